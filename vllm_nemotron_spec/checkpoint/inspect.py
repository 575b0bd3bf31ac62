"""The ``inspect`` command's report of a draft checkpoint, read without loading it.

A draft or target is a local directory (or its config.json) or a Hugging Face id: config files
come from the local cache or, with the Hub on, are downloaded; tensor headers come from local
files or the Hub's safetensors metadata (header byte ranges), never from a weight download.
The problems and warnings are :func:`checkpoint.check.check_draft`'s, which the NemotronH config
hook (``target_hook``) raises at server start-up, so both say the same thing; the report adds
what the checkpoint is and how to serve it.
"""

from __future__ import annotations

import json
import shlex
from collections import OrderedDict

from vllm_nemotron_spec.checkpoint.check import check_draft
from vllm_nemotron_spec.commands import model_argument, serve_program


def inspect_checkpoint(
    draft: str,
    target: str | None = None,
    num_speculative_tokens: int | None = None,
    *,
    revision: str | None = None,
    target_revision: str | None = None,
    draft_config: dict | None = None,
    target_config=None,
    hub: bool = True,
) -> dict:
    """Everything ``inspect`` prints, as a dict; never raises for a bad checkpoint.

    The arguments are :func:`check.check_draft`'s: ``draft`` / ``target`` are local paths or Hub
    ids (at ``revision`` / ``target_revision``). ``report["weights_checked"]`` says where the
    tensor headers were read, or why they were not (``report["weights_deferred"]`` is then
    True)."""
    checked = check_draft(
        draft,
        target,
        num_speculative_tokens,
        revision=revision,
        target_revision=target_revision,
        draft_config=draft_config,
        target_config=target_config,
        hub=hub,
    )
    report: dict = OrderedDict(
        ok=checked.ok,
        draft=draft,
        target=target,
        problems=checked.problems,
        warnings=checked.warnings,
        target_blocks=checked.target_blocks,
    )
    if checked.weights is not None:
        report["weights_checked"] = checked.weights.where
        report["weights_deferred"] = checked.weights.scan is None
        if checked.weights.scan is not None:
            report["checkpoint"] = _checkpoint_facts(checked.weights.scan)
    spec, gamma = checked.spec, checked.num_speculative_tokens
    if spec is not None:
        report.update(_spec_facts(spec, gamma))
        report["num_speculative_tokens_requested"] = num_speculative_tokens
        report["quantization"] = _quantization(spec, checked.modules)
        report["spec"] = spec.to_dict()
    if spec is not None and gamma is not None and checked.ok:
        report.update(_serve_facts(spec.method, gamma, draft, target, revision, target_revision))
    return report


def _serve_facts(method, gamma, draft, target, revision, target_revision) -> dict:
    """The speculative config and the ``vllm serve`` command that run the draft."""
    speculative_config = {
        "method": method,
        "model": model_argument(draft),
        "num_speculative_tokens": gamma,
    }
    if revision is not None:
        speculative_config["revision"] = revision
    serve_command = (
        f"{serve_program()} "
        f"{shlex.quote(model_argument(target)) if target is not None else 'TARGET'} "
        + (f"--revision {shlex.quote(target_revision)} " if target_revision else "")
        + f"--speculative-config {shlex.quote(json.dumps(speculative_config))}"
    )
    return {"speculative_config": speculative_config, "serve_command": serve_command}


def _checkpoint_facts(scan) -> dict:
    return {
        "files": list(scan.files),
        "index": scan.index,
        "num_tensors": len(scan.tensors),
        "tensors": [
            {
                "name": t.name,
                "dtype": t.dtype,
                "shape": list(t.shape),
                "file": t.file,
                "truncated": t.truncated,
            }
            for t in scan.tensors.values()
        ],
    }


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
        attention={
            "causal": spec.causal,
            "sliding_window": spec.sliding_window,
            "attention_sinks": spec.has_attention_sinks,
            "rope_theta": spec.rope_theta,
            "rope_scaling": spec.rope_scaling,
        },
        markov_head={"type": spec.markov_head_type, "rank": spec.markov_rank}
        if spec.method == "dspark"
        else None,
        embed_tokens="draft" if spec.has_embed_tokens else "target",
        lm_head="draft" if spec.has_lm_head else "target",
    )


def _quantization(spec, modules) -> dict:
    out = OrderedDict(
        quant_method=spec.quant_method,
        quant_algo=spec.quant_algo,
        group_size=spec.quant_group_size,
        exclude_modules=list(spec.quant_exclude_modules),
    )
    if modules is not None:
        out["modules"] = [
            {
                "name": m.name,
                "format": m.format,
                "logical_shape": list(m.logical_shape),
                "packed_shape": None if m.packed_shape is None else list(m.packed_shape),
                "scale_shape": None if m.scale_shape is None else list(m.scale_shape),
                "found_dtype": m.found_dtype,
                "found_shape": None if m.found_shape is None else list(m.found_shape),
                "ok": m.ok,
                "truncated": m.truncated,
            }
            for m in modules
        ]
    return out
