"""The CPU smoke runs of the benchmark scenarios (draft-breakdown, serving, anchor and speed),
each a ``benchmarks/run.py`` process that is mostly vLLM's import and start-up (about one core):
they start when the first test of this directory starts, two at a time, while the in-process
tests run (tests/background.py); each test waits for its own run and checks it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.background import Jobs, start_early
from tests.benchmarks import fake_pyspy

REPO = Path(__file__).resolve().parents[2]


def run_py(*args, env: dict, timeout=900):
    cmd = [sys.executable, str(REPO / "benchmarks" / "run.py"), *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)


@pytest.fixture(scope="session")
def smoke_jobs():
    jobs = Jobs(workers=2)
    yield jobs
    jobs.close()


def _smoke(jobs, base: Path, name: str, *args, env_over: dict | None = None):
    """``run.py NAME --smoke --out BASE/out --models-dir BASE/m ARGS``, submitted: a future of
    ``(out, the finished process)``."""
    out, env = base / "out", {**os.environ, **(env_over or {})}
    argv = (name, "--smoke", "--out", out, "--models-dir", base / "m", *args)
    return jobs.submit(lambda: (out, run_py(*argv, env=env)))


@pytest.fixture(scope="session")
def draft_breakdown_run(smoke_jobs, tmp_path_factory):
    return _smoke(smoke_jobs, tmp_path_factory.mktemp("draft-breakdown"), "draft-breakdown")


@pytest.fixture(scope="session")
def serving_run(smoke_jobs, tmp_path_factory):
    base = tmp_path_factory.mktemp("serving")
    return _smoke(smoke_jobs, base, "serving", "--arms", "dspark3-plugin")


@pytest.fixture(scope="session")
def anchor_run(smoke_jobs, tmp_path_factory):
    base = tmp_path_factory.mktemp("anchor")
    return _smoke(smoke_jobs, base, "anchor", "--arms", "dflash5-plugin", "--input-len", "200",
                  "--profile-steps", "2", "--profile-skip-steps", "1")  # fmt: skip


@pytest.fixture(scope="session")
def speed_run(smoke_jobs, tmp_path_factory):
    base = tmp_path_factory.mktemp("speed")
    # tune's schedule for the tiny DSpark: block 3, k 3 alone, k 1 from two requests on
    schedule = base / "schedule.json"
    schedule.write_text(
        json.dumps(
            {
                "method": "dspark",
                "model": "/d",
                "num_speculative_tokens": 3,
                "num_speculative_tokens_per_batch_size": [[1, 1, 3], [2, 64, 1]],
            }
        )
    )
    return _smoke(smoke_jobs, base, "speed", "--concurrency", "2", "--steps", "3",
                  "--profile-steps", "2", "--warmup-steps", "1", "--arms", "dspark3,plain,tuned",
                  "--schedule", schedule)  # fmt: skip


@pytest.fixture(scope="session")
def speed_variant_run(smoke_jobs, tmp_path_factory):
    """The plugin's DSpark engine beside its variant: another seed, an environment variable
    that vLLM names in its log (an unknown ``VLLM_`` one), and the variant's lane pinned to the
    first CPU this process may use; every wall window sampled by a stand-in py-spy
    (``fake_pyspy``) first on PATH."""
    base = tmp_path_factory.mktemp("speed-variant")
    first_cpu = min(os.sched_getaffinity(0))
    fake_pyspy.install(base / "bin")
    return _smoke(smoke_jobs, base, "speed", "--concurrency", "1", "--steps", "3",
                  "--profile-steps", "0", "--warmup-steps", "1", "--arms", "dspark3-plugin",
                  "--variant-engine-arg", "seed=7", "--variant-env", "VLLM_SPEED_VARIANT_PROBE=1",
                  "--variant-env", f"BENCH_LANE_CPUS={first_cpu}", "--host-profile", "200",
                  env_over={"PATH": fake_pyspy.path_with(base / "bin")})  # fmt: skip


@pytest.fixture(scope="session", autouse=True)
def _start_smoke_runs(request):
    start_early(
        request,
        "draft_breakdown_run",
        "serving_run",
        "anchor_run",
        "speed_run",
        "speed_variant_run",
        under=Path(__file__).parent,
    )
