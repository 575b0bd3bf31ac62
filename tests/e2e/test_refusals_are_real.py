"""The plugin refuses only what is wrong: a draft it refuses fails in vLLM without the check too,
and what it cannot check goes on with a line saying so.

The refusals of config and gamma are shown elsewhere (``test_dspark_engine``: more drafted tokens
than the block collapses acceptance, the wrong anchor layout collapses it; ``test_dflash_engine``:
the shifted layout is rejected). Here: a tensor whose header disagrees with the config.
"""

from __future__ import annotations

import json
import shutil
import types

import pytest

from vllm_nemotron_spec import runs, target_hook
from vllm_nemotron_spec.checkpoint import headers
from vllm_nemotron_spec.checkpoint.spec import DraftSpec, DraftSpecError

pytestmark = pytest.mark.engine


def _wrong_fc_draft(draft, out):
    from safetensors.torch import load_file, save_file

    shutil.copytree(draft, out)
    tensors = load_file(str(draft / "model.safetensors"))
    tensors["fc.weight"] = tensors["fc.weight"][:, :-8].contiguous()
    save_file(tensors, str(out / "model.safetensors"))
    return out


def test_a_refused_fc_shape_fails_loading_without_the_check_too(
    tiny_family, trained, tmp_path, monkeypatch
):
    draft = _wrong_fc_draft(trained.dspark, tmp_path / "wrong-fc")
    spec = {"method": "dspark", "model": str(draft), "num_speculative_tokens": 3}
    runs.set_cpu_engine_defaults()
    with pytest.raises(
        Exception, match=r"Nemotron 3\.5 draft .*`fc.weight`: found U8 \[128, 376\]"
    ):
        runs.make_llm(str(tiny_family.target), spec)  # vLLM wraps it in its config error
    # Without the header check (it finds nothing), loading fails on it anyway, later: the
    # tensor cannot fill the module the config describes.
    monkeypatch.setattr(
        headers, "check_tensors", lambda spec, tensors: headers.TensorCheck((), (), ())
    )
    with pytest.raises(Exception) as info:
        runs.make_llm(str(tiny_family.target), spec)
    assert "Nemotron 3.5 draft" not in str(info.value)
    assert "fc.weight" in str(info.value) and "[128, 376]" in str(info.value), repr(info.value)


def test_unreadable_headers_at_load_time_let_vllm_go_on_and_say_so(trained, tmp_path, caplog):
    """No weight file where the draft's headers should be: the load-time check cannot read
    them, says so in one warning, and hands every tensor on unchanged."""
    shutil.copytree(trained.dspark, tmp_path / "d", ignore=shutil.ignore_patterns("*.safetensors"))
    spec = DraftSpec.from_pretrained(tmp_path / "d")
    config = types.SimpleNamespace(
        model=str(tmp_path / "d"), revision=None, hf_config=types.SimpleNamespace()
    )
    items = [("a", 1), ("b", 2)]
    with caplog.at_level("WARNING"):
        assert list(target_hook.checked_weights(spec, config, iter(items))) == items
    assert "tensor headers NOT checked" in caplog.text
    # Checked at start-up: nothing is read again.
    setattr(config.hf_config, target_hook.WEIGHTS_CHECKED_ATTR, "local directory x")
    assert list(target_hook.checked_weights(spec, config, iter(items))) == items


def test_load_time_check_refuses_before_the_first_tensor(trained, tmp_path):
    draft = _wrong_fc_draft(trained.dspark, tmp_path / "wrong-fc")
    spec = DraftSpec.from_config(
        json.loads((draft / "config.json").read_text())
        | {"quantization_config": json.loads((draft / "hf_quant_config.json").read_text())}
    )
    config = types.SimpleNamespace(
        model=str(draft), revision=None, hf_config=types.SimpleNamespace()
    )
    handed = []

    def weights():
        for item in (("fc.weight", 0), ("norm.weight", 1)):
            handed.append(item)
            yield item

    stream = target_hook.checked_weights(spec, config, weights())
    with pytest.raises(DraftSpecError, match=r"Nemotron 3\.5 draft .*`fc\.weight`"):
        next(stream)
    assert handed == [("fc.weight", 0)]  # taken from vLLM's iterator, never handed on
