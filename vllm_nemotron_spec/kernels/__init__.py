"""Custom GPU kernels of the plugin (Triton). Their plain-torch reference is
:mod:`vllm_nemotron_spec.tiny.reference` (test side: no runtime module imports ``tiny/``).

* :mod:`vllm_nemotron_spec.kernels.markov`: DSpark's Markov step (base logits + NVFP4 low-rank
  bias, greedy argmax) fused into one pass over the vocabulary, and the greedy walk over the
  drafted positions.

Importing this package does not import Triton; the kernel modules do.
"""
