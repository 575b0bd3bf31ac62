"""What every scenario run shares: its ``--out`` folder, setup facts, device budget, progress
lines, the report it keeps up to date, and the bundle it leaves for the GPU machine's ``$OUT``."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

from benchmarks.harness import bundle, environment, report
from benchmarks.harness.budget import Budget

DEFAULT_MODELS_DIR = "/tmp/vllm-nemotron-lightning"


def add_common_arguments(p: argparse.ArgumentParser, models: bool = True) -> None:
    p.add_argument("--out", required=True, help="result folder (report, logs; created)")
    p.add_argument("--smoke", action="store_true",
                   help="CPU: the tiny family, tiny grids; every code path, no GPU")  # fmt: skip
    p.add_argument("--budget-s", type=float, default=None,
                   help="device time this command may use (default 540; smoke 3600): work that "
                   "cannot finish in it is skipped and says so")  # fmt: skip
    p.add_argument("--first-start-s", type=float, default=None,
                   help="expected start-up of the first engine before one has been seen "
                   "(default 330 on a GPU: a fresh machine JIT-compiles; 60 on CPU)")  # fmt: skip
    p.add_argument("--bundle", metavar="DIR", default=None,
                   help="also put the report and a tar.gz of --out into DIR (e.g. $OUT: at most "
                   "8 files of 15 MB come back from the GPU machine)")  # fmt: skip
    p.add_argument("--caches", metavar="DIR", default=None,
                   help="restore start-up caches packed by `run.py caches pack` from DIR first "
                   "(parts may arrive over several commands)")  # fmt: skip
    if models:
        p.add_argument("--models-dir", default=DEFAULT_MODELS_DIR,
                       help="where the models are built once and reused (outside --out: the "
                       f"NVFP4 target is ~19 GB; default {DEFAULT_MODELS_DIR})")  # fmt: skip
        p.add_argument("--force", action="store_true",
                       help="measure again what --out already holds from an earlier run")  # fmt: skip


class Run:
    """One scenario invocation."""

    def __init__(self, name: str, args: argparse.Namespace):
        self.name, self.args = name, args
        self.out = Path(args.out).resolve()
        (self.out / "logs").mkdir(parents=True, exist_ok=True)
        self.smoke = bool(getattr(args, "smoke", False))
        self.device = environment.device()
        if self.smoke and self.device != "cpu":
            print("note: --smoke runs the tiny family; on a GPU it runs there", flush=True)
        budget_s = args.budget_s or (3600.0 if self.smoke else 540.0)
        first = args.first_start_s or (60.0 if self.device == "cpu" else 330.0)
        self.budget = Budget(budget_s, first)
        self.setup = environment.setup_facts()
        self.setup["smoke"] = self.smoke
        self.setup["device"] = self.device
        if getattr(args, "caches", None):
            self.say(bundle.restore_caches(Path(args.caches)))
        path = self.out / f"{name}.json"
        self.previous = json.loads(path.read_text()) if path.is_file() else None
        self.trace_root = (
            Path(tempfile.gettempdir()) / "nemotron-spec-traces" / f"{name}-{os.getpid()}"
        )
        """Where the lanes' profiler traces go (read, summarized and deleted; not in --out)."""

    def say(self, message: str) -> None:
        print(f"[{self.budget.elapsed():5.0f}s] {message}", flush=True)

    def save(self, title: str, result: dict, tables: list[report.Table]) -> Path:
        result = dict(result, setup=self.setup, elapsed_s=round(self.budget.elapsed(), 1))
        return report.write_report(self.out, self.name, title, result, tables)

    def finish(self, title: str, result: dict, tables: list[report.Table]) -> Path:
        """The final report, printed, and the bundle where ``--bundle`` asks for one."""
        md = self.save(title, result, tables)
        shutil.rmtree(self.trace_root, ignore_errors=True)
        print(md.read_text(), flush=True)
        if getattr(self.args, "bundle", None):
            files = bundle.bundle_results(self.out, Path(self.args.bundle), self.name)
            self.say(f"bundle: {', '.join(p.name for p in files)} in {self.args.bundle}")
        self.say(f"report: {md}")
        return md


def earlier_entries(previous: dict | None, key: str, names) -> dict:
    """The entries of an earlier run in the same ``--out`` that this run does not measure again
    (other arms or servers): kept in the result, so the report holds every arm measured there."""
    out = {}
    for name, entry in ((previous or {}).get(key) or {}).items():
        if name not in names:
            status = entry.get("status")
            out[name] = dict(entry, status="kept" if status in ("ok", "kept") else status)
    return out


def kept_entry(previous: dict | None, key: str, name: str, fingerprint: dict, force: bool):
    """An entry of an earlier result with the same fingerprint that finished, to keep instead of
    measuring again (None when there is none, or ``--force``)."""
    if force or not previous:
        return None
    entry = (previous.get(key) or {}).get(name)
    if entry and entry.get("status") in ("ok", "kept") and entry.get("fingerprint") == fingerprint:
        return dict(entry, status="kept", kept_at=previous.get("setup", {}).get("date_utc"))
    return None
