"""vLLM's DFlash / DSpark draft classes, guarded: registered under vLLM's own names ONLY while the
plugin's NemotronH config hook is not installed (``plugin._guard_unrouted_drafts``).

Why: the hook is where a Nemotron 3.5 draft is checked and routed to the plugin's classes. A vLLM
whose config code changed leaves the hook uninstalled, and such a draft would then load into
vLLM's own class unchecked (silently: wrong layout, wrong NVFP4 scales, wrong tokens on CPU).
These subclasses refuse exactly that draft, in one line, when vLLM builds it; any other draft
builds as vLLM's class does (the subclass adds nothing else).
"""

from __future__ import annotations

from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM
from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM


def refuse_unrouted_nemotron35_draft(vllm_config) -> None:
    """Raise ``ValueError`` (one line) when the draft being built has the Nemotron 3.5 layout."""
    from vllm_nemotron_spec.checkpoint.check import vllm_draft_config
    from vllm_nemotron_spec.checkpoint.spec import is_nemotron35_draft_config
    from vllm_nemotron_spec.patches import state, vllm_version

    spec_config = getattr(vllm_config, "speculative_config", None)
    draft = getattr(spec_config, "draft_model_config", None)
    if draft is None or not is_nemotron35_draft_config(vllm_draft_config(draft)):
        return
    raise ValueError(
        f"vllm-nemotron-spec: refusing the Nemotron 3.5 {spec_config.method} draft "
        f"{draft.model}: the plugin's NemotronH config hook is {state('nemotron_h_config_hook')} "
        f"on vLLM {vllm_version()}, so the draft would run unchecked on vLLM's own class; use a "
        "vLLM the plugin supports (README: Install) or remove the plugin (VLLM_PLUGINS)"
    )


class GuardedDFlashQwen3ForCausalLM(DFlashQwen3ForCausalLM):
    """vLLM's DFlash draft class, refusing an unrouted Nemotron 3.5 draft."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        refuse_unrouted_nemotron35_draft(vllm_config)
        super().__init__(vllm_config=vllm_config, prefix=prefix)


class GuardedQwen3DSparkForCausalLM(Qwen3DSparkForCausalLM):
    """vLLM's Qwen3 DSpark draft class, refusing an unrouted Nemotron 3.5 draft."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        refuse_unrouted_nemotron35_draft(vllm_config)
        super().__init__(vllm_config=vllm_config, prefix=prefix)
