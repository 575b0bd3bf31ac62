"""Memory floors of one engine step: the bytes each part must read, over the GPU's bandwidth.

A decode step at small batch is bound by memory, not arithmetic, so the least time a part can
take is the bytes it must read from HBM divided by the bandwidth (:func:`bandwidth_for`: 4.3 TB/s,
what a device copy reaches on an H200, ~90% of its 4.8 TB/s; 3.0 TB/s on an H100 SXM, ~90% of its
3.35). Parts, as the speed scenario splits a step:

* ``target``: the target's forward over ``T = batch x (k + 1)`` tokens and its lm_head. Per MoE
  block the routed experts that ``T`` tokens touch: with top-``K`` of ``E`` experts and routing
  that is uniform and independent per token (random weights and prompts), the expected number of
  distinct experts is ``E x (1 - (1 - K/E)^T)``; plus the shared expert and the router. Per Mamba
  block its projections, and per request its SSM state: read once and written once for each of
  the ``k + 1`` verified positions (vLLM keeps one state per position to roll back to the accepted
  one; with vLLM's ReplaySSM, ``--use-replayssm``, read once only: the kernel keeps the recent
  tokens' inputs instead and writes the state back every few steps) plus the convolution window.
  Per attention block its projections and the requests' KV cache up to ``context`` tokens. The
  lm_head reads its whole ``vocab x hidden`` weight.
* ``draft`` (DFlash / DSpark): every draft layer's weights, ``fc``, the target's lm_head (the
  draft's logits go through it), the draft's KV cache (DSpark: within its sliding window) and,
  for DSpark, ``markov_w2`` once per drafted token (the walk is sequential).
* ``sampling``: the fp32 logits of the ``T`` verified rows.

Weights are counted at their stored width: NVFP4 0.5 bytes a value plus one fp8 scale per 16
(0.5625), FP8 1, BF16 2. Activations are left out (kilobytes at these batch sizes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm_nemotron_spec.checkpoint.spec import DraftSpec

NVFP4_BYTES = 0.5 + 1 / 16
"""Bytes per NVFP4 weight value: a 4-bit code and 1/16 of a float8 block scale."""
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1, "nvfp4": NVFP4_BYTES}
H200_BANDWIDTH_TBS = 4.3
BANDWIDTH_TBS = {"H200": H200_BANDWIDTH_TBS, "H100": 3.0}
"""Bandwidth of the floors per GPU (its name as nvidia-smi gives it contains the key)."""


def bandwidth_for(gpu_name: str | None) -> tuple[float, str]:
    """(TB/s, where it comes from) for the GPU named ``gpu_name``: :data:`BANDWIDTH_TBS`, else
    the H200's, said so."""
    for key, tbs in BANDWIDTH_TBS.items():
        if gpu_name and key in gpu_name:
            return tbs, key
    return H200_BANDWIDTH_TBS, f"H200's (no figure for {gpu_name or 'this machine'})"


@dataclass(frozen=True)
class TargetShape:
    """What the floors need of a NemotronH target (read from its config.json)."""

    hidden: int
    vocab: int
    pattern: str  # hybrid_override_pattern: M (Mamba-2), E (MoE), * (attention), - (MLP)
    experts: int
    top_k: int
    moe_intermediate: int
    shared_intermediate: int  # all shared experts together
    mamba_heads: int
    mamba_head_dim: int
    ssm_state: int
    n_groups: int
    conv_kernel: int
    attn_heads: int
    kv_heads: int
    head_dim: int
    mlp_intermediate: int = 0
    experts_dtype: str = "nvfp4"  # routed and shared experts (and dense MLP blocks)
    mamba_proj_dtype: str = "fp8"  # Mamba in_proj / out_proj
    ssm_state_dtype: str = "float32"
    conv_state_dtype: str = "bfloat16"

    @classmethod
    def from_config(cls, config: dict, quantized: bool) -> TargetShape:
        """From a target's config.json; ``quantized``: NVFP4 experts and FP8 Mamba projections
        (the NVFP4 checkpoint), else everything BF16."""
        shared = (config.get("moe_shared_expert_intermediate_size") or 0) * (
            config.get("n_shared_experts") or 0
        )
        return cls(
            hidden=config["hidden_size"],
            vocab=config["vocab_size"],
            pattern=config["hybrid_override_pattern"],
            experts=config.get("n_routed_experts") or 0,
            top_k=config.get("num_experts_per_tok") or 0,
            moe_intermediate=config.get("moe_intermediate_size") or 0,
            shared_intermediate=shared,
            mamba_heads=config["mamba_num_heads"],
            mamba_head_dim=config["mamba_head_dim"],
            ssm_state=config["ssm_state_size"],
            n_groups=config["n_groups"],
            conv_kernel=config["conv_kernel"],
            attn_heads=config["num_attention_heads"],
            kv_heads=config["num_key_value_heads"],
            head_dim=config["head_dim"],
            mlp_intermediate=config.get("intermediate_size") or 0,
            experts_dtype="nvfp4" if quantized else "bfloat16",
            mamba_proj_dtype="fp8" if quantized else "bfloat16",
            ssm_state_dtype=_state_dtype(config.get("mamba_ssm_cache_dtype")),
        )


def _state_dtype(name) -> str:
    """The SSM state's dtype name; "auto" or none means the model dtype (BF16 here)."""
    return name if name in DTYPE_BYTES else "bfloat16"


def distinct_experts(experts: int, top_k: int, tokens: int) -> float:
    """Expected number of distinct experts that ``tokens`` tokens touch when each picks ``top_k``
    of ``experts`` uniformly at random (independently per token)."""
    if experts <= 0 or tokens <= 0:
        return 0.0
    if not 0 < top_k <= experts:
        raise ValueError(f"top_k must be in 1..{experts}, got {top_k}")
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


def target_bytes(
    t: TargetShape,
    batch: int,
    num_spec: int,
    context: int,
    kv_bytes: float,
    replay_ssm: bool = False,
) -> dict[str, float]:
    """Bytes the target's forward and lm_head read in one step, by component (see the module
    doc). ``context``: tokens each request holds in the KV cache; ``kv_bytes``: bytes a KV value
    takes (1 for an fp8 cache); ``replay_ssm``: the engine runs vLLM's ReplaySSM (the SSM state
    read once a step, its write-back every few steps left out)."""
    tokens = batch * (num_spec + 1)
    h = t.hidden
    w_exp, w_mamba = DTYPE_BYTES[t.experts_dtype], DTYPE_BYTES[t.mamba_proj_dtype]
    n_moe, n_mamba = t.pattern.count("E"), t.pattern.count("M")
    n_attn, n_mlp = t.pattern.count("*"), t.pattern.count("-")
    expert = 2 * t.moe_intermediate * h * w_exp  # up + down (relu2: no gate)
    routed = distinct_experts(t.experts, t.top_k, tokens) * expert
    shared = 2 * t.shared_intermediate * h * w_exp
    router = t.experts * h * 2
    d_inner = t.mamba_heads * t.mamba_head_dim
    conv_dim = d_inner + 2 * t.n_groups * t.ssm_state
    in_proj = h * (2 * d_inner + 2 * t.n_groups * t.ssm_state + t.mamba_heads)
    out_proj = d_inner * h
    state = t.mamba_heads * t.mamba_head_dim * t.ssm_state * DTYPE_BYTES[t.ssm_state_dtype]
    conv_state = conv_dim * (t.conv_kernel - 1 + num_spec) * DTYPE_BYTES[t.conv_state_dtype]
    state_passes = 1 if replay_ssm else 1 + (num_spec + 1)
    per_request_state = state * state_passes + 2 * conv_state
    qkv = h * (t.attn_heads + 2 * t.kv_heads) * t.head_dim
    o = t.attn_heads * t.head_dim * h
    kv = context * 2 * t.kv_heads * t.head_dim * kv_bytes
    return {
        "routed_experts": n_moe * routed,
        "shared_experts": n_moe * (shared + router),
        "mlp": n_mlp * 2 * t.mlp_intermediate * h * w_exp,
        "mamba_weights": n_mamba * ((in_proj + out_proj) * w_mamba + conv_dim * t.conv_kernel * 2),
        "mamba_state": n_mamba * batch * per_request_state,
        "attention_weights": n_attn * (qkv + o) * 2,
        "kv_cache": n_attn * batch * kv,
        "embedding_rows": tokens * h * 2,
        "lm_head": t.vocab * h * 2,
    }


def draft_bytes(
    d: DraftSpec, batch: int, num_spec: int, context: int, kv_bytes: float
) -> dict[str, float]:
    """Bytes one draft step reads, by component (see the module doc); ``d``: the draft's parsed
    config (``checkpoint.spec.DraftSpec``)."""
    h, heads, kv_heads = d.hidden_size, d.num_attention_heads, d.num_key_value_heads
    attn = (h * (heads + 2 * kv_heads) * d.head_dim + heads * d.head_dim * h) * 2
    mlp = 3 * d.intermediate_size * h * NVFP4_BYTES
    window = context if d.sliding_window is None else min(context, d.sliding_window)
    kv = window * 2 * kv_heads * d.head_dim * kv_bytes
    out = {
        "fc": h * len(d.aux_hidden_state_ids) * h * NVFP4_BYTES,
        "layers": d.num_hidden_layers * (attn + mlp),
        "kv_cache": d.num_hidden_layers * batch * kv,
        "lm_head": d.vocab_size * h * 2,
    }
    if d.method == "dspark":
        out["markov_w2"] = num_spec * d.vocab_size * d.markov_rank * NVFP4_BYTES
    return out


def sampling_bytes(vocab: int, batch: int, num_spec: int) -> dict[str, float]:
    """The fp32 logits of the verified rows, read once."""
    return {"logits": batch * (num_spec + 1) * vocab * 4}


def floor_ms(nbytes: float, bandwidth_tbs: float = H200_BANDWIDTH_TBS) -> float:
    """Milliseconds to read ``nbytes`` at ``bandwidth_tbs`` (1 TB/s = 1e12 bytes/s)."""
    if bandwidth_tbs <= 0:
        raise ValueError(f"bandwidth must be positive, got {bandwidth_tbs} TB/s")
    return nbytes / (bandwidth_tbs * 1e12) * 1e3


def step_floors(
    target: TargetShape,
    draft: DraftSpec | None,
    batch: int,
    num_spec: int,
    context: int,
    kv_bytes: float = 1.0,
    bandwidth_tbs: float = H200_BANDWIDTH_TBS,
    drafted: int | None = None,
    replay_ssm: bool = False,
) -> dict:
    """Per part: the bytes by component, their total and the floor in ms; and the step's sum.
    ``num_spec`` drafts are verified; ``drafted`` (default ``num_spec``) are proposed: under a
    per-batch-size schedule vLLM drafts the whole block whatever k it verifies. ``replay_ssm``:
    see :func:`target_bytes`."""
    parts = {
        "target": target_bytes(target, batch, num_spec, context, kv_bytes, replay_ssm),
        "sampling": sampling_bytes(target.vocab, batch, num_spec),
    }
    if draft is not None and num_spec > 0:
        parts["draft"] = draft_bytes(draft, batch, drafted or num_spec, context, kv_bytes)
    out = {}
    for name, components in parts.items():
        total = sum(components.values())
        out[name] = {
            "bytes": components,
            "total_bytes": total,
            "floor_ms": floor_ms(total, bandwidth_tbs),
        }
    step_total = sum(p["total_bytes"] for p in out.values())
    out["step"] = {"total_bytes": step_total, "floor_ms": floor_ms(step_total, bandwidth_tbs)}
    out["bandwidth_tbs"] = bandwidth_tbs
    return out
