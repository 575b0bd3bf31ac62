"""Prompt-set loading for ``bench``: the accepted record shapes, and errors for everything else."""

from __future__ import annotations

import json

import pytest

from vllm_nemotron_spec.prompts import (
    TINY_FAMILY,
    PromptFileError,
    PromptSet,
    load_prompts,
    tiny_family_prompts,
)


def write(tmp_path, text: str, name: str = "prompts.jsonl"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def jsonl(*records) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def test_prompt_key_and_blank_lines(tmp_path):
    path = write(tmp_path, jsonl({"prompt": "a b"}, {"prompt": "c", "output_tokens": 3}) + "\n  \n")
    got = load_prompts(path)
    assert got.prompts == ("a b", "c")
    assert got.source == str(path)
    assert got.key == "prompt"


def test_text_key_and_bare_strings(tmp_path):
    assert load_prompts(write(tmp_path, jsonl({"text": "x"}))).prompts == ("x",)
    got = load_prompts(write(tmp_path, jsonl("one", "two")))
    assert got.prompts == ("one", "two")
    assert got.key is None


def test_gsm8k_style_uses_question(tmp_path):
    path = write(
        tmp_path,
        jsonl(
            {"question": "Natalia sold 48 clips. How many?", "answer": "#### 72"},
            {"question": "Weng earns $12 an hour. How much?", "answer": "#### 10"},
        ),
    )
    got = load_prompts(path)
    assert got.prompts == ("Natalia sold 48 clips. How many?", "Weng earns $12 an hour. How much?")
    assert got.key == "question"


def test_mt_bench_style_uses_first_turn(tmp_path):
    path = write(
        tmp_path,
        jsonl(
            {
                "question_id": 81,
                "category": "writing",
                "turns": ["Write a blog post.", "Rewrite it."],
            },
        ),
    )
    got = load_prompts(path)
    assert got.prompts == ("Write a blog post.",)
    assert got.key == "turns"


def test_prompt_key_wins_over_later_keys(tmp_path):
    got = load_prompts(write(tmp_path, jsonl({"question": "q", "prompt": "p"})))
    assert got.prompts == ("p",)


def test_json_array_file(tmp_path):
    path = write(tmp_path, json.dumps([{"prompt": "a"}, "b", {"turns": ["c"]}]), "p.json")
    got = load_prompts(path)
    assert got.prompts == ("a", "b", "c")
    assert got.key is None  # mixed keys


def test_take_cycles_and_truncates():
    ps = PromptSet(("a", "b", "c"), "x")
    assert ps.take(None) == ["a", "b", "c"]
    assert ps.take(2) == ["a", "b"]
    assert ps.take(7) == ["a", "b", "c", "a", "b", "c", "a"]
    with pytest.raises(ValueError, match="num_prompts must be >= 1, got 0"):
        ps.take(0)


def test_tiny_family_prompts():
    from vllm_nemotron_spec.tiny.corpus import sample_prompts

    got = tiny_family_prompts()
    assert got.source == TINY_FAMILY
    assert list(got.prompts) == sample_prompts()


@pytest.mark.parametrize(
    "text, message",
    [
        (
            '{"prompt": "ok"}\n{"prompt": "ok"\n',
            r":line 2: not valid JSON \(Expecting ',' delimiter",
        ),
        (
            '{"prompt": "ok"}\n{"input": "x", "output": "y"}\n',
            r':line 2: expected one of the keys "prompt", "text", "question", "turns", '
            r'found keys: "input", "output"',
        ),
        ('{"prompt": 3}\n', r':line 1: "prompt" must be a string, found number'),
        ('{"question": "  "}\n', r':line 1: "question" is an empty prompt'),
        (
            '{"turns": []}\n',
            r':line 1: "turns" must be a non-empty array of strings \(MT-Bench '
            r"style\), found array \(empty\)",
        ),
        ('{"turns": "hi"}\n', r':line 1: "turns" must be a non-empty array of strings'),
        ('{"turns": [1]}\n', r':line 1: "turns"\[0\] must be a string, found number'),
        (
            '{"prompt": "ok"}\n3\n',
            r":line 2: expected a JSON object with one of the keys .* or a "
            r"JSON string, found number",
        ),
        ("\n\n", r': no prompts; expected one JSON object per line with one of the keys "prompt"'),
    ],
)
def test_errors_name_file_line_and_expected_keys(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(PromptFileError, match=message) as err:
        load_prompts(path)
    assert str(err.value).startswith(str(path))


def test_json_array_errors_name_the_item(tmp_path):
    path = write(tmp_path, json.dumps([{"prompt": "a"}, {"nope": 1}]), "p.json")
    with pytest.raises(PromptFileError, match=r"p\.json:item 2: expected one of the keys"):
        load_prompts(path)
    path = write(tmp_path, '{"prompt": "a"}', "obj.json")  # a single object is one JSONL line
    assert load_prompts(path).prompts == ("a",)
    path = write(tmp_path, '[{"prompt": "a"},', "bad.json")
    with pytest.raises(PromptFileError, match=r"bad\.json:line 1: not valid JSON"):
        load_prompts(path)


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(PromptFileError, match=r"nope\.jsonl: no such prompt file"):
        load_prompts(tmp_path / "nope.jsonl")
    with pytest.raises(PromptFileError, match="is a directory"):
        load_prompts(tmp_path)


def test_not_utf8(tmp_path):
    path = tmp_path / "bin.jsonl"
    path.write_bytes(b'{"prompt": "\xff"}\n')
    with pytest.raises(PromptFileError, match=r"bin\.jsonl: not UTF-8 text"):
        load_prompts(path)
