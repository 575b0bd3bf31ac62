"""Shared test fixtures and environment.

The environment below is set before any test module imports vLLM: the real engine runs
in-process on CPU with a small KV cache, nothing is downloaded, and vLLM / torch / HF caches stay
inside the work tree (``/.cache/`` is git-ignored). Values already set in the environment win.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # the package is importable without `pip install -e .`
    sys.path.insert(0, str(REPO_ROOT))

_WORK_CACHE = REPO_ROOT / ".cache"
for _key, _value in {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "NEMOTRON_SPEC_CACHE": str(_WORK_CACHE / "nemotron-spec"),
    "VLLM_CACHE_ROOT": str(_WORK_CACHE / "vllm"),
    "TORCHINDUCTOR_CACHE_DIR": str(_WORK_CACHE / "torchinductor"),
    "HF_HOME": str(_WORK_CACHE / "hf"),
}.items():
    os.environ.setdefault(_key, _value)

SLOW_ENV = "NEMOTRON_SPEC_SLOW_TESTS"


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        f"slow: takes minutes (e.g. rebuilds the tiny family); runs only with {SLOW_ENV}=1",
    )


def pytest_collection_modifyitems(config, items):
    if os.environ.get(SLOW_ENV) == "1":
        return
    skip = pytest.mark.skip(reason=f"slow test; set {SLOW_ENV}=1 to run it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


SEED_ENV = "NEMOTRON_SPEC_TEST_SEED"


@pytest.fixture(scope="session")
def tiny_seed() -> int:
    """The seed of the session's tiny family: ``$NEMOTRON_SPEC_TEST_SEED``, default 0."""
    return int(os.environ.get(SEED_ENV, "0"))


@pytest.fixture(scope="session")
def tiny_family(tiny_seed):
    """The tiny family of seed ``tiny_seed`` (the suite must pass for any), built once into the
    cache ``$NEMOTRON_SPEC_CACHE`` and reused by later sessions. Treat its files as
    read-only."""
    from vllm_nemotron_spec.tiny.build import ensure_tiny_family

    return ensure_tiny_family(seed=tiny_seed)


@pytest.fixture(scope="module")
def jobs():
    """A module's pool for slow work started early (tests/background.py), two jobs at a time."""
    from tests.background import Jobs

    pool = Jobs(workers=2)
    yield pool
    pool.close()
