"""Checkpoint tensors from safetensors headers, checked against the DraftSpec."""

from __future__ import annotations

import json
import os

import pytest

from tests import draft_configs as dc
from vllm_nemotron_spec.checkpoint import headers
from vllm_nemotron_spec.checkpoint.check import check_tensors
from vllm_nemotron_spec.checkpoint.headers import (
    CheckpointError,
    read_checkpoint,
    read_safetensors_header,
    scan_checkpoint,
)
from vllm_nemotron_spec.checkpoint.spec import DraftSpec, DraftSpecError


def checked(directory, cfg):
    spec = DraftSpec.from_pretrained(directory)
    scan = scan_checkpoint(directory)
    assert scan.problems == (), scan.problems
    return check_tensors(spec, scan.tensors)


def problems(directory, cfg) -> tuple[str, ...]:
    return checked(directory, cfg).problems


@pytest.fixture(scope="module")
def small_dspark(tmp_path_factory):
    return dc.write_draft(str(tmp_path_factory.mktemp("dspark")), dc.dspark_config(dc.SMALL))


def test_header_matches_the_safetensors_library(small_dspark):
    from safetensors import safe_open

    path = os.path.join(small_dspark, "model.safetensors")
    ours = read_safetensors_header(path)
    with safe_open(path, "pt") as f:
        theirs = {k: f.get_slice(k) for k in f.keys()}
        assert set(ours) == set(theirs)
        for name, s in theirs.items():
            assert list(ours[name].shape) == s.get_shape(), name
            assert ours[name].dtype == s.get_dtype(), name
    assert ours["fc.weight"].dtype == "U8" and ours["fc.weight"].shape == (64, 64)
    assert ours["fc.weight_scale"].dtype == "F8_E4M3" and ours["fc.weight_scale"].shape == (64, 8)
    assert ours["fc.weight_scale_2"].dtype == "F32" and ours["fc.weight_scale_2"].shape == ()


def test_small_real_checkpoints_are_consistent(tmp_path):
    for name, cfg in (
        ("dflash", dc.dflash_config(dc.SMALL)),
        ("dspark", dc.dspark_config(dc.SMALL)),
    ):
        d = dc.write_draft(str(tmp_path / name), cfg)
        result = checked(d, cfg)
        assert result.problems == () and result.warnings == ()
        formats = {m.name: m.format for m in result.modules}
        assert formats["fc"] == formats["layers.1.mlp.down_proj"] == "nvfp4"
        assert formats["layers.0.self_attn.q_proj"] == formats["embed_tokens.weight"] == "dense"
        assert all(m.ok for m in result.modules)


def test_bf16_checkpoint_without_quantization(tmp_path):
    cfg = dc.mutated(dc.dspark_config(dc.SMALL), quantization_config=dc.DELETE)
    d = dc.write_draft(str(tmp_path), cfg)
    result = checked(d, cfg)
    assert result.problems == ()
    assert {m.format for m in result.modules} == {"dense"}


def test_sharded_checkpoint(tmp_path):
    cfg = dc.dspark_config(dc.SMALL)
    one = dc.write_draft(str(tmp_path / "one"), cfg)
    three = dc.write_draft(str(tmp_path / "three"), cfg, shards=3)
    scan = scan_checkpoint(three)
    assert scan.index == "model.safetensors.index.json" and len(scan.files) == 3
    assert {k: (v.dtype, v.shape) for k, v in scan.tensors.items()} == {
        k: (v.dtype, v.shape) for k, v in read_checkpoint(one).items()
    }
    assert problems(three, cfg) == ()


def test_full_size_headers(tmp_path):
    """The official layouts at full size, from header-only (sparse) files."""
    for name, cfg in (("dflash", dc.dflash_config()), ("dspark", dc.dspark_config())):
        d = dc.write_draft(str(tmp_path / name), cfg, real=False, shards=2)
        result = checked(d, cfg)
        assert result.problems == () and result.warnings == ()
        mods = {m.name: m for m in result.modules}
        fc = mods["fc"]
        assert (
            fc.logical_shape,
            fc.packed_shape,
            fc.scale_shape,
            fc.found_dtype,
            fc.found_shape,
        ) == ((2688, 16128), (2688, 8064), (2688, 1008), "U8", (2688, 8064))
        assert mods["embed_tokens.weight"].found_shape == (131072, 2688)
        if name == "dspark":
            w2 = mods["markov_head.markov_w2"]
            assert (w2.packed_shape, w2.scale_shape) == ((131072, 256), (131072, 32))
            assert mods["markov_head.markov_w1.weight"].format == "dense"
            assert mods["layers.0.self_attn.attention_sink_bias"].found_shape == (32,)


# ---- tensor-level problems -----------------------------------------------------------------


def write_with(tmp_path, hook, cfg=None):
    cfg = cfg or dc.dspark_config(dc.SMALL)
    return dc.write_draft(str(tmp_path), cfg, tensors_hook=hook), cfg


def test_quantized_module_stored_bf16(tmp_path):
    import torch

    def hook(t):
        for k in ("fc.weight", "fc.weight_scale", "fc.weight_scale_2"):
            del t[k]
        t["fc.weight"] = torch.zeros(64, 128, dtype=torch.bfloat16)
        return t

    d, cfg = write_with(tmp_path, hook)
    assert problems(d, cfg) == (
        "`fc.weight`: found BF16 [64, 128] (unquantized) but quantization_config (W4A16_NVFP4) "
        "does not exclude `fc`: expected NVFP4 uint8 [64, 64] (logical [64, 128])",
        "`fc.weight_scale`: missing (expected F8_E4M3 [64, 8], one scale per 16 inputs of "
        "logical [64, 128])",
        "`fc.weight_scale_2`: missing (expected a float32 scalar, the global scale)",
    )


def test_wrong_packed_and_scale_shapes(tmp_path):
    import torch

    def hook(t):
        t["layers.0.mlp.up_proj.weight"] = torch.zeros(96, 64, dtype=torch.uint8)
        t["layers.0.mlp.up_proj.weight_scale"] = torch.zeros(96, 4, dtype=torch.float32)
        t["layers.0.mlp.up_proj.weight_scale_2"] = torch.zeros(2, dtype=torch.float32)
        return t

    d, cfg = write_with(tmp_path, hook)
    assert problems(d, cfg) == (
        "`layers.0.mlp.up_proj.weight`: found U8 [96, 64], expected NVFP4 uint8 [96, 32] "
        "(logical [96, 64], two E2M1 codes per byte)",
        "`layers.0.mlp.up_proj.weight_scale`: found F32 [96, 4], expected F8_E4M3 [96, 4] (one "
        "scale per 16 inputs of logical [96, 64]; packed weight [96, 32])",
        "`layers.0.mlp.up_proj.weight_scale_2`: found F32 [2], expected a float32 scalar",
    )


def test_excluded_module_stored_packed(tmp_path):
    import torch

    from vllm_nemotron_spec.nvfp4.format import quantize

    def hook(t):
        del t["layers.1.self_attn.o_proj.weight"]
        t.update(quantize(torch.randn(64, 64)).tensors("layers.1.self_attn.o_proj"))
        return t

    d, cfg = write_with(tmp_path, hook)
    got = problems(d, cfg)
    assert got[0] == (
        "`layers.1.self_attn.o_proj.weight`: found U8 [64, 32], expected an unquantized (BF16) "
        "tensor [64, 64]; it looks NVFP4-packed, but quantization_config excludes it (pattern "
        "'layers.*.self_attn.o_proj')"
    )
    assert got[1] == (
        "`layers.1.self_attn.o_proj.weight_scale`: present, but "
        "`layers.1.self_attn.o_proj` is stored unquantized (quantization_config "
        "excludes it)"
    )
    assert len(got) == 3


def test_missing_and_misshapen_dense_tensors(tmp_path):
    import torch

    def hook(t):
        del t["norm.weight"]
        t["layers.0.self_attn.q_norm.weight"] = torch.ones(8, dtype=torch.bfloat16)
        t["layers.1.self_attn.attention_sink_bias"] = torch.ones(4, dtype=torch.int32)
        t["extra.weight"] = torch.ones(2)
        return t

    d, cfg = write_with(tmp_path, hook)
    result = checked(d, cfg)
    assert result.problems == (
        "`norm.weight`: missing (expected [64])",
        "`layers.0.self_attn.q_norm.weight`: found BF16 [8], expected shape [16]",
        "`layers.1.self_attn.attention_sink_bias`: found I32 [4], expected an unquantized (BF16) "
        "tensor [4]",
    )
    assert result.warnings == ("1 tensor(s) the draft does not use: `extra.weight`",)
    assert not {m.name: m for m in result.modules}["norm.weight"].ok


def test_lm_head_in_a_nemotron_checkpoint(tmp_path):
    import torch

    d, cfg = write_with(tmp_path, lambda t: dict(t, **{"lm_head.weight": torch.zeros(512, 64)}))
    assert problems(d, cfg) == (
        "`lm_head.weight` is in the checkpoint but `has_lm_head` is false: the draft uses the "
        "target's",
    )


def test_model_prefix_is_accepted(tmp_path):
    d, cfg = write_with(tmp_path, lambda t: {f"model.{k}": v for k, v in t.items()})
    assert problems(d, cfg) == ()


# ---- file-level problems -------------------------------------------------------------------


def raw_header(tmp_path, header_bytes: bytes, data: bytes = b"") -> str:
    path = tmp_path / "model.safetensors"
    path.write_bytes(len(header_bytes).to_bytes(8, "little") + header_bytes + data)
    return str(path)


def one(dtype, shape, offsets) -> bytes:
    return json.dumps({"a": {"dtype": dtype, "shape": shape, "data_offsets": offsets}}).encode()


@pytest.mark.parametrize(
    "header,data,expected",
    [
        (None, b"", "too short for a safetensors file"),
        (b"{}", b"", None),
        (b"[1]", b"", "header must be a JSON object, found list"),
        (b'{"a": ', b"", "header is not valid JSON"),
        (b"\xff\xff", b"", "header is not UTF-8"),
        (b'{"a": 1' + b"0" * 5000 + b"}", b"", "header is not valid JSON"),
        (one("Q9", [2], [0, 2]), b"xx", "tensor `a`: unknown dtype 'Q9'"),
        (one("U8", [-2], [0, 2]), b"xx", "shape must be a list of non-negative integers"),
        (
            one("U8", [2], [0, 9]),
            b"xx",
            "data_offsets must be [begin, end] with 0 <= begin <= end <= 2",
        ),
        (one("F32", [2], [0, 2]), b"xx", "F32 [2] needs 8 bytes but data_offsets span 2"),
        (one("U8", [2], [0, 2]), b"xxx", "the tensors cover 2 bytes of data but the file holds 3"),
        (one("U8", [2], [1, 3]), b"xxx", "`a` starts at byte 1 of the data, expected 0"),
        (
            b'{"a": "x", "__metadata__": {"k": 1}}',
            b"",
            "`__metadata__` must map strings to strings",
        ),
    ],
)
def test_corrupted_headers(tmp_path, header, data, expected):
    if header is None:
        path = tmp_path / "model.safetensors"
        path.write_bytes(b"\x01\x02")
        path = str(path)
    else:
        path = raw_header(tmp_path, header, data)
    if expected is None:
        assert read_safetensors_header(path) == {}
        return
    with pytest.raises(CheckpointError) as info:
        read_safetensors_header(path)
    assert any(expected in p for p in info.value.problems), info.value.problems
    assert isinstance(info.value, DraftSpecError)


def test_header_length_beyond_the_file(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes((10**6).to_bytes(8, "little") + b"{}")
    with pytest.raises(
        CheckpointError, match="header length 1000000 exceeds the file \\(10 bytes\\)"
    ):
        read_safetensors_header(str(path))


def test_index_problems(tmp_path):
    cfg = dc.dspark_config(dc.SMALL)
    d = dc.write_draft(str(tmp_path), cfg, shards=2)
    index_path = os.path.join(d, "model.safetensors.index.json")
    index = json.load(open(index_path))
    index["weight_map"]["ghost.weight"] = "model-00001-of-00002.safetensors"
    index["weight_map"]["fc.weight"] = "model-00009-of-00009.safetensors"
    index["weight_map"]["evil"] = "../outside.safetensors"
    json.dump(index, open(index_path, "w"))
    scan = scan_checkpoint(d)
    assert scan.problems == (
        "model.safetensors.index.json: `weight_map['evil']` must be a .safetensors file name in "
        "the checkpoint directory, found '../outside.safetensors'",
        "model.safetensors.index.json names shard 'model-00009-of-00009.safetensors' (1 tensors, "
        "e.g. `fc.weight`) but the file is missing",
        "model.safetensors.index.json puts `ghost.weight` in model-00001-of-00002.safetensors but "
        "that file has no such tensor",
    )
    json.dump({"weight_map": []}, open(index_path, "w"))
    assert "expected an object with a `weight_map` object" in scan_checkpoint(d).problems[0]


def test_no_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert (
        "no model.safetensors, model.safetensors.index.json or *.safetensors"
        in scan_checkpoint(str(tmp_path)).problems[0]
    )


def test_pytorch_weights_defer_the_header_check(small_dspark, tmp_path):
    """A draft stored as PyTorch pickles (vLLM's loader falls back to them) is not refused: its
    headers cannot be read without loading, so the check is deferred, naming the files."""
    import shutil

    from vllm_nemotron_spec.checkpoint.headers import draft_headers
    from vllm_nemotron_spec.checkpoint.inspect import inspect_checkpoint

    d = tmp_path / "bin"
    shutil.copytree(small_dspark, d, ignore=shutil.ignore_patterns("*.safetensors"))
    (d / "pytorch_model.bin").write_bytes(b"not read")
    source = draft_headers(str(d))
    assert source.scan is None
    assert "PyTorch weights (`pytorch_model.bin`)" in source.where
    report = inspect_checkpoint(str(d))
    assert report["weights_deferred"] and report["problems"] == [], report["problems"]
    # With safetensors files beside them, the safetensors headers are read as usual.
    shutil.copy(os.path.join(small_dspark, "model.safetensors"), d)
    assert draft_headers(str(d)).scan.files == ("model.safetensors",)
    # Neither kind: still refused, naming what was expected.
    os.remove(d / "pytorch_model.bin")
    os.remove(d / "model.safetensors")
    assert "no model.safetensors" in draft_headers(str(d)).scan.problems[0]


def test_pytorch_weights_in_the_hub_cache_defer_the_header_check(
    small_dspark, tmp_path, monkeypatch
):
    """The same for a Hub id whose cached snapshot holds PyTorch pickles only (what vLLM
    downloads for such a repo): deferred, naming the cache, not "not in the cache"."""
    import shutil

    from huggingface_hub import constants

    from vllm_nemotron_spec.checkpoint.headers import draft_headers

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    storage = tmp_path / "hub" / "models--org--bin-draft"
    (storage / "refs").mkdir(parents=True)
    (storage / "refs" / "main").write_text("abc123")
    snapshot = storage / "snapshots" / "abc123"
    shutil.copytree(small_dspark, snapshot, ignore=shutil.ignore_patterns("*.safetensors"))
    (snapshot / "pytorch_model.bin").write_bytes(b"not read")
    source = draft_headers("org/bin-draft", hub=False)
    assert source.scan is None
    assert source.where == (
        f"Hugging Face cache {snapshot} holds PyTorch weights (`pytorch_model.bin`), whose "
        "tensor headers cannot be read without loading them"
    )


@pytest.mark.parametrize("error", [TimeoutError(), ConnectionError(""), OSError("  \n")])
def test_a_hub_error_without_a_message_defers_the_check_to_load_time(monkeypatch, error):
    """Start-up must not fail on how an exception is worded: any Hub failure defers the header
    check to load time, naming the error."""
    import huggingface_hub
    from huggingface_hub import constants

    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(huggingface_hub, "get_safetensors_metadata", fail)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(headers, "cached_snapshot", lambda model, revision: None)
    source = headers.draft_headers("nvidia/some-draft", "main")
    assert source.scan is None
    assert source.where == (
        "the Hub's safetensors metadata of nvidia/some-draft@main could not be read "
        f"({type(error).__name__})"
    )
