"""The tiny Nemotron-3.5-shaped model family (tokenizer, NemotronH target, DFlash / DSpark drafts),
built locally and reproducibly from a seed. Importing this package is cheap (no torch)."""

from vllm_nemotron_spec.tiny.build import (
    TinyFamily,
    TinySpec,
    build_tiny_family,
    default_cache_dir,
    ensure_tiny_family,
)
from vllm_nemotron_spec.tiny.drafts import read_draft_state_dict, write_draft

__all__ = [
    "TinyFamily",
    "TinySpec",
    "build_tiny_family",
    "default_cache_dir",
    "ensure_tiny_family",
    "read_draft_state_dict",
    "write_draft",
]
