"""The V2 draft-input launcher with the wide tile (``patches/v2_dflash_inputs_block.py``) writes
exactly what vLLM's writes, on the GPU's Triton kernel: every output buffer, after launches of
decode steps with rejected drafts, a prefill chunk and a batch smaller than the graph buffers
(the padding the patch speeds up)."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from vllm_nemotron_spec.patches import v2_dflash_inputs_block as patch

MAX_REQS, MAX_TOKENS, MAX_LEN, BLOCK, K = 8, 2048, 4096, 16, 3
OUTPUTS = ("query_slot_mapping", "context_positions", "context_slot_mapping", "sample_indices",
           "sample_pos", "sample_idx_mapping", "temperature", "seeds")  # fmt: skip
BUFFERS = ("input_ids", "positions", "is_padding", "query_start_loc", "seq_lens")


def _buffers(seed: int) -> dict:
    """Output buffers filled with the same garbage for both launchers."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def junk(n, dtype):
        if dtype == torch.bool:
            return torch.randint(0, 2, (n,), generator=g, device="cuda").bool()
        return torch.randint(-9, 9, (n,), generator=g, device="cuda").to(dtype)

    ib = types.SimpleNamespace(
        input_ids=junk(MAX_TOKENS, torch.int32), positions=junk(MAX_TOKENS, torch.int64),
        is_padding=junk(MAX_TOKENS, torch.bool), query_start_loc=junk(MAX_REQS + 1, torch.int32),
        seq_lens=junk(MAX_REQS, torch.int32),
    )  # fmt: skip
    out = {
        "query_slot_mapping": junk(MAX_TOKENS, torch.int64),
        "context_positions": junk(MAX_TOKENS, torch.int64),
        "context_slot_mapping": junk(MAX_TOKENS, torch.int64),
        "sample_indices": junk(MAX_REQS * K, torch.int64),
        "sample_pos": junk(MAX_REQS * K, torch.int64),
        "sample_idx_mapping": junk(MAX_REQS * K, torch.int32),
        "temperature": junk(MAX_REQS, torch.float32), "seeds": junk(MAX_REQS, torch.int64),
    }  # fmt: skip
    return {"input_buffers": ib, **out}


def _batch(query_lens, rejected, seed):
    """A target batch of ``query_lens`` tokens per request, ``rejected`` of them rejected."""
    rng = np.random.default_rng(seed)
    n = len(query_lens)
    starts = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    context = rng.integers(100, 2000, n)
    positions = np.concatenate([c + np.arange(q) for c, q in zip(context, query_lens)])
    batch = types.SimpleNamespace(
        num_reqs=n, num_scheduled_tokens=np.array(query_lens, dtype=np.int32),
        positions=torch.tensor(positions, device="cuda", dtype=torch.int64),
        query_start_loc=torch.tensor(starts, device="cuda"),
        idx_mapping=torch.tensor(rng.permutation(MAX_REQS)[:n], device="cuda", dtype=torch.int32),
    )  # fmt: skip
    state = dict(
        num_sampled=torch.ones(n, device="cuda", dtype=torch.int32),
        num_rejected=torch.tensor(rejected, device="cuda", dtype=torch.int32),
        last_sampled=torch.randint(0, 1000, (MAX_REQS,), device="cuda"),
        next_prefill_tokens=torch.randint(0, 1000, (MAX_REQS,), device="cuda"),
        input_temperature=torch.rand(MAX_REQS, device="cuda"),
        input_seeds=torch.randint(0, 1 << 30, (MAX_REQS,), device="cuda"),
        block_table=torch.randint(1, 500, (MAX_REQS, MAX_LEN // BLOCK), device="cuda",
                                  dtype=torch.int32),
    )  # fmt: skip
    return batch, state


@pytest.mark.parametrize(
    "query_lens, rejected",
    [([K + 1], [0]), ([K + 1] * 5, [0, 1, 2, 3, 0]), ([300, K + 1], [0, 2])],
    ids=["one-decode", "decodes-rejecting", "prefill-chunk"],
)
def test_wide_tile_writes_what_vllm_writes(query_lens, rejected):
    from vllm.v1.worker.gpu.spec_decode.dflash import speculator

    upstream = getattr(speculator.prepare_dflash_inputs, "__wrapped__",
                       speculator.prepare_dflash_inputs)  # fmt: skip
    rewritten = patch.wide_block_launcher(upstream)
    batch, state = _batch(query_lens, rejected, seed=len(query_lens))
    results = []
    for launcher in (upstream, rewritten):
        bufs = _buffers(seed=0)
        launcher(
            bufs["input_buffers"], *(bufs[k] for k in OUTPUTS), batch,
            state["num_sampled"], state["num_rejected"], state["last_sampled"],
            state["next_prefill_tokens"], state["input_temperature"], state["input_seeds"],
            state["block_table"], BLOCK, 0, 1, 1, 990, K + 1, K, MAX_REQS, MAX_TOKENS, MAX_LEN,
            False,
        )  # fmt: skip
        torch.cuda.synchronize()
        results.append(
            {**{k: bufs[k].cpu() for k in OUTPUTS},
             **{k: getattr(bufs["input_buffers"], k).cpu() for k in BUFFERS}}
        )  # fmt: skip
    for name in results[0]:
        assert torch.equal(results[0][name], results[1][name]), name
