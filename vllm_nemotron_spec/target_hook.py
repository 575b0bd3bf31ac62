"""The NemotronH config hook: what the plugin decides about a NemotronH target's engine config.

vLLM runs ``MODELS_CONFIG_MAP[architecture].verify_and_update_config(vllm_config)`` once, from
``VllmConfig.__post_init__``, before the scheduler, the KV-cache manager or any worker reads the
config. ``patches/nemotron_h_config_hook.py`` chains ``prepare_nemotron_h_config`` onto vLLM's own
NemotronH entry (vLLM's Mamba cache-dtype update still runs first), which, in order:

1. A DFlash / DSpark draft with the Nemotron 3.5 layout (structural check of its config.json) is
   checked as a whole, exactly as ``vllm-nemotron-spec inspect`` checks it (config, aux ids
   against the target's blocks, tensor layout from the safetensors headers, gamma); any problem
   stops start-up with every problem listed. Nemotron 3.5 DFlash drafts are then routed to the
   plugin's draft class. Every other draft keeps vLLM's own path untouched.
2. Refuses speculative decoding, and on CPU prefix caching, whose exactness needs a patch that
   is not installed (``require_patches``).
3. Chooses the attention backends (``attention.apply_attention_choice``).

Every other target architecture keeps vLLM's hook untouched.
"""

from __future__ import annotations

from typing import Any

ARCHITECTURES = ("NemotronHForCausalLM",)
LOGGER_NAME = "vllm.nemotron_spec.target"



# speculative method -> our architecture for a Nemotron 3.5 draft (absent: vLLM's own class).
NEMOTRON35_DRAFT_ARCHITECTURES = {
    "dflash": "DFlashNemotron35DraftModel",
    "dspark": "DSparkNemotron35DraftModel",
}


def check_and_route_nemotron35_draft(vllm_config: Any) -> dict | None:
    """Validate a Nemotron 3.5 draft and route it to our class; returns the inspection report,
    or None when there is no DFlash/DSpark draft with the Nemotron 3.5 layout."""
    from vllm.logger import init_logger

    from vllm_nemotron_spec.checkpoint.spec import DraftSpecError
    from vllm_nemotron_spec.checkpoint.inspect import inspect_checkpoint

    spec_config = vllm_config.speculative_config
    if spec_config is None or spec_config.method not in ("dflash", "dspark"):
        return None
    draft_config = spec_config.draft_model_config
    report = inspect_checkpoint(
        draft_config.model, target=vllm_config.model_config.model,
        num_speculative_tokens=spec_config.num_speculative_tokens,
    )
    if not report.get("nemotron35_layout"):
        return None
    problems = list(report["problems"])
    if report["method"] != spec_config.method:
        problems.append(
            f'speculative_config.method is "{spec_config.method}" but the draft '
            f"{draft_config.model} is a {report['method']} checkpoint "
            f"(architecture {report['architecture']}): use "
            f'{{"method": "{report["method"]}", ...}}'
        )
    if problems:
        raise DraftSpecError(problems, source=f"Nemotron 3.5 draft {draft_config.model}")
    if spec_config.method == "dspark":
        drop_nested_sample_from_anchor(draft_config.hf_config)
    arch = NEMOTRON35_DRAFT_ARCHITECTURES.get(spec_config.method)
    if arch is not None and draft_config.hf_config.architectures != [arch]:
        draft_config.hf_config.architectures = [arch]
        spec_config.update_arch_()
    init_logger(LOGGER_NAME).info(
        "nemotron-spec: %s draft %s has the Nemotron 3.5 layout (%s, %d drafted tokens, "
        "sample_from_anchor=%s): checked against the target; model class %s",
        spec_config.method, draft_config.model, report["architecture"],
        spec_config.num_speculative_tokens, report["sample_from_anchor"],
        arch or "vLLM's own",
    )
    return report


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
        patches.require("Mamba prefix caching on CPU (--enable-prefix-caching)",
                        "cpu_mamba_align_cache")
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


