"""The scheduler fix the plugin applies beyond its own drafts: a hybrid (Mamba) target under any
speculative method. A one-token prompt joining a decoding batch is scheduled without placeholder
drafts and gets the tokens it gets alone, here with ngram (which the plugin does not route) on the
tiny NemotronH target, fp32, on CPU. The same check with DFlash runs on GPU
(tests/gpu/test_gpu_one_token_join.py)."""

from __future__ import annotations

import pytest

from tests.gpu.engines import LATE_TOKENS, late_join
from vllm_nemotron_spec import patches, runs

pytestmark = pytest.mark.engine


def test_ngram_on_a_hybrid_target_keeps_a_joining_one_token_prompt_exact(tiny_family):
    runs.set_engine_defaults()
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    llm = runs.make_llm(str(tiny_family.target), spec, max_num_seqs=4, enable_prefix_caching=False)
    try:
        join = late_join(llm)
    finally:
        runs.release(llm)
    assert patches.is_installed("mamba_spec_decode_padding")
    assert join["alone_first_schedule"] == (1, [])
    assert join["joined_first_schedule"] == (1, []), join  # vLLM alone: (4, [-1, -1, -1])
    assert len(join["alone"]) == LATE_TOKENS
    assert join["joined"] == join["alone"]
