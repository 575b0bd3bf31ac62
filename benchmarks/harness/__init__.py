"""The machinery every benchmark scenario shares.

``common`` (a run: --out, setup facts, budget, report, bundle), ``environment`` (versions, the
plugin's entry point, engine environments, log lines), ``budget``, ``models`` (the Lightning target
and drafts, synthetic acceptance), ``safetensors_io`` (writing big random checkpoints fast),
``lanes`` (worker processes holding one offline engine each, and the schedule), ``offline`` (an
in-process engine driven step by step: measurement windows), ``instrument`` (step counter and
phase ranges in the model runner), ``trace`` (GPU-busy and attribution from profiler traces),
``floors`` (memory floors), ``served`` (``vllm serve`` runs and their client), ``report`` (the one
report writer), ``bundle`` (results and start-up caches through the GPU machine's ``$OUT``).
"""
