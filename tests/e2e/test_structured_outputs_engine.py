"""Guided decoding (structured outputs) with DFlash and DSpark in the offline vLLM engine (CPU).

With speculative decoding the grammar must mask every drafted position, advance only over the
accepted tokens and roll back the rest; an error there gives output that breaks the guide, or
differs from plain guided decoding, or kills the engine (upstream reports "Failed to advance
FSM" for DFlash with xgrammar). Here each guide of ``guides.py`` (JSON schema, regex, choice,
grammar in GBNF and in Lark syntax) runs on the tiny family's trained drafts and on the plain
target, through ``StructuredOutputsParams``, with the xgrammar backend (JSON without free
whitespace, ``disable_any_whitespace``; vLLM's ``auto`` choice is served in
``test_recipe_serving.py``):

- every guided output stops and satisfies its guide, and equals the plain target's guided output
  token for token;
- guided and unguided requests in one batch: each equals its own plain output;
- the drafts are used under the guides (acceptance > 1, from vLLM's spec-decode counters).

One engine per (backend, method), fp32, eager, greedy. Acceptance per guide is printed
(``pytest -s``).
"""

from __future__ import annotations

import time
from typing import NamedTuple

import guides as g  # tests/e2e/guides.py
import pytest

from vllm_nemotron_spec import runs

pytestmark = pytest.mark.engine

NUM_SPECULATIVE_TOKENS = 3
UNGUIDED_MAX_TOKENS = 32
BACKENDS = ("xgrammar",)
METHODS = ("dflash", "dspark")


class Output(NamedTuple):
    token_ids: list[int]
    text: str
    finish_reason: str | None


class EngineRun(NamedTuple):
    guided: dict  # guide name -> [Output per prompt]
    unguided: list[Output]
    mixed: list[Output]  # MIXED order
    counters: dict  # guide name (or "unguided") -> runs.SpecCounters


def _mixed_order(names: list[str]) -> list[tuple[str | None, int]]:
    """(guide name or None for unguided, prompt index) in one batch: every guide and unguided
    requests interleaved."""
    out = []
    for i in range(len(g.PROMPTS)):
        for name in names:
            out += [(name, i), (None, i)]
    return out


def _params(guide: g.Guide | None):
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    if guide is None:
        return SamplingParams(max_tokens=UNGUIDED_MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return SamplingParams(
        max_tokens=g.MAX_TOKENS,
        temperature=0.0,
        structured_outputs=StructuredOutputsParams(**guide.params),
    )


def _generate(llm, prompts, params) -> tuple[list[Output], runs.SpecCounters]:
    before = runs.read_spec_counters(llm)
    outs = llm.generate(list(prompts), params, use_tqdm=False)
    counters = runs.read_spec_counters(llm).minus(before)
    return [
        Output(list(o.outputs[0].token_ids), o.outputs[0].text, o.outputs[0].finish_reason)
        for o in outs
    ], counters


@pytest.fixture(scope="module")
def results(tiny_family, trained):
    """{(backend, method): EngineRun} for method in plain, dflash, dspark."""
    runs.set_engine_defaults()
    out = {}
    for backend in BACKENDS:
        guides = g.guides(backend)
        by_name = {x.name: x for x in guides}
        order = _mixed_order(list(by_name))
        for method in ("plain", *METHODS):
            spec = None
            if method != "plain":
                spec = {
                    "method": method,
                    "model": str(getattr(trained, method)),
                    "num_speculative_tokens": NUM_SPECULATIVE_TOKENS,
                }
            start = time.perf_counter()
            llm = runs.make_llm(
                str(tiny_family.target),
                spec,
                enable_prefix_caching=False,
                structured_outputs_config={"backend": backend, "disable_any_whitespace": True},
            )
            try:
                guided, counters = {}, {}
                for guide in guides:
                    guided[guide.name], counters[guide.name] = _generate(
                        llm, g.PROMPTS, _params(guide)
                    )
                unguided, counters["unguided"] = _generate(llm, g.PROMPTS, _params(None))
                mixed, _ = _generate(
                    llm,
                    [g.PROMPTS[i] for _, i in order],
                    [_params(by_name.get(name)) for name, _ in order],
                )
                out[(backend, method)] = EngineRun(guided, unguided, mixed, counters)
                print(f"\n{backend} {method}: {time.perf_counter() - start:.0f} s")
            finally:
                runs.release(llm)
    for (backend, method), run in out.items():
        if method != "plain":
            print(
                f"\n{backend} {method}: acceptance "
                + ", ".join(
                    f"{name} {c.mean_acceptance_length:.2f}"
                    for name, c in run.counters.items()
                    if c.mean_acceptance_length is not None
                )
            )
    return out


CASES = [(b, x.name) for b in BACKENDS for x in g.guides(b)]


@pytest.mark.parametrize("backend,guide_name", CASES)
def test_plain_guided_output_satisfies_the_guide(results, backend, guide_name):
    """The reference itself: plain guided decoding stops and satisfies each guide."""
    guide = {x.name: x for x in g.guides(backend)}[guide_name]
    for prompt, out in zip(g.PROMPTS, results[(backend, "plain")].guided[guide_name]):
        assert out.finish_reason == "stop", (prompt, out)
        assert guide.satisfied_by(out.text), f"{prompt!r}: {out.text!r} breaks {guide}"


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("backend,guide_name", CASES)
def test_speculative_guided_output_equals_plain_guided(results, backend, guide_name, method):
    guide = {x.name: x for x in g.guides(backend)}[guide_name]
    plain = results[(backend, "plain")].guided[guide_name]
    got = results[(backend, method)].guided[guide_name]
    for prompt, want, out in zip(g.PROMPTS, plain, got):
        assert out.finish_reason == "stop", (prompt, out)
        assert guide.satisfied_by(out.text), f"{prompt!r}: {out.text!r} breaks {guide}"
        assert out.token_ids == want.token_ids, (
            f"{method} under {guide} on {prompt!r}: {out.text!r} != plain {want.text!r}"
        )


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_drafts_are_accepted_under_the_guides(results, backend, method):
    """Drafted tokens that the guide allows are accepted: over all guides, at least one accepted
    draft token per ten verification steps (the tiny drafts reach 2-3.5 tokens per step)."""
    counters = results[(backend, method)].counters
    for name in [x.name for x in g.guides(backend)]:
        assert counters[name].num_drafts > 0, f"{method} never drafted under guide {name}"
    guided = [c for name, c in counters.items() if name != "unguided"]
    drafts = sum(c.num_drafts for c in guided)
    accepted = sum(c.num_accepted_tokens for c in guided)
    assert accepted > drafts / 10, (
        f"{method} ({backend}): {accepted} draft tokens accepted in {drafts} guided steps"
    )


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_guided_and_unguided_batch_equals_each_request_alone(results, backend, method):
    """Guided requests of every kind and unguided ones in one batch: each request's tokens are
    its own plain output (guided: the plain guided batch; unguided: the plain unguided batch),
    so no request is masked by another's grammar."""
    plain = results[(backend, "plain")]
    run = results[(backend, method)]
    order = _mixed_order([x.name for x in g.guides(backend)])
    for (name, i), out in zip(order, run.mixed):
        want = plain.guided[name][i] if name else plain.unguided[i]
        assert out.token_ids == want.token_ids, (
            f"{method}: mixed-batch request ({name or 'unguided'}, prompt {i}) differs: "
            f"{out.text!r} != {want.text!r}"
        )
    assert [o.token_ids for o in run.unguided] == [o.token_ids for o in plain.unguided]


def test_backend_that_cannot_roll_back_is_refused_per_request(tiny_family, trained, results):
    """lm-format-enforcer cannot roll a grammar back over rejected drafts: with a draft, each
    guided request is refused (the error names the option; the API server answers 400) and
    unguided requests on the same engine are still exact. patches/
    spec_decode_structured_output_backend.py."""
    from vllm.exceptions import VLLMValidationError

    llm = runs.make_llm(
        str(tiny_family.target),
        {
            "method": "dflash",
            "model": str(trained.dflash),
            "num_speculative_tokens": NUM_SPECULATIVE_TOKENS,
        },
        enable_prefix_caching=False,
        structured_outputs_config={"backend": "lm-format-enforcer"},
    )
    try:
        guide = {x.name: x for x in g.guides("xgrammar")}["regex"]
        with pytest.raises(VLLMValidationError, match=r"--structured-outputs-config\.backend"):
            _generate(llm, g.PROMPTS[:1], _params(guide))
        unguided, counters = _generate(llm, g.PROMPTS, _params(None))
    finally:
        runs.release(llm)
    assert [o.token_ids for o in unguided] == [
        o.token_ids for o in results[("xgrammar", "plain")].unguided
    ]
    assert counters.num_drafts > 0
