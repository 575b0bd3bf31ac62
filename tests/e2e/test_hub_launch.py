"""Real launches by Hub repo id, on CPU, through a loopback Hugging Face Hub.

``tests/hub_server.py`` serves the tiny family under the official repo names on 127.0.0.1;
``HF_ENDPOINT`` points at it and ``HF_HOME`` starts empty, as on a fresh machine. In order:
``inspect`` reads only config files and safetensors header ranges; a draft revision whose
``fc.weight`` is wrongly shaped is refused by ``inspect`` and by ``vllm serve`` before any weight
byte is downloaded; ``vllm serve TARGET_ID --speculative-config {dspark, DSPARK_ID}`` starts,
downloads, checks the headers at start-up from the Hub's metadata, routes to the plugin's class
and returns the target's own greedy tokens; the offline ``LLM`` API does the same for DFlash;
then, with ``HF_HUB_OFFLINE=1`` on the filled cache, ``inspect`` and a DSpark launch again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.background import Jobs, start_early
from tests.hub_server import LoopbackHub
from vllm_nemotron_spec.bench import client as http
from vllm_nemotron_spec.bench import server as serve

pytestmark = pytest.mark.engine

TARGET = "nvidia/NVIDIA-Nemotron-3.5-Lightning-30B-A3B-NVFP4"
DFLASH = TARGET + "-DFlash"
DSPARK = TARGET + "-DSpark"
WRONG_FC = "wrong-fc"  # a revision of the DSpark repo whose fc.weight has the wrong shape
HEADER_RANGE = 100_001  # get_safetensors_metadata's first read: bytes=0-100000
GAMMA = 3
MAX_TOKENS = 12
LLM_TOKENS = Path(__file__).with_name("llm_tokens.py")


def _wrong_fc_files(draft: Path) -> dict[str, bytes]:
    from safetensors.torch import load_file, save_file

    files = {p.name: p.read_bytes() for p in draft.iterdir() if p.is_file()}
    tensors = load_file(str(draft / "model.safetensors"))
    tensors["fc.weight"] = tensors["fc.weight"][:, :-8].contiguous()
    out = draft.parent / "wrong-fc.safetensors.tmp"
    save_file(tensors, str(out))
    files["model.safetensors"] = out.read_bytes()
    out.unlink()
    return files


@pytest.fixture(scope="module")
def hub(tiny_family, trained, tmp_path_factory):
    import shutil

    scratch = tmp_path_factory.mktemp("dspark-copy") / "dspark"
    shutil.copytree(trained.dspark, scratch)
    repos = {
        TARGET: {"main": tiny_family.target},
        DFLASH: {"main": trained.dflash},
        DSPARK: {"main": trained.dspark, WRONG_FC: _wrong_fc_files(scratch)},
    }
    with LoopbackHub(repos) as server:
        yield server


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory):
    return tmp_path_factory.mktemp("hf-home")


def hub_env(hub, hf_home, offline=False) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_TOKEN")
    }
    env.update(
        HF_ENDPOINT=hub.endpoint,
        HF_HOME=str(hf_home),
        HF_HUB_OFFLINE="1" if offline else "0",
        TRANSFORMERS_OFFLINE="1" if offline else "0",
        HF_HUB_DISABLE_XET="1",
        PYTHONPATH=os.pathsep.join(
            [str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")]
        ),
    )
    return env


def run_inspect(env, *args):
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_nemotron_spec.cli.main", "inspect", *args, "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return proc.returncode, json.loads(proc.stdout) if proc.stdout.strip() else None, proc.stderr


def llm_tokens(env, model, spec, prompts):
    job = {"model": model, "speculative_config": spec, "prompts": prompts, "max_tokens": MAX_TOKENS}
    proc = subprocess.run(
        [sys.executable, str(LLM_TOKENS), json.dumps(job)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("TOKENS ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("TOKENS ") :])["token_ids"], proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def prompts(tiny_family):
    from vllm_nemotron_spec.tiny.corpus import sample_prompts
    from vllm_nemotron_spec.tiny.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_family.tokenizer)
    return [tok.encode(p).ids for p in sample_prompts()[:2]]


@pytest.fixture(scope="module")
def plain_run(tiny_family, prompts):
    """:func:`llm_tokens` of the target alone from its local directory (no Hub), started when the
    module starts: it runs while the Hub tests before the first one that needs it run."""
    jobs = Jobs(workers=1)
    yield jobs.submit(llm_tokens, dict(os.environ), str(tiny_family.target), None, prompts)
    jobs.close()


@pytest.fixture(scope="module", autouse=True)
def _start_plain_run(request):
    start_early(request, "plain_run")


@pytest.fixture(scope="module")
def plain(plain_run):
    """The target's own greedy tokens (plain decoding, from its local directory)."""
    tokens, _ = plain_run.result()
    return tokens


def test_inspect_online_reads_config_files_and_header_ranges_only(hub, hf_home):
    rc, report, err = run_inspect(hub_env(hub, hf_home), DSPARK, "--target", TARGET)
    assert rc == 0, err
    assert report["nemotron35_layout"] and report["method"] == "dspark"
    assert report["weights_checked"] == f"Hub safetensors metadata of {DSPARK}@main"
    assert report["checkpoint"]["num_tensors"] > 0 and report["target_blocks"] == 14
    size = len(hub.repos[DSPARK]["main"].files["model.safetensors"])
    assert 0 < hub.served_bytes(DSPARK, ".safetensors") <= HEADER_RANGE < size
    assert hub.served_bytes(TARGET, ".safetensors") == 0


def test_wrong_fc_revision_is_refused_before_any_weight_is_downloaded(hub, hf_home):
    env = hub_env(hub, hf_home)
    before = hub.served_bytes(DSPARK, ".safetensors")
    rc, report, _ = run_inspect(env, DSPARK, "--revision", WRONG_FC, "--target", TARGET)
    assert rc == 2 and any(p.startswith("draft weights: `fc.weight`") for p in report["problems"])
    failed = serve.serve_once(
        TARGET,
        speculative_config={
            "method": "dspark",
            "model": DSPARK,
            "revision": WRONG_FC,
            "num_speculative_tokens": GAMMA,
        },
        args=serve.CPU_TINY_SERVE_ARGS,
        env=env,
    )
    assert not failed.became_ready and failed.returncode != 0
    assert f"Nemotron 3.5 draft {DSPARK}" in failed.output and "`fc.weight`" in failed.output
    # Only header ranges of the draft were read (twice: inspect and the server); no target weight.
    assert hub.served_bytes(DSPARK, ".safetensors") - before <= 2 * HEADER_RANGE
    assert hub.served_bytes(TARGET, ".safetensors") == 0


def test_headers_unreadable_at_start_up_are_checked_at_load_time(hub, hf_home):
    """With the Hub's header ranges failing, start-up says the check is deferred, vLLM downloads
    the weights, and the draft model refuses them before any tensor is copied, with the same
    problem as at start-up."""
    before = hub.served_bytes(DSPARK, ".safetensors")
    hub.refuse_ranges = True
    try:
        failed = serve.serve_once(
            TARGET,
            speculative_config={
                "method": "dspark",
                "model": DSPARK,
                "revision": WRONG_FC,
                "num_speculative_tokens": GAMMA,
            },
            args=serve.CPU_TINY_SERVE_ARGS,
            env=hub_env(hub, hf_home),
            timeout=300,
        )
    finally:
        hub.refuse_ranges = False
    assert not failed.became_ready and failed.returncode != 0
    assert (
        "tensor headers deferred to load time (the Hub's safetensors metadata of "
        f"{DSPARK}@{WRONG_FC} could not be read" in failed.output
    ), failed.output[-3000:]
    assert f"Nemotron 3.5 draft {DSPARK}" in failed.output and "`fc.weight`" in failed.output
    size = len(hub.repos[DSPARK][WRONG_FC].files["model.safetensors"])
    assert hub.served_bytes(DSPARK, ".safetensors") - before == size  # downloaded, then refused


def test_serve_dspark_by_repo_id_from_an_empty_cache(hub, hf_home, prompts, plain, tmp_path):
    env = hub_env(hub, hf_home)
    log = tmp_path / "serve.log"
    server = serve.start_server(
        TARGET,
        log,
        speculative_config={"method": "dspark", "model": DSPARK, "num_speculative_tokens": GAMMA},
        args=[*serve.CPU_TINY_SERVE_ARGS, "--max-model-len", "512", "--max-num-seqs", "2"],
        env=env,
        timeout=420,
    )
    try:
        model = json.loads(http.get(f"{server.url}/v1/models")[1])["data"][0]["id"]
        got = [
            http.complete(
                server.url,
                {
                    "model": model,
                    "prompt": p,
                    "max_tokens": MAX_TOKENS,
                    "temperature": 0.0,
                    "ignore_eos": True,
                },
                stream=False,
            ).token_ids
            for p in prompts
        ]
    finally:
        server.stop()
    text = log.read_text()
    assert (
        f"tensor headers checked at start-up from Hub safetensors metadata of {DSPARK}@main" in text
    ), text[-3000:]
    assert "model class DSparkNemotron35DraftModel" in text
    assert got == plain
    assert hub.served_bytes(DSPARK, "model.safetensors") >= len(
        hub.repos[DSPARK]["main"].files["model.safetensors"]
    )  # downloaded at load time


def test_offline_llm_api_dflash_by_repo_id(hub, hf_home, prompts, plain):
    spec = {"method": "dflash", "model": DFLASH, "num_speculative_tokens": GAMMA}
    got, out = llm_tokens(hub_env(hub, hf_home), TARGET, spec, prompts)
    assert "model class DFlashNemotron35DraftModel" in out
    assert f"Hub safetensors metadata of {DFLASH}@main" in out
    assert got == plain


def test_hf_hub_offline_on_the_filled_cache(hub, hf_home, prompts, plain):
    env = hub_env(hub, hf_home, offline=True)
    requests = len(hub.requests)
    rc, report, err = run_inspect(env, DSPARK, "--target", TARGET)
    assert rc == 0, err
    assert report["weights_checked"].startswith("Hugging Face cache ")
    spec = {"method": "dspark", "model": DSPARK, "num_speculative_tokens": GAMMA}
    got, out = llm_tokens(env, TARGET, spec, prompts)
    assert "tensor headers checked at start-up from Hugging Face cache" in out
    assert got == plain
    assert len(hub.requests) == requests  # nothing asked of the Hub
