"""The package's import structure: no import cycles, no runtime module reaches the tiny test
family (``tiny/`` serves the demo, ``make-tiny``, tests and benchmarks only), and one HTTP client.
Imports are read from the source (module level and inside functions alike), so a lazy import
counts too."""

from __future__ import annotations

import ast
from pathlib import Path

import vllm_nemotron_spec

PACKAGE = Path(vllm_nemotron_spec.__file__).parent
NAME = "vllm_nemotron_spec"

# What vLLM loads at serve time, and the quantizer: none of it may depend on the tiny family.
RUNTIME = (
    "plugin",
    "target_hook",
    "attention",
    "checkpoint",
    "nvfp4",
    "models",
    "proposers",
    "kernels",
    "patches",
    "quantize",
    "_torch",
)


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports_of(path: Path, known: set[str]) -> set[str]:
    """The package modules ``path`` imports, at any level of the file."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text("utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            # "from pkg import sub" imports the submodule; "from pkg import name" the package.
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            ]
        else:
            continue
        out.update(t for t in targets if t in known and t != name)
    return out


def import_graph() -> dict[str, set[str]]:
    files = sorted(PACKAGE.rglob("*.py"))
    known = {_module_name(f) for f in files}
    return {_module_name(f): _imports_of(f, known) for f in files}


def _reachable(graph, start):
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (as a list of modules, the first repeated last), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_find_cycle_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_the_graph_sees_lazy_imports():
    graph = import_graph()
    assert len(graph) > 40
    assert f"{NAME}.tiny.build" in graph[f"{NAME}.cli.make_tiny"]  # imported inside a function
    assert f"{NAME}.bench" in graph[f"{NAME}.cli.bench"]  # likewise
    assert f"{NAME}.bench.client" in graph[f"{NAME}.bench.server"]


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_bench_submodules_never_import_their_package():
    """``bench/__init__`` imports its submodules, so none of them may import the package."""
    graph = import_graph()
    bench = [m for m in graph if m.startswith(f"{NAME}.bench.")]
    assert len(bench) >= 7
    assert not [m for m in bench if f"{NAME}.bench" in graph[m]]


def test_runtime_modules_never_import_the_tiny_family():
    graph = import_graph()
    runtime = [
        m for m in graph if any(m == f"{NAME}.{r}" or m.startswith(f"{NAME}.{r}.") for r in RUNTIME)
    ]
    assert len(runtime) > 20
    offenders = {
        m: sorted(t for t in _reachable(graph, m) if t.startswith(f"{NAME}.tiny")) for m in runtime
    }
    assert not {m: t for m, t in offenders.items() if t}


def test_one_http_client():
    """Only bench/client.py talks HTTP (urllib / http.client)."""
    users = sorted(
        _module_name(f)
        for f in PACKAGE.rglob("*.py")
        if any(word in f.read_text("utf-8") for word in ("urllib.request", "http.client"))
    )
    assert users == [f"{NAME}.bench.client"]


CHECKPOINT_STEPS = ("layout", "spec", "headers", "check", "inspect")
"""The checkpoint package in reading order: the layout, parse (spec), read (headers), check,
report (inspect)."""


def test_the_checkpoint_package_reads_in_one_direction():
    """Each checkpoint module imports only the steps before it, and only the ``inspect`` command
    imports the report: the runtime (target hook, draft models, proposers) and ``quantize`` use
    the check."""
    graph = import_graph()
    steps = [f"{NAME}.checkpoint.{step}" for step in CHECKPOINT_STEPS]
    for i, module in enumerate(steps):
        later = graph[module] & set(steps[i + 1 :])
        assert not later, f"{module} imports the later step(s) {sorted(later)}"
    report = f"{NAME}.checkpoint.inspect"
    assert sorted(m for m, deps in graph.items() if report in deps) == [f"{NAME}.cli.inspect"]
