"""Attention-backend choice for a NemotronH target and its draft (placeholder)."""


def register() -> list[str]:
    return []
