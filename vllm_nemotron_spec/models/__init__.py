"""Draft model architectures for the Nemotron 3.5 DFlash / DSpark checkpoints."""


def register() -> list[str]:
    """Register the Nemotron 3.5 draft classes with vLLM's ModelRegistry (idempotent)."""
    return []
