"""The text report, the serving commands and the plot of a ``tune`` report (``bench.tune``)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path


def engine_flags(engine_args: dict) -> list[str]:
    """``vllm serve`` flags for engine settings: ``--key value``, ``--key`` / ``--no-key`` for
    booleans, JSON for dicts and lists."""
    flags = []
    for key, value in engine_args.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, (dict, list)):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


def serve_command(report: dict) -> str | None:
    """``vllm serve TARGET [the engine settings tune measured with] --speculative-config '...'``
    for the chosen schedule (None: no k above 0 paid at any batch size)."""
    from vllm_nemotron_spec.commands import serve_program

    config = report["speculative_config"]
    if config is None:
        return None
    flags = engine_flags(report.get("engine_args") or {})
    return " ".join(
        [serve_program(), shlex.quote(report["target"]), *map(shlex.quote, flags),
         "--speculative-config", shlex.quote(json.dumps(config))]
    )  # fmt: skip


def llm_example(report: dict, schedule_file: str | None = None) -> str | None:
    """The same configuration for ``vllm.LLM`` (read from the schedule file when one was
    written), with the engine settings tune measured with."""
    config = report["speculative_config"]
    if config is None:
        return None
    source = f"json.load(open({str(schedule_file)!r}))" if schedule_file else json.dumps(config)
    settings = "".join(f", {k}={v!r}" for k, v in (report.get("engine_args") or {}).items())
    return (
        "import json\nfrom vllm import LLM\n"
        f"llm = LLM(model={report['target']!r}{settings}, speculative_config={source})"
    )


def format_tune_report(report: dict, schedule_file: str | None = None) -> str:
    ks, batches = report["ks"], report["batch_sizes"]
    rows = {(m["batch"], m["k"]): m for m in report["measurements"]}
    chosen = {c["batch"]: c for c in report["chosen"]}
    acc = report["acceptance"][report["acceptance_used"]]
    lines = [
        f"tune {report['method']} on vLLM {report['vllm_version'] or '?'} ({report['platform']}); "
        f"target {report['target']}; draft {report['draft']}",
        f"prompts: {report['prompts']['source']} ({report['prompts']['num_prompts']}), "
        f"temperature {report['temperature']}; {report['seconds']:.0f} s",
        "",
        f"acceptance ({report['acceptance_used']}, {acc['num_drafts']} drafting steps at "
        f"k={len(acc['per_position_acceptance'])}): per position "
        + " ".join(f"{x:.2f}" for x in acc["per_position_acceptance"]),
        "expected accepted drafts per step: "
        + ", ".join(f"k={k} {report['expected_accepted'][str(k)]:.2f}" for k in ks),
        "",
        "decode step time, ms (median) / expected output tokens/s; * = chosen. Each k ran as a "
        f"schedule serves it: {_drafted(report)}",
    ]
    plain = {p["batch"]: p for p in report.get("plain") or []}
    head = f"{'batch':>5}  " + "  ".join(f"{f'k={k}':>17}" for k in ks)
    head += f"  {'plain decoding':>17}" if plain else ""
    lines += [head, "-" * len(head)]
    for b in batches:
        cells = []
        for k in ks:
            m = rows[(b, k)]
            mark = "*" if chosen[b]["k"] == k else " "
            cells.append(f"{m['step_ms']:>7.2f} /{m['expected_tokens_per_s']:>8.1f}{mark}")
        if b in plain:
            cells.append(f"{plain[b]['step_ms']:>7.2f} /{plain[b]['tokens_per_s']:>8.1f} ")
        lines.append(f"{b:>5}  " + "  ".join(cells))
    lines += ["", "chosen: " + ", ".join(_chosen(c) for c in report["chosen"])]
    faster = report.get("plain_faster_at") or []
    if faster and report["speculative_config"] is not None:
        lines.append(
            "plain decoding serves more tokens/s than the chosen k at batch "
            + ", ".join(map(str, faster))
            + ": a schedule cannot turn speculation off there; if your load sits at those batch "
            "sizes, serve without --speculative-config"
        )
    scattered = [f"batch {b} k={k}" for b, k in report["scattered"]]
    scattered += [f"plain decoding at batch {b}" for b in report.get("plain_scattered") or []]
    if scattered:
        lines.append(
            f"warning: step times scattered at {len(scattered)} of {len(rows) + len(plain)} "
            "points (quartiles more than 25% of the median apart: "
            + ", ".join(scattered[:6])
            + (", ..." if len(scattered) > 6 else "")
            + "); was the machine busy? rerun on an idle machine or with more --steps"
        )
    lines.append(f"schedule (inclusive batch-size ranges [start, end, k]): {report['schedule']}")
    lines += serving_lines(report, schedule_file)
    return "\n".join(lines)


def serving_lines(report: dict, schedule_file: str | None = None) -> list[str]:
    """How to serve the schedule (or why not to speculate), for the text report."""
    lines: list[str] = []
    command = serve_command(report)
    if command is None:
        chosen = report["chosen"]
        if report.get("plain_faster_at") and len(report["plain_faster_at"]) == len(chosen):
            lines.append(
                "plain decoding serves more tokens/s than any k at every measured batch size: "
                "serve without --speculative-config"
            )
        else:
            lines.append(
                "no k above 0 pays at any measured batch size: serve plain decoding, without "
                "--speculative-config"
            )
    else:
        last = report["schedule"][-1]
        top = report["speculative_config"]["num_speculative_tokens"]
        if top < report["block"]:
            dflash = (
                f"; DFlash attends across its block: rerun with --k 0..{top} for its exact "
                "acceptance"
                if report["method"] == "dflash"
                else ""
            )
            lines.append(
                f"(served with a block of {top}, the schedule's largest k: drafting costs less "
                f"than the block of {report['block']} measured{dflash})"
            )
        lines += smaller_k_lines(report["schedule"], top, report.get("drafts_only_k") or ())
        lines += [
            f"(batch sizes above {last[1]} keep k={last[2]}: vLLM carries the last range on)",
            "",
            "serve it:",
            f"  {command}",
            "or offline:",
            *("  " + line for line in llm_example(report, schedule_file).splitlines()),
        ]
    return lines


def _drafted(report: dict) -> str:
    only = report.get("drafts_only_k") or []
    block = f"a block of {report['block']} drafted, k verified"
    if not only:
        return f"{block} (k=0: no drafts)"
    return (
        f"k = {', '.join(map(str, only))} drafted and verified, other k: {block} (k=0: no drafts)"
    )


def smaller_k_lines(schedule: list, top: int, drafts_only_k=()) -> list[str]:
    """Where the schedule verifies fewer than the block it drafts every step (a k not in
    ``drafts_only_k``): there an engine serving that k alone drafts only k, a shorter step,
    which the one engine cannot measure."""
    last = len(schedule) - 1
    below = [
        (i, *r) for i, r in enumerate(schedule) if 0 < r[2] < top and r[2] not in drafts_only_k
    ]
    if not below:
        return []
    where = ", ".join(
        f"{s} and above (k={k})" if i == last else f"{s}-{e} (k={k})" if s < e else f"{s} (k={k})"
        for i, s, e, k in below
    )
    return [
        f"(every step drafts the block of {top}; at batch sizes {where} only k are verified. An "
        "engine with num_speculative_tokens=k drafts k and its step is shorter: if your load "
        "stays there, serve both and compare; docs/tune.md)"
    ]


def _chosen(c: dict) -> str:
    if c.get("speedup_vs_plain"):
        speedup = f" ({c['speedup_vs_plain']:.2f}x plain decoding)"
    else:
        speedup = f" ({c['speedup_vs_k0']:.2f}x k=0)" if c["speedup_vs_k0"] else ""
    return f"batch {c['batch']}: k={c['k']}{speedup}"


def plot_tune_report(report: dict, path: str | Path) -> Path:
    """PNG: expected output tokens/s against batch size, one line per k, the chosen k marked;
    and the measured decode step time per batch size for each k."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {(m["batch"], m["k"]): m for m in report["measurements"]}
    batches, ks = report["batch_sizes"], report["ks"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.4), constrained_layout=True)
    for i, k in enumerate(ks):
        label = "k=0 (no drafts)" if k == 0 else f"k={k}"
        left.plot(
            batches,
            [rows[(b, k)]["expected_tokens_per_s"] for b in batches],
            marker="o",
            color=f"C{i % 10}",
            label=label,
        )
        right.plot(
            batches, [rows[(b, k)]["step_ms"] for b in batches], marker="o", color=f"C{i % 10}"
        )
    plain = {p["batch"]: p for p in report.get("plain") or []}
    if plain:
        xs = [b for b in batches if b in plain]
        style = dict(marker="s", linestyle="--", color="black", label="plain decoding")
        left.plot(xs, [plain[b]["tokens_per_s"] for b in xs], **style)
        right.plot(xs, [plain[b]["step_ms"] for b in xs], **style)
    left.plot(
        [c["batch"] for c in report["chosen"]],
        [c["expected_tokens_per_s"] for c in report["chosen"]],
        linestyle="none",
        marker="*",
        markersize=16,
        color="black",
        label="chosen",
    )
    for c in report["chosen"]:
        left.annotate(
            f"k={c['k']}",
            (c["batch"], c["expected_tokens_per_s"]),
            textcoords="offset points",
            xytext=(0, 9),
            ha="center",
            fontsize=8,
        )
    for ax, title, ylabel in (
        (left, "expected output tokens/s", "tokens/s"),
        (right, "decode step time (median)", "ms"),
    ):
        ax.set(title=title, xlabel="batch size (requests in flight)", ylabel=ylabel)
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.grid(alpha=0.3)
    left.legend(fontsize=8)
    fig.suptitle(
        f"{report['method']} on {report['platform']}: {Path(report['target']).name}, "
        f"block {report['block']}, acceptance {report['acceptance_used']}, "
        f"schedule {report['schedule']}",
        fontsize=10,
    )
    from vllm_nemotron_spec.bench.report import save_figure

    return save_figure(fig, path)
