"""The official Nemotron 3.5 DFlash / DSpark W4A16 NVFP4 draft layout, defined once.

Tensor names (no ``model.`` prefix), which linears are NVFP4, their packed and scale shapes, the
group size, and the ModelOpt quantization config as NVIDIA's checkpoints carry them. Validation
(``checkpoint.spec``, ``checkpoint.headers``), ``quantize`` and the tiny test family all read it
from here. Pure Python: no torch.

NVFP4 module ``X``: ``X.weight`` uint8 ``[out, in/2]`` (two E2M1 codes a byte, element ``2j`` in
the low nibble), ``X.weight_scale`` float8_e4m3fn ``[out, in/16]``, ``X.weight_scale_2`` float32
scalar (global). Everything else is BF16 at its logical shape.
"""

from __future__ import annotations

import re
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


def _dims(config: dict) -> dict:
    return {
        "H": config["hidden_size"],
        "V": config["vocab_size"],
        "L": config["num_hidden_layers"],
        "nh": config["num_attention_heads"],
        "nkv": config["num_key_value_heads"],
        "hd": config["head_dim"],
        "I": config["intermediate_size"],
        "A": config["num_aux_layers"],
    }


def draft_kind(config: dict) -> str:
    arch = (config.get("architectures") or [None])[0]
    for kind, name in ARCHITECTURES.items():
        if arch == name:
            return kind
    raise ValueError(
        f"config architectures {config.get('architectures')} is neither of {ARCHITECTURES}"
    )


def logical_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Dense (logical) shape of every tensor of the draft, by checkpoint name (no ``model.`` prefix)."""
    kind = draft_kind(config)
    d = _dims(config)
    H, V, nh, nkv, hd, inter = d["H"], d["V"], d["nh"], d["nkv"], d["hd"], d["I"]
    shapes: dict[str, tuple[int, ...]] = {
        "embed_tokens.weight": (V, H),
        "fc.weight": (H, d["A"] * H),
        "hidden_norm.weight": (H,),
        "norm.weight": (H,),
    }
    for i in range(d["L"]):
        p = f"layers.{i}"
        shapes.update(
            {
                f"{p}.input_layernorm.weight": (H,),
                f"{p}.post_attention_layernorm.weight": (H,),
                f"{p}.self_attn.q_proj.weight": (nh * hd, H),
                f"{p}.self_attn.k_proj.weight": (nkv * hd, H),
                f"{p}.self_attn.v_proj.weight": (nkv * hd, H),
                f"{p}.self_attn.o_proj.weight": (H, nh * hd),
                f"{p}.self_attn.q_norm.weight": (hd,),
                f"{p}.self_attn.k_norm.weight": (hd,),
                f"{p}.mlp.gate_proj.weight": (inter, H),
                f"{p}.mlp.up_proj.weight": (inter, H),
                f"{p}.mlp.down_proj.weight": (H, inter),
            }
        )
        if kind == DSPARK:
            shapes[f"{p}.self_attn.attention_sink_bias"] = (nh,)
    if kind == DSPARK:
        R = config["markov_rank"]
        shapes["markov_head.markov_w1.weight"] = (V, R)
        shapes["markov_head.markov_w2.weight"] = (V, R)
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
