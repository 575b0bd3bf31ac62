"""Version-guarded patches of vLLM internals (placeholder)."""


def apply_all() -> list[str]:
    return []
