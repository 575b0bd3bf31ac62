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
    "VLLM_NEMOTRON_SPEC_CACHE": str(_WORK_CACHE / "nemotron-spec"),
    "VLLM_CACHE_ROOT": str(_WORK_CACHE / "vllm"),
    "TORCHINDUCTOR_CACHE_DIR": str(_WORK_CACHE / "torchinductor"),
    "HF_HOME": str(_WORK_CACHE / "hf"),
}.items():
    os.environ.setdefault(_key, _value)

SLOW_ENV = "VLLM_NEMOTRON_SPEC_SLOW_TESTS"


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        f"slow: takes minutes (e.g. rebuilds the tiny family); runs only with {SLOW_ENV}=1",
    )


@pytest.hookimpl(trylast=True)  # after pytest's own ordering by fixture
def pytest_collection_modifyitems(config, items):
    if os.environ.get(SLOW_ENV) != "1":
        skip = pytest.mark.skip(reason=f"slow test; set {SLOW_ENV}=1 to run it")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip)
    if not config.option.collectonly:
        build_family_in_background(items)


FAMILY_FIXTURE = "tiny_family"

_BUILD_FAMILY = """import signal, sys
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # exit through the build's clean-up
from vllm_nemotron_spec.tiny.build import ensure_tiny_family
from vllm_nemotron_spec.tiny.train_draft import ensure_trained_drafts
ensure_trained_drafts(family=ensure_tiny_family(seed=int(sys.argv[1])))
"""

_family_build = None  # the background build's process


def build_family_in_background(items) -> None:
    """On a cold cache the first test that needs the tiny family builds it and trains its drafts
    (~2 minutes on one core). Build them in a background process instead (the cache's file lock
    makes the fixture wait for it, or reuse what it built) and run the files that need neither
    first, so the build overlaps them on another core."""
    global _family_build
    import subprocess

    def uses_family(item) -> bool:
        return FAMILY_FIXTURE in getattr(item, "fixturenames", ())

    with_family = {item.path for item in items if uses_family(item)}
    if not with_family or _family_build is not None:
        return
    items[:] = [i for i in items if i.path not in with_family] + [
        i for i in items if i.path in with_family
    ]
    _WORK_CACHE.mkdir(exist_ok=True)
    with open(_WORK_CACHE / "tiny-family-build.log", "wb") as log:
        _family_build = subprocess.Popen(
            [sys.executable, "-c", _BUILD_FAMILY, os.environ.get(SEED_ENV, "0")],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO_ROOT,
        )


def pytest_sessionfinish(session, exitstatus):
    """A background build still running finishes on its own (the next session reuses it), unless
    the tests were interrupted: then it stops and removes its partial files."""
    if _family_build is None or _family_build.poll() is not None:
        return
    if exitstatus == pytest.ExitCode.INTERRUPTED:
        _family_build.terminate()
        _family_build.wait()
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.ensure_newline()
        reporter.write_line(
            f"tiny family / trained drafts still building in the background (pid "
            f"{_family_build.pid}, log {_WORK_CACHE / 'tiny-family-build.log'})"
        )


SEED_ENV = "VLLM_NEMOTRON_SPEC_TEST_SEED"


@pytest.fixture(scope="session")
def tiny_seed() -> int:
    """The seed of the session's tiny family: ``$VLLM_NEMOTRON_SPEC_TEST_SEED``, default 0."""
    return int(os.environ.get(SEED_ENV, "0"))


@pytest.fixture(scope="session")
def tiny_family(tiny_seed):
    """The tiny family of seed ``tiny_seed`` (the suite must pass for any), built once into the
    cache ``$VLLM_NEMOTRON_SPEC_CACHE`` and reused by later sessions. Treat its files as
    read-only."""
    from vllm_nemotron_spec.tiny.build import ensure_tiny_family

    return ensure_tiny_family(seed=tiny_seed)
