"""``vllm-nemotron-spec bench``: acceptance and speed of speculative decoding, method by method.

Offline (default): each --method runs in its own vLLM engine in this process, one after another,
on the same prompts. Without --model it benchmarks the tiny local family (built on first use):
plain decoding plus every method the family has a draft for.

  vllm-nemotron-spec bench                                   # tiny family, plain/dflash/dspark
  vllm-nemotron-spec bench --model TARGET --prompts gsm8k.jsonl \\
      --method plain --method dflash:DFLASH_DIR --method dflash:DFLASH_DIR:3

Server: --server measures running `vllm serve` processes on this machine (one method per server)
through their OpenAI completions endpoint and the spec-decode counters of their /metrics.

  vllm-nemotron-spec bench --prompts prompts.jsonl \\
      --server plain=http://127.0.0.1:8000 --server dflash=http://127.0.0.1:8001

METHOD specs: plain | ngram[:K] | dflash[:DRAFT_DIR][:K] | dspark[:DRAFT_DIR][:K] |
eagle3:DRAFT_DIR:K | draft_model:DRAFT_DIR:K (K: drafted tokens per step; default: the draft's).
Prompt files: JSONL with "prompt" / "text" / "question" (GSM8K) / "turns" (MT-Bench, first turn).
Exit code 0 when every method ran or was reported unsupported on this platform, 1 when one failed
with an error, 2 for a bad option, method spec or prompt file (before any engine starts).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "bench",
        help="measure acceptance length, per-position acceptance, tokens/s and TPOT of "
        "speculative methods side by side (offline or against running servers)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    what = parser.add_argument_group("what to run")
    what.add_argument(
        "--method",
        action="append",
        default=None,
        metavar="SPEC",
        help="a method to run offline (repeatable), e.g. plain, ngram:3, dflash:DRAFT_DIR:5; "
        "default: plain + every method the tiny family has a draft for (with --model: plain)",
    )
    what.add_argument(
        "--model",
        default=None,
        help="target model (offline); default: the tiny family's target",
    )
    what.add_argument(
        "--server",
        action="append",
        default=None,
        metavar="[LABEL=]URL",
        help="benchmark a running server on this machine instead (repeatable, one method per "
        "server), e.g. dflash=http://127.0.0.1:8000",
    )
    what.add_argument(
        "--prompts",
        default=None,
        metavar="FILE",
        help="JSONL prompt file (see above); default: the tiny family's prompts",
    )
    what.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="number of prompts (cycles through the set when larger; default: the whole set)",
    )
    what.add_argument("--max-tokens", type=int, default=64, help="tokens per prompt (default 64)")
    what.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature (default 0: greedy, also compares tokens with plain decoding)",
    )
    what.add_argument(
        "--ignore-eos",
        action="store_true",
        help="keep generating past end-of-sequence: every prompt gets exactly --max-tokens",
    )

    engine = parser.add_argument_group("offline engine")
    engine.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra vllm.LLM argument (repeatable; VALUE is JSON when it parses), e.g. "
        "max_model_len=4096, tensor_parallel_size=2",
    )
    engine.add_argument("--seed", type=int, default=0, help="seed of the tiny family (default 0)")
    engine.add_argument(
        "--family-dir",
        default=None,
        help="where the tiny family is built/cached (default: $NEMOTRON_SPEC_CACHE or "
        "~/.cache/vllm-nemotron-spec)",
    )

    client = parser.add_argument_group("server client")
    client.add_argument(
        "--max-concurrency", type=int, default=8, help="requests in flight per server (default 8)"
    )
    client.add_argument(
        "--request-timeout", type=float, default=600.0, help="seconds per request (default 600)"
    )

    out = parser.add_argument_group("output")
    out.add_argument(
        "--json", action="store_true", help="print one JSON object instead of a report"
    )
    out.add_argument(
        "--plot",
        default=None,
        metavar="FILE.png",
        help="draw per-position acceptance and the acceptance-length histogram",
    )
    out.add_argument(
        "--no-warmup",
        action="store_true",
        help="skip the short warm-up request before each measurement",
    )
    out.add_argument(
        "--no-progress", action="store_true", help="no progress bars or status lines on stderr"
    )
    out.add_argument(
        "--verbose",
        action="store_true",
        help="show vLLM's INFO logs (default: only its warnings and errors)",
    )
    parser.set_defaults(func=run)


def parse_engine_args(items: list[str]) -> dict:
    from vllm_nemotron_spec.bench import BenchError

    kwargs = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key.isidentifier():
            raise BenchError(f"--engine-arg {item!r}: expected KEY=VALUE, e.g. max_model_len=4096")
        try:
            kwargs[key] = json.loads(value)
        except json.JSONDecodeError:
            kwargs[key] = value
    return kwargs


def build_report(args) -> dict:
    """Run what ``args`` asks for and return the report (``bench.make_report``)."""
    from vllm_nemotron_spec import bench
    from vllm_nemotron_spec.prompts import load_prompts, tiny_family_prompts

    if args.server and (args.method or args.model or args.engine_arg):
        raise bench.BenchError(
            "--server measures running servers: --method, --model and "
            "--engine-arg are for offline runs"
        )
    for name in ("num_prompts", "max_tokens", "max_concurrency"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise bench.BenchError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    prompt_set = load_prompts(args.prompts) if args.prompts else tiny_family_prompts()
    prompts = prompt_set.take(args.num_prompts)
    progress = not args.no_progress
    common = dict(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        warmup=not args.no_warmup,
        progress=progress,
    )

    if args.server:
        servers = [bench.parse_server_spec(s) for s in args.server]
        runs, models = bench.run_server(
            servers,
            prompts,
            ignore_eos=args.ignore_eos,
            max_concurrency=args.max_concurrency,
            timeout=args.request_timeout,
            **common,
        )
        return bench.make_report(
            runs,
            mode="server",
            model=", ".join(dict.fromkeys(models.values())),
            prompts=prompt_set,
            num_prompts=len(prompts),
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            ignore_eos=args.ignore_eos,
            platform="server",
            vllm_version=_server_version(servers[0]),
            extra={
                "servers": [
                    {"label": s.label, "url": s.url, "model": models[s.label]} for s in servers
                ]
            },
        )

    tiny = args.model is None
    specs = [bench.parse_method_spec(m) for m in args.method or []]
    engine_kwargs = parse_engine_args(args.engine_arg)
    family = _family(args) if tiny else None
    if not specs:
        specs = bench.default_methods(family)
    methods = bench.resolve_methods(specs, family)
    model = str(family.target) if tiny else args.model

    import os

    from vllm_nemotron_spec.runs import set_engine_defaults

    set_engine_defaults(model, *(m.draft for m in methods))
    # vLLM logs to stdout by default; keep stdout for the report (and --json parseable).
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    with vllm_log_level(None if args.verbose else "WARNING"):
        import vllm
        from vllm.platforms import current_platform

        is_cpu = current_platform.is_cpu()
        kwargs = bench.engine_defaults(tiny, is_cpu)
        kwargs.update(engine_kwargs)
        runs = bench.run_offline(
            methods, model, prompts, ignore_eos=args.ignore_eos, engine_kwargs=kwargs, **common
        )
    return bench.make_report(
        runs,
        mode="offline",
        model=model,
        prompts=prompt_set,
        num_prompts=len(prompts),
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        platform=_platform_name(current_platform),
        vllm_version=vllm.__version__,
        extra={"engine_args": {k: v for k, v in kwargs.items() if v is not None}},
    )


@contextlib.contextmanager
def vllm_log_level(level: str | None):
    """vLLM's loggers at ``level`` (e.g. WARNING: its ~200 INFO lines per engine start would hide
    the progress lines) in this process and the engine processes it starts, restored after;
    ``None`` (``--verbose``) or a VLLM_LOGGING_LEVEL set by the user leaves them alone."""
    import logging
    import os

    if level is None or "VLLM_LOGGING_LEVEL" in os.environ:
        yield
        return
    logger = logging.getLogger("vllm")
    before = logger.level
    os.environ["VLLM_LOGGING_LEVEL"] = level
    logger.setLevel(level)
    try:
        yield
    finally:
        os.environ.pop("VLLM_LOGGING_LEVEL", None)
        logger.setLevel(before)


def _platform_name(platform) -> str:
    """ "cpu", or the accelerator's name (e.g. "NVIDIA H200")."""
    if platform.is_cpu():
        return "cpu"
    try:
        return platform.get_device_name()
    except Exception:  # noqa: BLE001 - a name is only for the report
        return platform.device_name


def _family(args):
    from vllm_nemotron_spec.tiny.build import build_tiny_family, ensure_tiny_family

    if args.family_dir:
        return build_tiny_family(args.family_dir, seed=args.seed)
    return ensure_tiny_family(seed=args.seed)


def _server_version(server) -> str | None:
    from vllm_nemotron_spec.bench import BenchError
    from vllm_nemotron_spec.bench.client import get_text

    try:
        return json.loads(get_text(f"{server.url}/version", 10.0)).get("version")
    except (BenchError, ValueError, AttributeError):
        return None


def run(args) -> int:
    from vllm_nemotron_spec.bench import (
        BenchError,
        PlotUnavailable,
        check_plot_available,
        format_report,
        plot_report,
    )
    from vllm_nemotron_spec.outputs import check_output_file
    from vllm_nemotron_spec.prompts import PromptFileError

    if args.plot:
        check_output_file(args.plot)  # refused before any engine starts
    try:
        if args.plot:
            check_plot_available()
        report = build_report(args)
    except (BenchError, PromptFileError, PlotUnavailable) as exc:
        print(f"vllm-nemotron-spec bench: {exc}", file=sys.stderr)
        return 2
    # The results first: a plot that fails later must not lose them.
    print(json.dumps(report) if args.json else format_report(report))
    sys.stdout.flush()
    code = 1 if any(r["status"] == "error" for r in report["runs"]) else 0
    if args.plot:
        try:
            path = plot_report(report, args.plot)
        except Exception as exc:  # noqa: BLE001 - the results are printed already
            print(
                f"vllm-nemotron-spec bench: --plot {args.plot}: {type(exc).__name__}: {exc}",
                file=sys.stderr,
            )
            return 1
        if not args.no_progress:
            print(f"bench: wrote {path}", file=sys.stderr)
    return code
