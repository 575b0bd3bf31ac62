"""Attention-backend choice for a NemotronH target and its draft.

:func:`resolve_attention_backends` decides from plain facts (device capability, speculative method,
the draft's attention shape, every explicit user choice); :func:`apply_attention_choice` applies
it to a ``VllmConfig`` from the NemotronH config hook, before any worker selects a backend (the
draft's backend is read later from ``speculative_config.attention_backend``). The vLLM behaviour
the rules rest on is listed in docs/attention.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

# AttentionBackendEnum member names (vllm/v1/attention/backends/registry.py).
FLASHINFER = "FLASHINFER"
FLASH_ATTN = "FLASH_ATTN"

# The KV-cache dtypes the pinned choices were checked against (the Nemotron 3.5 checkpoints run BF16
# or FP8 E4M3 KV caches; FlashInfer/TRT-LLM and FA4 on SM10x declare all of them). Anything else
# (fp8_e5m2, nvfp4, turboquant_*, ...) is left to vLLM's selector, which falls back on its own.
_CHECKED_KV_CACHE_DTYPES = frozenset({"auto", "bfloat16", "float16", "fp8", "fp8_e4m3"})

# Speculative methods whose drafter has no attention layer of its own.
_METHODS_WITHOUT_DRAFT_ATTENTION = frozenset(
    {"ngram", "ngram_gpu", "suffix", "medusa", "mlp_speculator"}
)
# Methods whose draft attention this module decides (the Nemotron 3.5 drafts).
_BLOCK_DRAFT_METHODS = frozenset({"dflash", "dspark"})

# A logger under vLLM's "vllm" logger: only that one has a handler in vLLM's logging configuration
# (vllm/logger.py DEFAULT_LOGGING_CONFIG), so an INFO line elsewhere would not be printed.
_LOGGER_NAME = "vllm.nemotron_spec.attention"


@dataclass(frozen=True)
class AttentionInputs:
    """Everything the choice depends on. User choices: None / empty = not chosen by the user."""

    capability: tuple[int, int] | None
    """CUDA compute capability (major, minor); None on CPU or any non-CUDA platform."""
    method: str | None = None
    """``speculative_config.method`` (None = no speculative decoding)."""
    draft_causal: bool | None = True
    """None: the draft's config could not be read (see ``draft_problem``); the draft is left alone."""
    draft_has_sinks: bool = False
    draft_sliding_window: int | None = None
    draft_problem: str | None = None
    """Why the draft's config could not be read (the first :class:`DraftSpecError` problem)."""
    kv_cache_dtype: str = "auto"
    """The target's resolved ``cache_config.cache_dtype``."""
    draft_kv_cache_dtype: str | None = None
    """``speculative_config.kv_cache_dtype`` (None = the draft uses the target's)."""
    batch_invariant: bool = False
    """``VLLM_BATCH_INVARIANT`` (turns TRT-LLM attention off; FlashInfer is not batch invariant)."""
    user_backend: str | None = None
    """``--attention-backend`` / ``attention_config.backend``."""
    user_backend_per_kind: tuple[str, ...] = ()
    """Keys of ``attention_config.backend_per_kind``."""
    user_flash_attn_version: int | None = None
    user_use_trtllm_attention: bool | None = None
    user_draft_backend: str | None = None
    """``speculative_config.attention_backend``."""
    trtllm_kernels: bool = True
    """FlashInfer's TRT-LLM / XQA kernels can load: vLLM's ``has_nvidia_artifactory``
    (``flashinfer-cubin`` installed, or NVIDIA's artifactory reachable to download them). Without
    them FlashInfer has no TRT-LLM attention (SM10x), no attention sinks, and no full CUDA graph
    for multi-token steps on SM90 / SM12x."""

    def __post_init__(self) -> None:
        cap = self.capability
        if cap is not None and not (
            isinstance(cap, tuple) and len(cap) == 2 and all(isinstance(v, int) for v in cap)
        ):
            raise ValueError(
                f"AttentionInputs.capability: expected None or a (major, minor) tuple of ints, "
                f"found {cap!r}"
            )


@dataclass(frozen=True)
class AttentionDecision:
    """What to set; None leaves vLLM's own value (default or the user's)."""

    target_backend: str | None = None
    """``attention_config.backend`` (an AttentionBackendEnum name)."""
    use_trtllm_attention: bool | None = None
    """``attention_config.use_trtllm_attention`` (shared by target and draft)."""
    draft_backend: str | None = None
    """``speculative_config.attention_backend`` (an AttentionBackendEnum name)."""
    reason: str = ""

    @property
    def changes_nothing(self) -> bool:
        return (
            self.target_backend is None
            and self.use_trtllm_attention is None
            and self.draft_backend is None
        )


def resolve_attention_backends(inputs: AttentionInputs) -> AttentionDecision:
    """Decide the target's and the draft's attention backend (pure: no vLLM, no device access).

    Rules (no explicit user choice):
    - SM10x (B200/GB200 SM100, B300/GB300 SM103): target FLASHINFER with TRT-LLM kernels forced
      (``use_trtllm_attention=True``); a causal DFlash/DSpark draft (sinks, sliding window) FLASHINFER
      as well (TRT-LLM is FlashInfer's only sink path there); a non-causal draft FLASH_ATTN (FA4:
      non-causal with full CUDA graphs; TRT-LLM is causal only, FlashInfer non-causal has no full
      graph). EAGLE/MTP drafts follow vLLM (the target's settings reach them).
    - SM90, SM12x, any other CUDA device: vLLM's defaults (nothing measured says otherwise).
    - CPU / non-CUDA: nothing.
    Explicit choices are never overridden: an explicit target choice leaves the whole target side
    (backend and ``use_trtllm_attention``) alone; an explicit draft backend leaves the draft alone.
    """
    if inputs.capability is None:
        return AttentionDecision(reason="no CUDA device: vLLM's defaults, nothing changed")
    major, minor = inputs.capability
    where = f"SM{major}{minor}"
    target_backend, use_trtllm, target_why = _decide_target(inputs, major)
    draft_backend, draft_why = _decide_draft(inputs, major)
    return AttentionDecision(
        target_backend=target_backend,
        use_trtllm_attention=use_trtllm,
        draft_backend=draft_backend,
        reason=f"{where}: target {target_why}; draft {draft_why}",
    )


def _explicit_target_choices(inputs: AttentionInputs) -> list[str]:
    chosen = []
    if inputs.user_backend is not None:
        chosen.append(f"attention_config.backend={inputs.user_backend}")
    if inputs.user_backend_per_kind:
        chosen.append(f"attention_config.backend_per_kind={list(inputs.user_backend_per_kind)}")
    if inputs.user_flash_attn_version is not None:
        chosen.append(f"attention_config.flash_attn_version={inputs.user_flash_attn_version}")
    if inputs.user_use_trtllm_attention is not None:
        chosen.append(f"use_trtllm_attention={inputs.user_use_trtllm_attention}")
    return chosen


def _vllm_default(major: int) -> str:
    if major == 9:
        return "vLLM's default (FLASH_ATTN, FA3 on Hopper; nothing measured says otherwise)"
    if major == 12:
        return (
            "vLLM's default (FLASH_ATTN first on SM12x; the SGLang reference uses Triton for the "
            "target here, not measured)"
        )
    return "vLLM's default"


def _kv_dtype_unchecked(kv_cache_dtype: str) -> str | None:
    if kv_cache_dtype in _CHECKED_KV_CACHE_DTYPES:
        return None
    return f"vLLM's default (kv-cache dtype {kv_cache_dtype!r} is outside the checked dtypes)"


def _decide_target(inputs: AttentionInputs, major: int) -> tuple[str | None, bool | None, str]:
    explicit = _explicit_target_choices(inputs)
    if explicit:
        return None, None, f"kept as the user chose ({', '.join(explicit)})"
    if major != 10:
        return None, None, _vllm_default(major)
    if inputs.batch_invariant:
        return None, None, "vLLM's default (VLLM_BATCH_INVARIANT turns TRT-LLM attention off)"
    if not inputs.trtllm_kernels:
        return None, None, f"vLLM's default ({_NO_TRTLLM_KERNELS})"
    unchecked = _kv_dtype_unchecked(inputs.kv_cache_dtype)
    if unchecked:
        return None, None, unchecked
    return FLASHINFER, True, "FLASHINFER with TRT-LLM kernels (use_trtllm_attention=True)"


def _decide_draft(inputs: AttentionInputs, major: int) -> tuple[str | None, str]:
    method = inputs.method
    if method is None:
        return None, "none (no speculative decoding)"
    if method in _METHODS_WITHOUT_DRAFT_ATTENTION:
        return None, f"none ({method} has no draft attention)"
    shape = _draft_shape(inputs)
    if inputs.user_draft_backend is not None:
        return None, (
            f"{shape} kept as the user chose (speculative_config.attention_backend="
            f"{inputs.user_draft_backend}){_explicit_draft_caveat(inputs, major)}"
        )
    if method not in _BLOCK_DRAFT_METHODS:
        return None, (
            f"{shape} follows vLLM (V2 EAGLE/MTP drafts take the target's attention_config, "
            "V1 drafts auto-select)"
        )
    if inputs.draft_causal is None:
        return None, f"{shape} left to vLLM (the draft's config did not parse)"
    if major != 10:
        return None, f"{shape} {_vllm_default(major)}"
    if inputs.batch_invariant:
        return None, f"{shape} vLLM's default (VLLM_BATCH_INVARIANT)"
    unchecked = _kv_dtype_unchecked(inputs.draft_kv_cache_dtype or inputs.kv_cache_dtype)
    if unchecked:
        return None, f"{shape} {unchecked}"
    if not inputs.draft_causal:
        return FLASH_ATTN, (
            f"{shape} FLASH_ATTN (FA4: non-causal with full CUDA graphs; TRT-LLM kernels are "
            "causal only and FlashInfer's non-causal path runs without full CUDA graphs)"
        )
    if not inputs.trtllm_kernels:
        # The pin below needs TRT-LLM (a sink draft: FlashInfer's only sink path on SM10x); a
        # pinned backend that cannot serve the layer fails start-up, vLLM's own choice does not.
        return None, f"{shape} vLLM's choice among backends that serve it ({_NO_TRTLLM_KERNELS})"
    if inputs.user_use_trtllm_attention is False:
        return None, (
            f"{shape} vLLM's choice among backends that serve it (use_trtllm_attention=False "
            "rules out FlashInfer's TRT-LLM path"
            + (", its only sink path on SM10x)" if inputs.draft_has_sinks else ")")
        )
    return FLASHINFER, (
        f"{shape} FLASHINFER with TRT-LLM kernels"
        + (" (FlashInfer's only sink path on SM10x)" if inputs.draft_has_sinks else "")
    )


def _draft_shape(inputs: AttentionInputs) -> str:
    if inputs.method not in _BLOCK_DRAFT_METHODS:
        return f"({inputs.method})"
    if inputs.draft_causal is None:
        return f"({inputs.method}: {inputs.draft_problem or 'config not understood'})"
    parts = [inputs.method, "causal" if inputs.draft_causal else "non-causal"]
    if inputs.draft_has_sinks:
        parts.append("sinks")
    if inputs.draft_sliding_window is not None:
        parts.append(f"window {inputs.draft_sliding_window}")
    return f"({', '.join(parts)})"


_NO_CUBINS = "flashinfer-cubin is not installed and NVIDIA's artifactory is unreachable"
_NO_TRTLLM_KERNELS = f"FlashInfer's TRT-LLM kernels cannot load: {_NO_CUBINS}"

# What a FlashInfer draft without full CUDA graphs costs: vLLM lowers the whole engine's
# cudagraph_mode to PIECEWISE (the target's graphs too). Measured on an H200 with the recipe's
# FlashInfer options (its Mamba backend as well; DFlash 5, Lightning widths): ~4x fewer tokens/s
# at concurrency 1, ~1.6x fewer at 16 (benchmarks/RESULTS.md).
_PIECEWISE_COST = (
    "so vLLM captures piecewise CUDA graphs only, for the target too (an H200 with the recipe's "
    "FlashInfer options served ~4x fewer tokens/s at concurrency 1)"
)


def _explicit_draft_caveat(inputs: AttentionInputs, major: int) -> str:
    if inputs.user_draft_backend != FLASHINFER:
        return ""
    if inputs.draft_causal is False and major == 10:
        return (
            f"; note: a non-causal FlashInfer draft has no full CUDA graph on SM10x, "
            f"{_PIECEWISE_COST}"
        )
    if major in (9, 12) and not _xqa_decode_available(inputs):
        # FlashInferMetadataBuilder.get_cudagraph_support: on SM90/SM12x a FlashInfer layer gets
        # full graphs for multi-token (draft, verify) batches only through the XQA decode kernels.
        why = (
            "use_trtllm_attention=False"
            if inputs.user_use_trtllm_attention is False
            else "VLLM_BATCH_INVARIANT"
            if inputs.batch_invariant
            else _NO_TRTLLM_KERNELS
        )
        return (
            f"; note: without FlashInfer's XQA kernels ({why}) a FlashInfer draft has no full "
            f"CUDA graph on {'SM90' if major == 9 else 'SM12x'}, {_PIECEWISE_COST}"
        )
    if inputs.draft_has_sinks and inputs.user_use_trtllm_attention is False:
        return "; note: FlashInfer serves sinks only with TRT-LLM kernels, which are turned off"
    if inputs.draft_has_sinks and not inputs.trtllm_kernels:
        return (
            "; note: FlashInfer serves sinks only with TRT-LLM kernels, which cannot load here "
            f"({_NO_CUBINS}): vLLM will refuse it"
        )
    return ""


def _xqa_decode_available(inputs: AttentionInputs) -> bool:
    """Whether vLLM can use FlashInfer's XQA decode kernels (SM90 / SM12x) for the draft."""
    return (
        inputs.trtllm_kernels
        and inputs.user_use_trtllm_attention is not False
        and not inputs.batch_invariant
    )


# ----------------------------------------------------------------------------------------------
# Applying the decision to a VllmConfig (the NemotronH config hook)
# ----------------------------------------------------------------------------------------------


def _cuda_capability() -> tuple[int, int] | None:
    """The CUDA compute capability of device 0, None on CPU / ROCm / other platforms."""
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return None
    capability = current_platform.get_device_capability()
    if capability is None:
        return None
    return (int(capability.major), int(capability.minor))


def _draft_attention_facts(hf_config: Any) -> tuple[bool, bool, int | None] | str:
    """(causal, has_sinks, sliding_window) of a DFlash/DSpark draft from its :class:`DraftSpec`,
    or the first problem DraftSpec found (then the draft is left to vLLM: reporting a broken
    checkpoint is the draft model's job, not this hook's)."""
    from vllm_nemotron_spec.checkpoint.spec import DraftSpec, DraftSpecError

    try:
        spec = DraftSpec.from_config(hf_config.to_dict())
    except DraftSpecError as err:
        return err.problems[0]
    return spec.causal, spec.has_attention_sinks, spec.sliding_window


def _enum_name(value: Any) -> str | None:
    return None if value is None else getattr(value, "name", str(value))


def attention_inputs_from_config(vllm_config: Any) -> AttentionInputs:
    """Read the facts and the explicit choices from a VllmConfig (before any backend is chosen)."""
    import vllm.envs as envs

    attention = vllm_config.attention_config
    spec = vllm_config.speculative_config
    method = draft_backend = draft_kv = draft_problem = None
    causal: bool | None = True
    sinks, window = False, None
    if spec is not None:
        method = spec.method
        draft_backend = _enum_name(spec.attention_backend)
        draft_kv = spec.kv_cache_dtype
        draft_model_config = getattr(spec, "draft_model_config", None)
        if method in _BLOCK_DRAFT_METHODS and draft_model_config is not None:
            facts = _draft_attention_facts(draft_model_config.hf_config)
            if isinstance(facts, str):
                causal, draft_problem = None, facts
            else:
                causal, sinks, window = facts
    inputs = AttentionInputs(
        capability=_cuda_capability(),
        method=method,
        draft_causal=causal,
        draft_has_sinks=sinks,
        draft_sliding_window=window,
        kv_cache_dtype=str(vllm_config.cache_config.cache_dtype),
        draft_kv_cache_dtype=draft_kv,
        batch_invariant=bool(envs.VLLM_BATCH_INVARIANT),
        user_backend=_enum_name(attention.backend),
        user_backend_per_kind=tuple(sorted(attention.backend_per_kind or {})),
        user_flash_attn_version=attention.flash_attn_version,
        user_use_trtllm_attention=attention.use_trtllm_attention,
        user_draft_backend=draft_backend,
        draft_problem=draft_problem,
    )
    if _reads_trtllm_kernels(inputs):
        inputs = dataclasses.replace(inputs, trtllm_kernels=_trtllm_kernels_available())
    return inputs


def _reads_trtllm_kernels(inputs: AttentionInputs) -> bool:
    """Whether the decision depends on ``trtllm_kernels`` (else it is not probed): a pin that
    needs TRT-LLM on SM10x (where vLLM's own default, FlashInfer, asks the same question), or the
    user's FlashInfer draft on SM90 / SM12x. With VLLM_BATCH_INVARIANT no rule reads it (nor does
    vLLM, whose TRT-LLM check returns before the probe)."""
    if inputs.batch_invariant:
        return False
    major = inputs.capability[0] if inputs.capability else None
    if major == 10:
        causal_draft_pin = (
            inputs.method in _BLOCK_DRAFT_METHODS
            and inputs.user_draft_backend is None
            and inputs.draft_causal is True
        )
        return causal_draft_pin or not _explicit_target_choices(inputs)
    if major in (9, 12):
        return inputs.method is not None and inputs.user_draft_backend == FLASHINFER
    return False


def _trtllm_kernels_available() -> bool:
    """vLLM's own answer (``has_nvidia_artifactory``, cached per process): ``flashinfer-cubin``
    installed, else one request to NVIDIA's artifactory, the same vLLM makes for any FlashInfer
    layer when it builds the engine."""
    from vllm.utils.flashinfer import has_nvidia_artifactory

    return bool(has_nvidia_artifactory())


def apply_attention_choice(vllm_config: Any) -> AttentionDecision:
    """Decide for this VllmConfig, set the chosen fields, and log one line."""
    from vllm.logger import init_logger
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    decision = resolve_attention_backends(attention_inputs_from_config(vllm_config))
    attention = vllm_config.attention_config
    if decision.target_backend is not None:
        attention.backend = AttentionBackendEnum[decision.target_backend]
    if decision.use_trtllm_attention is not None:
        attention.use_trtllm_attention = decision.use_trtllm_attention
    if decision.draft_backend is not None:
        vllm_config.speculative_config.attention_backend = AttentionBackendEnum[
            decision.draft_backend
        ]
    state = "unchanged" if decision.changes_nothing else "set"
    init_logger(_LOGGER_NAME).info("nemotron-spec attention (%s): %s", state, decision.reason)
    return decision
