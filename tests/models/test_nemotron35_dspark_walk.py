"""Which Markov walk a DSpark step runs on vLLM 0.33's V2 runner: the plugin's fused greedy walk
only where it computes exactly what vLLM's loop would; every other case names its reason (the
fused kernel itself is tested on CUDA in tests/kernels)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from vllm_nemotron_spec.models import nemotron35_dspark as dspark

PACKED = {
    "weight": torch.zeros(1),
    "weight_scale": torch.zeros(1),
    "weight_scale_2": torch.zeros(1),
}


@pytest.fixture(autouse=True)
def anchor_patch_installed(monkeypatch):
    """As on vLLM 0.33.0 (the patch is checked against 0.33.0 only; the tests run vLLM 0.32)."""
    monkeypatch.setattr(dspark.v2_dspark_anchor_ids, "installed", lambda: True)


def _declined(speculator, hidden, packed=PACKED, tp=1, capability=(9, 0)):
    """What the hook decides for a model loaded on a GPU of ``capability`` under TP ``tp``."""
    off = dspark.fused_walk_switch_reason(tp, capability)
    model = SimpleNamespace(_packed_markov_w2=packed, tensor_parallel_size=tp, fused_walk_off=off)
    return dspark.Nemotron35DSparkForCausalLM.fused_walk_declined(model, speculator, hidden)


def _greedy_speculator(**overrides):
    fields = dict(
        draft_logits=None, _draft_topk=None, use_confidence_head=False, acceptance_estimator=None
    )
    fields.update(overrides)
    return SimpleNamespace(**fields)


class _CudaLike:
    """A stand-in for CUDA hidden states (only ``is_cuda`` and ``device`` are read)."""

    is_cuda = True
    device = SimpleNamespace(type="cuda")


def test_fused_walk_runs_for_greedy_drafts_on_cuda(monkeypatch):
    monkeypatch.delenv(dspark.FUSED_MARKOV_ENV, raising=False)  # the default
    assert _declined(_greedy_speculator(), _CudaLike()) is None
    monkeypatch.setenv(dspark.FUSED_MARKOV_ENV, "1")
    assert _declined(_greedy_speculator(), _CudaLike()) is None


@pytest.mark.parametrize(
    "override,reason",
    [
        ({"draft_logits": torch.zeros(1)}, "probabilistic"),
        ({"_draft_topk": 4}, "top-k"),
        ({"use_confidence_head": True}, "confidence"),
        ({"acceptance_estimator": object()}, "acceptance estimator"),
    ],
)
def test_cases_the_fused_walk_does_not_compute_go_to_vllms_loop(override, reason, monkeypatch):
    monkeypatch.setenv(dspark.FUSED_MARKOV_ENV, "1")
    assert reason in _declined(_greedy_speculator(**override), _CudaLike())


def test_cpu_env_switch_and_missing_packed_weights_are_named(monkeypatch):
    monkeypatch.setenv(dspark.FUSED_MARKOV_ENV, "1")
    assert "CUDA only" in _declined(_greedy_speculator(), torch.zeros(2))
    assert "weight_scale_2" in _declined(
        _greedy_speculator(), _CudaLike(), packed={"weight": 1, "weight_scale": 1}
    )
    monkeypatch.setenv(dspark.FUSED_MARKOV_ENV, "0")
    assert _declined(_greedy_speculator(), _CudaLike()) == f"{dspark.FUSED_MARKOV_ENV}=0"


def test_tensor_parallel_engines_run_vllms_loop(monkeypatch):
    for setting in (None, "1"):
        if setting is None:
            monkeypatch.delenv(dspark.FUSED_MARKOV_ENV, raising=False)
        else:
            monkeypatch.setenv(dspark.FUSED_MARKOV_ENV, setting)
        assert "tensor_parallel_size 2" in _declined(_greedy_speculator(), _CudaLike(), tp=2)


@pytest.mark.parametrize(
    "capability,named", [((8, 0), "8.0"), ((10, 0), "10.0"), ((12, 0), "12.0"), (("ROCm", 9, 4), "ROCm 9.4")]
)  # fmt: skip
def test_gpus_it_was_not_measured_on_run_vllms_loop_unless_asked(capability, named, monkeypatch):
    """Faster than vLLM's loop was measured on NVIDIA Hopper (H200) only; an AMD MI300 also
    reports major version 9 and must not pass for one."""
    monkeypatch.delenv(dspark.FUSED_MARKOV_ENV, raising=False)
    reason = _declined(_greedy_speculator(), _CudaLike(), capability=capability)
    assert f"compute capability {named}:" in reason
    assert f"{dspark.FUSED_MARKOV_ENV}=1" in reason  # says how to turn it on
    assert _declined(_greedy_speculator(), _CudaLike(), capability=(9, 0)) is None
    monkeypatch.setenv(dspark.FUSED_MARKOV_ENV, "1")
    assert _declined(_greedy_speculator(), _CudaLike(), capability=capability) is None


@pytest.mark.parametrize(
    "setting,tp,capability,hip,off",
    [(None, 1, (10, 0), None, "compute capability 10.0"), (None, 1, (9, 4), "6.4", "ROCm 9.4"),
     (None, 2, (9, 0), None, "tensor_parallel_size 2"), ("0", 1, (9, 0), None, "=0")],
)  # fmt: skip
def test_load_keeps_no_copies_when_the_walk_is_off(setting, tp, capability, hip, off, monkeypatch):
    """load_weights decides once, on the GPU the weights are on, and keeps the packed markov_w2
    and the by-phase markov_w1 (164 MiB at the real shape) only when the walk can run."""
    if setting is None:
        monkeypatch.delenv(dspark.FUSED_MARKOV_ENV, raising=False)
    else:
        monkeypatch.setenv(dspark.FUSED_MARKOV_ENV, setting)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(dspark, "checked_weights", lambda spec, config, weights: weights)
    monkeypatch.setattr(
        dspark.Qwen3DSparkForCausalLM, "load_weights", lambda self, w: {n for n, _ in w}
    )
    model = dspark.Nemotron35DSparkForCausalLM.__new__(dspark.Nemotron35DSparkForCausalLM)
    torch.nn.Module.__init__(model)
    w1 = SimpleNamespace(device=torch.device("cuda"))  # stands for an embedding on a GPU
    vars(model).update(
        tensor_parallel_size=tp,
        fused_walk_off="weights not loaded yet",
        _packed_markov_w2={},
        _markov_w1_by_phase=None,
        draft_spec=SimpleNamespace(is_quantized=lambda name: True),
        draft_model_config=None,
        model=SimpleNamespace(markov_head=SimpleNamespace(markov_w1=SimpleNamespace(weight=w1))),
    )
    weights = [("markov_head.markov_w2.weight", torch.zeros(4, 2, dtype=torch.uint8))]
    assert model.load_weights(weights) == {"markov_head.markov_w2.weight"}
    assert off in model.fused_walk_off
    assert model._packed_markov_w2 == {} and model._markov_w1_by_phase is None


def test_without_the_anchor_patch_vllms_loop_runs(monkeypatch):
    monkeypatch.setenv(dspark.FUSED_MARKOV_ENV, "1")
    monkeypatch.setattr(dspark.v2_dspark_anchor_ids, "installed", lambda: False)
    assert "patch v2_dspark_anchor_ids" in _declined(_greedy_speculator(), _CudaLike())


def test_the_choice_is_logged_once_per_reason(caplog, monkeypatch):
    monkeypatch.setattr(dspark, "_WALK_CHOICES_LOGGED", set())
    with caplog.at_level(logging.INFO, logger=dspark.logger.name):
        for _ in range(3):
            dspark._log_walk_choice_once(None)
            dspark._log_walk_choice_once("top-k drafting")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "nemotron-spec: DSpark Markov walk runs fused (kernels/markov.py, greedy)",
        "nemotron-spec: DSpark Markov walk runs vLLM's loop: top-k drafting",
    ]
    assert dspark.logger.name.startswith("vllm."), "only vLLM's logger tree is printed by vLLM"


@pytest.mark.parametrize("rank,phases", [(512, 8), (64, 4), (32, 2)])
def test_markov_w1_is_kept_grouped_by_the_kernels_phases(rank, phases):
    """The fused walk's copy of markov_w1: column ``p * r/phases + j`` is column ``phases * j + p``
    (fp16x2 decodes 8 codes a 32-bit word at the real rank; smaller heads use other variants)."""
    from vllm_nemotron_spec.kernels import markov as mk

    w1 = torch.randn(10, rank)
    by_phase = dspark.markov_w1_by_phase(w1)
    assert mk.default_config(1, rank).phases == mk.default_config(16, rank).phases == phases
    width = rank // phases
    for p in range(phases):
        assert torch.equal(by_phase[:, p * width : (p + 1) * width], w1[:, p::phases])


@pytest.mark.parametrize("kept", [True, False])
def test_the_fused_walk_reads_markov_w1_by_phase_when_kept(kept, monkeypatch):
    """sample_sequential hands the kernel the by-phase copy (``w1_permuted=True``) when load_weights
    kept one, else the raw embedding."""
    from vllm_nemotron_spec.kernels import markov as mk

    monkeypatch.setenv(dspark.FUSED_MARKOV_ENV, "1")
    monkeypatch.setattr(dspark.Nemotron35DSparkForCausalLM, "fused_walk_declined", lambda *a: None)
    monkeypatch.setattr(dspark.v2_dspark_anchor_ids, "anchor_token_ids", lambda s, n: "anchors")
    seen = {}

    def walk(base, anchors, w1, *packed, bias_scale, w1_permuted):
        seen.update(w1=w1, w1_permuted=w1_permuted, anchors=anchors, base=base.shape)
        return torch.zeros(base.shape[:2], dtype=torch.int64)

    monkeypatch.setattr(mk, "markov_walk_greedy", walk)
    raw = torch.randn(20, 512)
    model = dspark.Nemotron35DSparkForCausalLM.__new__(dspark.Nemotron35DSparkForCausalLM)
    torch.nn.Module.__init__(model)
    vars(model).update(
        _packed_markov_w2=PACKED,
        _markov_w1_by_phase=dspark.markov_w1_by_phase(raw) if kept else None,
        model=SimpleNamespace(markov_head=SimpleNamespace(markov_w1=SimpleNamespace(weight=raw))),
        logits_processor=SimpleNamespace(scale=1.0),
        compute_draft_logits=lambda h: torch.zeros(h.shape[0], 20),
        map_draft_to_target=lambda ids: ids,
    )
    speculator = SimpleNamespace(
        num_speculative_steps=3,
        sample_indices=torch.arange(6),
        draft_tokens=torch.full((2, 3), -1),
    )
    assert model.sample_sequential(speculator, 2, torch.zeros(6, 8)) is True
    assert seen["w1_permuted"] is kept
    assert seen["w1"] is (model._markov_w1_by_phase if kept else raw)
    assert seen["base"] == (2, 3, 20) and seen["anchors"] == "anchors"
    assert torch.equal(speculator.draft_tokens, torch.zeros(2, 3, dtype=torch.int64))
