"""The seeded partial-prefill patch: discarded rows leave their CPU generator untouched and the
CUDA-only ``set_offset`` rewind finds nothing to rewind; tripwires on the upstream code."""

import inspect
import types

import numpy as np
import pytest
import torch

from vllm_nemotron_spec.patches import cpu_seeded_partial_prefill as patch

REWIND = "gen.set_offset(gen.get_offset() - 4)"


def _upstream_like_sample_tokens(self, grammar_output):
    """What vLLM's ``sample_tokens`` does with the generators: every row samples (a seeded row
    with its generator), then ``_bookkeeping_sync`` rewinds the discarded rows' generators."""
    generators = self.input_batch.generators
    sampled = {
        i: torch.rand(1, generator=generators[i]) if i in generators else torch.rand(1)
        for i in range(self.input_batch.num_reqs)
    }
    for i in np.nonzero(self.discard_request_mask.np[: self.input_batch.num_reqs])[0]:
        gen = self.input_batch.generators.get(int(i))
        if gen is not None:
            gen.set_offset(gen.get_offset() - 4)
    return sampled


def _runner(discard):
    gens = {i: torch.Generator().manual_seed(100 + i) for i in range(len(discard))}
    return types.SimpleNamespace(
        input_batch=types.SimpleNamespace(generators=gens, num_reqs=len(discard)),
        discard_request_mask=types.SimpleNamespace(np=np.array(discard + [False] * 3)),
        execute_model_state=object(),
    )


def test_cpu_generators_still_have_no_offset():
    """Tripwire: when a CPU torch.Generator gets an offset, upstream's rewind may just work."""
    with pytest.raises(RuntimeError, match="CPU Generator does not use offset"):
        torch.Generator().get_offset()


def test_without_the_patch_the_rewind_raises():
    runner = _runner([False, True])
    with pytest.raises(RuntimeError, match="does not use offset"):
        _upstream_like_sample_tokens(runner, None)


def test_discarded_rows_keep_their_generator_state():
    runner = _runner([False, True, False])
    generators = dict(runner.input_batch.generators)
    states = {i: g.get_state() for i, g in generators.items()}
    wrapped = patch._sample_tokens_sparing_discarded_generators(_upstream_like_sample_tokens)
    wrapped(runner, None)
    assert runner.input_batch.generators == generators  # all put back, same objects, same rows
    assert torch.equal(generators[1].get_state(), states[1])  # the discarded row: untouched
    assert not torch.equal(generators[0].get_state(), states[0])  # the others sampled
    assert not torch.equal(generators[2].get_state(), states[2])


def test_generators_are_put_back_when_sampling_raises():
    runner = _runner([True, False])
    generators = dict(runner.input_batch.generators)

    def boom(self, grammar_output):
        assert 0 not in self.input_batch.generators
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        patch._sample_tokens_sparing_discarded_generators(boom)(runner, None)
    assert runner.input_batch.generators == generators


def test_upstream_rewinds_in_bookkeeping_called_from_sample_tokens():
    """Tripwire: the patch relies on the rewind living in ``_bookkeeping_sync``, reached from
    ``sample_tokens`` after ``_sample``, keyed on ``discard_request_mask`` and
    ``input_batch.generators``."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    bookkeeping = inspect.getsource(GPUModelRunner._bookkeeping_sync)
    sample_tokens = inspect.getsource(GPUModelRunner.sample_tokens)
    message = (
        "vLLM's generator rewind for discarded rows changed: re-check (or remove) "
        "vllm_nemotron_spec/patches/cpu_seeded_partial_prefill.py"
    )
    assert REWIND in bookkeeping, message
    assert "self.discard_request_mask.np[:num_reqs]" in bookkeeping, message
    assert "self.input_batch.generators.get(int(i))" in bookkeeping, message
    assert sample_tokens.index("self._sample(") < sample_tokens.index("self._bookkeeping_sync("), (
        message
    )
    assert (
        sum(
            REWIND in inspect.getsource(f)
            for f in vars(GPUModelRunner).values()
            if inspect.isfunction(f)
        )
        == 1
    ), message


def test_applied_once_on_the_cpu_runner():
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    patch.install()
    patch.install()
    method = CPUModelRunner.sample_tokens
    assert method._nemotron_spec_patch
    assert method.__wrapped__ is GPUModelRunner.sample_tokens
