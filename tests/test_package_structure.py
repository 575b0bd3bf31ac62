"""The package's import structure: no import cycles, and no runtime module reaches the tiny test
family (``tiny/`` serves the demo, ``make-tiny``, tests and benchmarks only). Imports are read
from the source (module level and inside functions alike), so a lazy import counts too."""

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


def import_graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                submodules = [
                    f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules
                ]
                targets = submodules or [base]  # ``from pkg import mod`` depends on mod
            else:
                continue
            edges |= {t for t in targets if t in modules and t != name}
        graph[name] = edges
    return graph


def _reachable(graph, start):
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_no_import_cycles():
    graph = import_graph()
    cycles = sorted(m for m in graph if m in _reachable(graph, m))
    assert not cycles, f"modules on an import cycle: {cycles}"


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


def test_the_graph_sees_lazy_imports():
    graph = import_graph()
    assert f"{NAME}.tiny.build" in graph[f"{NAME}.cli.make_tiny"]  # imported inside a function
