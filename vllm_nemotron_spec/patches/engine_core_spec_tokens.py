"""Patch: a running engine's drafted-token count can be set, so one ``tune`` engine measures every k.

Why:     ``tune`` times the decode step at every (batch size, k). vLLM fixes k per batch size
         when the engine starts (the scheduler's dense ``dynamic_sd_lookup``, built from
         ``num_speculative_tokens_per_batch_size``), so n values of k took n engine starts: on a
         GPU minutes each for Lightning (333 s cold on an H100), most of tune's time.
How:     adds one method to ``vllm.v1.engine.core.EngineCore``, :func:`set_num_spec_tokens`
         (named :data:`METHOD`): every entry of the scheduler's lookup becomes ``k``, or, with
         ``None``, what the engine started with. It replaces nothing and is inert until called.
         A client reaches it as a utility (``call_utility``, into the engine-core process) or
         directly in-process (:func:`set_engine_num_spec_tokens`). Only a k that the engine's
         own schedule holds is accepted: those are the k whose CUDA graphs the runner captured
         (``tune`` starts its engine with a schedule naming every k it measures).
Relies:  ``Scheduler.schedule`` reads ``self.dynamic_sd_lookup[<batch size>]`` each step to choose
         the step's k (the V1 and V2 runners take it from the scheduler output); its code is
         pinned by fingerprint.
Upstream: vLLM has no runtime control of the schedule; none requested.
Removal: when vLLM can change a running engine's schedule.
         ``tests/patches/test_engine_core_spec_tokens.py`` pins the scheduler (tripwire) and
         checks the method; ``tests/e2e/test_batch_size_schedule.py`` drives a real CPU engine's
         k through it in vLLM's engine-core process (drafts per step and tokens checked).
"""

from __future__ import annotations

from vllm_nemotron_spec.patches import (
    ShapeMismatch,
    Target,
    check_when_imported,
    install_when_imported,
    require,
)

PATCH = __name__.rsplit(".", 1)[-1]
SCHEDULER_MODULE = "vllm.v1.core.sched.scheduler"
ENGINE_MODULE = "vllm.v1.engine.core"
METHOD = "nemotron_spec_set_num_spec_tokens"
TARGETS = (
    Target(
        SCHEDULER_MODULE,
        "Scheduler.schedule",
        {"f0bf9ee1ca0e0316": "0.32.0", "4632061d97d252d8": "0.33.0"},
    ),
)

_STARTED_WITH = "_nemotron_spec_started_lookup"


def set_num_spec_tokens(self, k: int | None) -> list[int]:
    """``EngineCore.<METHOD>``: draft ``k`` tokens at every batch size from the next step on
    (``None``: the schedule the engine started with); returns the k values it accepts."""
    require("setting k on a running engine", PATCH)
    scheduler = self.scheduler
    lookup = getattr(scheduler, "dynamic_sd_lookup", None)
    if lookup is None:
        raise ValueError(
            "the engine was started without num_speculative_tokens_per_batch_size: its k "
            "cannot change"
        )
    started = scheduler.__dict__.setdefault(_STARTED_WITH, list(lookup))
    allowed = sorted(set(started[1:]))  # index 0 is unused (no batch of 0 requests)
    if k is None:
        scheduler.dynamic_sd_lookup = list(started)
    elif k in allowed:
        scheduler.dynamic_sd_lookup = [k] * len(started)
    else:
        raise ValueError(
            f"k={k} is not in the engine's schedule (k values {allowed}): only those have "
            "their CUDA graphs captured"
        )
    return allowed


def set_engine_num_spec_tokens(llm, k: int | None) -> list[int]:
    """Call :func:`set_num_spec_tokens` on ``llm``'s engine core, in its process or in this
    one."""
    client = llm.llm_engine.engine_core
    core = getattr(client, "engine_core", None)  # vLLM's in-process client holds the core
    if core is not None:
        return getattr(core, METHOD)(k)
    return client.call_utility(METHOD, k)


def install() -> None:
    check_when_imported(PATCH, SCHEDULER_MODULE, "Scheduler.schedule")

    def add_method(module):
        current = getattr(module.EngineCore, METHOD, None)
        if current is set_num_spec_tokens:
            return
        if current is not None:
            raise ShapeMismatch(f"{ENGINE_MODULE}.EngineCore.{METHOD} exists already")
        setattr(module.EngineCore, METHOD, set_num_spec_tokens)

    install_when_imported(PATCH, ENGINE_MODULE, add_method)
