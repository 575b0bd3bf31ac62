"""``quantize`` with the builtin engine: the official layout, configs, shards, and every refusal."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.quantize.util import bits_equal
from tests.quantize.util import tensors as _tensors
from vllm_nemotron_spec.checkpoint import layout
from vllm_nemotron_spec.nvfp4 import format as nvfp4
from vllm_nemotron_spec.quantize.core import QuantizeError, load_source, quantize_draft


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


# ------------------------------------------------------------------------------------------
# The official layout
# ------------------------------------------------------------------------------------------


def test_dflash_has_the_official_layout_and_configs(bf16_dflash, builtin_dflash, trained):
    """Same config.json, hf_quant_config.json, tensor names, dtypes and shapes as the tiny
    family's NVFP4 draft (written by tiny/drafts.py in the official layout)."""
    assert _json(builtin_dflash / "config.json") == _json(trained.dflash / "config.json")
    assert _json(builtin_dflash / "hf_quant_config.json") == _json(
        trained.dflash / "hf_quant_config.json"
    )
    ours, official = _tensors(builtin_dflash), _tensors(trained.dflash)
    assert sorted(ours) == sorted(official)
    for name, t in official.items():
        assert (ours[name].dtype, tuple(ours[name].shape)) == (t.dtype, tuple(t.shape)), name
    packed = sorted(k[: -len(".weight_scale")] for k in ours if k.endswith(".weight_scale"))
    assert packed == sorted(
        ["fc"] + [f"layers.{i}.mlp.{p}_proj" for i in range(6) for p in ("gate", "up", "down")]
    )
    assert all(ours[f"{m}.weight_scale_2"].shape == () for m in packed)
    for name in (
        "embed_tokens.weight",
        "layers.0.self_attn.q_proj.weight",
        "norm.weight",
        "layers.3.self_attn.k_norm.weight",
        "hidden_norm.weight",
    ):
        assert ours[name].dtype == torch.bfloat16
    # the tokenizer travels with the draft
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (builtin_dflash / f).read_bytes() == (bf16_dflash / f).read_bytes()


def test_builtin_packs_with_the_reference_packer_bit_for_bit(bf16_dflash, builtin_dflash):
    """Every packed module is nvfp4.format.quantize of the BF16 weight; every other tensor is the
    BF16 source tensor unchanged."""
    source, ours = _tensors(bf16_dflash), _tensors(builtin_dflash)
    for name, weight in source.items():
        module = name[: -len(".weight")]
        if layout.is_nvfp4_module(module):
            ref = nvfp4.quantize(weight.float()).tensors(module)
            for key, value in ref.items():
                assert bits_equal(ours[key], value), key
        else:
            assert ours[name].dtype == torch.bfloat16
            assert torch.equal(ours[name], weight), name


def test_dequantized_weights_are_close_to_the_bf16_draft(bf16_dflash, builtin_dflash):
    from vllm_nemotron_spec.tiny.drafts import read_draft_state_dict

    source, deq = _tensors(bf16_dflash), read_draft_state_dict(builtin_dflash)
    for name, weight in source.items():
        w = weight.float()
        err = (deq[name] - w).norm() / w.norm()
        limit = 0.12 if layout.is_nvfp4_module(name[: -len(".weight")]) else 0.0
        assert float(err) <= limit, (name, float(err))


def test_dspark_packs_markov_w2_and_keeps_markov_w1_and_sinks_bf16(
    bf16_dspark, tiny_family, tmp_path
):
    out = quantize_draft(bf16_dspark, tmp_path / "dspark", progress=False).outdir
    assert _json(out / "config.json") == _json(tiny_family.dspark_draft / "config.json")
    assert _json(out / "hf_quant_config.json") == _json(
        tiny_family.dspark_draft / "hf_quant_config.json"
    )
    ours, official = _tensors(out), _tensors(tiny_family.dspark_draft)
    assert {k: (v.dtype, tuple(v.shape)) for k, v in ours.items()} == {
        k: (v.dtype, tuple(v.shape)) for k, v in official.items()
    }
    assert ours["markov_head.markov_w2.weight"].dtype == torch.uint8
    assert ours["markov_head.markov_w1.weight"].dtype == torch.bfloat16
    assert ours["layers.0.self_attn.attention_sink_bias"].dtype == torch.bfloat16


def test_result_passes_inspect(builtin_dflash, tiny_family):
    from vllm_nemotron_spec.checkpoint.inspect import inspect_checkpoint

    report = inspect_checkpoint(str(builtin_dflash), target=str(tiny_family.target))
    assert report["problems"] == [] and report["nemotron35_layout"]
    modules = {m["name"]: m["format"] for m in report["quantization"]["modules"]}
    assert modules["fc"] == "nvfp4" and modules["layers.2.mlp.down_proj"] == "nvfp4"
    assert modules["layers.2.self_attn.o_proj"] == "dense"


# ------------------------------------------------------------------------------------------
# Shards, other files, options
# ------------------------------------------------------------------------------------------


def test_shards_with_an_index_load_the_same_tensors(bf16_dflash, builtin_dflash, tmp_path):
    out = quantize_draft(bf16_dflash, tmp_path / "sharded", max_shard_size="400KiB", progress=False)
    shards = sorted(p.name for p in out.outdir.glob("*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = _json(out.outdir / "model.safetensors.index.json")
    assert sorted(set(index["weight_map"].values())) == shards
    for shard in shards:
        assert (out.outdir / shard).stat().st_size <= 400 * 1024 + 4096  # + header
    single = _tensors(builtin_dflash)
    sharded = _tensors(out.outdir)
    assert sorted(single) == sorted(sharded)
    for k in single:
        assert bits_equal(single[k], sharded[k]), k
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in single.values()
    )


def test_streaming_writer_files_are_standard_safetensors(tmp_path):
    """The writer's bytes decode with the safetensors library to the same tensors (every dtype
    the drafts use, scalars included) and carry the metadata."""
    from vllm_nemotron_spec.quantize.safetensors_io import write_shards

    tensors = {
        "a": torch.randn(3, 5).to(torch.bfloat16),
        "b.weight": torch.randint(0, 255, (4, 7), dtype=torch.uint8),
        "b.weight_scale": torch.rand(4, 2).to(torch.float8_e4m3fn),
        "b.weight_scale_2": torch.tensor(0.25, dtype=torch.float32),
        "c": torch.arange(6, dtype=torch.int64).reshape(2, 3),
    }
    write_shards(
        tensors, tmp_path, max_shard_bytes=10**9, metadata={"format": "pt"}, progress=False
    )
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        for k, v in tensors.items():
            got = f.get_tensor(k)
            assert bits_equal(got, v), k


def test_progress_bar_on_stderr_and_summary(bf16_dflash, tmp_path, capsys):
    from vllm_nemotron_spec.cli.main import main

    assert main(["quantize", str(bf16_dflash), str(tmp_path / "q")]) == 0
    captured = capsys.readouterr()
    assert "writing shards" in captured.err and "100%" in captured.err
    assert "packing NVFP4 (builtin)" in captured.err
    assert "NVFP4      19 modules" in captured.out


def test_json_output(bf16_dflash, tmp_path, capsys):
    from vllm_nemotron_spec.cli.main import main

    assert main(["quantize", str(bf16_dflash), str(tmp_path / "q"), "--quiet", "--json"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert captured.err == ""
    assert result["kind"] == "dflash" and len(result["packed_modules"]) == 19
    assert "model.safetensors" in result["files"] and "config.json" in result["files"]


def test_model_prefix_is_dropped(bf16_dflash, builtin_dflash, tmp_path):
    src = tmp_path / "prefixed"
    shutil.copytree(bf16_dflash, src)
    tensors = load_file(str(src / "model.safetensors"))
    save_file({f"model.{k}": v for k, v in tensors.items()}, str(src / "model.safetensors"))
    out = quantize_draft(src, tmp_path / "q", progress=False).outdir
    a, b = _tensors(out), _tensors(builtin_dflash)
    assert sorted(a) == sorted(b)
    assert all(bits_equal(a[k], b[k]) for k in a)


def test_fp32_source_is_rounded_to_bf16_first(bf16_dflash, builtin_dflash, tmp_path):
    src = tmp_path / "fp32"
    shutil.copytree(bf16_dflash, src)
    tensors = load_file(str(src / "model.safetensors"))
    save_file({k: v.float() for k, v in tensors.items()}, str(src / "model.safetensors"))
    result = quantize_draft(src, tmp_path / "q", progress=False)
    assert any("rounded to bfloat16" in w for w in result.warnings)
    a, b = _tensors(result.outdir), _tensors(builtin_dflash)
    assert sorted(a) == sorted(b) and all(bits_equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------------------------------
# Refusals: every problem named
# ------------------------------------------------------------------------------------------


def test_refuses_a_quantized_draft(trained, tmp_path):
    with pytest.raises(QuantizeError, match="already quantized \\(W4A16_NVFP4\\)"):
        quantize_draft(trained.dflash, tmp_path / "q", progress=False)


def test_lists_missing_unexpected_and_misshaped_tensors(bf16_dflash, tmp_path):
    src = tmp_path / "broken"
    shutil.copytree(bf16_dflash, src)
    tensors = load_file(str(src / "model.safetensors"))
    del tensors["layers.1.mlp.up_proj.weight"]
    tensors["extra.weight"] = torch.zeros(2, 2, dtype=torch.bfloat16)
    tensors["fc.weight"] = tensors["fc.weight"][:, :32].contiguous()
    tensors["norm.weight"] = tensors["norm.weight"].to(torch.int32)
    save_file(tensors, str(src / "model.safetensors"))
    with pytest.raises(QuantizeError) as err:
        load_source(src)
    text = str(err.value)
    assert len(err.value.problems) == 4, text
    assert "missing tensor(s) the config implies: layers.1.mlp.up_proj.weight" in text
    assert "tensor(s) the config does not imply: extra.weight" in text
    assert "tensor fc.weight: shape [128, 32], the config implies [128, 768]" in text
    assert "tensor norm.weight: torch.int32, expected an unquantized float tensor" in text


def test_refuses_a_bad_config(bf16_dflash, tmp_path):
    src = tmp_path / "badcfg"
    shutil.copytree(bf16_dflash, src)
    cfg = _json(src / "config.json")
    cfg["num_hidden_layers"] = "six"
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(QuantizeError, match="config.json: .*num_hidden_layers"):
        load_source(src)


def test_out_must_be_new_or_forced(bf16_dflash, tmp_path):
    out = tmp_path / "q"
    quantize_draft(bf16_dflash, out, progress=False)
    with pytest.raises(QuantizeError, match="exists and is not empty; pass --force"):
        quantize_draft(bf16_dflash, out, progress=False)
    quantize_draft(bf16_dflash, out, force=True, progress=False)  # its own output: replaced
    assert (out / "model.safetensors").is_file()
    assert not list(tmp_path.glob(".q.*"))  # the temporary and the old directory are gone
    (out / "old.txt").write_text("x")  # not written by quantize: never deleted
    with pytest.raises(QuantizeError, match="holds old.txt, which this command did not write"):
        quantize_draft(bf16_dflash, out, force=True, progress=False)
    assert (out / "old.txt").read_text() == "x"
    with pytest.raises(QuantizeError, match="is the source; refusing"):
        quantize_draft(bf16_dflash, bf16_dflash, force=True, progress=False)


def test_cli_exit_status_2_names_the_problem(trained, tmp_path, capsys):
    from vllm_nemotron_spec.cli.main import main

    assert main(["quantize", str(trained.dflash), str(tmp_path / "q"), "--quiet"]) == 2
    assert "already quantized" in capsys.readouterr().err
    assert (
        main(
            [
                "quantize",
                str(trained.dflash_unquantized),
                str(tmp_path / "q"),
                "--quiet",
                "--max-shard-size",
                "lots",
            ]
        )
        == 2
    )
    assert "not a size: 'lots'" in capsys.readouterr().err


def test_cli_help_explains_layout_engines_and_environment(capsys):
    from vllm_nemotron_spec.cli.main import main

    with pytest.raises(SystemExit) as exit_:
        main(["quantize", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for needle in (
        "--engine {builtin,modelopt}",
        "--modelopt-python",
        "ITS OWN environment",
        "setuptools >= 80",
        "transformers < 5.15",
        ".venv-quantize",
        "scripts/install.sh --quantize",
        "markov_head.markov_w2",
        "markov_head.markov_w1",
        "hf_quant_config.json",
        "progress bar",
        "code 8 (-0)",
    ):
        assert needle in text, needle


def test_modelopt_engine_without_an_environment_says_how_to_get_one(
    bf16_dflash, tmp_path, monkeypatch
):
    from vllm_nemotron_spec.quantize import modelopt_engine
    from vllm_nemotron_spec.quantize.modelopt_engine import ModelOptUnavailable

    monkeypatch.delenv(modelopt_engine.PYTHON_ENV, raising=False)
    monkeypatch.setattr(modelopt_engine, "modelopt_importable", lambda: False)
    monkeypatch.setattr(modelopt_engine, "default_python", lambda: None)
    with pytest.raises(ModelOptUnavailable, match="scripts/install.sh --quantize"):
        quantize_draft(bf16_dflash, tmp_path / "q", "modelopt", progress=False)
    with pytest.raises(ModelOptUnavailable, match="does not exist"):
        quantize_draft(
            bf16_dflash,
            tmp_path / "q",
            "modelopt",
            modelopt_python=str(tmp_path / "nope" / "python"),
            progress=False,
        )
    assert not (tmp_path / "q").exists()
