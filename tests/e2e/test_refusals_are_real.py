"""The plugin refuses only what is wrong: a draft it refuses fails in vLLM without the check too,
and what it cannot check goes on with a line saying so.

Shown here for each start-up refusal of a draft unlike its target (an aux id beyond its blocks,
another vocab size, an fc width unlike its hidden size) or unlike its own config (an fc tensor's
shape): with that check off, vLLM fails at load or on the first request. Gamma and layout
refusals are shown in ``test_dspark_engine`` / ``test_dflash_engine`` (acceptance collapses).
"""

from __future__ import annotations

import json
import shutil
import types

import pytest

from vllm_nemotron_spec import runs, target_hook
from vllm_nemotron_spec.checkpoint import check
from vllm_nemotron_spec.checkpoint import spec as spec_module
from vllm_nemotron_spec.checkpoint.spec import DraftSpec, DraftSpecError

pytestmark = pytest.mark.engine


def _changed_draft(draft, out, config=None, tensors=None):
    """A copy of ``draft`` with ``config(cfg)`` / ``tensors(dict)`` applied in place."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(draft, out)
    if config is not None:
        cfg = json.loads((out / "config.json").read_text())
        config(cfg)
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
    if tensors is not None:
        weights = load_file(str(out / "model.safetensors"))
        tensors(weights)
        save_file(weights, str(out / "model.safetensors"))
    return out


def _dspark(draft):
    return {"method": "dspark", "model": str(draft), "num_speculative_tokens": 3}


def _wrong_fc_draft(draft, out):
    def cut(weights):
        weights["fc.weight"] = weights["fc.weight"][:, :-8].contiguous()

    return _changed_draft(draft, out, tensors=cut)


def test_a_refused_fc_shape_fails_loading_without_the_check_too(
    tiny_family, trained, tmp_path, monkeypatch
):
    draft = _wrong_fc_draft(trained.dspark, tmp_path / "wrong-fc")
    spec = _dspark(draft)
    runs.set_engine_defaults()
    with pytest.raises(
        Exception, match=r"Nemotron 3\.5 draft .*`fc.weight`: found U8 \[128, 376\]"
    ):
        runs.make_llm(str(tiny_family.target), spec)  # vLLM wraps it in its config error
    # Without the header check (it finds nothing), loading fails on it anyway, later: the
    # tensor cannot fill the module the config describes.
    monkeypatch.setattr(check, "check_tensors", lambda spec, tensors: check.TensorCheck((), (), ()))
    with pytest.raises(Exception) as info:
        runs.make_llm(str(tiny_family.target), spec)
    assert "Nemotron 3.5 draft" not in str(info.value)
    assert "fc.weight" in str(info.value) and "[128, 376]" in str(info.value), repr(info.value)


PROMPTS = [{"prompt_token_ids": [1, 5, 17, 300, 9, 33]}]


def _refused_then_unchecked(target, spec, problem, monkeypatch):
    """The plugin refuses ``spec`` at start-up with the one target problem ``problem`` (a regex);
    afterwards the draft-against-target check finds nothing."""
    runs.set_engine_defaults()
    with pytest.raises(Exception, match=r"Nemotron 3\.5 draft .*target config: " + problem) as info:
        runs.make_llm(str(target), spec)  # vLLM wraps it in its config error
    assert str(info.value).count("target config:") == 1, repr(info.value)
    monkeypatch.setattr(spec_module, "check_against_target", lambda spec, target: ([], []))


def _first_request(target, spec):
    llm = runs.make_llm(str(target), spec)
    try:
        runs.generate(llm, PROMPTS, 4, "dspark")
    finally:
        runs.release(llm)


def test_an_aux_id_beyond_the_target_fails_the_first_request_without_the_check(
    tiny_family, trained, tmp_path, monkeypatch
):
    """Aux id 15 of a 14-block target: vLLM starts, collects 5 aux states, and the first request
    fails in the drafter (the refused id is never produced)."""

    def beyond(cfg):
        cfg["eagle_aux_hidden_state_layer_ids"][-1] = 15
        cfg["target_layer_ids"][-1] = cfg["dflash_config"]["target_layer_ids"][-1] = 14

    spec = _dspark(_changed_draft(trained.dspark, tmp_path / "aux", config=beyond))
    _refused_then_unchecked(
        tiny_family.target,
        spec,
        r"aux hidden state id 15 \(target_layer_ids\[5\] = 14, \+ 1\) is beyond the target's "
        r"14 blocks",
        monkeypatch,
    )
    with pytest.raises(
        ValueError, match=r"expects 768 concatenated aux hidden features but received 640"
    ):
        _first_request(tiny_family.target, spec)


@pytest.mark.parametrize(
    ("vocab", "error", "fails"),
    [
        (1008, r"Reduced-vocabulary Qwen3 DSpark checkpoints must include lm_head", "at load"),
        (1040, r"size of tensor a \(1024\) must match the size of tensor b \(1040\)", "drafting"),
    ],
    ids=["smaller", "larger"],
)
def test_a_vocab_size_unlike_the_target_fails_without_the_check(
    tiny_family, trained, tmp_path, monkeypatch, vocab, error, fails
):
    """A draft vocab (embedding and Markov head rows cut or repeated to match) unlike the
    target's 1024: vLLM takes a smaller one for a reduced vocab that lacks its lm_head; a larger
    one starts, and the first request fails adding the Markov bias to the target's logits."""
    import torch

    def config(cfg):
        cfg["vocab_size"] = vocab

    def tensors(weights):
        for name in (
            "embed_tokens.weight",
            "markov_head.markov_w1.weight",
            "markov_head.markov_w2.weight",
            "markov_head.markov_w2.weight_scale",
        ):
            rows = weights[name]
            weights[name] = torch.cat([rows, rows])[:vocab].contiguous()

    spec = _dspark(
        _changed_draft(trained.dspark, tmp_path / "vocab", config=config, tensors=tensors)
    )
    _refused_then_unchecked(
        tiny_family.target,
        spec,
        rf"`vocab_size`: the draft has {vocab} but the target has 1024",
        monkeypatch,
    )
    with pytest.raises((ValueError, RuntimeError), match=error):
        if fails == "at load":
            runs.make_llm(str(tiny_family.target), spec)
        else:
            _first_request(tiny_family.target, spec)


def test_an_fc_width_unlike_the_target_hidden_fails_the_first_request_without_the_check(
    tiny_family, trained, tmp_path, monkeypatch
):
    """``target_hidden_size`` 96 with an fc of 6 x 96 inputs, on a target of hidden size 128:
    without the config check and its repeat at model build, vLLM starts and the first request
    fails in the drafter."""
    from vllm_nemotron_spec.models import nemotron35_dspark

    def config(cfg):
        cfg["target_hidden_size"] = 96

    def tensors(weights):  # NVFP4: two values a byte, one scale per 16
        weights["fc.weight"] = weights["fc.weight"][:, : 6 * 96 // 2].contiguous()
        weights["fc.weight_scale"] = weights["fc.weight_scale"][:, : 6 * 96 // 16].contiguous()

    spec = _dspark(_changed_draft(trained.dspark, tmp_path / "fc", config=config, tensors=tensors))
    _refused_then_unchecked(
        tiny_family.target,
        spec,
        r"`target_hidden_size`: the draft's fc expects aux hidden states of width 96 but the "
        r"target's hidden_size is 128",
        monkeypatch,
    )
    monkeypatch.setattr(
        nemotron35_dspark, "check_built_model_matches_spec", lambda *args, **kwargs: None
    )
    with pytest.raises(
        ValueError, match=r"expects 576 concatenated aux hidden features but received 768"
    ):
        _first_request(tiny_family.target, spec)


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
