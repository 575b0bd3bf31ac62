"""Fixtures for the quantize tests: BF16 drafts of the tiny family, their quantized versions (one
per engine, built once per session), and the compressed-tensors draft.

The modelopt engine runs where ``vllm_nemotron_spec.quantize.modelopt_engine.resolve_engine``
finds nvidia-modelopt (``bash scripts/install.sh --quantize`` makes ``.venv-quantize``); where
there is none, its tests are skipped with the reason.
"""

from __future__ import annotations

import pytest

from tests.nvfp4.conftest import vllm_ctx, vllm_dist  # noqa: F401  (vLLM layers on CPU)


@pytest.fixture(scope="session")
def trained(tiny_family):
    """The trained DFlash drafts (``dflash_unquantized`` is the BF16 twin of ``dflash``)."""
    from vllm_nemotron_spec.tiny.train_draft import ensure_trained_drafts

    return ensure_trained_drafts(seed=0, family=tiny_family)


@pytest.fixture(scope="session")
def bf16_dflash(trained):
    return trained.dflash_unquantized


@pytest.fixture(scope="session")
def bf16_dspark(tiny_family, tmp_path_factory):
    """The family's (random) DSpark draft as a BF16 checkpoint: its NVFP4 modules dequantized."""
    from vllm_nemotron_spec.checkpoint.layout import DSPARK
    from vllm_nemotron_spec.tiny.drafts import DraftParams, read_draft_state_dict
    from vllm_nemotron_spec.tiny.train_draft import write_unquantized_draft

    state = read_draft_state_dict(tiny_family.dspark_draft)
    params = DraftParams(**tiny_family.manifest()["params"]["draft"])
    import json

    cfg = json.loads((tiny_family.dspark_draft / "config.json").read_text())
    out = tmp_path_factory.mktemp("bf16") / "dspark"
    return write_unquantized_draft(
        out,
        DSPARK,
        state,
        tiny_family.target,
        params=params,
        target_layer_ids=cfg["target_layer_ids"],
        mask_token_id=cfg["mask_token_id"],
    )


@pytest.fixture(scope="session")
def builtin_dflash(bf16_dflash, tmp_path_factory):
    from vllm_nemotron_spec.quantize.core import quantize_draft

    out = tmp_path_factory.mktemp("quantized") / "dflash-builtin"
    quantize_draft(bf16_dflash, out, "builtin", progress=False)
    return out


@pytest.fixture(scope="session")
def modelopt_engine():
    """The modelopt engine, or a skip saying why there is none."""
    from vllm_nemotron_spec.quantize.modelopt_engine import ModelOptUnavailable, resolve_engine

    try:
        engine = resolve_engine()
        version = engine.check_available()
    except ModelOptUnavailable as exc:
        pytest.skip(f"nvidia-modelopt is not available: {exc}")
    return engine, version


@pytest.fixture(scope="session")
def modelopt_result(modelopt_engine, bf16_dflash, tmp_path_factory):
    from vllm_nemotron_spec.quantize.core import quantize_draft

    engine, _ = modelopt_engine
    out = tmp_path_factory.mktemp("quantized") / "dflash-modelopt"
    return quantize_draft(
        bf16_dflash,
        out,
        "modelopt",
        modelopt_python=None if engine.python is None else str(engine.python),
        progress=False,
    )


@pytest.fixture(scope="session")
def modelopt_dflash(modelopt_result):
    return modelopt_result.outdir


@pytest.fixture(scope="session")
def ct_dflash(bf16_dflash, tmp_path_factory):
    """The trained BF16 DFlash draft quantized NVFP4A16 by the compressed-tensors library."""
    import torch

    from tests.quantize.ct_draft import build_ct_draft

    out = tmp_path_factory.mktemp("ct") / "dflash-nvfp4a16"
    # compressed-tensors compiles its FP4 rounding with torch.compile (~30 s of inductor on two
    # cores for nothing): the same function runs eagerly.
    with torch.compiler.set_stance("force_eager"):
        return build_ct_draft(bf16_dflash, out)
