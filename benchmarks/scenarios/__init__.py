"""The scenarios: each a short module with ``NAME``, a docstring (its ``--help``),
``add_arguments(parser)`` and ``run(args) -> exit code``, built on ``benchmarks/harness``."""

from __future__ import annotations

import importlib

MODULES = {
    "speed": "benchmarks.scenarios.speed",
    "serving": "benchmarks.scenarios.serving",
    "anchor": "benchmarks.scenarios.anchor",
    "nvfp4-linear": "benchmarks.scenarios.nvfp4_linear",
    "draft-breakdown": "benchmarks.scenarios.draft_breakdown",
    "tp": "benchmarks.scenarios.tp",
    "mamba-metadata": "benchmarks.scenarios.mamba_metadata",
}


def load(name: str):
    return importlib.import_module(MODULES[name])
