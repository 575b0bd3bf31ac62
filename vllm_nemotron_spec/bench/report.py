"""The text report and the plot of a bench report."""

from __future__ import annotations

from pathlib import Path


def format_report(report: dict) -> str:
    runs = report["runs"]
    if report["mode"] == "server":
        servers = report.get("servers", [])
        where = "servers " + ", ".join(f"{s['label']}={s['url']}" for s in servers)
    else:
        where = f"offline on {report['platform']}"
    lines = [
        f"vLLM {report['vllm_version'] or '?'}, {where}; model: {report['model']}",
        f"prompts: {report['prompts']['source']} ({report['prompts']['num_prompts']}), "
        f"max_tokens {report['max_tokens']}, temperature {report['temperature']}"
        f"{', ignore_eos' if report['ignore_eos'] else ''}",
        "",
    ]
    width = max([len("method")] + [len(r["label"]) for r in runs])
    head = (
        f"{'method':<{width}}  {'tokens':>6}  {'s':>7}  {'tok/s':>8}  {'speedup':>7}  "
        f"{'TPOT ms':>8}  {'accept len':>10}  {'draft acc':>9}  matches plain"
    )
    lines += [head, "-" * len(head)]
    for r in runs:
        if r["status"] != "ok":
            what = "unsupported on this platform" if r["status"] == "unsupported" else "ERROR"
            lines.append(f"{r['label']:<{width}}  {what}: {r['error']}")
            continue
        matches = {None: "-", True: "yes"}.get(r["matches_plain"], None)
        if matches is None:
            matches = f"NO (prompt {r['first_mismatching_prompt']})"
        if r["label"] == report["reference"]:
            matches = "(reference)"
        lines.append(
            f"{r['label']:<{width}}  {r['output_tokens']:>6}  {r['seconds']:>7.2f}  "
            f"{_fmt(r['tokens_per_s'], '8.1f')}  {_fmt(r['speedup_vs_plain'], '6.2f', 'x'):>7}  "
            f"{_fmt(r['mean_tpot_ms'], '8.2f')}  {_fmt(r['mean_acceptance_length'], '10.2f')}  "
            f"{_fmt(r['draft_acceptance_rate'], '9.2f')}  {matches}"
        )
    spec_runs = [r for r in runs if r["per_position_acceptance"]]
    if spec_runs:
        k = max(len(r["per_position_acceptance"]) for r in spec_runs)
        lines += [
            "",
            "per-position acceptance (share of drafting steps whose token at position "
            "p was accepted)",
        ]
        lines.append(f"{'method':<{width}}  " + "  ".join(f"{f'p{p}':>5}" for p in range(1, k + 1)))
        for r in spec_runs:
            lines.append(
                f"{r['label']:<{width}}  "
                + "  ".join(f"{x:>5.2f}" for x in r["per_position_acceptance"])
            )
    hist_runs = [r for r in runs if r["acceptance_histogram"]]
    if hist_runs:
        k = max(len(r["acceptance_histogram"]) for r in hist_runs)
        sources = sorted({r["acceptance_histogram_source"] for r in hist_runs})
        lines += [
            "",
            "acceptance length histogram (drafting steps that emitted L tokens = 1 + "
            f"accepted drafts; from {', '.join(sources).replace('_', ' ')})",
        ]
        lines.append(
            f"{'method':<{width}}  " + "  ".join(f"{f'L={L}':>6}" for L in range(1, k + 1))
        )
        for r in hist_runs:
            lines.append(
                f"{r['label']:<{width}}  "
                + "  ".join(f"{x:>6d}" for x in r["acceptance_histogram"])
            )
    timing = sorted({r["timing_source"] for r in runs if r["timing_source"]})
    if timing:
        lines += ["", "TPOT from " + ", ".join(_TIMING_NOTES.get(t, t) for t in timing)]
    return "\n".join(lines)


_TIMING_NOTES = {
    "request_metrics": "vLLM's per-request timestamps (first to last token)",
    "wall_time": "wall time / longest output (vLLM gave no per-request timing)",
    "client_stream": "client-side stream timing (first to last chunk)",
}


def _fmt(value, spec: str, suffix: str = "") -> str:
    if value is None:
        width = int(spec.split(".")[0]) if spec[0].isdigit() else 0
        return f"{'-':>{width}}"
    return f"{value:{spec}}{suffix}"


class PlotUnavailable(RuntimeError):
    """``--plot`` asked for, but matplotlib cannot be imported."""


def check_plot_available() -> None:
    """Raise :class:`PlotUnavailable` (one line saying what to install) when matplotlib cannot
    be imported; called before any engine starts so a missing plotter costs nothing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise PlotUnavailable(
            f"--plot needs matplotlib, which cannot be imported here ({exc}); install it with "
            "`pip install matplotlib` (the cpu and gpu extras include it)"
        ) from None


def plot_report(report: dict, path: str | Path) -> Path:
    """PNG with three panels: per-position acceptance, the acceptance-length histogram as a share
    of drafting steps (one series per speculative run, K in the legends, every length labelled),
    and output tokens/s per method with the speedup over plain decoding."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    color = {r["label"]: f"C{i % 10}" for i, r in enumerate(report["runs"])}  # one per method
    spec = [r for r in report["runs"] if r["per_position_acceptance"]]
    timed = [r for r in report["runs"] if r["status"] == "ok" and r["tokens_per_s"]]
    fig, (left, mid, right) = plt.subplots(1, 3, figsize=(15, 4.2), constrained_layout=True)
    if not spec:
        for ax in (left, mid):
            ax.text(0.5, 0.5, "no speculative runs", ha="center", va="center")
            ax.set_axis_off()
    width = 0.8 / max(1, len(spec))
    longest = max((len(r["acceptance_histogram"] or []) for r in spec), default=0)
    for i, r in enumerate(spec):
        k = r["num_speculative_tokens"] or len(r["per_position_acceptance"])
        rates = r["per_position_acceptance"]
        left.plot(
            range(1, len(rates) + 1),
            rates,
            marker="o",
            color=color[r["label"]],
            label=f"{r['label']} (K={k}, accept len {r['mean_acceptance_length']:.2f})",
        )
        hist = r["acceptance_histogram"] or []
        total = sum(hist) or 1
        xs = [L + (i - (len(spec) - 1) / 2) * width for L in range(1, len(hist) + 1)]
        mid.bar(
            xs,
            [h / total for h in hist],
            width=width,
            label=f"{r['label']} (K={k})",
            color=color[r["label"]],
        )
    if spec:
        positions = max(len(r["per_position_acceptance"]) for r in spec)
        left.set(
            title="per-position acceptance",
            xlabel="draft position p",
            ylabel="share of drafting steps accepted",
            ylim=(0, 1.05),
            xticks=range(1, positions + 1),
        )
        left.legend(fontsize=8)
        left.grid(alpha=0.3)
        mid.set(
            title="acceptance length histogram",
            xlabel="tokens per step L (1 + accepted)",
            ylabel="share of drafting steps",
            xticks=range(1, longest + 1),
        )
        mid.legend(fontsize=8)
        mid.grid(alpha=0.3, axis="y")
    if timed:
        names = [
            r["label"]
            + (f" (K={r['num_speculative_tokens']})" if r["num_speculative_tokens"] else "")
            for r in timed
        ]
        speeds = [r["tokens_per_s"] for r in timed]
        bars = right.barh(range(len(timed)), speeds, color=[color[r["label"]] for r in timed])
        right.set_yticks(range(len(timed)), names)
        right.invert_yaxis()
        for bar, r in zip(bars, timed):
            note = f" {r['tokens_per_s']:.0f}"
            if r["speedup_vs_plain"] is not None:
                note += f" ({r['speedup_vs_plain']:.2f}x)"
            right.text(
                bar.get_width(), bar.get_y() + bar.get_height() / 2, note, va="center", fontsize=8
            )
        right.set(
            title="output tokens/s (speedup over plain)",
            xlabel="tokens/s",
            xlim=(0, max(speeds) * 1.3),
        )
        right.grid(alpha=0.3, axis="x")
    else:
        right.text(0.5, 0.5, "no timed runs", ha="center", va="center")
        right.set_axis_off()
    model = Path(str(report["model"]))
    fig.suptitle(
        f"{model.parent.name + '/' if model.parent.name else ''}{model.name} on "
        f"{report['platform']}: "
        f"{report['prompts']['num_prompts']} prompts x {report['max_tokens']} tokens"
        f"{'' if not report['temperature'] else ', temperature ' + str(report['temperature'])}",
        fontsize=10,
    )
    return save_figure(fig, path)


def save_figure(fig, path) -> Path:
    """Write a matplotlib figure to ``path`` atomically (never a half-written file) and close it."""
    import matplotlib.pyplot as plt

    from vllm_nemotron_spec.outputs import atomic_output_file

    path = Path(path)
    with atomic_output_file(path) as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)
    return path
