"""The V1-runner proposer patch: what it changes, for whom, and tripwires on the vLLM code it
relies on (vLLM 0.32 here; the same symbols exist in 0.33's V1 runner)."""

from __future__ import annotations

import inspect
import types

import pytest
import torch

from vllm_nemotron_spec.patches import v1_nemotron35_proposers as patch


def _config(method, archs):
    hf = types.SimpleNamespace(architectures=archs)
    spec = types.SimpleNamespace(
        method=method, draft_model_config=types.SimpleNamespace(hf_config=hf)
    )
    return types.SimpleNamespace(speculative_config=spec)


@pytest.mark.parametrize(
    "method, archs, expected",
    [
        ("dspark", ["DSparkNemotron35DraftModel"], "DSparkNemotron35DraftModel"),
        ("dflash", ["DFlashNemotron35DraftModel"], "DFlashNemotron35DraftModel"),
        ("dspark", ["Qwen3DSparkModel"], None),  # not routed: vLLM's own path
        ("dflash", ["DFlashDraftModel"], None),
        ("eagle3", ["DFlashNemotron35DraftModel"], None),
    ],
)
def test_only_routed_drafts_are_taken(method, archs, expected):
    from vllm_nemotron_spec.target_hook import routed_architecture

    assert routed_architecture(_config(method, archs).speculative_config) == expected
    assert routed_architecture(None) is None


def test_v1_rejection_dropped_only_for_our_dspark_draft():
    def original(self):
        return ["dspark speculative decoding", "something else"]

    wrapped = patch._unsupported_features(original)
    assert wrapped(_config("dspark", ["DSparkNemotron35DraftModel"])) == ["something else"]
    assert wrapped(_config("dspark", ["Qwen3DSparkModel"])) == original(None)


def test_applied_once():
    from vllm.config.vllm import VllmConfig
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    patch.install()
    first = GPUModelRunner.__init__
    patch.install()
    assert GPUModelRunner.__init__ is first
    assert getattr(GPUModelRunner._input_fits_in_drafter, "_nemotron_spec_patch", False)
    assert getattr(
        VllmConfig._get_v1_model_runner_unsupported_features, "_nemotron_spec_patch", False
    )


def _unwrapped(func):
    return getattr(func, "__wrapped__", func)


def test_tripwire_v1_still_rejects_dspark():
    """When vLLM's V1 runner accepts DSpark itself, this patch's first wrapper can go."""
    from vllm.config.vllm import VllmConfig

    source = inspect.getsource(_unwrapped(VllmConfig._get_v1_model_runner_unsupported_features))
    assert f'"{patch.V1_DSPARK_REJECTION}"' in source


def test_tripwire_vllm_dflash_proposer_contract():
    """What the proposers build on: DFlashProposer asserts method "dflash" (hence the DSpark
    proposer's construction as dflash), the runner creates the drafter in __init__ and hands the
    drafter the metadata of ``drafter.kv_cache_gid``, the V1 proposer asserts a single KV-cache
    group, the DFlash input kernel takes query rows per request, and the context K/V insert takes
    per-layer slot mappings."""
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model
    from vllm.v1.spec_decode import llm_base_proposer
    from vllm.v1.spec_decode.dflash import DFlashProposer
    from vllm.v1.spec_decode.utils import _copy_and_expand_dflash_inputs
    from vllm.v1.worker import gpu_model_runner

    assert 'method == "dflash"' in inspect.getsource(DFlashProposer.__init__)
    runner_init = inspect.getsource(_unwrapped(gpu_model_runner.GPUModelRunner.__init__))
    assert "self.drafter = DFlashProposer(" in runner_init
    assert "self.drafter.kv_cache_gid == kv_cache_gid" in inspect.getsource(gpu_model_runner)
    assert "All drafting layers should belong to the same kv cache group" in inspect.getsource(
        llm_base_proposer.SpecDecodeBaseProposer.validate_same_kv_cache_group
    )
    params = inspect.signature(
        getattr(_copy_and_expand_dflash_inputs, "func", _copy_and_expand_dflash_inputs)
    ).parameters
    if not params:  # the dispatcher object: read the wrapped function's source instead
        params = inspect.getsource(_copy_and_expand_dflash_inputs)
    assert "num_query_per_req" in params
    assert "list[torch.Tensor | None]" in inspect.getsource(
        DFlashQwen3Model.precompute_and_store_context_kv
    )
    fits = inspect.getsource(_unwrapped(gpu_model_runner.GPUModelRunner._input_fits_in_drafter))
    assert "use_dflash()" in fits


def test_slots_from_block_table_matches_vllm_slot_rule():
    from vllm_nemotron_spec.proposers.dflash import slots_from_block_table

    table = torch.tensor([[5, 9, 2], [7, 1, 3]], dtype=torch.int32)
    req = torch.tensor([0, 0, 1, 1, 1])
    pos = torch.tensor([0, 17, 3, 16, 99])  # 99 // 16 = 6: clamped to the last column
    got = slots_from_block_table(table, req, pos, 16)
    assert got.tolist() == [5 * 16 + 0, 9 * 16 + 1, 7 * 16 + 3, 1 * 16 + 0, 3 * 16 + 3]


def test_every_vllm_method_the_proposers_override_is_a_checked_target():
    """The plugin's proposers extend vLLM's: each base method they override is pinned by its
    fingerprint, so a changed base refuses instead of running half-old code."""
    from vllm_nemotron_spec.proposers.dflash import Nemotron35DFlashProposer
    from vllm_nemotron_spec.proposers.dspark import Nemotron35DSparkProposer

    listed = {t.qualname for t in patch.TARGETS}
    bases = [c for c in Nemotron35DFlashProposer.__mro__[1:] if c.__module__.startswith("vllm.")]
    for cls in (Nemotron35DFlashProposer, Nemotron35DSparkProposer):
        for name, value in vars(cls).items():
            if (
                not (callable(value) or isinstance(value, property))
                or name.startswith("__")
                and name != "__init__"
            ):
                continue
            owner = next((b for b in bases if name in vars(b)), None)
            if owner is not None:
                assert f"{owner.__name__}.{name}" in listed, f"{owner.__name__}.{name}"
