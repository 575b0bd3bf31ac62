"""The DSpark draft step part by part at the real shapes, each against its memory-bandwidth floor.
Self-checking: exits 1 when the fused Markov walk disagrees with the fp32 reference.

GPU (H200, vLLM 0.33; about 2-4 minutes, most of it Triton compiles of the candidate kernels):
    python benchmarks/dspark_draft_kernels.py --out /tmp/dspark-kernels
CPU smoke test of every code path (tiny shapes; the Triton kernel runs in Triton's interpreter):
    python benchmarks/dspark_draft_kernels.py --smoke --out /tmp/dspark-kernels-smoke

Shapes (shared doc, "The drafts"): hidden 2688, vocab 131072, 6 layers, 32 q heads / 2 kv heads x
head_dim 128 (q [4096, 2688], k/v [256, 2688], o [2688, 4096]), MLP 6144 (SiLU, gate+up), fc
[2688, 6 x 2688], markov rank 512. For each batch B (requests) and gamma (drafted tokens; DSpark's
bonus-anchor layout has gamma + 1 query rows), the parts of one draft step:

* backbone: the GEMMs of the 6 layers at M = B * (gamma + 1): fc (NVFP4) and every layer's context
  K/V projection (bf16) at M_ctx = B * (gamma + 1) (an upper bound: accepted + bonus rows), and
  q/k/v (fused, bf16), o (bf16), gate_up (NVFP4) + SiLU-mul, down (NVFP4) at M_q. vLLM 0.33 layers
  (ReplicatedLinear / MergedColumnParallelLinear / RowParallelLinear); the NVFP4 ones with the
  plugin's W4A16 method (vLLM's FP4 Marlin kernel on Hopper). Attention, norms and RoPE are NOT
  timed. If the vLLM layers cannot be built, bf16 F.linear GEMMs of the same shapes are timed
  instead and the JSON says so (``backbone_kind``).
* lm_head: the target's bf16 lm_head [131072, 2688] at M = B * gamma (F.linear, as vLLM's
  unquantized head); also, for reference, the same head in NVFP4 (plugin ParallelLMHead, Marlin).
* markov walk (gamma sequential steps; greedy): (a) unfused bf16: dense dequantized markov_w2 in
  bf16, embedding + GEMM + add + argmax a step (what vLLM's loop does for an unquantized head);
  (a32) the same in fp32 (the verification reference); (b) vLLM 0.33's own path: its
  ``DSparkMarkovHead`` with vLLM's ModelOpt W4A16 config and ``LogitsProcessor``, the loop of
  ``DSparkSpeculator._sample_sequential``; (c) the plugin's fused kernel
  (``vllm_nemotron_spec.kernels.markov.markov_walk_greedy``), every candidate launch config, each
  verified token for token against (a32) (teacher-forced; a mismatch is accepted only at a near-tie
  whose top-2 gap is within the fp32 error bound) before it is timed; (c+q) the fused walk that also
  writes the corrected logits (fp32, for sampling).

Floors: bytes the part must move at least / ``--bandwidth`` (default 4.3e12 B/s; the H200's
nominal HBM3e peak is 4.8e12): weights once (bf16: 2 B, NVFP4: 0.5 + 1/16 B a weight), activations
in and out, the base logits read once and (c+q) the logits written. Timing: each part captured in a
CUDA graph (``--inner`` calls; eager if capture fails), warm-up, ``--reps`` replays timed with
CUDA events, median. Random data throughout (no checkpoint needed).

Writes result.json and result.md to --out (partial results after each part).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Shapes:
    hidden: int
    vocab: int
    rank: int
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    aux: int

    @property
    def q(self) -> int:
        return self.q_heads * self.head_dim

    @property
    def kv(self) -> int:
        return self.kv_heads * self.head_dim


REAL = Shapes(hidden=2688, vocab=131072, rank=512, layers=6, q_heads=32, kv_heads=2, head_dim=128,
              intermediate=6144, aux=6)  # fmt: skip
# rank 128: r/2 = 64 packed bytes, enough for every kernel variant
SMOKE = Shapes(hidden=64, vocab=1024, rank=128, layers=2, q_heads=4, kv_heads=2, head_dim=16,
               intermediate=128, aux=6)  # fmt: skip
QUANT_CONFIG = {"quant_method": "modelopt", "quant_algo": "W4A16_NVFP4", "group_size": 16}
NVFP4_BYTES_PER_WEIGHT = 0.5 + 1 / 16


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", required=True, help="directory for result.json and result.md")
    p.add_argument(
        "--smoke", action="store_true", help="tiny shapes; runs on CPU (Triton interpreter)"
    )
    p.add_argument("--device", choices=["cuda", "cpu"], default=None,
                   help="default: cuda, or cpu with --smoke when no GPU")  # fmt: skip
    p.add_argument(
        "--batches", default=None, help="comma-separated (default 1,2,4,8,16,32; smoke 1,2)"
    )
    p.add_argument("--gammas", default=None, help="comma-separated (default 3,7; smoke 3)")
    p.add_argument("--reps", type=int, default=None, help="timed samples (default 20; smoke 2)")
    p.add_argument("--inner", type=int, default=None, help="calls per sample (default 10; smoke 1)")
    p.add_argument("--bandwidth", type=float, default=4.3e12, help="B/s for the floors")
    p.add_argument("--parts", default="backbone,lm_head,markov", help="comma-separated subset")
    p.add_argument("--no-candidates", action="store_true",
                   help="time only the default fused config (skips the other launch configs)")  # fmt: skip
    p.add_argument("--sweep", action="store_true",
                   help="time the fused walk over a grid of launch configs (tile rows, warps, chunk "
                        "bytes, programs per SM, pipeline stages) instead of the few named candidates; "
                        "use with --parts markov and few batches (each config compiles once, ~1 s)")  # fmt: skip
    p.add_argument("--configs", default=None,
                   help="with --sweep: only these comma-separated config names (the default config "
                        "is always timed), e.g. v128-w4-k64-p4-s2,v128-w4-k64-p4-s2-atomic")  # fmt: skip
    return p.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.smoke and ARGS.device != "cuda":
    # Before anything imports triton: its interpreter must be chosen at first import.
    try:
        import torch as _t

        _cuda = _t.cuda.is_available()
    except Exception:  # pragma: no cover
        _cuda = False
    if not _cuda or ARGS.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from vllm_nemotron_spec.nvfp4 import format as nvfp4  # noqa: E402

# ---------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------


class Timer:
    """Median microseconds per call of ``fn`` (CUDA graph of ``inner`` calls + CUDA events on the
    GPU, eager perf_counter on the CPU)."""

    def __init__(self, device: torch.device, reps: int, inner: int):
        self.device, self.reps, self.inner = device, reps, inner

    def __call__(self, fn) -> tuple[float, str]:
        if self.device.type != "cuda":
            fn()
            samples = []
            for _ in range(self.reps):
                t0 = time.perf_counter()
                for _ in range(self.inner):
                    fn()
                samples.append((time.perf_counter() - t0) / self.inner)
            return statistics.median(samples) * 1e6, "cpu eager"
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph, how = None, "cuda graph"
        try:
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                fn()
                with torch.cuda.graph(graph, stream=stream):
                    for _ in range(self.inner):
                        fn()
            torch.cuda.current_stream().wait_stream(stream)
            graph.replay()
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - report and time eagerly
            print(f"    (CUDA graph capture failed: {type(exc).__name__}: {str(exc)[:200]}; eager)")
            graph, how = None, "eager"
            torch.cuda.synchronize()
        samples = []
        for _ in range(self.reps):
            start.record()
            if graph is not None:
                graph.replay()
            else:
                for _ in range(self.inner):
                    fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) * 1e3 / self.inner)
        del graph
        return statistics.median(samples), how


# ---------------------------------------------------------------------------------------------
# random weights
# ---------------------------------------------------------------------------------------------


def random_nvfp4(rows: int, cols: int, device, seed: int) -> nvfp4.NVFP4Weight:
    """A valid NVFP4 weight with random codes and block scales (speed does not depend on values)."""
    g = torch.Generator(device=device).manual_seed(seed)
    packed = torch.randint(0, 256, (rows, cols // 2), generator=g, device=device, dtype=torch.int32)
    scale = 64 + 384 * torch.rand(rows, cols // 16, generator=g, device=device)
    gs = torch.tensor(0.05 / (6 * 448), dtype=torch.float32)
    return nvfp4.NVFP4Weight(packed.to(torch.uint8), scale.to(torch.float8_e4m3fn), gs)


def quantized_gaussian(rows: int, cols: int, device, seed: int, std: float) -> nvfp4.NVFP4Weight:
    g = torch.Generator(device=device).manual_seed(seed)
    return nvfp4.quantize(std * torch.randn(rows, cols, generator=g, device=device))


# ---------------------------------------------------------------------------------------------
# vLLM layers
# ---------------------------------------------------------------------------------------------


def load_nvfp4(layer, shards: list[nvfp4.NVFP4Weight], merged: bool):
    for shard_id, q in enumerate(shards):
        for name, tensor in (("weight", q.weight), ("weight_scale", q.weight_scale),
                             ("weight_scale_2", q.weight_scale_2)):  # fmt: skip
            param = getattr(layer, name)
            if merged:
                param.weight_loader(param, tensor, shard_id)
            else:
                param.weight_loader(param, tensor)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def dense_layer(cls, *args, device, dtype, seed, **kw):
    layer = cls(*args, bias=False, quant_config=None, params_dtype=dtype, return_bias=False, **kw)
    g = torch.Generator(device=device).manual_seed(seed)
    layer.weight.data = (0.02 * torch.randn(layer.weight.shape, generator=g, device=device)).to(
        dtype
    )
    layer.quant_method.process_weights_after_loading(layer)
    return layer


class Backbone:
    """The draft's GEMMs (see the module doc), built from vLLM layers or plain bf16 weights."""

    def __init__(self, s: Shapes, device, dtype, qc):
        self.s, self.device, self.dtype = s, device, dtype
        self.kind = "vllm layers (NVFP4: plugin W4A16 method)"
        try:
            self._build_vllm(qc)
        except Exception as exc:  # noqa: BLE001
            print(
                f"  backbone: vLLM layers failed ({type(exc).__name__}: {exc}); bf16 F.linear instead"
            )
            self.kind = (
                f"bf16 F.linear (vLLM layers failed: {type(exc).__name__}: {str(exc)[:300]})"
            )
            self._build_plain()

    def _build_vllm(self, qc):
        from vllm.model_executor.layers.linear import (
            MergedColumnParallelLinear,
            ReplicatedLinear,
            RowParallelLinear,
        )

        s, dev, dt = self.s, self.device, self.dtype
        fc = ReplicatedLinear(s.aux * s.hidden, s.hidden, bias=False, quant_config=qc,
                              params_dtype=dt, return_bias=False, prefix="bench.fc")  # fmt: skip
        self.fc = load_nvfp4(fc, [random_nvfp4(s.hidden, s.aux * s.hidden, dev, 1)], merged=False)
        self.layers = []
        for i in range(s.layers):
            kv = dense_layer(ReplicatedLinear, s.hidden, 2 * s.kv, device=dev, dtype=dt, seed=10 + i,
                             prefix=f"bench.{i}.kv")  # fmt: skip
            qkv = dense_layer(ReplicatedLinear, s.hidden, s.q + 2 * s.kv, device=dev, dtype=dt,
                              seed=20 + i, prefix=f"bench.{i}.qkv")  # fmt: skip
            o = dense_layer(ReplicatedLinear, s.q, s.hidden, device=dev, dtype=dt, seed=30 + i,
                            prefix=f"bench.{i}.o")  # fmt: skip
            gu = MergedColumnParallelLinear(s.hidden, [s.intermediate] * 2, bias=False, quant_config=qc,
                                            params_dtype=dt, return_bias=False,
                                            prefix=f"bench.{i}.gate_up")  # fmt: skip
            gu = load_nvfp4(gu, [random_nvfp4(s.intermediate, s.hidden, dev, 40 + i),
                                 random_nvfp4(s.intermediate, s.hidden, dev, 50 + i)], merged=True)  # fmt: skip
            down = RowParallelLinear(s.intermediate, s.hidden, bias=False, quant_config=qc, params_dtype=dt,
                                     return_bias=False, prefix=f"bench.{i}.down")  # fmt: skip
            down = load_nvfp4(
                down, [random_nvfp4(s.hidden, s.intermediate, dev, 60 + i)], merged=False
            )
            self.layers.append((kv, qkv, o, gu, down))

    def _build_plain(self):
        s, dev, dt = self.s, self.device, self.dtype

        def lin(n_out, n_in, seed):
            g = torch.Generator(device=dev).manual_seed(seed)
            w = (0.02 * torch.randn(n_out, n_in, generator=g, device=dev)).to(dt)
            return lambda x, w=w: F.linear(x, w)

        self.fc = lin(s.hidden, s.aux * s.hidden, 1)
        self.layers = [
            (
                lin(2 * s.kv, s.hidden, 10 + i),
                lin(s.q + 2 * s.kv, s.hidden, 20 + i),
                lin(s.hidden, s.q, 30 + i),
                lin(2 * s.intermediate, s.hidden, 40 + i),
                lin(s.hidden, s.intermediate, 60 + i),
            )  # fmt: skip
            for i in range(s.layers)
        ]

    def step_fn(self, m_q: int, m_ctx: int):
        s, dev, dt = self.s, self.device, self.dtype
        g = torch.Generator(device=dev).manual_seed(m_q)
        x_ctx = torch.randn(m_ctx, s.aux * s.hidden, generator=g, device=dev).to(dt)
        x = torch.randn(m_q, s.hidden, generator=g, device=dev).to(dt)
        attn = torch.randn(m_q, s.q, generator=g, device=dev).to(dt)  # stands for attention output
        inter = s.intermediate

        def step():
            ctx = self.fc(x_ctx)
            for kv, qkv, o, gu, down in self.layers:
                kv(ctx)
                qkv(x)
                o(attn)
                y = gu(x)
                down(F.silu(y[:, :inter]) * y[:, inter:])

        return step

    def floor_bytes(self, m_q: int, m_ctx: int) -> int:
        s = self.s
        nv = NVFP4_BYTES_PER_WEIGHT
        w = s.hidden * s.aux * s.hidden * nv
        act = m_ctx * (s.aux * s.hidden + s.hidden) * 2
        for _ in range(s.layers):
            w += (s.q + 2 * s.kv) * s.hidden * 2 + s.q * s.hidden * 2  # k/v weights counted once
            w += 3 * s.intermediate * s.hidden * nv
            act += m_ctx * (s.hidden + 2 * s.kv) * 2
            act += m_q * (s.hidden + s.q + 2 * s.kv + s.q + s.hidden + s.hidden + 2 * s.intermediate
                          + 2 * s.intermediate + s.hidden) * 2  # fmt: skip
        return int(w + act)


# ---------------------------------------------------------------------------------------------
# Markov walks
# ---------------------------------------------------------------------------------------------


class MarkovSetup:
    """markov_w1 / markov_w2 at the shapes, in every form the variants need."""

    def __init__(self, s: Shapes, device, dtype, qc_plugin, mk):
        self.s, self.device, self.dtype, self.mk = s, device, dtype, mk
        g = torch.Generator(device=device).manual_seed(7)
        self.w1 = (0.5 * torch.randn(s.vocab, s.rank, generator=g, device=device)).to(dtype)
        self._w1_by_phase: dict[int, torch.Tensor] = {}
        self.q = quantized_gaussian(s.vocab, s.rank, device, seed=8, std=0.05)
        self.gs = self.q.weight_scale_2.reshape(1).to(torch.float32).to(device)
        self.w2_f32 = nvfp4.dequantize(
            self.q.weight, self.q.weight_scale, self.gs, dtype=torch.float32
        )
        self.w2_bf16 = self.w2_f32.to(dtype)
        self.vllm_head, self.vllm_lp, self.vllm_kind = self._vllm_head(qc_plugin)

    def _vllm_head(self, qc_plugin):
        """vLLM's DSparkMarkovHead with vLLM's own ModelOpt W4A16 config (fallback: the plugin's)."""
        from vllm.model_executor.layers.logits_processor import LogitsProcessor
        from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config
        from vllm.model_executor.models.qwen3_dspark import DSparkMarkovHead

        s = self.s
        errors = []
        for name, make_qc in (("vLLM ModelOptNvFp4Config (W4A16_NVFP4)",
                               lambda: ModelOptNvFp4Config.from_config(QUANT_CONFIG)),
                              ("plugin nemotron_w4a16_nvfp4 (same Marlin kernel on GPU)",
                               lambda: qc_plugin)):  # fmt: skip
            try:
                # vLLM builds models with the model dtype as torch's default dtype
                previous = torch.get_default_dtype()
                torch.set_default_dtype(self.dtype)
                try:
                    with torch.device(self.device):
                        head = DSparkMarkovHead(s.vocab, s.vocab, s.rank, prefix="markov_head",
                                                quant_config=make_qc())  # fmt: skip
                finally:
                    torch.set_default_dtype(previous)
                head.markov_w1.weight.data = self.w1.clone()
                load_nvfp4(head.markov_w2, [self.q], merged=False)
                head = head.to(self.device)
                lp = LogitsProcessor(s.vocab)
                emb = head.embed(torch.zeros(2, dtype=torch.long, device=self.device))
                bias = head.bias(emb, lp)
                assert tuple(bias.shape) == (2, s.vocab), tuple(bias.shape)
                kind = name + (f" [first choice failed: {errors[0]}]" if errors else "")
                return head, lp, kind
            except Exception as exc:  # noqa: BLE001
                errors.append(f"{type(exc).__name__}: {str(exc)[:300]}")
                print(f"  markov (b) with {name} failed: {errors[-1]}")
        return None, None, "unavailable: " + " | ".join(errors)

    # -- the walks (each writes tokens [B, gamma]) --

    def walk_unfused(self, U, anchor, tokens, fp32: bool):
        w2 = self.w2_f32 if fp32 else self.w2_bf16
        prev = anchor
        for k in range(U.shape[1]):
            emb = F.embedding(prev, self.w1)
            if fp32:
                logits = U[:, k].float() + emb.float() @ w2.T
            else:
                logits = U[:, k] + F.linear(emb, w2)
            prev = logits.argmax(dim=-1)
            tokens[:, k] = prev

    def walk_vllm(self, U, anchor, tokens):
        head, lp = self.vllm_head, self.vllm_lp
        prev = anchor
        for k in range(U.shape[1]):  # DSparkSpeculator._sample_sequential, greedy
            emb = head.embed(prev)
            logits = U[:, k] + head.bias(emb, lp)
            prev = logits.argmax(dim=-1)
            tokens[:, k] = prev

    def w1_by_phase(self, phases: int) -> torch.Tensor:
        """markov_w1 grouped by the kernel's phases, as the engine keeps it at load for the walk."""
        if phases not in self._w1_by_phase:
            self._w1_by_phase[phases] = self.mk.permute_w1_columns(self.w1, phases)
        return self._w1_by_phase[phases]

    def walk_fused(self, U, anchor, tokens, cfg, logits_out=None):
        self.mk.markov_walk_greedy(
            U, anchor, self.w1_by_phase(cfg.phases), self.q.weight, self.q.weight_scale, self.gs,
            tokens_out=tokens, logits_out=logits_out, config=cfg, w1_permuted=True,
        )  # fmt: skip

    # -- verification against the fp32 reference, teacher-forced --

    def check(self, U, anchor, tokens) -> dict:
        """Each step's token against argmax of the fp32 reference given the same previous token.
        A mismatch is a near-tie when the reference's gap between its token and ours is within
        the fp32 error bound of both implementations."""
        s = self.s
        mismatches = near_ties = 0
        prev = anchor.long()
        for k in range(U.shape[1]):
            emb = self.w1[prev].float()
            logits = U[:, k].float() + emb @ self.w2_f32.T
            ref = logits.argmax(dim=-1)
            got = tokens[:, k]
            bad = (got != ref).nonzero().flatten().tolist()
            if bad:
                absdot = emb.abs() @ self.w2_f32.abs().T
                bound = (s.rank + 4) * 2.0**-24 * absdot + 2.0**-24 * logits.abs()
                for b in bad:
                    r, t = int(ref[b]), int(got[b])
                    gap = float(logits[b, r] - logits[b, t])
                    tol = 2 * float(bound[b, r] + bound[b, t])
                    if gap <= tol:
                        near_ties += 1
                    else:
                        mismatches += 1
            prev = got.long()
        return {
            "steps": int(U.shape[0] * U.shape[1]),
            "mismatches": mismatches,
            "near_ties": near_ties,
        }

    def walk_floor_bytes(self, batch: int, gamma: int, weights: str, logits_bytes: int = 0) -> int:
        s = self.s
        w = s.vocab * s.rank * (2 if weights == "bf16" else NVFP4_BYTES_PER_WEIGHT)
        per_step = w + batch * s.rank * 2 + batch * s.vocab * (2 + logits_bytes)
        return int(gamma * per_step)


def sweep_configs(mk, s: Shapes, batch: int, only: list[str] | None = None) -> dict:
    """The --sweep grid for ``batch`` rows (fp16x2; named v<rows>-w<warps>-k<bytes>-p<programs per
    SM>-s<stages>[-atomic]). Register use on sm_90 bounds which ones can keep more than 8 warps an
    SM busy; "-atomic" reduces the programs' (max, argmax) by int64 atomic max, so more programs
    do not cost every program more partials to read. ``only``: keep these names (and the default)."""
    default = mk.default_config(batch, s.rank)
    r_half = s.rank // 2
    out = {"default": default}
    for v, w, k, pps, st in (
        [(v, w, k, p, 2) for v in (64, 128) for w in (4, 8) for k in (64, 128, 256) for p in (2, 4)]
        + [(32, 8, 64, 2, 2), (32, 8, 64, 4, 2), (32, 4, 128, 3, 2), (64, 4, 64, 3, 2)]
        + [(v, w, 64, p, st) for v in (64, 128) for w in (4, 8) for p in (2, 4) for st in (3, 4)]
    ):
        if k > r_half:
            continue
        cfg = replace(default, block_v=v, num_warps=w, block_k=k, programs_per_sm=pps, num_stages=st,
                      reduction="partials")  # fmt: skip
        if cfg != default:  # the default is timed once, under its own name
            out[f"v{v}-w{w}-k{k}-p{pps}-s{st}"] = cfg
    for v, w, k, pps in ((64, 4, 256, 2), (64, 4, 256, 4), (128, 4, 64, 2), (128, 4, 64, 4), (64, 4, 64, 4),
                         (128, 8, 256, 2), (128, 8, 256, 4), (128, 4, 128, 4)):  # fmt: skip
        cfg = replace(default, block_v=v, num_warps=w, block_k=k, programs_per_sm=pps, num_stages=2,
                      reduction="atomic")  # fmt: skip
        if k <= r_half and cfg != default:
            out[f"v{v}-w{w}-k{k}-p{pps}-s2-atomic"] = cfg
    if only is not None:
        unknown = sorted(set(only) - set(out))
        if unknown:
            raise SystemExit(f"--configs: unknown names {unknown}; the grid has {sorted(out)}")
        out = {name: cfg for name, cfg in out.items() if name == "default" or name in only}
    return out


def fused_candidates(mk, s: Shapes, batch: int, only_default: bool, smoke: bool = False, sweep: bool = False,
                     only: list[str] | None = None):  # fmt: skip
    """Launch configs to try for ``batch`` rows: the default first."""
    default = mk.default_config(batch, s.rank)
    if only_default:
        return {"default": default}
    if sweep and not smoke:
        return sweep_configs(mk, s, batch, only)
    r_half = s.rank // 2
    out = {"default": default}
    bb = default.block_b
    # the earlier default: partials reduction, two programs an SM
    previous = mk.MarkovKernelConfig(variant=default.variant, block_b=bb, block_v=64 if bb == 16 else 128,
                                     block_k=r_half, num_warps=4 if bb == 16 else 8)  # fmt: skip
    out["previous-default-partials"] = previous
    if smoke:  # the interpreter is slow: one other variant
        out["bf16-v64-k32"] = mk.MarkovKernelConfig(
            variant="bf16", block_b=bb, block_v=64, block_k=32
        )
        return out
    if r_half % 64 == 0 and r_half <= 256 and default.block_k != r_half:
        out["fp16x2-onechunk"] = replace(
            default, block_k=r_half
        )  # embeddings hoisted (spills a bit)
    out["fp16x2-v128-w8"] = replace(default, block_v=128, num_warps=8)
    out["fp16-v128-k128"] = mk.MarkovKernelConfig(variant="fp16", block_b=bb, block_v=128,
                                                  block_k=min(128, r_half), num_warps=8)  # fmt: skip
    out["bf16-v128-k64"] = mk.MarkovKernelConfig(variant="bf16", block_b=bb, block_v=128,
                                                 block_k=min(64, r_half), num_warps=8)  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------
# environment and output
# ---------------------------------------------------------------------------------------------


def environment(device: torch.device, args) -> dict:
    env = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": device.type,
        "bandwidth_B_per_s": args.bandwidth,
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
    }
    try:
        import vllm

        env["vllm"] = getattr(vllm, "__version__", "?")
    except Exception as exc:  # noqa: BLE001
        env["vllm"] = f"import failed: {exc}"
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        env["triton"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda,
                   capability=".".join(map(str, torch.cuda.get_device_capability(device))),
                   sms=props.multi_processor_count, gpu_memory_gib=round(props.total_memory / 2**30, 1))  # fmt: skip
        try:
            env["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20,
            ).stdout.strip().splitlines()[0]  # fmt: skip
        except Exception as exc:  # noqa: BLE001
            env["driver"] = f"unknown ({type(exc).__name__})"
    else:
        env.update(
            cpu=platform.processor() or platform.machine(), torch_threads=torch.get_num_threads()
        )
    return env


def init_vllm(device: torch.device):
    from nvfp4_linear import init_vllm as _init  # the H200-proven initialisation

    _init(device.type)


def markdown(result: dict) -> str:
    env = result["environment"]
    lines = ["# DSpark draft step: parts against their memory-bandwidth floors", ""]
    lines += [f"- {k}: {v}" for k, v in env.items()]
    lines += [f"- shapes: {result['shapes']}", f"- backbone: {result.get('backbone_kind')}",
              f"- markov (b): {result.get('vllm_markov_kind')}", ""]  # fmt: skip
    status = "PASS" if result["ok"] else "FAIL"
    lines += [f"**{status}**", ""] + [f"- FAIL: {f}" for f in result["failures"]] + [""]
    lines += ["| part | B | gamma | M | us | floor us | ratio | timing | notes |",
              "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in result["rows"]:
        if "us" not in r:
            lines.append(
                f"| {r['part']} | {r['batch']} | {r['gamma']} | | error | | | | {r.get('error', '')[:120]} |"
            )
            continue
        lines.append(
            f"| {r['part']} | {r['batch']} | {r['gamma']} | {r.get('m', '')} | {r['us']:.1f} | "
            f"{r['floor_us']:.1f} | {r['ratio']:.2f} | {r['timing']} | {r.get('notes', '')} |"
        )
    fused = [r for r in result["rows"] if r["part"].startswith("markov (c) fused") and "us" in r
             and not r["part"].endswith("BEST")]  # fmt: skip
    if len(fused) > 8:  # a sweep: the fastest launch configs of each shape
        lines += ["", "Fastest fused launch configs per shape (us; vs the default config):", ""]
        for key in sorted({(r["batch"], r["gamma"]) for r in fused}):
            rows = sorted(
                (r for r in fused if (r["batch"], r["gamma"]) == key), key=lambda r: r["us"]
            )
            default = next((r["us"] for r in rows if r["part"].endswith(" default")), None)
            ranked = ", ".join(
                f"{r['part'].removeprefix('markov (c) fused ')} {r['us']:.1f}"
                + (f" ({default / r['us']:.2f}x)" if default else "")
                for r in rows[:6]
            )
            lines.append(f"- B={key[0]} gamma={key[1]}: {ranked}; default {default:.1f}" if default else
                         f"- B={key[0]} gamma={key[1]}: {ranked}")  # fmt: skip
    totals = result.get("step_totals") or []
    if totals:
        lines += ["", "Draft step totals (backbone + bf16 lm_head + Markov walk), us:", "",
                  "| B | gamma | with (b) vLLM | with (c) fused | with (a) bf16 unfused | Markov share (b) -> (c) |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        for t in totals:
            lines.append(
                f"| {t['batch']} | {t['gamma']} | {t.get('total_vllm_us', float('nan')):.1f} | "
                f"{t.get('total_fused_us', float('nan')):.1f} | {t.get('total_unfused_bf16_us', float('nan')):.1f} | "
                f"{t.get('markov_share_vllm', float('nan')):.0%} -> {t.get('markov_share_fused', float('nan')):.0%} |"
            )
    return "\n".join(lines) + "\n"


def main() -> int:
    args = ARGS if ARGS is not None else parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device(
        args.device or ("cuda" if cuda and not (args.smoke and not cuda) else "cpu")
    )
    if device.type == "cuda" and not cuda:
        raise SystemExit("--device cuda but no GPU")
    if device.type == "cpu" and not args.smoke:
        print("warning: real shapes on CPU (the Triton interpreter) take very long; use --smoke")
    s = SMOKE if args.smoke else REAL
    batches = [
        int(b) for b in (args.batches or ("1,2" if args.smoke else "1,2,4,8,16,32")).split(",")
    ]
    gammas = [int(g) for g in (args.gammas or ("3" if args.smoke else "3,7")).split(",")]
    reps = args.reps or (2 if args.smoke else 20)
    inner = args.inner or (1 if args.smoke else 10)
    parts = set(args.parts.split(","))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = torch.bfloat16
    if device.type == "cuda":
        torch.cuda.set_device(device if device.index is not None else 0)
        torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference stays fp32
    timer = Timer(device, reps, inner)

    from vllm.config import VllmConfig, set_current_vllm_config

    from vllm_nemotron_spec.kernels import markov as mk
    from vllm_nemotron_spec.nvfp4 import config as nvcfg

    env = environment(device, args)
    print(json.dumps(env, indent=1))
    result = {"environment": env, "shapes": asdict(s), "batches": batches, "gammas": gammas,
              "rows": [], "verification": [], "failures": [], "ok": True}  # fmt: skip

    def save():
        result["ok"] = not result["failures"]
        (out_dir / "result.json").write_text(json.dumps(result, indent=1))
        (out_dir / "result.md").write_text(markdown(result))

    def record(part, batch, gamma, m, fn, floor_bytes, notes=""):
        row = {"part": part, "batch": batch, "gamma": gamma, "m": m, "notes": notes}
        try:
            us, how = timer(fn)
            floor_us = floor_bytes / args.bandwidth * 1e6
            row.update(
                us=us, timing=how, floor_bytes=floor_bytes, floor_us=floor_us, ratio=us / floor_us
            )
            print(f"  {part:28s} B={batch:3d} gamma={gamma} M={m!s:>5}: {us:9.1f} us  floor {floor_us:8.1f} us"
                  f"  x{us / floor_us:6.2f}  [{how}]")  # fmt: skip
        except Exception as exc:  # noqa: BLE001
            row["error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
            print(f"  {part} B={batch} gamma={gamma}: ERROR {row['error']}")
            traceback.print_exc()
        result["rows"].append(row)
        return row

    t_start = time.time()
    with set_current_vllm_config(VllmConfig()):
        init_vllm(device)
        nvcfg.register()
        qc = nvcfg.NemotronW4A16NvFp4Config.from_config(QUANT_CONFIG)
        with torch.device(device):
            backbone = Backbone(s, device, dtype, qc) if "backbone" in parts else None
        result["backbone_kind"] = backbone.kind if backbone else None
        lm_w = lm_nvfp4 = None
        if "lm_head" in parts:
            g = torch.Generator(device=device).manual_seed(3)
            lm_w = (0.02 * torch.randn(s.vocab, s.hidden, generator=g, device=device)).to(dtype)
            try:
                from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

                with torch.device(device):
                    head = ParallelLMHead(s.vocab, s.hidden, bias=False, quant_config=qc, params_dtype=dtype,
                                          prefix="bench.lm_head", disable_tp=True)  # fmt: skip
                lm_nvfp4 = load_nvfp4(
                    head, [random_nvfp4(s.vocab, s.hidden, device, 4)], merged=False
                )
            except Exception as exc:  # noqa: BLE001
                print(f"  lm_head NVFP4 unavailable: {type(exc).__name__}: {exc}")
                result["lm_head_nvfp4_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        markov = None
        if "markov" in parts:
            print("markov: building weights (quantize, dequantize, vLLM head)")
            markov = MarkovSetup(s, device, dtype, qc, mk)
            result["vllm_markov_kind"] = markov.vllm_kind
        save()

        for batch in batches:
            for gamma in gammas:
                print(f"B={batch} gamma={gamma}")
                m_q = batch * (gamma + 1)
                if backbone is not None:
                    record("backbone", batch, gamma, m_q, backbone.step_fn(m_q, m_q),
                           backbone.floor_bytes(m_q, m_q), notes="GEMMs only; M_ctx = M_q")  # fmt: skip
                if lm_w is not None:
                    m = batch * gamma
                    h = torch.randn(m, s.hidden, device=device).to(dtype)
                    floor = s.vocab * s.hidden * 2 + m * (s.hidden + s.vocab) * 2
                    record("lm_head bf16", batch, gamma, m, lambda h=h: F.linear(h, lm_w), floor)
                    if lm_nvfp4 is not None:
                        floor4 = (
                            s.vocab * s.hidden * NVFP4_BYTES_PER_WEIGHT
                            + m * (s.hidden + s.vocab) * 2
                        )
                        record("lm_head nvfp4 (ref)", batch, gamma, m,
                               lambda h=h: lm_nvfp4.quant_method.apply(lm_nvfp4, h), int(floor4))  # fmt: skip
                if markov is not None:
                    run_markov(markov, mk, s, batch, gamma, device, dtype, record, result, args)
                save()
        result["step_totals"] = step_totals(result)
    result["wall_s"] = round(time.time() - t_start, 1)
    save()
    print(f"\n{'PASS' if result['ok'] else 'FAIL'}: results in {out_dir} ({result['wall_s']} s)")
    for f in result["failures"]:
        print("  FAIL:", f)
    return 0 if result["ok"] else 1


def run_markov(markov: MarkovSetup, mk, s, batch, gamma, device, dtype, record, result, args):
    g = torch.Generator(device=device).manual_seed(100 * batch + gamma)
    U = (3 * torch.randn(batch, gamma, s.vocab, generator=g, device=device)).to(dtype)
    anchor = torch.randint(0, s.vocab, (batch,), generator=g, device=device)
    tokens = torch.zeros(batch, gamma, dtype=torch.int64, device=device)
    floor_bf16 = markov.walk_floor_bytes(batch, gamma, "bf16")
    floor_fp4 = markov.walk_floor_bytes(batch, gamma, "nvfp4")

    def verify(name, fn, must_match: bool):
        tokens.fill_(-1)
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        check = markov.check(U, anchor, tokens)
        check.update(name=name, batch=batch, gamma=gamma)
        result["verification"].append(check)
        ok = check["mismatches"] == 0
        print(f"    verify {name}: {check}")
        if must_match and not ok:
            result["failures"].append(f"{name} B={batch} gamma={gamma}: {check['mismatches']} tokens differ "
                                      f"from the fp32 reference (not near-ties)")  # fmt: skip
        return ok

    a32 = lambda: markov.walk_unfused(U, anchor, tokens, fp32=True)  # noqa: E731
    a16 = lambda: markov.walk_unfused(U, anchor, tokens, fp32=False)  # noqa: E731
    b = (lambda: markov.walk_vllm(U, anchor, tokens)) if markov.vllm_head is not None else None  # noqa: E731
    for label, fn, floor, notes in (
        ("markov (a) unfused bf16", a16, floor_bf16, "dense bf16 W2"),
        ("markov (a32) unfused fp32", a32, 2 * floor_bf16, "reference; floor with fp32 W2"),
        ("markov (b) vLLM 0.33 loop", b, floor_fp4, markov.vllm_kind[:40]),
    ):
        if fn is None:
            continue
        try:  # bf16 rounding: token agreement with the fp32 reference is informational here
            if label != "markov (a32) unfused fp32":
                verify(label, fn, must_match=False)
        except Exception as exc:  # noqa: BLE001
            msg = f"{type(exc).__name__}: {str(exc)[:400]}"
            print(f"    {label}: ERROR {msg}")
            result["rows"].append({"part": label, "batch": batch, "gamma": gamma, "error": msg})
            continue
        record(label, batch, gamma, batch, fn, floor, notes=notes)
    best = None
    only = args.configs.split(",") if args.configs else None
    for name, cfg in fused_candidates(
        mk, s, batch, args.no_candidates, args.smoke, args.sweep, only
    ).items():
        label = f"markov (c) fused {name}"
        fn = lambda cfg=cfg: markov.walk_fused(U, anchor, tokens, cfg)  # noqa: E731
        try:
            ok = verify(f"(c) fused {name}", fn, must_match=True)
        except Exception as exc:  # noqa: BLE001
            msg = f"{type(exc).__name__}: {str(exc)[:400]}"
            print(f"    {label}: ERROR {msg}")
            result["rows"].append({"part": label, "batch": batch, "gamma": gamma, "error": msg})
            if name == "default":
                result["failures"].append(f"{label} B={batch} gamma={gamma}: {msg}")
            continue
        if not ok:
            continue
        resolved = cfg.resolve(batch, s.vocab, s.rank, device)
        row = record(label, batch, gamma, batch, fn, floor_fp4,
                     notes=f"{resolved.variant} b{resolved.block_b} v{resolved.block_v} k{resolved.block_k} "
                           f"t{resolved.tiles_per_program} w{resolved.num_warps} s{resolved.num_stages} "
                           f"{resolved.reduction}")  # fmt: skip
        if "us" in row and (best is None or row["us"] < best[1]["us"]):
            best = (cfg, row)
    if best is not None:
        result["rows"].append(dict(best[1], part="markov (c) fused BEST"))
        logits = torch.empty(batch, gamma, s.vocab, dtype=torch.float32, device=device)
        cfg = best[0]
        fnq = lambda: markov.walk_fused(U, anchor, tokens, cfg, logits_out=logits)  # noqa: E731
        try:
            if verify("(c+q) fused, logits written", fnq, must_match=True):
                record("markov (c+q) fused + logits", batch, gamma, batch, fnq,
                       markov.walk_floor_bytes(batch, gamma, "nvfp4", logits_bytes=4), notes="fp32 logits out")  # fmt: skip
        except Exception as exc:  # noqa: BLE001
            msg = f"{type(exc).__name__}: {str(exc)[:400]}"
            result["failures"].append(f"markov (c+q) B={batch} gamma={gamma}: {msg}")
        del logits


def step_totals(result: dict) -> list[dict]:
    by = {}
    for r in result["rows"]:
        if "us" in r:
            by[(r["part"], r["batch"], r["gamma"])] = r["us"]
    out = []
    for b in result["batches"]:
        for gm in result["gammas"]:
            bb, lm = by.get(("backbone", b, gm)), by.get(("lm_head bf16", b, gm))
            if bb is None or lm is None:
                continue
            t = {"batch": b, "gamma": gm, "backbone_us": bb, "lm_head_us": lm}
            for key, part in (("vllm", "markov (b) vLLM 0.33 loop"), ("fused", "markov (c) fused BEST"),
                              ("unfused_bf16", "markov (a) unfused bf16")):  # fmt: skip
                mv = by.get((part, b, gm))
                if mv is not None:
                    t[f"total_{key}_us"] = bb + lm + mv
                    t[f"markov_share_{key}"] = mv / (bb + lm + mv)
            out.append(t)
    return out


if __name__ == "__main__":
    sys.exit(main())
