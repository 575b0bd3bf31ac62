"""``vllm-nemotron-spec demo``: the tiny Nemotron-3.5-shaped family through the real vLLM engine.

Builds (or reuses) the tiny family and the DFlash and DSpark drafts trained against its target (about 6-7
minutes on 2 cores the first time, then cached), decodes a fixed prompt set greedily with plain decoding and
with each speculative method, and reports speed, acceptance and whether the speculative output is
token-for-token identical to plain decoding. Exit code 0 only when every run is lossless.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import logging
import os
import shlex
import sys
import tempfile
from pathlib import Path

# method -> speculative method name (None = plain decoding). DFlash and DSpark run the drafts
# trained against the tiny target (vllm_nemotron_spec.tiny.train_draft; trained on first use, then
# cached).
METHODS: dict[str, str | None] = {
    "plain": None,
    "dflash": "dflash",
    "dspark": "dspark",
}


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "demo",
        help="run plain and speculative decoding on the tiny local model family and compare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--methods",
        default=",".join(METHODS),
        help=f"comma-separated subset of {', '.join(METHODS)} (default: all; plain always runs "
        "first, it is the reference for the lossless check)",
    )
    parser.add_argument("--num-prompts", type=int, default=8, help="prompts to decode (default 8)")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per prompt (default 48)")
    parser.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        help="drafted tokens per step (default: the draft's own default)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the tiny family (default 0)")
    parser.add_argument(
        "--family-dir",
        default=None,
        help="where the tiny family is built/cached (default: $NEMOTRON_SPEC_CACHE or "
        "~/.cache/vllm-nemotron-spec)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object instead of a report"
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="show vLLM's INFO logs and warnings (default: the plugin's warnings and everyone's "
        "errors; vLLM's warnings are about the engines the demo configures itself)",
    )
    parser.set_defaults(func=run)


def parse_methods(text: str) -> list[str]:
    methods = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(
            f"unknown method(s) {', '.join(unknown)} in --methods; choose from {', '.join(METHODS)}"
        )
    return ["plain"] + [m for m in methods if m != "plain"]


PLUGIN_LOGGERS = ("vllm.nemotron_spec", "vllm.plugins.nemotron_spec")
"""The plugin's loggers under vLLM's ``vllm`` logger (its others log outside it)."""


class PluginWarningsOnly(logging.Filter):
    """Keeps the plugin's records and every record at ERROR or above: vLLM's own warnings in the
    demo are about the engines the demo configures itself (eager fp32 engines in its own process,
    vLLM's V1 runner on CPU, several engines one after another) and CPU tuning advice that does
    not matter at the tiny family's size."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or record.name.startswith(PLUGIN_LOGGERS)


@contextlib.contextmanager
def plugin_warnings_only():
    """vLLM's log handler filtered by :class:`PluginWarningsOnly`, in every engine started here:
    vLLM's default logging config with the filter, given to vLLM the way it reads a user's
    (``VLLM_LOGGING_CONFIG_PATH``, which a user's setting overrides). Enter it after importing vLLM,
    before the first engine."""
    if os.environ.get("VLLM_LOGGING_CONFIG_PATH"):
        yield
        return
    from vllm.config.logging import LoggingConfig
    from vllm.logger import DEFAULT_LOGGING_CONFIG, configure_logging

    config = copy.deepcopy(DEFAULT_LOGGING_CONFIG)
    config["filters"] = {"plugin_warnings_only": {"()": f"{__name__}.PluginWarningsOnly"}}
    config["handlers"]["vllm"]["filters"] = ["plugin_warnings_only"]
    with tempfile.TemporaryDirectory(prefix="nemotron-spec-demo-") as tmp:
        path = Path(tmp) / "vllm-logging.json"
        path.write_text(json.dumps(config), encoding="utf-8")
        os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(path)
        try:
            configure_logging(LoggingConfig())
            yield
        finally:
            os.environ.pop("VLLM_LOGGING_CONFIG_PATH", None)


def run_demo(
    methods: list[str],
    num_prompts: int,
    max_tokens: int,
    seed: int = 0,
    family_dir: str | None = None,
    num_speculative_tokens: int | None = None,
    verbose: bool = False,
) -> dict:
    """Run the demo and return the JSON-able report (see README for the fields); ``verbose``:
    vLLM's warnings too (else :func:`plugin_warnings_only`)."""
    from vllm_nemotron_spec.runs import set_engine_defaults
    from vllm_nemotron_spec.tiny.build import build_tiny_family, ensure_tiny_family

    set_engine_defaults()
    # The family first: a --family-dir that cannot be written is refused before vLLM loads.
    family = (
        build_tiny_family(family_dir, seed=seed) if family_dir else ensure_tiny_family(seed=seed)
    )
    # vLLM logs to stdout by default; keep stdout for the report (and --json parseable).
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    import vllm

    with contextlib.nullcontext() if verbose else plugin_warnings_only():
        runs, drafts = _run_methods(
            methods, family, num_prompts, max_tokens, num_speculative_tokens
        )
    from vllm.platforms import current_platform

    return {
        "vllm_version": vllm.__version__,
        "platform": current_platform.device_name if not current_platform.is_cpu() else "cpu",
        "family": str(family.root),
        "target": str(Path(family.target).resolve()),
        "drafts": {m: str(Path(draft).resolve()) for m, draft in drafts.items()},
        "max_tokens": max_tokens,
        "runs": runs,
    }


def _run_methods(methods, family, num_prompts, max_tokens, num_speculative_tokens):
    """Every method's report entry, plain decoding first (the reference), and the drafts used."""
    from vllm.platforms import current_platform

    from vllm_nemotron_spec.bench import family_draft
    from vllm_nemotron_spec.tiny.corpus import sample_prompts

    prompts = (sample_prompts() * num_prompts)[:num_prompts]
    engine_kwargs = {}
    if current_platform.is_cpu():  # distinct prompts: nothing to reuse, only the CPU copy cost
        engine_kwargs["enable_prefix_caching"] = False
    # Every draft before the first engine: trained (first run) while the output is still the
    # demo's own progress.
    drafts = {m: family_draft(METHODS[m], family) for m in methods if METHODS[m] is not None}
    runs, reference = [], None
    for method in methods:
        run, token_ids = _run_method(
            method, family, drafts.get(method), prompts, max_tokens, num_speculative_tokens,
            reference, engine_kwargs,
        )  # fmt: skip
        reference = token_ids if reference is None else reference
        runs.append(run)
    return runs, drafts


def _run_method(
    method, family, draft, prompts, max_tokens, num_speculative_tokens, reference, engine_kwargs
) -> tuple[dict, list[list[int]]]:
    """One engine of the demo: its report entry and its tokens (``reference``: plain decoding's,
    None for plain decoding itself)."""
    from vllm_nemotron_spec.checkpoint.spec import DraftSpec
    from vllm_nemotron_spec.runs import generate, make_llm, release

    spec = METHODS[method]
    speculative_config = None
    if spec is not None:
        speculative_config = {
            "method": spec,
            "model": draft,
            "num_speculative_tokens": DraftSpec.from_pretrained(
                draft
            ).resolve_num_speculative_tokens(num_speculative_tokens),
        }
    llm = make_llm(str(family.target), speculative_config, **engine_kwargs)
    result = generate(llm, prompts, max_tokens, method)
    release(llm)
    reference = result.token_ids if reference is None else reference
    first_mismatch = next(
        (i for i, (a, b) in enumerate(zip(result.token_ids, reference)) if a != b), None
    )
    counters = result.counters
    run = {
        "method": method,
        "num_prompts": len(prompts),
        "output_tokens": result.num_output_tokens,
        "seconds": round(result.seconds, 3),
        "tokens_per_s": round(result.tokens_per_s, 2),
        "mean_acceptance_length": (
            None
            if spec is None or counters.mean_acceptance_length is None
            else round(counters.mean_acceptance_length, 3)
        ),
        "per_position_acceptance": [round(x, 3) for x in counters.per_position_acceptance],
        "num_speculative_tokens": (
            None if spec is None else len(counters.accepted_per_position) or None
        ),
        "lossless": first_mismatch is None,
        "first_mismatching_prompt": first_mismatch,
    }
    return run, result.token_ids


def format_report(report: dict) -> str:
    lines = [
        f"vLLM {report['vllm_version']} on {report['platform']}; tiny family: {report['family']}",
        f"{'method':<8} {'prompts':>7} {'tokens':>7} {'tok/s':>8} {'accept len':>10}  lossless",
    ]
    for r in report["runs"]:
        acc = "-" if r["mean_acceptance_length"] is None else f"{r['mean_acceptance_length']:.2f}"
        lossless = "yes" if r["lossless"] else f"NO (prompt {r['first_mismatching_prompt']})"
        lines.append(
            f"{r['method']:<8} {r['num_prompts']:>7} {r['output_tokens']:>7} "
            f"{r['tokens_per_s']:>8.1f} {acc:>10}  {lossless}"
        )
    ok = all(r["lossless"] for r in report["runs"])
    lines.append("all speculative runs match plain decoding" if ok else "MISMATCH: see above")
    if report.get("drafts"):
        lines.append(f"target: {report['target']}")
        for method, draft in report["drafts"].items():
            lines.append(f"{method} draft (trained against the target): {draft}")
        method, draft = next(iter(report["drafts"].items()))
        config = json.dumps(
            {
                "method": METHODS[method],
                "model": draft,
                "num_speculative_tokens": k_of(report, method),
            }
        )
        lines.append(
            f"serve: vllm-nemotron-spec vllm serve {shlex.quote(report['target'])} "
            f"--dtype float32 --no-enable-prefix-caching --speculative-config {shlex.quote(config)}"
        )
    return "\n".join(lines)


def k_of(report: dict, method: str) -> int:
    """The drafted tokens per step of ``method``'s run (vLLM requires the number for a DFlash draft
    without ``block_size``, as the tiny one); the Nemotron 3.5 DFlash default when it did not run."""
    from vllm_nemotron_spec.checkpoint.spec import NEMOTRON35_DFLASH_NUM_SPECULATIVE_TOKENS

    ks = [r.get("num_speculative_tokens") for r in report["runs"] if r["method"] == method]
    return next((k for k in ks if k), NEMOTRON35_DFLASH_NUM_SPECULATIVE_TOKENS)


def run(args) -> int:
    from vllm_nemotron_spec.cli.bench import vllm_log_level

    try:
        methods = parse_methods(args.methods)
        for name in ("num_prompts", "max_tokens", "num_speculative_tokens"):
            value = getattr(args, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    except ValueError as exc:
        print(f"vllm-nemotron-spec demo: {exc}", file=sys.stderr)
        return 2
    if not args.verbose and "torch" not in sys.modules:
        # vLLM's CPU worker reports its NUMA memory binding as a torch C++ warning, which only
        # this setting (read when torch loads) holds back.
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    with vllm_log_level(None if args.verbose else "WARNING"):
        report = run_demo(
            methods,
            args.num_prompts,
            args.max_tokens,
            seed=args.seed,
            family_dir=args.family_dir,
            num_speculative_tokens=args.num_speculative_tokens,
            verbose=args.verbose,
        )
    if args.json:
        print(json.dumps(report))
    else:
        print(format_report(report))
    sys.stdout.flush()
    return 0 if all(r["lossless"] for r in report["runs"]) else 1
