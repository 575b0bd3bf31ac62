"""Run the real vLLM engine offline and read back tokens, speed and spec-decode counters.

Shared by ``demo`` and ``bench``. Everything vLLM-specific is imported inside the functions, so
importing this module stays cheap. Several engines can run one after another in one process; the
spec-decode counters are process-global Prometheus counters, so each run reports the difference
between snapshots taken before and after its own generate call.
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass, field

PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def set_engine_defaults(*models: str | None) -> None:
    """Environment for the commands' engines; a user's own settings win. Offline (no Hub request
    at all) only when every model given is a local directory: a Hub id must stay downloadable.
    On CPU the engine runs in-process with a 1 GiB KV cache (the small-model settings); on a GPU
    its core keeps vLLM's own process, as served: steps are timed as a server runs them, and a
    released engine frees its GPU memory (an in-process one keeps its weights held)."""
    if all(m is None or os.path.isdir(m) for m in models):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


@dataclass
class SpecCounters:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def minus(self, before: "SpecCounters") -> "SpecCounters":
        per_pos = [
            a - (before.accepted_per_position[i] if i < len(before.accepted_per_position) else 0)
            for i, a in enumerate(self.accepted_per_position)
        ]
        return SpecCounters(
            self.num_drafts - before.num_drafts,
            self.num_draft_tokens - before.num_draft_tokens,
            self.num_accepted_tokens - before.num_accepted_tokens,
            per_pos,
        )

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens emitted per target step: 1 (the target's own token) + accepted drafts per draft."""
        if self.num_drafts == 0:
            return None
        return 1.0 + self.num_accepted_tokens / self.num_drafts

    @property
    def per_position_acceptance(self) -> list[float]:
        if self.num_drafts == 0:
            return []
        return [a / self.num_drafts for a in self.accepted_per_position]


def read_spec_counters(llm) -> SpecCounters:
    """Current values of vLLM's spec-decode counters (summed over label sets)."""
    out = SpecCounters()
    for metric in llm.get_metrics():
        if metric.name == "vllm:spec_decode_num_drafts":
            out.num_drafts += metric.value
        elif metric.name == "vllm:spec_decode_num_draft_tokens":
            out.num_draft_tokens += metric.value
        elif metric.name == "vllm:spec_decode_num_accepted_tokens":
            out.num_accepted_tokens += metric.value
        elif metric.name == PER_POSITION:
            values = list(metric.values)
            if len(out.accepted_per_position) < len(values):
                out.accepted_per_position += [0] * (len(values) - len(out.accepted_per_position))
            for i, v in enumerate(values):
                out.accepted_per_position[i] += v
    return out


@dataclass
class RunResult:
    method: str
    token_ids: list[list[int]]
    seconds: float
    counters: SpecCounters

    @property
    def num_output_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.seconds if self.seconds > 0 else 0.0


SMALL_MODEL_DEFAULTS = dict(
    dtype="float32",
    enforce_eager=True,
    max_model_len=512,
    max_num_seqs=16,
    seed=0,
    disable_log_stats=False,
)
"""The engine settings :func:`make_llm` starts from: they suit the tiny family on CPU."""


def make_llm(model: str, speculative_config: dict | None = None, **engine_kwargs):
    """An offline ``vllm.LLM`` with settings that suit the tiny family on CPU (overridable)."""
    from vllm import LLM

    kwargs = dict(model=model, **SMALL_MODEL_DEFAULTS, speculative_config=speculative_config)
    kwargs.update(engine_kwargs)
    return LLM(**kwargs)


def generate(llm, prompts: list[str], max_tokens: int, method: str, **sampling) -> RunResult:
    """Greedy (unless ``sampling`` says otherwise) generation, timed, with counter deltas."""
    from vllm import SamplingParams

    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=sampling.pop("temperature", 0.0),
        ignore_eos=True,
        **sampling,
    )
    before = read_spec_counters(llm)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    counters = read_spec_counters(llm).minus(before)
    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    return RunResult(method, token_ids, seconds, counters)


def release(llm) -> None:
    """Free an engine so the next one fits (in-process engines)."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    del llm
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:
        pass
