"""benchmarks/gpu_draft_breakdown.py: attribution of kernels (and CPU ops) to the innermost range
open at their launch, step splitting, module-name matching and the floor arithmetic, on made-up
profiler traces (pure Python, no vLLM)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_draft_breakdown.py"
sys.path.insert(0, str(_PATH.parent))
_spec = importlib.util.spec_from_file_location("gpu_draft_breakdown", _PATH)
bd = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("gpu_draft_breakdown", bd)
_spec.loader.exec_module(bd)

P = bd.RANGE_PREFIX


def rng(name, ts, dur, tid=1):
    return {
        "ph": "X",
        "cat": "user_annotation",
        "name": P + name,
        "ts": ts,
        "dur": dur,
        "pid": 0,
        "tid": tid,
    }


def launch_and_kernel(corr, ts, kdur, tid=1, cat="kernel"):
    """A runtime launch at ``ts`` on thread ``tid`` and its kernel, which runs much later (as
    on a GPU that lags the CPU): attribution must follow the launch, not the kernel's time."""
    return [
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 1,
         "pid": 0, "tid": tid, "args": {"correlation": corr}},
        {"ph": "X", "cat": cat, "name": f"k{corr}", "ts": ts + 10_000, "dur": kdur,
         "pid": 1, "tid": 7, "args": {"correlation": corr}},
    ]  # fmt: skip


def two_steps():
    ev = []
    for step, t in enumerate((0, 1000)):
        ev += [rng("draft_step", t, 500), rng("layer0.attn", t + 10, 100), rng("lm_head", t + 200, 100),
               rng("markov_walk", t + 300, 150), rng("lm_head", t + 310, 20)]  # fmt: skip
        c = 100 * (step + 1)
        ev += launch_and_kernel(c + 1, t + 20, 3.0)  # attn
        ev += launch_and_kernel(c + 2, t + 210, 40.0)  # lm_head
        ev += launch_and_kernel(c + 3, t + 315, 5.0)  # lm_head nested in markov_walk: innermost
        ev += launch_and_kernel(c + 4, t + 400, 7.0)  # markov_walk itself
        ev += launch_and_kernel(c + 5, t + 5, 1.5, cat="gpu_memcpy")  # glue in the step
    ev += launch_and_kernel(999, 2000, 50.0)  # the target: no range
    ev += launch_and_kernel(998, 1020, 9.0, tid=2)  # another thread: no range there
    ev += [rng("context_kv", 3000, 100)] + launch_and_kernel(997, 3010, 2.0)  # outside a step
    return ev


def test_kernels_go_to_the_innermost_range_of_their_launch():
    a = bd.attribute(two_steps(), device=True)
    assert len(a["steps"]) == 2
    for s in a["steps"]:
        assert s == {"layer0.attn": [1, 3.0], "lm_head": [2, 45.0], "markov_walk": [1, 7.0],
                     bd.OTHER: [1, 1.5]}  # fmt: skip
    assert a["unattributed"] == [2, 59.0]
    assert a["outside"] == {"context_kv": [1, 2.0]}


def test_kernels_are_named_per_part_over_the_kept_steps():
    a = bd.attribute(two_steps(), device=True)
    assert a["kernel_names"][0]["lm_head"] == {"k102": [1, 40.0], "k103": [1, 5.0]}
    s = bd.summarize(a, skip_first=1, skip_last=0, floors_bytes={}, bandwidth_gbs=4300.0)
    rows = {r["part"]: r for r in s["rows"]}
    assert rows["lm_head"]["top_kernels"] == [
        {"name": "k202", "us_per_step": 40.0, "per_step": 1.0},
        {"name": "k203", "us_per_step": 5.0, "per_step": 1.0},
    ]
    assert bd._short("void f<int, g<2>>(float)") == "void f(float)"


def test_unmatched_kernels_are_counted():
    ev = two_steps() + [{"ph": "X", "cat": "kernel", "name": "orphan", "ts": 5, "dur": 4.0,
                         "pid": 1, "tid": 7, "args": {"correlation": 12345}}]  # fmt: skip
    assert bd.attribute(ev, device=True)["unattributed"][0] == 3


def test_cpu_mode_attributes_top_level_ops_only():
    ev = [rng("draft_step", 0, 100), rng("layer0.mlp", 10, 50)]
    op = {"ph": "X", "cat": "cpu_op", "pid": 0, "tid": 1}
    ev += [{**op, "name": "aten::linear", "ts": 12, "dur": 20}, {**op, "name": "aten::mm", "ts": 13, "dur": 18},
           {**op, "name": "aten::argmax", "ts": 70, "dur": 5}]  # fmt: skip
    a = bd.attribute(ev, device=False)
    assert a["steps"] == [{"layer0.mlp": [1, 20.0], bd.OTHER: [1, 5.0]}]


def test_summary_skips_steps_and_computes_floors():
    a = {"steps": [{"lm_head": [1, 1000.0]}] + [{"lm_head": [2, 200.0], bd.OTHER: [1, 100.0]}] * 3
         + [{"lm_head": [1, 9999.0]}], "outside": {}, "unattributed": [0, 0.0]}  # fmt: skip
    floors = {"lm_head": 131072 * 2688 * 2, "embed": 0}
    s = bd.summarize(a, skip_first=1, skip_last=1, floors_bytes=floors, bandwidth_gbs=4300.0)
    assert s["steps_profiled"] == 5 and s["steps_kept"] == 3
    rows = {r["part"]: r for r in s["rows"]}
    assert rows["lm_head"]["gpu_ms_per_step"] == pytest.approx(0.2)
    assert rows["lm_head"]["kernels_per_step"] == pytest.approx(2.0)
    assert rows["lm_head"]["floor_ms"] == pytest.approx(704643072 / 4.3e12 * 1e3)  # 0.1639 ms
    assert rows["lm_head"]["ratio"] == pytest.approx(0.2 / (704643072 / 4.3e12 * 1e3))
    assert rows["embed"]["gpu_ms_per_step"] == 0 and rows["embed"]["ratio"] is None
    assert s["total_ms_per_step"] == pytest.approx(0.3)
    assert s["total_floor_ms"] == pytest.approx(rows["lm_head"]["floor_ms"])
    assert [r["part"] for r in s["rows"]] == ["embed", "lm_head", bd.OTHER]


def test_floor_arithmetic():
    assert bd.floor_ms_of(4.3e9, 4300.0) == pytest.approx(1.0)
    assert bd.floor_ms_of(0, 4300.0) == 0


@pytest.mark.parametrize(
    "name, part",
    [("model.embed_tokens", "embed"), ("model.fc", "context_kv"), ("model.hidden_norm", "context_kv"),
     ("model.layers.3.self_attn", "layer3.attn"), ("model.layers.5.mlp", "layer5.mlp"),
     ("model.layers.0.input_layernorm", "layer0.norms"), ("model.norm", "final_norm"),
     ("lm_head", "lm_head"), ("model.markov_head", "markov_walk"),
     ("model.layers.3.self_attn.qkv_proj", None), ("model.layers.3", None), ("model", None),
     ("model.markov_head.markov_w2", None)],
)  # fmt: skip
def test_module_names_map_to_parts(name, part):
    assert bd.module_part(name) == part


def test_the_draft_model_is_found_from_the_engine_object():
    torch = pytest.importorskip("torch")

    class Inner(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2)])

    class FakeDSparkForCausalLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model, self.lm_head = Inner(), torch.nn.Linear(2, 2)

    class TargetForCausalLM(FakeDSparkForCausalLM):  # not a draft by its name
        pass

    class Node:
        pass

    draft, root = FakeDSparkForCausalLM(), Node()
    root.engine = Node()
    root.engine.blocks = [Node() for _ in range(1000)]  # big containers are not walked
    root.engine.runner = Node()
    root.engine.runner.model = TargetForCausalLM()
    root.engine.runner.speculator = Node()
    root.engine.runner.speculator.model = draft
    assert bd.find_draft_models(root) == [draft]
    # not reachable from the root: found through the garbage collector (vLLM freezes it)
    assert bd.find_draft_models(root.engine.runner.model) == [draft]
