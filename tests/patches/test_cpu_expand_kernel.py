"""The expand-kernel patch: the rejection sampler's per-token temperature / top_p / top_k are
right on CPU, and tripwires on vLLM's CPU fallback and on how it gets registered."""

import inspect

import pytest
import torch

from vllm_nemotron_spec.patches import cpu_expand_kernel as patch

CU = torch.tensor([2, 5, 6], dtype=torch.int32)  # 2, 3 and 1 draft tokens


def _reference(values, cu, replace_from=0, replace_to=0):
    out, start = [], 0
    for v, end in zip(values.tolist(), cu.tolist()):
        out += [replace_to if v == replace_from else v] * (end - start)
        start = end
    return torch.tensor(out, dtype=values.dtype)


def _upstream_impl():
    from vllm import _custom_ops  # noqa: F401 - loads vllm._C, whose op the fallback calls
    from vllm.utils import cpu_triton_utils

    current = cpu_triton_utils._expand_kernel_impl
    return getattr(current, "__wrapped__", current)


@pytest.mark.parametrize(
    "values, replace_from, replace_to",
    [
        (torch.tensor([0.8, 0.0, 0.7]), 0, 1),  # temperature (greedy -> 1)
        (torch.tensor([0.95, 1.0, 0.5]), 0, 0),  # top_p
        (torch.tensor([5, 0, 7], dtype=torch.int32), 0, 0),  # top_k
        (torch.tensor([5, 0, 7], dtype=torch.int64), 0, 0),
    ],
    ids=["temperature", "top_p", "top_k_int32", "int64"],
)
def test_expands_in_the_output_dtype(values, replace_from, replace_to):
    out = torch.full((6,), -7, dtype=values.dtype)
    patch.expand_kernel_any_dtype(out, values, CU, replace_from, replace_to, MAX_NUM_TOKENS=128)
    torch.testing.assert_close(out, _reference(values, CU, replace_from, replace_to))


def test_upstream_cpu_fallback_still_loses_float_values():
    """Tripwire: when vLLM's CPU expand fallback writes float tensors right, the patch can go."""
    temperature = torch.tensor([0.8, 0.0, 0.7])
    out = torch.full((6,), -7.0)
    _upstream_impl()(out, temperature, CU, 0, 1)
    assert not torch.allclose(out, _reference(temperature, CU, 0, 1)), (
        "vLLM's cpu_triton_utils._expand_kernel_impl now expands float tensors correctly: remove "
        "vllm_nemotron_spec/patches/cpu_expand_kernel.py"
    )


def test_upstream_registers_the_patched_attribute_after_loading_plugins():
    """The patch swaps a module attribute, so it must be read when the override is registered,
    and plugins (which apply it) must load before that."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.worker import worker_base

    register = inspect.getsource(CpuPlatform.register_triton_kernel_overrides)
    assert (
        '"vllm.v1.sample.rejection_sampler.expand_kernel": (\n'
        "                    cpu_tl._expand_kernel_impl"
    ) in register, (
        "CpuPlatform.register_triton_kernel_overrides no longer maps expand_kernel to "
        "cpu_tl._expand_kernel_impl: re-check vllm_nemotron_spec/patches/cpu_expand_kernel.py"
    )
    init = inspect.getsource(worker_base)
    plugins = init.index("load_general_plugins()")
    overrides = init.index("current_platform.register_triton_kernel_overrides()")
    assert plugins < overrides, "vLLM registers the CPU kernel overrides before loading plugins"


def test_applied_once_and_the_sampler_uses_the_request_temperature():
    """With the patch applied before the overrides are registered (as in the engine),
    ``apply_sampling_constraints`` divides each draft-token row by its request's temperature."""
    from vllm.platforms import current_platform
    from vllm.utils import cpu_triton_utils
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.rejection_sampler import apply_sampling_constraints

    patch.install()
    patch.install()
    assert cpu_triton_utils._expand_kernel_impl is patch.expand_kernel_any_dtype
    current_platform.register_triton_kernel_overrides()

    temperature = torch.tensor([0.8, 0.0, 0.7])
    metadata = SamplingMetadata(
        temperature=temperature,
        all_greedy=False,
        all_random=False,
        top_p=None,
        top_k=None,
        generators={},
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(3),
        presence_penalties=torch.zeros(3),
        repetition_penalties=torch.ones(3),
        output_token_ids=[[], [], []],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
    )
    logits = torch.randn(6, 11, generator=torch.Generator().manual_seed(0))
    got = apply_sampling_constraints(logits.clone(), CU, metadata)
    per_row = _reference(temperature, CU, 0, 1)
    torch.testing.assert_close(got, logits / per_row[:, None])
