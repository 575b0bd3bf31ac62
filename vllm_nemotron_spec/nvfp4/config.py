"""W4A16 NVFP4 quantization config for vLLM (placeholder)."""


def register() -> list[str]:
    return []
