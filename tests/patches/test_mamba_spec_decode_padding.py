"""The spec-decode padding patch: real vLLM schedulers (hybrid and attention-only KV-cache
configs) admitting a 1-token prompt while another request decodes, and a tripwire on the upstream
condition it rewrites (vLLM 0.32 here; 0.33.0's condition is the same)."""

from __future__ import annotations

import ast
import inspect
import textwrap
import types

import pytest

from vllm_nemotron_spec.patches import mamba_spec_decode_padding as patch

NUM_SPEC = 3
BLOCK = 16


def _original():
    from vllm.v1.core.sched.scheduler import Scheduler

    return getattr(Scheduler.schedule, "__wrapped__", Scheduler.schedule)


def test_tripwire_upstream_padding_condition():
    """Upstream's schedule() pads with exactly the condition this patch extends; when this fails,
    re-read scheduler.py's 'Pad new decode requests to uniform spec decoding size' and the Mamba
    builder (mamba_attn.py, 'padded_prompt_tail_rows') before updating PADDING_CONDITION."""
    source = inspect.getsource(_original())
    assert "Pad new decode requests to uniform spec decoding size" in source
    assert len(patch.find_padding_ifs(ast.parse(textwrap.dedent(source)))) == 1
    body = ast.parse(textwrap.dedent(source)).body[0]
    padded = [
        n
        for n in ast.walk(body)
        if isinstance(n, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "pad_spec_decode" for t in n.targets)
        and isinstance(n.value, ast.Constant)
        and n.value.value is True
    ]
    assert len(padded) == 1, "pad_spec_decode is set somewhere else too: review the patch"


def test_tripwire_mamba_builder_rolls_back_only_stateful_rows():
    """Why the clause is limited to num_computed_tokens == 0: vLLM routes padded rows WITH prior
    state to the decode kernels (which can roll drafts back), rows without it stay prefills."""
    from vllm.v1.attention.backends import mamba_attn

    source = inspect.getsource(mamba_attn)
    assert "has_prior_state = seq_lens_cpu > query_lens_cpu" in source
    assert "padded_prompt_tail_rows = (\n                stateful_prefill_rows" in source


def test_rewrite_changes_only_the_padding_condition():
    original = _original()
    patched = patch.rewrite_schedule(original)
    assert patched is not original
    assert patched.__code__.co_filename == original.__code__.co_filename
    assert patched.__code__.co_firstlineno == original.__code__.co_firstlineno
    assert patched.__globals__ is original.__globals__
    assert patched.__qualname__ == original.__qualname__
    assert patched.__defaults__ == original.__defaults__
    assert patched.__code__.co_varnames == original.__code__.co_varnames
    assert set(patched.__code__.co_names) - set(original.__code__.co_names) == {"has_mamba_layers"}
    # Dropping the appended clause gives back upstream's function, node for node.
    tree = patch.rewritten_source_tree(original)
    (node,) = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.If)
        and isinstance(n.test, ast.BoolOp)
        and ast.unparse(n.test.values[-1]) == patch.NO_PAD_WITHOUT_PRIOR_STATE
    ]
    node.test = node.test.values[0]
    upstream = ast.parse(textwrap.dedent(inspect.getsource(original)))
    assert ast.dump(tree.body[0]) == ast.dump(upstream.body[0])


def test_rewrite_refuses_what_it_does_not_know():
    def schedule(self):
        return None

    with pytest.raises(patch.PatchMismatch):
        patch.rewrite_schedule(schedule)
    with pytest.raises(patch.PatchMismatch):
        patch.rewrite_schedule(patch._schedule(_original(), _original()))  # someone's wrapper
    with pytest.raises(patch.PatchMismatch):  # the install records the patch as failed
        patch._schedule_with_rewrite(schedule)
    assert patch._schedule_with_rewrite(_original()).__wrapped__ is _original()


def test_dispatch_only_hybrid_with_spec_decode():
    calls = []
    wrapper = patch._schedule(lambda self: calls.append("vllm"), lambda self: calls.append("patch"))
    for has_mamba, k in ((True, 3), (True, 0), (False, 3), (False, 0)):
        wrapper(types.SimpleNamespace(has_mamba_layers=has_mamba, num_spec_tokens=k))
    assert calls == ["patch", "vllm", "vllm", "vllm"]


def test_applied_once():
    from vllm.v1.core.sched.scheduler import Scheduler

    patch.install()
    first = Scheduler.schedule
    patch.install()
    assert Scheduler.schedule is first
    assert first._nemotron_spec_patch
    assert first.__wrapped__.__code__.co_filename.endswith("v1/core/sched/scheduler.py")


# ------------------------------------------------------------------------------------------
# Real schedulers


@pytest.fixture(scope="module")
def vllm_config(tiny_family):
    """The tiny NemotronH target with ngram speculative decoding (k=3), as the engines use it."""
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=str(tiny_family.target),
        dtype="float32",
        enforce_eager=True,
        max_model_len=512,
        max_num_seqs=16,
        enable_prefix_caching=False,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": NUM_SPEC,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 2,
        },
    )
    config = args.create_engine_config()
    config.cache_config.num_gpu_blocks = 256
    return config


def _scheduler(vllm_config, hybrid: bool):
    """A real Scheduler whose KV-cache config has an attention group, plus a Mamba group when
    ``hybrid`` (what the scheduler knows of the model: ``kv_cache_config.has_mamba_layers``)."""
    import torch
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )
    from vllm.v1.structured_output import StructuredOutputManager

    attn = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float32)
    groups = [KVCacheGroupSpec(["attn.0"], attn)]
    if hybrid:
        mamba = MambaSpec(
            block_size=BLOCK,
            shapes=((2, 8),),
            dtypes=(torch.float32,),
            page_size_padded=attn.page_size_bytes,
        )
        groups.append(KVCacheGroupSpec(["mamba.0"], mamba))
    kv_cache_config = KVCacheConfig(num_blocks=256, kv_cache_tensors=[], kv_cache_groups=groups)
    scheduler = Scheduler(
        vllm_config, kv_cache_config, StructuredOutputManager(vllm_config), block_size=BLOCK
    )
    assert scheduler.has_mamba_layers is hybrid and scheduler.num_spec_tokens == NUM_SPEC
    return scheduler


def _request(request_id: str, prompt: list[int]):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=8, temperature=0.0)
    return Request(
        request_id=request_id, prompt_token_ids=prompt, sampling_params=params, pooling_params=None
    )


def _admit_one_token_prompt_while_decoding(scheduler, schedule, late=None):
    """Request "a" is prefilled and samples a token; then ``late`` (default: the 1-token prompt
    [1]) arrives and both are scheduled in one step. Returns (tokens, drafts) of "late"."""
    from vllm.v1.outputs import ModelRunnerOutput

    scheduler.add_request(_request("a", [1, 300, 301, 302]))
    first = schedule(scheduler)
    assert first.num_scheduled_tokens == {"a": 4}
    scheduler.update_from_output(
        first, ModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0}, sampled_token_ids=[[5]])
    )
    scheduler.add_request(late if late is not None else _request("late", [1]))
    out = schedule(scheduler)
    assert out.num_scheduled_tokens["a"] == 1  # no drafts were proposed for "a"
    return out.num_scheduled_tokens["late"], out.scheduled_spec_decode_tokens.get("late")


def test_hybrid_fresh_one_token_prompt_is_not_padded(vllm_config):
    patch.install()
    from vllm.v1.core.sched.scheduler import Scheduler

    got = _admit_one_token_prompt_while_decoding(_scheduler(vllm_config, True), Scheduler.schedule)
    assert got == (1, None)


def test_hybrid_without_the_patch_is_padded_with_placeholders(vllm_config):
    """The bug: vLLM's own function pads the fresh request to 1 + k rows of placeholder drafts
    (a tripwire too: when vLLM stops doing so, the patch can go)."""
    got = _admit_one_token_prompt_while_decoding(_scheduler(vllm_config, True), _original())
    assert got == (1 + NUM_SPEC, [-1] * NUM_SPEC)


def test_attention_only_model_is_still_padded(vllm_config):
    """Without Mamba layers the padding is harmless (rejected rows' KV is overwritten) and keeps
    the full CUDA graph: vLLM's path, untouched."""
    patch.install()
    from vllm.v1.core.sched.scheduler import Scheduler

    got = _admit_one_token_prompt_while_decoding(_scheduler(vllm_config, False), Scheduler.schedule)
    assert got == (1 + NUM_SPEC, [-1] * NUM_SPEC)


def test_hybrid_request_with_prior_state_is_still_padded(vllm_config):
    """A waiting request with computed tokens (a resumed one, or a KV-transfer prompt tail) has
    Mamba state; vLLM's decode kernels roll its placeholders back, so it keeps the padding."""
    patch.install()
    from vllm.v1.core.sched.scheduler import Scheduler

    late = _request("late", [1, 400, 401])
    late.num_computed_tokens = 2
    got = _admit_one_token_prompt_while_decoding(
        _scheduler(vllm_config, True), Scheduler.schedule, late
    )
    assert got == (1 + NUM_SPEC, [-1] * NUM_SPEC)
