"""``vllm-nemotron-spec``: the command-line front end.

Each subcommand lives in its own module of this package and exposes ``add_parser(subparsers)``,
which adds its parser and sets ``func`` to the function that runs it. Modules are imported only to
build their parsers, so they must keep heavy imports (torch, vLLM) inside their run functions.

A bad argument, and a refusal to write an output (:class:`~vllm_nemotron_spec.outputs.OutputError`),
end the command with one line on stderr and exit status 2, never a traceback. SIGTERM ends a
command like Ctrl-C does, so an output being written is removed and the old one kept.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import threading

SUBCOMMANDS = ("make_tiny", "demo", "inspect", "bench", "tune", "quantize", "vllm")


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, with a usage error said in one line (the usage is in --help)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from vllm_nemotron_spec import __version__

    parser = ArgumentParser(
        prog="vllm-nemotron-spec",
        description=(
            "Speculative decoding of NVIDIA Nemotron 3.5 Lightning with its DFlash / DSpark "
            "drafts in vLLM. The plugin itself needs no command: installing the package makes "
            "`vllm serve`, `LLM(...)` and `vllm bench serve` pick it up. These commands build the "
            "tiny local model family, run the demo, quantize and check your own drafts, "
            "benchmark, tune the drafted tokens per batch size, and wrap vLLM's CLI."
        ),
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(f"vllm_nemotron_spec.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"vllm_nemotron_spec.cli.{name}":
                continue  # subcommand not shipped in this build
            raise
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if getattr(args, "command", None) is None:
        parser.print_help()
        return 2
    if extra and not getattr(args, "accepts_extra_args", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if getattr(args, "accepts_extra_args", False):
        args.extra_args = extra
        return int(args.func(args) or 0)  # vLLM's CLI handles its own signals
    from vllm_nemotron_spec.outputs import OutputError

    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        return int(args.func(args) or 0)
    except OutputError as exc:
        print(f"{parser.prog} {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        print(
            f"{parser.prog} {args.command}: {exc.args[0] if exc.args else 'interrupted'}",
            file=sys.stderr,
        )
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _terminate(signum, frame):
    """SIGTERM as KeyboardInterrupt: ``finally`` blocks remove half-written outputs."""
    raise KeyboardInterrupt(f"terminated (signal {signum})")


if __name__ == "__main__":
    sys.exit(main())
