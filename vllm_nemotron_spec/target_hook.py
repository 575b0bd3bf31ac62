"""The NemotronH config hook: what the plugin decides about a NemotronH target's engine config.

vLLM runs it once from ``VllmConfig.__post_init__`` (chained after vLLM's own NemotronH entry by
``patches/nemotron_h_config_hook.py``), before any scheduler or worker reads the config. It checks
a Nemotron 3.5 draft as a whole (``checkpoint.check``, whose problems ``inspect`` reports too) and
routes it to the plugin's draft classes; refuses features whose exactness needs a patch that is
not installed, and a Mamba state-update algorithm FlashInfer cannot run for a verify step on this
GPU; and chooses the attention backends. Other drafts and other target architectures
keep vLLM's path.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

LOGGER_NAME = "vllm.nemotron_spec.target"


DFLASH_ARCH = "DFlashNemotron35DraftModel"
DSPARK_ARCH = "DSparkNemotron35DraftModel"
# speculative method -> our architecture for a Nemotron 3.5 draft.
NEMOTRON35_DRAFT_ARCHITECTURES = {"dflash": DFLASH_ARCH, "dspark": DSPARK_ARCH}


def routed_architecture(spec_config: Any) -> str | None:
    """The plugin's draft architecture a ``SpeculativeConfig`` was routed to by this hook, or None
    (no speculative config, another method, or a draft the plugin leaves to vLLM)."""
    if getattr(spec_config, "method", None) not in NEMOTRON35_DRAFT_ARCHITECTURES:
        return None
    draft = getattr(spec_config, "draft_model_config", None)
    archs = list(getattr(getattr(draft, "hf_config", None), "architectures", None) or [])
    arch = NEMOTRON35_DRAFT_ARCHITECTURES[spec_config.method]
    return arch if archs == [arch] else None


WEIGHTS_CHECKED_ATTR = "nemotron_spec_weights_checked"
"""Set on the draft's ``hf_config`` (which travels to the engine processes) to where its tensor
headers were checked at start-up; absent: the draft model checks them at load time."""


def check_and_route_nemotron35_draft(vllm_config: Any):
    """Validate a Nemotron 3.5 draft and route it to our class; returns the check
    (:class:`~vllm_nemotron_spec.checkpoint.check.DraftCheck`), or None when there is no
    DFlash/DSpark draft with the Nemotron 3.5 layout.

    Whether a draft has the layout is decided from its config alone (vLLM has fetched it before
    the hook runs). The target's facts come from the ``hf_config`` vLLM loaded. Tensor headers are
    checked at start-up when they can be read without downloading a weight (local files, a
    complete cache snapshot, the Hub's safetensors metadata), else at load time by the draft model.
    One log line says what was checked and from where."""
    from vllm.logger import init_logger

    from vllm_nemotron_spec.checkpoint.check import check_draft, vllm_draft_config
    from vllm_nemotron_spec.checkpoint.spec import (
        DraftSpecError,
        is_nemotron35_draft_config,
    )

    spec_config = vllm_config.speculative_config
    if spec_config is None or spec_config.method not in ("dflash", "dspark"):
        return None
    draft_config = spec_config.draft_model_config
    cfg = vllm_draft_config(draft_config)
    if not is_nemotron35_draft_config(cfg):
        return None
    require_registrations(spec_config, cfg)
    revision = getattr(draft_config, "revision", None)
    checked = check_draft(
        draft_config.model,
        target=vllm_config.model_config.model,
        num_speculative_tokens=spec_config.num_speculative_tokens,
        revision=revision,
        draft_config=cfg,
        target_config=vllm_config.model_config.hf_config,
        method=spec_config.method,
    )
    if checked.problems:
        raise DraftSpecError(checked.problems, source=f"Nemotron 3.5 draft {draft_config.model}")
    if spec_config.method == "dspark":
        drop_nested_sample_from_anchor(draft_config.hf_config)
    arch = NEMOTRON35_DRAFT_ARCHITECTURES.get(spec_config.method)
    if arch is not None and draft_config.hf_config.architectures != [arch]:
        draft_config.hf_config.architectures = [arch]
        spec_config.update_arch_()
    if checked.weights.scan is None:
        weights = f"tensor headers deferred to load time ({checked.weights.where})"
    else:
        setattr(draft_config.hf_config, WEIGHTS_CHECKED_ATTR, checked.weights.where)
        weights = (
            f"{len(checked.weights.scan.tensors)} tensor headers checked at start-up "
            f"from {checked.weights.where}"
        )
    init_logger(LOGGER_NAME).info(
        "nemotron-spec: %s draft %s%s has the Nemotron 3.5 layout (%s, %d drafted tokens, "
        "sample_from_anchor=%s): config checked against the target's loaded config (%d blocks); "
        "%s; model class %s",
        spec_config.method,
        draft_config.model,
        f"@{revision}" if revision else "",
        checked.spec.architecture,
        spec_config.num_speculative_tokens,
        checked.spec.sample_from_anchor,
        checked.target_blocks,
        weights,
        arch or "vLLM's own",
    )
    return checked


def checked_weights(spec: Any, draft_model_config: Any, weights):
    """The draft model's weights iterator, with the load-time half of the draft check in front
    when start-up could not read the tensor headers: vLLM downloads the files when its iterator
    starts, so the first item is taken, the headers on disk are checked as at start-up (same
    problems, same error), and only then is any tensor handed to the model."""
    if getattr(draft_model_config.hf_config, WEIGHTS_CHECKED_ATTR, None):
        yield from weights
        return
    items = iter(weights)
    first = next(items, None)
    check_draft_weights_at_load(spec, draft_model_config)
    if first is not None:
        yield first
    yield from items


def check_draft_weights_at_load(spec: Any, draft_model_config: Any) -> None:
    """Read the draft's tensor headers from its downloaded files and check them (see
    :func:`checked_weights`); a warning says so when no file can be found."""
    from vllm.logger import init_logger

    from vllm_nemotron_spec.checkpoint.check import check_downloaded_weights
    from vllm_nemotron_spec.checkpoint.spec import DraftSpecError

    model = draft_model_config.model
    revision = getattr(draft_model_config, "revision", None)
    source, problems = check_downloaded_weights(spec, model, revision)
    logger = init_logger(LOGGER_NAME)
    if source.scan is None or not source.scan.files:
        logger.warning(
            "nemotron-spec: draft %s: tensor headers NOT checked (%s); vLLM loads the "
            "weights unchecked",
            model,
            source.where,
        )
        return
    if problems:
        raise DraftSpecError(problems, source=f"Nemotron 3.5 draft {model}")
    logger.info(
        "nemotron-spec: draft %s: %d tensor headers checked at load time from %s",
        model,
        len(source.scan.tensors),
        source.where,
    )


def drop_nested_sample_from_anchor(hf_config: Any) -> None:
    """A DSpark draft's layout flag is its TOP-LEVEL ``sample_from_anchor`` (what vLLM's
    ``DSparkSpeculator`` and the plugin's V1 proposer read; the validation above checked that a
    nested copy agrees). vLLM 0.33's V2 ``DFlashSpeculator.__init__``, which DSpark inherits,
    refuses ``dflash_config.sample_from_anchor: true`` ("not supported for DFlash"), which would
    stop every anchor-layout DSpark draft on GPU; the in-memory config keeps the flag at the top
    level only."""
    nested = getattr(hf_config, "dflash_config", None)
    if isinstance(nested, dict) and "sample_from_anchor" in nested:
        hf_config.dflash_config = {k: v for k, v in nested.items() if k != "sample_from_anchor"}


# What a routed draft's exactness needs, refused at start-up without it; the same fixes are only
# warned about for every other launch (vLLM's own behaviour then applies, as without the plugin).
SPEC_DECODE_FIXES = ("mamba_spec_decode_padding",)
CPU_SPEC_DECODE_FIXES = ("cpu_mamba_conv_state", "cpu_mamba_ssm_state", "cpu_expand_kernel")
CPU_PREFIX_CACHING_FIXES = ("cpu_mamba_align_cache",)


def needed_patches(vllm_config: Any, cpu: bool) -> list[str]:
    """The patches whose fixes this NemotronH configuration relies on."""
    needed = []
    if cpu and vllm_config.cache_config.enable_prefix_caching:
        needed += CPU_PREFIX_CACHING_FIXES
    spec_config = vllm_config.speculative_config
    if spec_config is not None:
        needed += SPEC_DECODE_FIXES
        if cpu:
            needed += CPU_SPEC_DECODE_FIXES
        elif getattr(spec_config, "num_speculative_tokens_per_batch_size", None):
            needed.append("mamba_schedule_graph_capture")  # CUDA graphs for each k
    return needed


def require_patches(vllm_config: Any, routed: bool) -> None:
    """A routed Nemotron 3.5 draft refuses, in one line, a configuration whose exactness needs a
    patch of vLLM that is not installed here (an upstream change the install detected). Any
    other launch keeps vLLM's behaviour, with one warning per fix it does not get."""
    from vllm.logger import init_logger
    from vllm.platforms import current_platform

    from vllm_nemotron_spec import patches

    cpu = current_platform.is_cpu()
    needed = needed_patches(vllm_config, cpu)
    spec_config = vllm_config.speculative_config
    if not routed:
        for name in patches.missing(*needed):
            init_logger(LOGGER_NAME).warning(
                "nemotron-spec: the plugin's fix %s (%s) is %s: this launch gets vLLM's own "
                "behaviour there (%s)",
                name,
                patches.entry(name).symbol,
                patches.state(name),
                patches.entry(name).why,
            )
        return
    if cpu or not vllm_config.use_v2_model_runner:
        needed.append("v1_nemotron35_proposers")
        if spec_config.method == "dspark" and getattr(
            spec_config, "num_speculative_tokens_per_batch_size", None
        ):
            needed.append("v1_dspark_dynamic_sd")  # vLLM 0.33 drops the schedule there
    if cpu and getattr(vllm_config.cache_config, "use_replayssm", False):
        raise patches.PatchUnavailable(
            f"the Nemotron 3.5 {spec_config.method} draft on CPU: the plugin's CPU Mamba fixes "
            "do not cover --use-replayssm; start without it"
        )
    patches.require(f"the Nemotron 3.5 {spec_config.method} draft", *needed)


def require_registrations(spec_config: Any, draft_cfg: dict) -> None:
    """The plugin's registrations a routed draft needs: its model classes, and the quantization
    config of its checkpoint format."""
    from vllm_nemotron_spec.checkpoint.layout import QUANT_ALGO, modelopt_quant_algo
    from vllm_nemotron_spec.plugin import require_registered

    quant = draft_cfg.get("quantization_config")
    concerns = ["models"]
    if modelopt_quant_algo(quant) == QUANT_ALGO:
        concerns.append("quantization")
    elif isinstance(quant, dict) and quant.get("quant_method") == "compressed-tensors":
        concerns.append("compressed-tensors")
    require_registered(f"the Nemotron 3.5 {spec_config.method} draft", *concerns)


# FlashInfer's multi-token state update (what every speculative verify step runs) and the text of
# its guard that refuses the vertical / horizontal algorithms below SM100 (flashinfer-python 0.7:
# the SM90 JIT module is built without FLASHINFER_MAMBA_ENABLE_SM100).
FLASHINFER_MTP_HEADER = "data/include/flashinfer/mamba/invoke_selective_state_update_mtp.cuh"
FLASHINFER_MTP_SM100_GUARD = "MTP algorithm requires SM100"
_SM100_ONLY_SSU_ALGORITHMS = ("vertical", "horizontal")


def flashinfer_mtp_algorithms_need_sm100(package_dir: Path | None = None) -> bool | None:
    """Whether the installed FlashInfer refuses the vertical / horizontal multi-token state
    update below SM100, read from the kernel source it ships for its JIT builds; None when
    FlashInfer is not installed or ships no such header (then FlashInfer decides on its own)."""
    if package_dir is None:
        found = importlib.util.find_spec("flashinfer")  # finds the package without importing it
        if found is None or not found.submodule_search_locations:
            return None
        package_dir = Path(list(found.submodule_search_locations)[0])
    header = package_dir / FLASHINFER_MTP_HEADER
    if not header.is_file():
        return None
    return FLASHINFER_MTP_SM100_GUARD in header.read_text(errors="replace")


def mamba_ssu_problem(
    capability: tuple[int, int] | None,
    backend: str | None,
    algorithm: str | None,
    num_speculative_tokens: int,
    mtp_needs_sm100: bool | None,
) -> str | None:
    """Why this Mamba state-update choice cannot serve speculative decoding here, or None.

    A verify step updates the state over 1 + k tokens: FlashInfer's multi-token path, whose
    vertical and horizontal algorithms exist only in its SM100 builds. On Hopper the engine
    would fail at start-up, after the model loads, inside FlashInfer."""
    if backend != "FLASHINFER" or algorithm not in _SM100_ONLY_SSU_ALGORITHMS:
        return None
    if capability is None or capability[0] >= 10 or not mtp_needs_sm100:
        return None
    return (
        f"--mamba-ssu-algorithm {algorithm} with speculative decoding on SM"
        f"{capability[0]}{capability[1]}: every verify step updates the Mamba state over "
        f"{1 + num_speculative_tokens} tokens, and the installed FlashInfer has the vertical "
        "and horizontal multi-token algorithms only for SM100+ (Blackwell). Leave "
        "--mamba-ssu-algorithm out (FlashInfer picks its 'simple' kernel), or keep vLLM's "
        "default --mamba-backend triton (as fast or faster on an H100: docs/serving.md)"
    )


def refuse_unservable_mamba_ssu(vllm_config: Any) -> None:
    """A routed draft refuses, at start-up, a Mamba state-update algorithm that FlashInfer
    cannot run for speculative decoding on this GPU (:func:`mamba_ssu_problem`)."""
    from vllm_nemotron_spec.attention import _cuda_capability, _enum_name

    mamba = getattr(vllm_config, "mamba_config", None)
    algorithm = getattr(mamba, "ssu_algorithm", None)
    if algorithm not in _SM100_ONLY_SSU_ALGORITHMS:
        return
    problem = mamba_ssu_problem(
        _cuda_capability(),
        _enum_name(getattr(mamba, "backend", None)),
        algorithm,
        vllm_config.speculative_config.num_speculative_tokens,
        flashinfer_mtp_algorithms_need_sm100(),
    )
    if problem is not None:
        raise ValueError(f"nemotron-spec: {problem}")


def prepare_nemotron_h_config(vllm_config: Any) -> None:
    """Everything the plugin sets on a NemotronH target's VllmConfig (see the module docstring):
    only a launch that routes a Nemotron 3.5 draft gets checks, refusals and attention pins."""
    from vllm_nemotron_spec.attention import apply_attention_choice
    from vllm_nemotron_spec.plugin import announce

    announce()
    routed = check_and_route_nemotron35_draft(vllm_config) is not None
    require_patches(vllm_config, routed)
    if routed:
        refuse_unservable_mamba_ssu(vllm_config)
        apply_attention_choice(vllm_config)
