"""DSpark's Markov step, fused: base logits + NVFP4 low-rank bias + greedy argmax in one pass.

A DSpark draft step ``k`` is ``logits_k = U_k + markov_w2(markov_w1[prev])``, ``x_k =
argmax(logits_k)``, ``prev = x_k``, with ``markov_w1`` a BF16 embedding ``[V, r]`` and ``markov_w2``
an NVFP4 W4A16 linear ``r -> V`` as ModelOpt stores it (:mod:`vllm_nemotron_spec.nvfp4.format`).
vLLM's loop (``DSparkSpeculator._sample_sequential``) writes and rereads the ``[B, V]`` bias in 4+
launches a step; here one launch a step decodes ``markov_w2`` in registers tile by tile and keeps a
running (max, argmax) per row, so the bias never exists in memory and a walk is ``gamma + 1``
launches with no host synchronisation. Entry points: :func:`markov_greedy_step`,
:func:`markov_walk_greedy` (arithmetic and ties documented there), :func:`permute_w1_columns`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from vllm_nemotron_spec.nvfp4 import format as nvfp4

# ---------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------

try:  # Triton is a GPU dependency; CPU installs may lack it.
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - CPU installs without triton
    HAVE_TRITON = False

INT32_MAX = 2**31 - 1

# DOT_MODE: how the tile products run. 0: fp32 IEEE (fp32 embeddings; Triton's interpreter, whose
# bf16 dot is broken in Triton 3.9), 1: bf16 tensor cores, 2: fp16 tensor cores.
DOT_FP32, DOT_BF16, DOT_FP16 = 0, 1, 2

VARIANTS = ("bf16", "fp16", "fp16x2")
"""Kernel variants (``MarkovKernelConfig.variant``), by how ``markov_w2`` is decoded.

All three decoders are bit-exact: a code's 3 magnitude bits go to fp16 bits 11..9 and its sign to
bit 15, which is exactly the fp16 ``2^-14 * E2M1[code]`` (code 1 lands on the fp16 subnormal
2^-15); the ``2^14`` is folded into the global scale (a power of two: exact). The fp16 variants
multiply code and block scale in fp16: exact, since ``2^-14 * E2M1 * scale`` is a multiple of 2^-24
with at most 6 significant bits and at most 0.17.

* ``bf16``: byte by byte (two codes), times the fp32 block scale, rounded to bf16 (exact), bf16 dot
  with the bf16 embedding: products exact. About 26 SASS instructions a packed byte on sm_90.
* ``fp16``: 16-bit words (four codes), codes times the block scale in fp16 (exact), fp16 dot with
  the embedding rounded to fp16 (see :func:`markov_walk_greedy`). About 13-20 instructions a byte.
* ``fp16x2`` (the default): 32-bit words, two codes an integer op. About 13 instructions a byte
  with 128-byte chunks (no register spills); with one chunk over the rank (``block_k = r/2``, the
  default at batch 2..32) the embeddings are loaded once per program: about 9 a byte (close to
  the memory floor's budget of ~9 on an H200), but it takes all 255 registers and a few spill
  for some launch kinds. Batch 1 uses 64-byte chunks (see :func:`default_config`).

Instruction counts: loop bodies of the offline sm_90 build (Triton 3.9) divided by the bytes a
thread decodes per iteration; estimates, not measured times (the benchmark measures).
"""

if HAVE_TRITON:
    # Globals read inside @triton.jit functions must be constexpr.
    _IMAX = tl.constexpr(INT32_MAX)

    @triton.jit
    def _e4m3_to_f32(byte, NATIVE_FP8: tl.constexpr):
        """float8_e4m3fn bit pattern (uint8) -> fp32, exact. NATIVE_FP8: the hardware conversion
        (sm_89+; also Triton's interpreter); else from the bits (NaN codes 0x7F / 0xFF read +-480)."""
        if NATIVE_FP8:
            return byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            b = byte.to(tl.uint32)
            sign = (b >> 7) & 1
            exp = (b >> 3) & 15
            man = b & 7
            normal = ((sign << 31) | ((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
            sub = man.to(tl.float32) * 0.001953125  # 2^-9: subnormals man/8 * 2^-6
            sub = tl.where(sign == 1, -sub, sub)
            return tl.where(exp == 0, sub, normal)

    @triton.jit
    def _reduce_partials(val_ptr, idx_ptr, rows, row_ok, num_parts, PARTS_POW2: tl.constexpr):
        """Per row: index of the max over the programs' partial (max, argmax), lowest index among
        equal maxima; 0 for a row whose values are all -inf."""
        cols = tl.arange(0, PARTS_POW2)
        mask = row_ok[:, None] & (cols[None, :] < num_parts)
        offs = rows[:, None].to(tl.int64) * num_parts + cols[None, :]
        val = tl.load(val_ptr + offs, mask=mask, other=float("-inf"))
        idx = tl.load(idx_ptr + offs, mask=mask, other=_IMAX)
        best = tl.max(val, axis=1)
        cand = tl.where(mask & (val == best[:, None]), idx, _IMAX)
        tok = tl.min(cand, axis=1)
        return tl.where(tok == _IMAX, 0, tok)

    @triton.jit
    def _pack_max_key(val, idx):
        """(max, argmax) as one int64 whose signed order is (value, then LOWER index): the value's
        fp32 bits mapped to an order-preserving int32 in the high word, ``INT32_MAX - idx`` in the
        low word. -0.0 is taken as +0.0 (they are equal logits: the lower index must win)."""
        val = tl.where(val == 0.0, 0.0, val)
        bits = val.to(tl.int32, bitcast=True)
        ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        # tensor op first: constexpr - tensor stays a constexpr in Triton's interpreter
        return (ordered.to(tl.int64) << 32) | (-idx.to(tl.int64) + _IMAX)

    @triton.jit
    def _unpack_max_index(key):
        """The index of a packed key; 0 for a row whose values are all -inf (no program found
        a finite one: every program's index was the INT32_MAX sentinel)."""
        idx = -(key & 0xFFFFFFFF).to(tl.int32) + _IMAX
        return tl.where(idx == _IMAX, 0, idx)

    @triton.jit
    def _dot(w, e, acc, DOT_MODE: tl.constexpr):
        """acc += w @ e with fp32 accumulation (w [M, K], e [K, N])."""
        if DOT_MODE == 1:
            return tl.dot(w.to(tl.bfloat16), e.to(tl.bfloat16), acc)
        elif DOT_MODE == 2:
            return tl.dot(w.to(tl.float16), e.to(tl.float16), acc)
        else:
            return tl.dot(w.to(tl.float32), e.to(tl.float32), acc, input_precision="ieee")

    @triton.jit
    def _load_emb_phase(
        emb_cols, row_ok, w, PHASE: tl.constexpr, PHASES: tl.constexpr, R: tl.constexpr,
        W1_PERMUTED: tl.constexpr,
    ):  # fmt: skip
        """Embedding inputs ``PHASES * w + PHASE`` of each row, as [len(w), BLOCK_B]."""
        if W1_PERMUTED:  # columns grouped by phase: contiguous loads
            cols = PHASE * (R // PHASES) + w
        else:
            cols = PHASES * w + PHASE
        return tl.load(emb_cols[None, :] + cols[:, None], mask=row_ok[None, :], other=0.0)

    @triton.jit
    def _emb_fp16(emb_cols, row_ok, w, PHASE: tl.constexpr, R: tl.constexpr,
                  W1_PERMUTED: tl.constexpr, emb_scale):  # fmt: skip
        """Embedding phase PHASE of 8 (inputs 8w + PHASE), times emb_scale, as fp16 [len(w), BLOCK_B]."""
        e = _load_emb_phase(emb_cols, row_ok, w, PHASE, 8, R, W1_PERMUTED)
        return (e.to(tl.float32) * emb_scale).to(tl.float16)

    @triton.jit
    def _code_dot(bits, s16, e, acc, DOT_MODE: tl.constexpr):
        """acc += (fp16 codes in the low 16 bits of ``bits`` x block scales) @ e."""
        q = bits.to(tl.uint16).to(tl.float16, bitcast=True) * s16
        return _dot(q, e, acc, DOT_MODE)

    @triton.jit
    def _markov_tiles_kernel(
        base_ptr,  # U [B, V] (row stride stride_base), any float dtype
        stride_base,
        prev_ptr,  # previous token ids [B] (any int dtype; unused with PREV_FROM_PARTS)
        stride_prev,
        w1_ptr,  # markov_w1 [V1, R] (W1_PERMUTED: columns grouped by phase, see permute_w1_columns)
        stride_w1,
        w2_ptr,  # markov_w2 packed [V, R/2] as uint8 (VARIANT 0) or as uint16 words (VARIANT 1)
        stride_w2,  # in elements of that view
        sc_ptr,  # block scales as uint8 [V, R/16]
        stride_sc,
        gs_ptr,  # global scale: fp32 tensor with one element
        out_scale,  # fp32: multiplies the dot (bias_scale x 2^14 [x 1/emb_scale])
        emb_scale,  # fp32: VARIANT 1 multiplies the embedding by this before rounding it to fp16
        logits_ptr,  # corrected logits out [B, V] (WRITE_LOGITS)
        stride_logits,
        part_val_ptr,  # [B, num_parts] fp32: this launch's partial maxima
        part_idx_ptr,  # [B, num_parts] int32: their indices
        prev_val_ptr,  # previous step's partials (PREV_FROM_PARTS)
        prev_idx_ptr,
        keys_ptr,  # ATOMIC: int64 packed (max, argmax) [gamma, B], initialised to INT64_MIN
        key_col,  # ATOMIC: this step's slot (step * B); the previous step's is key_col - B
        tok_ptr,  # tokens [B, gamma]: the previous step's token goes to offset tok_col of a row
        stride_tok,
        tok_col,
        B,
        V,
        num_parts,
        R: tl.constexpr,  # markov rank
        BLOCK_B: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_K: tl.constexpr,  # packed BYTES a chunk (2 x BLOCK_K inputs)
        TILES: tl.constexpr,
        PARTS_POW2: tl.constexpr,
        PREV_FROM_PARTS: tl.constexpr,
        WRITE_LOGITS: tl.constexpr,
        DOT_MODE: tl.constexpr,
        VARIANT: tl.constexpr,
        W1_PERMUTED: tl.constexpr,
        NATIVE_FP8: tl.constexpr,
        GROUPS: tl.constexpr,  # BLOCK_K // 8: fp8 block scales (16 inputs = 8 bytes) a chunk
        HOIST: tl.constexpr,  # VARIANT 2 with BLOCK_K == R // 2: embeddings loaded once
        ATOMIC: tl.constexpr,  # reduce across programs by int64 atomic max instead of partials
    ):
        """One Markov step over ``TILES`` consecutive vocabulary tiles of ``BLOCK_V`` rows of
        ``markov_w2`` for ``BLOCK_B`` request rows: decodes the packed codes and fp8 block scales
        in registers, multiplies them with the rows' Markov embeddings on the tensor cores
        (transposed: the vocabulary tile is the dot's M, the rows its N), scales by the global
        scale, adds ``U`` and keeps a running (max, argmax) per row. The result goes into one int64
        slot per row and step by atomic max (``ATOMIC``) or into a partial that the next launch
        reduces; with ``PREV_FROM_PARTS`` the previous step's token is read from there (programs
        of vocabulary slice 0 also store it)."""
        pid_v = tl.program_id(0)
        pid_b = tl.program_id(1)
        rows = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
        row_ok = rows < B
        if PREV_FROM_PARTS:
            if ATOMIC:
                prev_key = tl.load(keys_ptr + (key_col - B) + rows, mask=row_ok, other=0)
                prev = _unpack_max_index(prev_key)
            else:
                prev = _reduce_partials(
                    prev_val_ptr, prev_idx_ptr, rows, row_ok, num_parts, PARTS_POW2
                )
            if pid_v == 0:
                tl.store(
                    tok_ptr + rows.to(tl.int64) * stride_tok + tok_col,
                    prev.to(tok_ptr.dtype.element_ty),
                    mask=row_ok,
                )
        else:
            prev = tl.load(prev_ptr + rows.to(tl.int64) * stride_prev, mask=row_ok, other=0)
        prev = prev.to(tl.int64)

        gs = tl.load(gs_ptr).to(tl.float32) * out_scale
        gg = tl.arange(0, GROUPS)
        vv = tl.arange(0, BLOCK_V)
        # Transposed ("swap AB"): the vocabulary tile is the dot's M, the request rows its N, so a
        # small batch wastes little of a tensor-core tile.
        emb_cols = w1_ptr + prev * stride_w1  # [BLOCK_B]
        base_cols = base_ptr + rows.to(tl.int64) * stride_base
        run_max = tl.full([BLOCK_B], float("-inf"), tl.float32)
        run_idx = tl.full([BLOCK_B], _IMAX, tl.int32)
        if HOIST:  # one chunk covers the rank: the rows' embeddings are loaded once, here
            wf = tl.arange(0, R // 8)
            f0 = _emb_fp16(emb_cols, row_ok, wf, 0, R, W1_PERMUTED, emb_scale)
            f1 = _emb_fp16(emb_cols, row_ok, wf, 1, R, W1_PERMUTED, emb_scale)
            f2 = _emb_fp16(emb_cols, row_ok, wf, 2, R, W1_PERMUTED, emb_scale)
            f3 = _emb_fp16(emb_cols, row_ok, wf, 3, R, W1_PERMUTED, emb_scale)
            f4 = _emb_fp16(emb_cols, row_ok, wf, 4, R, W1_PERMUTED, emb_scale)
            f5 = _emb_fp16(emb_cols, row_ok, wf, 5, R, W1_PERMUTED, emb_scale)
            f6 = _emb_fp16(emb_cols, row_ok, wf, 6, R, W1_PERMUTED, emb_scale)
            f7 = _emb_fp16(emb_cols, row_ok, wf, 7, R, W1_PERMUTED, emb_scale)
        for t in range(TILES):
            tile = pid_v * TILES + t
            v = tile * BLOCK_V + vv
            v_ok = v < V
            w_rows = w2_ptr + v * stride_w2  # int32 offsets: V * stride < 2^31 (checked)
            s_rows = sc_ptr + v * stride_sc
            acc = tl.zeros([BLOCK_V, BLOCK_B], dtype=tl.float32)
            for k0 in range(0, R // 2, BLOCK_K):
                sbyte = tl.load(
                    s_rows[:, None] + (k0 // 8 + gg)[None, :], mask=v_ok[:, None], other=0
                )
                scale = _e4m3_to_f32(sbyte, NATIVE_FP8)[:, :, None]  # [BLOCK_V, GROUPS, 1]
                if VARIANT == 0:
                    # byte j of the chunk holds inputs 2j (low nibble) and 2j + 1 (high nibble).
                    # fp16 bit trick: the 3 magnitude bits at fp16 bits 11..9 and the sign at 15
                    # give exactly 2^-14 x E2M1 (code 1: the fp16 subnormal 2^-15).
                    kk = tl.arange(0, BLOCK_K)
                    b = tl.load(w_rows[:, None] + (k0 + kk)[None, :], mask=v_ok[:, None], other=0)
                    b = b.to(tl.uint16)
                    lo = (((b << 9) & 0x0E00) | ((b << 12) & 0x8000)).to(tl.float16, bitcast=True)
                    hi = (((b << 5) & 0x0E00) | ((b << 8) & 0x8000)).to(tl.float16, bitcast=True)
                    lo = tl.reshape(lo.to(tl.float32), [BLOCK_V, GROUPS, 8]) * scale
                    hi = tl.reshape(hi.to(tl.float32), [BLOCK_V, GROUPS, 8]) * scale
                    w = k0 + kk
                    e0 = _load_emb_phase(emb_cols, row_ok, w, 0, 2, R, W1_PERMUTED)
                    e1 = _load_emb_phase(emb_cols, row_ok, w, 1, 2, R, W1_PERMUTED)
                    acc = _dot(tl.reshape(lo, [BLOCK_V, BLOCK_K]), e0, acc, DOT_MODE)
                    acc = _dot(tl.reshape(hi, [BLOCK_V, BLOCK_K]), e1, acc, DOT_MODE)
                elif VARIANT == 1:
                    # 16-bit word j of the chunk holds inputs 4j .. 4j + 3 (nibbles 0..3).
                    ww = tl.arange(0, BLOCK_K // 2)
                    h = tl.load(
                        w_rows[:, None] + (k0 // 2 + ww)[None, :], mask=v_ok[:, None], other=0
                    )
                    h = h.to(tl.uint16, bitcast=True)
                    q0 = (((h << 9) & 0x0E00) | ((h << 12) & 0x8000)).to(tl.float16, bitcast=True)
                    q1 = (((h << 5) & 0x0E00) | ((h << 8) & 0x8000)).to(tl.float16, bitcast=True)
                    q2 = (((h << 1) & 0x0E00) | ((h << 4) & 0x8000)).to(tl.float16, bitcast=True)
                    q3 = (((h >> 3) & 0x0E00) | (h & 0x8000)).to(tl.float16, bitcast=True)
                    s16 = scale.to(tl.float16)  # exact: e4m3 values are fp16 values
                    q0 = tl.reshape(
                        tl.reshape(q0, [BLOCK_V, GROUPS, 4]) * s16, [BLOCK_V, BLOCK_K // 2]
                    )
                    q1 = tl.reshape(
                        tl.reshape(q1, [BLOCK_V, GROUPS, 4]) * s16, [BLOCK_V, BLOCK_K // 2]
                    )
                    q2 = tl.reshape(
                        tl.reshape(q2, [BLOCK_V, GROUPS, 4]) * s16, [BLOCK_V, BLOCK_K // 2]
                    )
                    q3 = tl.reshape(
                        tl.reshape(q3, [BLOCK_V, GROUPS, 4]) * s16, [BLOCK_V, BLOCK_K // 2]
                    )
                    w = k0 // 2 + ww
                    e0 = _load_emb_phase(emb_cols, row_ok, w, 0, 4, R, W1_PERMUTED)
                    e1 = _load_emb_phase(emb_cols, row_ok, w, 1, 4, R, W1_PERMUTED)
                    e2 = _load_emb_phase(emb_cols, row_ok, w, 2, 4, R, W1_PERMUTED)
                    e3 = _load_emb_phase(emb_cols, row_ok, w, 3, 4, R, W1_PERMUTED)
                    e0 = (e0.to(tl.float32) * emb_scale).to(tl.float16)
                    e1 = (e1.to(tl.float32) * emb_scale).to(tl.float16)
                    e2 = (e2.to(tl.float32) * emb_scale).to(tl.float16)
                    e3 = (e3.to(tl.float32) * emb_scale).to(tl.float16)
                    acc = _dot(q0, e0, acc, DOT_MODE)
                    acc = _dot(q1, e1, acc, DOT_MODE)
                    acc = _dot(q2, e2, acc, DOT_MODE)
                    acc = _dot(q3, e3, acc, DOT_MODE)
                else:
                    # 32-bit word j of the chunk holds inputs 8j .. 8j + 7 (bytes 0..3, low nibble
                    # first). Each 32-bit op below decodes two codes at once (fp16 pairs: bytes 0/2
                    # in the low/high half, or bytes 1/3), so phase p of word j is input 8j + p.
                    ww = tl.arange(0, BLOCK_K // 4)
                    x = tl.load(
                        w_rows[:, None] + (k0 // 4 + ww)[None, :], mask=v_ok[:, None], other=0
                    )
                    x = x.to(tl.uint32, bitcast=True)
                    r0 = ((x << 9) & 0x0E000E00) | ((x << 12) & 0x80008000)  # inputs +0, +4
                    r1 = ((x << 5) & 0x0E000E00) | ((x << 8) & 0x80008000)  # +1, +5
                    r2 = ((x << 1) & 0x0E000E00) | ((x << 4) & 0x80008000)  # +2, +6
                    r3 = ((x >> 3) & 0x0E000E00) | (x & 0x80008000)  # +3, +7
                    s16 = tl.reshape(
                        tl.broadcast_to(scale.to(tl.float16), [BLOCK_V, GROUPS, 2]),
                        [BLOCK_V, BLOCK_K // 4],
                    )
                    if HOIST:
                        e0, e1, e2, e3, e4, e5, e6, e7 = f0, f1, f2, f3, f4, f5, f6, f7
                    else:
                        w = k0 // 4 + ww
                        e0 = _emb_fp16(emb_cols, row_ok, w, 0, R, W1_PERMUTED, emb_scale)
                        e1 = _emb_fp16(emb_cols, row_ok, w, 1, R, W1_PERMUTED, emb_scale)
                        e2 = _emb_fp16(emb_cols, row_ok, w, 2, R, W1_PERMUTED, emb_scale)
                        e3 = _emb_fp16(emb_cols, row_ok, w, 3, R, W1_PERMUTED, emb_scale)
                        e4 = _emb_fp16(emb_cols, row_ok, w, 4, R, W1_PERMUTED, emb_scale)
                        e5 = _emb_fp16(emb_cols, row_ok, w, 5, R, W1_PERMUTED, emb_scale)
                        e6 = _emb_fp16(emb_cols, row_ok, w, 6, R, W1_PERMUTED, emb_scale)
                        e7 = _emb_fp16(emb_cols, row_ok, w, 7, R, W1_PERMUTED, emb_scale)
                    acc = _code_dot(r0 & 0xFFFF, s16, e0, acc, DOT_MODE)
                    acc = _code_dot(r1 & 0xFFFF, s16, e1, acc, DOT_MODE)
                    acc = _code_dot(r2 & 0xFFFF, s16, e2, acc, DOT_MODE)
                    acc = _code_dot(r3 & 0xFFFF, s16, e3, acc, DOT_MODE)
                    acc = _code_dot(r0 >> 16, s16, e4, acc, DOT_MODE)
                    acc = _code_dot(r1 >> 16, s16, e5, acc, DOT_MODE)
                    acc = _code_dot(r2 >> 16, s16, e6, acc, DOT_MODE)
                    acc = _code_dot(r3 >> 16, s16, e7, acc, DOT_MODE)
            both_ok = v_ok[:, None] & row_ok[None, :]
            u = tl.load(base_cols[None, :] + v[:, None], mask=both_ok, other=0.0)
            logits = u.to(tl.float32) + acc * gs  # [BLOCK_V, BLOCK_B]
            logits = tl.where(v_ok[:, None], logits, float("-inf"))
            if WRITE_LOGITS:
                out_cols = logits_ptr + rows.to(tl.int64) * stride_logits
                tl.store(
                    out_cols[None, :] + v[:, None],
                    logits.to(logits_ptr.dtype.element_ty),
                    mask=both_ok,
                )
            tile_max = tl.max(logits, axis=0)
            tile_arg = tl.argmax(logits, axis=0, tie_break_left=True).to(tl.int32) + tile * BLOCK_V
            better = tile_max > run_max  # strict: an earlier tile keeps a tie
            run_max = tl.where(better, tile_max, run_max)
            run_idx = tl.where(better, tile_arg, run_idx)
        if ATOMIC:
            key = _pack_max_key(run_max, run_idx)
            slot = keys_ptr + key_col + rows
            # Most programs lose to the running maximum: read it first, skip the atomic then.
            current = tl.load(slot, mask=row_ok, other=0, volatile=True)
            tl.atomic_max(slot, key, mask=row_ok & (key > current), sem="relaxed")
        else:
            out = rows.to(tl.int64) * num_parts + pid_v
            tl.store(part_val_ptr + out, run_max, mask=row_ok)
            tl.store(part_idx_ptr + out, run_idx, mask=row_ok)

    @triton.jit
    def _markov_reduce_kernel(
        part_val_ptr,
        part_idx_ptr,
        tok_ptr,
        stride_tok,
        tok_col,
        B,
        num_parts,
        BLOCK_B: tl.constexpr,
        PARTS_POW2: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
        row_ok = rows < B
        tok = _reduce_partials(part_val_ptr, part_idx_ptr, rows, row_ok, num_parts, PARTS_POW2)
        tl.store(
            tok_ptr + rows.to(tl.int64) * stride_tok + tok_col,
            tok.to(tok_ptr.dtype.element_ty),
            mask=row_ok,
        )

    @triton.jit
    def _markov_keys_to_tokens_kernel(
        keys_ptr, tok_ptr, stride_tok, tok_col, B, BLOCK_B: tl.constexpr
    ):
        rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
        row_ok = rows < B
        tok = _unpack_max_index(tl.load(keys_ptr + rows, mask=row_ok, other=0))
        tl.store(
            tok_ptr + rows.to(tl.int64) * stride_tok + tok_col,
            tok.to(tok_ptr.dtype.element_ty),
            mask=row_ok,
        )


# ---------------------------------------------------------------------------------------------
# launch configuration
# ---------------------------------------------------------------------------------------------


REDUCTIONS = ("partials", "atomic")
"""How a step's programs combine their (max, argmax) per row (``MarkovKernelConfig.reduction``):

* ``partials``: each program writes its pair to a ``[B, programs]`` buffer; every program of the
  next step (and a last small kernel) reduces the whole row. Cost grows with programs x rows.
* ``atomic``: each program folds its pair into one int64 a row by ``atomic_max`` (value in the
  high word, ``INT32_MAX - index`` in the low word: ties keep the lowest index, as torch.argmax);
  the next step reads one int64 a row. One fill of the ``[gamma, B]`` slots a walk.
"""

INT64_MIN = -(2**63)


@dataclass(frozen=True)
class MarkovKernelConfig:
    """Launch parameters. ``block_b`` None: ``max(16, next_pow2(B))`` capped at 32 (one row block
    reads ``markov_w2`` once for all its rows; 64 spills registers on sm_90); ``tiles_per_program``
    None: about ``programs_per_sm`` programs per SM on CUDA (4 tiles a program elsewhere); more
    programs hide more memory latency when registers allow them to be resident together (with the
    ``partials`` reduction each program of the next step also reads more partials). ``block_k``: packed
    bytes a chunk (a multiple of 16 dividing r/2, at least 64 for fp16x2; capped at r/2).
    ``variant`` and ``emb_scale``: see :data:`VARIANTS`. Calls without a config use
    :func:`default_config`."""

    block_v: int = 64  # vocabulary rows a tile (the dot's M: 16 .. 256)
    block_k: int = 64
    tiles_per_program: int | None = None
    block_b: int | None = None
    num_warps: int = 4
    num_stages: int = 2
    variant: str = "fp16x2"
    emb_scale: float = 1.0
    programs_per_sm: int = 2
    reduction: str = "partials"  # or "atomic": see REDUCTIONS

    def resolve(
        self, batch: int, vocab: int, rank: int, device: torch.device
    ) -> "MarkovKernelConfig":
        if self.variant not in VARIANTS:
            raise ValueError(f"unknown kernel variant {self.variant!r}; choose from {VARIANTS}")
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"unknown reduction {self.reduction!r}; choose from {REDUCTIONS}")
        block_k = min(self.block_k, rank // 2)
        block_b = self.block_b
        if block_b is None:
            block_b = min(32, max(16, _next_pow2(batch)))
        tiles = self.tiles_per_program
        if tiles is None:
            num_tiles = _cdiv(vocab, self.block_v)
            sms = _num_sms(device)
            row_blocks = _cdiv(batch, block_b)
            tiles = max(1, num_tiles * row_blocks // (self.programs_per_sm * sms)) if sms else 4
        return replace(self, block_k=block_k, block_b=block_b, tiles_per_program=tiles)

    def num_programs(self, vocab: int) -> int:
        return _cdiv(_cdiv(vocab, self.block_v), self.tiles_per_program)

    @property
    def phases(self) -> int:
        """Embedding column phases of the variant (see :func:`permute_w1_columns`)."""
        return {"bf16": 2, "fp16": 4, "fp16x2": 8}[self.variant]


def default_config(batch: int, rank: int = 512) -> MarkovKernelConfig:
    """The launch parameters chosen for ``batch`` rows, from H200 measurements (benchmarks/RESULTS.md,
    "the Markov walk's launch configs and atomic reduction"): the atomic (max, argmax) reduction
    and about four programs an SM at every batch.

    More resident programs hide more of the memory latency of streaming ``markov_w2`` (the
    one-chunk config takes all 255 registers a thread on sm_90, so two programs an SM leave 8
    warps); with the partials reduction each extra program also made every program of the next
    step read more partials, which ate the gain beyond batch 1. With the atomic reduction, gamma-3
    walk, microseconds against one chunk with two programs an SM and the partials reduction, and
    vLLM 0.33's loop: batch 1 74.2 (79.8 / 121.0), 4 84.2 (116.6 / 132.7), 16 91.9 (128.2 / 195.3),
    32 114.5 (143.1 / 189.2).

    Batch 1: 128-row tiles in 64-byte chunks; batch 2..32: 64-row tiles, one chunk over the rank
    (``block_k = r/2``: the rows' embeddings are loaded once a program)."""
    r_half = rank // 2
    if r_half >= 64:  # the real head: r = 512
        variant, block_k = "fp16x2", r_half
    elif r_half >= 32:
        variant, block_k = "fp16", r_half
    else:  # tiny heads (tests)
        variant, block_k = "bf16", r_half
    if batch == 1 and variant == "fp16x2":
        return MarkovKernelConfig(variant=variant, block_b=16, block_v=128, block_k=64, num_warps=4,
                                  programs_per_sm=4, reduction="atomic")  # fmt: skip
    return MarkovKernelConfig(variant=variant, block_b=16 if batch <= 16 else 32, block_v=64, block_k=block_k,
                              num_warps=4, programs_per_sm=4, reduction="atomic")  # fmt: skip


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 0


def interpreting() -> bool:
    """Whether this module's kernels run in Triton's interpreter (TRITON_INTERPRET=1 was set
    before triton was first imported)."""
    return HAVE_TRITON and type(_markov_tiles_kernel).__name__ == "InterpretedFunction"


def _native_fp8(device: torch.device) -> bool:
    if interpreting() or device.type != "cuda":
        return True  # Triton's interpreter converts float8e4nv itself
    return torch.cuda.get_device_capability(device) >= (8, 9)


def permute_w1_columns(w1: torch.Tensor, phases: int) -> torch.Tensor:
    """``markov_w1`` with its columns grouped by phase (a copy), for ``w1_permuted=True``:
    ``out[:, p * r/phases + j] = w1[:, phases * j + p]``. The kernel then reads each phase of a
    row's embedding with contiguous loads. ``phases``: ``MarkovKernelConfig.phases`` (2 for the
    bf16 variant, 4 for fp16). Do it once, at weight-load time."""
    rank = w1.shape[1]
    if rank % phases:
        raise ValueError(f"rank {rank} is not a multiple of {phases}")
    return torch.cat([w1[:, p::phases] for p in range(phases)], dim=1).contiguous()


def _dot_mode(cfg: MarkovKernelConfig, emb_dtype: torch.dtype, device: torch.device) -> int:
    if interpreting() or device.type != "cuda":
        return DOT_FP32
    if cfg.variant in ("fp16", "fp16x2"):
        return DOT_FP16
    return DOT_BF16 if emb_dtype in (torch.bfloat16, torch.float16) else DOT_FP32


def _check_inputs(base_2d_shape, w1, w2_packed, w2_scale, w2_global, cfg: MarkovKernelConfig):
    if not HAVE_TRITON:
        raise RuntimeError("the fused Markov kernel needs triton")
    batch, vocab = base_2d_shape
    if w2_packed.dtype != torch.uint8 or w2_packed.dim() != 2:
        raise TypeError(
            f"w2_packed must be uint8 [V, r/2], got {w2_packed.dtype} {tuple(w2_packed.shape)}"
        )
    v2, r_half = w2_packed.shape
    rank = 2 * r_half
    if v2 != vocab:
        raise ValueError(f"markov_w2 has {v2} rows, base logits have vocab {vocab}")
    if tuple(w2_scale.shape) != (vocab, rank // nvfp4.GROUP_SIZE):
        raise ValueError(f"w2_scale shape {tuple(w2_scale.shape)}, expected {(vocab, rank // 16)}")
    if w2_scale.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise TypeError(f"w2_scale must be float8_e4m3fn (or its uint8 view), got {w2_scale.dtype}")
    if w1.dim() != 2 or w1.shape[1] != rank:
        raise ValueError(f"markov_w1 must be [V, {rank}], got {tuple(w1.shape)}")
    block_k = min(cfg.block_k, r_half)
    if r_half % 16 or block_k % 16 or r_half % block_k:
        raise ValueError(
            f"markov rank {rank}: r/2 must be a multiple of 16 and of block_k ({block_k}, itself a "
            f"multiple of 16)"
        )
    if cfg.block_v not in (16, 32, 64, 128, 256):
        raise ValueError(f"block_v must be a power of two in 16..256, got {cfg.block_v}")
    for name, t in (("w1", w1), ("w2_packed", w2_packed), ("w2_scale", w2_scale)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    word = {"bf16": 1, "fp16": 2, "fp16x2": 4}[cfg.variant]
    if w2_packed.stride(0) % word or w2_packed.data_ptr() % word:
        raise ValueError(
            f"the {cfg.variant} variant reads markov_w2 in {word}-byte words: row stride and offset "
            f"must be multiples of {word}"
        )
    min_k = {"bf16": 16, "fp16": 32, "fp16x2": 64}[cfg.variant]
    if block_k < min_k:
        raise ValueError(
            f"the {cfg.variant} variant needs block_k >= {min_k} (a dot's K of 16); rank {rank} "
            f"allows at most {r_half}: use {'bf16' if r_half < 32 else 'fp16'}"
        )
    if (
        w2_packed.shape[0] * w2_packed.stride(0) >= 2**31
        or w2_scale.shape[0] * w2_scale.stride(0) >= 2**31
    ):
        raise ValueError("markov_w2 is too large for the kernel's 32-bit offsets")
    if not torch.is_tensor(w2_global) or w2_global.numel() != 1:
        raise ValueError("w2_global must be a one-element tensor on the kernel's device")
    return batch, vocab, rank


def _global_scale_tensor(w2_global, device) -> torch.Tensor:
    if (
        torch.is_tensor(w2_global)
        and w2_global.device == device
        and w2_global.dtype == torch.float32
    ):
        return w2_global.reshape(1)
    # A host-to-device copy: pass a device tensor to keep the call CUDA-graph capturable.
    return torch.as_tensor(w2_global, dtype=torch.float32).reshape(1).to(device)


class _Launcher:
    """What the launches of one call share: resolved config, weight views, scalars."""

    def __init__(self, cfg0, batch, vocab, rank, w1, w2_packed, w2_scale, w2_global, bias_scale,
                 w1_permuted, device):  # fmt: skip
        self.cfg = cfg = cfg0.resolve(batch, vocab, rank, device)
        self.batch, self.vocab, self.rank = batch, vocab, rank
        self.w1 = w1
        self.w2 = w2_packed.view(
            {"bf16": torch.uint8, "fp16": torch.int16, "fp16x2": torch.int32}[cfg.variant]
        )
        self.scale = w2_scale.view(torch.uint8)
        self.gs = _global_scale_tensor(w2_global, device)
        out_scale = float(bias_scale) * 16384.0  # the E2M1 decoder's 2^-14
        self.emb_scale = float(cfg.emb_scale) if cfg.variant != "bf16" else 1.0
        self.out_scale = out_scale / self.emb_scale
        self.w1_permuted = bool(w1_permuted)
        self.dot_mode = _dot_mode(cfg, w1.dtype, device)
        self.native_fp8 = _native_fp8(device)
        self.num_parts = cfg.num_programs(vocab)
        self.atomic = cfg.reduction == "atomic"
        self.extra = (
            {} if interpreting() else {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
        )

    def partials(self, device):
        return (
            torch.empty(self.batch, self.num_parts, dtype=torch.float32, device=device),
            torch.empty(self.batch, self.num_parts, dtype=torch.int32, device=device),
        )

    def tiles(self, base_2d, prev_ids, logits_2d, parts, prev_parts, tokens, tok_col, keys, step):
        """One step's launch. ``parts``/``prev_parts``: this and the previous step's partials
        (``partials`` reduction); ``keys``: the walk's [gamma, B] slots (``atomic``)."""
        cfg = self.cfg
        prev_from_parts = step > 0
        prev_val, prev_idx = prev_parts if prev_parts is not None else parts
        prev_ptr = prev_ids if prev_ids is not None else tokens
        grid = (self.num_parts, _cdiv(self.batch, cfg.block_b))
        _markov_tiles_kernel[grid](
            base_2d, base_2d.stride(0),
            prev_ptr, prev_ptr.stride(0) if prev_ids is not None else 0,
            self.w1, self.w1.stride(0),
            self.w2, self.w2.stride(0),
            self.scale, self.scale.stride(0),
            self.gs, self.out_scale, self.emb_scale,
            logits_2d if logits_2d is not None else base_2d,
            logits_2d.stride(0) if logits_2d is not None else 0,
            parts[0], parts[1], prev_val, prev_idx, keys, step * self.batch,
            tokens, tokens.stride(0), tok_col,
            self.batch, self.vocab, self.num_parts,
            R=self.rank, BLOCK_B=cfg.block_b, BLOCK_V=cfg.block_v, BLOCK_K=cfg.block_k,
            TILES=cfg.tiles_per_program, PARTS_POW2=max(2, _next_pow2(self.num_parts)),
            PREV_FROM_PARTS=prev_from_parts, WRITE_LOGITS=logits_2d is not None,
            DOT_MODE=self.dot_mode, VARIANT=VARIANTS.index(cfg.variant),
            W1_PERMUTED=self.w1_permuted, NATIVE_FP8=self.native_fp8, GROUPS=cfg.block_k // 8,
            HOIST=cfg.variant == "fp16x2" and cfg.block_k == self.rank // 2, ATOMIC=self.atomic,
            **self.extra,
        )  # fmt: skip

    def reduce(self, parts, tokens, tok_col, keys, step):
        """The last step's tokens, from its partials or its key slots."""
        if self.atomic:
            _markov_keys_to_tokens_kernel[(_cdiv(self.batch, 128),)](
                keys[step], tokens, tokens.stride(0), tok_col, self.batch, BLOCK_B=128
            )
            return
        block_b = 16 if self.num_parts <= 1024 else 4
        _markov_reduce_kernel[(_cdiv(self.batch, block_b),)](
            parts[0], parts[1], tokens, tokens.stride(0), tok_col, self.batch, self.num_parts,
            BLOCK_B=block_b, PARTS_POW2=max(2, _next_pow2(self.num_parts)),
        )  # fmt: skip


def markov_greedy_step(
    base_logits: torch.Tensor,
    prev_ids: torch.Tensor,
    w1: torch.Tensor,
    w2_packed: torch.Tensor,
    w2_scale: torch.Tensor,
    w2_global: torch.Tensor,
    *,
    bias_scale: float = 1.0,
    logits_out: torch.Tensor | None = None,
    tokens_out: torch.Tensor | None = None,
    config: MarkovKernelConfig | None = None,
    w1_permuted: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One fused greedy Markov step: ``(tokens [B], logits_out or None)``.

    ``base_logits`` [B, V] (any float dtype, unit stride along V); ``prev_ids`` [B] (any int
    dtype); ``w1`` [V1, r] (bf16 on the GPU path); ``w2_packed`` uint8 [V, r/2]; ``w2_scale``
    float8_e4m3fn [V, r/16]; ``w2_global`` one-element fp32 tensor on the device. With
    ``logits_out`` [B, V] (fp32 recommended) the corrected logits ``U + bias`` are written as well
    (the draft distribution q for sampling: sample from them and pass the sampled ids as the next
    step's ``prev_ids``). ``tokens_out``: [B] int tensor to write (default: new int64).
    ``w1_permuted``: ``w1`` is :func:`permute_w1_columns` of markov_w1 with ``config.phases``.
    It is the walk of one step (:func:`markov_walk_greedy` on ``[B, 1, V]`` views)."""
    if base_logits.dim() != 2:
        raise ValueError(f"base_logits must be [B, V], got {tuple(base_logits.shape)}")
    batch, vocab = base_logits.shape
    if logits_out is not None and (
        tuple(logits_out.shape) != (batch, vocab) or logits_out.stride(-1) != 1
    ):
        raise ValueError(f"logits_out must be [{batch}, {vocab}] with unit stride along V")
    if tokens_out is None:
        tokens_out = torch.empty(batch, dtype=torch.int64, device=base_logits.device)
    markov_walk_greedy(
        base_logits[:, None], prev_ids, w1, w2_packed, w2_scale, w2_global, bias_scale=bias_scale,
        tokens_out=tokens_out[:, None], logits_out=None if logits_out is None else logits_out[:, None],
        config=config, w1_permuted=w1_permuted,
    )  # fmt: skip
    return tokens_out, logits_out


def markov_walk_greedy(
    base_logits: torch.Tensor,
    anchor_ids: torch.Tensor,
    w1: torch.Tensor,
    w2_packed: torch.Tensor,
    w2_scale: torch.Tensor,
    w2_global: torch.Tensor,
    *,
    bias_scale: float = 1.0,
    tokens_out: torch.Tensor | None = None,
    logits_out: torch.Tensor | None = None,
    config: MarkovKernelConfig | None = None,
    w1_permuted: bool = False,
) -> torch.Tensor:
    """The greedy Markov walk: ``gamma = base_logits.shape[1]`` fused steps from ``anchor_ids``.

    ``base_logits`` [B, gamma, V] (unit stride along V); ``anchor_ids`` [B] (the bonus token b of
    each request); returns ``tokens_out`` [B, gamma] (default new int64; may be a view such as
    ``DSparkSpeculator.draft_tokens[:num_reqs]``). ``logits_out`` [B, gamma, V]: also write every
    step's corrected logits (q for probabilistic verification of greedy drafts). ``config`` and
    ``w1_permuted``: as in :func:`markov_greedy_step`. ``gamma + 1`` launches (and a fill of the
    atomic reduction's slots), no host synchronisation (CUDA-graph capturable when ``w2_global``
    is a device tensor).

    Arithmetic (fp32 accumulation everywhere):

    * ``bf16``: products ``emb * w`` are exact (bf16 x bf16 into fp32). ``fp16``/``fp16x2``: the
      embedding is rounded to fp16 after multiplying by ``emb_scale`` (default 1): exact for
      magnitudes in [2^-14, 65504] (bf16 has fewer significant bits than fp16); smaller ones lose
      bits as fp16 subnormals (absolute error <= 2^-25 / emb_scale each, far below the fp32 sum's
      rounding), larger ones overflow (markov_w1 values are O(1)).
    * The sum over ``r`` is in fp32 in the tensor cores' order; the global scale (times
      ``bias_scale``, vLLM's LogitsProcessor scale) multiplies the sum once; ``U`` is added in fp32.
    * The plain-torch reference (``tiny/reference.py: markov_walk``, which the tests compare
      against) multiplies each weight by the global scale first (``format.dequantize``: one
      rounding per weight) and sums in torch's order. Both are fp32 sums of the same ``r``
      products up to those roundings: they differ by a few fp32 ulps of ``sum |emb * w|``.
    * Ties: argmax keeps the LOWEST index among equal maxima, within a tile (``tie_break_left``),
      across tiles (strict ``>``) and across programs (min index among the maxima), as
      ``torch.argmax``. Two logits that differ by less than the rounding difference above can
      come out in either order, so the fused kernel and any other implementation (the reference,
      vLLM's bf16 loop) can pick different tokens there: a property of fp32 sums in different
      orders, not a bug; tests use random data and check the reference's top-2 gap against the
      error bound.
    * A row whose logits are all ``-inf`` gives token 0 (as ``torch.argmax``). NaN logits are not
      handled (torch would return the NaN's index). Without native fp8 conversion (pre-sm_89) the
      fp8 decoder maps the e4m3 NaN codes (0x7F, 0xFF) to +-480; valid checkpoints have no NaN
      scales."""
    if base_logits.dim() != 3:
        raise ValueError(f"base_logits must be [B, gamma, V], got {tuple(base_logits.shape)}")
    batch, gamma, vocab = base_logits.shape
    cfg0 = config or default_config(batch, w1.shape[1])
    _, _, rank = _check_inputs((batch, vocab), w1, w2_packed, w2_scale, w2_global, cfg0)
    if base_logits.stride(-1) != 1:
        raise ValueError("base_logits must have unit stride along the vocabulary")
    device = base_logits.device
    launch = _Launcher(cfg0, batch, vocab, rank, w1, w2_packed, w2_scale, w2_global, bias_scale,
                       w1_permuted, device)  # fmt: skip
    if tokens_out is None:
        tokens_out = torch.empty(batch, gamma, dtype=torch.int64, device=device)
    if tuple(tokens_out.shape) != (batch, gamma):
        raise ValueError(f"tokens_out must be [{batch}, {gamma}], got {tuple(tokens_out.shape)}")
    if logits_out is not None and (
        tuple(logits_out.shape) != (batch, gamma, vocab) or logits_out.stride(-1) != 1
    ):
        raise ValueError(f"logits_out must be [{batch}, {gamma}, {vocab}] with unit stride along V")
    if launch.atomic:
        keys = torch.full((gamma, batch), INT64_MIN, dtype=torch.int64, device=device)
        parts = [(keys, keys)] * 2  # unused: the kernels are built without the partials code
    else:
        keys = tokens_out  # unused
        parts = [launch.partials(device) for _ in range(min(2, gamma))]
    col = tokens_out.stride(1)
    for k in range(gamma):
        launch.tiles(
            base_logits[:, k], anchor_ids if k == 0 else None,
            logits_out[:, k] if logits_out is not None else None,
            parts[k % 2], parts[(k - 1) % 2] if k else None, tokens_out, (k - 1) * col if k else 0,
            keys, k,
        )  # fmt: skip
    launch.reduce(parts[(gamma - 1) % 2], tokens_out, (gamma - 1) * col, keys, gamma - 1)
    return tokens_out
