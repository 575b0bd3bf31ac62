"""The NemotronH config hook: what the plugin decides about a NemotronH target's engine config.

vLLM runs ``MODELS_CONFIG_MAP[architecture].verify_and_update_config(vllm_config)`` once, from
``VllmConfig.__post_init__``, before the scheduler, the KV-cache manager or any worker reads the
config. ``register()`` chains a subclass onto vLLM's own NemotronH entry (vLLM's Mamba cache-dtype
update still runs first) and then, in order:

1. A DFlash / DSpark draft with the Nemotron 3.5 layout (structural check of its config.json) is
   checked as a whole, exactly as ``vllm-nemotron-spec inspect`` checks it (config, aux ids
   against the target's blocks, tensor layout from the safetensors headers, gamma); any problem
   stops start-up with every problem listed. Nemotron 3.5 DFlash drafts are then routed to the
   plugin's draft class. Every other draft keeps vLLM's own path untouched.
2. Chooses the attention backends (``attention.apply_attention_choice``).

Every other target architecture keeps vLLM's hook untouched.
"""

from __future__ import annotations

import threading
from typing import Any

ARCHITECTURES = ("NemotronHForCausalLM",)
LOGGER_NAME = "vllm.nemotron_spec.target"

_lock = threading.Lock()


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


def prepare_nemotron_h_config(vllm_config: Any) -> None:
    """Everything the plugin sets on a NemotronH target's VllmConfig (see the module docstring)."""
    from vllm_nemotron_spec.attention import apply_attention_choice

    check_and_route_nemotron35_draft(vllm_config)
    apply_attention_choice(vllm_config)


def register() -> list[str]:
    """Chain our hook onto vLLM's NemotronH config hook (idempotent)."""
    from vllm.model_executor.models import config as models_config

    with _lock:
        for arch in ARCHITECTURES:
            base = models_config.MODELS_CONFIG_MAP.get(arch, models_config.VerifyAndUpdateConfig)
            if getattr(base, "_nemotron_spec_hook", False):
                continue

            class NemotronHSpecConfig(base):  # type: ignore[misc, valid-type]
                """vLLM's NemotronH config hook, then vllm-nemotron-spec's decisions."""

                _nemotron_spec_hook = True

                @classmethod
                def verify_and_update_config(cls, vllm_config: Any, _base=base) -> None:
                    _base.verify_and_update_config(vllm_config)
                    prepare_nemotron_h_config(vllm_config)

            models_config.MODELS_CONFIG_MAP[arch] = NemotronHSpecConfig
    return [f"config hook for {', '.join(ARCHITECTURES)}"]

