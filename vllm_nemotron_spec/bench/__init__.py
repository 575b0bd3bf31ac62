"""Acceptance and speed of speculative decoding methods, side by side on one prompt set.

``offline`` runs each method in its own ``vllm.LLM`` in this process; ``online`` drives running
``vllm serve`` processes with a bounded pool of streaming clients and reads their ``/metrics``.
Each submodule imports only those listed before it: ``stats``, ``methods``, ``client`` (the one
HTTP, SSE and Prometheus client), ``server``, ``offline``, ``online``, ``report``, then ``tune``'s
own: ``schedule`` (the pure per-batch-size schedule arithmetic), ``tune`` (its measurements),
``tune_report``. What is measured and what is derived is described in ``docs/bench.md`` and
``docs/tune.md``.
"""

from vllm_nemotron_spec.bench.client import parse_prometheus_text, spec_counters_from_metrics
from vllm_nemotron_spec.bench.methods import (
    DEFAULT_NGRAM_TOKENS,
    DRAFT_METHODS,
    FAMILY_DRAFTS,
    METHODS,
    MethodSpec,
    default_methods,
    family_draft,
    local_checkpoint,
    parse_method_spec,
    resolve_methods,
)
from vllm_nemotron_spec.bench.offline import (
    classify_start_error,
    engine_defaults,
    execution_order,
    measure_offline,
    run_offline,
)
from vllm_nemotron_spec.bench.online import ServerSpec, parse_server_spec, run_server
from vllm_nemotron_spec.bench.report import (
    PlotUnavailable,
    check_plot_available,
    format_report,
    plot_report,
)
from vllm_nemotron_spec.bench.stats import (
    SCHEMA,
    BenchError,
    RunStats,
    add_histograms,
    first_mismatch,
    histogram_from_counters,
    make_report,
    run_to_json,
)

__all__ = [
    "DEFAULT_NGRAM_TOKENS",
    "DRAFT_METHODS",
    "FAMILY_DRAFTS",
    "METHODS",
    "SCHEMA",
    "BenchError",
    "MethodSpec",
    "PlotUnavailable",
    "RunStats",
    "ServerSpec",
    "add_histograms",
    "check_plot_available",
    "classify_start_error",
    "default_methods",
    "engine_defaults",
    "execution_order",
    "family_draft",
    "first_mismatch",
    "format_report",
    "histogram_from_counters",
    "local_checkpoint",
    "make_report",
    "measure_offline",
    "parse_method_spec",
    "parse_prometheus_text",
    "parse_server_spec",
    "plot_report",
    "resolve_methods",
    "run_offline",
    "run_server",
    "run_to_json",
    "spec_counters_from_metrics",
]
