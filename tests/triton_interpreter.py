"""Triton kernel tests on a machine without CUDA.

Triton's interpreter needs TRITON_INTERPRET=1 in the environment BEFORE triton is first imported
(triton.language's own jit helpers are decorated then, and a launch checks it again), which a
pytest session that already imported vLLM cannot give. So a kernel test module runs its kernel
tests in a child pytest process started with TRITON_INTERPRET=1 (:func:`interpreter_run`, judged
by :func:`check_interpreter_run`) and skips them in the parent (:data:`kernel_test`); with CUDA
they run on the GPU in place.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

CUDA = torch.cuda.is_available()
INTERPRETED = not CUDA and os.environ.get("TRITON_INTERPRET") == "1"
RUN_KERNELS = CUDA or INTERPRETED
KERNEL_TEST_SKIP = "CPU: run in the child process of test_kernel_tests_in_triton_interpreter"
kernel_test = pytest.mark.skipif(not RUN_KERNELS, reason=KERNEL_TEST_SKIP)
in_parent_only = pytest.mark.skipif(RUN_KERNELS, reason="the kernel tests run in this process")


def interpreter_run(test_file: str, env: dict) -> subprocess.CompletedProcess:
    """``test_file`` run to the end in a child pytest started from ``env`` with TRITON_INTERPRET=1
    (:func:`check_interpreter_run` judges it)."""
    env = dict(env, TRITON_INTERPRET="1")
    repo = Path(__file__).resolve().parents[1]
    argv = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(test_file)]
    return subprocess.run(argv, cwd=repo, env=env, capture_output=True, text=True, timeout=900)


def check_interpreter_run(proc: subprocess.CompletedProcess) -> None:
    """Assert that the child pytest of :func:`interpreter_run` passed and ran every kernel test
    (none skipped as if it were the parent)."""
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, tail
    summary = proc.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary and "error" not in summary, tail
    assert KERNEL_TEST_SKIP not in proc.stdout, f"the interpreter run skipped kernel tests:\n{tail}"


def nvidia_backend() -> bool:
    """Whether Triton can compile for an NVIDIA target here (offline builds need no GPU)."""
    try:
        import triton.backends.nvidia  # noqa: F401
        from triton.backends.compiler import GPUTarget  # noqa: F401
    except ImportError:
        return False
    return not INTERPRETED
