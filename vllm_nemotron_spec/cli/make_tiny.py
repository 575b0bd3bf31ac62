"""``vllm-nemotron-spec make-tiny OUTDIR``: build the tiny Nemotron-3.5-shaped model family locally."""

from __future__ import annotations

import argparse
from pathlib import Path

DESCRIPTION = """\
Build the tiny Nemotron-3.5-shaped model family into OUTDIR, locally and reproducibly from a seed
(nothing is downloaded):

  OUTDIR/target     a tiny NemotronHForCausalLM (Mamba-2 / attention / MLP blocks), trained on
                    a synthetic corpus so its greedy output is structured text
  OUTDIR/dflash     a tiny DFlash draft (DFlashDraftModel) in the official W4A16 NVFP4 layout
  OUTDIR/dspark     a tiny DSpark draft (Qwen3DSparkModel) in the official W4A16 NVFP4 layout
  OUTDIR/tokenizer  the byte-level BPE tokenizer (1024 tokens; <mask> = the drafts' mask_token_id)

Each model directory also carries the tokenizer files, so each loads on its own. The draft
weights are random (untrained: acceptance ~1). --trained also trains both drafts against the
target (about 1.5 minutes on 2 cores, cached) into OUTDIR/../tiny-drafts-trained-seedN/{dflash,dspark},
the drafts `demo` and `bench` use.

The same seed gives byte-identical weights on the same machine type. An OUTDIR that already
holds a complete family built with the same seed and builder version is reused as is; pass
--force to rebuild it. A family is replaced only when OUTDIR holds nothing but the files of its
manifest.json; any other non-empty directory is refused (exit 2), as are /, the home and the
working directory. Building takes about 1.5 minutes (one CPU core; training the target).
"""

EPILOG = """\
example:
  vllm-nemotron-spec make-tiny /tmp/tiny
  vllm-nemotron-spec make-tiny /tmp/tiny --trained    # + trained drafts in /tmp/tiny-drafts-trained-seed0
  vllm-nemotron-spec vllm serve /tmp/tiny/target --dtype float32 --no-enable-prefix-caching \
    --speculative-config '{"method": "dflash", "model": "/tmp/tiny-drafts-trained-seed0/dflash", "num_speculative_tokens": 5}'
(the family is stored in float32: serve it so; vLLM's default would cast it to bfloat16)

tests build (and reuse) the family of seed 0 in $NEMOTRON_SPEC_CACHE
(default ~/.cache/vllm-nemotron-spec)/tiny-family-seed0.
"""


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "make-tiny",
        help="build the tiny Nemotron-3.5-shaped target + DFlash/DSpark drafts (local, seeded)",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("outdir", metavar="OUTDIR", help="directory to build the family into")
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the corpus, tokenizer, target training and draft init (default: 0)",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="rebuild even if OUTDIR already holds a matching complete family",
    )
    parser.add_argument(
        "--trained",
        action="store_true",
        help="also train the DFlash and DSpark drafts against the target (cached next to OUTDIR)",
    )
    parser.add_argument(
        "--quiet", action="store_true", help="no progress bar or build messages, only the paths"
    )
    parser.set_defaults(func=run)


def run(args) -> int:
    from vllm_nemotron_spec.tiny.build import build_tiny_family

    family = build_tiny_family(
        args.outdir, seed=args.seed, force=args.force, progress=not args.quiet
    )
    print(f"root:      {Path(family.root).resolve()}")
    print(f"tokenizer: {Path(family.tokenizer).resolve()}")
    print(f"target:    {Path(family.target).resolve()}")
    print(f"dflash:    {Path(family.dflash_draft).resolve()}  (untrained)")
    print(f"dspark:    {Path(family.dspark_draft).resolve()}  (untrained)")
    draft = family.dflash_draft
    if getattr(args, "trained", False):
        from vllm_nemotron_spec.tiny.train_draft import ensure_trained_drafts

        trained = ensure_trained_drafts(args.seed, family=family, progress=not args.quiet)
        print(f"trained dflash: {Path(trained.dflash).resolve()}")
        print(f"trained dspark: {Path(trained.dspark).resolve()}")
        draft = trained.dflash
    print(f"serve:     {serve_line(family.target, draft)}")
    return 0


def serve_line(target, draft) -> str:
    """The ``vllm serve`` command for the tiny family (float32, as it is stored). vLLM needs
    ``num_speculative_tokens`` for a DFlash draft without ``block_size``: the plugin's default."""
    import json
    import shlex

    from vllm_nemotron_spec.checkpoint.spec import NEMOTRON35_DFLASH_NUM_SPECULATIVE_TOKENS

    config = json.dumps(
        {
            "method": "dflash",
            "model": str(Path(draft).resolve()),
            "num_speculative_tokens": NEMOTRON35_DFLASH_NUM_SPECULATIVE_TOKENS,
        }
    )
    return (
        f"vllm-nemotron-spec vllm serve {shlex.quote(str(Path(target).resolve()))} "
        "--dtype float32 "
        f"--no-enable-prefix-caching --speculative-config {shlex.quote(config)}"
    )
