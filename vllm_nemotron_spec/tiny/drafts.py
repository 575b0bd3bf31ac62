"""Tiny DFlash / DSpark drafts in EXACTLY the layout of the official Nemotron 3.5 W4A16 NVFP4 drafts.

``config.json`` carries every field of the official drafts with tiny values, ``hf_quant_config.json``
is written as ModelOpt writes it, and tensors use the official names and formats
(:mod:`vllm_nemotron_spec.checkpoint.layout`). :func:`write_draft` packs any fp32 state dict in
this schema (random or trained) into a checkpoint directory; :func:`read_draft_state_dict` reads
one back as dense fp32 tensors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from vllm_nemotron_spec._torch import torch_threads
from vllm_nemotron_spec.checkpoint.layout import (
    ARCHITECTURES,
    CONFIG_FILE,
    DFLASH,
    GROUP_SIZE,
    HF_QUANT_CONFIG_FILE,
    IGNORED_SUFFIXES,
    KINDS,
    NVFP4_SUFFIXES,
    WEIGHTS_FILE,
    _check_kind,
    draft_kind,
    hf_quant_config,
    is_nvfp4_module,
    logical_shapes,
    quantization_config,
)
from vllm_nemotron_spec.tiny.tokenizer import BOS_ID, EOS_ID, MASK_ID, copy_tokenizer

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DraftParams:
    """Shape of the tiny drafts (real drafts in brackets); hidden size and vocab come from the target."""

    num_hidden_layers: int = 6  # [6]
    num_attention_heads: int = 8  # [32]
    num_key_value_heads: int = 2  # [2]
    head_dim: int = 32  # [128]; a head size vLLM's CPU attention supports
    intermediate_size: int = 384  # [6144]; multiple of 16 (NVFP4 group) and of 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # DFlash YaRN [factor 128, original 8192]: scaled to the tiny target's 4096 positions.
    yarn_factor: float = 16.0
    yarn_original_max_position_embeddings: int = 256
    max_position_embeddings: int = 4096
    # DSpark
    sliding_window: int = 64  # [1024]; small so tests can exceed it
    block_size: int = 8  # [8]
    markov_rank: int = 32  # [512]; multiple of 16 (it is markov_w2's input size)
    num_aux_layers: int = 6  # [6]
    init_std: float = 0.02

    def __post_init__(self):
        for name in ("intermediate_size", "markov_rank"):
            value = getattr(self, name)
            if value % GROUP_SIZE:
                raise ValueError(
                    f"DraftParams.{name} must be a multiple of {GROUP_SIZE} (NVFP4 group), "
                    f"got {value}"
                )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )


def spread_layer_ids(num_blocks: int, count: int = 6) -> list[int]:
    """``count`` target block ids spread from block 1 to the LAST block (``num_blocks - 1``), like
    the official ``[1, 5, 19, 29, 41, 51]`` of the 52-block target."""
    if num_blocks < count + 1:
        raise ValueError(
            f"need at least {count + 1} target blocks for {count} layer ids, got {num_blocks}"
        )
    step = (num_blocks - 2) / (count - 1)
    ids = [round(1 + k * step) for k in range(count)]
    if len(set(ids)) != count or ids[-1] != num_blocks - 1:
        raise AssertionError(f"bad layer id spread {ids} for {num_blocks} blocks")
    return ids


# ---------------------------------------------------------------------------------------------
# config.json
# ---------------------------------------------------------------------------------------------


def draft_config(
    kind: str,
    *,
    hidden_size: int,
    vocab_size: int,
    target_layer_ids: list[int],
    params: DraftParams = DraftParams(),
    mask_token_id: int = MASK_ID,
) -> dict:
    """The draft's ``config.json`` (official field set, tiny values)."""
    _check_kind(kind)
    if len(target_layer_ids) != params.num_aux_layers:
        raise ValueError(
            f"target_layer_ids has {len(target_layer_ids)} entries, expected num_aux_layers="
            f"{params.num_aux_layers}"
        )
    ids = [int(i) for i in target_layer_ids]
    n = params.num_hidden_layers
    config = {
        "architectures": [ARCHITECTURES[kind]],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "head_dim": params.head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden_size,
        "initializer_range": params.init_std,
        "intermediate_size": params.intermediate_size,
        "max_position_embeddings": params.max_position_embeddings,
        "num_attention_heads": params.num_attention_heads,
        "num_hidden_layers": n,
        "num_key_value_heads": params.num_key_value_heads,
        "rms_norm_eps": params.rms_norm_eps,
        "rope_theta": params.rope_theta,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": vocab_size,
        # Nemotron 3.5 draft fields
        "has_embed_tokens": True,
        "has_lm_head": False,
        "target_layer_ids": ids,
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in ids],
        "num_aux_layers": params.num_aux_layers,
        "mask_token_id": mask_token_id,
        "pard_token": mask_token_id,
        "sample_from_anchor": False,
        "quantization_config": quantization_config(kind),
    }
    if kind == DFLASH:
        config.update(
            {
                "layer_types": ["full_attention"] * n,
                "use_sliding_window": False,
                "sliding_window": None,
                "max_window_layers": n,
                "rope_scaling": {
                    "rope_type": "yarn",
                    "factor": params.yarn_factor,
                    "original_max_position_embeddings": params.yarn_original_max_position_embeddings,
                },
                "dflash_config": {
                    "causal": False,
                    "mask_token_id": mask_token_id,
                    "target_layer_ids": ids,
                    "use_swa": False,
                    "sample_from_anchor": False,
                    "attention_sink_bias": False,
                },
            }
        )
    else:
        config.update(
            {
                "layer_types": ["sliding_attention"] * n,
                "use_sliding_window": True,
                "sliding_window": params.sliding_window,
                "max_window_layers": 0,
                "rope_scaling": None,
                "block_size": params.block_size,
                "dspark_bonus_anchor": True,
                "markov_head_type": "vanilla",
                "markov_rank": params.markov_rank,
                "dflash_config": {
                    "causal": True,
                    "mask_token_id": mask_token_id,
                    "target_layer_ids": ids,
                    "use_swa": True,
                    "swa_window_size": params.sliding_window,
                    "sample_from_anchor": False,
                    "attention_sink_bias": True,
                },
            }
        )
    return dict(sorted(config.items()))


# ---------------------------------------------------------------------------------------------
# weights
# ---------------------------------------------------------------------------------------------


def init_draft_state_dict(config: dict, seed: int, embed_tokens: "torch.Tensor | None" = None):
    """Random fp32 weights for the draft (deterministic in ``seed``). Norm weights are 1 + noise and
    sinks are non-zero so a loader that mixes tensors up is caught by tests."""
    import torch

    kind = draft_kind(config)
    std = config.get("initializer_range", 0.02)
    gen = torch.Generator().manual_seed(int(seed) * 1000 + KINDS.index(kind) + 17)
    state: dict[str, torch.Tensor] = {}
    for name, shape in logical_shapes(config).items():
        if name == "embed_tokens.weight" and embed_tokens is not None:
            state[name] = embed_tokens.detach().to(torch.float32).clone()
        elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            state[name] = 1.0 + 0.05 * torch.randn(shape, generator=gen)
        elif name.endswith("attention_sink_bias"):
            state[name] = 0.5 * torch.randn(shape, generator=gen)
        elif name == "markov_head.markov_w1.weight":
            state[name] = 0.1 * torch.randn(shape, generator=gen)
        else:
            state[name] = std * torch.randn(shape, generator=gen)
    return state


def target_embedding(target_dir: str | Path):
    """The target's input embedding [vocab, hidden] (``backbone.embeddings.weight``) as fp32."""
    import torch
    from safetensors import safe_open

    target_dir = Path(target_dir)
    for file in sorted(target_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in (
                "backbone.embeddings.weight",
                "model.embeddings.weight",
                "model.embed_tokens.weight",
            ):
                if key in f.keys():
                    return f.get_tensor(key).to(torch.float32)
    raise KeyError(
        f"no embedding tensor (backbone.embeddings.weight) in {target_dir}/*.safetensors"
    )


def write_draft(
    outdir: str | Path,
    kind: str,
    state_dict_fp32: dict,
    target_dir: str | Path,
    *,
    params: DraftParams = DraftParams(),
    target_layer_ids: list[int] | None = None,
    mask_token_id: int = MASK_ID,
) -> Path:
    """Write a draft checkpoint directory from a dense fp32 state dict in the draft schema.

    ``config.json`` carries every field of the official drafts (architectures, qwen3 fields,
    ``has_embed_tokens`` / ``has_lm_head``, ``target_layer_ids`` and the
    ``eagle_aux_hidden_state_layer_ids`` (= ids + 1), ``mask_token_id`` / ``pard_token``,
    top-level and ``dflash_config.sample_from_anchor``, the DSpark block / Markov-head fields, and
    the ModelOpt ``quantization_config``). Tensors use the official names, without a ``model.``
    prefix: BF16 ``embed_tokens.weight`` (a copy of the target's embedding), ``hidden_norm``,
    ``norm``, ``layers.{i}.input_layernorm`` / ``post_attention_layernorm``,
    ``layers.{i}.self_attn.{q,k,v,o}_proj`` / ``{q,k}_norm``, DSpark
    ``layers.{i}.self_attn.attention_sink_bias`` [num_heads] and ``markov_head.markov_w1``
    [vocab, rank]; NVFP4 (``X.weight`` uint8 [out, in/2], ``X.weight_scale`` float8_e4m3fn
    [out, in/16], ``X.weight_scale_2`` fp32 scalar; see :mod:`vllm_nemotron_spec.nvfp4.format`)
    ``fc`` [hidden, num_aux * hidden], ``layers.{i}.mlp.{gate,up,down}_proj``, DSpark
    ``markov_head.markov_w2`` [vocab, rank].

    ``state_dict_fp32`` maps the official tensor names (see :func:`logical_shapes`) to dense
    tensors; ``embed_tokens.weight`` may be left out, then the target's embedding is copied.
    NVFP4 modules are packed with :func:`vllm_nemotron_spec.nvfp4.format.quantize`, the rest is
    stored in BF16. Writes ``config.json``, ``hf_quant_config.json``, ``model.safetensors`` and
    the target's tokenizer files. Returns ``outdir``.
    """
    from safetensors.torch import save_file

    _check_kind(kind)
    outdir, target_dir = Path(outdir), Path(target_dir)
    target_cfg = json.loads((target_dir / CONFIG_FILE).read_text())
    num_blocks = len(target_cfg.get("hybrid_override_pattern") or target_cfg["layers_block_type"])
    ids = list(target_layer_ids) if target_layer_ids is not None else spread_layer_ids(num_blocks)
    bad = [i for i in ids if not 0 <= i < num_blocks]
    if bad:
        raise ValueError(
            f"target_layer_ids {ids}: {bad} outside the target's blocks 0..{num_blocks - 1}"
        )
    config = draft_config(
        kind,
        hidden_size=target_cfg["hidden_size"],
        vocab_size=target_cfg["vocab_size"],
        target_layer_ids=ids,
        params=params,
        mask_token_id=mask_token_id,
    )
    shapes = logical_shapes(config)
    state = dict(state_dict_fp32)
    if "embed_tokens.weight" not in state:
        state["embed_tokens.weight"] = target_embedding(target_dir)
    missing = sorted(set(shapes) - set(state))
    unexpected = sorted(set(state) - set(shapes))
    if missing or unexpected:
        raise KeyError(
            f"{kind} draft state dict does not match the schema: missing {missing}, "
            f"unexpected {unexpected}"
        )
    with torch_threads(1):
        tensors = _pack(shapes, state)

    outdir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(outdir / WEIGHTS_FILE), metadata={"format": "pt"})
    _write_json(outdir / CONFIG_FILE, config)
    _write_json(outdir / HF_QUANT_CONFIG_FILE, hf_quant_config(kind))
    copy_tokenizer(target_dir, outdir)
    return outdir


def _pack(shapes: dict, state: dict) -> dict:
    """Dense fp32 state -> checkpoint tensors (NVFP4 modules packed, the rest BF16), sorted by name."""
    import torch

    from vllm_nemotron_spec.nvfp4 import format as nvfp4

    tensors: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        value = state[name]
        if tuple(value.shape) != shape:
            raise ValueError(f"tensor {name}: expected shape {shape}, found {tuple(value.shape)}")
        if not torch.is_floating_point(value):
            raise TypeError(f"tensor {name}: expected a floating-point tensor, found {value.dtype}")
        value = value.detach().to("cpu", torch.float32)
        if not torch.isfinite(value).all():
            raise ValueError(f"tensor {name}: contains inf/nan")
        module = name[: -len(".weight")]
        if name.endswith(".weight") and is_nvfp4_module(module):
            tensors.update(nvfp4.quantize(value).tensors(module))
        else:
            tensors[name] = value.to(torch.bfloat16)
    return {k: v.contiguous() for k, v in sorted(tensors.items())}


def read_draft_state_dict(path: str | Path) -> dict:
    """Dense fp32 tensors of a draft checkpoint (directory or ``.safetensors`` file), NVFP4
    modules dequantized, by the official tensor names; ``input_scale`` tensors are ignored."""
    import torch
    from safetensors import safe_open

    from vllm_nemotron_spec.nvfp4 import format as nvfp4

    path = Path(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"no .safetensors file in {path}")
    raw: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                raw[key] = f.get_tensor(key)
    quantized = sorted(k[: -len(".weight_scale")] for k in raw if k.endswith(".weight_scale"))
    out: dict[str, torch.Tensor] = {}
    consumed: set[str] = set()
    for module in quantized:
        names = [f"{module}.{s}" for s in NVFP4_SUFFIXES]
        absent = [n for n in names if n not in raw]
        if absent:
            raise KeyError(f"NVFP4 module {module}: missing tensors {absent}")
        with torch_threads(1):
            out[f"{module}.weight"] = nvfp4.dequantize(
                *(raw[n] for n in names), dtype=torch.float32
            )
        consumed.update(names)
        consumed.update(f"{module}.{s}" for s in IGNORED_SUFFIXES)
    for key, value in raw.items():
        if key in consumed or key.endswith(IGNORED_SUFFIXES):
            continue
        if not torch.is_floating_point(value):
            raise TypeError(f"tensor {key}: unexpected dtype {value.dtype} outside an NVFP4 module")
        out[key] = value.to(torch.float32)
    return dict(sorted(out.items()))


def build_draft(
    outdir: str | Path,
    kind: str,
    target_dir: str | Path,
    seed: int,
    params: DraftParams = DraftParams(),
) -> Path:
    """A randomly initialised draft of ``kind`` for the target in ``target_dir``."""
    target_dir = Path(target_dir)
    target_cfg = json.loads((target_dir / CONFIG_FILE).read_text())
    num_blocks = len(target_cfg.get("hybrid_override_pattern") or target_cfg["layers_block_type"])
    ids = spread_layer_ids(num_blocks, params.num_aux_layers)
    config = draft_config(
        kind,
        hidden_size=target_cfg["hidden_size"],
        vocab_size=target_cfg["vocab_size"],
        target_layer_ids=ids,
        params=params,
    )
    state = init_draft_state_dict(config, seed, embed_tokens=target_embedding(target_dir))
    return write_draft(outdir, kind, state, target_dir, params=params, target_layer_ids=ids)


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
