"""The machinery every benchmark scenario shares.

``cli`` (``run.py``'s subcommands), ``common`` (a run: --out, setup facts, budget, report,
bundle), ``environment`` (versions, the plugin's entry point, engine environments, log lines),
``budget``, ``arms`` (plain, vLLM alone and the plugin per draft; synthetic acceptance),
``models`` (the Lightning target and drafts), ``safetensors_io`` (writing big random checkpoints
fast), ``lanes`` (worker processes holding one offline engine each, and the schedule),
``offline`` (an in-process engine driven step by step: measurement windows), ``instrument``
(step counter and phase ranges in the model runner), ``trace`` (GPU-busy and attribution from
profiler traces), ``floors`` (memory floors), ``served`` (``vllm serve`` sets and their client),
``nvfp4_layers`` (the draft's NVFP4 linear layers built as vLLM builds them), ``report`` (the one
report writer), ``bundle`` (results and start-up caches through the GPU machine's ``$OUT``).
"""
