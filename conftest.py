"""Test-session environment: the real vLLM engine in-process on CPU, nothing downloaded, every
cache inside the work tree. Set before any test imports vLLM; a value already set wins."""

import os
from pathlib import Path

_CACHE = Path(__file__).resolve().parent / ".cache"
for key, value in {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NEMOTRON_SPEC_CACHE": str(_CACHE / "nemotron-spec"),
    "VLLM_CACHE_ROOT": str(_CACHE / "vllm"),
    "TORCHINDUCTOR_CACHE_DIR": str(_CACHE / "inductor"),
    "HF_HOME": str(_CACHE / "hf"),
}.items():
    os.environ.setdefault(key, value)
