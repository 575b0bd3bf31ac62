"""The DFlash draft trainer: aux hidden states as vLLM defines them, vLLM's RoPE, the reference
forward's block semantics (masks, anchors, rows), labels and deterministic training.

Fast: tiny random models built here, no tiny family, no engine."""

from __future__ import annotations

import json

import pytest
import torch

from vllm_nemotron_spec.checkpoint import layout
from vllm_nemotron_spec.checkpoint.spec import DraftSpec
from vllm_nemotron_spec.tiny import drafts
from vllm_nemotron_spec.tiny import reference as ref
from vllm_nemotron_spec.tiny import train_draft as td
from vllm_nemotron_spec.tiny.target import TargetParams, make_config

MASK = 4
VOCAB = 64
HIDDEN = 32


# ------------------------------------------------------------------------------------------
# fixtures: a tiny random NemotronH target and a tiny random DFlash draft
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target():
    from transformers import NemotronHForCausalLM

    params = TargetParams(
        hidden_size=HIDDEN,
        hybrid_override_pattern="M*-M-",
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=64,
        mamba_num_heads=4,
        mamba_head_dim=8,
        ssm_state_size=8,
        n_groups=1,
        chunk_size=16,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = NemotronHForCausalLM(make_config(params, VOCAB)).eval()
        with torch.no_grad():  # a visible final norm, so "before norm_f" is distinguishable
            model.model.norm_f.weight.uniform_(0.5, 1.5)
    return model


def _draft_config(kind=layout.DFLASH) -> dict:
    p = drafts.DraftParams(
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=32,
        markov_rank=16,
        sliding_window=6,
        block_size=4,
    )
    return drafts.draft_config(
        kind,
        hidden_size=HIDDEN,
        vocab_size=VOCAB,
        target_layer_ids=drafts.spread_layer_ids(8),
        params=p,
        mask_token_id=MASK,
    )


def _draft(config: dict | None = None, seed: int = 0):
    config = config or _draft_config()
    spec = DraftSpec.from_config(config)
    model = ref.DFlashDraft(spec)
    state = drafts.init_draft_state_dict(config, seed)
    # DFlashDraft is the backbone alone: DSpark's Markov head tensors are left out.
    model.load_state_dict({k: v for k, v in state.items() if not k.startswith("markov_head.")})
    return model.eval(), spec


def _inputs(S=2, T=24, seed=1):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(5, VOCAB, (S, T), generator=g)
    aux = torch.randn(S, T, 6 * HIDDEN, generator=g)
    return tokens, aux


# ------------------------------------------------------------------------------------------
# aux hidden states
# ------------------------------------------------------------------------------------------


def test_aux_hidden_states_are_the_residual_stream_vllm_captures(target):
    ids = torch.randint(5, VOCAB, (2, 11), generator=torch.Generator().manual_seed(0))
    n = len(target.model.layers)
    aux = td.target_aux_hidden_states(target, ids, [n, 0, 2])  # any order in, ascending out
    h = HIDDEN
    assert aux.shape == (2, 11, 3 * h)
    # The definition, block by block: id 0 = embedding output, id k = after block k - 1.
    with torch.no_grad():
        x = target.model.embeddings(ids)
        stream = [x]
        for block in target.model.layers:
            x = block(x)
            stream.append(x)
        out = target(input_ids=ids, output_hidden_states=True)
    torch.testing.assert_close(aux[..., :h], stream[0], rtol=0, atol=0)
    torch.testing.assert_close(aux[..., h : 2 * h], stream[2], rtol=0, atol=0)
    torch.testing.assert_close(aux[..., 2 * h :], stream[n], rtol=1e-6, atol=1e-6)
    # transformers' output_hidden_states agrees except for its LAST entry, which is after norm_f;
    # vLLM's id N is before norm_f (nemotron_h.py applies norm_f after the aux capture).
    torch.testing.assert_close(out.hidden_states[2], stream[2], rtol=1e-6, atol=1e-6)
    assert not torch.allclose(out.hidden_states[n], aux[..., 2 * h :], atol=1e-3)
    torch.testing.assert_close(target.model.norm_f(aux[..., 2 * h :]), out.hidden_states[n])
    torch.testing.assert_close(target.lm_head(target.model.norm_f(aux[..., 2 * h :])), out.logits)


def test_aux_ids_outside_the_target_are_rejected(target):
    with pytest.raises(ValueError, match=r"aux hidden state ids \[6\] outside 0..5"):
        td.target_aux_hidden_states(target, torch.ones(1, 3, dtype=torch.long), [1, 6])


def test_aux_recorded_while_decoding_matches_teacher_forcing(target):
    prompt = torch.randint(5, VOCAB, (3, 7), generator=torch.Generator().manual_seed(2))
    tokens, aux = td.greedy_continue(target, prompt, 6, aux_ids=[2, 5])
    assert tokens.shape == (3, 13) and aux.shape == (3, 13, 2 * HIDDEN)
    assert torch.equal(tokens[:, :7], prompt)
    forced = td.target_aux_hidden_states(target, tokens, [2, 5])
    torch.testing.assert_close(aux[:, :-1], forced[:, :-1], rtol=1e-4, atol=1e-4)
    assert torch.count_nonzero(aux[:, -1]) == 0  # the last token is never fed back
    # Greedy: every generated token is the target's argmax after the tokens before it.
    with torch.no_grad():
        logits = target(input_ids=tokens).logits
    assert torch.equal(logits[:, 6:-1].argmax(-1), tokens[:, 7:])


def test_aux_ids_follow_vllm_block_order():
    spec = DraftSpec.from_config(_draft_config())
    assert td.aux_hidden_state_ids(spec) == tuple(sorted(spec.aux_hidden_state_ids))
    assert td.aux_hidden_state_ids(spec) == tuple(i + 1 for i in spec.target_layer_ids)


# ------------------------------------------------------------------------------------------
# RoPE: vLLM's get_rope, cos/sin cache and neox rotation
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [layout.DFLASH, layout.DSPARK])  # YaRN / plain RoPE
def test_rope_matches_vllm(tmp_path, kind):
    from transformers import AutoConfig
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    config = _draft_config(kind)
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = AutoConfig.from_pretrained(tmp_path)  # what vLLM reads: rope_parameters
    spec = DraftSpec.from_config(config)
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(
            spec.head_dim,
            max_position=hf.max_position_embeddings,
            is_neox_style=True,
            rope_parameters=hf.rope_parameters,
            dtype=torch.float32,
        )
    positions = torch.tensor([0, 1, 5, 17, 255, 256, 1000, 4095])
    cos, sin = ref.rope_cos_sin(spec.head_dim, spec.rope_theta, spec.rope_scaling, positions)
    torch.testing.assert_close(torch.cat([cos, sin], -1), rope.cos_sin_cache[positions])
    if kind == layout.DFLASH:
        assert cos[1].abs().max() > 1.0  # YaRN's mscale multiplies cos and sin
    q = torch.randn(len(positions), spec.num_attention_heads * spec.head_dim)
    k = torch.randn(len(positions), spec.num_key_value_heads * spec.head_dim)
    q_ref, k_ref = rope.forward_native(positions, q.clone(), k.clone())
    view = lambda x: x.view(len(positions), -1, spec.head_dim)  # noqa: E731
    torch.testing.assert_close(ref.apply_rope(view(q), cos, sin).flatten(1), q_ref)
    torch.testing.assert_close(ref.apply_rope(view(k), cos, sin).flatten(1), k_ref)


# ------------------------------------------------------------------------------------------
# the reference forward: block layout, masks, rows
# ------------------------------------------------------------------------------------------


def test_module_state_dict_uses_the_checkpoint_names():
    config = _draft_config()
    model, _ = _draft(config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes == layout.logical_shapes(config)
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert frozen == ["embed_tokens.weight"]


def test_reference_forward_shapes():
    model, spec = _draft()
    tokens, aux = _inputs(S=2, T=24)
    anchors = torch.tensor([[3, 9, 14], [5, 6, 19]])
    hidden = ref.draft_forward(model, aux, tokens, anchors, 5)
    assert hidden.shape == (2, 3, 5, HIDDEN)
    lm_head = torch.randn(VOCAB, HIDDEN)
    assert ref.draft_logits(hidden, lm_head).shape == (2, 3, 5, VOCAB)


def test_block_inputs_are_bonus_then_masks_at_consecutive_positions():
    tokens = torch.arange(10, 30)[None]
    ids, pos = ref.block_inputs(tokens, torch.tensor([[4, 11]]), 5, MASK)
    assert ids.tolist() == [[[14, MASK, MASK, MASK, MASK], [21, MASK, MASK, MASK, MASK]]]
    assert pos.tolist() == [[[4, 5, 6, 7, 8], [11, 12, 13, 14, 15]]]


def test_mask_context_before_anchor_and_own_block_only():
    allowed = ref.block_attention_mask(torch.tensor([[3, 6]]), 3, context_len=8)[0]
    assert allowed.shape == (6, 8 + 6)
    ctx, blk = allowed[:, :8], allowed[:, 8:]
    assert ctx[:3].tolist() == [[True] * 3 + [False] * 5] * 3  # block at L=3: context 0..2
    assert ctx[3:].tolist() == [[True] * 6 + [False] * 2] * 3  # block at L=6: context 0..5
    own = torch.block_diag(torch.ones(3, 3), torch.ones(3, 3)).bool()
    assert torch.equal(blk, own)  # non-causal inside the block, nothing of other blocks


def test_mask_causal_and_sliding_window():
    allowed = ref.block_attention_mask(torch.tensor([[5]]), 3, 6, causal=True, sliding_window=4)[0]
    # query positions 5, 6, 7; keys: context 0..5 (only < 5 valid), block 5, 6, 7.
    assert allowed[:, :6].tolist() == [
        [False, False, True, True, True, False],  # p=5 sees positions > 1
        [False, False, False, True, True, False],  # p=6 sees > 2
        [False, False, False, False, True, False],  # p=7 sees > 3
    ]
    assert allowed[:, 6:].tolist() == [
        [True, False, False],
        [True, True, False],
        [True, True, True],
    ]


def test_block_cannot_see_context_at_or_after_its_anchor():
    model, _ = _draft()
    tokens, aux = _inputs(S=1, T=20)
    anchors = torch.tensor([[7, 12]])
    base = ref.draft_forward(model, aux, tokens, anchors, 4)
    later = aux.clone()
    later[:, 7:] += torch.randn_like(later[:, 7:])  # the context at and after L = 7
    changed = ref.draft_forward(model, later, tokens, anchors, 4)
    torch.testing.assert_close(changed[:, 0], base[:, 0], rtol=0, atol=0)
    assert not torch.allclose(changed[:, 1], base[:, 1])  # L = 12 sees positions 7..11
    earlier = aux.clone()
    earlier[:, 6] += 1.0  # the last context token of the block at L = 7
    moved = ref.draft_forward(model, earlier, tokens, anchors, 4)
    assert not torch.allclose(moved[:, 0], base[:, 0])
    # Tokens are used only as the bonus of each block: a token inside the context does not matter.
    other = tokens.clone()
    other[0, 3] = (other[0, 3] + 1) % VOCAB
    torch.testing.assert_close(ref.draft_forward(model, aux, other, anchors, 4), base)


def test_batched_blocks_equal_one_vllm_step_each():
    """Blocks trained together equal separate steps whose context is exactly the committed
    tokens (what vLLM's draft KV cache holds), one anchor each."""
    model, _ = _draft()
    tokens, aux = _inputs(S=1, T=20)
    anchors = torch.tensor([[4, 9, 15]])
    joint = ref.draft_forward(model, aux, tokens, anchors, 5)
    for k, L in enumerate(anchors[0].tolist()):
        alone = ref.draft_forward(
            model, aux[:, : L + 1], tokens[:, : L + 1], torch.tensor([[L]]), 5
        )
        torch.testing.assert_close(joint[:, k], alone[:, 0], rtol=1e-5, atol=1e-5)


def test_non_causal_inside_the_block():
    tokens, aux = _inputs(S=1, T=16)
    anchors = torch.tensor([[8]])
    model, _ = _draft()
    # Non-causal (DFlash): the anchor row sees the mask rows, so the block size changes it.
    short = ref.draft_forward(model, aux, tokens, anchors, 3)
    long = ref.draft_forward(model, aux, tokens, anchors, 5)
    assert not torch.allclose(short[:, :, 0], long[:, :, 0])
    # Causal (DSpark's attention, with its sliding window and sinks): row r sees rows <= r only.
    causal, spec = _draft(_draft_config(layout.DSPARK))
    assert spec.causal and spec.sliding_window == 6 and spec.has_attention_sinks
    short = ref.draft_forward(causal, aux, tokens, anchors, 3)
    long = ref.draft_forward(causal, aux, tokens, anchors, 5)
    torch.testing.assert_close(short, long[:, :, :3], rtol=1e-5, atol=1e-5)


def test_sinks_only_add_to_the_softmax_denominator():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 3, 2, 8, generator=g) for _ in range(3))
    allowed = torch.ones(1, 3, 3, dtype=torch.bool)
    sinks = torch.tensor([0.5, -1.0])
    got = ref.attention(q, k, v, allowed, sinks).view(1, 3, 2, 8)
    scores = torch.einsum("sqhd,skhd->shqk", q, k) / 8**0.5
    logits = torch.cat([scores, sinks.view(1, 2, 1, 1).expand(1, 2, 3, 1)], -1)
    probs = torch.softmax(logits, -1)[..., :-1]
    torch.testing.assert_close(got, torch.einsum("shqk,skhd->sqhd", probs, v))


def test_propose_takes_rows_one_to_gamma():
    model, _ = _draft()
    tokens, aux = _inputs(S=1, T=12)
    lm_head = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(3))
    drafted = ref.dflash_propose(model, lm_head, aux[0, :9], tokens[0, :9], int(tokens[0, 9]), 3)
    hidden = ref.draft_forward(model, aux[:, :10], tokens[:, :10], torch.tensor([[9]]), 4)
    assert drafted == ref.draft_logits(hidden[0, 0, 1:], lm_head).argmax(-1).tolist()
    assert len(drafted) == 3


# ------------------------------------------------------------------------------------------
# labels, anchors, training
# ------------------------------------------------------------------------------------------


def test_labels_vllm_layout_and_shifted_layout():
    tokens = torch.arange(100, 120)[None]
    anchors = torch.tensor([[5, 16]])
    labels, valid = td.block_labels(tokens, anchors, 4, label_offset=0)
    assert labels[0, 0].tolist() == [105, 106, 107, 108]  # row j predicts position L + j
    assert valid[0, 0].tolist() == [False, True, True, True]  # row 0 is the bonus, not a prediction
    assert valid[0, 1].tolist() == [False, True, True, True]  # 16 + 3 = 19 is the last token
    labels, valid = td.block_labels(tokens, anchors, 4, label_offset=1)
    assert labels[0, 0].tolist() == [106, 107, 108, 109]  # the anchor row predicts L + 1
    assert valid[0, 0].tolist() == [True] * 4
    assert valid[0, 1].tolist() == [True, True, True, False]


def test_anchors_start_after_the_prompt():
    g = torch.Generator().manual_seed(0)
    anchors = td.sample_anchors(torch.tensor([3, 10]), torch.tensor([12, 18]), 5, g)
    assert anchors.shape == (2, 5)
    assert anchors[0].min() >= 3 and anchors[0].max() <= 12
    assert anchors[1].min() >= 10 and anchors[1].max() <= 18
    assert all(len(set(row.tolist())) == 5 for row in anchors)
    with pytest.raises(ValueError, match="has 3 anchors, need 5"):
        td.sample_anchors(torch.tensor([3]), torch.tensor([5]), 5, g)


def _tiny_data(target, n=6):
    prompts = torch.randint(5, VOCAB, (n, 6), generator=torch.Generator().manual_seed(4))
    tokens, aux = td.greedy_continue(target, prompts, 14, aux_ids=[0, 1, 2, 3, 4, 5])  # 6 x hidden
    return td.DraftData(tokens, torch.full((n,), 6), torch.full((n,), 20), aux)


def test_training_is_deterministic_in_the_seed(target):
    data = _tiny_data(target)
    lm_head = target.lm_head.weight.detach()
    params = td.TrainParams(
        steps=3, seqs_per_step=2, anchors_per_seq=4, warmup_steps=1, eval_sequences=2
    )

    def run(seed):
        model, _ = _draft()
        return td.train_draft(model, lm_head, data, params, seed=seed, progress=False)

    a, b, c = run(0), run(0), run(1)
    assert a.losses == b.losses
    assert all(torch.equal(a.state_dict[k], b.state_dict[k]) for k in a.state_dict)
    assert a.losses != c.losses
    init, _ = _draft()
    assert torch.equal(a.state_dict["embed_tokens.weight"], init.embed_tokens.weight)  # frozen
    assert not torch.equal(a.state_dict["fc.weight"], init.fc.weight)
    assert set(a.eval["vllm_layout"]) == {"num_steps", "mean_acceptance_length", "per_position"}
    assert len(a.eval["vllm_layout"]["per_position"]) == params.block_size - 1


def test_unquantized_writer_has_no_quantization(tmp_path):
    """The BF16 twin of a trained draft: same names and config, no quantization_config."""
    from vllm_nemotron_spec.tiny.drafts import read_draft_state_dict

    target_dir = tmp_path / "target"
    target_dir.mkdir()
    config = _draft_config()
    (target_dir / "config.json").write_text(
        json.dumps(
            {"hidden_size": HIDDEN, "vocab_size": VOCAB, "hybrid_override_pattern": "M*-M-M*-M"}
        )
    )
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (target_dir / name).write_text("{}")
    state = drafts.init_draft_state_dict(config, 0, embed_tokens=torch.randn(VOCAB, HIDDEN))
    params = drafts.DraftParams(
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=32,
        markov_rank=16,
        sliding_window=6,
        block_size=4,
    )
    ids = drafts.spread_layer_ids(8)
    out = td.write_unquantized_draft(
        tmp_path / "bf16",
        layout.DFLASH,
        state,
        target_dir,
        params=params,
        target_layer_ids=ids,
        mask_token_id=MASK,
    )
    written = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in written and not (out / "hf_quant_config.json").exists()
    back = read_draft_state_dict(out)
    assert set(back) == set(state)
    for k, v in state.items():
        torch.testing.assert_close(back[k], v.to(torch.bfloat16).float(), rtol=0, atol=0)


def test_a_draft_trained_in_the_second_process_is_the_one_trained_in_process(tiny_family, tmp_path):
    """The shifted draft trains in a spawned process beside the DFlash one: its written files
    and stats must be what training it in this process gives."""
    from vllm_nemotron_spec.tiny.drafts import DraftParams

    _, dspec = ref.load_draft_module(tiny_family.dflash_draft)
    data_params = td.DataParams(prompt_lengths=(16,), sequences_per_length=6, new_tokens=8)
    data = td.generate_draft_data(
        tiny_family.target, 0, data_params, td.aux_hidden_state_ids(dspec), progress=False
    )
    write_kwargs = dict(
        params=DraftParams(**tiny_family.manifest()["params"]["draft"]),
        target_layer_ids=list(dspec.target_layer_ids),
        mask_token_id=dspec.mask_token_id,
    )
    params = td.TrainParams(
        label_offset=1, steps=3, seqs_per_step=2, anchors_per_seq=2, warmup_steps=1,
        eval_sequences=2,
    )  # fmt: skip

    def args(root):
        root.mkdir()
        return (root, tiny_family.target, tiny_family.dflash_draft, data, write_kwargs,
                td.DFLASH_SHIFTED, params, 1, False)  # fmt: skip

    here, _ = td._train_dflash_variant(*args(tmp_path / "here"))
    with td._second_process() as pool:
        there, _ = pool.submit(td._train_dflash_variant, *args(tmp_path / "there")).result()
    here.pop("train_seconds"), there.pop("train_seconds")
    assert here == there and here["first_loss"] != here["final_loss"]
    files = sorted(p.name for p in (tmp_path / "here" / td.DFLASH_SHIFTED).iterdir())
    assert any(f.endswith(".safetensors") for f in files)
    for name in files:
        a = (tmp_path / "here" / td.DFLASH_SHIFTED / name).read_bytes()
        assert a == (tmp_path / "there" / td.DFLASH_SHIFTED / name).read_bytes(), name
