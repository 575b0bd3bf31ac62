"""Reading profiler traces: GPU-busy time and where the GPU time went.

The traces are the chrome-trace JSON that ``torch.profiler`` writes (vLLM's worker profiler
writes ``*.pt.trace.json.gz``). Pure Python on the event list:

* :func:`busy_us`: the union of the intervals of device activity (``cat`` kernel, gpu_memcpy,
  gpu_memset): the time the GPU was doing anything, overlaps counted once. Without device
  events (a CPU machine) the union of top-level CPU ops stands in.
* :func:`assign_ranges`: each device event (or, on CPU, each top-level CPU op) with the stack of
  the harness's ``record_function`` ranges (names starting with :data:`RANGE_PREFIX`) open on the
  LAUNCHING thread at the launch. A kernel and its launch (``cudaLaunchKernel``,
  ``cuLaunchKernel``, ``cudaGraphLaunch``, ``cudaMemcpyAsync``...) share a ``correlation`` id; the
  kernels of a CUDA-graph replay carry the id of their ``cudaGraphLaunch``. The kernel runs later
  than its launch, so the launch's time decides, not the kernel's.
* :func:`by_priority` (the step split: a kernel belongs to the highest-priority range open at its
  launch) and :func:`by_step` (the draft breakdown: the innermost range, grouped by the outermost
  instance of a step range).
"""

from __future__ import annotations

import gzip
import json
from collections import defaultdict
from pathlib import Path

RANGE_PREFIX = "nsh:"
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
UNATTRIBUTED = "unattributed"


def load_events(path: str | Path) -> list[dict]:
    """The ``traceEvents`` of a ``.json`` or ``.json.gz`` trace."""
    path = Path(path)
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as fh:
        data = json.load(fh)
    return data.get("traceEvents", []) if isinstance(data, dict) else data


def newest_trace(directory: str | Path, after: float = 0.0) -> Path | None:
    """The most recently written ``*.pt.trace.json[.gz]`` under ``directory`` (modified after
    ``after``, a ``time.time()``), or None."""
    found = [
        p
        for p in Path(directory).rglob("*.pt.trace.json*")
        if p.is_file() and p.stat().st_mtime >= after
    ]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def _complete(e: dict) -> bool:
    return e.get("ph") == "X" and "ts" in e


def device_events(events: list[dict]) -> list[dict]:
    return [e for e in events if _complete(e) and e.get("cat") in DEVICE_CATS]


def _thread(e: dict) -> tuple:
    return (e.get("pid"), e.get("tid"))


def top_level(events: list[dict]) -> list[dict]:
    """Events not contained in another event of the list on the same thread."""
    out, end = [], {}
    for e in sorted(events, key=lambda e: (str(_thread(e)), e["ts"], -e.get("dur", 0))):
        t = _thread(e)
        if t in end and e["ts"] < end[t]:
            continue
        out.append(e)
        end[t] = e["ts"] + e.get("dur", 0)
    return out


def cpu_ops(events: list[dict]) -> list[dict]:
    return top_level([e for e in events if _complete(e) and e.get("cat") == "cpu_op"])


def union_us(intervals) -> float:
    """Total length of the union of ``(start, end)`` intervals."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def counted_events(events: list[dict]) -> tuple[list[dict], str]:
    """(the events whose time counts, what they are): device activity, else top-level CPU ops
    (a machine without CUDA)."""
    dev = device_events(events)
    return (dev, "GPU activity") if dev else (cpu_ops(events), "CPU ops (no GPU)")


def _busy(items: list[dict]) -> float:
    return union_us((e["ts"], e["ts"] + e.get("dur", 0.0)) for e in items)


def _span(items: list[dict]) -> float:
    if not items:
        return 0.0
    return max(e["ts"] + e.get("dur", 0.0) for e in items) - min(e["ts"] for e in items)


def busy_us(events: list[dict]) -> tuple[float, str]:
    """(busy microseconds, what was counted): the union of :func:`counted_events`."""
    items, counted = counted_events(events)
    return _busy(items), counted


def span_us(events: list[dict]) -> float:
    """From the first start to the last end of the events counted by :func:`busy_us`."""
    return _span(counted_events(events)[0])


def _ranges(events: list[dict]) -> list[dict]:
    return [
        e
        for e in events
        if _complete(e)
        and e.get("cat") == "user_annotation"
        and str(e.get("name", "")).startswith(RANGE_PREFIX)
    ]


def _items(events: list[dict]) -> tuple[list[tuple], int, bool]:
    """(items, unmatched, device): each item (thread, time it was issued, duration, name, time
    it ran)."""
    dev = device_events(events)
    if not dev:
        items = [
            (_thread(e), e["ts"], float(e.get("dur", 0.0)), e["name"], e["ts"])
            for e in cpu_ops(events)
        ]
        return items, 0, False
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in LAUNCH_CATS and "correlation" in (e.get("args") or {})
    }
    items, unmatched = [], 0
    for e in dev:
        launch = launches.get((e.get("args") or {}).get("correlation"))
        if launch is None:
            unmatched += 1
            continue
        dur = float(e.get("dur", 0.0))
        items.append((_thread(launch), launch["ts"], dur, e.get("name", ""), e["ts"]))
    return items, unmatched, True


def assign_ranges(events: list[dict]) -> dict:
    """Every device event (CPU op without a GPU) with the names of the harness ranges open on
    its launching thread at the launch, outermost first, and the id of the outermost range.
    Returns ``{"items": [(names, outer_id, issued_us, dur_us, name, ran_us)], "unmatched": n (kernels
    whose launch is not in the trace), "device": bool}``."""
    ranges = _ranges(events)
    items, unmatched, device = _items(events)
    timeline = defaultdict(list)  # per thread: range starts (0), items (1), range ends (2)
    for i, r in enumerate(ranges):
        timeline[_thread(r)].append((r["ts"], 0, -r.get("dur", 0), i))
        timeline[_thread(r)].append((r["ts"] + r.get("dur", 0), 2, 0, i))
    for j, (thread, ts, _dur, _name, _ran) in enumerate(items):
        timeline[thread].append((ts, 1, 0, j))
    out = []
    for points in timeline.values():
        stack: list[int] = []
        for _ts, kind, _neg, idx in sorted(points):
            if kind == 0:
                stack.append(idx)
            elif kind == 2:
                if idx in stack:
                    stack.remove(idx)
            else:
                names = tuple(ranges[i]["name"][len(RANGE_PREFIX) :] for i in stack)
                _thr, ts, dur, name, ran = items[idx]
                out.append((names, stack[0] if stack else None, ts, dur, name, ran))
    out.sort(key=lambda item: item[2])
    return {"items": out, "unmatched": unmatched, "device": device}


def by_priority(assigned: dict, priority: dict[str, int]) -> dict:
    """GPU time per part: each item goes to the open range of the highest ``priority`` (names
    not in it: priority 0; ties: the innermost), items in no range to :data:`UNATTRIBUTED`.
    Returns ``{"us": {part: us}, "kernel_us": {part: us}, "count": {part: n}, "top": {part:
    {kernel: us}}}``: ``us`` is the union of a part's intervals (kernels of one part that overlap,
    e.g. the shared experts on their own stream beside the routed ones, count once, so the parts
    add up to about the busy time), ``kernel_us`` the plain sum of its kernels' durations."""
    intervals: dict[str, list] = defaultdict(list)
    kernel_us: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    top: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for names, _outer, _ts, dur, name, ran in assigned["items"]:
        part = UNATTRIBUTED
        if names:
            best = max(range(len(names)), key=lambda i: (priority.get(names[i], 0), i))
            part = names[best]
        intervals[part].append((ran, ran + dur))
        kernel_us[part] += dur
        count[part] += 1
        top[part][name] += dur
    return {
        "us": {part: union_us(iv) for part, iv in intervals.items()},
        "kernel_us": dict(kernel_us),
        "count": dict(count),
        "top": {k: dict(v) for k, v in top.items()},
    }


def by_step(assigned: dict, step: str, glue: str) -> dict:
    """Items grouped by the outermost open instance of range ``step``, each to its innermost
    range (``glue`` when that is ``step`` itself). Returns ``{"steps": [{part: [count, us]}]
    (in time order), "outside": {part: [count, us]} (in a range, but no step), "unattributed":
    [count, us], "kernel_names": [{part: {kernel: [count, us]}}] (per step, as "steps")}``."""
    steps: dict[int, dict] = {}
    names_per_step: dict[int, dict] = {}
    order: list[int] = []
    outside: dict = defaultdict(lambda: [0, 0.0])
    unattributed = [0, 0.0]
    for names, outer, _ts, dur, name, _ran in assigned["items"]:
        if not names:
            unattributed[0] += 1
            unattributed[1] += dur
            continue
        part = glue if names[-1] == step else names[-1]
        if names[0] != step:
            cell = outside[part]
        else:
            if outer not in steps:
                steps[outer], names_per_step[outer] = {}, {}
                order.append(outer)
            cell = steps[outer].setdefault(part, [0, 0.0])
            kernel = names_per_step[outer].setdefault(part, {}).setdefault(name, [0, 0.0])
            kernel[0] += 1
            kernel[1] += dur
        cell[0] += 1
        cell[1] += dur
    unattributed[0] += assigned.get("unmatched", 0)
    return {
        "steps": [steps[i] for i in order],
        "outside": dict(outside),
        "unattributed": unattributed,
        "kernel_names": [names_per_step[i] for i in order],
    }


# (family, name fragments), first match wins: the MoE's own GEMMs before dense GEMMs
KERNEL_FAMILIES = (
    ("MoE experts", ("moe", "expert", "topk")),
    ("attention", ("flash", "fmha", "attn", "attention", "reshape_and_cache")),
    (
        "Mamba",
        (
            "mamba",
            "ssd",
            "chunk_scan",
            "chunk_state",
            "state_passing",
            "bmm_chunk",
            "chunk_cumsum",
            "selective",
            "conv1d",
            "ssu",
        ),
    ),  # fmt: skip
    (
        "other GEMMs",
        (
            "gemm",
            "cutlass",
            "cublas",
            "xmma",
            "nvjet",
            "humming",
            "marlin",
            "matmul",
            "aten::mm",
            "aten::addmm",
            "aten::linear",
        ),
    ),  # fmt: skip
)
REST = "rest"


def kernel_family(name: str) -> str:
    lower = name.lower()
    for family, fragments in KERNEL_FAMILIES:
        if any(f in lower for f in fragments):
            return family
    return REST


def kernel_families(events: list[dict], top: int = 10) -> dict:
    """Where a profiled window's device time went: GPU-busy (the union), the span, each kernel
    family's summed time (kernels of a family may overlap each other's streams; on a machine
    without CUDA, top-level CPU ops stand in) and the ``top`` kernels by time."""
    items, counted = counted_events(events)
    families = {family: 0.0 for family, _ in KERNEL_FAMILIES} | {REST: 0.0}
    kernels: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for e in items:
        dur = e.get("dur", 0.0)
        families[kernel_family(e.get("name", ""))] += dur
        kernels[e.get("name", "")][0] += dur
        kernels[e.get("name", "")][1] += 1
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "counted": counted,
        "busy_ms": _busy(items) / 1e3,
        "span_ms": _span(items) / 1e3,
        "families_ms": {k: v / 1e3 for k, v in families.items()},
        "top_kernels": [[name[:120], round(us / 1e3, 3), n] for name, (us, n) in ranked],
    }
