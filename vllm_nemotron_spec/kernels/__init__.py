"""Custom GPU kernels of the plugin (Triton), each with a plain-torch reference.

* :mod:`vllm_nemotron_spec.kernels.markov`: DSpark's Markov step (base logits + NVFP4 low-rank
  bias, greedy argmax) fused into one pass over the vocabulary, and the greedy walk over the
  drafted positions.

Importing this package does not import Triton; the kernel modules do.
"""
