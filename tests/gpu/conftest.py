"""The GPU tests: every test in this folder is marked ``gpu`` and, where no CUDA device is
present, skipped with the reason :data:`NO_GPU` (a clean skip on CPU CI). Where CUDA is present
everything they need must be there: a missing vLLM, plugin entry point or compressed-tensors
fails the test, never skips it.

Run them on the lent H200 with ``bash scripts/gpu-tests.sh`` (docs/gpu-tests.md). Collecting them
imports neither vLLM nor the package's vLLM modules, so the default CPU run stays as fast.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
NO_GPU = "needs a CUDA GPU (torch.cuda.is_available() is False)"


def _in_this_folder(item) -> bool:
    return HERE == Path(item.path).resolve().parent or HERE in Path(item.path).resolve().parents


@pytest.hookimpl(tryfirst=True)  # before pytest's own hook deselects by -m
def pytest_collection_modifyitems(config, items):
    mine = [item for item in items if _in_this_folder(item)]
    if not mine:
        return
    import torch

    skip = None if torch.cuda.is_available() else pytest.mark.skip(reason=NO_GPU)
    for item in mine:
        item.add_marker(pytest.mark.gpu)
        if skip is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def gpu_session():
    """Environment of the session's engines, set before the first one (vLLM caches its
    environment variables once an engine core has started): model runner V2 (vLLM's default on
    CUDA, asserted by the tests), in-process engines, one tiny-family cache under both of its
    variable names, and fp32 arithmetic where fp32 is asked for: cuBLAS in full fp32 (vLLM's
    default) and Triton's dot products on fp32 inputs in IEEE fp32 instead of TF32 (Triton's
    default; part of Triton's cache key), so an fp32 run differs from plain decoding by fp32
    rounding only, far below the tiny target's closest logits (~1e-3 apart)."""
    from tests.gpu.drafts import use_one_cache_dir

    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_FLOAT32_MATMUL_PRECISION"] = "highest"
    os.environ["TRITON_F32_DEFAULT"] = "ieee"
    use_one_cache_dir()
    import torch

    torch.cuda.set_device(0)
    return {
        "device": torch.cuda.get_device_name(0),
        "capability": tuple(torch.cuda.get_device_capability(0)),
    }


@pytest.fixture(scope="session")
def trained(tiny_family):
    """The drafts trained against the tiny family (``ensure_trained_drafts``, cached)."""
    from vllm_nemotron_spec.tiny.train_draft import ensure_trained_drafts

    return ensure_trained_drafts(seed=0, family=tiny_family)


PROMPT_DOCUMENT_SEED = 97531
LONG_PROMPT_LENGTHS = (100, 300)
"""Corpus windows after the sample prompts: longer than a KV-cache block, so a prompt crosses
block boundaries in prefill and while decoding."""


@pytest.fixture(scope="session")
def turn2_suffix(tiny_family):
    """The user tokens appended to each prompt and its answer in a second turn."""
    from vllm_nemotron_spec.tiny.corpus import document_windows
    from vllm_nemotron_spec.tiny.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_family.tokenizer)
    return document_windows(tok, PROMPT_DOCUMENT_SEED + 1, (32,))[0]


@pytest.fixture(scope="session")
def prompts(tiny_family):
    """The tiny family's sample prompts and two long corpus windows, as token ids."""
    from vllm_nemotron_spec.tiny.corpus import document_windows, sample_prompts
    from vllm_nemotron_spec.tiny.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_family.tokenizer)
    out = [{"prompt_token_ids": tok.encode(p).ids} for p in sample_prompts()]
    windows = document_windows(tok, PROMPT_DOCUMENT_SEED, LONG_PROMPT_LENGTHS)
    return out + [{"prompt_token_ids": w} for w in windows]


def _spec(method: str, draft, k: int) -> dict:
    return {"method": method, "model": str(draft), "num_speculative_tokens": k}


@pytest.fixture(scope="session")
def fp32_runs(tiny_family, trained, prompts, turn2_suffix, tmp_path_factory):
    """fp32 runs of the tiny target on model runner V2, built on first use: ``plain``, the
    trained drafts (unquantized twins: vLLM's NVFP4 kernels take 16-bit activations only)
    ``dflash`` / ``dspark`` and their wrong-layout controls ``dflash_shifted`` /
    ``dspark_wrong_anchor``. Prefix caching is on in Mamba cache mode ``align`` (the recipe's
    flags); each engine also runs a second turn on its cached prefixes (``extra["turn2"]``). The ``dflash`` engine then serves the one-token join
    (``extra["then"]``, :func:`tests.gpu.engines.late_join`)."""
    from tests.gpu import drafts, engines
    from tests.gpu.engines import MAX_TOKENS, NUM_DFLASH_TOKENS, NUM_DSPARK_TOKENS

    twins = drafts.unquantized_twins(trained, tiny_family, tmp_path_factory.mktemp("fp32-drafts"))

    def build(method, name, k, then=None):
        spec = None if method is None else _spec(method, twins[name], k)
        return lambda: engines.run_engine(
            tiny_family.target,
            spec,
            "float32",
            prompts,
            MAX_TOKENS,
            suffix=turn2_suffix,
            then=then,
        )

    return engines.LazyRuns(
        {
            "plain": build(None, None, 0),
            "dflash": build("dflash", "dflash", NUM_DFLASH_TOKENS, then=engines.late_join),
            "dflash_shifted": build("dflash", "dflash_shifted", NUM_DFLASH_TOKENS),
            "dspark": build("dspark", "dspark", NUM_DSPARK_TOKENS),
            "dspark_wrong_anchor": build("dspark", "dspark_wrong_anchor", NUM_DSPARK_TOKENS),
        }
    )


@pytest.fixture(scope="session")
def bf16_runs(tiny_family, trained, prompts):
    """bf16 runs, built on first use: ``plain`` (with each position's two largest logits),
    ``dspark_nvfp4`` (the trained W4A16 NVFP4 DSpark draft on vLLM's NVFP4 kernels and the
    plugin's Markov-walk hook) and ``dflash_ct`` (the trained DFlash draft quantized by the
    compressed-tensors library, on vLLM's compressed-tensors scheme)."""
    from tests.gpu import drafts, engines
    from tests.gpu.engines import MAX_TOKENS, NUM_DFLASH_TOKENS, NUM_DSPARK_TOKENS

    def run(spec, top2=False):
        return lambda: engines.run_engine(
            tiny_family.target, spec, "bfloat16", prompts, MAX_TOKENS, top2=top2
        )

    return engines.LazyRuns(
        {
            "plain": run(None, top2=True),
            "dspark_nvfp4": run(_spec("dspark", trained.dspark, NUM_DSPARK_TOKENS)),
            "dflash_ct": lambda: run(
                _spec(
                    "dflash",
                    drafts.ensure_ct_dflash(trained.dflash_unquantized),
                    NUM_DFLASH_TOKENS,
                )
            )(),
        }
    )
