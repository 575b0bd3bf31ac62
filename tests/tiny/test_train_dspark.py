"""The DSpark side of the draft trainer: the reference step (query layouts, sliding window and
sinks as vLLM's attention kernel applies them, the sequential Markov walk) and the trained tiny
DSpark draft with its wrong-anchor twin.

The reference tests build tiny random drafts here; the trained-draft tests use the cached drafts of
``ensure_trained_drafts`` (trained once, ~1.5 minutes on 2 cores, then reused)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from vllm_nemotron_spec.checkpoint import layout
from vllm_nemotron_spec.checkpoint.spec import DraftSpec
from vllm_nemotron_spec.tiny import drafts
from vllm_nemotron_spec.tiny import reference as ref
from vllm_nemotron_spec.tiny import train_draft as td

MASK = 4
VOCAB = 64
HIDDEN = 32
WINDOW = 6


def _config(sample_from_anchor: bool = False) -> dict:
    params = drafts.DraftParams(
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=32,
        markov_rank=16,
        sliding_window=WINDOW,
        block_size=4,
    )
    config = drafts.draft_config(
        layout.DSPARK,
        hidden_size=HIDDEN,
        vocab_size=VOCAB,
        target_layer_ids=drafts.spread_layer_ids(8),
        params=params,
        mask_token_id=MASK,
    )
    if sample_from_anchor:
        config.update(sample_from_anchor=True, dspark_bonus_anchor=False)
        config["dflash_config"]["sample_from_anchor"] = True
    return config


def _draft(sample_from_anchor: bool = False, seed: int = 0) -> ref.DSparkDraft:
    config = _config(sample_from_anchor)
    model = ref.DSparkDraft(DraftSpec.from_config(config))
    model.load_state_dict(drafts.init_draft_state_dict(config, seed))
    return model.eval()


def _inputs(S=2, T=24, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, VOCAB, (S, T), generator=g), torch.randn(S, T, 6 * HIDDEN, generator=g)


def _lm_head(seed=3):
    return torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------
# the module and the attention it runs
# ------------------------------------------------------------------------------------------


def test_module_state_dict_uses_the_checkpoint_names():
    config = _config()
    model = _draft()
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes == layout.logical_shapes(config)
    assert shapes["markov_head.markov_w1.weight"] == (VOCAB, 16)
    assert shapes["markov_head.markov_w2.weight"] == (VOCAB, 16)  # a linear rank -> vocab
    assert model.causal and model.sliding_window == WINDOW and not model.sample_from_anchor
    assert _draft(sample_from_anchor=True).sample_from_anchor


def test_attention_matches_vllm_cpu_kernel():
    """Sliding window and sinks as vLLM's CPU attention kernel applies them (the same convention
    as flash-attn's ``window_size=(sliding_window - 1, 0)``): a query at position ``p`` sees keys
    at ``p - sliding_window < pos <= p``; a sink is one logit per head added to the softmax
    denominator, unscaled, carrying no value."""
    import vllm._custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    nh, nkv, hd, page = 4, 2, 32, 16
    L, B, W = 21, 5, 8  # context positions 0..20, block rows at 21..25
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, B, nh, hd, generator=g)
    k, v = (torch.randn(1, L + B, nkv, hd, generator=g) for _ in range(2))
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])

    isa = _get_attn_isa(torch.float32, page, hd)
    cache = torch.zeros(2, nkv, 2 * page, hd)
    key_cache, value_cache = cache.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(k[0], v[0], key_cache, value_cache, torch.arange(L + B), isa)
    query_start = torch.tensor([0, B], dtype=torch.int32)
    seq_lens = torch.tensor([L + B], dtype=torch.int32)
    meta = ops.cpu_attn_get_scheduler_metadata(
        1, nh, nkv, hd, seq_lens, torch.float32, query_start, True, W, isa, False
    )
    expected = torch.zeros(B, nh, hd)
    ops.cpu_attention_with_kv_cache(
        q[0],
        key_cache,
        value_cache,
        expected,
        query_start,
        seq_lens,
        hd**-0.5,
        True,
        None,
        W,
        torch.arange(2, dtype=torch.int32)[None],
        0.0,
        meta,
        sinks,
    )
    anchors = torch.tensor([[L]])
    dense = ref.attention(
        q, k, v, ref.block_attention_mask(anchors, B, L, causal=True, sliding_window=W), sinks
    )
    torch.testing.assert_close(dense.view(B, nh, hd), expected, rtol=1e-5, atol=1e-5)

    def in_window(x):  # the W - 1 context positions before L, then the block
        return torch.cat([x[:, L - W + 1 : L], x[:, L:]], dim=1)

    per_block = ref.attention(
        q,
        in_window(k),
        in_window(v),
        ref.windowed_block_attention_mask(anchors, B, W, causal=True),
        sinks,
    )
    torch.testing.assert_close(per_block.view(B, nh, hd), expected, rtol=1e-5, atol=1e-5)


def test_windowed_mask_is_the_dense_mask_restricted_to_the_window():
    anchors = torch.tensor([[3, 9]])  # L = 3: part of the window lies before position 0
    per_block = ref.windowed_block_attention_mask(anchors, 3, 4, causal=True).view(2, 3, 3 + 3)
    dense = ref.block_attention_mask(anchors, 3, 12, causal=True, sliding_window=4)[0]
    for k, L in enumerate(anchors[0].tolist()):
        rows = dense[3 * k : 3 * k + 3]
        ctx_pos = torch.arange(L - 3, L)
        expected_ctx = torch.where(ctx_pos[None] >= 0, rows[:, ctx_pos.clamp(min=0)], False)
        assert torch.equal(per_block[k, :, :3], expected_ctx)
        assert torch.equal(per_block[k, :, 3:], rows[:, 12 + 3 * k : 12 + 3 * k + 3])
        assert not rows[:, :12][:, : max(L - 3, 0)].any()  # nothing outside the window


def test_windowed_forward_equals_the_dense_mask_forward():
    model = _draft()
    tokens, aux = _inputs(S=2, T=30)
    anchors = torch.tensor([[2, 11, 25], [5, 6, 20]])  # some windows reach before position 0
    fast = ref.draft_forward(model, aux, tokens, anchors, 4)
    dense = ref.draft_forward(model, aux, tokens, anchors, 4, dense_mask=True)
    torch.testing.assert_close(fast, dense, rtol=1e-5, atol=1e-5)
    # The window hides context before L - (WINDOW - 1) from every row of the block at L.
    old = aux.clone()
    old[:, : 20 - (WINDOW - 1)] += 1.0  # before the windows of L = 25 and L = 20
    moved = ref.draft_forward(model, old, tokens, anchors[:, 2:], 4)
    torch.testing.assert_close(moved, fast[:, 2:], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------
# query layouts and the Markov walk
# ------------------------------------------------------------------------------------------


def test_bonus_layout_drops_row_zero_and_anchor_layout_uses_it():
    tokens, aux = _inputs(S=1, T=20)
    anchors, lm_head = torch.tensor([[9, 14]]), _lm_head()
    bonus, anchor = _draft(), _draft(sample_from_anchor=True)  # same weights, two layouts
    u_bonus = ref.dspark_base_logits(bonus, lm_head, aux, tokens, anchors, 3)
    u_anchor = ref.dspark_base_logits(anchor, lm_head, aux, tokens, anchors, 3)
    # Bonus anchor: [b, MASK x 3] at L .. L+3, U_k from row k (the MASK at L + k).
    rows = ref.draft_forward(bonus, aux, tokens, anchors, 4)
    torch.testing.assert_close(u_bonus, ref.draft_logits(rows[:, :, 1:], lm_head))
    # Anchor layout: [b, MASK x 2] at L .. L+2, U_k from row k - 1 (row r predicts L + r + 1).
    rows = ref.draft_forward(anchor, aux, tokens, anchors, 3)
    torch.testing.assert_close(u_anchor, ref.draft_logits(rows, lm_head))
    # Causal blocks: the anchor layout's U_k is the bonus layout's U_{k-1}, one row off.
    torch.testing.assert_close(u_anchor[:, :, 1:], u_bonus[:, :, :-1], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(u_anchor, u_bonus)


def _walk(model, base, bonus):
    """The reference walk with ``model``'s Markov head."""
    head = model.markov_head
    with torch.no_grad():
        return ref.markov_walk(base, bonus, head.markov_w1.weight, head.markov_w2.weight)


def test_markov_walk_feeds_each_draft_to_the_next_position():
    model = _draft()
    g = torch.Generator().manual_seed(5)
    base = torch.randn(3, 4, VOCAB, generator=g)
    bonus = torch.tensor([7, 8, 9])
    drafted, logits = _walk(model, base, bonus)
    w1, w2 = model.markov_head.markov_w1.weight, model.markov_head.markov_w2.weight
    with torch.no_grad():
        prev = bonus
        for k in range(4):
            expected = base[:, k] + w1[prev] @ w2.T  # U_k + markov_w2(markov_w1[prev])
            torch.testing.assert_close(logits[:, k], expected)
            assert torch.equal(drafted[:, k], expected.argmax(-1))
            prev = drafted[:, k]
    # The bias depends on the previous token: another bonus changes the first position's logits.
    _, other = _walk(model, base, torch.tensor([10, 8, 9]))
    assert not torch.allclose(other[0, 0], logits[0, 0]) and torch.equal(other[1:], logits[1:])


def test_walk_without_markov_bias_is_the_argmax_of_the_base_logits():
    model = _draft()
    with torch.no_grad():
        model.markov_head.markov_w2.weight.zero_()
    base = torch.randn(2, 4, VOCAB, generator=torch.Generator().manual_seed(6))
    drafted, logits = _walk(model, base, torch.tensor([5, 6]))
    assert torch.equal(drafted, base.argmax(-1))
    torch.testing.assert_close(logits, base, rtol=0, atol=0)


def test_teacher_forcing_is_the_walk_when_every_draft_is_right():
    """Training feeds the true previous token to the Markov head; along a sequence the walk
    itself drafted, that is exactly the walk's logits."""
    model, lm_head = _draft(), _lm_head()
    tokens, aux = _inputs(S=1, T=20)
    L, gamma = 12, 4
    drafted, walk_logits = ref.dspark_propose(
        model, lm_head, aux[0, :L], tokens[0, :L], int(tokens[0, L]), gamma
    )
    along = tokens.clone()
    along[0, L + 1 : L + 1 + gamma] = torch.tensor(drafted)
    with torch.no_grad():
        forced = td.dspark_teacher_forced_logits(
            model, lm_head, aux, along, torch.tensor([[L]]), gamma
        )
    torch.testing.assert_close(forced[0, 0], walk_logits, rtol=1e-5, atol=1e-5)
    assert walk_logits.shape == (gamma, VOCAB) and len(drafted) == gamma


def test_propose_uses_the_context_window_and_the_bonus():
    model, lm_head = _draft(), _lm_head()
    tokens, aux = _inputs(S=1, T=20)
    L = 15
    drafted, logits = ref.dspark_propose(
        model, lm_head, aux[0, :L], tokens[0, :L], int(tokens[0, L]), 3
    )
    older = aux.clone()
    older[0, : L - (WINDOW - 1)] += 3.0  # outside the window: no effect
    same, same_logits = ref.dspark_propose(
        model, lm_head, older[0, :L], tokens[0, :L], int(tokens[0, L]), 3
    )
    assert same == drafted
    torch.testing.assert_close(same_logits, logits, rtol=1e-5, atol=1e-5)
    _, other = ref.dspark_propose(
        model, lm_head, aux[0, :L], tokens[0, :L], (int(tokens[0, L]) + 1) % VOCAB, 3
    )
    assert not torch.allclose(other, logits)


def test_training_is_deterministic_and_trains_backbone_and_markov_head():
    tokens, aux = _inputs(S=6, T=24, seed=8)
    data = td.DraftData(tokens, torch.full((6,), 6), torch.full((6,), 24), aux)
    params = td.TrainParams(
        block_size=4,
        steps=3,
        seqs_per_step=2,
        anchors_per_seq=4,
        warmup_steps=1,
        eval_sequences=2,
    )

    def run(seed):
        return td.train_dspark_draft(_draft(), _lm_head(), data, params, seed, progress=False)

    a, b, c = run(0), run(0), run(1)
    assert a.losses == b.losses and a.losses != c.losses
    assert all(torch.equal(a.state_dict[k], b.state_dict[k]) for k in a.state_dict)
    init = _draft().state_dict()
    changed = {k for k in init if not torch.equal(a.state_dict[k], init[k])}
    assert "embed_tokens.weight" not in changed  # frozen
    assert {
        "markov_head.markov_w1.weight",
        "markov_head.markov_w2.weight",
        "fc.weight",
        "layers.0.self_attn.attention_sink_bias",
    } <= changed
    assert a.eval["gamma"] == 3 and len(a.eval["acceptance"]["per_position"]) == 3


# ------------------------------------------------------------------------------------------
# the trained tiny DSpark draft
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tiny_family):
    return td.ensure_trained_drafts(seed=0, family=tiny_family)


@pytest.fixture(scope="module")
def fresh_data(tiny_family, trained):
    """Target greedy continuations of prompts from documents the trainer never saw (another
    corpus seed), with the DSpark draft's aux hidden states."""
    from vllm_nemotron_spec._torch import deterministic_torch

    params = td.DataParams(
        prompt_lengths=(24, 96), sequences_per_length=6, new_tokens=32, num_docs=300
    )
    ids = td.aux_hidden_state_ids(DraftSpec.from_pretrained(trained.dspark))
    with deterministic_torch(1):
        return td.generate_draft_data(tiny_family.target, 7, params, ids, progress=False)


def _acceptance(path, tiny_family, data, gamma):
    from vllm_nemotron_spec._torch import deterministic_torch

    model, _ = ref.load_draft_module(path)
    with deterministic_torch(1):
        return td.offline_dspark_acceptance(
            model, td.target_lm_head(tiny_family.target), data, gamma
        )["mean_acceptance_length"]


def test_trained_dspark_accepts_in_the_bonus_layout(tiny_family, trained, fresh_data):
    assert _acceptance(trained.dspark, tiny_family, fresh_data, 3) >= 2.5
    stats = trained.manifest()["stats"][td.DSPARK]
    assert stats["offline_dspark"]["gamma_3"]["mean_acceptance_length"] >= 2.8


def test_wrong_anchor_twin_collapses(tiny_family, trained, fresh_data):
    assert _acceptance(trained.dspark_wrong_anchor, tiny_family, fresh_data, 3) < 1.5
    stats = trained.manifest()["stats"][td.DSPARK]
    assert stats["offline_dspark_wrong_anchor"]["gamma_3"]["mean_acceptance_length"] < 1.5


def test_trained_checkpoints_pass_inspection(tiny_family, trained):
    from vllm_nemotron_spec.checkpoint.inspect import inspect_checkpoint

    for path, anchor in ((trained.dspark, False), (trained.dspark_wrong_anchor, True)):
        report = inspect_checkpoint(str(path), str(tiny_family.target))
        assert report["ok"] and report["problems"] == [], report["problems"]
        assert report["method"] == "dspark" and report["sample_from_anchor"] is anchor


def test_trained_config_is_the_family_layout(tiny_family, trained):
    family = json.loads((tiny_family.dspark_draft / "config.json").read_text())
    assert json.loads((trained.dspark / "config.json").read_text()) == family
    wrong = json.loads((trained.dspark_wrong_anchor / "config.json").read_text())
    changed = {k for k in family if family[k] != wrong.get(k)} | (set(wrong) - set(family))
    assert changed == {"sample_from_anchor", "dspark_bonus_anchor", "dflash_config"}
    assert wrong["sample_from_anchor"] is True and wrong["dflash_config"]["sample_from_anchor"]
    assert {k: v for k, v in wrong["dflash_config"].items() if k != "sample_from_anchor"} == {
        k: v for k, v in family["dflash_config"].items() if k != "sample_from_anchor"
    }
    weights = [
        (path / "model.safetensors").read_bytes()
        for path in (trained.dspark, trained.dspark_wrong_anchor)
    ]
    assert weights[0] == weights[1]  # identical


def test_markov_head_is_stored_as_in_the_official_checkpoint(tiny_family, trained):
    config = json.loads((trained.dspark / "config.json").read_text())
    V, r = config["vocab_size"], config["markov_rank"]
    with safe_open(str(trained.dspark / "model.safetensors"), framework="pt") as f:
        dtypes = {k: (f.get_tensor(k).dtype, tuple(f.get_tensor(k).shape)) for k in f.keys()}
    assert dtypes["markov_head.markov_w2.weight"] == (torch.uint8, (V, r // 2))
    assert dtypes["markov_head.markov_w2.weight_scale"] == (torch.float8_e4m3fn, (V, r // 16))
    assert dtypes["markov_head.markov_w2.weight_scale_2"] == (torch.float32, ())
    assert dtypes["markov_head.markov_w1.weight"] == (torch.bfloat16, (V, r))
    assert dtypes["layers.0.self_attn.attention_sink_bias"] == (
        torch.bfloat16,
        (config["num_attention_heads"],),
    )
    assert {n: d for n, d in dtypes.items()} == {
        n: (getattr(torch, d), s) for n, (d, s) in layout.checkpoint_layout(config).items()
    }
    # Trained, not the family's random init.
    family = drafts.read_draft_state_dict(tiny_family.dspark_draft)
    ours = drafts.read_draft_state_dict(trained.dspark)
    name = "markov_head.markov_w2.weight"
    assert not torch.equal(ours[name], family[name])


def test_reference_propose_is_the_offline_walk(tiny_family, trained, fresh_data):
    """One step of :func:`~vllm_nemotron_spec.tiny.reference.dspark_propose` (how an engine test calls it) drafts what
    the offline acceptance walk drafts at the same anchor."""
    model, _ = ref.load_draft_module(trained.dspark)
    lm_head = td.target_lm_head(tiny_family.target)
    s, gamma = 0, 3
    L = int(fresh_data.prompt_lens[s]) + 5
    tokens, aux = fresh_data.tokens[s], fresh_data.aux[s]
    drafted, logits = ref.dspark_propose(model, lm_head, aux[:L], tokens[:L], int(tokens[L]), gamma)
    with torch.no_grad():
        base = ref.dspark_base_logits(
            model, lm_head, aux[None], tokens[None], torch.tensor([[L]]), gamma
        )
        walk, walk_logits = _walk(model, base[0], tokens[L : L + 1])
    assert drafted == walk[0].tolist()
    torch.testing.assert_close(logits, walk_logits[0], rtol=1e-4, atol=1e-4)
