"""Structured-output guides for the tiny family, shared by the offline and the served tests.

Each guide is the ``structured_outputs`` of a request (vLLM's ``StructuredOutputsParams`` fields,
also the ``structured_outputs`` field of the OpenAI-compatible server's request body) and a check
that a finished output satisfies it. The guides stay close to the tiny corpus ("The green cat
walks every morning."), so the drafts can be accepted under them, and each ends within
:data:`MAX_TOKENS` tokens: a finished guide allows only EOS, so every guided output must stop
(``finish_reason`` "stop") and satisfy its guide in full.

Whitespace: a JSON schema guide lets the model put whitespace between any two JSON tokens, and the
tiny target (trained on prose, never on JSON) fills the output with spaces. Engines with the
xgrammar backend turn that off (``disable_any_whitespace``, an engine setting that vLLM allows
only with an explicit xgrammar or guidance backend); with ``auto`` the JSON guides are a string
and an integer, which have no whitespace positions.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Callable

MAX_TOKENS = 64
"""Enough for the longest output any guide allows (about 50 tokens of the tiny tokenizer)."""

PROMPTS = (
    "The small cat",
    "One day, Ben found a blue box in the garden. The old horse",
    "Anna has a red dog. Q: What color is the dog? A:",
)

SENTENCE = r"The [a-z]{1,8} [a-z]{1,8}( [a-z]{1,8}){0,3}\."

JSON_SCHEMA = {
    "type": "object",
    "properties": {
        "sentence": {"type": "string", "maxLength": 32},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["sentence", "count"],
    "additionalProperties": False,
}

JSON_STRING = {"type": "string", "pattern": "^The [a-z]{1,8} [a-z]{1,8}( [a-z]{1,8}){0,3}\\.$"}
"""A JSON string (quoted): no whitespace positions, so it ends under ``auto`` too."""

JSON_MULTIPLE_OF = {"type": "integer", "minimum": 0, "maximum": 100, "multipleOf": 5}
"""xgrammar does not support ``multipleOf``: vLLM's ``auto`` hands this one to guidance."""

CHOICES = [
    "The small cat sat on the red mat.",
    "The red dog ran happily.",
    "The old horse was big.",
]

ADJECTIVES = ("small", "big", "red", "green", "old", "white")
NOUNS = ("cat", "dog", "horse", "bird", "rabbit")
VERBS = ("ran", "sat", "was big", "rests happily", "walks every morning")

EBNF_GRAMMAR = "\n".join(
    [
        'root ::= "The " adj " " noun " " verb "."',
        "adj ::= " + " | ".join(f'"{a}"' for a in ADJECTIVES),
        "noun ::= " + " | ".join(f'"{n}"' for n in NOUNS),
        "verb ::= " + " | ".join(f'"{v}"' for v in VERBS),
    ]
)
"""GBNF, xgrammar's grammar syntax."""

LARK_GRAMMAR = "\n".join(
    [
        'start: "The " adj " " noun " " verb "."',
        "adj: " + " | ".join(f'"{a}"' for a in ADJECTIVES),
        "noun: " + " | ".join(f'"{n}"' for n in NOUNS),
        "verb: " + " | ".join(f'"{v}"' for v in VERBS),
    ]
)
"""The same grammar in Lark syntax (xgrammar compiles it too)."""

_GRAMMAR_RE = re.compile(
    "The ({}) ({}) ({})\\.".format(*("|".join(w) for w in (ADJECTIVES, NOUNS, VERBS)))
)


def _satisfies_schema(schema: dict) -> Callable[[str], bool]:
    def check(text: str) -> bool:
        import jsonschema

        try:
            jsonschema.validate(json.loads(text), schema)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True

    return check


@dataclass(frozen=True)
class Guide:
    name: str
    params: dict  # StructuredOutputsParams fields (and the server's ``structured_outputs``)
    satisfied_by: Callable[[str], bool]

    def __repr__(self) -> str:  # pytest ids, failure messages
        return f"Guide({self.name})"


def guides(backend: str) -> list[Guide]:
    """The guides for an engine whose structured-outputs backend is ``backend``: "xgrammar"
    (with ``disable_any_whitespace``) or "auto". JSON schema, regex, choice and grammar (GBNF and
    Lark syntax) for both; the JSON schemas differ (see the module docstring), and ``auto``
    adds one that xgrammar refuses, so vLLM falls back to guidance."""
    if backend == "xgrammar":
        json_guides = [Guide("json", {"json": JSON_SCHEMA}, _satisfies_schema(JSON_SCHEMA))]
    elif backend == "auto":
        json_guides = [
            Guide("json", {"json": JSON_STRING}, _satisfies_schema(JSON_STRING)),
            Guide(
                "json-multipleOf", {"json": JSON_MULTIPLE_OF}, _satisfies_schema(JSON_MULTIPLE_OF)
            ),
        ]
    else:
        raise ValueError(f"no guides for backend {backend!r}")
    return json_guides + [
        Guide("regex", {"regex": SENTENCE}, lambda t: re.fullmatch(SENTENCE, t) is not None),
        Guide("choice", {"choice": CHOICES}, lambda t: t in CHOICES),
        Guide("grammar", {"grammar": EBNF_GRAMMAR}, lambda t: _GRAMMAR_RE.fullmatch(t) is not None),
        Guide(
            "grammar-lark",
            {"grammar": LARK_GRAMMAR},
            lambda t: _GRAMMAR_RE.fullmatch(t) is not None,
        ),
    ]


def xgrammar_refuses(guide: Guide) -> bool:
    """Whether vLLM's xgrammar validation refuses the guide (then ``auto`` picks guidance or
    outlines)."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import StructuredOutputsParams
    from vllm.v1.structured_output.backend_xgrammar import validate_xgrammar_grammar

    try:
        validate_xgrammar_grammar(
            SamplingParams(structured_outputs=StructuredOutputsParams(**guide.params))
        )
    except VLLMValidationError:
        return True
    return False
