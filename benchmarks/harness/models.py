"""The benchmark models: Nemotron 3.5 Lightning's target at its real widths and depth, and the
official DFlash / DSpark drafts, all with random values (nothing is downloaded).

**Target, ``nvfp4`` (the default: the checkpoint users serve).** NemotronH, hidden 2688, vocab
131072, the real 52-block pattern (23 Mamba-2, 23 MoE, 6 attention), 128 routed experts top-6
plus one shared expert (relu2), Mamba-2 64 heads x 64, state 128, 8 groups, attention 32 q / 2 kv
heads x 128. Quantized as ModelOpt writes NVIDIA's NVFP4 checkpoint: ``quant_algo:
MIXED_PRECISION`` with a per-layer ``quantized_layers`` map, each routed expert's and the shared
expert's up/down projection ``W4A16_NVFP4`` (uint8 E2M1 pairs, float8 block scales per 16
inputs, a float32 global scale; experts also carry a float32 ``input_scale``, which W4A16 does
not use), each Mamba ``in_proj`` / ``out_proj`` ``FP8`` per-tensor (float8 weight, float32
``weight_scale`` and static ``input_scale``); attention, the router, embeddings and lm_head BF16.
vLLM 0.33 detects this as ``modelopt_mixed`` (``ModelOptMixedPrecisionConfig``): experts run
through ``ModelOptNvFp4FusedMoE`` with its W4A16 (Marlin / Humming) kernels, the Mamba
projections through FP8 W8A8, the rest unquantized. ``W4A16_NVFP4`` rather than NVFP4 W4A4: the
checkpoint's experts are weight-only (activations stay BF16), and on Hopper both would run as
W4A16 through FP4 Marlin or Humming anyway.

Written once on the machine as sharded safetensors (~21 GB) into ``--models-dir`` (outside
``--out``) and reused while the builder's stamp matches. The values are windows of pools of
random numbers (:mod:`safetensors_io`): codes uniform over all 16 E2M1 values, block scales in
[1, 2], global scales and FP8 scales finite and positive, BF16 weights N(0, 0.02), norms 1, the
router's score-correction bias 0, so each token's experts follow its own router logits.

*Why not vLLM's dummy loader for it:* ``initialize_single_dummy_weight`` (0.33) fills float
parameters uniformly in +-1e-3, so the FP8 layers' float32 weight and input scales would be tiny
and half of them negative; written tensors keep every scale valid and every value in the range a
trained checkpoint has. (Routing would still spread there: RMSNorm weights load as 1, so the
router sees normalised inputs whose logits vary far more across tokens than the +-1e-3
score-correction bias. Each engine records the experts 64 random tokens reach in its first MoE
block, ``routing`` in the report, to check this on the machine.)

**Target, ``bf16`` (a labelled second row).** The same config without quantization and no
weights written (BF16 experts would be ~61 GB): vLLM's dummy loader.

**Drafts.** The official layout and size (6 layers, hidden 2688, 32 / 2 heads x 128, MLP 6144,
Markov rank 512, sliding window 1024, block size 8, ``target_layer_ids`` [1, 5, 19, 29, 41, 51]),
W4A16 NVFP4 as NVIDIA ships them (``checkpoint/layout.py``), random values as above.

**Smoke (CPU).** Engines run the tiny family (``tiny/``, fp32) and its drafts; the NVFP4 target
is also written at tiny widths with MoE blocks and checked (no CPU kernel runs NVFP4 or FP8).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.harness import safetensors_io as st

REAL_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
OFFICIAL_LAYER_IDS = [1, 5, 19, 29, 41, 51]
MASK_TOKEN_ID = 990
EXPECTED = {"dflash": (3.18, 5), "dspark": (3.69, 7)}
"""NVIDIA's expected acceptance lengths (mean accepted tokens per step, bonus included) and the
draft count they were published at."""
BUILDER_VERSION = 1
SHARD_BYTES = 4 << 30
GLOBAL_SCALE = 4.6e-3  # NVFP4: E2M1 (rms 2.9) x block scale (~1.5) x this ~ N(0, 0.02)
FP8_WEIGHT_SCALE = 0.02  # FP8 weights are ~N(0, 1) values: x this ~ N(0, 0.02)
FP8_INPUT_SCALE = 0.02  # static activation scale: normed inputs up to ~9 fit float8's 448


@dataclass(frozen=True)
class LightningShape:
    """The target's shape; the defaults are Nemotron 3.5 Lightning's."""

    hidden_size: int = 2688
    vocab_size: int = 131072
    pattern: str = REAL_PATTERN
    num_attention_heads: int = 32
    num_key_value_heads: int = 2
    head_dim: int = 128
    mamba_num_heads: int = 64
    mamba_head_dim: int = 64
    ssm_state_size: int = 128
    n_groups: int = 8
    conv_kernel: int = 4
    chunk_size: int = 128
    n_routed_experts: int = 128
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 1856
    moe_shared_expert_intermediate_size: int = 3712
    routed_scaling_factor: float = 2.5
    max_position_embeddings: int = 262144


TINY_SHAPE = LightningShape(
    hidden_size=128, vocab_size=1024, pattern="MEM*EM*E", num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16,
    n_groups=2, chunk_size=64, n_routed_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=64, moe_shared_expert_intermediate_size=128, max_position_embeddings=4096,
)  # fmt: skip
"""The same structure at tiny widths (smoke runs and tests write it; nothing on CPU runs it)."""


@dataclass(frozen=True)
class Models:
    """Paths of one built set and how its target loads."""

    target: str
    drafts: dict  # kind -> path
    target_kind: str  # nvfp4 | bf16 | tiny
    load_format: str  # the target's: auto (written weights) or dummy

    @property
    def quantized(self) -> bool:
        return self.target_kind == "nvfp4"


# ------------------------------------------------------------------------------------------
# synthetic acceptance


def geometric_alpha(mean_length: float, n: int) -> float:
    """The constant conditional acceptance ``a`` with ``1 + sum_{i=1..n} a^i = mean_length``."""
    target = mean_length - 1.0
    if not 0.0 <= target <= n:
        raise ValueError(f"mean acceptance length {mean_length} impossible with {n} drafts")
    lo, hi = 0.0, 1.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if sum(mid**i for i in range(1, n + 1)) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def acceptance_rates(method: str, gamma: int) -> tuple[list[float], float, float]:
    """(unconditional per-position rates, a, expected mean acceptance length) for ``gamma``
    drafts: position i is accepted with rate a^i, ``a`` fitted to NVIDIA's length at its
    published draft count (DFlash 3.18 at 5, DSpark 3.69 at 7). DSpark with 3 drafts keeps the
    7-draft ``a`` (the same draft, fewer positions): 1 + a + a^2 + a^3 = 2.77."""
    if method not in EXPECTED:
        raise ValueError(f"no published acceptance for method {method!r}; known: {list(EXPECTED)}")
    length, n = EXPECTED[method]
    alpha = geometric_alpha(length, n)
    rates = [alpha**i for i in range(1, gamma + 1)]
    return rates, alpha, 1.0 + sum(rates)


# ------------------------------------------------------------------------------------------
# target


def target_config(shape: LightningShape, quantized: bool) -> dict:
    """The target's config.json (transformers' NemotronHConfig with the MoE fields, the legacy
    ``hybrid_override_pattern`` / ``num_hidden_layers`` that the official file carries, and the
    ModelOpt quantization config when ``quantized``)."""
    from transformers import NemotronHConfig

    moe = dict(
        n_routed_experts=shape.n_routed_experts, num_experts_per_tok=shape.num_experts_per_tok,
        n_shared_experts=1, moe_intermediate_size=shape.moe_intermediate_size,
        moe_shared_expert_intermediate_size=shape.moe_shared_expert_intermediate_size,
        routed_scaling_factor=shape.routed_scaling_factor, n_group=1, topk_group=1,
        norm_topk_prob=True,
    )  # fmt: skip
    config = NemotronHConfig(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
        hybrid_override_pattern=shape.pattern, num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads, head_dim=shape.head_dim,
        intermediate_size=shape.moe_intermediate_size, mlp_hidden_act="relu2",
        mamba_num_heads=shape.mamba_num_heads, mamba_head_dim=shape.mamba_head_dim,
        ssm_state_size=shape.ssm_state_size, n_groups=shape.n_groups,
        conv_kernel=shape.conv_kernel, chunk_size=shape.chunk_size, layer_norm_epsilon=1e-5,
        max_position_embeddings=shape.max_position_embeddings, tie_word_embeddings=False,
        mamba_ssm_cache_dtype="float32", **moe,
    )  # fmt: skip
    data = json.loads(config.to_json_string())
    data.update(moe)
    data.update(
        architectures=["NemotronHForCausalLM"],  # else vLLM resolves NemotronHModel (pooling)
        hybrid_override_pattern=shape.pattern,
        num_hidden_layers=len(shape.pattern),
        num_nextn_predict_layers=0,
        torch_dtype="bfloat16",
        dtype="bfloat16",
    )
    if quantized:
        data["quantization_config"] = mixed_precision_config(shape)
    return dict(sorted(data.items()))


def mixed_precision_config(shape: LightningShape) -> dict:
    """ModelOpt's ``MIXED_PRECISION`` quantization config: the per-module map (checkpoint names)
    of the NVFP4 experts and the FP8 Mamba projections (see the module doc)."""
    w4a16 = {"quant_algo": "W4A16_NVFP4", "group_size": 16}
    layers: dict[str, dict] = {}
    for i, kind in enumerate(shape.pattern):
        p = f"backbone.layers.{i}.mixer"
        if kind == "E":
            for e in range(shape.n_routed_experts):
                layers[f"{p}.experts.{e}.up_proj"] = dict(w4a16)
                layers[f"{p}.experts.{e}.down_proj"] = dict(w4a16)
            layers[f"{p}.shared_experts.up_proj"] = dict(w4a16)
            layers[f"{p}.shared_experts.down_proj"] = dict(w4a16)
        elif kind == "M":
            layers[f"{p}.in_proj"] = {"quant_algo": "FP8"}
            layers[f"{p}.out_proj"] = {"quant_algo": "FP8"}
    return {
        "quant_method": "modelopt",
        "quant_algo": "MIXED_PRECISION",
        "producer": {"name": "modelopt", "version": "0.47.0"},
        "ignore": ["lm_head"],
        "quantized_layers": layers,
    }


class Pools:
    """The random-value pools one build draws from (made once, ~0.5 GB)."""

    def __init__(self, seed: int = 1234, scale: int = 1):
        mib = 1 << 20
        self.codes = st.uniform_byte_pool(64 * mib // scale, 0, 255, seed)
        self.block_scales = st.uniform_byte_pool(16 * mib // scale, 0x38, 0x40, seed + 1)
        self.bf16 = st.bf16_normal_pool(128 * mib // scale, 0.02, seed + 2)
        self.fp8 = st.fp8_e4m3_normal_pool(64 * mib // scale, seed + 3)


def _nvfp4(entries: list, name: str, out_f: int, in_f: int, pools: Pools, input_scale: bool):
    entries += [
        st.Entry(f"{name}.weight", "U8", (out_f, in_f // 2), pool=pools.codes),
        st.Entry(f"{name}.weight_scale", "F8_E4M3", (out_f, in_f // 16), pool=pools.block_scales),
        st.Entry(f"{name}.weight_scale_2", "F32", (), st.constant(GLOBAL_SCALE, "F32")),
    ]
    if input_scale:
        entries.append(st.Entry(f"{name}.input_scale", "F32", (), st.constant(1.0, "F32")))


def _fp8(entries: list, name: str, out_f: int, in_f: int, pools: Pools):
    entries += [
        st.Entry(f"{name}.weight", "F8_E4M3", (out_f, in_f), pool=pools.fp8),
        st.Entry(f"{name}.weight_scale", "F32", (), st.constant(FP8_WEIGHT_SCALE, "F32")),
        st.Entry(f"{name}.input_scale", "F32", (), st.constant(FP8_INPUT_SCALE, "F32")),
    ]


def _bf16(name: str, shape: tuple, pools: Pools) -> st.Entry:
    return st.Entry(name, "BF16", shape, pool=pools.bf16)


def _ones(name: str, n: int) -> st.Entry:
    return st.Entry(name, "BF16", (n,), st.constant(1.0, "BF16", n))


def _mamba_entries(p: str, s: LightningShape, pools: Pools) -> list:
    d_inner = s.mamba_num_heads * s.mamba_head_dim
    conv_dim = d_inner + 2 * s.n_groups * s.ssm_state_size
    in_out = 2 * d_inner + 2 * s.n_groups * s.ssm_state_size + s.mamba_num_heads
    h, heads = s.hidden_size, s.mamba_num_heads
    out: list = []
    _fp8(out, f"{p}.in_proj", in_out, h, pools)
    _fp8(out, f"{p}.out_proj", h, d_inner, pools)
    out += [
        _bf16(f"{p}.conv1d.weight", (conv_dim, 1, s.conv_kernel), pools),
        _bf16(f"{p}.conv1d.bias", (conv_dim,), pools),
        st.Entry(f"{p}.A_log", "F32", (heads,), st.constant(0.5, "F32", heads)),
        st.Entry(f"{p}.D", "F32", (heads,), st.constant(1.0, "F32", heads)),
        st.Entry(f"{p}.dt_bias", "F32", (heads,), st.constant(-2.0, "F32", heads)),
        _ones(f"{p}.norm.weight", d_inner),
    ]
    return out


def _moe_entries(p: str, s: LightningShape, pools: Pools) -> list:
    h, n = s.hidden_size, s.n_routed_experts
    out = [
        _bf16(f"{p}.gate.weight", (n, h), pools),
        st.Entry(f"{p}.gate.e_score_correction_bias", "F32", (n,), st.constant(0.0, "F32", n)),
    ]
    for e in range(n):
        _nvfp4(out, f"{p}.experts.{e}.up_proj", s.moe_intermediate_size, h, pools, True)
        _nvfp4(out, f"{p}.experts.{e}.down_proj", h, s.moe_intermediate_size, pools, True)
    shared = s.moe_shared_expert_intermediate_size
    _nvfp4(out, f"{p}.shared_experts.up_proj", shared, h, pools, False)
    _nvfp4(out, f"{p}.shared_experts.down_proj", h, shared, pools, False)
    return out


def target_entries(s: LightningShape, pools: Pools) -> list[st.Entry]:
    """Every tensor of the NVFP4 target checkpoint, in checkpoint names (``backbone.``)."""
    h = s.hidden_size
    q, kv = s.num_attention_heads * s.head_dim, s.num_key_value_heads * s.head_dim
    out = [_bf16("backbone.embeddings.weight", (s.vocab_size, h), pools)]
    for i, kind in enumerate(s.pattern):
        p = f"backbone.layers.{i}"
        out.append(_ones(f"{p}.norm.weight", h))
        if kind == "M":
            out += _mamba_entries(f"{p}.mixer", s, pools)
        elif kind == "E":
            out += _moe_entries(f"{p}.mixer", s, pools)
        elif kind == "*":
            out += [
                _bf16(f"{p}.mixer.q_proj.weight", (q, h), pools),
                _bf16(f"{p}.mixer.k_proj.weight", (kv, h), pools),
                _bf16(f"{p}.mixer.v_proj.weight", (kv, h), pools),
                _bf16(f"{p}.mixer.o_proj.weight", (h, q), pools),
            ]
        else:
            raise ValueError(f"pattern {s.pattern!r}: block kind {kind!r} is not M, E or *")
    out += [_ones("backbone.norm_f.weight", h), _bf16("lm_head.weight", (s.vocab_size, h), pools)]
    return out


# ------------------------------------------------------------------------------------------
# drafts


def draft_params():
    """The official drafts' shape (``tiny.drafts.DraftParams`` at the real sizes)."""
    from vllm_nemotron_spec.tiny.drafts import DraftParams

    return DraftParams(
        num_hidden_layers=6, num_attention_heads=32, num_key_value_heads=2, head_dim=128,
        intermediate_size=6144, yarn_factor=128.0, yarn_original_max_position_embeddings=8192,
        max_position_embeddings=8192 * 128, sliding_window=1024, block_size=8, markov_rank=512,
        num_aux_layers=6,
    )  # fmt: skip


def draft_entries(config: dict, pools: Pools) -> list[st.Entry]:
    """Every tensor of a draft in the official layout (``checkpoint/layout.py``)."""
    from vllm_nemotron_spec.checkpoint import layout

    out = []
    for name, (dtype, shape) in layout.checkpoint_layout(config).items():
        if dtype == "uint8":
            out.append(st.Entry(name, "U8", shape, pool=pools.codes))
        elif dtype == "float8_e4m3fn":
            out.append(st.Entry(name, "F8_E4M3", shape, pool=pools.block_scales))
        elif dtype == "float32":
            out.append(st.Entry(name, "F32", shape, st.constant(GLOBAL_SCALE, "F32")))
        elif name.endswith(("norm.weight", "layernorm.weight")):
            out.append(_ones(name, shape[0]))
        elif "attention_sink" in name:
            out.append(st.Entry(name, "BF16", shape, st.constant(0.5, "BF16", shape[0])))
        else:
            out.append(_bf16(name, shape, pools))
    return out


def write_draft(out: Path, kind: str, target_cfg: dict, pools: Pools) -> dict:
    from vllm_nemotron_spec.checkpoint import layout
    from vllm_nemotron_spec.tiny import drafts

    config = drafts.draft_config(
        kind, hidden_size=target_cfg["hidden_size"], vocab_size=target_cfg["vocab_size"],
        target_layer_ids=OFFICIAL_LAYER_IDS, params=draft_params(), mask_token_id=MASK_TOKEN_ID,
    )  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    st.write_safetensors(out / layout.WEIGHTS_FILE, draft_entries(config, pools))
    (out / layout.CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / layout.HF_QUANT_CONFIG_FILE).write_text(
        json.dumps(layout.hf_quant_config(kind), indent=2) + "\n"
    )
    return config


# ------------------------------------------------------------------------------------------
# building, cached in --models-dir


def _stamp_matches(directory: Path, stamp: dict) -> bool:
    path = directory / "build.json"
    return path.is_file() and json.loads(path.read_text()) == stamp


def _progress_line(what: str, t0: float):
    def report(done_files, files, done, total):
        rate = done / max(1e-9, time.monotonic() - t0) / 1e9
        print(
            f"models: {what}: {done_files}/{files} files, {done / 1e9:.1f}/{total / 1e9:.1f} GB "
            f"({rate:.1f} GB/s)",
            flush=True,
        )

    return report


TOKENIZER_SPECIALS = ("<pad>", "<s>", "</s>")
"""Ids 0, 1, 2 of the targets' tokenizer: NemotronH's ``pad_token_id``, ``bos_token_id`` and
``eos_token_id``."""


def write_tokenizer(directory: Path, vocab_size: int) -> None:
    """A word-level tokenizer of exactly ``vocab_size`` tokens (``<pad>``, ``<s>``, ``</s>``,
    then ``w3``, ``w4``, ...), so that the target is a whole checkpoint: what starts an engine
    with a tokenizer (``vllm-nemotron-spec tune``) starts on it, and every id the random weights
    produce decodes. Text outside the vocabulary encodes to ``<pad>``; the token ids, not the
    text, are what a benchmark needs."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    pad, bos, eos = TOKENIZER_SPECIALS
    vocab = {t: i for i, t in enumerate(TOKENIZER_SPECIALS)}
    vocab.update({f"w{i}": i for i in range(len(vocab), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=pad))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": pad,
              "bos_token": bos, "eos_token": eos, "unk_token": pad,
              "model_max_length": 1 << 20}  # fmt: skip
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")


def build_target(directory: Path, shape: LightningShape, quantized: bool, pools=None) -> dict:
    """Write the target (config only when not ``quantized``: vLLM's dummy loader fills it);
    reused when its stamp matches."""
    stamp = {"builder": BUILDER_VERSION, "shape": asdict(shape), "quantized": quantized}
    if _stamp_matches(directory, stamp):
        print(f"models: reusing the target in {directory}", flush=True)
        config = json.loads((directory / "config.json").read_text())
        if not (directory / "tokenizer.json").is_file():
            write_tokenizer(directory, config["vocab_size"])
        return config
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "build.json").unlink(missing_ok=True)
    for old in directory.glob("*.safetensors*"):
        old.unlink()
    t0 = time.monotonic()
    config = target_config(shape, quantized)
    if quantized:
        entries = target_entries(shape, pools or Pools())
        total = sum(e.nbytes for e in entries) / 1e9
        print(f"models: writing the NVFP4 target ({total:.1f} GB) to {directory}", flush=True)
        st.write_sharded(directory, entries, SHARD_BYTES, _progress_line("target", t0))
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_tokenizer(directory, config["vocab_size"])
    (directory / "build.json").write_text(json.dumps(stamp, indent=1) + "\n")
    print(f"models: target ready in {time.monotonic() - t0:.0f} s", flush=True)
    return config


def build_drafts(directory: Path, target_cfg: dict, pools=None) -> dict:
    """Both official-size drafts, reused when their stamp matches."""
    stamp = {"builder": BUILDER_VERSION, "draft": asdict(draft_params()),
             "hidden": target_cfg["hidden_size"], "vocab": target_cfg["vocab_size"]}  # fmt: skip
    paths = {kind: directory / kind for kind in ("dflash", "dspark")}
    if _stamp_matches(directory, stamp) and all(
        (p / "config.json").is_file() for p in paths.values()
    ):
        print(f"models: reusing the drafts in {directory}", flush=True)
        return {k: str(v) for k, v in paths.items()}
    t0 = time.monotonic()
    pools = pools or Pools()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "build.json").unlink(missing_ok=True)
    for kind, path in paths.items():
        write_draft(path, kind, target_cfg, pools)
        print(f"models: {kind} draft written ({time.monotonic() - t0:.0f} s)", flush=True)
    (directory / "build.json").write_text(json.dumps(stamp, indent=1) + "\n")
    return {k: str(v) for k, v in paths.items()}


def build_models(models_dir: str | Path, target: str, smoke: bool) -> Models:
    """The models a run needs, built into ``models_dir`` once (see the module doc)."""
    models_dir = Path(models_dir)
    if smoke:
        return smoke_models(models_dir)
    if target not in ("nvfp4", "bf16"):
        raise ValueError(f"--target must be nvfp4 or bf16, got {target!r}")
    pools = Pools()
    quantized = target == "nvfp4"
    config = build_target(models_dir / f"lightning-{target}", LightningShape(), quantized, pools)
    drafts = build_drafts(models_dir / "drafts", config, pools)
    return Models(
        target=str(models_dir / f"lightning-{target}"),
        drafts=drafts,
        target_kind=target,
        load_format="auto" if quantized else "dummy",
    )


def smoke_models(models_dir: Path) -> Models:
    """The tiny family's target and drafts (what CPU engines run), and the NVFP4 target written
    at tiny widths (checked by the tests, run by nothing on CPU)."""
    from vllm_nemotron_spec.tiny.build import ensure_tiny_family

    build_target(models_dir / "tiny-lightning-nvfp4", TINY_SHAPE, True, Pools(scale=64))
    family = ensure_tiny_family(seed=0)
    return Models(
        target=str(family.target),
        drafts={"dflash": str(family.dflash_draft), "dspark": str(family.dspark_draft)},
        target_kind="tiny",
        load_format="auto",
    )


def routing_spread(model, tokens: int = 64, seed: int = 0) -> dict | None:
    """How many of the first MoE block's experts ``tokens`` random tokens pick: the block's
    RMSNorm (its loaded weight) and router (loaded weights and bias) applied to the token
    embeddings, beside the count uniform routing gives. A count near top-k would mean the
    router's constant bias decides (degenerate routing: a batch reads far fewer experts than
    the real model)."""
    import torch

    from benchmarks.harness.floors import distinct_experts

    inner = getattr(model, "model", None)
    embed = getattr(inner, "embed_tokens", None)
    layer = next(
        (
            m
            for m in getattr(inner, "layers", [])
            if hasattr(getattr(getattr(m, "mixer", None), "gate", None), "e_score_correction_bias")
        ),
        None,
    )
    if embed is None or layer is None:
        return None
    gate, norm = layer.mixer.gate, getattr(getattr(layer, "norm", None), "weight", None)
    weight = embed.weight
    gen = torch.Generator(device=weight.device).manual_seed(seed)
    ids = torch.randint(0, weight.shape[0], (tokens,), generator=gen, device=weight.device)
    top_k = getattr(getattr(layer.mixer, "experts", None), "top_k", 6)
    with torch.no_grad():
        x = weight[ids].float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
        if norm is not None:
            x = x * norm.float()
        scores = torch.sigmoid(x @ gate.weight.float().t()) + gate.e_score_correction_bias.float()
        picked = scores.topk(top_k, dim=-1).indices.unique().numel()
    experts = scores.shape[-1]
    return {
        "tokens": tokens,
        "experts_touched": int(picked),
        "uniform_expectation": round(distinct_experts(experts, top_k, tokens), 1),
        "experts": experts,
        "top_k": top_k,
    }
