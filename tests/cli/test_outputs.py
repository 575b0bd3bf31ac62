"""Commands that write files never destroy what they did not create.

``quantize``, ``make-tiny`` (and ``demo`` / ``bench --family-dir``, which build the family the same
way) and ``bench --plot`` build their output next to the destination and move it into place at
the end; ``--force`` replaces only an empty directory or the tool's own earlier output. Every
refusal and bad argument is one line on stderr with exit status 2. No test here starts vLLM.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests import draft_configs as dc
from vllm_nemotron_spec import outputs
from vllm_nemotron_spec.cli.main import main

REPO = Path(__file__).resolve().parents[2]


def snapshot(root: Path) -> dict[str, str]:
    """Relative path -> SHA-256 of every file under ``root`` (hidden ones included)."""
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def run_cli(*argv, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vllm_nemotron_spec.cli.main", *map(str, argv)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
    )


def assert_one_line_refusal(result: subprocess.CompletedProcess, *texts: str) -> str:
    """Exit status 2, exactly one line on stderr containing every text, no traceback."""
    lines = result.stderr.splitlines()
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert len(lines) == 1, result.stderr
    for text in texts:
        assert text in lines[0], (text, lines[0])
    return lines[0]


@pytest.fixture()
def parent(tmp_path):
    """``parent/src``: a small BF16 DFlash draft (with a tokenizer file) and an unrelated file
    ``parent/notes.txt``."""
    root = tmp_path / "parent"
    cfg = dc.mutated(dc.dflash_config(dc.SMALL), quantization_config=dc.DELETE)
    dc.write_draft(str(root / "src"), cfg, quantized=False)
    (root / "src" / "tokenizer.json").write_text("{}\n")
    (root / "notes.txt").write_text("mine\n")
    return root


# ---- quantize ---------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["parent", "source", "cwd", "home", "root"])
def test_quantize_never_replaces_the_source_cwd_home_or_their_parents(parent, tmp_path, where):
    home = tmp_path / "home"
    home.mkdir()
    (home / "keep.txt").write_text("x")
    cwd = parent if where == "cwd" else tmp_path
    out = {"parent": parent, "source": parent / "src", "cwd": ".", "home": "~", "root": "/"}[where]
    before = snapshot(tmp_path)
    result = run_cli(
        "quantize", parent / "src", out, "--force", "--quiet", cwd=cwd, env={"HOME": str(home)}
    )
    why = {
        "parent": "contains",
        "source": "is the source",
        "cwd": "is the working directory",
        "home": "is the home directory",
        "root": "is the root directory",
    }[where]
    assert_one_line_refusal(result, "vllm-nemotron-spec quantize: ", why, "refusing")
    assert snapshot(tmp_path) == before


def test_quantize_force_replaces_only_its_own_output(parent, tmp_path, capsys):
    src, out = parent / "src", tmp_path / "out"
    assert main(["quantize", str(src), str(out), "--quiet"]) == 0
    first = snapshot(out)
    assert outputs.OUTPUT_MANIFEST in first and "tokenizer.json" in first

    assert main(["quantize", str(src), str(out), "--quiet"]) == 2  # without --force
    assert capsys.readouterr().err.strip().endswith("pass --force to replace it")
    (out / "model.safetensors").write_bytes(b"stale")  # its own file, changed: still its own
    assert main(["quantize", str(src), str(out), "--quiet", "--force"]) == 0
    assert snapshot(out) == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "parent"]  # no temporaries

    (out / "sub").mkdir()
    (out / "sub" / "notes.txt").write_text("mine")  # a file quantize did not write
    capsys.readouterr()
    assert main(["quantize", str(src), str(out), "--quiet", "--force"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds sub/notes.txt, which this command did not write" in err
    assert (out / "sub" / "notes.txt").read_text() == "mine"

    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["quantize", str(src), str(empty), "--quiet"]) == 0  # an empty directory is fine
    assert snapshot(empty) == first


def test_quantize_into_a_foreign_directory_is_refused_even_with_force(parent, tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "data.bin").write_bytes(b"\0" * 10)
    for extra in ((), ("--force",)):
        result = run_cli("quantize", parent / "src", foreign, "--quiet", *extra, cwd=tmp_path)
        assert_one_line_refusal(result, str(foreign))
    assert snapshot(foreign) == {"data.bin": hashlib.sha256(b"\0" * 10).hexdigest()}


def test_quantize_failing_half_way_leaves_the_old_output(parent, tmp_path, monkeypatch, capsys):
    from vllm_nemotron_spec.quantize import safetensors_io

    src, out = parent / "src", tmp_path / "out"
    assert main(["quantize", str(src), str(out), "--quiet"]) == 0
    before = snapshot(out)
    real = safetensors_io.write_shards

    def write_then_fail(tensors, directory, **kwargs):
        files = real(tensors, directory, **kwargs)
        assert (directory / files[0]).stat().st_size > 0  # a shard is half-way there
        raise OSError("disk full")

    monkeypatch.setattr(safetensors_io, "write_shards", write_then_fail)
    with pytest.raises(OSError, match="disk full"):
        main(["quantize", str(src), str(out), "--quiet", "--force"])
    assert snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "parent"]
    with pytest.raises(OSError, match="disk full"):
        main(["quantize", str(src), str(tmp_path / "new"), "--quiet"])
    assert not (tmp_path / "new").exists()


KILL_MIDWAY = """\
import os, signal, sys
import vllm_nemotron_spec.quantize.safetensors_io as io
real = io.write_shards
def write_then_die(tensors, directory, **kwargs):
    real(tensors, directory, **kwargs)
    os.kill(os.getpid(), signal.{sig})
    raise AssertionError("still alive")
io.write_shards = write_then_die
from vllm_nemotron_spec.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_quantize_killed_half_way_leaves_the_old_output(parent, tmp_path, sig):
    src, out = parent / "src", tmp_path / "out"
    assert main(["quantize", str(src), str(out), "--quiet"]) == 0
    before = snapshot(out)
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            KILL_MIDWAY.format(sig=sig),
            "quantize",
            str(src),
            str(out),
            "--quiet",
            "--force",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert snapshot(out) == before
    if sig == "SIGTERM":  # handled: one line, the temporary directory removed
        assert result.returncode == 130, result.stderr
        assert result.stderr == (
            f"vllm-nemotron-spec quantize: terminated (signal {int(signal.SIGTERM)})\n"
        )
        assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "parent"]
    else:  # not catchable: only the hidden temporary sibling is left behind
        assert result.returncode == -signal.SIGKILL
        leftovers = [p.name for p in tmp_path.iterdir() if p.name not in ("out", "parent")]
        assert len(leftovers) == 1 and leftovers[0].startswith(".out.tmp-")


# ---- make-tiny (the family builder; demo and bench --family-dir use the same one) ---------------


@pytest.mark.parametrize("where", ["foreign", "cwd", "home", "parent-of-cwd"])
def test_make_tiny_refuses_in_one_line(tmp_path, where):
    home = tmp_path / "home"
    (home / "work").mkdir(parents=True)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    cwd = home / "work"
    out = {"foreign": foreign, "cwd": ".", "home": "~", "parent-of-cwd": ".."}[where]
    before = snapshot(tmp_path)
    for extra in ((), ("--force",)):
        result = run_cli("make-tiny", out, "--quiet", *extra, cwd=cwd, env={"HOME": str(home)})
        why = {
            "foreign": "was not written by this command",
            "cwd": "is the working directory",
            "home": "is the home directory",
            "parent-of-cwd": "is the home directory",
        }[where]
        line = assert_one_line_refusal(result, "vllm-nemotron-spec make-tiny: ", why)
        assert (", even with --force" in line) == (bool(extra) and where == "foreign")
    assert snapshot(tmp_path) == before


def fake_family(root: Path, content: str) -> dict:
    """What ``_build_into`` writes, in miniature: a file (the cache adds the manifest listing
    it); returns the manifest's other fields."""
    (root / "target").mkdir()
    (root / "target" / "model.safetensors").write_text(content)
    return {}


def test_make_tiny_replaces_its_own_family_and_nothing_else(tmp_path, monkeypatch, capsys):
    from vllm_nemotron_spec.tiny import build

    out = tmp_path / "fam"
    monkeypatch.setattr(build, "_build_into", lambda root, *a: fake_family(root, "old"))
    monkeypatch.setattr(build, "is_complete", lambda outdir, *a: Path(outdir).is_dir())
    assert main(["make-tiny", str(out), "--quiet"]) == 0
    monkeypatch.setattr(build, "_build_into", lambda root, *a: fake_family(root, "new"))
    assert main(["make-tiny", str(out), "--quiet", "--force"]) == 0  # its own family: replaced
    assert (out / "target" / "model.safetensors").read_text() == "new"

    (out / "target" / "notes.txt").write_text("mine")
    capsys.readouterr()
    assert main(["make-tiny", str(out), "--quiet", "--force"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds target/notes.txt, which this command did not" in err
    assert (out / "target" / "notes.txt").read_text() == "mine"
    assert (out / "target" / "model.safetensors").read_text() == "new"


def test_make_tiny_failing_half_way_leaves_the_old_family(tmp_path, monkeypatch):
    from vllm_nemotron_spec.tiny import build

    out = tmp_path / "fam"
    monkeypatch.setattr(build, "_build_into", lambda root, *a: fake_family(root, "old"))
    monkeypatch.setattr(build, "is_complete", lambda outdir, *a: Path(outdir).is_dir())
    assert main(["make-tiny", str(out), "--quiet"]) == 0
    before = snapshot(out)

    def half_then_fail(root, *args):
        (root / "target").mkdir()
        (root / "target" / "model.safetensors").write_text("half")
        raise KeyboardInterrupt("terminated (signal 15)")

    monkeypatch.setattr(build, "_build_into", half_then_fail)
    assert main(["make-tiny", str(out), "--quiet", "--force"]) == 130
    assert snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [".fam.lock", "fam"]


# ---- bench --plot -------------------------------------------------------------------------------


def _report() -> dict:
    run = {
        "label": "dflash",
        "mean_acceptance_length": 2.5,
        "per_position_acceptance": [0.8, 0.5],
        "acceptance_histogram": [1, 2, 3],
        "num_speculative_tokens": 2,
        "status": "ok",
        "tokens_per_s": 10.0,
        "speedup_vs_plain": None,
    }
    return {
        "runs": [run],
        "model": "/m/target",
        "platform": "cpu",
        "prompts": {"num_prompts": 2},
        "max_tokens": 8,
        "temperature": 0.0,
    }


def test_bench_plot_replaces_a_png_atomically_and_nothing_else(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    from vllm_nemotron_spec.bench import plot_report

    png = tmp_path / "acc.png"
    plot_report(_report(), png)
    first = png.read_bytes()
    assert first.startswith(b"\x89PNG")
    plot_report(_report(), png)  # a PNG: replaced
    assert png.read_bytes().startswith(b"\x89PNG")

    def half_then_fail(self, path, **kwargs):
        Path(path).write_bytes(b"\x89PNG half")
        raise OSError("disk full")

    monkeypatch.setattr(Figure, "savefig", half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        plot_report(_report(), png)
    assert png.read_bytes() == first and sorted(os.listdir(tmp_path)) == ["acc.png"]

    notes = tmp_path / "notes.png"
    notes.write_text("not an image")
    with pytest.raises(outputs.OutputError, match="exists and is not a PNG file"):
        plot_report(_report(), notes)
    assert notes.read_text() == "not an image"


@pytest.mark.parametrize("where", ["dir", "cwd", "text-file"])
def test_bench_plot_refused_before_any_engine_starts(tmp_path, where):
    (tmp_path / "d").mkdir()
    (tmp_path / "notes.txt").write_text("mine")
    plot = {"dir": tmp_path / "d", "cwd": ".", "text-file": tmp_path / "notes.txt"}[where]
    result = run_cli("bench", "--plot", plot, "--model", "/nonexistent", cwd=tmp_path)
    why = "exists and is not a file" if where == "text-file" else "is a directory"
    assert_one_line_refusal(result, "vllm-nemotron-spec bench: ", why)
    assert (tmp_path / "notes.txt").read_text() == "mine"


# ---- every subcommand: bad arguments and refusals are one line, exit status 2 -------------------


ERROR_CASES = {
    "unknown-command": (["nosuch"], "invalid choice"),
    "unknown-option": (["inspect", "x", "--nosuch"], "unrecognized arguments: --nosuch"),
    "demo-method": (["demo", "--methods", "plain,foo"], "unknown method(s) foo"),
    "demo-num-prompts": (["demo", "--num-prompts", "0"], "--num-prompts must be >= 1"),
    "demo-max-tokens": (["demo", "--max-tokens", "x"], "invalid int value"),
    "demo-family-dir": (["demo", "--family-dir", "{foreign}"], "was not written by this command"),
    "inspect-missing": (["inspect", "{tmp}/nope"], "no such file or directory"),
    "inspect-k": (["inspect", "{tmp}", "-k", "x"], "invalid int value"),
    "bench-num-prompts": (["bench", "--num-prompts", "0"], "--num-prompts must be >= 1"),
    "bench-server-and-method": (
        ["bench", "--server", "http://127.0.0.1:1", "--method", "plain"],
        "--server measures running servers",
    ),
    "bench-method": (["bench", "--model", "m", "--method", "nosuch"], "nosuch"),
    "bench-family-dir": (["bench", "--family-dir", "{foreign}"], "was not written by this command"),
    "bench-plot": (["bench", "--plot", "{foreign}"], "is a directory"),
    "tune-max-batch": (
        ["tune", "t", "--method", "dspark", "--draft", "d", "--max-batch", "0"],
        "--max-batch must be an integer >= 1, found 0",
    ),
    "tune-method": (["tune", "t", "--method", "eagle", "--draft", "d"], "invalid choice"),
    "tune-out": (
        ["tune", "t", "--method", "dspark", "--draft", "d", "--out", "{foreign}"],
        "is a directory",
    ),
    "make-tiny-missing-outdir": (["make-tiny"], "required: OUTDIR"),
    "make-tiny-seed": (["make-tiny", "{tmp}/t", "--seed", "x"], "invalid int value"),
    "make-tiny-foreign": (["make-tiny", "{foreign}"], "was not written by this command"),
    "quantize-engine": (["quantize", "{tmp}/a", "{tmp}/b", "--engine", "x"], "invalid choice"),
    "quantize-missing-source": (["quantize", "{tmp}/nope", "{tmp}/b"], "no config.json"),
    "quantize-shard-size": (
        ["quantize", "{tmp}/nope", "{tmp}/b", "--max-shard-size", "lots"],
        "not a size: 'lots'",
    ),
    "quantize-foreign": (
        ["quantize", "{tmp}/nope", "{foreign}", "--force"],
        "was not written by this command",
    ),
}


@pytest.mark.parametrize("case", sorted(ERROR_CASES))
def test_every_error_is_one_line_with_exit_status_2(tmp_path, case):
    argv, text = ERROR_CASES[case]
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    argv = [a.format(tmp=tmp_path, foreign=foreign) for a in argv]
    line = assert_one_line_refusal(run_cli(*argv, cwd=tmp_path), text)
    assert line.startswith("vllm-nemotron-spec")
    assert (foreign / "notes.txt").read_text() == "mine"


def test_vllm_passthrough_without_vllm_is_one_line(monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "vllm", None)  # ``import vllm`` raises ImportError
    assert main(["vllm", "serve", "m"]) == 2
    assert capsys.readouterr().err == (
        "vllm-nemotron-spec vllm: vLLM is not installed: see the README's Install section\n"
    )
