"""Draft and target configs in the official Nemotron 3.5 schema, built in code, and checkpoint
writers for header-level tests.

The official configs follow /work/shared/docs/nemotron35-spec-decode.md field by field. Fields the
doc does not state are marked ``# not in the doc``: plausible Qwen3 / ModelOpt values that the
parser must accept, not facts. The exclusion list is inferred from which tensors the doc says are
packed (fc, the MLP linears, markov_w2).

The tensor layout here is written out independently of ``DraftSpec.linear_modules`` so that tests
compare the parser against a second description of the checkpoint, not against itself.
"""

from __future__ import annotations

import copy
import json
import math
import os

NEMOTRON35_TARGET_LAYER_IDS = [1, 5, 19, 29, 41, 51]
NEMOTRON35_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
"""52 blocks: 23 Mamba-2 M, 23 MoE E, 6 attention * (the doc's counts; the order is not in the
doc)."""

FULL = dict(
    hidden=2688,
    layers=6,
    heads=32,
    kv_heads=2,
    head_dim=128,
    inter=6144,
    vocab=131072,
    target_ids=NEMOTRON35_TARGET_LAYER_IDS,
    mask=990,
    window=1024,
    block=8,
    rank=512,
)
SMALL = dict(
    hidden=64,
    layers=2,
    heads=4,
    kv_heads=2,
    head_dim=16,
    inter=96,
    vocab=512,
    target_ids=[0, 3],
    mask=500,
    window=16,
    block=4,
    rank=32,
)
"""Scaled down: hidden 64, 2 layers; a 4-block target (aux ids [1, 4]: 4 = after the last block)."""
SMALL_PATTERN = "M*ME"


def _exclusions(dspark: bool) -> list[str]:
    out = [
        "embed_tokens",
        "hidden_norm",
        "norm",
        "layers.*.input_layernorm",
        "layers.*.post_attention_layernorm",
        "layers.*.self_attn.q_proj",
        "layers.*.self_attn.k_proj",
        "layers.*.self_attn.v_proj",
        "layers.*.self_attn.o_proj",
        "layers.*.self_attn.q_norm",
        "layers.*.self_attn.k_norm",
    ]
    if dspark:
        out += ["layers.*.self_attn.attention_sink_bias", "markov_head.markov_w1"]
    return out


def _common(s: dict, dspark: bool) -> dict:
    ids = list(s["target_ids"])
    return {
        "model_type": "qwen3",
        "hidden_size": s["hidden"],
        "num_hidden_layers": s["layers"],
        "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"],
        "head_dim": s["head_dim"],
        "intermediate_size": s["inter"],
        "hidden_act": "silu",
        "vocab_size": s["vocab"],
        "rms_norm_eps": 1e-6,  # not in the doc
        "attention_bias": False,  # not in the doc
        "tie_word_embeddings": False,  # not in the doc
        "torch_dtype": "bfloat16",  # not in the doc
        "has_embed_tokens": True,
        "has_lm_head": False,
        "target_layer_ids": ids,
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in ids],
        "num_aux_layers": len(ids),
        "mask_token_id": s["mask"],
        "pard_token": s["mask"],
        "sample_from_anchor": False,
        "quantization_config": {
            "quant_method": "modelopt",
            "quant_algo": "W4A16_NVFP4",
            "group_size": 16,
            "ignore": _exclusions(dspark),  # key name and list not in the doc (inferred)
            "producer": {"name": "modelopt", "version": "0.47.0"},  # not in the doc
        },
    }


def dflash_config(s: dict = FULL) -> dict:
    """The official ``...-NVFP4-DFlash`` config.json (``s=SMALL``: the same schema, scaled down)."""
    cfg = _common(s, dspark=False)
    cfg.update(
        {
            "architectures": ["DFlashDraftModel"],
            "layer_types": ["full_attention"] * s["layers"],
            "rope_theta": 10000.0,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 128.0,
                "original_max_position_embeddings": 8192,
            },
            "max_position_embeddings": 8192 * 128,  # not in the doc
            "sliding_window": None,  # not in the doc
            "use_sliding_window": False,  # not in the doc
            "dflash_config": {
                "causal": False,
                "mask_token_id": s["mask"],
                "target_layer_ids": list(s["target_ids"]),
                "use_swa": False,
                "sample_from_anchor": False,
                "attention_sink_bias": False,
            },
        }
    )
    return cfg


def dspark_config(s: dict = FULL) -> dict:
    """The official ``...-NVFP4-DSpark`` config.json (``s=SMALL``: scaled down)."""
    cfg = _common(s, dspark=True)
    cfg.update(
        {
            "architectures": ["Qwen3DSparkModel"],
            "layer_types": ["sliding_attention"] * s["layers"],
            "sliding_window": s["window"],
            "use_sliding_window": True,  # not in the doc
            "rope_theta": 10000.0,
            "rope_scaling": None,
            "max_position_embeddings": 262144,  # not in the doc
            "block_size": s["block"],
            "dspark_bonus_anchor": True,
            "markov_head_type": "vanilla",
            "markov_rank": s["rank"],
            "dflash_config": {
                "causal": True,
                "use_swa": True,
                "swa_window_size": s["window"],
                "attention_sink_bias": True,
                "mask_token_id": s["mask"],  # "..." in the doc
                "target_layer_ids": list(s["target_ids"]),  # "..." in the doc
                "sample_from_anchor": False,
            },
        }
    )
    return cfg


def zlab_qwen3_dflash_config() -> dict:
    """A generic (non-Nemotron) DFlash draft in the z-lab Qwen3 style: no has_embed_tokens, no
    eagle aux ids, a trained block size (values from memory of z-lab/Qwen3-8B-DFlash-b16)."""
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": 16,
        "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
        "hidden_size": 4096,
        "num_hidden_layers": 5,
        "num_target_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 12288,
        "hidden_act": "silu",
        "vocab_size": 151936,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000,
        "rope_scaling": None,
        "max_position_embeddings": 40960,
        "sliding_window": None,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def generic_dspark_config() -> dict:
    """A generic Qwen3 DSpark draft: anchor layout by default (no sample_from_anchor key)."""
    return {
        "architectures": ["Qwen3DSparkModel"],
        "model_type": "qwen3",
        "block_size": 7,
        "markov_head_type": "vanilla",
        "markov_rank": 256,
        "target_layer_ids": [1, 9, 17, 25, 33],
        "mask_token_id": 151669,
        "hidden_size": 4096,
        "num_hidden_layers": 2,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 12288,
        "vocab_size": 151936,
        "rope_theta": 1000000,
    }


def target_config(s: dict = FULL) -> dict:
    """The target's config.json (NemotronH): the fields the draft is checked against."""
    pattern = NEMOTRON35_PATTERN if s is FULL else SMALL_PATTERN
    return {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "hybrid_override_pattern": pattern,
        "num_hidden_layers": len(pattern),
        "hidden_size": s["hidden"],
        "vocab_size": s["vocab"],
        "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"],
        "head_dim": s["head_dim"],
    }


def mutated(cfg: dict, **changes) -> dict:
    """A deep copy with top-level changes; a value of ``DELETE`` removes the key; keys of the form
    ``dflash_config__x`` / ``quantization_config__x`` reach one level down."""
    out = copy.deepcopy(cfg)
    for key, value in changes.items():
        target, name = out, key
        if "__" in key:
            outer, name = key.split("__", 1)
            target = out[outer]
        if value is DELETE:
            target.pop(name, None)
        else:
            target[name] = value
    return out


class _Delete:
    """The marker for a key to remove; its repr is stable, so test ids built from it are the same
    in every process (parallel test workers compare their collections)."""

    def __repr__(self) -> str:
        return "DELETE"


DELETE = _Delete()


# --------------------------------------------------------------------------------------------
# Tensor layout (independent of DraftSpec) and writers.


def module_layout(cfg: dict, quantized: bool = True) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, "nvfp4" | "dense", logical shape) for every module/tensor of a Nemotron-schema draft.
    Linear modules are named without ``.weight``; other tensors with their full name."""
    h, L = cfg["hidden_size"], cfg["num_hidden_layers"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    inter, vocab = cfg["intermediate_size"], cfg["vocab_size"]
    naux = len(cfg["target_layer_ids"])
    dspark = "markov_rank" in cfg
    sinks = cfg.get("dflash_config", {}).get("attention_sink_bias", False)
    q = "nvfp4" if quantized else "dense"
    out = [
        ("embed_tokens.weight", "dense", (vocab, h)),
        ("fc", q, (h, naux * h)),
        ("hidden_norm.weight", "dense", (h,)),
        ("norm.weight", "dense", (h,)),
    ]
    for i in range(L):
        p = f"layers.{i}."
        out += [
            (p + "input_layernorm.weight", "dense", (h,)),
            (p + "post_attention_layernorm.weight", "dense", (h,)),
            (p + "self_attn.q_proj", "dense", (nh * hd, h)),
            (p + "self_attn.k_proj", "dense", (nkv * hd, h)),
            (p + "self_attn.v_proj", "dense", (nkv * hd, h)),
            (p + "self_attn.o_proj", "dense", (h, nh * hd)),
            (p + "self_attn.q_norm.weight", "dense", (hd,)),
            (p + "self_attn.k_norm.weight", "dense", (hd,)),
            (p + "mlp.gate_proj", q, (inter, h)),
            (p + "mlp.up_proj", q, (inter, h)),
            (p + "mlp.down_proj", q, (h, inter)),
        ]
        if sinks:
            out.append((p + "self_attn.attention_sink_bias", "dense", (nh,)))
    if dspark:
        out += [
            ("markov_head.markov_w1.weight", "dense", (vocab, cfg["markov_rank"])),
            ("markov_head.markov_w2", q, (vocab, cfg["markov_rank"])),
        ]
    return out


def tensor_headers(layout) -> list[tuple[str, str, tuple[int, ...]]]:
    """(tensor name, safetensors dtype, stored shape) with NVFP4 modules expanded by hand:
    weight U8 [out, in/2], weight_scale F8_E4M3 [out, in/16], weight_scale_2 F32 []."""
    out = []
    for name, kind, shape in layout:
        if kind == "nvfp4":
            o, i = shape
            out += [
                (f"{name}.weight", "U8", (o, i // 2)),
                (f"{name}.weight_scale", "F8_E4M3", (o, i // 16)),
                (f"{name}.weight_scale_2", "F32", ()),
            ]
        elif name.endswith((".weight", "attention_sink_bias")):
            out.append((name, "BF16", shape))
        else:
            out.append((f"{name}.weight", "BF16", shape))
    return out


_BYTES = {"U8": 1, "F8_E4M3": 1, "BF16": 2, "F16": 2, "F32": 4}


def write_header_only(path: str, tensors) -> None:
    """A safetensors file with a real header and a SPARSE data section (no bytes written): lets
    full-size checkpoints (700 MB embedding) be checked from their headers in a test."""
    header, offset = {}, 0
    for name, dtype, shape in tensors:
        size = math.prod(shape) * _BYTES[dtype]
        header[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        f.truncate(8 + len(raw) + offset)


def write_draft(
    directory: str,
    cfg: dict,
    *,
    real: bool = True,
    shards: int = 1,
    quantized: bool | None = None,
    tensors_hook=None,
    seed: int = 0,
) -> str:
    """Write ``config.json`` and weights for ``cfg``.

    ``real``: actual tensors via ``safetensors.torch.save_file`` (NVFP4 ones from
    ``nvfp4.format.quantize``), for scaled-down configs; else header-only sparse files.
    ``tensors_hook(dict) -> dict`` may alter the real tensors (or the header list) before saving.
    ``shards > 1`` writes ``model-0000k-of-0000n.safetensors`` plus the index.
    """
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    if quantized is None:
        quantized = cfg.get("quantization_config") is not None
    layout = module_layout(cfg, quantized=quantized)
    if real:
        entries = list(_real_tensors(layout, seed).items())
    else:
        entries = tensor_headers(layout)
    if tensors_hook is not None:
        entries = list(tensors_hook(dict(entries)).items()) if real else tensors_hook(entries)
    n = max(1, shards)
    files = (
        ["model.safetensors"]
        if n == 1
        else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    )
    chunks = [entries[k::n] for k in range(n)]
    for file, chunk in zip(files, chunks):
        path = os.path.join(directory, file)
        if real:
            from safetensors.torch import save_file

            save_file(dict(chunk), path)
        else:
            write_header_only(path, chunk)
    if n > 1:
        weight_map = {(e[0]): file for file, chunk in zip(files, chunks) for e in chunk}
        with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)
    return directory


def _real_tensors(layout, seed: int) -> dict:
    import torch

    from vllm_nemotron_spec.nvfp4.format import quantize

    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, kind, shape in layout:
        w = torch.randn(shape, generator=gen) * 0.05
        if kind == "nvfp4":
            out.update(quantize(w).tensors(name))
        elif name.endswith((".weight", "attention_sink_bias")):
            out[name] = w.to(torch.bfloat16)
        else:
            out[f"{name}.weight"] = w.to(torch.bfloat16)
    return out


def write_target(directory: str, cfg: dict) -> str:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return directory
