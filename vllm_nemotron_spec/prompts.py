"""Prompt sets for ``bench``: a JSONL (or JSON array) file of prompts, or the tiny family's prompts.

A record is a JSON string or an object with one of :data:`PROMPT_KEYS` (``prompt`` / ``text``,
GSM8K's ``question``, MT-Bench's ``turns``, whose first turn is the prompt). Every problem is a
:class:`PromptFileError` naming the file, the line and the expected keys. Pure Python.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

PROMPT_KEYS = ("prompt", "text", "question", "turns")
"""Keys holding the prompt, in order of preference."""

TINY_FAMILY = "tiny-family"
"""``PromptSet.source`` of the default prompt set (``tiny.corpus.sample_prompts()``)."""


class PromptFileError(ValueError):
    """A prompt file cannot be used; the message names the file (and line) and what was expected."""


@dataclass(frozen=True)
class PromptSet:
    prompts: tuple[str, ...]
    source: str  # the file's path, or TINY_FAMILY
    key: str | None = None  # the record key the prompts came from ("prompt", "turns", ...), if any

    def take(self, num_prompts: int | None) -> list[str]:
        """The first ``num_prompts`` prompts, cycling through the set when it is shorter (all of
        them when ``num_prompts`` is None)."""
        if num_prompts is None:
            return list(self.prompts)
        if num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
        return [self.prompts[i % len(self.prompts)] for i in range(num_prompts)]


def tiny_family_prompts() -> PromptSet:
    from vllm_nemotron_spec.tiny.corpus import sample_prompts

    return PromptSet(tuple(sample_prompts()), TINY_FAMILY)


def load_prompts(path: str | Path) -> PromptSet:
    """Read a prompt file (see the module docstring for the accepted records)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PromptFileError(f"{path}: no such prompt file") from None
    except IsADirectoryError:
        raise PromptFileError(f"{path}: is a directory, expected a JSONL file of prompts") from None
    except UnicodeDecodeError as exc:
        raise PromptFileError(
            f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})"
        ) from None

    if text.lstrip().startswith("["):
        records = _json_array(path, text)
    else:
        records = _jsonl(path, text)
    if not records:
        raise PromptFileError(
            f"{path}: no prompts; expected one JSON object per line with one of the keys "
            f"{_keys()} (or a JSON string per line)"
        )
    prompts, keys = [], set()
    for where, record in records:
        prompt, key = prompt_of(record, f"{path}:{where}")
        prompts.append(prompt)
        keys.add(key)
    key = keys.pop() if len(keys) == 1 else None
    return PromptSet(tuple(prompts), str(path), key)


def prompt_of(record, where: str) -> tuple[str, str | None]:
    """The prompt text of one record and the key it came from (None for a bare string)."""
    if isinstance(record, str):
        return _nonempty(record, where, "the line"), None
    if not isinstance(record, dict):
        raise PromptFileError(
            f"{where}: expected a JSON object with one of the keys {_keys()} or a JSON string, "
            f"found {_jtype(record)}"
        )
    for key in PROMPT_KEYS:
        if key not in record:
            continue
        value = record[key]
        if key == "turns":
            if not isinstance(value, list) or not value:
                raise PromptFileError(
                    f'{where}: "turns" must be a non-empty array of strings (MT-Bench style), '
                    f"found {_jtype(value)}{' (empty)' if value == [] else ''}"
                )
            return _nonempty(value[0], where, '"turns"[0]'), key
        return _nonempty(value, where, f'"{key}"'), key
    found = ", ".join(f'"{k}"' for k in list(record)[:8]) or "none"
    raise PromptFileError(f"{where}: expected one of the keys {_keys()}, found keys: {found}")


def _jsonl(path: Path, text: str) -> list[tuple[str, object]]:
    records = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append((f"line {lineno}", json.loads(line)))
        except json.JSONDecodeError as exc:
            raise PromptFileError(
                f"{path}:line {lineno}: not valid JSON ({exc.msg} at column {exc.colno}); "
                f"expected one JSON object per line with one of the keys {_keys()}"
            ) from None
    return records


def _json_array(path: Path, text: str) -> list[tuple[str, object]]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PromptFileError(
            f"{path}:line {exc.lineno}: not valid JSON ({exc.msg} at column {exc.colno}); "
            f"expected a JSON array of objects with one of the keys {_keys()}, or JSONL"
        ) from None
    if not isinstance(data, list):
        raise PromptFileError(f"{path}: expected a JSON array, found {_jtype(data)}")
    return [(f"item {i}", record) for i, record in enumerate(data, start=1)]


def _nonempty(value, where: str, what: str) -> str:
    if not isinstance(value, str):
        raise PromptFileError(f"{where}: {what} must be a string, found {_jtype(value)}")
    if not value.strip():
        raise PromptFileError(f"{where}: {what} is an empty prompt")
    return value


def _keys() -> str:
    return ", ".join(f'"{k}"' for k in PROMPT_KEYS)


def _jtype(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__
