"""The synthetic corpus and the tiny family's tokenizer."""

from __future__ import annotations

import json

import pytest

from vllm_nemotron_spec.tiny import tokenizer as tk
from vllm_nemotron_spec.tiny.corpus import generate_documents, sample_prompts

ROUND_TRIP_TEXTS = [
    "The small cat sat on the red mat.",
    "Count from 3: 3, 4, 5, 6.",
    "12 + 7 = 19; 3 * 4 = 12.",
    "Unseen words: zebra, quokka, naïve café, 東京, emoji 🙂, tabs\tand\nnewlines.",
    "  leading and trailing spaces  ",
]


def test_corpus_is_deterministic_and_seeded():
    a = generate_documents(0, 300)
    assert a == generate_documents(0, 300)
    assert a != generate_documents(1, 300)
    assert len(a) == 300 and all(isinstance(d, str) and d and "\n" not in d for d in a)
    # structured: every document ends with a full stop, and several kinds appear
    assert all(d.endswith(".") for d in a)
    assert any(d.startswith("Count") for d in a)
    assert any(d.startswith(("Days:", "Months:", "Letters:", "Words:")) for d in a)
    assert any(" = " in d for d in a)
    assert any("Q: " in d for d in a)


def test_corpus_rejects_empty():
    with pytest.raises(ValueError, match="num_docs"):
        generate_documents(0, 0)


def test_tokenizer_training_is_deterministic():
    docs = generate_documents(3, 800)
    a = tk.train_tokenizer(docs).to_str()
    assert a == tk.train_tokenizer(docs).to_str()


def test_tokenizer_layout(tiny_family):
    tok = tk.load_tokenizer(tiny_family.tokenizer)
    assert tok.get_vocab_size(with_added_tokens=True) == 1024
    for token_id, token in enumerate(tk.SPECIAL_TOKENS):
        assert tok.token_to_id(token) == token_id
    assert tok.token_to_id("<mask>") == tk.MASK_ID == 4
    # digits are split one per token
    ids = tok.encode("1234", add_special_tokens=False).ids
    assert [tok.id_to_token(i) for i in ids] == ["1", "2", "3", "4"]


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_mask_token_matches_draft_config(tiny_family, kind):
    config = json.loads((tiny_family.draft(kind) / "config.json").read_text())
    tok = tk.load_tokenizer(tiny_family.draft(kind))
    assert tok.id_to_token(config["mask_token_id"]) == "<mask>"
    assert tok.id_to_token(config["dflash_config"]["mask_token_id"]) == "<mask>"
    assert tok.id_to_token(config["pard_token"]) == "<mask>"


def test_every_model_dir_has_the_same_tokenizer(tiny_family):
    for name in tk.TOKENIZER_FILES:
        ref = (tiny_family.tokenizer / name).read_bytes()
        for model_dir in (tiny_family.target, tiny_family.dflash_draft, tiny_family.dspark_draft):
            assert (model_dir / name).read_bytes() == ref, (
                f"{model_dir}/{name} differs from the target's"
            )


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS + sample_prompts())
def test_tokenizer_round_trip(tiny_family, text):
    tok = tk.load_tokenizer(tiny_family.tokenizer)
    enc = tok.encode(text)
    assert enc.ids[0] == tk.BOS_ID  # BOS added by the post-processor
    assert tok.decode(enc.ids, skip_special_tokens=True) == text


def test_corpus_text_is_compact(tiny_family):
    """BPE learned the corpus: corpus text takes few tokens per word."""
    tok = tk.load_tokenizer(tiny_family.tokenizer)
    docs = generate_documents(0, 200)
    words = sum(len(d.split()) for d in docs)
    tokens = sum(len(tok.encode(d, add_special_tokens=False).ids) for d in docs)
    assert tokens < 2.2 * words


def test_transformers_autotokenizer(tiny_family):
    from transformers import AutoTokenizer

    tok = tk.load_tokenizer(tiny_family.tokenizer)
    hf = AutoTokenizer.from_pretrained(str(tiny_family.tokenizer))
    assert len(hf) == 1024
    assert (
        hf.unk_token_id,
        hf.bos_token_id,
        hf.eos_token_id,
        hf.pad_token_id,
        hf.mask_token_id,
    ) == (
        0,
        1,
        2,
        3,
        4,
    )
    for text in ROUND_TRIP_TEXTS:
        ids = hf(text)["input_ids"]
        assert ids == tok.encode(text).ids
        assert hf.decode(ids, skip_special_tokens=True) == text
    chat = hf.apply_chat_template(
        [{"role": "user", "content": "The small cat"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<s><|im_start|>user\nThe small cat<|im_end|>\n<|im_start|>assistant\n<think>\n"


def test_chat_tokens_are_single_tokens_after_the_merges(tiny_family):
    """The reasoning and tool-call markers are one token each (vLLM's nemotron_v3 reasoning
    parser and qwen3_coder tool parser look them up by id), placed after the BPE merges, so the
    corpus encodes as it would without them; ``<|im_start|>`` / ``<|im_end|>`` are special."""
    tok = tk.load_tokenizer(tiny_family.tokenizer)
    ids = [tok.token_to_id(t) for t in tk.CHAT_TOKENS]
    assert None not in ids and ids == list(range(ids[0], ids[0] + len(ids)))
    assert tok.token_to_id("<reserved_0>") == ids[-1] + 1
    text = "a<think>b</think><tool_call>c</tool_call>"
    encoded = tok.encode(text, add_special_tokens=False).ids
    assert [i for i in encoded if i in ids] == ids[2:]
    assert tok.decode(encoded, skip_special_tokens=True) == text
    chat = tok.encode("<|im_start|>user<|im_end|>", add_special_tokens=False).ids
    assert chat[0] == ids[0] and chat[-1] == ids[1]
    assert tok.decode(chat, skip_special_tokens=True) == "user"
    for doc in generate_documents(0, 200):
        assert not set(tok.encode(doc).ids) & set(ids)


def test_chat_template_renders_tools_reasoning_and_tool_calls(tiny_family):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tiny_family.tokenizer))
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Paris.",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "content": "sunny"},
    ]
    text = hf.apply_chat_template(
        messages, tools=[tool], tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert text.startswith("<s><|im_start|>system\nBe brief.\n\n# Tools\n")
    assert '{"name": "get_weather", "parameters":' in text
    assert (
        "<|im_start|>assistant\n<think>Paris.</think>\n<tool_call>\n<function=get_weather>\n"
        "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
    ) in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n<think></think>")
