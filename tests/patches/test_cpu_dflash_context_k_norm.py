"""The DFlash context k_norm patch: per-layer weights, and a tripwire on vLLM's CPU rms_norm."""

import types

import torch

from vllm_nemotron_spec.patches import cpu_dflash_context_k_norm as patch


def _reference(all_k, weight, eps):
    out = []
    for i in range(all_k.shape[0]):
        k = all_k[i]
        out.append(k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + eps) * weight[i])
    return torch.stack(out)


def test_each_layer_gets_its_own_k_norm():
    torch.manual_seed(0)
    all_k = torch.randn(3, 5, 2, 32)
    fake_model = types.SimpleNamespace(_k_norm_weights=torch.randn(3, 32), _rms_norm_eps=1e-6)
    got = patch.normalize_context_k_per_layer(fake_model, all_k)
    torch.testing.assert_close(got, _reference(all_k, fake_model._k_norm_weights, 1e-6))


def test_cpu_rms_norm_still_ignores_rows_beyond_the_first():
    """Tripwire: when vLLM's CPU rms_norm honours a 2-D weight, the patch can go."""
    from vllm import _custom_ops as ops

    torch.manual_seed(0)
    all_k = torch.randn(3, 5, 2, 32)
    weight = torch.randn(3, 32)
    out = torch.empty_like(all_k)
    ops.rms_norm(out, all_k, weight, 1e-6)
    per_layer = _reference(all_k, weight, 1e-6)
    assert not torch.allclose(out, per_layer, atol=1e-4), (
        "vLLM's CPU rms_norm now applies a 2-D weight per row group: remove "
        "vllm_nemotron_spec/patches/cpu_dflash_context_k_norm.py"
    )


def test_applied_once():
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model

    patch.install()
    patch.install()
    assert DFlashQwen3Model._normalize_context_k is patch.normalize_context_k_per_layer
