"""DraftSpec: the one validated parse of a DFlash / DSpark draft checkpoint's config.json.

Every reader takes a :class:`DraftSpec`, never the raw dict, so ``inspect`` and the server report
a checkpoint problem the same way; the parse collects every problem into one
:class:`DraftSpecError`. The Nemotron 3.5 layout is decided by the config's structure
(:func:`is_nemotron35_draft_config`) and everything else is validated, so a damaged Nemotron
config is reported instead of taking the generic path. Pure Python: no torch, no vLLM.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Literal

from vllm_nemotron_spec.checkpoint import layout
from vllm_nemotron_spec.checkpoint.layout import GROUP_SIZE as NVFP4_GROUP_SIZE

NEMOTRON35_ARCHITECTURES = tuple(layout.ARCHITECTURES.values())
"""Draft architectures that can carry the Nemotron 3.5 layout."""

VLLM_DSPARK_ARCHITECTURES = (
    "Qwen3DSparkModel",
    "Qwen3OmniDSparkModel",
    "MuseSparkDSparkModel",
    "Gemma4DSparkModel",
    "K3DSparkModel",
)
"""With ``method="dspark"`` vLLM 0.33 silently rewrites any other architecture to DeepSeek-V4
DSpark."""

NVFP4_QUANT_ALGOS = (layout.QUANT_ALGO, "NVFP4")
"""ModelOpt algorithms whose weights use the packed NVFP4 layout of ``nvfp4.format``."""


NEMOTRON35_DFLASH_NUM_SPECULATIVE_TOKENS = 5
"""The Nemotron 3.5 DFlash draft declares no ``block_size``; NVIDIA's published vLLM recipe drafts 5
tokens (acceptance length 3.18 @ 5 drafts), i.e. SGLang's block of 6 minus the anchor row."""

MAX_DRAFT_LAYERS = 1024
"""Sanity bound on ``num_hidden_layers`` (per-layer tables are built from it)."""

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"

_MISSING = object()


class DraftSpecError(ValueError):
    """A draft (or target) checkpoint is inconsistent. ``problems`` lists every problem found;
    each names the field or tensor, what was expected and what was found."""

    def __init__(self, problems: str | list[str] | tuple[str, ...], source: str | None = None):
        if isinstance(problems, str):
            problems = [problems]
        self.problems: tuple[str, ...] = tuple(problems)
        self.source = source
        super().__init__(self._message())

    def _message(self) -> str:
        head = f"{self.source}: " if self.source else ""
        if len(self.problems) == 1:
            return head + self.problems[0]
        lines = "\n".join(f"  - {p}" for p in self.problems)
        return f"{head}{len(self.problems)} problems:\n{lines}"


# --------------------------------------------------------------------------------------------
# Small helpers: describing JSON values and reading typed fields while collecting problems.


def _jtype(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple)):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _show(value: Any, limit: int = 60) -> str:
    """A value as it would appear in config.json, shortened."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _found(value: Any) -> str:
    return "null" if value is None else f"{_jtype(value)} {_show(value)}"


class _Bad(Exception):
    """A value does not have the expected type/range (message: what was expected)."""


def _int(value: Any, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Bad("an integer" if minimum is None else _int_desc(minimum))
    if minimum is not None and value < minimum:
        raise _Bad(_int_desc(minimum))
    return value


def _int_desc(minimum: int) -> str:
    named = {0: "a non-negative integer", 1: "a positive integer"}
    return named.get(minimum, f"an integer >= {minimum}")


def _pos_int(value: Any) -> int:
    return _int(value, 1)


def _nonneg_int(value: Any) -> int:
    return _int(value, 0)


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise _Bad("true or false")
    return value


def _str(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise _Bad("a non-empty string")
    return value


def _pos_float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _Bad("a positive finite number")
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise _Bad("a positive finite number")
    return value


def _id_list(value: Any) -> tuple[int, ...]:
    expected = "a non-empty list of distinct non-negative integers"
    if not isinstance(value, list) or not value:
        raise _Bad(expected)
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            raise _Bad(expected)
    if len(set(value)) != len(value):
        raise _Bad(expected)
    return tuple(value)


def _str_list(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _Bad("a list of strings")
    return tuple(value)


def _dict(value: Any) -> dict:
    if not isinstance(value, dict):
        raise _Bad("an object")
    return value


class _Fields:
    """Reads typed fields of one JSON object, appending a problem for each bad one.

    A ``null`` value counts as absent (Hugging Face configs write ``null`` for unset fields).
    """

    def __init__(self, cfg: dict, problems: list[str], where: str = ""):
        self.cfg = cfg
        self.problems = problems
        self.where = where

    def name(self, key: str) -> str:
        return f"`{self.where}{key}`"

    def has(self, key: str) -> bool:
        return self.cfg.get(key) is not None

    def get(self, key: str, conv, *, required: bool = False, default: Any = None) -> Any:
        value = self.cfg.get(key)
        if value is None:
            if required:
                try:
                    conv(_MISSING)
                except _Bad as bad:
                    expected = str(bad)
                self.problems.append(
                    f"{self.name(key)}: missing (expected {expected})"
                    if key not in self.cfg
                    else f"{self.name(key)}: expected {expected}, found null"
                )
            return default
        try:
            return conv(value)
        except _Bad as bad:
            self.problems.append(f"{self.name(key)}: expected {bad}, found {_found(value)}")
            return default


# --------------------------------------------------------------------------------------------
# Public helpers of the API.


def is_nemotron35_draft_config(cfg: dict) -> bool:
    """Whether ``cfg`` has the Nemotron 3.5 draft layout (never raises).

    The layout is defined by the four things that make these drafts different from other
    DFlash / DSpark drafts: a ``DFlashDraftModel`` / ``Qwen3DSparkModel`` architecture that
    (1) ships its own token embedding (``has_embed_tokens: true``), (2) has no lm_head and uses the
    target's (``has_lm_head: false``), (3) names the target's residual-stream capture points
    explicitly (``eagle_aux_hidden_state_layer_ids``) and (4) carries a ``dflash_config`` object.
    Values are not part of the decision: ids, mask token, anchor mode and quantization are
    validated by :class:`DraftSpec`, so a damaged Nemotron config yields errors rather than the
    generic path. Quantization is deliberately not part of it (BF16 drafts in this layout exist),
    nor is ``sample_from_anchor`` (read from its own field, see :func:`get_sample_from_anchor`).
    """
    if not isinstance(cfg, dict):
        return False
    archs = cfg.get("architectures")
    if not isinstance(archs, list) or not any(
        isinstance(a, str) and a in NEMOTRON35_ARCHITECTURES for a in archs
    ):
        return False
    return (
        cfg.get("has_embed_tokens") is True
        and cfg.get("has_lm_head") is False
        and cfg.get("eagle_aux_hidden_state_layer_ids") is not None
        and isinstance(cfg.get("dflash_config"), dict)
    )


def get_sample_from_anchor(cfg: dict) -> bool:
    """The DSpark query layout flag, read from the checkpoint's TOP-LEVEL ``sample_from_anchor``.

    Absent -> ``True`` (the original DSpark layout: gamma query rows, row k predicts L+k+1).
    ``False`` (Nemotron 3.5, "bonus anchor"): gamma+1 rows ``[b, MASK x gamma]``, row 0 dropped.
    A value only inside ``dflash_config`` is an error: readers that look only at the top level
    would take the default ``True`` while the checkpoint may mean ``False`` (acceptance ~1 token).
    A ``dflash_config`` copy must agree with the top-level value.
    """
    if not isinstance(cfg, dict):
        raise DraftSpecError(f"config: expected a JSON object, found {_jtype(cfg)}")
    problems: list[str] = []
    value = _sample_from_anchor(cfg, problems)
    if problems:
        raise DraftSpecError(problems)
    return value


def _sample_from_anchor(cfg: dict, problems: list[str]) -> bool:
    top = cfg.get("sample_from_anchor", _MISSING)
    dflash_config = cfg.get("dflash_config")
    nested = (
        dflash_config.get("sample_from_anchor", _MISSING)
        if isinstance(dflash_config, dict)
        else _MISSING
    )
    if top is _MISSING or top is None:
        if nested is not _MISSING and nested is not None:
            problems.append(
                f"`sample_from_anchor`: set only inside dflash_config (= {_show(nested)}); the "
                "top-level field decides the DSpark query layout and defaults to true when absent, "
                "so the checkpoint is ambiguous: set the top-level `sample_from_anchor` too"
            )
        return True
    if not isinstance(top, bool):
        problems.append(f"`sample_from_anchor`: expected true or false, found {_found(top)}")
        return True
    if nested is not _MISSING and nested is not None and nested is not top:
        problems.append(
            f"`dflash_config.sample_from_anchor` ({_show(nested)}) disagrees with the top-level "
            f"`sample_from_anchor` ({_show(top)})"
        )
    return top


def read_config_json(path: str, what: str = "draft") -> tuple[dict, str]:
    """Read ``path`` (a checkpoint directory or a JSON file) -> (object, file read).

    Raises :class:`DraftSpecError` naming the file for a missing file, invalid JSON or a
    top-level value that is not an object.
    """
    path = os.fspath(path)
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.exists(path):
        raise DraftSpecError(f"{what} {path!r}: no such file or directory")
    if not os.path.isfile(file):
        raise DraftSpecError(f"{what} {path!r}: no config.json in this directory")
    try:
        with open(file, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise DraftSpecError(f"{file}: cannot read ({exc.strerror or exc})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DraftSpecError(f"{file}: not UTF-8 text (byte {exc.start})") from None
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DraftSpecError(
            f"{file}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    except RecursionError:
        raise DraftSpecError(f"{file}: invalid JSON (nested too deeply)") from None
    except ValueError as exc:  # e.g. an integer literal beyond Python's digit limit
        raise DraftSpecError(f"{file}: invalid JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise DraftSpecError(
            f"{file}: expected a JSON object at the top level, found {_jtype(cfg)}"
        )
    return cfg, file


BLOCK_TYPE_CHARS = {
    "linear_attention": "M",
    "mamba": "M",
    "full_attention": "*",
    "attention": "*",
    "mlp": "-",
    "moe": "E",
}
"""``layers_block_type`` values (transformers >= 5 and their legacy names) -> pattern characters."""

_TARGET_FIELDS = (
    "hybrid_override_pattern",
    "layers_block_type",
    "num_hidden_layers",
    "hidden_size",
    "vocab_size",
    "architectures",
)


def target_config_dict(target_config: Any) -> Any:
    """The target facts the checks read, as a dict, from any of the target's encodings.

    A dict (a parsed config.json) is returned as is: the pattern string, ``layers_block_type`` and
    a nested ``text_config`` are all read from it by the checks. A loaded config object (the
    ``hf_config`` vLLM built, a transformers ``PretrainedConfig``) is read through its text config's
    attributes, so the properties transformers >= 5 derives from ``layers_block_type``
    (``hybrid_override_pattern``, ``num_hidden_layers``) count like fields. Anything else is
    returned unchanged (and reported by the checks).
    """
    if isinstance(target_config, dict) or not hasattr(target_config, "to_dict"):
        return target_config
    text = target_config
    get_text = getattr(target_config, "get_text_config", None)
    if callable(get_text):
        try:
            text = get_text()
        except Exception:  # a config class without a usable text config: read the top level
            text = target_config
    out = {}
    for key in _TARGET_FIELDS:
        try:
            value = getattr(text, key, None)
        except Exception:  # a property that cannot be computed counts as absent
            value = None
        if value is None and key == "architectures":
            value = getattr(target_config, key, None)
        if value is not None:
            out[key] = list(value) if isinstance(value, tuple) else value
    return out


def target_num_blocks(target_config: Any) -> int:
    """Number of blocks of the target (a config.json dict or a loaded config object): the length
    of ``layers_block_type`` (transformers >= 5), else of ``hybrid_override_pattern``, else
    ``num_hidden_layers``; a pattern and ``num_hidden_layers`` both present must agree."""
    problems: list[str] = []
    blocks = _target_blocks(target_config, problems)
    if problems or blocks is None:
        raise DraftSpecError(
            problems or ["target config: cannot tell the number of blocks"], source="target"
        )
    return blocks


def _target_text_config(target_config: Any, problems: list[str]) -> dict | None:
    target_config = target_config_dict(target_config)
    if not isinstance(target_config, dict):
        problems.append(f"target config: expected a JSON object, found {_jtype(target_config)}")
        return None
    text = target_config.get("text_config")
    if isinstance(text, dict) and not any(
        k in target_config for k in ("hybrid_override_pattern", "layers_block_type")
    ):
        return text
    return target_config


def _target_blocks(target_config: Any, problems: list[str]) -> int | None:
    tc = _target_text_config(target_config, problems)
    if tc is None:
        return None
    f = _Fields(tc, problems, "target.")
    block_types = f.get("layers_block_type", _str_list)
    if block_types is not None:
        unknown = sorted({t for t in block_types if t not in BLOCK_TYPE_CHARS})
        if unknown or not block_types:
            problems.append(
                f"`target.layers_block_type`: expected a non-empty list of "
                f"{sorted(BLOCK_TYPE_CHARS)}, found {_show(unknown or block_types)}"
            )
            return None
        # transformers >= 5 derives the pattern and the layer count from this list and ignores
        # a stale num_hidden_layers, so the list alone counts the blocks.
        return len(block_types)
    pattern = f.get("hybrid_override_pattern", _str)
    layers = f.get("num_hidden_layers", _pos_int)
    if pattern is not None and layers is not None and len(pattern) != layers:
        problems.append(
            f"`target.hybrid_override_pattern` has {len(pattern)} blocks but "
            f"`target.num_hidden_layers` is {layers}"
        )
        return None
    if pattern is not None:
        return len(pattern)
    if layers is None and not any(
        f.has(k) for k in ("hybrid_override_pattern", "num_hidden_layers", "layers_block_type")
    ):
        problems.append(
            "target config: missing `layers_block_type`, `hybrid_override_pattern` and "
            "`num_hidden_layers` (cannot count the target's blocks)"
        )
    return layers


# --------------------------------------------------------------------------------------------
# The spec.


@dataclass(frozen=True)
class DraftSpec:
    """Everything the package needs to know about one draft checkpoint, validated."""

    path: str | None
    architecture: str
    method: Literal["dflash", "dspark"]
    is_nemotron35: bool
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    causal: bool
    sliding_window: int | None
    has_attention_sinks: bool
    rope_theta: float
    rope_scaling: dict | None
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    aux_hidden_state_ids: tuple[int, ...]
    sample_from_anchor: bool
    block_size: int | None
    markov_head_type: str | None
    markov_rank: int | None
    has_embed_tokens: bool
    has_lm_head: bool
    quant_algo: str | None
    quant_group_size: int | None
    quant_exclude_modules: tuple[str, ...]
    # Optional fields: defaults where the config does not set them.
    model_type: str | None = None
    hidden_act: str = "silu"
    attention_bias: bool = False
    target_hidden_size: int | None = None  # fc input per aux layer; None -> hidden_size
    draft_vocab_size: int | None = None  # markov_w2 / lm_head rows; None -> vocab_size
    max_position_embeddings: int | None = None
    layer_types: tuple[str, ...] | None = None  # per layer: full_attention / sliding_attention
    num_target_layers: int | None = None  # declared by some generic drafts; checked vs the target
    default_num_speculative_tokens: int | None = None
    quant_method: str | None = None
    warnings: tuple[str, ...] = field(default=(), compare=False)

    # ---- construction ----------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path, target_config: dict | None = None) -> "DraftSpec":
        """Parse ``path/config.json`` (``path`` may also be the JSON file itself). When the config
        has no ``quantization_config``, ModelOpt's legacy ``hf_quant_config.json`` is read."""
        cfg, file = read_config_json(path, "draft")
        quant_file = os.path.join(os.path.dirname(file), "hf_quant_config.json")
        if "quantization_config" not in cfg and os.path.isfile(quant_file):
            quant, _ = read_config_json(quant_file, "draft")
            cfg = dict(cfg, quantization_config=quant)
        return cls.from_config(cfg, path=os.fspath(path), target_config=target_config)

    @classmethod
    def from_config(cls, cfg: dict, path=None, target_config: dict | None = None) -> "DraftSpec":
        """Parse and validate a config dict; with ``target_config`` also check it against the
        target (:func:`validate_against_target`). Raises :class:`DraftSpecError` listing every
        problem found."""
        source = f"draft {path}" if path is not None else None
        if not isinstance(cfg, dict):
            raise DraftSpecError(
                f"config.json: expected a JSON object at the top level, found {_jtype(cfg)}",
                source=source,
            )
        problems: list[str] = []
        warnings: list[str] = []
        values = _parse(cfg, problems, warnings)
        if problems:
            raise DraftSpecError(problems, source=source)
        spec = cls(
            path=None if path is None else os.fspath(path), warnings=tuple(warnings), **values
        )
        if target_config is not None:
            validate_against_target(spec, target_config)
        return spec

    # ---- derived facts ---------------------------------------------------------------------

    @property
    def is_nvfp4(self) -> bool:
        return self.quant_algo is not None and self.quant_algo.upper() in NVFP4_QUANT_ALGOS

    @property
    def max_num_speculative_tokens(self) -> int | None:
        """The largest gamma the trained block allows: DSpark ``block_size``; DFlash
        ``block_size - 1`` (its block includes the anchor row ``b``); None when unknown."""
        if self.block_size is None:
            return None
        return self.block_size if self.method == "dspark" else self.block_size - 1

    def num_query_rows(self, gamma: int) -> int:
        """Rows of the draft's query block for ``gamma`` drafted tokens: ``gamma + 1``
        (``[b, MASK x gamma]``, row 0 dropped) unless the draft samples from the anchor."""
        gamma = _check_gamma(gamma)
        return gamma if self.sample_from_anchor else gamma + 1

    def resolve_num_speculative_tokens(self, requested: int | None) -> int:
        """``requested`` validated against the trained block, or the default (DSpark:
        ``block_size``; DFlash: ``block_size - 1``; Nemotron 3.5 DFlash without block_size: 5)."""
        limit = self.max_num_speculative_tokens
        if requested is None:
            if self.default_num_speculative_tokens is None:
                raise DraftSpecError(
                    "num_speculative_tokens: not given and the draft declares no `block_size`; "
                    "pass num_speculative_tokens explicitly"
                )
            return self.default_num_speculative_tokens
        gamma = _check_gamma(requested)
        if limit is not None and gamma > limit:
            block = (
                f"trained block_size {self.block_size}"
                if self.method == "dspark"
                else f"trained block_size {self.block_size} (one row is the anchor)"
            )
            raise DraftSpecError(
                f"num_speculative_tokens={gamma} exceeds the {block}: acceptance collapses at "
                f"every position beyond the trained block size; use at most {limit}"
            )
        return gamma

    def is_quantized(self, module_name: str) -> bool:
        """Whether linear module ``module_name`` (checkpoint name, e.g. ``layers.0.mlp.up_proj``;
        a leading ``model.`` is accepted) is stored quantized: the config quantizes the draft and
        no exclusion pattern matches it. Exclusions match like vLLM's ModelOpt config: exact name,
        substring, or fnmatch wildcard. Fused names (``qkv_proj``, ``gate_up_proj``) answer for
        their shards, which must agree."""
        if self.quant_algo is None:
            return False
        head, _, leaf = module_name.rpartition(".")
        if leaf in layout.FUSED_MODULES:
            prefix = f"{head}." if head else ""
            answers = {s: not self._excluded(prefix + s) for s in layout.FUSED_MODULES[leaf]}
            if len(set(answers.values())) > 1:
                shown = ", ".join(
                    f"{prefix}{s}: {'quantized' if q else 'excluded'}" for s, q in answers.items()
                )
                raise DraftSpecError(
                    f"{module_name}: its shards are quantized differently ({shown}); a fused "
                    "linear needs one format"
                )
            return next(iter(answers.values()))
        return not self._excluded(module_name)

    def _excluded(self, module_name: str) -> bool:
        return self.exclusion_pattern(module_name) is not None

    def exclusion_pattern(self, module_name: str) -> str | None:
        """The first ``quant_exclude_modules`` pattern that excludes ``module_name``, or None."""
        bare = module_name[len("model.") :] if module_name.startswith("model.") else module_name
        names = (bare, f"model.{bare}")
        for pattern in self.quant_exclude_modules:
            for name in names:
                if name == pattern or pattern in name or fnmatch.fnmatchcase(name, pattern):
                    return pattern
        return None

    def draft_shape(self) -> layout.DraftShape:
        """The sizes and options that fix this draft's tensor names and shapes."""
        return layout.DraftShape(
            kind=self.method,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_size,
            num_aux_layers=len(self.aux_hidden_state_ids),
            target_hidden_size=self.target_hidden_size,
            draft_vocab_size=self.draft_vocab_size,
            markov_rank=self.markov_rank,
            has_embed_tokens=self.has_embed_tokens,
            has_lm_head=self.has_lm_head,
            attention_bias=self.attention_bias,
            has_attention_sinks=self.has_attention_sinks,
        )

    def linear_modules(self) -> tuple[tuple[str, tuple[int, int]], ...]:
        """Checkpoint names and logical ``[out, in]`` shapes of every linear layer of the draft
        (the modules that may be stored NVFP4; :func:`layout.linear_modules`)."""
        return layout.linear_modules(self.draft_shape())

    def dense_tensors(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """Checkpoint names and shapes of the non-linear tensors (always stored unquantized;
        :func:`layout.dense_tensors`)."""
        return layout.dense_tensors(self.draft_shape())

    def to_dict(self) -> dict:
        """JSON-ready dict of the spec (tuples as lists)."""
        out = {}
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            out[name] = list(value) if isinstance(value, tuple) else value
        return out


def _check_gamma(gamma: Any) -> int:
    if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1:
        raise DraftSpecError(
            f"num_speculative_tokens: expected a positive integer, found {_found(gamma)}"
        )
    return gamma


def validate_against_target(spec: DraftSpec, target_config: dict) -> None:
    """Check the draft against the target's config.json; raises :class:`DraftSpecError` listing
    every problem (see :func:`check_against_target`)."""
    problems, _ = check_against_target(spec, target_config)
    if problems:
        raise DraftSpecError(problems, source="target")


def check_against_target(spec: DraftSpec, target_config: Any) -> tuple[list[str], list[str]]:
    """(problems, warnings) of the draft against the target: its config.json as a dict, or the
    config object vLLM loaded (:func:`target_config_dict` reads every encoding).

    * aux ids: aux id k is the target's residual stream after block k-1 (0 = embedding output),
      so ids must lie in 1..N with N the number of blocks (``len(hybrid_override_pattern)`` or
      ``num_hidden_layers``); id N = after the final block, before the final norm.
    * vocab sizes equal; the fc input width per aux layer equals the target's hidden size, and so
      does the draft's hidden size when it borrows the target's embedding or lm_head.
    """
    problems: list[str] = []
    warnings: list[str] = []
    target_config = target_config_dict(target_config)
    tc = _target_text_config(target_config, problems)
    blocks = _target_blocks(target_config, problems) if tc is not None else None
    if blocks is not None:
        for i, (tid, aux) in enumerate(zip(spec.target_layer_ids, spec.aux_hidden_state_ids)):
            if aux > blocks:
                problems.append(
                    f"aux hidden state id {aux} (target_layer_ids[{i}] = {tid}, + 1) is beyond "
                    f"the target's {blocks} blocks: aux id k is the residual stream after block "
                    f"k-1, so ids run 1..{blocks} ({blocks} = after the last block, before the "
                    "final norm)"
                )
        if spec.num_target_layers is not None and spec.num_target_layers != blocks:
            problems.append(
                f"`num_target_layers` is {spec.num_target_layers} but the target has {blocks} "
                "blocks"
            )
    if tc is not None:
        f = _Fields(tc, problems, "target.")
        vocab = f.get("vocab_size", _pos_int, required=True)
        hidden = f.get("hidden_size", _pos_int, required=True)
        if vocab is not None and vocab != spec.vocab_size:
            problems.append(
                f"`vocab_size`: the draft has {spec.vocab_size} but the target has {vocab} "
                "(drafted ids are verified by the target and logits use its lm_head)"
            )
        if hidden is not None:
            fc_in = spec.target_hidden_size or spec.hidden_size
            if fc_in != hidden:
                name = "target_hidden_size" if spec.target_hidden_size else "hidden_size"
                problems.append(
                    f"`{name}`: the draft's fc expects aux hidden states of width {fc_in} but the "
                    f"target's hidden_size is {hidden}"
                )
            borrowed = [
                n
                for n, own in (
                    ("lm_head", spec.has_lm_head),
                    ("embed_tokens", spec.has_embed_tokens),
                )
                if not own
            ]
            if borrowed and spec.hidden_size != hidden and fc_in == hidden:
                problems.append(
                    f"`hidden_size`: the draft's is {spec.hidden_size} but it uses the target's "
                    f"{' and '.join(borrowed)}, whose width is the target's hidden_size {hidden}"
                )
        archs = tc.get("architectures") or target_config.get("architectures")
        if spec.is_nemotron35 and isinstance(archs, list) and "NemotronHForCausalLM" not in archs:
            warnings.append(
                f"the draft has the Nemotron 3.5 layout but the target's architectures are "
                f"{_show(archs)}, not NemotronHForCausalLM"
            )
    return problems, warnings


# --------------------------------------------------------------------------------------------
# The parse itself.


_SHAPE_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "aux_hidden_state_ids",
)
"""The fields :meth:`DraftSpec.linear_modules` needs to list the draft's linears and their shapes."""


def _parse(cfg: dict, problems: list[str], warnings: list[str]) -> dict:
    """The :class:`DraftSpec` field values of ``cfg``, read section by section; every problem and
    warning found is appended (in the order the sections read the config)."""
    f = _Fields(cfg, problems)
    out: dict[str, Any] = {}
    architecture, method = _parse_architecture(f, problems, warnings)
    nemotron = is_nemotron35_draft_config(cfg)
    out.update(architecture=architecture or "", method=method or "dflash", is_nemotron35=nemotron)
    out["model_type"] = f.get("model_type", _str)
    _parse_sizes(f, out, nemotron, problems)
    _parse_widths_and_activation(f, out, nemotron, problems)

    dcfg = f.get("dflash_config", _dict)  # None when absent or mistyped (reported)
    d = _Fields(dcfg or {}, problems, "dflash_config.")
    _parse_attention(f, d, out, nemotron, out["num_hidden_layers"], problems)
    _parse_rope(f, out, nemotron, problems)
    _parse_mask_token(f, d, out, problems)
    _parse_target_layers(f, d, out, problems)

    if method == "dflash":
        out["sample_from_anchor"] = _parse_dflash_anchor(f, d, problems)
    else:
        out["sample_from_anchor"] = _parse_dspark_anchor(f, d, nemotron, problems, warnings)
    _parse_block_size(f, d, out, method, problems)
    _parse_markov_head(f, out, method, nemotron, problems)
    _parse_embedding_ownership(f, d, out, nemotron, architecture, warnings)
    _parse_quant(cfg, out, problems, warnings)

    if method is not None and all(out.get(k) is not None for k in _SHAPE_FIELDS):
        # A partial spec (some unrelated fields may be None) is enough to list the modules.
        _check_nvfp4_shapes(DraftSpec(path=None, **out), problems)
    out["default_num_speculative_tokens"] = _default_num_speculative_tokens(
        method, out["block_size"], nemotron
    )
    return out


def _parse_architecture(
    f: _Fields, problems: list[str], warnings: list[str]
) -> tuple[str | None, str | None]:
    """The draft's architecture (the first of ``architectures``) and the method it implies:
    DSpark by name or by a declared Markov head, DFlash by name; None where undecidable."""
    archs = f.get("architectures", _str_list, required=True)
    architecture = None
    if archs is not None:
        if not archs:
            problems.append("`architectures`: expected a non-empty list of strings, found []")
        else:
            architecture = archs[0]
    has_markov = f.has("markov_head_type") or f.has("markov_rank")
    method = None
    if architecture is not None:
        if "DSpark" in architecture:
            method = "dspark"
        elif "DFlash" in architecture:
            method = "dflash"
            if has_markov:
                problems.append(
                    f"`architectures`: {architecture!r} is a DFlash draft but the config declares "
                    "a DSpark Markov head (`markov_head_type` / `markov_rank`): ambiguous method"
                )
        elif has_markov:
            method = "dspark"
        else:
            problems.append(
                f"`architectures`: {architecture!r} is neither a DFlash (DFlashDraftModel) nor a "
                "DSpark (*DSparkModel, or a config with markov_head_type / markov_rank) draft"
            )
    if method == "dspark" and architecture not in VLLM_DSPARK_ARCHITECTURES:
        warnings.append(
            f"architecture {architecture!r}: with method 'dspark' vLLM 0.33 rewrites any "
            f"architecture outside {', '.join(VLLM_DSPARK_ARCHITECTURES)} to DeepSeek-V4 DSpark"
        )
    return architecture, method


def _parse_sizes(f: _Fields, out: dict, nemotron: bool, problems: list[str]) -> None:
    """The transformer's shape: hidden size, layers, heads, head_dim (derived from hidden size
    and heads where a generic draft omits it), intermediate size, vocabulary, RMSNorm eps."""
    hidden = f.get("hidden_size", _pos_int, required=True)
    layers = f.get("num_hidden_layers", _pos_int, required=True)
    if layers is not None and layers > MAX_DRAFT_LAYERS:
        problems.append(
            f"`num_hidden_layers`: {layers} is not a draft's layer count (at most "
            f"{MAX_DRAFT_LAYERS}; the Nemotron 3.5 drafts have 6)"
        )
        layers = None
    heads = f.get("num_attention_heads", _pos_int, required=True)
    kv_heads = f.get("num_key_value_heads", _pos_int, required=nemotron, default=heads)
    head_dim = f.get("head_dim", _pos_int, required=nemotron)
    inter = f.get("intermediate_size", _pos_int, required=True)
    vocab = f.get("vocab_size", _pos_int, required=True)
    eps = f.get("rms_norm_eps", _pos_float, default=1e-6)
    if (
        head_dim is None
        and not nemotron
        and not f.has("head_dim")
        and hidden is not None
        and heads is not None
    ):
        if hidden % heads:
            problems.append(
                f"`head_dim`: missing and hidden_size {hidden} is not divisible by "
                f"num_attention_heads {heads}"
            )
        else:
            head_dim = hidden // heads
    if heads is not None and kv_heads is not None and heads % kv_heads:
        problems.append(
            f"`num_key_value_heads`: {kv_heads} does not divide num_attention_heads {heads}"
        )
    out.update(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=inter,
        vocab_size=vocab,
        rms_norm_eps=eps,
    )


def _parse_widths_and_activation(
    f: _Fields, out: dict, nemotron: bool, problems: list[str]
) -> None:
    """The MLP activation, attention bias, the fc input width per aux layer, the draft
    vocabulary (the Nemotron 3.5 drafts use the full target vocabulary) and the position limit."""
    out["hidden_act"] = f.get("hidden_act", _str, default="silu")
    if nemotron and out["hidden_act"] != "silu":
        problems.append(
            "`hidden_act`: the Nemotron 3.5 drafts use a SiLU MLP, found "
            f"{_show(out['hidden_act'])}"
        )
    out["attention_bias"] = f.get("attention_bias", _bool, default=False)
    out["target_hidden_size"] = f.get("target_hidden_size", _pos_int)
    vocab = out["vocab_size"]
    draft_vocab = f.get("draft_vocab_size", _pos_int)
    if draft_vocab is not None and vocab is not None and draft_vocab > vocab:
        problems.append(f"`draft_vocab_size`: {draft_vocab} exceeds vocab_size {vocab}")
    if nemotron and draft_vocab is not None and vocab is not None and draft_vocab != vocab:
        problems.append(
            f"`draft_vocab_size`: {draft_vocab} differs from vocab_size {vocab}; the Nemotron 3.5 "
            "drafts use the full target vocabulary"
        )
    out["draft_vocab_size"] = draft_vocab
    out["max_position_embeddings"] = f.get("max_position_embeddings", _pos_int)


def _parse_mask_token(f: _Fields, d: _Fields, out: dict, problems: list[str]) -> None:
    """The MASK id that fills the query block, from any of the four fields drafts use for it
    (all that are set must agree)."""
    sources = [
        ("dflash_config.mask_token_id", d.get("mask_token_id", _nonneg_int)),
        ("mask_token_id", f.get("mask_token_id", _nonneg_int)),
        ("pard_token", f.get("pard_token", _nonneg_int)),
        ("dspark_noise_token_id", f.get("dspark_noise_token_id", _nonneg_int)),
    ]
    present = [(k, v) for k, v in sources if v is not None]
    mask = present[0][1] if present else None
    if len({v for _, v in present}) > 1:
        problems.append("mask token ids disagree: " + ", ".join(f"`{k}` = {v}" for k, v in present))
    elif mask is None and not _declared(f, d, sources):
        problems.append(
            "`mask_token_id`: missing (expected a non-negative integer in "
            "`dflash_config.mask_token_id` or `mask_token_id`; the MASK id fills the query block)"
        )
    vocab = out["vocab_size"]
    if mask is not None and vocab is not None and mask >= vocab:
        problems.append(f"`mask_token_id`: {mask} is not below vocab_size {vocab}")
    out["mask_token_id"] = mask


def _parse_target_layers(f: _Fields, d: _Fields, out: dict, problems: list[str]) -> None:
    """The target-facing facts: which target blocks feed the draft (``target_layer_ids``, from
    any of three fields), their aux ids (id + 1), and the declared target layer count."""
    id_sources = [
        ("target_layer_ids", f.get("target_layer_ids", _id_list)),
        ("dflash_config.target_layer_ids", d.get("target_layer_ids", _id_list)),
        ("dspark_target_layer_ids", f.get("dspark_target_layer_ids", _id_list)),
    ]
    id_present = [(k, v) for k, v in id_sources if v is not None]
    target_ids = id_present[0][1] if id_present else None
    if len({v for _, v in id_present}) > 1:
        problems.append(
            "target layer ids disagree: " + ", ".join(f"`{k}` = {list(v)}" for k, v in id_present)
        )
        target_ids = None
    elif not id_present and not _declared(f, d, id_sources):
        problems.append(
            "`target_layer_ids`: missing (expected a non-empty list of distinct non-negative "
            "integers at the top level or in `dflash_config`: the target blocks whose outputs "
            "feed the draft)"
        )
    aux_ids = tuple(i + 1 for i in target_ids) if target_ids is not None else None
    declared_aux = f.get("eagle_aux_hidden_state_layer_ids", _id_list)
    if declared_aux is not None and aux_ids is not None and declared_aux != aux_ids:
        problems.append(
            f"`eagle_aux_hidden_state_layer_ids` is {list(declared_aux)} but must be "
            f"target_layer_ids + 1 = {list(aux_ids)} (aux id k = the residual stream after "
            "target block k-1)"
        )
    num_aux = f.get("num_aux_layers", _pos_int)
    if num_aux is not None and target_ids is not None and num_aux != len(target_ids):
        problems.append(
            f"`num_aux_layers` is {num_aux} but target_layer_ids has {len(target_ids)} entries"
        )
    num_target = f.get("num_target_layers", _pos_int)
    if num_target is None:
        num_target = d.get("num_target_layers", _pos_int)
    if num_target is not None and target_ids is not None and max(target_ids) >= num_target:
        problems.append(
            f"`target_layer_ids` {list(target_ids)}: id {max(target_ids)} is not below "
            f"num_target_layers {num_target}"
        )
    out.update(
        target_layer_ids=target_ids, aux_hidden_state_ids=aux_ids, num_target_layers=num_target
    )


def _parse_dflash_anchor(f: _Fields, d: _Fields, problems: list[str]) -> bool:
    """A DFlash draft never samples from the anchor; a ``sample_from_anchor`` it states must say
    false."""
    values = [
        (k, v)
        for k, v in (
            ("sample_from_anchor", f.cfg.get("sample_from_anchor")),
            ("dflash_config.sample_from_anchor", d.cfg.get("sample_from_anchor")),
        )
        if v is not None
    ]
    for k, v in values:
        if v is not False:
            problems.append(
                f"`{k}`: DFlash drafts never sample from the anchor (row 0 of the query block "
                f"is the anchor b; rows 1..B-1 are the drafts), expected false, found "
                f"{_found(v)}"
            )
    return False


def _parse_dspark_anchor(
    f: _Fields, d: _Fields, nemotron: bool, problems: list[str], warnings: list[str]
) -> bool:
    """The DSpark query layout (:func:`get_sample_from_anchor`), checked against the
    ``dspark_bonus_anchor`` spelling of the same flag."""
    cfg = f.cfg
    sample_from_anchor = _sample_from_anchor(cfg, problems)
    if (
        nemotron
        and cfg.get("sample_from_anchor") is None
        and d.cfg.get("sample_from_anchor") is None
    ):
        warnings.append(
            "`sample_from_anchor` is absent: the DSpark default (true, anchor layout) applies; "
            "the published Nemotron 3.5 DSpark checkpoint says false"
        )
    bonus = f.get("dspark_bonus_anchor", _bool)
    if (
        bonus is not None
        and isinstance(cfg.get("sample_from_anchor"), bool)
        and bonus == cfg["sample_from_anchor"]
    ):
        problems.append(
            f"`dspark_bonus_anchor` ({_show(bonus)}) contradicts `sample_from_anchor` "
            f"({_show(cfg['sample_from_anchor'])}): the bonus-anchor layout is "
            "sample_from_anchor=false"
        )
    return sample_from_anchor


def _parse_block_size(
    f: _Fields, d: _Fields, out: dict, method: str | None, problems: list[str]
) -> None:
    """The block the draft was trained for (required for DSpark; DFlash's includes the anchor)."""
    block_sources = [
        ("block_size", f.get("block_size", _pos_int)),
        ("dflash_config.block_size", d.get("block_size", _pos_int)),
        ("dspark_block_size", f.get("dspark_block_size", _pos_int)),
    ]
    block_present = [(k, v) for k, v in block_sources if v is not None]
    block = block_present[0][1] if block_present else None
    if len({v for _, v in block_present}) > 1:
        problems.append(
            "block sizes disagree: " + ", ".join(f"`{k}` = {v}" for k, v in block_present)
        )
    if method == "dspark" and not _declared(f, d, block_sources):
        problems.append(
            "`block_size`: missing (expected a positive integer: DSpark drafts are trained for a "
            "block size, and num_speculative_tokens must not exceed it)"
        )
    if method == "dflash" and block == 1:
        problems.append("`block_size`: 1 leaves no draft rows (a DFlash block includes the anchor)")
    out["block_size"] = block


def _parse_markov_head(
    f: _Fields, out: dict, method: str | None, nemotron: bool, problems: list[str]
) -> None:
    """The DSpark Markov head: its rank (required for DSpark) and type ("vanilla" for the
    Nemotron 3.5 DSpark draft)."""
    markov_type = f.get("markov_head_type", _str)
    markov_rank = f.get("markov_rank", _pos_int)
    if method == "dspark":
        if markov_rank is None and not f.has("markov_rank"):
            problems.append(
                "`markov_rank`: missing (expected a positive integer for the DSpark Markov head)"
            )
        if nemotron:
            if markov_type is None and not f.has("markov_head_type"):
                problems.append(
                    '`markov_head_type`: missing (the Nemotron 3.5 DSpark draft needs "vanilla")'
                )
            elif markov_type is not None and markov_type != "vanilla":
                problems.append(
                    f'`markov_head_type`: the Nemotron 3.5 DSpark draft needs "vanilla", found '
                    f"{_show(markov_type)}"
                )
    out.update(markov_head_type=markov_type, markov_rank=markov_rank)


def _parse_embedding_ownership(
    f: _Fields,
    d: _Fields,
    out: dict,
    nemotron: bool,
    architecture: str | None,
    warnings: list[str],
) -> None:
    """Whether the draft ships its own embedding and lm_head; a config that looks like the
    Nemotron 3.5 layout but lacks part of it is named in a warning (it takes the generic path)."""
    out["has_embed_tokens"] = f.get("has_embed_tokens", _bool, default=False)
    out["has_lm_head"] = f.get("has_lm_head", _bool, default=False)
    if (
        not nemotron
        and out["has_embed_tokens"]
        and out["has_lm_head"] is False
        and architecture in NEMOTRON35_ARCHITECTURES
    ):
        missing = [
            k
            for k in ("eagle_aux_hidden_state_layer_ids", "dflash_config")
            if not (f.has(k) if k != "dflash_config" else isinstance(f.cfg.get(k), dict))
        ]
        if missing:
            warnings.append(
                "has_embed_tokens=true / has_lm_head=false look like the Nemotron 3.5 layout but "
                f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing: treated "
                "as a generic draft"
            )


def _default_num_speculative_tokens(
    method: str | None, block: int | None, nemotron: bool
) -> int | None:
    """The gamma a draft runs with when none is asked for: the whole trained block (less the
    anchor row for DFlash), else the published Nemotron 3.5 DFlash recipe's 5."""
    if method == "dflash" and block is not None:
        return block - 1
    if method == "dspark":
        return block
    return NEMOTRON35_DFLASH_NUM_SPECULATIVE_TOKENS if nemotron else None


def _check_nvfp4_shapes(spec: DraftSpec, problems: list[str]) -> None:
    """Every NVFP4 linear needs in_features divisible by the group size."""
    if not spec.is_nvfp4:
        return
    group = spec.quant_group_size or NVFP4_GROUP_SIZE
    for name, (_, in_features) in spec.linear_modules():
        if spec.is_quantized(name) and in_features % group:
            why = {
                "markov_head.markov_w2": f"markov_rank {spec.markov_rank}",
                "fc": f"num_aux_layers x hidden = {in_features}",
            }.get(name, f"in_features {in_features}")
            problems.append(
                f"{name}: NVFP4 (not excluded by quantization_config) needs in_features to be a "
                f"multiple of the group size {group}, but {why} is not"
            )


def _declared(f: _Fields, d: _Fields, sources) -> bool:
    """Whether any of the (name, value) sources is set (non-null) in the config, valid or not."""
    return any(
        d.has(k.removeprefix("dflash_config.")) if k.startswith("dflash_config.") else f.has(k)
        for k, _ in sources
    )


def _parse_attention(
    f: _Fields, d: _Fields, out: dict, nemotron: bool, layers: int | None, problems: list[str]
) -> None:
    """The attention layout: each layer's attention type, causality, the sliding window and
    attention sinks (``dflash_config`` and top-level spellings must agree)."""
    layer_types, per_layer = _parse_layer_types(f, d, nemotron, layers, problems)
    out["layer_types"] = per_layer if layers is not None else None

    # Causality: dflash_config.causal, then top-level is_causal, else all-sliding layers.
    causal_d = d.get("causal", _bool)
    causal_top = f.get("is_causal", _bool)
    if causal_d is not None and causal_top is not None and causal_d != causal_top:
        problems.append(
            f"`dflash_config.causal` ({_show(causal_d)}) disagrees with the top-level "
            f"`is_causal` ({_show(causal_top)})"
        )
    if causal_d is not None:
        causal = causal_d
    elif causal_top is not None:
        causal = causal_top
    else:
        causal = bool(layer_types) and all(t == SLIDING_ATTENTION for t in layer_types)
    out["causal"] = causal

    # Sliding window.
    window_d = d.get("swa_window_size", _pos_int)
    window_top = f.get("sliding_window", _pos_int)
    sliding = SLIDING_ATTENTION in per_layer
    window = None
    if sliding:
        if window_d is not None and window_top is not None and window_d != window_top:
            problems.append(
                f"`dflash_config.swa_window_size` ({window_d}) disagrees with the top-level "
                f"`sliding_window` ({window_top})"
            )
        window = window_d if window_d is not None else window_top
        if window is None and not d.has("swa_window_size") and not f.has("sliding_window"):
            problems.append(
                "`sliding_window`: missing (sliding_attention layers need a window in "
                "`sliding_window` or `dflash_config.swa_window_size`)"
            )
    out["sliding_window"] = window

    # Attention sinks.
    sinks_d = d.get("attention_sink_bias", _bool)
    sinks_top = f.get("attention_sink_bias", _bool)
    if sinks_d is not None and sinks_top is not None and sinks_d != sinks_top:
        problems.append(
            f"`dflash_config.attention_sink_bias` ({_show(sinks_d)}) disagrees with the top-level "
            f"`attention_sink_bias` ({_show(sinks_top)})"
        )
    out["has_attention_sinks"] = bool(sinks_d if sinks_d is not None else sinks_top)


def _parse_layer_types(
    f: _Fields, d: _Fields, nemotron: bool, layers: int | None, problems: list[str]
) -> tuple[tuple[str, ...] | None, tuple[str, ...]]:
    """The declared ``layer_types`` (None when absent or invalid) and the per-layer types the
    draft runs with (``dflash_config.use_swa`` makes every layer sliding where none is declared
    sliding)."""
    layer_types = f.get("layer_types", _str_list)
    if layer_types is not None:
        bad = sorted({t for t in layer_types if t not in (FULL_ATTENTION, SLIDING_ATTENTION)})
        if bad:
            problems.append(
                f"`layer_types`: unknown attention type(s) {bad} (expected "
                f"{FULL_ATTENTION!r} or {SLIDING_ATTENTION!r})"
            )
            layer_types = None
        elif layers is not None and len(layer_types) != layers:
            problems.append(
                f"`layer_types` has {len(layer_types)} entries but num_hidden_layers is {layers}"
            )
            layer_types = None
    elif nemotron and not f.has("layer_types"):
        problems.append("`layer_types`: missing (expected one attention type per draft layer)")

    use_swa = d.get("use_swa", _bool)
    any_sliding = bool(layer_types) and SLIDING_ATTENTION in layer_types
    if layer_types is None or (use_swa and not any_sliding):
        per_layer = (SLIDING_ATTENTION if use_swa else FULL_ATTENTION,) * (layers or 0)
    else:
        per_layer = tuple(layer_types)
    if nemotron and layer_types is not None:
        kinds = set(layer_types)
        if len(kinds) > 1:
            problems.append(
                f"`layer_types`: the Nemotron 3.5 drafts use one attention type for all layers, "
                f"found {sorted(kinds)}"
            )
        if use_swa is not None and use_swa != any_sliding:
            problems.append(
                f"`dflash_config.use_swa` is {_show(use_swa)} but `layer_types` are {sorted(kinds)}"
            )
    return layer_types, per_layer


def _parse_rope(f: _Fields, out: dict, nemotron: bool, problems: list[str]) -> None:
    params = f.get("rope_parameters", _dict)
    theta_top = f.get("rope_theta", _pos_float)
    theta_params = None
    if params is not None:
        theta_params = _Fields(params, problems, "rope_parameters.").get("rope_theta", _pos_float)
    if theta_top is not None and theta_params is not None and theta_top != theta_params:
        problems.append(
            f"`rope_theta` ({theta_top:g}) disagrees with `rope_parameters.rope_theta` "
            f"({theta_params:g})"
        )
    theta = theta_top if theta_top is not None else theta_params
    if theta is None:
        if nemotron and not f.has("rope_theta"):
            problems.append(
                "`rope_theta`: missing (expected a positive number; the Nemotron 3.5 "
                "drafts use 10000)"
            )
        theta = 1e6  # vLLM's DFlash default when a checkpoint states none
    out["rope_theta"] = theta

    scaling = f.get("rope_scaling", _dict)
    if scaling is None and params is not None:
        kind = params.get("rope_type", params.get("type", "default"))
        if kind != "default":
            scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling is not None:
        s = _Fields(scaling, problems, "rope_scaling.")
        kind = s.get("rope_type", _str) or s.get("type", _str)
        if kind is None and not s.has("rope_type") and not s.has("type"):
            problems.append('`rope_scaling.rope_type`: missing (expected a string such as "yarn")')
        s.get("factor", _pos_float, required=kind in ("yarn", "linear", "dynamic", "llama3"))
        if kind == "yarn":
            s.get("original_max_position_embeddings", _pos_int, required=True)
        if kind == "default":
            scaling = None
    out["rope_scaling"] = scaling


def _parse_quant(cfg: dict, out: dict, problems: list[str], warnings: list[str]) -> None:
    out.update(quant_algo=None, quant_group_size=None, quant_exclude_modules=(), quant_method=None)
    raw = cfg.get("quantization_config")
    if raw is None:
        return
    if not isinstance(raw, dict):
        problems.append(f"`quantization_config`: expected an object, found {_found(raw)}")
        return
    where = "quantization_config."
    qc = raw
    if isinstance(raw.get("quantization"), dict):  # legacy hf_quant_config.json form
        qc, where = raw["quantization"], "quantization_config.quantization."
    top = _Fields(raw, problems, "quantization_config.")
    q = _Fields(qc, problems, where)
    method = top.get("quant_method", _str)
    producer = raw.get("producer")
    if method is None and isinstance(producer, dict) and producer.get("name") == "modelopt":
        method = "modelopt"
    out["quant_method"] = method
    algo = q.get("quant_algo", _str, required=method in (None, "modelopt"))
    if method not in (None, "modelopt"):
        warnings.append(
            f"quantization_config.quant_method {method!r} is not ModelOpt: its tensor layout is "
            "not checked"
        )
    out["quant_algo"] = algo
    group = q.get("group_size", _pos_int)
    if group is None:
        groups = raw.get("config_groups")
        if isinstance(groups, dict):
            for name, g in groups.items():
                weights = g.get("weights") if isinstance(g, dict) else None
                if isinstance(weights, dict) and weights.get("group_size") is not None:
                    group = _Fields(
                        weights, problems, f"quantization_config.config_groups.{name}.weights."
                    ).get("group_size", _pos_int)
                    break
    if algo is not None and algo.upper() in NVFP4_QUANT_ALGOS:
        if group is not None and group != NVFP4_GROUP_SIZE:
            problems.append(
                f"`{where}group_size`: NVFP4 stores one scale per {NVFP4_GROUP_SIZE} inputs, "
                f"found {group}"
            )
        group = NVFP4_GROUP_SIZE if group is None else group
    out["quant_group_size"] = group
    ignore = q.get("ignore", _str_list)
    exclude = q.get("exclude_modules", _str_list)
    if ignore is not None and exclude is not None and set(ignore) != set(exclude):
        problems.append(f"`{where}ignore` and `{where}exclude_modules` list different modules")
    patterns = tuple(exclude if exclude is not None else ignore or ())
    if "" in patterns:
        problems.append(
            f"`{where}{'exclude_modules' if exclude is not None else 'ignore'}`: "
            "an empty pattern would exclude every module"
        )
    out["quant_exclude_modules"] = patterns
