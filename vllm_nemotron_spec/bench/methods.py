"""Method specs (``METHOD[:DRAFT_DIR][:K]``): parsing, defaults from the draft's config, labels."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

from vllm_nemotron_spec.bench.stats import BenchError

NO_DRAFT_METHODS = ("plain", "ngram")
DRAFT_METHODS = ("dflash", "dspark", "eagle3", "draft_model")
METHODS = NO_DRAFT_METHODS + DRAFT_METHODS
FAMILY_DRAFTS = ("dflash", "dspark")
"""Methods the tiny family has a draft for (see ``family_draft``)."""


def family_draft(method: str, family) -> str:
    """The tiny family's draft for ``method`` (dflash or dspark), trained against the tiny target
    (trained on first use, then cached)."""
    from vllm_nemotron_spec.tiny.train_draft import ensure_trained_drafts

    return str(getattr(ensure_trained_drafts(family=family), method))


DEFAULT_NGRAM_TOKENS = 5
"""``num_speculative_tokens`` of ``ngram`` when not given (vLLM requires one)."""


@dataclass(frozen=True)
class MethodSpec:
    method: str  # one of METHODS
    draft: str | None = None
    num_speculative_tokens: int | None = None
    label: str = ""

    @property
    def is_speculative(self) -> bool:
        return self.method != "plain"

    def speculative_config(self) -> dict | None:
        if not self.is_speculative:
            return None
        config: dict = {"method": self.method}
        if self.draft is not None:
            config["model"] = self.draft
        if self.num_speculative_tokens is not None:
            config["num_speculative_tokens"] = self.num_speculative_tokens
        return config


def parse_method_spec(text: str) -> MethodSpec:
    """``plain``, ``ngram[:K]``, ``dflash[:DRAFT_DIR][:K]`` (also dspark, eagle3, draft_model).

    A trailing ``:K`` that is an integer is the number of drafted tokens per step; the draft
    directory may itself contain ``:``."""
    name, _, rest = text.strip().partition(":")
    name = name.strip().lower()
    if name not in METHODS:
        raise BenchError(
            f"--method {text!r}: unknown method {name!r}; expected one of {', '.join(METHODS)} "
            "as METHOD[:DRAFT_DIR][:K]"
        )
    draft, k = None, None
    if rest:
        head, sep, tail = rest.rpartition(":")
        if re.fullmatch(r"-?\d+", rest):
            k_text = rest
        elif sep and re.fullmatch(r"-?\d+", tail):
            draft, k_text = head, tail
        else:
            draft, k_text = rest, None
        if k_text is not None:
            k = int(k_text)
            if k < 1:
                raise BenchError(
                    f"--method {text!r}: num_speculative_tokens must be a positive integer, "
                    f"found {k}"
                )
        if draft is not None and not draft:
            raise BenchError(f"--method {text!r}: empty draft directory")
    if name == "plain" and (draft or k):
        raise BenchError(f"--method {text!r}: plain decoding takes no draft and no K; use 'plain'")
    if name == "ngram" and draft:
        raise BenchError(
            f"--method {text!r}: ngram takes no draft directory; use 'ngram' or 'ngram:K'"
        )
    return MethodSpec(name, draft, k)


def default_methods(family) -> list[MethodSpec]:
    """plain + every method the tiny family has a draft for."""
    return [MethodSpec("plain")] + [MethodSpec(m) for m in FAMILY_DRAFTS if family is not None]


def resolve_methods(specs: list[MethodSpec], family=None) -> list[MethodSpec]:
    """Fill in drafts (tiny family), default K (from the draft's config), and unique labels.

    Raises :class:`BenchError` for a spec that cannot run (before any engine starts)."""
    resolved = []
    for spec in specs:
        draft, k = spec.draft, spec.num_speculative_tokens
        if spec.method in DRAFT_METHODS and draft is None:
            if family is None or spec.method not in FAMILY_DRAFTS:
                raise BenchError(
                    f"--method {spec.method}: needs a draft checkpoint: {spec.method}:DRAFT_DIR[:K]"
                )
            draft = family_draft(spec.method, family)
        if spec.method in ("dflash", "dspark"):
            k = _checked_draft_k(spec.method, draft, k)
        elif spec.method == "ngram" and k is None:
            k = DEFAULT_NGRAM_TOKENS
        elif spec.method in ("eagle3", "draft_model") and k is None:
            raise BenchError(
                f"--method {spec.method}:{draft}: give the number of drafted tokens: "
                f"{spec.method}:DRAFT_DIR:K"
            )
        resolved.append(replace(spec, draft=draft, num_speculative_tokens=k))
    return _with_labels(resolved)


def _checked_draft_k(method: str, draft: str, k: int | None) -> int:
    """K for a DFlash/DSpark draft: validated against (or defaulted from) the draft's config when
    the checkpoint is available locally."""
    from vllm_nemotron_spec.checkpoint.spec import DraftSpec, DraftSpecError

    local = local_checkpoint(draft)
    if local is None:
        if k is None:
            raise BenchError(
                f"--method {method}:{draft}: not a local directory nor in the local Hugging Face "
                f"cache, so its default K cannot be read; give it: {method}:{draft}:K"
            )
        return k
    try:
        draft_spec = DraftSpec.from_pretrained(local)
        if draft_spec.method != method:
            raise BenchError(
                f"--method {method}:{draft}: the draft is a {draft_spec.method} draft "
                f"({draft_spec.architecture}), not {method}; "
                f"use --method {draft_spec.method}:{draft}"
            )
        return draft_spec.resolve_num_speculative_tokens(k)
    except DraftSpecError as exc:
        raise BenchError(f"--method {method}:{draft}: {exc}") from None


def local_checkpoint(path: str) -> str | None:
    """``path`` if it exists here, else its snapshot in the local Hugging Face cache (never
    downloads), else None."""
    if os.path.exists(path):
        return path
    if re.fullmatch(r"[\w.-]+/[\w.-]+", path):
        try:
            from huggingface_hub import snapshot_download

            return snapshot_download(path, local_files_only=True)
        except Exception:  # noqa: BLE001 - not cached, or huggingface_hub absent
            return None
    return None


def _with_labels(specs: list[MethodSpec]) -> list[MethodSpec]:
    def base(spec: MethodSpec, detail: int) -> str:
        if spec.label:
            return spec.label
        label = spec.method
        if detail >= 1 and spec.num_speculative_tokens is not None:
            label += f" k={spec.num_speculative_tokens}"
        if detail >= 2 and spec.draft is not None:
            label += f" {Path(spec.draft).name}"
        return label

    for detail in range(3):
        labels = [base(s, detail) for s in specs]
        if len(set(labels)) == len(labels):
            break
    seen: dict[str, int] = {}
    out = []
    for spec, label in zip(specs, labels):
        seen[label] = seen.get(label, 0) + 1
        out.append(replace(spec, label=label if seen[label] == 1 else f"{label} #{seen[label]}"))
    return out
