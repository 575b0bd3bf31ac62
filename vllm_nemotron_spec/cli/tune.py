"""``vllm-nemotron-spec tune``: choose the number of drafted tokens per batch size for this machine.

Measures, with your prompts, (a) how often the draft's tokens are accepted at each position
(vLLM's per-position counters; greedy, and at --temperature when given) and (b) the engine's decode
step time for every batch size of the grid 1, 2, 4, ... --max-batch and every k from 0 (no drafts)
to the draft's trained block. It then computes the expected output tokens/s

    batch x (1 + E[accepted drafts | k]) / step_time(batch, k)

picks the best k per batch size, merges neighbouring batch sizes with the same k into vLLM's
inclusive ranges, and prints the --speculative-config that serves the schedule
(`num_speculative_tokens_per_batch_size`).

  vllm-nemotron-spec tune TARGET --method dspark --draft DRAFT --prompts prompts.jsonl \\
      --max-batch 64 --out schedule.json --plot tune.png
  vllm serve TARGET --speculative-config "$(cat schedule.json)"

One engine measures every k, each as a schedule serves it: k tokens drafted and verified (DFlash:
its whole block drafted, k verified; the k is set on the running engine between measurements). A
second engine without speculation times plain decoding at every batch size (--no-plain skips it):
the report says where it serves more than the schedule, and no config is written when it does at
every batch size.
Prompt files: JSONL with "prompt" / "text" / "question" (GSM8K) / "turns" (MT-Bench, first turn).
Exit status 0 on success, 1 when an engine or a measurement failed, 2 for a bad option, prompt
file, target/draft pair or a plugin patch tune needs that is not installed (before any engine
starts). More: docs/tune.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "tune",
        help="measure acceptance and step time per batch size and write the "
        "per-batch-size speculation schedule that maximises tokens/s",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("target", metavar="TARGET", help="the NemotronH target (directory or id)")
    what = parser.add_argument_group("what to tune")
    what.add_argument(
        "--method", required=True, choices=("dflash", "dspark"), help="the draft's method"
    )
    what.add_argument(
        "--draft", required=True, help="the Nemotron 3.5 DFlash / DSpark draft (directory or id)"
    )
    what.add_argument(
        "--prompts",
        metavar="FILE",
        default=None,
        help="JSONL prompt file; default: the package's small built-in prompt set",
    )
    what.add_argument(
        "--num-prompts", type=int, default=None, help="use the first N prompts (default: all)"
    )
    what.add_argument(
        "--max-batch",
        type=int,
        default=16,
        help="largest batch size measured; the grid is 1, 2, 4, ... up to it (default 16)",
    )
    what.add_argument(
        "--k",
        default=None,
        metavar="LIST",
        help="comma-separated k values to measure, e.g. 0,1,3,5,7 (default: every k from 0 to "
        "the draft's trained block: DSpark block_size, DFlash block_size - 1 or 5)",
    )
    what.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature of your traffic (default 0: greedy); with T > 0 acceptance is "
        "also measured sampled and the schedule uses it",
    )
    _measurement_args(parser)
    _output_args(parser)
    parser.set_defaults(func=run)


def _measurement_args(parser) -> None:
    how = parser.add_argument_group("measurement")
    how.add_argument(
        "--max-tokens",
        type=int,
        default=128,
        help="tokens generated per prompt for the acceptance measurement (default 128)",
    )
    how.add_argument(
        "--ignore-eos",
        action="store_true",
        help="acceptance: keep generating past end-of-sequence",
    )
    how.add_argument(
        "--steps", type=int, default=16, help="decode steps timed per (batch, k) (default 16)"
    )
    how.add_argument(
        "--warmup-steps",
        type=int,
        default=4,
        help="decode steps run before timing each (batch, k) (default 4)",
    )
    how.add_argument(
        "--no-plain",
        action="store_true",
        help="skip timing plain decoding (an engine without speculation, started after the "
        "measuring one): one engine start less, and the report cannot say where plain "
        "decoding serves more than the schedule",
    )
    how.add_argument(
        "--speculative-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra speculative-config key for every engine and the printed config (repeatable; "
        "VALUE is JSON when it parses), e.g. draft_sample_method=probabilistic",
    )
    how.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra vllm.LLM argument (repeatable), e.g. max_model_len=8192; serve with the same",
    )


def _output_args(parser) -> None:
    out = parser.add_argument_group("output")
    out.add_argument(
        "--out",
        metavar="FILE.json",
        default=None,
        help="write the speculative config (with the schedule) as JSON, for "
        '`vllm serve TARGET --speculative-config "$(cat FILE.json)"`',
    )
    out.add_argument("--json", action="store_true", help="print one JSON object, not a report")
    out.add_argument(
        "--plot", metavar="FILE.png", default=None, help="draw expected tokens/s per batch size"
    )
    out.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    out.add_argument(
        "--verbose", action="store_true", help="show vLLM's INFO logs (default: warnings only)"
    )


def parse_k_list(text: str | None) -> list[int] | None:
    from vllm_nemotron_spec.bench.tune import TuneError

    if text is None:
        return None
    try:
        ks = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise TuneError(f"--k {text!r}: expected comma-separated integers, e.g. 0,1,3,5") from None
    if not ks:
        raise TuneError(f"--k {text!r}: no k given")
    return ks


def check_schedule_file(path: str) -> Path:
    """``path`` may be written: absent, or a schedule this command wrote (a JSON object with a
    ``method`` and ``num_speculative_tokens``); anything else is refused."""
    from vllm_nemotron_spec.outputs import OutputError

    dest = Path(path).expanduser().resolve()
    if dest.is_dir():
        raise OutputError(f"--out {dest} is a directory; give a file name")
    if dest.exists():
        try:
            old = json.loads(dest.read_text("utf-8"))
        except (OSError, ValueError):
            old = None
        if not (isinstance(old, dict) and "method" in old and "num_speculative_tokens" in old):
            raise OutputError(
                f"--out {dest} exists and is not a schedule this command wrote; refusing to "
                "overwrite it: choose another name"
            )
    return dest


def write_schedule_file(dest: Path, config: dict) -> None:
    """Atomically: a temporary sibling, then renamed over ``dest``."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{dest.name}.tmp-", dir=dest.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
            f.write("\n")
        os.chmod(name, 0o644)
        os.replace(name, dest)
    finally:
        if os.path.exists(name):
            os.unlink(name)


def plan_from_args(args):
    """The validated plan and prompt set (raises TuneError / PromptFileError / BenchError)."""
    from vllm_nemotron_spec.bench.tune import plan_tune
    from vllm_nemotron_spec.cli.bench import parse_engine_args
    from vllm_nemotron_spec.prompts import load_prompts, tiny_family_prompts

    prompt_set = load_prompts(args.prompts) if args.prompts else tiny_family_prompts()
    if args.num_prompts is not None:
        from vllm_nemotron_spec.bench.tune import TuneError

        if args.num_prompts < 1:
            raise TuneError(f"--num-prompts must be >= 1, found {args.num_prompts}")
        prompt_set = type(prompt_set)(
            tuple(prompt_set.take(args.num_prompts)), prompt_set.source, prompt_set.key
        )
    plan = plan_tune(
        args.target,
        args.method,
        args.draft,
        ks=parse_k_list(args.k),
        max_batch=args.max_batch,
        temperature=args.temperature,
        steps=args.steps,
        warmup_steps=args.warmup_steps,
        max_tokens=args.max_tokens,
        ignore_eos=args.ignore_eos,
        plain=not args.no_plain,
        speculative_extra=parse_engine_args(args.speculative_arg),
        engine_kwargs=parse_engine_args(args.engine_arg),
    )
    return plan, prompt_set


def measure(args, plan, prompt_set) -> dict:
    """Start the engines, measure, and return the report (``bench.tune.tune_report``)."""
    from dataclasses import replace

    from vllm_nemotron_spec.bench.offline import engine_defaults
    from vllm_nemotron_spec.bench.tune import TuneError, run_tune, tune_report
    from vllm_nemotron_spec.cli.bench import _platform_name, vllm_log_level
    from vllm_nemotron_spec.runs import set_engine_defaults

    set_engine_defaults(plan.target, plan.draft)
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout: the report
    with vllm_log_level(None if args.verbose else "WARNING"):
        import vllm
        from vllm.platforms import current_platform

        is_cpu = current_platform.is_cpu()
        kwargs = engine_defaults(is_cpu, is_cpu)  # CPU: the small-model settings (fp32, eager)
        kwargs["max_num_seqs"] = max(plan.batch_sizes)
        kwargs.update(plan.engine_kwargs)
        if (kwargs["max_num_seqs"] or 0) < max(plan.batch_sizes):
            raise TuneError(
                f"--engine-arg max_num_seqs={kwargs['max_num_seqs']} is below --max-batch "
                f"{max(plan.batch_sizes)}: the engine cannot hold that many requests"
            )
        plan = replace(plan, engine_kwargs=kwargs)
        measurements = run_tune(plan, list(prompt_set.prompts), progress=not args.no_progress)
    return tune_report(
        plan,
        measurements,
        prompts=prompt_set,
        platform=_platform_name(current_platform),
        vllm_version=vllm.__version__,
    )


def run(args) -> int:
    from vllm_nemotron_spec.bench import BenchError, PlotUnavailable, check_plot_available
    from vllm_nemotron_spec.bench.tune_report import format_tune_report, plot_tune_report
    from vllm_nemotron_spec.outputs import check_output_file
    from vllm_nemotron_spec.patches import PatchUnavailable
    from vllm_nemotron_spec.prompts import PromptFileError

    prog = "vllm-nemotron-spec tune"
    try:  # every refusal before any engine starts
        dest = check_schedule_file(args.out) if args.out else None
        if args.plot:
            check_output_file(args.plot)
            check_plot_available()
        plan, prompt_set = plan_from_args(args)
    except (BenchError, PromptFileError, PlotUnavailable) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    try:
        report = measure(args, plan, prompt_set)
    except PatchUnavailable as exc:  # refused before any engine started
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    except BenchError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - an engine failed: its traceback, then one line
        import traceback

        traceback.print_exception(exc, file=sys.stderr)
        print(f"{prog}: {type(exc).__name__}: {exc}".splitlines()[0], file=sys.stderr)
        return 1
    written = None
    if dest is not None and report["speculative_config"] is not None:
        write_schedule_file(dest, report["speculative_config"])
        written = str(dest)
    report["schedule_file"] = written
    print(json.dumps(report) if args.json else format_tune_report(report, written))
    sys.stdout.flush()
    if dest is not None and written is None and not args.no_progress:
        print(f"tune: speculation did not pay; {dest} not written", file=sys.stderr)
    if args.plot:
        try:
            path = plot_tune_report(report, args.plot)
        except Exception as exc:  # noqa: BLE001 - the results are printed already
            print(f"{prog}: --plot {args.plot}: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
        if not args.no_progress:
            print(f"tune: wrote {path}", file=sys.stderr)
    return 0
