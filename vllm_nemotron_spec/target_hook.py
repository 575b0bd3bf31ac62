"""The NemotronH config hook: what the plugin decides about a NemotronH target's engine config.

vLLM runs it once from ``VllmConfig.__post_init__`` (chained after vLLM's own NemotronH entry by
``patches/nemotron_h_config_hook.py``), before any scheduler or worker reads the config. It checks
a Nemotron 3.5 draft as a whole (``checkpoint.check``, whose problems ``inspect`` reports too) and
routes it to the plugin's draft classes; refuses features whose exactness needs a patch that is
not installed; and chooses the attention backends. Other drafts and other target architectures
keep vLLM's path.
"""

from __future__ import annotations

from typing import Any

LOGGER_NAME = "vllm.nemotron_spec.target"


# speculative method -> our architecture for a Nemotron 3.5 draft (absent: vLLM's own class).
NEMOTRON35_DRAFT_ARCHITECTURES = {
    "dflash": "DFlashNemotron35DraftModel",
    "dspark": "DSparkNemotron35DraftModel",
}


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


def require_patches(vllm_config: Any) -> None:
    """Refuse, in one line, a configuration whose exactness needs a patch of vLLM that is not
    installed here (another vLLM version, or an upstream change the install detected)."""
    from vllm.platforms import current_platform

    from vllm_nemotron_spec import patches
    from vllm_nemotron_spec.patches.v1_nemotron35_proposers import routed_draft_architecture

    cpu = current_platform.is_cpu()
    if cpu and vllm_config.cache_config.enable_prefix_caching:
        patches.require(
            "Mamba prefix caching on CPU (--enable-prefix-caching)", "cpu_mamba_align_cache"
        )
    spec_config = vllm_config.speculative_config
    if spec_config is None:
        return
    feature = f"speculative decoding ({spec_config.method}) on a NemotronH target"
    needed = ["mamba_spec_decode_padding"]
    if cpu:
        needed += ["cpu_mamba_conv_state", "cpu_mamba_ssm_state", "cpu_expand_kernel"]
    if routed_draft_architecture(vllm_config) and (cpu or not vllm_config.use_v2_model_runner):
        needed.append("v1_nemotron35_proposers")
    patches.require(feature, *needed)


def prepare_nemotron_h_config(vllm_config: Any) -> None:
    """Everything the plugin sets on a NemotronH target's VllmConfig (see the module docstring)."""
    from vllm_nemotron_spec.attention import apply_attention_choice

    check_and_route_nemotron35_draft(vllm_config)
    require_patches(vllm_config)
    apply_attention_choice(vllm_config)
