"""Torch settings for the tiny-family build steps."""

from __future__ import annotations

import contextlib


def _set_num_threads(num_threads: int) -> None:
    """``torch.set_num_threads``, also after vLLM's in-process CPU worker replaced it with a stub
    that only warns (the worker binds its OpenMP threads when it starts): the build steps run
    between engines and restore the caller's count, and their results depend on it."""
    import torch

    torch._C.set_num_threads(num_threads)


@contextlib.contextmanager
def deterministic_torch(num_threads: int = 1):
    """Fixed intra-op thread count and deterministic algorithms for the duration of a build step;
    restores the caller's thread count, determinism flag and global RNG state afterwards.

    A fixed thread count makes float reductions (and so the trained weights) independent of the
    machine's core count. One thread is also the fast choice for tensors this small: on a busy
    2-core machine, two OpenMP threads per op were seen running 5-15x slower than one.
    """
    import torch

    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    rng = torch.get_rng_state()
    _set_num_threads(num_threads)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        _set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
        torch.set_rng_state(rng)


@contextlib.contextmanager
def torch_threads(num_threads: int = 1):
    """Only the intra-op thread count, restored afterwards (for packing / unpacking small tensors)."""
    import torch

    threads = torch.get_num_threads()
    _set_num_threads(num_threads)
    try:
        yield
    finally:
        _set_num_threads(threads)
