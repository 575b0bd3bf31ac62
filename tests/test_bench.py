"""``bench``: method specs, counters -> acceptance numbers, /metrics parsing, the server client
(against a fake OpenAI server in this process), the report, the plot, and the real engine on the
tiny family (offline, and a real ``vllm serve``; marked ``engine``)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.background import start_early
from vllm_nemotron_spec import bench
from vllm_nemotron_spec.bench import (
    BenchError,
    MethodSpec,
    RunStats,
    histogram_from_counters,
    parse_method_spec,
    parse_server_spec,
    spec_counters_from_metrics,
)
from vllm_nemotron_spec.bench.methods import _with_labels
from vllm_nemotron_spec.prompts import PromptSet
from vllm_nemotron_spec.runs import SpecCounters

RUN_KEYS = {
    "label",
    "method",
    "draft",
    "num_speculative_tokens",
    "status",
    "error",
    "num_prompts",
    "output_tokens",
    "seconds",
    "tokens_per_s",
    "speedup_vs_plain",
    "mean_tpot_ms",
    "mean_ttft_ms",
    "timing_source",
    "num_drafts",
    "num_draft_tokens",
    "num_accepted_tokens",
    "draft_acceptance_rate",
    "mean_acceptance_length",
    "accepted_per_position",
    "per_position_acceptance",
    "acceptance_histogram",
    "acceptance_histogram_source",
    "matches_plain",
    "first_mismatching_prompt",
}
REPORT_KEYS = {
    "schema",
    "mode",
    "vllm_version",
    "platform",
    "model",
    "prompts",
    "max_tokens",
    "temperature",
    "ignore_eos",
    "reference",
    "runs",
}


# ---- method specs ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("plain", MethodSpec("plain")),
        ("ngram", MethodSpec("ngram")),
        ("ngram:3", MethodSpec("ngram", None, 3)),
        ("dflash", MethodSpec("dflash")),
        ("dflash:4", MethodSpec("dflash", None, 4)),
        ("dflash:/m/draft", MethodSpec("dflash", "/m/draft")),
        ("DFlash:/m/draft:5", MethodSpec("dflash", "/m/draft", 5)),
        ("dspark:C:/odd:dir:7", MethodSpec("dspark", "C:/odd:dir", 7)),
        ("eagle3:/e3:2", MethodSpec("eagle3", "/e3", 2)),
    ],
)
def test_parse_method_spec(text, expected):
    assert parse_method_spec(text) == expected


@pytest.mark.parametrize(
    "text, message",
    [
        ("medusa", r"unknown method 'medusa'; expected one of plain, ngram, dflash, dspark"),
        ("plain:3", "plain decoding takes no draft and no K"),
        ("ngram:/x", "ngram takes no draft directory"),
        ("dflash:/x:0", "num_speculative_tokens must be a positive integer, found 0"),
        ("dflash::3", "empty draft directory"),
    ],
)
def test_parse_method_spec_errors(text, message):
    with pytest.raises(BenchError, match=message):
        parse_method_spec(text)


def test_resolve_methods_without_family():
    got = bench.resolve_methods([MethodSpec("plain"), MethodSpec("ngram")])
    assert got == [
        MethodSpec("plain", label="plain"),
        MethodSpec("ngram", None, bench.DEFAULT_NGRAM_TOKENS, label="ngram"),
    ]
    with pytest.raises(
        BenchError, match=r"dflash: needs a draft checkpoint: dflash:DRAFT_DIR\[:K\]"
    ):
        bench.resolve_methods([MethodSpec("dflash")])
    with pytest.raises(BenchError, match=r"eagle3:/e: give the number of drafted tokens"):
        bench.resolve_methods([MethodSpec("eagle3", "/e")])


def test_labels_are_unique_and_say_what_differs():
    specs = [
        MethodSpec("ngram", None, 3),
        MethodSpec("ngram", None, 5),
        MethodSpec("eagle3", "/a/x", 2),
        MethodSpec("eagle3", "/b/y", 2),
        MethodSpec("plain"),
        MethodSpec("plain"),
    ]
    labels = [s.label for s in _with_labels(specs)]
    assert labels == ["ngram k=3", "ngram k=5", "eagle3 k=2 x", "eagle3 k=2 y", "plain", "plain #2"]


# ---- counters -> acceptance -------------------------------------------------------------------


def test_histogram_from_counters():
    # 10 drafting steps, K=3: 2 steps accepted 0, 3 accepted 1, 1 accepted 2, 4 accepted all 3.
    c = SpecCounters(
        num_drafts=10,
        num_draft_tokens=30,
        num_accepted_tokens=3 + 2 * 1 + 3 * 4,
        accepted_per_position=[8, 5, 4],
    )
    hist = histogram_from_counters(c)
    assert hist == [2, 3, 1, 4]
    assert sum(hist) == c.num_drafts
    assert sum(k * n for k, n in enumerate(hist)) == c.num_accepted_tokens
    assert c.mean_acceptance_length == pytest.approx(1 + 17 / 10)
    assert histogram_from_counters(SpecCounters()) is None
    # Inconsistent counters (position 2 accepted more often than position 1): no histogram.
    assert histogram_from_counters(SpecCounters(4, 8, 3, [1, 2])) is None


def metrics_text(model="m", drafts=0, draft_tokens=0, accepted=0, per_pos=(), engines=("0",)):
    """A /metrics page as vLLM's prometheus_client writes it (HELP/TYPE, _total, _created)."""
    import prometheus_client  # a dependency of vLLM

    registry = prometheus_client.CollectorRegistry()
    labels = ["model_name", "engine"]
    made = {}
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        made[name] = prometheus_client.Counter(
            f"vllm:spec_decode_{name}", "help", labels, registry=registry
        )
    per = prometheus_client.Counter(
        "vllm:spec_decode_num_accepted_tokens_per_pos",
        "help",
        labels + ["position"],
        registry=registry,
    )
    other = prometheus_client.Counter("vllm:generation_tokens", "help", labels, registry=registry)
    for engine in engines:
        made["num_drafts"].labels(model, engine).inc(drafts)
        made["num_draft_tokens"].labels(model, engine).inc(draft_tokens)
        made["num_accepted_tokens"].labels(model, engine).inc(accepted)
        for pos, n in enumerate(per_pos):
            per.labels(model, engine, str(pos)).inc(n)
        other.labels(model, engine).inc(1234)
    return prometheus_client.generate_latest(registry).decode()


def test_spec_counters_from_metrics_text():
    text = metrics_text('we"ird,model', 7, 21, 9, (5, 3, 1))
    assert 'model_name="we\\"ird,model"' in text and "_created" in text
    assert spec_counters_from_metrics(text) == SpecCounters(7, 21, 9, [5, 3, 1])
    # Two engines (data parallel) are summed.
    two = spec_counters_from_metrics(metrics_text("m", 7, 21, 9, (5, 3, 1), engines=("0", "1")))
    assert two == SpecCounters(14, 42, 18, [10, 6, 2])


def test_spec_counters_absent_without_spec_decoding():
    assert spec_counters_from_metrics("# HELP x\nvllm:generation_tokens_total 5.0\n") is None


def test_prometheus_parse_errors():
    with pytest.raises(BenchError, match="/metrics line 2: not a Prometheus sample"):
        bench.parse_prometheus_text("a 1\n{oops\n")
    with pytest.raises(BenchError, match="/metrics line 1: bad value 'x'"):
        bench.parse_prometheus_text("a x\n")
    with pytest.raises(BenchError, match="without a position label"):
        spec_counters_from_metrics("vllm:spec_decode_num_accepted_tokens_per_pos_total 3\n")


@pytest.mark.parametrize(
    "text, label, url",
    [
        ("http://127.0.0.1:8000", "127.0.0.1:8000", "http://127.0.0.1:8000"),
        ("dflash=http://localhost:8001/v1/", "dflash", "http://localhost:8001"),
        ("http://127.0.0.1:8000/?a=b", "127.0.0.1:8000", "http://127.0.0.1:8000"),
    ],
)
def test_parse_server_spec(text, label, url):
    assert parse_server_spec(text) == bench.ServerSpec(label, url)


def test_parse_server_spec_refuses_other_hosts():
    with pytest.raises(BenchError, match=r"host '10\.0\.0\.2' is not this machine"):
        parse_server_spec("http://10.0.0.2:8000")
    with pytest.raises(BenchError, match=r"expected \[LABEL=\]http://127\.0\.0\.1:PORT"):
        parse_server_spec("127.0.0.1:8000")


# ---- report -----------------------------------------------------------------------------------


def fake_runs():
    plain = RunStats(
        "plain",
        "plain",
        num_prompts=2,
        output_tokens=40,
        seconds=2.0,
        tpot_ms=[50.0, 50.0],
        ttft_ms=[10.0, 12.0],
        timing_source="request_metrics",
        token_ids=[[1] * 20, [2] * 20],
    )
    c = SpecCounters(10, 30, 17, [8, 5, 4])
    spec = RunStats(
        "dflash",
        "dflash",
        "/d",
        3,
        num_prompts=2,
        output_tokens=40,
        seconds=1.0,
        tpot_ms=[20.0, 30.0],
        ttft_ms=[10.0, 10.0],
        timing_source="request_metrics",
        counters=c,
        histogram=histogram_from_counters(c),
        histogram_source="per_position_counters",
        token_ids=[[1] * 20, [2] * 19 + [3]],
    )
    missing = RunStats(
        "dspark",
        "dspark",
        "/s",
        8,
        status="unsupported",
        num_prompts=2,
        error="Model Runner V1 does not support: dspark speculative decoding",
    )
    return [plain, spec, missing]


def fake_report(**kw):
    return bench.make_report(
        fake_runs(),
        mode="offline",
        model="/x/target",
        prompts=PromptSet(("a", "b"), "tiny-family"),
        num_prompts=2,
        max_tokens=20,
        temperature=kw.get("temperature", 0.0),
        ignore_eos=True,
        platform="cpu",
        vllm_version="0.32.0",
    )


def test_report_schema_and_derived_numbers():
    report = json.loads(json.dumps(fake_report()))  # JSON-able
    assert set(report) == REPORT_KEYS and report["schema"] == bench.SCHEMA
    assert report["reference"] == "plain"
    plain, spec, dspark = report["runs"]
    for run in report["runs"]:
        assert set(run) == RUN_KEYS
    assert plain["tokens_per_s"] == 20.0 and plain["speedup_vs_plain"] == 1.0
    assert plain["mean_acceptance_length"] is None and plain["matches_plain"] is None
    assert spec["speedup_vs_plain"] == 2.0
    assert spec["mean_tpot_ms"] == 25.0
    assert spec["mean_acceptance_length"] == 2.7
    assert spec["draft_acceptance_rate"] == round(17 / 30, 4)
    assert spec["per_position_acceptance"] == [0.8, 0.5, 0.4]
    assert spec["acceptance_histogram"] == [2, 3, 1, 4]
    assert spec["matches_plain"] is False and spec["first_mismatching_prompt"] == 1
    assert dspark["status"] == "unsupported" and dspark["tokens_per_s"] is None
    assert dspark["mean_acceptance_length"] is None and dspark["speedup_vs_plain"] is None


def test_report_skips_token_comparison_when_sampling():
    report = fake_report(temperature=0.7)
    assert report["runs"][1]["matches_plain"] is None


def test_format_report():
    text = bench.format_report(fake_report())
    lines = text.splitlines()
    assert lines[0] == "vLLM 0.32.0, offline on cpu; model: /x/target"
    row = next(line for line in lines if line.startswith("dflash "))
    assert "2.00x" in row and "2.70" in row and "NO (prompt 1)" in row
    assert any(line.startswith("plain ") and "(reference)" in line for line in lines)
    assert (
        "dspark  unsupported on this platform: Model Runner V1 does not support: dspark "
        "speculative decoding"
    ) in text
    assert "from per position counters" in text
    hist_row = lines[-3]
    assert hist_row.split() == ["dflash", "2", "3", "1", "4"]


def test_plot_report(tmp_path):
    path = bench.plot_report(fake_report(), tmp_path / "sub" / "bench.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    empty = fake_report()
    empty["runs"] = empty["runs"][:1]
    assert bench.plot_report(empty, tmp_path / "empty.png").stat().st_size > 0


def test_execution_order_runs_ngram_last():
    specs = [
        MethodSpec("plain"),
        MethodSpec("ngram", None, 3),
        MethodSpec("dflash", "/d", 5),
        MethodSpec("ngram", None, 5),
    ]
    assert bench.execution_order(specs) == [0, 2, 1, 3]


def test_classify_start_error():
    pydantic_style = ValueError(
        "1 validation error for VllmConfig\n  Value error, Model Runner V1 does not support: "
        "dspark speculative decoding [type=value_error, input_value=ArgsKwargs((), {'m': 1})]\n"
        "    For further information visit https://errors.pydantic.dev/2.14/v/value_error"
    )
    assert bench.classify_start_error(pydantic_style) == (
        "unsupported",
        "Model Runner V1 does not support: dspark speculative decoding",
    )
    assert bench.classify_start_error(NotImplementedError("no")) == (
        "unsupported",
        "NotImplementedError: no",
    )
    assert bench.classify_start_error(RuntimeError("boom\nmore"))[0] == "error"
    assert bench.classify_start_error(RuntimeError("boom\nmore"))[1] == "RuntimeError: boom"


# ---- server client against a fake OpenAI server -------------------------------------------------


class FakeVllmServer:
    """Speaks the slice of vLLM's OpenAI server that ``bench`` uses. With ``k`` it does
    speculative decoding: every step after the first token emits 1 + a accepted drafts (cycling
    through ``accepts``) and counts them in /metrics."""

    def __init__(self, k: int | None = None, accepts=(2, 0, 1), per_request_metrics=False):
        self.k, self.accepts, self.per_request_metrics = k, accepts, per_request_metrics
        self.counters = SpecCounters(0, 0, 0, [0] * (k or 0))
        self.lock = threading.Lock()
        self.requests = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, body: bytes, ctype="application/json"):
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path == "/v1/models":
                    self._send(json.dumps({"data": [{"id": "fake-model"}]}).encode())
                elif self.path == "/version":
                    self._send(b'{"version": "0.32.0"}')
                elif self.path == "/metrics":
                    self._send(server.metrics().encode(), "text/plain")
                else:
                    self.send_error(404)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append(body)
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for chunk in server.stream(body):
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.write(b"data: [DONE]\n\n")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        ).start()

    def metrics(self) -> str:
        if self.k is None:
            return "# HELP vllm:generation_tokens_total x\nvllm:generation_tokens_total 1.0\n"
        c = self.counters
        return metrics_text(
            "fake-model",
            c.num_drafts,
            c.num_draft_tokens,
            c.num_accepted_tokens,
            c.accepted_per_position,
        )

    def stream(self, body):
        n, prompt = body["max_tokens"], body["prompt"]
        tokens = [hash((prompt, i)) % 1000 for i in range(n)]
        chunks, i, step, hist = [tokens[:1]], 1, 0, [0] * ((self.k or 0) + 1)
        while i < n:
            a = 0
            if self.k:
                a = min(self.accepts[step % len(self.accepts)], n - i - 1, self.k)
                with self.lock:
                    c = self.counters
                    c.num_drafts += 1
                    c.num_draft_tokens += self.k
                    c.num_accepted_tokens += a
                    for p in range(a):
                        c.accepted_per_position[p] += 1
                hist[a] += 1
            chunks.append(tokens[i : i + 1 + a])
            i += 1 + a
            step += 1
        for ids in chunks:
            yield {"choices": [{"index": 0, "text": "x" * len(ids), "token_ids": ids}]}
        final = {"choices": [], "usage": {"completion_tokens": n}}
        if self.per_request_metrics and self.k:
            final["metrics"] = {"speculative_decoding": {"acceptance_histogram": hist}}
        yield final

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake_servers():
    made = []

    def make(**kw):
        made.append(FakeVllmServer(**kw))
        return made[-1]

    yield make
    for s in made:
        s.close()


def test_run_server_against_fake_servers(fake_servers):
    plain, spec = fake_servers(), fake_servers(k=3)
    servers = [parse_server_spec(f"plain={plain.url}"), parse_server_spec(f"dflash={spec.url}")]
    prompts = ["p1", "p2", "p3"]
    runs, models = bench.run_server(
        servers,
        prompts,
        max_tokens=10,
        max_concurrency=2,
        ignore_eos=True,
        progress=False,
        metrics_settle_s=0.5,
    )
    assert models == {"plain": "fake-model", "dflash": "fake-model"}
    # The warm-up request is not counted: deltas cover the 3 measured requests only.
    p, s = runs
    assert p.method == "plain" and p.counters is None
    assert s.method == "speculative" and s.num_speculative_tokens == 3
    assert p.output_tokens == s.output_tokens == 30
    assert p.token_ids == s.token_ids
    # Each request: first token, then steps accepting 2, 0, 1, 2 (capped by max_tokens): 10 tokens.
    assert s.counters == SpecCounters(12, 36, 15, [9, 6, 0])
    assert s.histogram == [3, 3, 6, 0] and s.histogram_source == "per_position_counters"
    assert all(
        body["stream"] and body["return_token_ids"] and body["ignore_eos"] for body in spec.requests
    )
    report = bench.make_report(
        runs,
        mode="server",
        model="fake-model",
        prompts=PromptSet(tuple(prompts), "x"),
        num_prompts=3,
        max_tokens=10,
        temperature=0.0,
        ignore_eos=True,
        platform="server",
        vllm_version="0.32.0",
    )
    r = report["runs"][1]
    assert r["mean_acceptance_length"] == 2.25 and r["matches_plain"] is True
    assert r["timing_source"] == "client_stream" and r["mean_tpot_ms"] > 0
    assert sum(r["acceptance_histogram"]) == r["num_drafts"]


def test_run_server_uses_per_request_histograms(fake_servers):
    spec = fake_servers(k=3, per_request_metrics=True)
    runs, _ = bench.run_server(
        [parse_server_spec(spec.url)],
        ["p1", "p2"],
        max_tokens=10,
        progress=False,
        warmup=False,
        metrics_settle_s=0.5,
    )
    assert runs[0].histogram_source == "per_request_metrics"
    assert runs[0].histogram == histogram_from_counters(runs[0].counters) == [2, 2, 4, 0]


def test_server_errors_are_reported(fake_servers):
    with pytest.raises(
        BenchError,
        match=r"GET http://127\.0\.0\.1:1/v1/models: .*is the server "
        r"running\?",
    ):
        bench.run_server(
            [parse_server_spec("http://127.0.0.1:1")], ["p"], max_tokens=2, progress=False
        )


# ---- CLI errors (before any engine starts) ----------------------------------------------------


def test_cli_errors_exit_2_before_any_engine(tmp_path, capsys):
    from vllm_nemotron_spec.cli.main import main

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input": "x"}\n', "utf-8")
    assert main(["bench", "--model", "/nowhere", "--prompts", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f'{bad}:line 1: expected one of the keys "prompt", "text", "question", "turns"' in err
    assert main(["bench", "--model", "/nowhere", "--method", "medusa"]) == 2
    assert "unknown method 'medusa'" in capsys.readouterr().err
    assert main(["bench", "--server", "http://127.0.0.1:1", "--method", "plain"]) == 2
    assert "--server measures running servers" in capsys.readouterr().err
    assert main(["bench", "--model", "/nowhere", "--engine-arg", "oops"]) == 2
    assert "--engine-arg 'oops': expected KEY=VALUE" in capsys.readouterr().err
    assert main(["bench", "--model", "/nowhere", "--max-tokens", "0"]) == 2
    assert "--max-tokens must be >= 1, got 0" in capsys.readouterr().err
    assert main(["bench", "--model", "/nowhere", "--method", "dflash"]) == 2
    assert "--method dflash: needs a draft checkpoint" in capsys.readouterr().err


def test_draft_checks_before_any_engine(tiny_family, tiny_seed, capsys):
    from vllm_nemotron_spec.cli.main import main

    family = ["bench", "--family-dir", str(tiny_family.root), "--seed", str(tiny_seed)]
    assert main([*family, "--method", f"dflash:{tiny_family.dspark_draft}"]) == 2
    assert (
        f"--method dflash:{tiny_family.dspark_draft}: the draft is a dspark draft "
        f"(Qwen3DSparkModel), not dflash; use --method dspark:"
    ) in capsys.readouterr().err
    assert main([*family, "--method", "dspark:9"]) == 2
    assert "num_speculative_tokens=9 exceeds the trained block_size 8" in capsys.readouterr().err
    # Defaults come from the draft's config: DSpark block_size; the Nemotron 3.5 DFlash layout
    # declares no block_size and drafts 5 (NVIDIA's recipe).
    got = bench.resolve_methods([MethodSpec("dflash"), MethodSpec("dspark")], tiny_family)
    assert [m.num_speculative_tokens for m in got] == [5, 8]
    from vllm_nemotron_spec.tiny.train_draft import ensure_trained_drafts

    trained = ensure_trained_drafts(family=tiny_family)
    assert [m.draft for m in got] == [str(trained.dflash), str(trained.dspark)]


def test_draft_not_available_locally_needs_k(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(
        BenchError,
        match=r"not a local directory nor in the local Hugging Face "
        r"cache, so its default K cannot be read; give it: "
        r"dflash:nobody/no-such-draft:K",
    ):
        bench.resolve_methods([parse_method_spec("dflash:nobody/no-such-draft")])
    got = bench.resolve_methods([parse_method_spec("dflash:nobody/no-such-draft:4")])
    assert got[0].speculative_config() == {
        "method": "dflash",
        "model": "nobody/no-such-draft",
        "num_speculative_tokens": 4,
    }


# ---- the real engine on the tiny family ------------------------------------------------------

"""vLLM 0.32's V1 proposers reject a draft with several attention layers on a hybrid (Mamba)
target (docs/cpu-vllm.md); the tiny family's DFlash draft has 6 layers, like the official one."""


def run_cli(argv: list[str], spy_target: str):
    """``vllm-nemotron-spec bench ... --json --no-progress`` in this process: (exit code, report,
    what ``bench.<spy_target>`` returned)."""
    import contextlib
    import io

    from vllm_nemotron_spec.cli.main import main

    seen = {}
    out = io.StringIO()
    original = getattr(bench, spy_target)

    def spy(*args, **kwargs):
        seen["result"] = original(*args, **kwargs)
        return seen["result"]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bench, spy_target, spy)
        with contextlib.redirect_stdout(out):
            code = main(["bench", *argv, "--json", "--no-progress"])
    return code, json.loads(out.getvalue()), seen.get("result")


def assert_acceptance_consistent(r: dict, stats: RunStats) -> None:
    """The acceptance numbers of one speculative run agree with each other and with vLLM's
    counters."""
    k = r["num_speculative_tokens"]
    assert r["status"] == "ok", r["error"]
    assert r["num_drafts"] > 0 and r["num_draft_tokens"] <= k * r["num_drafts"]
    assert 1.0 <= r["mean_acceptance_length"] <= 1.0 + k
    assert r["mean_acceptance_length"] == pytest.approx(
        1 + r["num_accepted_tokens"] / r["num_drafts"], abs=1e-4
    )
    hist = r["acceptance_histogram"]
    assert len(hist) == k + 1 and sum(hist) == r["num_drafts"]
    # Position p is accepted in the steps that accepted more than p drafts: the rates from
    # vLLM's per-position counters against its per-request histograms.
    assert r["per_position_acceptance"] == [
        round(sum(hist[p + 1 :]) / r["num_drafts"], 4) for p in range(k)
    ]
    assert sum(a * n for a, n in enumerate(hist)) == r["num_accepted_tokens"]
    # vLLM's per-request histograms agree with the one derived from its per-position counters.
    assert r["acceptance_histogram_source"] == "per_request_metrics"
    assert hist == histogram_from_counters(stats.counters)
    assert r["output_tokens"] == sum(len(t) for t in stats.token_ids)
    assert r["mean_tpot_ms"] > 0 and r["tokens_per_s"] > 0


def assert_comparison_reported(r: dict, stats: RunStats, plain: RunStats) -> None:
    """matches_plain / first_mismatching_prompt say what the token ids say."""
    mismatch = next(
        (i for i, (a, b) in enumerate(zip(stats.token_ids, plain.token_ids)) if a != b), None
    )
    assert r["matches_plain"] is (mismatch is None)
    assert r["first_mismatching_prompt"] == mismatch


@pytest.fixture(scope="module")
def one_layer_dflash(tiny_family, tmp_path_factory):
    """A 1-layer DFlash draft for the tiny target (random init, like the family's drafts): a
    second, generic-sized DFlash draft next to the family's 6-layer one."""
    from vllm_nemotron_spec.tiny.drafts import DraftParams, build_draft

    out = tmp_path_factory.mktemp("bench-draft") / "dflash-1layer"
    return build_draft(
        out, "dflash", tiny_family.target, seed=0, params=DraftParams(num_hidden_layers=1)
    )


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench-prompts") / "gsm8k-style.jsonl"
    path.write_text(
        "".join(
            json.dumps({"question": q, "answer": "#### 0"}) + "\n"
            for q in (
                "Count from 3: 3, 4,",
                "Days: monday, tuesday,",
                "12 + 7 = 19; 3 * 4 =",
            )
        ),
        "utf-8",
    )
    return path


@pytest.mark.engine
def test_offline_default_methods_on_tiny_family(tiny_family, tiny_seed, tmp_path):
    plot = tmp_path / "bench.png"
    code, report, runs = run_cli(
        [
            "--family-dir",
            str(tiny_family.root),
            "--seed",
            str(tiny_seed),
            "--num-prompts",
            "2",
            "--max-tokens",
            "12",
            "--plot",
            str(plot),
        ],
        spy_target="run_offline",
    )
    assert set(report) >= REPORT_KEYS and report["mode"] == "offline"
    assert report["prompts"] == {"source": "tiny-family", "key": None, "num_prompts": 2}
    assert [r["label"] for r in report["runs"]] == ["plain", "dflash", "dspark"]
    assert report["reference"] == "plain"
    for r in report["runs"]:
        assert set(r) == RUN_KEYS
    plain, dflash, dspark = report["runs"]
    assert code == (1 if any(r["status"] == "error" for r in report["runs"]) else 0)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    assert plain["status"] == "ok" and plain["num_drafts"] is None
    assert plain["output_tokens"] == sum(len(t) for t in runs[0].token_ids) > 0
    assert plain["speedup_vs_plain"] == 1.0 and plain["timing_source"] == "request_metrics"

    # dspark: vLLM's V1 runner refuses it; the plugin's V1 proposer runs it (CPU and GPU).
    from vllm_nemotron_spec.tiny.train_draft import ensure_trained_drafts

    trained = ensure_trained_drafts(family=tiny_family)
    assert dspark["draft"] == str(trained.dspark)
    assert dspark["status"] == "ok", dspark["error"]
    assert_acceptance_consistent(dspark, runs[2])
    assert_comparison_reported(dspark, runs[2], runs[0])

    assert dflash["draft"] == str(trained.dflash)
    assert dflash["status"] == "ok", dflash["error"]
    assert_acceptance_consistent(dflash, runs[1])
    assert_comparison_reported(dflash, runs[1], runs[0])


@pytest.fixture(scope="module")
def offline_explicit(tiny_family, tiny_seed, one_layer_dflash, prompt_file):
    return run_cli(
        [
            "--family-dir",
            str(tiny_family.root),
            "--seed",
            str(tiny_seed),
            "--prompts",
            str(prompt_file),
            "--max-tokens",
            "24",
            "--no-warmup",
            "--method",
            "plain",
            "--method",
            "ngram:3",
            "--method",
            f"dflash:{one_layer_dflash}:3",
        ],
        spy_target="run_offline",
    )


@pytest.mark.engine
def test_offline_prompt_file_and_explicit_methods(offline_explicit, prompt_file):
    code, report, runs = offline_explicit
    assert code == 0
    assert report["prompts"] == {"source": str(prompt_file), "key": "question", "num_prompts": 3}
    assert [r["label"] for r in report["runs"]] == ["plain", "ngram", "dflash"]
    assert [r["num_speculative_tokens"] for r in report["runs"]] == [None, 3, 3]
    plain, ngram, dflash = report["runs"]
    assert plain["output_tokens"] == sum(len(t) for t in runs[0].token_ids) > 0
    for r, stats in ((ngram, runs[1]), (dflash, runs[2])):
        assert_acceptance_consistent(r, stats)
        assert_comparison_reported(r, stats, runs[0])
        assert r["speedup_vs_plain"] == pytest.approx(
            r["tokens_per_s"] / plain["tokens_per_s"], rel=1e-2, abs=2e-3
        )
    # The tiny target continues these prompts with repeating patterns that ngram drafts from
    # the context, so its histogram is not all "nothing accepted".
    assert ngram["num_accepted_tokens"] > 0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def dflash_server_process(tiny_family, one_layer_dflash, tmp_path_factory):
    """A real ``vllm serve`` (through the package's passthrough) on 127.0.0.1 with the 1-layer
    DFlash draft, launched when the module starts (it starts while the offline tests run; most
    of a start is vLLM's single-threaded import) and not waited for; stopped at the end of the
    module. ``(process, url, log, launch time)``."""
    import os
    import subprocess
    import sys
    import time

    port = _free_port()
    log = tmp_path_factory.mktemp("bench-server") / "serve.log"
    env = dict(os.environ)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server's engine core is its own process
    spec = {"method": "dflash", "model": str(one_layer_dflash), "num_speculative_tokens": 3}
    cmd = [
        sys.executable,
        "-m",
        "vllm_nemotron_spec.cli.main",
        "vllm",
        "serve",
        str(tiny_family.target),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        "512",
        "--max-num-seqs",
        "4",
        "--no-enable-prefix-caching",
        "--speculative-config",
        json.dumps(spec),
        "--per-request-spec-decode-metrics",
        "summary",
    ]
    launched = time.monotonic()
    with open(log, "wb") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env)
    try:
        yield proc, f"http://127.0.0.1:{port}", log, launched
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module", autouse=True)
def _launch_server_early(request):
    start_early(request, "dflash_server_process")


@pytest.fixture(scope="module")
def dflash_server(dflash_server_process):
    """The server of :func:`dflash_server_process`, once ready (300 s from its launch)."""
    import time
    import urllib.request

    proc, url, log, launched = dflash_server_process
    deadline = launched + 300
    while True:
        if proc.poll() is not None:
            pytest.fail(f"vllm serve exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                break
        except OSError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"vllm serve not ready after 300 s:\n{log.read_text()[-3000:]}")
        time.sleep(1)
    import vllm

    return url, vllm.__version__  # what the server's /version reports


@pytest.mark.engine
def test_server_mode_against_real_vllm_serve(dflash_server, prompt_file):
    url, version = dflash_server
    code, report, result = run_cli(
        [
            "--server",
            f"dflash={url}",
            "--prompts",
            str(prompt_file),
            "--num-prompts",
            "4",
            "--max-tokens",
            "16",
            "--max-concurrency",
            "2",
        ],
        spy_target="run_server",
    )
    runs, models = result
    assert code == 0
    assert set(report) >= REPORT_KEYS | {"servers"} and report["mode"] == "server"
    assert report["vllm_version"] == version
    assert report["servers"] == [{"label": "dflash", "url": url, "model": models["dflash"]}]
    assert report["reference"] is None
    r = report["runs"][0]
    assert set(r) == RUN_KEYS
    assert r["label"] == "dflash" and r["method"] == "speculative"
    assert r["num_speculative_tokens"] == 3 and r["num_prompts"] == 4
    assert r["timing_source"] == "client_stream"
    # /metrics counter deltas, per-request histograms and streamed tokens agree.
    assert_acceptance_consistent(r, runs[0])
    assert r["speedup_vs_plain"] is None and r["matches_plain"] is None
