"""The DFlash / DSpark draft layout, defined once: the official Nemotron 3.5 W4A16 NVFP4 drafts'.

Tensor names (no ``model.`` prefix) and logical shapes of a draft from its sizes
(:class:`DraftShape`: :func:`linear_modules`, :func:`dense_tensors`), which linears the official
drafts store as NVFP4, their packed and scale shapes, the group size, and the ModelOpt
quantization config as NVIDIA's checkpoints carry them. The config parse
(``checkpoint.spec``), the tensor checks (``checkpoint.check``), ``quantize`` and the tiny test
family all read it from here. Pure Python: no torch.

NVFP4 module ``X``: ``X.weight`` uint8 ``[out, in/2]`` (two E2M1 codes a byte, element ``2j`` in
the low nibble), ``X.weight_scale`` float8_e4m3fn ``[out, in/16]``, ``X.weight_scale_2`` float32
scalar (global). Everything else is BF16 at its logical shape.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

DFLASH = "dflash"
DSPARK = "dspark"
KINDS = (DFLASH, DSPARK)

GROUP_SIZE = 16
"""Inputs that share one float8 block scale."""

ARCHITECTURES = {DFLASH: "DFlashDraftModel", DSPARK: "Qwen3DSparkModel"}
QUANT_ALGO = "W4A16_NVFP4"
MODELOPT_VERSION = "0.47.0"

CONFIG_FILE = "config.json"
HF_QUANT_CONFIG_FILE = "hf_quant_config.json"
WEIGHTS_FILE = "model.safetensors"

FUSED_MODULES = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
"""The linears vLLM fuses in the drafts' Qwen3 layers, and the checkpoint modules each loads."""

# Suffixes of the three tensors of one NVFP4 module (plus the optional, ignored input_scale).
NVFP4_SUFFIXES = ("weight", "weight_scale", "weight_scale_2")
IGNORED_SUFFIXES = ("input_scale",)


def _check_logical(shape) -> tuple[int, int]:
    if len(shape) != 2:
        raise ValueError(f"NVFP4 weight must be 2-D [out, in], got shape {tuple(shape)}")
    out_features, in_features = int(shape[0]), int(shape[1])
    if in_features % GROUP_SIZE:
        raise ValueError(
            f"NVFP4 needs in_features divisible by {GROUP_SIZE}, got shape {tuple(shape)}"
        )
    return out_features, in_features


def packed_shape(logical: tuple[int, int]) -> tuple[int, int]:
    """Shape of the uint8 ``weight`` tensor that stores a logical ``[out, in]`` weight."""
    out_features, in_features = _check_logical(logical)
    return (out_features, in_features // 2)


def scale_shape(logical: tuple[int, int]) -> tuple[int, int]:
    """Shape of the float8 ``weight_scale`` tensor for a logical ``[out, in]`` weight."""
    out_features, in_features = _check_logical(logical)
    return (out_features, in_features // GROUP_SIZE)


def logical_shape(packed: tuple[int, ...]) -> tuple[int, int]:
    """Logical ``[out, in]`` of a packed uint8 ``[out, in // 2]`` weight."""
    if len(packed) != 2:
        raise ValueError(f"packed NVFP4 weight must be 2-D [out, in/2], got shape {tuple(packed)}")
    return (int(packed[0]), int(packed[1]) * 2)


def exclude_modules(kind: str) -> list[str]:
    """ModelOpt exclusions (wildcards over module names): every module NOT stored as NVFP4."""
    _check_kind(kind)
    modules = [
        "lm_head",
        "embed_tokens",
        "hidden_norm",
        "norm",
        "layers.*.input_layernorm",
        "layers.*.post_attention_layernorm",
        "layers.*.self_attn*",  # q/k/v/o_proj, q_norm, k_norm (and DSpark's attention_sink_bias)
    ]
    if kind == DSPARK:
        modules.append("markov_head.markov_w1")
    return modules


def quantization_config(kind: str) -> dict:
    """``config.json``'s ``quantization_config`` as ModelOpt exports it for W4A16 NVFP4."""
    return {
        "config_groups": {
            "group_0": {
                "weights": {
                    "dynamic": False,
                    "num_bits": 4,
                    "type": "float",
                    "group_size": GROUP_SIZE,
                },
                "targets": ["Linear"],
            }
        },
        "group_size": GROUP_SIZE,
        "ignore": exclude_modules(kind),
        "producer": {"name": "modelopt", "version": MODELOPT_VERSION},
        "quant_algo": QUANT_ALGO,
        "quant_method": "modelopt",
    }


def hf_quant_config(kind: str) -> dict:
    """``hf_quant_config.json`` (ModelOpt's legacy file, read by vLLM's modelopt loader)."""
    return {
        "producer": {"name": "modelopt", "version": MODELOPT_VERSION},
        "quantization": {
            "quant_algo": QUANT_ALGO,
            "kv_cache_quant_algo": None,
            "group_size": GROUP_SIZE,
            "exclude_modules": exclude_modules(kind),
        },
    }


@dataclass(frozen=True)
class DraftShape:
    """The sizes and options that fix a DFlash / DSpark draft's tensor names and shapes.

    :func:`official_shape` gives the official layout's (own embedding, the target's lm_head,
    attention sinks and a Markov head for DSpark); ``DraftSpec.draft_shape()`` any parsed
    draft's."""

    kind: str  # DFLASH or DSPARK
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_aux_layers: int
    target_hidden_size: int | None = None  # fc input per aux layer; None: hidden_size
    draft_vocab_size: int | None = None  # markov_w2 / lm_head rows; None: vocab_size
    markov_rank: int | None = None  # DSpark's Markov head (none without a rank)
    has_embed_tokens: bool = True
    has_lm_head: bool = False
    attention_bias: bool = False
    has_attention_sinks: bool = False


def official_shape(config: dict) -> DraftShape:
    """The official layout's :class:`DraftShape` for a draft ``config.json`` dict."""
    kind = draft_kind(config)
    return DraftShape(
        kind=kind,
        hidden_size=config["hidden_size"],
        num_hidden_layers=config["num_hidden_layers"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"],
        intermediate_size=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        num_aux_layers=config["num_aux_layers"],
        markov_rank=config["markov_rank"] if kind == DSPARK else None,
        has_attention_sinks=kind == DSPARK,
    )


def linear_modules(shape: DraftShape) -> tuple[tuple[str, tuple[int, int]], ...]:
    """Module names and logical ``[out, in]`` shapes of every linear layer (the modules that may
    be stored NVFP4), in checkpoint order: fc, each layer's attention and MLP projections, the
    Markov head's ``markov_w2``, an own lm_head."""
    h, hd = shape.hidden_size, shape.head_dim
    q, kv = shape.num_attention_heads * hd, shape.num_key_value_heads * hd
    inter = shape.intermediate_size
    rows = shape.draft_vocab_size or shape.vocab_size
    mods = [("fc", (h, shape.num_aux_layers * (shape.target_hidden_size or h)))]
    for i in range(shape.num_hidden_layers):
        p = f"layers.{i}."
        mods += [
            (p + "self_attn.q_proj", (q, h)),
            (p + "self_attn.k_proj", (kv, h)),
            (p + "self_attn.v_proj", (kv, h)),
            (p + "self_attn.o_proj", (h, q)),
            (p + "mlp.gate_proj", (inter, h)),
            (p + "mlp.up_proj", (inter, h)),
            (p + "mlp.down_proj", (h, inter)),
        ]
    if shape.kind == DSPARK and shape.markov_rank is not None:
        mods.append(("markov_head.markov_w2", (rows, shape.markov_rank)))
    if shape.has_lm_head:
        mods.append(("lm_head", (rows, h)))
    return tuple(mods)


def dense_tensors(shape: DraftShape) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Names and shapes of the tensors that are never quantized (embedding, norms, biases,
    sinks, ``markov_w1``), in checkpoint order."""
    h, hd = shape.hidden_size, shape.head_dim
    heads, kv_heads = shape.num_attention_heads, shape.num_key_value_heads
    out: list[tuple[str, tuple[int, ...]]] = []
    if shape.has_embed_tokens:
        out.append(("embed_tokens.weight", (shape.vocab_size, h)))
    out += [("hidden_norm.weight", (h,)), ("norm.weight", (h,))]
    for i in range(shape.num_hidden_layers):
        p = f"layers.{i}."
        out += [
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "self_attn.q_norm.weight", (hd,)),
            (p + "self_attn.k_norm.weight", (hd,)),
        ]
        if shape.attention_bias:
            out += [
                (p + "self_attn.q_proj.bias", (heads * hd,)),
                (p + "self_attn.k_proj.bias", (kv_heads * hd,)),
                (p + "self_attn.v_proj.bias", (kv_heads * hd,)),
            ]
        if shape.has_attention_sinks:
            out.append((p + "self_attn.attention_sink_bias", (heads,)))
    if shape.kind == DSPARK and shape.markov_rank is not None:
        out.append(("markov_head.markov_w1.weight", (shape.vocab_size, shape.markov_rank)))
    return tuple(out)


def draft_kind(config: dict) -> str:
    arch = (config.get("architectures") or [None])[0]
    for kind, name in ARCHITECTURES.items():
        if arch == name:
            return kind
    raise ValueError(
        f"config architectures {config.get('architectures')} is neither of {ARCHITECTURES}"
    )


def logical_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Dense (logical) shape of every tensor of an official draft, by checkpoint name (no
    ``model.`` prefix), sorted by name."""
    shape = official_shape(config)
    shapes = {f"{name}.weight": s for name, s in linear_modules(shape)}
    shapes.update(dense_tensors(shape))
    return dict(sorted(shapes.items()))


_NVFP4_MODULE = re.compile(r"^(fc|layers\.\d+\.mlp\.(gate|up|down)_proj|markov_head\.markov_w2)$")


def is_nvfp4_module(module: str) -> bool:
    """Whether module ``module`` (e.g. ``layers.0.mlp.up_proj``) is stored as NVFP4."""
    return bool(_NVFP4_MODULE.match(module))


def nvfp4_modules(config: dict) -> list[str]:
    """Modules stored as NVFP4: fc, the MLP linears and (DSpark) markov_w2."""
    return [
        n[: -len(".weight")]
        for n in logical_shapes(config)
        if is_nvfp4_module(n[: -len(".weight")])
    ]


def checkpoint_layout(config: dict) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every stored tensor: name -> (dtype name, shape), as in the official checkpoints."""
    layout: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, shape in logical_shapes(config).items():
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if module is not None and is_nvfp4_module(module):
            layout[f"{module}.weight"] = ("uint8", packed_shape(shape))
            layout[f"{module}.weight_scale"] = ("float8_e4m3fn", scale_shape(shape))
            layout[f"{module}.weight_scale_2"] = ("float32", ())
        else:
            layout[name] = ("bfloat16", shape)
    return dict(sorted(layout.items()))


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"draft kind must be one of {KINDS}, got {kind!r}")


def modelopt_quant_algo(hf_quant_cfg: dict[str, Any] | None) -> str | None:
    """Upper-cased ``quant_algo`` of a ModelOpt quantization config, None for anything else.

    Accepts the flat config.json form ``{"quant_method": "modelopt", "quant_algo": ...}`` and the
    nested hf_quant_config.json form ``{"producer": {"name": "modelopt"}, "quantization":
    {"quant_algo": ...}}`` (with or without a ``quant_method``).
    """
    if not isinstance(hf_quant_cfg, dict):
        return None
    method = str(hf_quant_cfg.get("quant_method") or "").lower()
    producer = hf_quant_cfg.get("producer")
    producer_name = producer.get("name") if isinstance(producer, dict) else None
    if not (method.startswith("modelopt") or producer_name == "modelopt"):
        return None
    nested = hf_quant_cfg.get("quantization")
    source = nested if isinstance(nested, dict) else hf_quant_cfg
    algo = source.get("quant_algo")
    return str(algo).upper() if algo else None
