"""A stand-in ``py-spy`` for the tests (the real one needs the right to read another process's
memory, which a test machine need not grant): ``py-spy record ... -o FILE`` says it is
sampling, waits for Ctrl-C as py-spy does, and writes raw stacks shaped as the harness's timed
window over vLLM's engine step (:data:`STACKS`). ``FAKE_PYSPY_FAIL`` makes it refuse to attach,
as py-spy does without the permission; ``FAKE_PYSPY_SILENT`` makes it hang without a word;
``FAKE_PYSPY_WARN`` makes it warn on stderr before it says it is sampling."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

WINDOW = "OfflineEngine._timed (benchmarks/harness/offline.py:252)"
STEP = "LLMEngine.step (vllm/v1/engine/llm_engine.py:327)"
OUTER = "lane_main (benchmarks/harness/lanes.py:91);run_window (benchmarks/harness/offline.py:348)"
STACKS = {  # stack -> samples
    f"{OUTER};{WINDOW};{STEP};execute_model (vllm/v1/worker/gpu/model_runner.py:10);"
    "build (vllm/v1/attention/backends/mamba2_attn.py:168)": 25,
    f"{OUTER};{WINDOW};{STEP};execute_model (vllm/v1/worker/gpu/model_runner.py:11)": 15,
    f"{OUTER};{WINDOW};{STEP};sample_tokens (vllm/v1/worker/gpu/model_runner.py:20)": 20,
    f"{OUTER};{WINDOW};_step (benchmarks/harness/offline.py:150)": 4,
    f"{OUTER};OfflineEngine._past_prefill (benchmarks/harness/offline.py:238);{STEP}": 50,
}

SCRIPT = """#!{python}
import os, signal, sys, time
args = sys.argv[1:]
if os.environ.get("FAKE_PYSPY_SILENT"):
    time.sleep(60)
if os.environ.get("FAKE_PYSPY_FAIL"):
    print("Error: Permission Denied: Try running again with elevated permissions", file=sys.stderr)
    sys.exit(1)
out = args[args.index("-o") + 1]
stop = []
signal.signal(signal.SIGINT, lambda *a: stop.append(1))
if os.environ.get("FAKE_PYSPY_WARN"):
    print("py-spy> Warning: a thread's stack could not be read", file=sys.stderr, flush=True)
# as py-spy: its messages on stdout (Rust's println!, line-buffered), its errors on stderr
print("py-spy> Sampling process 400 times a second. Press Control-C to exit.", flush=True)
while not stop:
    time.sleep(0.01)
with open(out, "w") as f:
    f.write({stacks!r})
print("py-spy> Wrote raw flamegraph data")
"""


def raw() -> str:
    """:data:`STACKS` in py-spy's raw format, as the stand-in writes them."""
    return "".join(f"{k} {v}\n" for k, v in STACKS.items())


def install(bin_dir: Path) -> Path:
    """Write the stand-in as ``BIN_DIR/py-spy``; put BIN_DIR first on PATH to use it."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    exe = bin_dir / "py-spy"
    exe.write_text(SCRIPT.format(python=sys.executable, stacks=raw()))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return exe


def path_with(bin_dir: Path) -> str:
    return f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
