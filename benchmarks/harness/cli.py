"""``python3 benchmarks/run.py SCENARIO --out DIR [--smoke] [options]``: one entry point for every
benchmark, plus ``models`` (build the Lightning models only) and ``caches`` (pack or restore the
start-up caches). ``run.py SCENARIO --help`` explains a scenario and its options."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from benchmarks import scenarios


def _first_line(doc: str | None) -> str:
    return (doc or "").strip().splitlines()[0] if doc else ""


def _available(name: str) -> bool:
    return importlib.util.find_spec(scenarios.MODULES[name]) is not None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="run.py",
        description=__doc__ + "\n\nThe H200 commands and how results are recorded: "
        "benchmarks/README.md.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="SCENARIO")
    for name in scenarios.MODULES:
        if not _available(name):
            continue
        module = scenarios.load(name)
        sp = sub.add_parser(
            name, help=_first_line(module.__doc__).split(": ", 1)[-1], description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )  # fmt: skip
        module.add_arguments(sp)
        sp.set_defaults(func=module.run)
    models = sub.add_parser("models", help="build the Lightning models into --models-dir only")
    models.add_argument("--models-dir", default="/tmp/vllm-nemotron-lightning")
    models.add_argument("--target", choices=("nvfp4", "bf16"), default="nvfp4")
    models.add_argument("--smoke", action="store_true", help="the tiny models")
    models.set_defaults(func=_build_models)
    caches = sub.add_parser(
        "caches", help="pack the start-up caches into a folder, or restore them"
    )
    caches.add_argument("action", choices=("pack", "restore"))
    caches.add_argument(
        "folder", help="pack: where the parts go (e.g. $OUT); restore: where they are"
    )
    caches.add_argument("--max-parts", type=int, default=4,
                        help="pack: copy at most this many parts of 15 MB into the folder, 1-7 "
                        "(default 4, room for a scenario's 3 files beside them; the rest come "
                        "with later commands, --from-part)")  # fmt: skip
    caches.add_argument("--from-part", type=int, default=0,
                        help="pack: go on with this part of the pack an earlier command made on "
                        "this machine (default 0: pack afresh)")  # fmt: skip
    caches.set_defaults(func=_caches)
    return p


def _build_models(args) -> int:
    from benchmarks.harness.models import build_models

    print(build_models(args.models_dir, args.target, args.smoke))
    return 0


def _caches(args) -> int:
    from benchmarks.harness import bundle

    if args.action == "restore":
        print(bundle.restore_caches(Path(args.folder)))
        return 0
    try:
        done = bundle.pack_caches(Path(args.folder), max_parts=args.max_parts,
                                  from_part=args.from_part)  # fmt: skip
    except ValueError as e:  # --max-parts out of range
        raise SystemExit(f"--max-parts {args.max_parts}: {e}") from None
    if not done.get("packed"):
        print(f"caches not packed: {done['reason']}")
        return 1
    first, last = args.from_part, args.from_part + len(done["copied"]) - 1
    print(f"caches: {len(done['parts'])} parts, {done['bytes'] / 1e6:.1f} MB ({done['dirs']}); "
          f"parts {first}-{last} in {args.folder}"
          + (f"; next command: caches pack FOLDER --from-part {done['next_part']}"
             if done["next_part"] is not None else "; that is every part"))  # fmt: skip
    return 0


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
