"""``patches.when_imported``: a patch is installed when its upstream module is first imported
(before the importer sees the module), or at once when it already is; and registering the plugin
does not import the V1 runner or the scheduler (checked in a fresh interpreter)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types

from vllm_nemotron_spec import patches
from vllm_nemotron_spec.patches import replace_when_imported, when_imported


def test_hook_runs_after_the_first_import_before_the_importer_binds(tmp_path, monkeypatch):
    (tmp_path / "nsp_upstream_mod.py").write_text("def f():\n    return 'upstream'\n")
    (tmp_path / "nsp_importer_mod.py").write_text("from nsp_upstream_mod import f\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("nsp_upstream_mod", "nsp_importer_mod"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    seen = []

    def install(module):
        seen.append(module.__name__)
        module.f = lambda: "patched"

    when_imported("nsp_upstream_mod", install)
    assert seen == [] and "nsp_upstream_mod" not in sys.modules
    import nsp_importer_mod  # noqa: F401  (imports the upstream module)

    assert seen == ["nsp_upstream_mod"]
    assert nsp_importer_mod.f() == "patched", "the importer bound the unpatched symbol"
    upstream = sys.modules["nsp_upstream_mod"]
    assert type(upstream.__loader__).__name__ != "_InstallingLoader"  # loader restored
    import inspect

    assert "upstream" in inspect.getsource(upstream)  # source lookups still work
    when_imported("nsp_upstream_mod", install)  # already imported: runs at once
    assert seen == ["nsp_upstream_mod", "nsp_upstream_mod"]


def test_registering_the_plugin_leaves_runner_and_scheduler_unimported_until_used():
    code = textwrap.dedent("""
        import sys
        import vllm.config
        from vllm_nemotron_spec import plugin
        plugin.register()
        heavy = ("vllm.v1.worker.gpu_model_runner", "vllm.v1.core.sched.scheduler")
        print("IMPORTED", [m for m in heavy if m in sys.modules])
        import vllm.v1.core.sched.scheduler as s
        import vllm.v1.worker.gpu_model_runner as g
        print("PATCHED", getattr(g.GPUModelRunner.__init__, "_nemotron_spec_patch", False),
              getattr(s.Scheduler.schedule, "_nemotron_spec_patch", False))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "IMPORTED []" in out.stdout, out.stdout
    assert "PATCHED True True" in out.stdout, out.stdout


def _accept_any_code(monkeypatch, patch, module_name, qualname):
    """Give a test patch a TARGETS entry that matches whatever code the test module has."""
    monkeypatch.setattr(patches, "fingerprint", lambda obj: "0" * 16)
    monkeypatch.setitem(
        patches._targets,
        patch,
        {f"{module_name}.{qualname}": patches.Target(module_name, qualname, {"0" * 16: "t"})},
    )


def test_replace_when_imported_marks_the_replacement_and_a_failing_make_leaves_upstream(
    monkeypatch,
):
    module = types.ModuleType("nsp_replace_mod")
    module.f = upstream = lambda: "upstream"
    monkeypatch.setitem(sys.modules, "nsp_replace_mod", module)
    for name in ("nsp_fails", "nsp_ok"):
        _accept_any_code(monkeypatch, name, "nsp_replace_mod", "f")

    def renamed_upstream(current):
        raise AttributeError("upstream renamed what the patch needs")

    replace_when_imported("nsp_fails", "nsp_replace_mod", None, "f", renamed_upstream)
    assert module.f is upstream and not hasattr(upstream, "_nemotron_spec_patch")
    assert patches.state("nsp_fails").startswith("not installed: AttributeError")
    assert "upstream renamed" in patches.state("nsp_fails")
    replace_when_imported("nsp_ok", "nsp_replace_mod", None, "f", lambda current: lambda: "ok")
    patched = module.f
    assert patched() == "ok" and patched._nemotron_spec_patch and patched.__wrapped__ is upstream
    assert patches.is_installed("nsp_ok")
    replace_when_imported("nsp_ok", "nsp_replace_mod", None, "f", lambda current: lambda: "again")
    assert module.f is patched  # idempotent: the plugin's replacement is kept


def test_a_failing_install_never_breaks_the_upstream_import(tmp_path, monkeypatch):
    (tmp_path / "nsp_broken_upstream.py").write_text("def g():\n    return 'upstream'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "nsp_broken_upstream", raising=False)
    _accept_any_code(monkeypatch, "nsp_broken", "nsp_broken_upstream", "no_such_symbol")
    replace_when_imported(
        "nsp_broken", "nsp_broken_upstream", None, "no_such_symbol", lambda current: current
    )
    assert patches.state("nsp_broken").startswith("pending")  # waits for the import
    import nsp_broken_upstream

    assert nsp_broken_upstream.g() == "upstream"
    assert patches.state("nsp_broken").startswith("not installed")
    assert "nsp_broken_upstream.no_such_symbol does not exist" in patches.state("nsp_broken")
