"""W4A16 NVFP4 (ModelOpt) for the drafts: ``format`` is the reference on-disk format (pure torch),
``config`` the quantization config registered with vLLM and its linear methods.

Import-light on purpose: importing this package imports neither torch nor vLLM; import a submodule.
"""
