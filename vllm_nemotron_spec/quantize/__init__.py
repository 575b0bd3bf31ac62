"""``vllm-nemotron-spec quantize``: a BF16 DFlash / DSpark draft -> a W4A16 NVFP4 draft in the
official Nemotron 3.5 layout (:mod:`vllm_nemotron_spec.checkpoint.layout` says which modules).

Two engines pack the weights: ``builtin`` (:mod:`.builtin`, the project's reference packer) and
``modelopt`` (:mod:`.modelopt_engine`, nvidia-modelopt's own export, usually run in an environment
of its own); :mod:`.core` reads, checks and writes for both. Importing this package imports
neither torch nor vLLM.
"""

ENGINES = ("builtin", "modelopt")
