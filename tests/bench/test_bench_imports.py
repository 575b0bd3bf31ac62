"""The package's import graph has no cycles (function-level imports included), the ``bench``
package's neither, and there is one HTTP client: nothing else in the package opens URLs."""

from __future__ import annotations

import ast
from pathlib import Path

import vllm_nemotron_spec

ROOT = Path(vllm_nemotron_spec.__file__).parent
PACKAGE = "vllm_nemotron_spec"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The package modules ``path`` imports, at any level of the file (lazy imports count)."""
    name = module_name(path)
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text("utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # "from pkg import sub" imports the submodule; "from pkg import name" the package.
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            ]
        else:
            continue
        out.update(t for t in targets if t in known and t != name)
    return out


def import_graph() -> dict[str, set[str]]:
    files = sorted(ROOT.rglob("*.py"))
    known = {module_name(f) for f in files}
    return {module_name(f): imports_of(f, known) for f in files}


def find_cycle(graph: dict[str, set[str]], nodes: set[str]) -> list[str] | None:
    """One cycle through ``nodes`` (as a list of modules), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in nodes:
                continue
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(nodes):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_graph_sees_lazy_imports():
    graph = import_graph()
    # cli.bench imports the package only inside functions.
    assert f"{PACKAGE}.bench" in graph[f"{PACKAGE}.cli.bench"]
    assert f"{PACKAGE}.bench.client" in graph[f"{PACKAGE}.bench.server"]


def test_find_cycle_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}, {"a", "b", "c"}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}}, {"a", "b", "c"}) is None


def test_bench_package_has_no_import_cycle():
    graph = import_graph()
    bench = {m for m in graph if m == f"{PACKAGE}.bench" or m.startswith(f"{PACKAGE}.bench.")}
    assert len(bench) >= 7
    # Every module the bench package reaches, so a cycle through another module counts too.
    reach, todo = set(), list(bench)
    while todo:
        m = todo.pop()
        if m not in reach:
            reach.add(m)
            todo.extend(graph.get(m, ()))
    cycle = find_cycle(graph, reach)
    assert cycle is None, " -> ".join(cycle)
    # The submodules never import the package itself (its __init__ imports them).
    for m in bench - {f"{PACKAGE}.bench"}:
        assert f"{PACKAGE}.bench" not in graph[m], m


def test_package_has_no_import_cycle():
    graph = import_graph()
    cycle = find_cycle(graph, set(graph))
    assert cycle is None, " -> ".join(cycle)


def test_one_http_client():
    """Only bench/client.py talks HTTP (urllib / http.client)."""
    users = sorted(
        module_name(f)
        for f in ROOT.rglob("*.py")
        if any(word in f.read_text("utf-8") for word in ("urllib.request", "http.client"))
    )
    assert users == [f"{PACKAGE}.bench.client"]
