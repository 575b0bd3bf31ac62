"""``vllm-nemotron-spec inspect DRAFT [--target TARGET] [--json]``: check a draft checkpoint.

Reads the draft's config.json and its safetensors HEADERS (never the weights; no vLLM, no GPU) and
prints what the server will do with it: method (DFlash / DSpark), whether it has the Nemotron 3.5
layout, the anchor mode, gamma against the trained block size, the mask token, the aux hidden-state
ids against the target's blocks, which modules are NVFP4 and which BF16 (packed and logical
shapes), who owns the embedding and the lm_head, and the exact ``vllm serve`` command.

Exit status: 0 when the checkpoint is consistent; 2 when any problem was found (every problem is
listed, each naming the field or tensor with the expected and the found value).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections import OrderedDict


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "inspect",
        help="check a DFlash / DSpark draft checkpoint and print how to serve it",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "draft",
        metavar="DRAFT",
        help="draft checkpoint: a local directory (or its config.json), or a "
        "Hugging Face id (from the local cache; with the Hub on, its config "
        "files are downloaded and its tensor headers read remotely, never "
        "its weights)",
    )
    parser.add_argument(
        "--revision",
        metavar="REV",
        default=None,
        help="the draft's revision on the Hub (branch, tag or commit)",
    )
    parser.add_argument(
        "--target",
        metavar="TARGET",
        help="target checkpoint (directory, config.json or Hugging Face id): "
        "check the aux hidden-state ids, vocab and hidden size against it",
    )
    parser.add_argument(
        "--target-revision", metavar="REV", default=None, help="the target's revision on the Hub"
    )
    parser.add_argument(
        "-k",
        "--num-speculative-tokens",
        type=int,
        metavar="N",
        default=None,
        help="gamma to check against the draft's trained block size "
        "(default: the draft's own default)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


def run(args) -> int:
    from vllm_nemotron_spec.checkpoint.inspect import inspect_checkpoint

    try:
        report = inspect_checkpoint(
            args.draft,
            target=args.target,
            num_speculative_tokens=args.num_speculative_tokens,
            revision=args.revision,
            target_revision=args.target_revision,
        )
        if not args.json and "checkpoint" not in report and len(report["problems"]) == 1:
            # Nothing could be read (e.g. no such draft): one line, no report.
            print(f"vllm-nemotron-spec inspect: {report['problems'][0]}", file=sys.stderr)
            return 2
        if args.json:
            print(json.dumps(_jsonable(report), indent=2, allow_nan=False))
        else:
            _print_text(report)
    except Exception as exc:  # never a traceback: a bug in this command, said as such
        print(
            f"vllm-nemotron-spec inspect: internal error ({type(exc).__name__}: {exc}); "
            "this is a bug, please report it",
            file=sys.stderr,
        )
        return 1
    return 2 if report["problems"] else 0


def _jsonable(value):
    """Strict JSON: non-finite floats become strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


# --------------------------------------------------------------------------------------------
# Text output.


def _print_text(report: dict) -> None:
    lines: list[tuple[str, str]] = [("draft", report["draft"])]
    if "method" in report:
        lines += _describe(report)
    ckpt = report.get("checkpoint")
    if ckpt is not None:
        where = ", ".join(ckpt["files"]) or "no weight files"
        lines.append(("checkpoint", f"{where}: {ckpt['num_tensors']} tensors (headers only)"))
    if report.get("weights_checked"):
        lines.append(
            (
                "headers",
                ("not read: " if report["weights_deferred"] else "from ")
                + report["weights_checked"],
            )
        )
    if report.get("serve_command"):
        lines.append(("serve", report["serve_command"]))
    width = max(len(k) for k, _ in lines)
    for key, value in lines:
        print(f"{key:<{width}}  {value}")
    quant = report.get("quantization")
    if quant is not None and quant.get("modules"):
        print()
        for row in _module_rows(quant["modules"]):
            print("  " + row)
    if report["warnings"]:
        print("\nwarnings:")
        for w in report["warnings"]:
            print(f"  - {w}")
    if report["problems"]:
        print(f"\n{len(report['problems'])} problem(s):", file=sys.stderr)
        for p in report["problems"]:
            print(f"  - {p}", file=sys.stderr)


def _describe(r: dict) -> list[tuple[str, str]]:
    out = [("method", f"{r['method']} ({r['architecture']})")]
    if r["nemotron35_layout"]:
        out.append(
            (
                "layout",
                "Nemotron 3.5: own embed_tokens, the target's lm_head, aux ids = "
                "target_layer_ids + 1",
            )
        )
    else:
        out.append(("layout", "generic DFlash/DSpark draft (not the Nemotron 3.5 layout)"))
    if r["sample_from_anchor"]:
        out.append(("anchor", "sample_from_anchor=true: gamma query rows, row k predicts L+k+1"))
    else:
        out.append(
            (
                "anchor",
                "sample_from_anchor=false: gamma+1 query rows [b, MASK x gamma], "
                "row 0 (the anchor) dropped",
            )
        )
    block = "no block_size" if r["block_size"] is None else f"block_size {r['block_size']}"
    if r["max_num_speculative_tokens"] is not None:
        block += f", at most {r['max_num_speculative_tokens']}"
    if r["num_speculative_tokens"] is not None:
        out.append(
            (
                "gamma",
                f"{r['num_speculative_tokens']} drafted tokens ({block}) -> "
                f"{r['num_query_rows']} query rows per step",
            )
        )
    elif r.get("num_speculative_tokens_requested") is not None:
        out.append(("gamma", f"{r['num_speculative_tokens_requested']} requested ({block})"))
    else:
        out.append(("gamma", f"unresolved ({block})"))
    out.append(("mask token", str(r["mask_token_id"])))
    att = r["attention"]
    parts = ["causal" if att["causal"] else "non-causal within the block"]
    parts.append(
        f"sliding window {att['sliding_window']}" if att["sliding_window"] else "full attention"
    )
    if att["attention_sinks"]:
        parts.append("attention sinks")
    rope = f"RoPE theta {att['rope_theta']:g}"
    if att["rope_scaling"]:
        rope += " " + json.dumps(att["rope_scaling"], sort_keys=True)
    out.append(("attention", ", ".join(parts) + "; " + rope))
    if r["markov_head"] is not None:
        out.append(
            (
                "markov head",
                f"{r['markov_head']['type'] or 'unspecified'}, rank {r['markov_head']['rank']}",
            )
        )
    aux = f"{r['aux_hidden_state_ids']} (target_layer_ids {r['target_layer_ids']} + 1)"
    if r["target_blocks"] is not None:
        beyond = [a for a in r["aux_hidden_state_ids"] if a > r["target_blocks"]]
        aux += f" vs the target's {r['target_blocks']} blocks: " + (
            "ok" if not beyond else f"{beyond} beyond the last block"
        )
    elif r["target"] is None:
        aux += "; pass --target to check them against the target's blocks"
    out.append(("aux ids", aux))
    out.append(
        (
            "embedding",
            "embed_tokens: "
            + ("the draft's own" if r["embed_tokens"] == "draft" else "the target's")
            + "; lm_head: "
            + ("the draft's own" if r["lm_head"] == "draft" else "the target's"),
        )
    )
    q = r["quantization"]
    if q["quant_algo"] is None and q["quant_method"] is None:
        out.append(("quantization", "none (all tensors unquantized)"))
    else:
        excl = len(q["exclude_modules"])
        out.append(
            (
                "quantization",
                f"{q['quant_algo'] or q['quant_method']} (group "
                f"{q['group_size']}), {excl} exclusion pattern(s)",
            )
        )
    return out


def _module_rows(modules: list[dict]) -> list[str]:
    """One row per group of identical modules (the layers' copies folded into ``layers.*``)."""
    groups: OrderedDict = OrderedDict()
    for m in modules:
        name = re.sub(r"(^|\.)layers\.\d+\.", r"\1layers.*.", m["name"])
        key = (
            name,
            m["format"],
            m["found_dtype"],
            tuple(m["logical_shape"]),
            tuple(m["found_shape"] or ()),
            m["ok"],
            m.get("truncated", False),
        )
        groups.setdefault(key, []).append(m)
    rows = []
    for (name, fmt, dtype, logical, _, ok, cut), members in groups.items():
        m = members[0]
        label = name + (f" (x{len(members)})" if len(members) > 1 else "")
        if fmt == "nvfp4":
            text = (
                f"NVFP4  {label:<38} logical {m['logical_shape']} stored uint8 "
                f"{m['packed_shape']}, scales F8_E4M3 {m['scale_shape']}"
            )
        elif fmt == "dense":
            shown = dtype or "BF16"
            text = f"{shown:<6} {label:<38} {m['logical_shape']}"
        else:
            text = f"{'?':<6} {label:<38} logical {m['logical_shape']} (layout not checked)"
        if dtype is not None and fmt == "nvfp4" and dtype != "U8":
            text += f"  found {dtype} {m['found_shape']}"
        elif (
            m["found_shape"] is not None
            and tuple(m["found_shape"]) != tuple(logical)
            and fmt == "dense"
        ):
            text += f"  found {m['found_shape']}"
        if cut:
            text += "  <- truncated: its data lies past the end of the file"
        elif not ok:
            text += "  <- problem"
        rows.append(text)
    return rows
