"""Slow work of a test module started in the background when the module starts.

Most of a ``vllm serve`` start or a ``python`` run of the package is single-threaded (vLLM's
import in each of its processes), so on a small machine two of them side by side take about as
long as one. A module whose tests wait on such processes starts them together, from a
module-scoped fixture that the module's autouse fixture requests (:func:`start_early`); each test
then waits for its own and checks it exactly as before (a directory's conftest may do the same
for the tests under it). Nothing is started for a test that this session does not run (``-k``,
``--deselect``).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest


def selected_items(request: pytest.FixtureRequest, under: Path | None = None) -> list:
    """The tests this session runs of the requesting module, or (``under``) of that directory."""
    if under is None:
        module = request.module
        return [i for i in request.session.items if getattr(i, "module", None) is module]
    return [i for i in request.session.items if Path(i.path).is_relative_to(under)]


def param_selected(request: pytest.FixtureRequest, fixture_name: str, param) -> bool:
    """Whether a test of the requesting module that this session runs gets ``param`` of the
    parametrized fixture ``fixture_name``."""
    return any(
        getattr(item, "callspec", None) is not None
        and item.callspec.params.get(fixture_name, object()) == param
        for item in selected_items(request)
    )


def start_early(request: pytest.FixtureRequest, *fixture_names: str, under: Path | None = None):
    """Set up each of ``fixture_names`` (in this order) that a selected test of the module (or,
    ``under``, of that directory) uses."""
    items = selected_items(request, under)
    for name in fixture_names:
        if any(name in item.fixturenames for item in items):
            request.getfixturevalue(name)


class Jobs:
    """A thread pool for a module's background jobs: at most ``workers`` run at once, in the
    order submitted; :meth:`close` drops those not started yet and waits for the others."""

    def __init__(self, workers: int):
        self._pool = ThreadPoolExecutor(max_workers=workers)

    def submit(self, fn, *args, **kwargs) -> Future:
        return self._pool.submit(fn, *args, **kwargs)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
