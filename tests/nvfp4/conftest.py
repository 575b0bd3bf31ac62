"""Fixtures for the NVFP4 tests: vLLM's tensor-parallel state (tp=1, gloo), so real vLLM linear
layers can be built on CPU."""

from __future__ import annotations

import socket

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ensure_dist() -> bool:
    """Initialise vLLM's distributed state (world size 1, gloo) unless it is there; True if this
    call did."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized():
        return False
    with set_current_vllm_config(VllmConfig()):
        ps.init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
            backend="gloo",
        )
        ps.initialize_model_parallel(1)
    return True


@pytest.fixture(scope="session")
def vllm_dist():
    """vLLM's distributed state, created once unless a test already did. An engine's shutdown
    tears it down, so ``vllm_ctx`` makes sure it is there again before each test."""
    from vllm.distributed import parallel_state as ps

    created = _ensure_dist()
    yield
    if created and ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
        ps.destroy_distributed_environment()


@pytest.fixture
def vllm_ctx(vllm_dist):
    """A default VllmConfig as the current config while a test builds layers."""
    from vllm.config import VllmConfig, set_current_vllm_config

    _ensure_dist()
    with set_current_vllm_config(VllmConfig()):
        yield
