"""Train tiny DFlash and DSpark drafts for the tiny NemotronH target (CPU, fp32, deterministic).

The drafts are the plain-torch modules of :mod:`vllm_nemotron_spec.tiny.reference`, trained
through that module's forward (the step vLLM computes), so what is trained is what is served.
Data: :func:`generate_draft_data`; DFlash: :func:`train_draft`; DSpark:
:func:`train_dspark_draft`; the cached result: :func:`ensure_trained_drafts`.
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
from vllm_nemotron_spec.tiny import cache
from vllm_nemotron_spec.tiny.build import builder_source_hash
from vllm_nemotron_spec.tiny.cache import MANIFEST
from vllm_nemotron_spec.tiny.reference import (
    DFlashDraft,
    DSparkDraft,
    draft_forward,
    draft_logits,
    dspark_base_logits,
    load_draft_module,
    markov_walk,
    target_lm_head,
)

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
    prompt length. The aux hidden states are recorded as vLLM records them
    (:func:`capture_aux_hidden_states`: the last id BEFORE ``norm_f``; transformers'
    ``output_hidden_states`` gives ``norm_f``'s output there)."""
    from tqdm.auto import tqdm

    from vllm_nemotron_spec.tiny.target import load_target, quiet_kernel_fallback_warnings
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
        with quiet_kernel_fallback_warnings():
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
# training
# ---------------------------------------------------------------------------------------------


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
    base = dspark_base_logits(draft, lm_head_weight, aux, tokens, anchors, gamma)
    S, K = anchors.shape
    prev = tokens.gather(1, (anchors[..., None] + torch.arange(gamma)).reshape(S, -1))
    return base + draft.markov_head(prev.view(S, K, gamma))


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
    minus ``params.eval_sequences`` held-out sequences, through :func:`draft_forward`;
    deterministic in ``seed`` (fixed thread count, deterministic algorithms).

    Many anchors ``L`` per sequence train in one forward, each block masked to the context before
    its anchor and its own rows. Cross-entropy through the frozen target lm_head, rows weighted
    ``exp(-(j - 1) / position_decay)``. ``label_offset=1`` trains the shifted layout (row ``r``
    predicts ``L + r + 1``, the anchor row used as a prediction), which vLLM's layout serves one
    position off: acceptance collapses to ~1 token while outputs stay exact."""
    train, held_out = data.split(params.eval_sequences)
    B = params.block_size
    distance = torch.arange(B) + params.label_offset  # how far ahead each row predicts
    weights = torch.exp(-(distance.clamp(min=1) - 1).float() / params.position_decay)
    lm_head_weight = lm_head_weight.detach()

    def batch_loss(tokens, aux, anchors):
        hidden = draft_forward(draft, aux, tokens, anchors, B)
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
    ``embed_tokens`` frozen; deterministic in ``seed``.

    Teacher forcing (the bonus for ``k = 1``) is the walk whenever the earlier drafts were
    accepted, the only case greedy acceptance uses. The backbone starts from the trained DFlash
    draft (same shapes), sinks and Markov head from the family's DSpark draft. The causal block
    makes the anchor layout read the same weights one row off, so the wrong-anchor twin
    (``sample_from_anchor: true``) collapses to ~1.2 tokens."""
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
        hidden = draft_forward(
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
        base = dspark_base_logits(
            draft,
            lm_head_weight,
            data.aux[s : s + 1],
            data.tokens[s : s + 1],
            anchors,
            gamma,
        )
        head = draft.markov_head
        bonus = data.tokens[s, anchors[0]]
        return markov_walk(base[0], bonus, head.markov_w1.weight, head.markov_w2.weight)[0]

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
    trained on first use (~1.5 minutes on 2 cores, in two processes), reused while the family's
    target and draft files and every trainer parameter are unchanged (keyed by the builder's
    source, every parameter and the family's files; :mod:`vllm_nemotron_spec.tiny.cache`).
    Parallel processes wait on a file lock; the first trains, the others reuse."""
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
    """Hash of the builder's code (``builder_source_hash``), the trainer's parameters, the seed
    and the family's target, DFlash and DSpark draft files (the drafts' configs and initial
    weights are the starting point)."""
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
    key = cache_key(family, seed, spec)

    def train(tmp: Path) -> dict:
        stats = _train_into(tmp, family, seed, spec, progress)
        return {
            "key": key,
            "builder_sources": builder_source_hash(),
            "seed": seed,
            "family": str(family.root),
            "params": spec.to_dict(),
            "stats": stats,
        }

    root = cache.cached_build(
        outdir,
        train,
        lambda path: cache.is_complete(path, {"key": key}),
        force=force,
        what="trained drafts",
    )
    return TrainedDrafts.at(root)


def _train_into(root: Path, family, seed: int, spec: TrainerSpec, progress: bool) -> dict:
    from vllm_nemotron_spec._torch import deterministic_torch
    from vllm_nemotron_spec.tiny.drafts import DraftParams

    t0 = time.monotonic()
    cache.say(progress, f"training tiny DFlash and DSpark drafts (seed {seed}) into {root.parent}")
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
    variant = (Path(root), Path(family.target), Path(family.dflash_draft), data, write_kwargs)
    # The shifted draft is independent of the others: it trains in a second process meanwhile
    # (spawned: a forked child of a process that ran OpenMP may hang). Each run is
    # deterministic in its seed on one thread, so the weights are the same either way.
    with _second_process() as pool:
        shifted = pool.submit(  # its progress bar would share the terminal line: none
            _train_dflash_variant, *variant, DFLASH_SHIFTED, spec.dflash_shifted, seed + 1,
            progress, bar=False,
        )  # fmt: skip
        stats[DFLASH], dflash_state = _train_dflash_variant(
            *variant, DFLASH, spec.dflash, seed, progress, lm_head=lm_head
        )
        stats[DFLASH_SHIFTED], _ = shifted.result()
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


@contextlib.contextmanager
def _second_process():
    """A pool of one spawned worker process, shut down on exit."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
    try:
        yield pool
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _run_stats(result: TrainResult) -> dict:
    """A training run's time and its first and final loss (the mean of the last 10 steps)."""
    return {
        "train_seconds": round(result.seconds, 1),
        "first_loss": round(result.losses[0], 4),
        "final_loss": round(sum(result.losses[-10:]) / len(result.losses[-10:]), 4),
    }


def _train_dflash_variant(
    root: Path,
    target: Path,
    init_draft: Path,
    data: DraftData,
    write_kwargs: dict,
    name: str,
    params: TrainParams,
    train_seed: int,
    progress: bool,
    lm_head: torch.Tensor | None = None,
    bar: bool = True,
) -> tuple[dict, dict]:
    """Train one DFlash draft (``name``: the layout vLLM serves, or its shifted twin) from the
    family's DFlash draft ``init_draft``, write it (the unquantized copy too for DFlash) and
    check what was written; its stats and trained state."""
    from vllm_nemotron_spec._torch import deterministic_torch
    from vllm_nemotron_spec.tiny.drafts import write_draft

    if lm_head is None:
        lm_head = target_lm_head(target)
    draft, _ = load_draft_module(init_draft)  # the family's draft is the init
    result = train_draft(draft, lm_head, data, params, train_seed, progress and bar, desc=name)
    written = {name: write_draft(root / name, DFLASH, result.state_dict, target, **write_kwargs)}
    if name == DFLASH:
        written[DFLASH_UNQUANTIZED] = write_unquantized_draft(
            root / DFLASH_UNQUANTIZED, DFLASH, result.state_dict, target, **write_kwargs
        )
    stats = {
        **_run_stats(result),
        "offline_fp32": result.eval,
    }
    expected_config = json.loads((init_draft / "config.json").read_text())
    expected_config.pop("quantization_config", None)
    # Acceptance of what is served: the written weights (NVFP4 dequantized, BF16 rounded).
    _, held_out = data.split(params.eval_sequences)
    for label, path in written.items():
        config = json.loads((path / "config.json").read_text())
        config.pop("quantization_config", None)
        if config != expected_config:
            raise AssertionError(f"{path}/config.json differs from the family's DFlash draft")
        served, _ = load_draft_module(path)
        with deterministic_torch(params.num_threads):
            stats[f"offline_{label}"] = offline_acceptance(
                served, lm_head, held_out, params.block_size - 1
            )
    cache.say(progress, f"{name}: {json.dumps(stats)}")
    return stats, result.state_dict


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
        **_run_stats(result),
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
    cache.say(progress, f"{DSPARK}: {json.dumps(stats)}")
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
