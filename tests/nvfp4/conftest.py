"""Fixtures for the NVFP4 tests: vLLM's tensor-parallel state (tp=1, gloo), so real vLLM linear
layers can be built on CPU."""

from __future__ import annotations

import socket

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def vllm_dist():
    """Initialise vLLM's distributed state once (world size 1) unless a test already did."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    created = False
    with set_current_vllm_config(VllmConfig()):
        if not ps.model_parallel_is_initialized():
            ps.init_distributed_environment(
                world_size=1,
                rank=0,
                local_rank=0,
                distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
                backend="gloo",
            )
            ps.initialize_model_parallel(1)
            created = True
    yield
    if created:
        ps.destroy_model_parallel()
        ps.destroy_distributed_environment()


@pytest.fixture
def vllm_ctx(vllm_dist):
    """A default VllmConfig as the current config while a test builds layers."""
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        yield
