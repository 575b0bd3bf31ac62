"""Check a draft checkpoint as a whole, without loading it: the one check of the package.

The draft's config parsed (``checkpoint.spec``) and checked against its target, its files read
(``checkpoint.headers``: config files, safetensors headers) and its tensors checked against the
config, the drafted-token count checked against the trained block. :func:`check_draft` returns
every problem and warning; the ``inspect`` command reports them (``checkpoint.inspect``) and the
NemotronH config hook (``target_hook``) refuses a draft with any, so both say the same thing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from vllm_nemotron_spec.checkpoint import headers, layout
from vllm_nemotron_spec.checkpoint import spec as parse
from vllm_nemotron_spec.checkpoint.headers import (
    FLOAT_DTYPES,
    CheckpointScan,
    HeaderSource,
    TensorInfo,
    name_list,
)
from vllm_nemotron_spec.checkpoint.spec import DraftSpec, DraftSpecError


@dataclass(frozen=True)
class ModuleCheck:
    """One module (linear layer) or tensor of the draft: what the spec expects, what was found."""

    name: str  # module ("layers.0.mlp.up_proj") or tensor ("norm.weight")
    format: str  # "nvfp4", "dense" or "unchecked" (a quantization this package does not know)
    logical_shape: tuple[int, ...]
    packed_shape: tuple[int, ...] | None = None  # NVFP4: stored uint8 weight
    scale_shape: tuple[int, ...] | None = None  # NVFP4: float8 block scales
    found_dtype: str | None = None  # of the weight tensor, when the checkpoint was read
    found_shape: tuple[int, ...] | None = None
    ok: bool = True
    truncated: bool = False  # a tensor of it lies past the end of a truncated file


@dataclass(frozen=True)
class TensorCheck:
    modules: tuple[ModuleCheck, ...]
    problems: tuple[str, ...]
    warnings: tuple[str, ...]


# --------------------------------------------------------------------------------------------
# The draft's tensors against its config.


def _layout_checked(spec: DraftSpec) -> bool:
    """Whether this package knows the stored layout of the spec's quantization."""
    return spec.quant_method in (None, "modelopt") and (spec.quant_algo is None or spec.is_nvfp4)


def expected_modules(spec: DraftSpec) -> tuple[ModuleCheck, ...]:
    """The modules and tensors the spec implies, with their expected storage (nothing read)."""
    known = _layout_checked(spec)
    out = []
    for name, logical in spec.linear_modules():
        if not known:
            out.append(ModuleCheck(name, "unchecked", logical))
        elif spec.is_nvfp4 and spec.is_quantized(name):
            out.append(
                ModuleCheck(
                    name,
                    "nvfp4",
                    logical,
                    layout.packed_shape(logical),
                    layout.scale_shape(logical),
                )
            )
        else:
            out.append(ModuleCheck(name, "dense", logical))
    for name, shape in spec.dense_tensors():
        out.append(ModuleCheck(name, "dense", shape))
    return tuple(out)


def check_tensors(spec: DraftSpec, tensors: dict[str, TensorInfo]) -> TensorCheck:
    """Compare the checkpoint's tensors with the layout ``spec`` implies (see module doc)."""
    problems: list[str] = []
    warnings: list[str] = []
    used: set[str] = set()

    def find(name: str) -> TensorInfo | None:
        for key in (name, f"model.{name}"):
            if key in tensors:
                used.add(key)
                return tensors[key]
        return None

    why_dense = (
        "the config has no quantization_config"
        if spec.quant_algo is None
        else "quantization_config excludes it"
    )
    linear = {name for name, _ in spec.linear_modules()}
    modules: list[ModuleCheck] = []
    for expected in expected_modules(spec):
        before = len(problems)
        name = expected.name
        is_linear = name in linear
        weight_name = f"{name}.weight" if is_linear else name
        weight = find(weight_name)
        scales = {
            s: find(f"{name}.{s}") if is_linear else None
            for s in ("weight_scale", "weight_scale_2", "input_scale")
        }
        logical = expected.logical_shape
        if expected.format == "nvfp4":
            packed, scale = expected.packed_shape, expected.scale_shape
            if weight is None:
                problems.append(
                    f"`{weight_name}`: missing (NVFP4 module: expected uint8 {list(packed)} for "
                    f"logical {list(logical)})"
                )
            elif weight.dtype != "U8" or weight.shape != packed:
                if weight.dtype in FLOAT_DTYPES and weight.shape == logical:
                    problems.append(
                        f"`{weight_name}`: found {weight.dtype} {list(weight.shape)} (unquantized) "
                        f"but quantization_config ({spec.quant_algo}) does not exclude `{name}`: "
                        f"expected NVFP4 uint8 {list(packed)} (logical {list(logical)})"
                    )
                else:
                    problems.append(
                        f"`{weight_name}`: found {weight.dtype} {list(weight.shape)}, expected "
                        f"NVFP4 uint8 {list(packed)} (logical {list(logical)}, two E2M1 codes "
                        "per byte)"
                    )
            s1 = scales["weight_scale"]
            if s1 is None:
                problems.append(
                    f"`{name}.weight_scale`: missing (expected F8_E4M3 {list(scale)}, "
                    f"one scale per 16 inputs of logical {list(logical)})"
                )
            elif s1.dtype != "F8_E4M3" or s1.shape != scale:
                problems.append(
                    f"`{name}.weight_scale`: found {s1.dtype} {list(s1.shape)}, expected F8_E4M3 "
                    f"{list(scale)} (one scale per 16 inputs of logical {list(logical)}; packed "
                    f"weight {list(packed)})"
                )
            for key, required in (("weight_scale_2", True), ("input_scale", False)):
                t = scales[key]
                if t is None:
                    if required:
                        problems.append(
                            f"`{name}.{key}`: missing (expected a float32 scalar, the global scale)"
                        )
                elif t.dtype != "F32" or t.shape not in ((), (1,)):
                    problems.append(
                        f"`{name}.{key}`: found {t.dtype} {list(t.shape)}, expected a "
                        "float32 scalar"
                    )
        elif expected.format == "dense":
            if weight is None:
                problems.append(f"`{weight_name}`: missing (expected {list(logical)})")
            elif weight.dtype not in FLOAT_DTYPES:
                hint = ""
                if is_linear and weight.dtype == "U8":
                    try:
                        looks_packed = weight.shape == layout.packed_shape(logical)
                    except ValueError:
                        looks_packed = False
                    if looks_packed:
                        pattern = spec.exclusion_pattern(name)
                        hint = f"; it looks NVFP4-packed, but {why_dense}" + (
                            f" (pattern {pattern!r})" if pattern else ""
                        )
                problems.append(
                    f"`{weight_name}`: found {weight.dtype} {list(weight.shape)}, expected an "
                    f"unquantized (BF16) tensor {list(logical)}{hint}"
                )
            elif weight.shape != logical:
                problems.append(
                    f"`{weight_name}`: found {weight.dtype} {list(weight.shape)}, "
                    f"expected shape {list(logical)}"
                )
            for key, t in scales.items():
                if t is not None:
                    problems.append(
                        f"`{name}.{key}`: present, but `{name}` is stored unquantized ({why_dense})"
                    )
        else:  # a quantization whose layout this package does not know
            packed = find(f"{name}.weight_packed") if is_linear and weight is None else None
            if packed is not None:  # compressed-tensors packs as weight_packed (+ its scales)
                weight = packed
                for extra in ("weight_global_scale", "weight_zero_point", "input_global_scale"):
                    find(f"{name}.{extra}")
            elif weight is None:
                problems.append(f"`{weight_name}`: missing")
        cut = any(x is not None and x.truncated for x in (weight, *scales.values()))
        modules.append(
            ModuleCheck(
                name,
                expected.format,
                logical,
                expected.packed_shape,
                expected.scale_shape,
                None if weight is None else weight.dtype,
                None if weight is None else weight.shape,
                ok=len(problems) == before and not cut,
                truncated=cut,
            )
        )

    for tensor, own, flag in (
        ("embed_tokens.weight", spec.has_embed_tokens, "has_embed_tokens"),
        ("lm_head.weight", spec.has_lm_head, "has_lm_head"),
    ):
        if own:
            continue
        present = [k for k in (tensor, f"model.{tensor}") if k in tensors]
        if not present:
            continue
        used.update(present)
        message = (
            f"`{present[0]}` is in the checkpoint but `{flag}` is "
            f"{'false' if spec.is_nemotron35 else 'not true'}: the draft uses the target's"
        )
        (problems if spec.is_nemotron35 else warnings).append(message)
    unexpected = sorted(set(tensors) - used)
    if unexpected:
        warnings.append(
            f"{len(unexpected)} tensor(s) the draft does not use: {name_list(unexpected)}"
        )
    return TensorCheck(tuple(modules), tuple(problems), tuple(warnings))


def tensor_problems(spec: DraftSpec, scan: CheckpointScan | None) -> tuple:
    """(modules, problems, warnings) of the draft's tensors against ``spec``; with no readable
    headers (``scan`` None or broken, but not merely truncated: then the tensors past the end are
    marked) the modules the spec implies and no tensor problems."""
    truncated = scan is not None and any(t.truncated for t in scan.tensors.values())
    if scan is None or not scan.tensors or (scan.problems and not truncated):
        return expected_modules(spec), [], []
    checked = check_tensors(spec, scan.tensors)
    return (
        checked.modules,
        [f"draft weights: {p}" for p in checked.problems],
        [f"draft weights: {w}" for w in checked.warnings],
    )


def weights_problems(spec: DraftSpec | None, scan: CheckpointScan | None) -> tuple:
    """(modules, problems, warnings) of the draft's files: what their headers get wrong, then
    (with a spec) its tensors against the spec; modules None without a spec."""
    problems = [] if scan is None else [f"draft weights: {p}" for p in scan.problems]
    warnings = [] if scan is None else [f"draft weights: {w}" for w in scan.warnings]
    modules = None
    if spec is not None:
        modules, t_problems, t_warnings = tensor_problems(spec, scan)
        problems += t_problems
        warnings += t_warnings
    return modules, problems, warnings


# --------------------------------------------------------------------------------------------
# The draft as a whole.


@dataclass
class DraftCheck:
    """What :func:`check_draft` found. ``spec`` None: the draft's config could not be parsed;
    ``weights`` None: its files were not looked at (no config and no local path)."""

    spec: DraftSpec | None
    problems: list[str]
    warnings: list[str]
    target_blocks: int | None = None
    weights: HeaderSource | None = None
    modules: tuple[ModuleCheck, ...] | None = None
    num_speculative_tokens: int | None = None  # the drafted tokens a server would run

    @property
    def ok(self) -> bool:
        return not self.problems


def check_draft(
    draft: str,
    target: str | None = None,
    num_speculative_tokens: int | None = None,
    *,
    revision: str | None = None,
    target_revision: str | None = None,
    draft_config: dict | None = None,
    target_config=None,
    hub: bool = True,
    method: str | None = None,
) -> DraftCheck:
    """Check ``draft`` (a local path or a Hub id at ``revision``) as a whole; never raises for a
    bad checkpoint.

    The config is checked against the target (``target`` at ``target_revision``, or its loaded
    ``target_config``: a config.json dict or vLLM's ``hf_config``), the tensor headers against
    the config (from local files, a complete cache snapshot, or with ``hub`` the Hub's
    safetensors metadata; ``weights.where`` says from where, or why not), the drafted-token count
    against the trained block and, with ``method``, the speculative method against the draft's.
    ``draft_config``: the draft's config.json as already loaded (read otherwise)."""
    problems: list[str] = []
    warnings: list[str] = []
    spec = _parse_draft(draft, revision, draft_config, hub, problems, warnings)
    if target_config is None and target is not None:
        try:
            target_config, _ = headers.load_config(target, "target", target_revision, hub=hub)
        except DraftSpecError as exc:
            problems.extend(f"target config: {p}" for p in exc.problems)
    check = DraftCheck(spec, problems, warnings)
    check.target_blocks = _check_target(spec, target, target_config, problems, warnings)
    if spec is not None or (not headers.is_repo_id(draft) and os.path.exists(draft)):
        check.weights = headers.draft_headers(draft, revision, hub=hub)
        check.modules, w_problems, w_warnings = weights_problems(spec, check.weights.scan)
        problems.extend(w_problems)
        warnings.extend(w_warnings)
    if spec is not None:
        try:
            check.num_speculative_tokens = spec.resolve_num_speculative_tokens(
                num_speculative_tokens
            )
        except DraftSpecError as exc:
            problems.extend(f"draft config: {p}" for p in exc.problems)
        if method is not None and method != spec.method:
            problems.append(
                f'speculative_config.method is "{method}" but the draft {draft} is a '
                f"{spec.method} checkpoint (architecture {spec.architecture}): use "
                f'{{"method": "{spec.method}", ...}}'
            )
    return check


def _parse_draft(draft, revision, draft_config, hub, problems, warnings) -> DraftSpec | None:
    """The draft's :class:`DraftSpec` (its config read unless given), or None with the
    problems."""
    try:
        if draft_config is None:
            draft_config, _ = headers.load_config(draft, "draft", revision, hub=hub)
        spec = DraftSpec.from_config(draft_config, path=draft)
    except DraftSpecError as exc:
        problems.extend(f"draft config: {p}" for p in exc.problems)
        return None
    warnings.extend(f"draft config: {w}" for w in spec.warnings)
    return spec


def _check_target(spec, target, target_config, problems, warnings) -> int | None:
    """The target's number of blocks (None when unknown), after checking that it is a NemotronH
    model and that the draft fits it."""
    if target_config is None:
        return None
    what = not_nemotron_h(target_config)
    if what:
        problems.append(
            f"target: {target} is {what}, not a NemotronH model "
            "(NemotronHForCausalLM); pass the target model as --target"
        )
        return None
    blocks = None
    try:
        blocks = parse.target_num_blocks(target_config)
    except DraftSpecError as exc:
        if spec is None:  # else check_against_target reports the same problems
            problems.extend(f"target config: {p}" for p in exc.problems)
    if spec is not None:
        t_problems, t_warnings = parse.check_against_target(spec, target_config)
        problems.extend(f"target config: {p}" for p in t_problems)
        warnings.extend(f"target config: {w}" for w in t_warnings)
    return blocks


def not_nemotron_h(target_config) -> str | None:
    """What a target config (a dict or a loaded config object) is when it is plainly not a
    NemotronH model (its architectures or model_type say so), else None."""
    config = parse.target_config_dict(target_config)
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


def check_downloaded_weights(
    spec: DraftSpec, model: str, revision: str | None
) -> tuple[HeaderSource, list[str]]:
    """The load-time half of :func:`check_draft` when start-up could not read the headers: the
    files vLLM downloaded (never the Hub) checked as at start-up (the same problems). No problem
    when no file was found (``source.scan`` None or without files)."""
    source = headers.draft_headers(model, revision, hub=False)
    if source.scan is None or not source.scan.files:
        return source, []
    return source, weights_problems(spec, source.scan)[1]


# --------------------------------------------------------------------------------------------
# The draft vLLM loaded.


def vllm_draft_config(draft_model_config) -> dict:
    """The draft's config.json as vLLM loaded it (a vLLM ``ModelConfig``): read from the local
    path or the cache at the config's revision (vLLM fetched it there), else the ``hf_config``
    vLLM built, as a dict."""
    try:
        return headers.load_config(
            draft_model_config.model, "draft", getattr(draft_model_config, "revision", None)
        )[0]
    except DraftSpecError:
        return draft_model_config.hf_config.to_dict()


def draft_spec_from_vllm_config(vllm_config) -> DraftSpec:
    """The draft's DraftSpec, parsed from its config.json as vLLM loaded it (local path, or the
    cache at the draft's revision): what the draft models and the V1 proposers read."""
    draft_config = vllm_config.speculative_config.draft_model_config
    return DraftSpec.from_config(vllm_draft_config(draft_config), path=draft_config.model)
