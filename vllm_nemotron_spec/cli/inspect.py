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
import os
import re
import shlex
import sys
from collections import OrderedDict


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "inspect",
        help="check a DFlash / DSpark draft checkpoint and print how to serve it",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("draft", metavar="DRAFT",
                        help="draft checkpoint: a local directory (or its config.json), or a "
                             "Hugging Face id already in the local cache")
    parser.add_argument("--target", metavar="TARGET",
                        help="target checkpoint (directory, config.json or cached id): check the "
                             "aux hidden-state ids, vocab and hidden size against it")
    parser.add_argument("-k", "--num-speculative-tokens", type=int, metavar="N", default=None,
                        help="gamma to check against the draft's trained block size "
                             "(default: the draft's own default)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


def run(args) -> int:
    try:
        report = inspect_checkpoint(args.draft, target=args.target,
                                    num_speculative_tokens=args.num_speculative_tokens)
        if args.json:
            print(json.dumps(_jsonable(report), indent=2, allow_nan=False))
        else:
            _print_text(report)
    except Exception as exc:  # never a traceback: a bug in this command, said as such
        print(f"vllm-nemotron-spec inspect: internal error ({type(exc).__name__}: {exc}); "
              "this is a bug, please report it", file=sys.stderr)
        return 1
    return 2 if report["problems"] else 0


# --------------------------------------------------------------------------------------------
# The report (a plain dict: the --json output).


def inspect_checkpoint(draft: str, target: str | None = None,
                       num_speculative_tokens: int | None = None) -> dict:
    """Everything ``inspect`` prints, as a dict; never raises for a bad checkpoint."""
    from vllm_nemotron_spec.draft_spec import (
        DraftSpec,
        DraftSpecError,
        check_against_target,
        read_config_json,
        target_num_blocks,
    )

    problems: list[str] = []
    warnings: list[str] = []
    report: dict = OrderedDict(ok=False, draft=draft, target=target, problems=problems,
                               warnings=warnings)

    # ---- draft config ----------------------------------------------------------------------
    spec = None
    draft_dir = None
    local = _local_path(draft)
    if local is None:
        problems.append(f"draft: {draft!r} is not a local directory or file (inspect reads local "
                        "checkpoints only and never downloads)")
    else:
        draft_dir = local if os.path.isdir(local) else os.path.dirname(local) or "."
        try:
            spec = DraftSpec.from_pretrained(local)
            warnings.extend(f"draft config: {w}" for w in spec.warnings)
        except DraftSpecError as exc:
            problems.extend(f"draft config: {p}" for p in exc.problems)

    # ---- target config ---------------------------------------------------------------------
    target_blocks = None
    if target is not None:
        tlocal = _local_path(target)
        if tlocal is None:
            problems.append(f"target: {target!r} is not a local directory or file (inspect reads "
                            "local checkpoints only and never downloads)")
        else:
            try:
                tcfg, _ = read_config_json(tlocal, "target")
            except DraftSpecError as exc:
                problems.extend(f"target config: {p}" for p in exc.problems)
            else:
                try:
                    target_blocks = target_num_blocks(tcfg)
                except DraftSpecError as exc:
                    if spec is None:  # else check_against_target reports the same problems
                        problems.extend(f"target config: {p}" for p in exc.problems)
                if spec is not None:
                    t_problems, t_warnings = check_against_target(spec, tcfg)
                    problems.extend(f"target config: {p}" for p in t_problems)
                    warnings.extend(f"target config: {w}" for w in t_warnings)
    report["target_blocks"] = target_blocks

    # ---- weights (headers only) ------------------------------------------------------------
    modules = None
    if draft_dir is not None:
        from vllm_nemotron_spec.checkpoint import check_tensors, expected_modules, scan_checkpoint

        scan = scan_checkpoint(draft_dir)
        problems.extend(f"draft weights: {p}" for p in scan.problems)
        warnings.extend(f"draft weights: {w}" for w in scan.warnings)
        report["checkpoint"] = {
            "files": list(scan.files),
            "index": scan.index,
            "num_tensors": len(scan.tensors),
            "tensors": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape),
                         "file": t.file} for t in scan.tensors.values()],
        }
        if spec is not None:
            if scan.tensors and not scan.problems:
                checked = check_tensors(spec, scan.tensors)
                problems.extend(f"draft weights: {p}" for p in checked.problems)
                warnings.extend(f"draft weights: {w}" for w in checked.warnings)
                modules = checked.modules
            else:
                modules = expected_modules(spec)

    # ---- what the server will do -----------------------------------------------------------
    gamma = None
    if spec is not None:
        try:
            gamma = spec.resolve_num_speculative_tokens(num_speculative_tokens)
        except DraftSpecError as exc:
            problems.extend(f"draft config: {p}" for p in exc.problems)
        report.update(_spec_facts(spec, gamma))
        report["num_speculative_tokens_requested"] = num_speculative_tokens
        report["quantization"] = _quantization(spec, modules)
        report["spec"] = spec.to_dict()
    if spec is not None and gamma is not None and not problems:
        speculative_config = {"method": spec.method, "model": _model_arg(draft),
                              "num_speculative_tokens": gamma}
        report["speculative_config"] = speculative_config
        report["serve_command"] = (
            f"vllm serve {shlex.quote(_model_arg(target)) if target is not None else 'TARGET'} "
            f"--speculative-config {shlex.quote(json.dumps(speculative_config))}"
        )
    report["ok"] = not problems
    return report


def _model_arg(path: str) -> str:
    """What vLLM takes as a model: the checkpoint directory when given its config.json."""
    if os.path.isfile(path):
        return os.path.dirname(path) or "."
    return path


def _local_path(path: str) -> str | None:
    """``path`` if it exists here, else its snapshot in the local Hugging Face cache (never
    downloads)."""
    if os.path.exists(path):
        return path
    if re.fullmatch(r"[\w.-]+/[\w.-]+", path) and not path.startswith((".", "/")):
        try:
            from huggingface_hub import snapshot_download

            return snapshot_download(path, local_files_only=True)
        except Exception:  # not cached, or huggingface_hub absent: a plain "not found"
            return None
    return None


def _spec_facts(spec, gamma) -> dict:
    return OrderedDict(
        method=spec.method,
        architecture=spec.architecture,
        nemotron35_layout=spec.is_nemotron35,
        sample_from_anchor=spec.sample_from_anchor,
        block_size=spec.block_size,
        num_speculative_tokens=gamma,
        max_num_speculative_tokens=spec.max_num_speculative_tokens,
        num_query_rows=None if gamma is None else spec.num_query_rows(gamma),
        mask_token_id=spec.mask_token_id,
        target_layer_ids=list(spec.target_layer_ids),
        aux_hidden_state_ids=list(spec.aux_hidden_state_ids),
        attention={"causal": spec.causal, "sliding_window": spec.sliding_window,
                   "attention_sinks": spec.has_attention_sinks, "rope_theta": spec.rope_theta,
                   "rope_scaling": spec.rope_scaling},
        markov_head={"type": spec.markov_head_type, "rank": spec.markov_rank}
        if spec.method == "dspark" else None,
        embed_tokens="draft" if spec.has_embed_tokens else "target",
        lm_head="draft" if spec.has_lm_head else "target",
    )


def _quantization(spec, modules) -> dict:
    out = OrderedDict(quant_method=spec.quant_method, quant_algo=spec.quant_algo,
                      group_size=spec.quant_group_size,
                      exclude_modules=list(spec.quant_exclude_modules))
    if modules is not None:
        out["modules"] = [
            {"name": m.name, "format": m.format, "logical_shape": list(m.logical_shape),
             "packed_shape": None if m.packed_shape is None else list(m.packed_shape),
             "scale_shape": None if m.scale_shape is None else list(m.scale_shape),
             "found_dtype": m.found_dtype,
             "found_shape": None if m.found_shape is None else list(m.found_shape),
             "ok": m.ok}
            for m in modules
        ]
    return out


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
        out.append(("layout", "Nemotron 3.5: own embed_tokens, the target's lm_head, aux ids = "
                              "target_layer_ids + 1"))
    else:
        out.append(("layout", "generic DFlash/DSpark draft (not the Nemotron 3.5 layout)"))
    if r["sample_from_anchor"]:
        out.append(("anchor", "sample_from_anchor=true: gamma query rows, row k predicts L+k+1"))
    else:
        out.append(("anchor", "sample_from_anchor=false: gamma+1 query rows [b, MASK x gamma], "
                              "row 0 (the anchor) dropped"))
    block = "no block_size" if r["block_size"] is None else f"block_size {r['block_size']}"
    if r["max_num_speculative_tokens"] is not None:
        block += f", at most {r['max_num_speculative_tokens']}"
    if r["num_speculative_tokens"] is not None:
        out.append(("gamma", f"{r['num_speculative_tokens']} drafted tokens ({block}) -> "
                             f"{r['num_query_rows']} query rows per step"))
    elif r.get("num_speculative_tokens_requested") is not None:
        out.append(("gamma", f"{r['num_speculative_tokens_requested']} requested ({block})"))
    else:
        out.append(("gamma", f"unresolved ({block})"))
    out.append(("mask token", str(r["mask_token_id"])))
    att = r["attention"]
    parts = ["causal" if att["causal"] else "non-causal within the block"]
    parts.append(f"sliding window {att['sliding_window']}" if att["sliding_window"]
                 else "full attention")
    if att["attention_sinks"]:
        parts.append("attention sinks")
    rope = f"RoPE theta {att['rope_theta']:g}"
    if att["rope_scaling"]:
        rope += " " + json.dumps(att["rope_scaling"], sort_keys=True)
    out.append(("attention", ", ".join(parts) + "; " + rope))
    if r["markov_head"] is not None:
        out.append(("markov head", f"{r['markov_head']['type'] or 'unspecified'}, rank "
                                   f"{r['markov_head']['rank']}"))
    aux = f"{r['aux_hidden_state_ids']} (target_layer_ids {r['target_layer_ids']} + 1)"
    if r["target_blocks"] is not None:
        beyond = [a for a in r["aux_hidden_state_ids"] if a > r["target_blocks"]]
        aux += (f" vs the target's {r['target_blocks']} blocks: "
                + ("ok" if not beyond else f"{beyond} beyond the last block"))
    elif r["target"] is None:
        aux += "; pass --target to check them against the target's blocks"
    out.append(("aux ids", aux))
    out.append(("embedding", "embed_tokens: " + ("the draft's own" if r["embed_tokens"] == "draft"
                                                 else "the target's")
                + "; lm_head: " + ("the draft's own" if r["lm_head"] == "draft"
                                   else "the target's")))
    q = r["quantization"]
    if q["quant_algo"] is None and q["quant_method"] is None:
        out.append(("quantization", "none (all tensors unquantized)"))
    else:
        excl = len(q["exclude_modules"])
        out.append(("quantization", f"{q['quant_algo'] or q['quant_method']} (group "
                                    f"{q['group_size']}), {excl} exclusion pattern(s)"))
    return out


def _module_rows(modules: list[dict]) -> list[str]:
    """One row per group of identical modules (the layers' copies folded into ``layers.*``)."""
    groups: OrderedDict = OrderedDict()
    for m in modules:
        name = re.sub(r"(^|\.)layers\.\d+\.", r"\1layers.*.", m["name"])
        key = (name, m["format"], m["found_dtype"], tuple(m["logical_shape"]),
               tuple(m["found_shape"] or ()), m["ok"])
        groups.setdefault(key, []).append(m)
    rows = []
    for (name, fmt, dtype, logical, _, ok), members in groups.items():
        m = members[0]
        label = name + (f" (x{len(members)})" if len(members) > 1 else "")
        if fmt == "nvfp4":
            text = (f"NVFP4  {label:<38} logical {m['logical_shape']} stored uint8 "
                    f"{m['packed_shape']}, scales F8_E4M3 {m['scale_shape']}")
        elif fmt == "dense":
            shown = dtype or "BF16"
            text = f"{shown:<6} {label:<38} {m['logical_shape']}"
        else:
            text = f"{'?':<6} {label:<38} logical {m['logical_shape']} (layout not checked)"
        if dtype is not None and fmt == "nvfp4" and dtype != "U8":
            text += f"  found {dtype} {m['found_shape']}"
        elif m["found_shape"] is not None and tuple(m["found_shape"]) != tuple(logical) \
                and fmt == "dense":
            text += f"  found {m['found_shape']}"
        if not ok:
            text += "  <- problem"
        rows.append(text)
    return rows
