"""``python -m vllm_nemotron_spec.patches``: every patch target's fingerprint on a vLLM.

For reviewing a new vLLM release: a target marked ``CHANGED`` has code its patch was not checked
against (the patch will not install there). Read that symbol's new code against the patch; when
the patch still holds, add the printed fingerprint to the patch's ``TARGETS`` with the version.
Exit status 1 when any target changed, is missing or (``--source``) cannot be resolved.

By default the installed vLLM is imported. ``--source DIR`` reads a vLLM source tree instead (an
unpacked sdist or a git checkout: the directory holding the ``vllm`` package) without importing
it, so that a GPU release can be reviewed on a machine that cannot install it. A symbol is found
as Python would bind it: defined in its module (at top level or under a top-level ``if``/``try``),
imported there with ``from ... import``, or, for a method, inherited from a base class found the
same way. A name bound more than once in a module (a GPU definition and a CPU one chosen at import)
or only by assignment is reported ``UNSURE``: the source does not say which code runs.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import re
import sys
from pathlib import Path

from vllm_nemotron_spec import patches

_DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


class SourceTree:
    """A vLLM source tree read with ``ast`` only: a symbol's syntax tree by module and qualname."""

    def __init__(self, root: Path):
        self.root = root
        self._parsed: dict[str, ast.Module | None] = {}

    def version(self) -> str:
        """The version its ``vllm/_version.py`` or ``PKG-INFO`` names, else ``unknown``."""
        for path, pattern in (
            (self.root / "vllm" / "_version.py", r"^__version__ = version = '([^']+)'"),
            (self.root / "PKG-INFO", r"^Version: (\S+)"),
        ):
            if path.is_file():
                match = re.search(pattern, path.read_text(), re.M)
                if match:
                    return match.group(1)
        return "unknown"

    def module(self, name: str) -> ast.Module | None:
        if name not in self._parsed:
            rel = Path(*name.split("."))
            paths = (self.root / rel.with_suffix(".py"), self.root / rel / "__init__.py")
            path = next((p for p in paths if p.is_file()), None)
            self._parsed[name] = ast.parse(path.read_text()) if path else None
        return self._parsed[name]

    def lookup(self, module: str, qualname: str) -> ast.AST | None:
        """The definition ``getattr`` would reach from ``module`` along ``qualname``, or None."""
        first, *rest = qualname.split(".")
        found = self._binding(module, first, depth=0)
        for part in rest:
            if found is None or not isinstance(found[1], ast.ClassDef):
                return None
            found = self._member(*found, part, depth=0)
        return found[1] if found else None

    def _binding(self, module: str, name: str, depth: int) -> tuple[str, ast.AST] | None:
        tree = self.module(module)
        if tree is None or depth > 16:
            return None
        bindings = [n for n in _top_level(tree.body) if _binds(n, name)]
        if len(bindings) > 1:  # e.g. a GPU definition and a CPU one chosen at import
            lines = ", ".join(str(n.lineno) for n in bindings)
            raise Unresolved(f"{module}.{name} is bound {len(bindings)} times (lines {lines})")
        if not bindings:
            return None
        node = bindings[0]
        if isinstance(node, _DEFINITIONS):
            return module, node
        if isinstance(node, ast.ImportFrom):
            alias = next(a for a in node.names if (a.asname or a.name) == name)
            source = _absolute(module, node, is_package=self._is_package(module))
            return self._binding(source, alias.name, depth + 1)
        raise Unresolved(f"{module}.{name} is assigned (line {node.lineno}), not defined")

    def _member(
        self, module: str, cls: ast.ClassDef, name: str, depth: int
    ) -> tuple[str, ast.AST] | None:
        hits = [n for n in cls.body if isinstance(n, _DEFINITIONS) and n.name == name]
        if hits:
            return module, hits[-1]
        if depth > 16:
            return None
        for base in cls.bases:  # depth first, left to right: the MRO of single inheritance
            if isinstance(base, ast.Name):
                found = self._binding(module, base.id, depth + 1)
                if found and isinstance(found[1], ast.ClassDef):
                    member = self._member(*found, name, depth + 1)
                    if member:
                        return member
        return None

    def _is_package(self, module: str) -> bool:
        return (self.root / Path(*module.split(".")) / "__init__.py").is_file()


class Unresolved(LookupError):
    """The source alone does not say which code a name is bound to at run time."""


def _binds(node: ast.stmt, name: str) -> bool:
    if isinstance(node, _DEFINITIONS):
        overload = any(
            (isinstance(d, ast.Name) and d.id == "overload")
            or (isinstance(d, ast.Attribute) and d.attr == "overload")
            for d in node.decorator_list
        )
        return node.name == name and not overload
    if isinstance(node, ast.ImportFrom):
        return any((a.asname or a.name) == name for a in node.names)
    if isinstance(node, ast.Assign):
        return any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
    if isinstance(node, ast.AnnAssign):
        return isinstance(node.target, ast.Name) and node.target.id == name and bool(node.value)
    return False


def _top_level(body: list[ast.stmt]):
    """Statements run at import: the body, and the branches of top-level ``if`` and ``try``."""
    for node in body:
        yield node
        if isinstance(node, ast.If):
            yield from _top_level(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            yield from _top_level(node.body + node.orelse + node.finalbody)
            for handler in node.handlers:
                yield from _top_level(handler.body)


def _absolute(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def verdict(target: patches.Target, found: str) -> str:
    if found in target.checked:
        return f"ok       {target.where} {found} (as on {target.checked[found]})"
    if found in target.fixed_upstream:
        fixed = target.fixed_upstream[found]
        return f"fixed    {target.where} {found} (upstream fix, as on {fixed})"
    return f"CHANGED  {target.where} {found}"


def describe(patch: patches.Patch, tree: SourceTree | None = None) -> list[str]:
    module = importlib.import_module(f"{patches.__name__}.{patch.name}")
    lines = []
    for target in getattr(module, "TARGETS", ()):
        try:
            found = _fingerprint(target, tree)
        except Unresolved as e:
            lines.append(f"  UNSURE   {target.where}: {e}: read it, or review the installed vLLM")
            continue
        except (AttributeError, ModuleNotFoundError, LookupError) as e:
            if target.absent_upstream:  # allowed: nothing needs the patch there
                lines.append(f"  absent   {target.where} (not needed: {target.absent_upstream})")
            else:
                lines.append(f"  MISSING  {target.where}: {e}")
            continue
        except Exception as e:  # missing module, no source
            lines.append(f"  MISSING  {target.where}: {type(e).__name__}: {e}")
            continue
        lines.append("  " + verdict(target, found))
    return lines


def _fingerprint(target: patches.Target, tree: SourceTree | None) -> str:
    if tree is None:
        obj = patches._lookup(importlib.import_module(target.module), target.qualname)
        return patches.fingerprint(getattr(obj, "__wrapped__", obj))
    node = tree.lookup(target.module, target.qualname)
    if node is None:
        raise LookupError("not in the source tree")
    return patches.fingerprint_node(node)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_nemotron_spec.patches",
        description="Print each patch target's fingerprint on a vLLM and whether a patch was "
        "checked against that code (CHANGED: not; MISSING: the symbol is gone). Exit status 1 "
        "when any target changed or is missing (or, with --source, is UNSURE: bound more than "
        "once in its module, e.g. per platform).",
    )
    parser.add_argument(
        "--source",
        metavar="DIR",
        type=Path,
        help="review the vLLM source tree in DIR (the directory holding the `vllm` package, "
        "e.g. an unpacked sdist) without importing it, instead of the installed vLLM",
    )
    args = parser.parse_args(argv)
    tree = None
    if args.source is not None:
        if not (args.source / "vllm" / "__init__.py").is_file():
            parser.error(f"--source {args.source}: no vllm/__init__.py there")
        tree = SourceTree(args.source)
        print(f"vLLM {tree.version()} (source tree {args.source})")
    else:
        print(f"vLLM {patches.vllm_version()}")
    bad = False
    for patch in patches.PATCHES:
        lines = describe(patch, tree)
        bad |= any(line.lstrip().startswith(("CHANGED", "MISSING", "UNSURE")) for line in lines)
        print(f"{patch.name} ({'CPU only' if patch.cpu_only else 'all platforms'})")
        print("\n".join(lines) if lines else "  (no vLLM symbol)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
