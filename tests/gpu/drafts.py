"""The drafts the GPU tests run, derived from the tiny family's trained drafts.

- Unquantized twins (``write_unquantized_draft``: the same weights, NVFP4 modules dequantized and
  stored in BF16, no quantization config) for the fp32 runs: vLLM's NVFP4 kernels take 16-bit
  activations only, and exactness against plain decoding is asserted in fp32.
- The trained DFlash draft quantized NVFP4A16 by the compressed-tensors library
  (``tests/quantize/ct_draft.py``), cached next to the trained drafts: its build takes about a
  minute of CPU, so it is made before the GPU run (``python3 -m tests.gpu.drafts``) and carried
  with the cache.

``python3 -m tests.gpu.drafts`` builds everything the GPU tests read from the cache (the tiny
family, its trained drafts, the compressed-tensors draft) and prints the directory to carry.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

from vllm_nemotron_spec.checkpoint.layout import DFLASH, DSPARK

REPO = Path(__file__).resolve().parents[2]

CACHE_ENVS = ("NEMOTRON_SPEC_CACHE",)
"""The cache directory's environment variable, new name first (the package reads one of them)."""


def use_one_cache_dir(default: Path = REPO / ".cache" / "nemotron-spec") -> Path:
    """The tiny family's cache: the first of :data:`CACHE_ENVS` that is set, else ``default``;
    exported under both names, so the package finds it whichever name it reads."""
    chosen = next((os.environ[n] for n in CACHE_ENVS if os.environ.get(n)), str(default))
    for name in CACHE_ENVS:
        os.environ[name] = chosen
    return Path(chosen)


def unquantized_twin(draft: Path, kind: str, family, outdir: Path) -> Path:
    """``draft`` with its NVFP4 modules dequantized and stored in BF16 (no quantization config)."""
    from vllm_nemotron_spec.tiny.drafts import DraftParams, read_draft_state_dict
    from vllm_nemotron_spec.tiny.train_draft import write_unquantized_draft

    cfg = json.loads((Path(draft) / "config.json").read_text())
    return write_unquantized_draft(
        outdir,
        kind,
        read_draft_state_dict(draft),
        family.target,
        params=DraftParams(**family.manifest()["params"]["draft"]),
        target_layer_ids=cfg["target_layer_ids"],
        mask_token_id=cfg["mask_token_id"],
    )


def unquantized_twins(trained, family, root: Path) -> dict[str, Path]:
    """fp32-servable copies of the trained drafts and their wrong-layout controls."""
    from vllm_nemotron_spec.tiny.train_draft import write_wrong_anchor_twin

    dspark = unquantized_twin(trained.dspark, DSPARK, family, root / "dspark")
    return {
        "dflash": Path(trained.dflash_unquantized),
        "dflash_shifted": unquantized_twin(
            trained.dflash_shifted, DFLASH, family, root / "dflash_shifted"
        ),
        "dspark": dspark,
        "dspark_wrong_anchor": write_wrong_anchor_twin(dspark, root / "dspark_wrong_anchor"),
    }


def ct_dflash_dir(bf16_draft: Path, seed: int) -> Path:
    """Where the compressed-tensors copy of ``bf16_draft`` is cached (keyed by its weights)."""
    from vllm_nemotron_spec.tiny.build import default_cache_dir

    digest = hashlib.sha256()
    for f in sorted(Path(bf16_draft).glob("*.safetensors")):
        digest.update(f.read_bytes())
    return default_cache_dir() / f"ct-dflash-nvfp4a16-seed{seed}-{digest.hexdigest()[:12]}"


def ensure_ct_dflash(bf16_draft: Path, seed: int = 0) -> Path:
    """The trained BF16 DFlash draft quantized NVFP4A16 by compressed-tensors, built on first use
    (written to a temporary sibling, then moved into place)."""
    out = ct_dflash_dir(bf16_draft, seed)
    if (out / "config.json").is_file():
        return out
    import torch

    from tests.quantize.ct_draft import build_ct_draft

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with torch.compiler.set_stance("force_eager"):  # its FP4 rounding needs no inductor
        build_ct_draft(bf16_draft, tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def _size_mib(path: Path) -> float:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()) / 2**20


def prepare(seed: int = 0) -> list[Path]:
    """Build (or reuse) everything the GPU tests read from the cache; the directories made."""
    from vllm_nemotron_spec.tiny.build import ensure_tiny_family
    from vllm_nemotron_spec.tiny.train_draft import ensure_trained_drafts

    family = ensure_tiny_family(seed=seed)
    trained = ensure_trained_drafts(seed=seed, family=family)
    ct = ensure_ct_dflash(trained.dflash_unquantized, seed)
    return [Path(family.root), Path(trained.root), ct]


def main() -> int:
    use_one_cache_dir()
    dirs = prepare()
    cache = dirs[0].parent
    for d in dirs:
        print(f"{_size_mib(d):6.1f} MiB  {d}")
    others = sorted(p.name for p in cache.iterdir() if p not in dirs)
    print(f"{sum(_size_mib(d) for d in dirs):6.1f} MiB  in all: carry {cache}")
    if others:
        print(f"(also in {cache}, not read by the GPU tests: {', '.join(others)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
