"""The target's Mamba KV-cache groups sharing one metadata build
(``patches/v2_mamba_group_metadata_reuse.py``), on vLLM 0.33's own code and CUDA tensors (0.33
gathers align-mode state indices with a Triton kernel on the GPU): vLLM's ``build_attn_metadata``
for four Mamba groups with different block tables gives every layer the same metadata, field by
field, whether the later groups share the first group's or build their own; and on a real CUDA
config with model runner V2 and a routed DSpark draft the patch turns the sharing on. No engine:
seconds (``benchmarks/harness/mamba_groups.py`` builds the groups)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from benchmarks.harness import mamba_groups as mg

K, GROUPS = 3, 4


@pytest.fixture(scope="module", params=["none", "align"])
def config(request, tiny_family):
    from vllm_nemotron_spec.plugin import register

    register()
    return mg.engine_config(tiny_family.target, tiny_family.dspark_draft, request.param, K)


@pytest.mark.parametrize("kind", ["decode", "decodes-padded", "mixed", "prefill"])
def test_shared_metadata_equals_each_groups_own_build_on_cuda(config, kind):
    cuda = torch.device("cuda")
    rng = np.random.default_rng(len(kind))
    b = mg.batch(kind, K, rng, n=4)
    tables = mg.block_tables(config, GROUPS, len(b.query_lens), rng, cuda)
    shared_groups = mg.groups(config, GROUPS, share=True, device=cuda)
    shared = mg.metadata(shared_groups, b, tables, cuda)
    own = mg.metadata(mg.groups(config, GROUPS, share=False, device=cuda), b, tables, cuda)
    torch.cuda.synchronize()
    bad = [d for name in own for d in mg.differences(shared[name], own[name], name)]
    assert not bad, bad
    assert [mg.builder_of(g).builds for g in shared_groups] == [1, 0, 0, 0]


def test_the_patch_shares_for_a_routed_draft_on_model_runner_v2(config):
    import vllm.v1.worker.gpu.attn_utils  # noqa: F401  the patch's last parts check these
    import vllm.v1.worker.gpu.model_states.mamba_hybrid  # noqa: F401
    from vllm.v1.attention.backends.mamba2_attn import Mamba2AttentionMetadataBuilder

    from vllm_nemotron_spec import patches
    from vllm_nemotron_spec.patches import v2_mamba_group_metadata_reuse as patch

    patches.require("the test", patch.NAME)
    assert config.use_v2_model_runner
    spec = mg.mamba_spec(config)
    builder = Mamba2AttentionMetadataBuilder(spec, ["m"], config, torch.device("cuda"))
    assert builder.supports_update_block_table and getattr(builder, patch.MARK, False)
