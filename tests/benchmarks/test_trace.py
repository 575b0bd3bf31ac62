"""benchmarks/harness/trace.py on profiler traces built here: GPU-busy as a union of intervals,
kernels given to the harness's ranges through their launch's correlation id (by priority for the
step split, innermost and per step for the draft breakdown), CPU ops on a machine without CUDA."""

from __future__ import annotations

import gzip
import json

import pytest

from benchmarks.harness import trace
from benchmarks.harness.instrument import PRIORITY

P = trace.RANGE_PREFIX


def rng(name, ts, dur, tid=1):
    return {"ph": "X", "cat": "user_annotation", "name": P + name, "ts": ts, "dur": dur,
            "pid": 0, "tid": tid}  # fmt: skip


def launch_and_kernel(corr, ts, kdur, tid=1, cat="kernel", lag=10_000, launch="cudaLaunchKernel"):
    """A launch at ``ts`` on thread ``tid`` and its kernel, which runs much later (a GPU lags
    the CPU): attribution must follow the launch, not the kernel's own time."""
    return [
        {"ph": "X", "cat": "cuda_runtime", "name": launch, "ts": ts, "dur": 1,
         "pid": 0, "tid": tid, "args": {"correlation": corr}},
        {"ph": "X", "cat": cat, "name": f"k{corr}", "ts": ts + lag, "dur": kdur,
         "pid": 1, "tid": 7, "args": {"correlation": corr}},
    ]  # fmt: skip


@pytest.mark.parametrize(
    "intervals, expected",
    [
        ([], 0.0),
        ([(0, 10)], 10.0),
        ([(0, 10), (5, 15)], 15.0),  # overlap counted once
        ([(0, 10), (10, 20)], 20.0),  # touching
        ([(0, 10), (20, 25)], 15.0),  # a gap is not busy
        ([(20, 25), (0, 10), (2, 3)], 15.0),  # unsorted, nested
        ([(5, 5), (0, 1)], 1.0),  # empty intervals add nothing
    ],
)
def test_union_of_intervals(intervals, expected):
    assert trace.union_us(intervals) == expected


def test_busy_time_is_the_union_of_device_activity_only():
    events = launch_and_kernel(1, 0, 100.0) + launch_and_kernel(2, 50, 100.0, lag=10_050)
    events += launch_and_kernel(3, 400, 20.0, cat="gpu_memcpy")  # 10_400..10_420
    events += launch_and_kernel(4, 500, 5.0, cat="gpu_memset", lag=9_915)  # inside the copy
    events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 99_999,
                   "pid": 0, "tid": 1})  # fmt: skip
    busy, counted = trace.busy_us(events)
    # kernels at 10_000..10_100 and 10_100..10_200 (touching), the copy apart, the memset in it
    assert (busy, counted) == (220.0, "GPU activity")
    assert trace.span_us(events) == 420.0


def test_without_device_events_top_level_cpu_ops_stand_in():
    ops = [
        {"ph": "X", "cat": "cpu_op", "name": "outer", "ts": 0, "dur": 100, "pid": 0, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "inner", "ts": 10, "dur": 50, "pid": 0, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "other", "ts": 150, "dur": 30, "pid": 0, "tid": 1},
    ]
    assert trace.busy_us(ops) == (130.0, "CPU ops (no GPU)")


def step_events():
    """One engine step: the target forward (a graph launch: two kernels), the sampler with the
    lm_head inside it, the draft step which calls the lm_head too, and glue in the step."""
    ev = [rng("step", 0, 1000), rng("target", 10, 100), rng("sampling", 200, 100),
          rng("target_logits", 210, 20), rng("draft", 400, 300), rng("target_logits", 450, 20),
          rng("step", 2000, 500)]  # fmt: skip
    ev += launch_and_kernel(1, 20, 40.0, launch="cudaGraphLaunch")
    ev.append({"ph": "X", "cat": "kernel", "name": "graph_k2", "ts": 10_050, "dur": 60.0,
               "pid": 1, "tid": 7, "args": {"correlation": 1}})  # fmt: skip
    ev += launch_and_kernel(2, 215, 30.0)  # lm_head in sample: the target's
    ev += launch_and_kernel(3, 250, 4.0)  # the sampler itself
    ev += launch_and_kernel(4, 455, 25.0)  # lm_head called by the draft: the draft's
    ev += launch_and_kernel(5, 500, 9.0, launch="cuLaunchKernel")  # a Triton kernel in the draft
    ev += launch_and_kernel(6, 900, 2.0, cat="gpu_memcpy", launch="cudaMemcpyAsync")  # glue
    ev += launch_and_kernel(7, 1500, 50.0)  # between steps: no range
    ev += launch_and_kernel(8, 300, 7.0, tid=2)  # another thread: nothing open there
    ev.append(
        {
            "ph": "X",
            "cat": "kernel",
            "name": "orphan",
            "ts": 5,
            "dur": 1.0,
            "pid": 1,
            "tid": 7,
            "args": {"correlation": 99},
        }
    )  # its launch is not in the trace
    return ev


def test_split_by_priority_follows_each_kernels_launch():
    split = trace.by_priority(trace.assign_ranges(step_events()), PRIORITY)
    assert split["kernel_us"]["target"] == 100.0  # both kernels of the graph launched inside it
    assert split["us"] == {
        "target": 90.0,  # ... and overlapping by 10 us on the GPU
        "target_logits": 30.0,
        "sampling": 4.0,
        "draft": 34.0,  # its own kernel and the lm_head it called
        "step": 2.0,
        trace.UNATTRIBUTED: 57.0,  # between steps and on the other thread
    }
    assert split["count"]["target"] == 2
    assert split["top"]["draft"] == {"k4": 25.0, "k5": 9.0}


def test_equal_priorities_go_to_the_innermost_range():
    ev = [rng("outer", 0, 100), rng("inner", 10, 20)] + launch_and_kernel(1, 15, 3.0)
    assert trace.by_priority(trace.assign_ranges(ev), {})["us"] == {"inner": 3.0}


def test_unmatched_kernels_are_counted_not_attributed():
    assigned = trace.assign_ranges(step_events())
    assert assigned["unmatched"] == 1 and assigned["device"]
    assert all(name != "orphan" for _, _, _, _, name, _ in assigned["items"])


def draft_steps():
    ev = []
    for step, t in enumerate((0, 1000)):
        ev += [rng("draft_step", t, 500), rng("layer0.attn", t + 10, 100),
               rng("lm_head", t + 200, 100), rng("markov_walk", t + 300, 150),
               rng("lm_head", t + 310, 20)]  # fmt: skip
        c = 100 * (step + 1)
        ev += launch_and_kernel(c + 1, t + 20, 3.0)  # attn
        ev += launch_and_kernel(c + 2, t + 210, 40.0)  # lm_head
        ev += launch_and_kernel(c + 3, t + 315, 5.0)  # lm_head nested in markov_walk: innermost
        ev += launch_and_kernel(c + 4, t + 400, 7.0)  # markov_walk itself
        ev += launch_and_kernel(c + 5, t + 5, 1.5, cat="gpu_memcpy")  # glue in the step
    ev += launch_and_kernel(999, 2000, 50.0)  # no range
    ev += [rng("context_kv", 3000, 100)] + launch_and_kernel(997, 3010, 2.0)  # outside a step
    return ev


def test_by_step_groups_kernels_per_step_under_their_innermost_range():
    out = trace.by_step(trace.assign_ranges(draft_steps()), "draft_step", "glue")
    assert (
        out["steps"]
        == [
            {
                "glue": [1, 1.5],
                "layer0.attn": [1, 3.0],
                "lm_head": [2, 45.0],
                "markov_walk": [1, 7.0],
            }
        ]
        * 2
    )
    assert out["outside"] == {"context_kv": [1, 2.0]}
    assert out["unattributed"] == [1, 50.0]
    assert out["kernel_names"][0]["lm_head"] == {"k102": [1, 40.0], "k103": [1, 5.0]}


def test_traces_load_from_json_and_gzip(tmp_path):
    events = step_events()
    (tmp_path / "a.pt.trace.json").write_text(json.dumps({"traceEvents": events}))
    with gzip.open(tmp_path / "b.pt.trace.json.gz", "wt") as fh:
        json.dump({"traceEvents": events[:3]}, fh)
    assert trace.load_events(tmp_path / "a.pt.trace.json") == events
    assert trace.load_events(tmp_path / "b.pt.trace.json.gz") == events[:3]
    newest = trace.newest_trace(tmp_path)
    assert newest is not None and newest.name.startswith(("a.", "b."))
    assert trace.newest_trace(tmp_path, after=newest.stat().st_mtime + 60) is None


def test_a_parts_overlapping_kernels_count_once_in_its_time():
    """Kernels of one part on two streams (the shared experts beside the routed ones) overlap:
    the part's time is their union, so the parts add up to the busy time; the plain sum of
    durations is kept beside it."""
    ev = [rng("target", 0, 100), rng("draft", 200, 300)]
    ev += launch_and_kernel(1, 10, 50.0) + launch_and_kernel(2, 20, 50.0)  # runs 10_010..10_070
    ev += launch_and_kernel(3, 210, 30.0)
    split = trace.by_priority(trace.assign_ranges(ev), PRIORITY)
    assert split["us"] == {"target": 60.0, "draft": 30.0}
    assert split["kernel_us"] == {"target": 100.0, "draft": 30.0}
    assert sum(split["us"].values()) == trace.busy_us(ev)[0]


def kernel(name, ts, dur, stream=7):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "pid": 1,
            "tid": stream}  # fmt: skip


@pytest.mark.parametrize(
    "name, family",
    [
        ("void marlin_moe_wna16::Marlin<4, 8>(...)", "MoE experts"),  # MoE before dense Marlin
        ("void vllm::moe::topkGatingSoftmax<float>", "MoE experts"),
        ("void flash::FlashAttnFwdSm90<...>", "attention"),
        ("void vllm::reshape_and_cache_flash_kernel<...>", "attention"),
        ("_chunk_scan_fwd_kernel", "Mamba"),
        ("_selective_scan_update_kernel", "Mamba"),
        ("void humming::gemm_kernel<...>", "other GEMMs"),
        ("nvjet_tst_128x64_64x4", "other GEMMs"),
        ("void marlin::Marlin<...>", "other GEMMs"),
        ("triton_poi_fused_add_rms_norm_0", "rest"),
    ],
)
def test_kernels_are_sorted_into_families_by_name(name, family):
    assert trace.kernel_family(name) == family


def test_kernel_families_sum_each_family_and_rank_the_kernels():
    events = [
        kernel("marlin_moe_wna16::Marlin", 0, 300),
        kernel("marlin_moe_wna16::Marlin", 400, 300),
        kernel("FlashAttnFwdSm90", 700, 100),
        kernel("_chunk_scan_fwd_kernel", 750, 100, stream=8),  # overlaps: busy counts it once
        kernel("triton_poi_fused_add_rms_norm_0", 1000, 50),
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 0, "dur": 5,
         "pid": 0, "tid": 1},  # a launch is not device time
    ]  # fmt: skip
    out = trace.kernel_families(events, top=2)
    assert out["counted"] == "GPU activity"
    assert out["busy_ms"] == pytest.approx((300 + 300 + 150 + 50) / 1e3)
    assert out["span_ms"] == pytest.approx(1.05)
    assert out["families_ms"] == pytest.approx(
        {"MoE experts": 0.6, "attention": 0.1, "Mamba": 0.1, "other GEMMs": 0.0, "rest": 0.05}
    )
    assert out["top_kernels"] == [
        ["marlin_moe_wna16::Marlin", 0.6, 2],
        ["FlashAttnFwdSm90", 0.1, 1],
    ]
