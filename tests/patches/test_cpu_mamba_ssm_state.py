"""The CPU SSM-state patch: resumes from the accepted prefix, stores a state per token."""

import torch
import torch.nn.functional as F

from vllm_nemotron_spec.patches import cpu_mamba_ssm_state as patch


def _step(s, x, dt, A, B, C, D, dt_bias, z, heads_per_group):
    delta = F.softplus(dt + dt_bias)
    b = B.repeat_interleave(heads_per_group, 0)[:, None, :]
    c = C.repeat_interleave(heads_per_group, 0)[:, None, :]
    s = s * torch.exp(A * delta[..., None]) + b * delta[..., None] * x[..., None]
    return s, ((s * c).sum(-1) + D * x) * F.silu(z)


def test_next_step_resumes_from_the_accepted_token():
    torch.manual_seed(0)
    nheads, dim, dstate, ngroups, n = 4, 8, 16, 2, 4
    A = -torch.rand(nheads, dim, dstate)
    D, dt_bias = torch.randn(nheads, dim), torch.randn(nheads, dim)
    state = torch.zeros(10, nheads, dim, dstate)
    state[1] = torch.randn(nheads, dim, dstate)  # the prefill's state for the request
    initial = state[1].clone()
    # one request; its block of n tokens writes per-token states into slots 1..n
    indices = torch.tensor([[1, 2, 3, 4]])

    def block(seed):
        g = torch.Generator().manual_seed(seed)
        return [
            torch.randn(n, *shape, generator=g)
            for shape in [
                (nheads, dim),
                (nheads, dim),
                (ngroups, dstate),
                (ngroups, dstate),
                (nheads, dim),
            ]
        ]

    x, dt, B, C, z = block(1)
    out = torch.empty(n, nheads, dim)
    patch.ssm_update_with_accepted_tokens(
        state,
        x,
        dt,
        A,
        B,
        C,
        D,
        dt_bias,
        z,
        True,
        indices,
        indices,
        -1,
        out,
        torch.tensor([1]),
        torch.tensor([0, n]),
    )
    s, expected = initial, []
    states = []
    for t in range(n):
        s, y = _step(s, x[t], dt[t], A, B[t], C[t], D, dt_bias, z[t], nheads // ngroups)
        expected.append(y)
        states.append(s)
    torch.testing.assert_close(out, torch.stack(expected))
    for t in range(n):
        torch.testing.assert_close(state[indices[0, t]], states[t])

    # 3 of the block's tokens were accepted: the next block starts from the state after token 2.
    x2, dt2, B2, C2, z2 = block(2)
    out2 = torch.empty(n, nheads, dim)
    patch.ssm_update_with_accepted_tokens(
        state,
        x2,
        dt2,
        A,
        B2,
        C2,
        D,
        dt_bias,
        z2,
        True,
        indices,
        indices,
        -1,
        out2,
        torch.tensor([3]),
        torch.tensor([0, n]),
    )
    s = states[2]
    for t in range(n):
        s, y = _step(s, x2[t], dt2[t], A, B2[t], C2[t], D, dt_bias, z2[t], nheads // ngroups)
        torch.testing.assert_close(out2[t], y)


def test_applied_once_and_upstream_entry_point_exists():
    from vllm.model_executor.layers.mamba.ops import ssu_dispatch

    patch.install()
    call = ssu_dispatch.CPUSSUBackend.__call__
    patch.install()
    assert ssu_dispatch.CPUSSUBackend.__call__ is call and call._nemotron_spec_patch
    import inspect

    params = list(inspect.signature(call.__wrapped__).parameters)
    assert params[-3:] == ["num_accepted_tokens", "cu_seqlens", "is_blackwell"], (
        "vLLM's CPUSSUBackend.__call__ signature changed: re-check "
        "vllm_nemotron_spec/patches/cpu_mamba_ssm_state.py"
    )
