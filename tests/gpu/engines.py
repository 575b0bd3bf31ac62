"""In-process vLLM engines of the GPU tests and what each one ran.

Engines are built one after another in the test process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
eager (CUDA graphs are not what these tests check), with a fixed 1 GiB KV cache (vLLM then skips
its memory profiling) and released before the next. :func:`engine_facts` reads, inside the
worker, which runner, speculator, draft class, attention backends and NVFP4 kernels the engine
really built. vLLM is imported inside the functions only: collecting the GPU tests stays cheap.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from vllm_nemotron_spec import runs

GPU_ENGINE_ARGS = dict(
    enforce_eager=True,
    max_model_len=1024,
    max_num_seqs=16,
    kv_cache_memory_bytes=1 << 30,
    gpu_memory_utilization=0.2,
    enable_prefix_caching=True,  # the serving recipe's cache flags (vLLM 0.33's GPU defaults too)
    mamba_cache_mode="align",
)
"""Overrides of :func:`vllm_nemotron_spec.runs.make_llm`'s defaults for the tiny family on GPU."""

MAX_TOKENS = 48
NUM_DFLASH_TOKENS = 4
NUM_DSPARK_TOKENS = 3  # the checkpoints' recommended gamma

V2_RUNNER = "vllm.v1.worker.gpu.model_runner.GPUModelRunner"
"""vLLM 0.33's model runner V2 (the CUDA default), the one running DSparkSpeculator."""


def make_engine(target, speculative_config: dict | None, dtype: str, **overrides):
    """An in-process ``vllm.LLM`` of the tiny target; fails if vLLM did not load the plugin
    (its entry point is installed by ``pip install -e .``)."""
    kwargs = {**GPU_ENGINE_ARGS, **overrides}
    llm = runs.make_llm(str(target), speculative_config, dtype=dtype, **kwargs)
    from vllm_nemotron_spec import plugin

    if plugin._registered is None:
        runs.release(llm)
        raise AssertionError(
            "vLLM started without the vllm_nemotron_spec plugin: install the package "
            "(python3 -m pip install --no-deps --no-build-isolation --no-index -e .) so its "
            "vllm.general_plugins entry point exists"
        )
    return llm


@contextlib.contextmanager
def engine(target, speculative_config: dict | None, dtype: str, **overrides):
    """:func:`make_engine`, released when the block ends."""
    llm = make_engine(target, speculative_config, dtype, **overrides)
    try:
        yield llm
    finally:
        runs.release(llm)


@dataclass
class EngineFacts:
    """What the worker built (names, so the facts outlive the engine)."""

    runner: str
    speculator: str | None
    draft_model: str | None
    draft_quantization: str | None
    target_backends: dict[str, str] = field(default_factory=dict)
    """Attention layer name -> backend name (``AttentionBackend.get_name()``), target layers."""
    draft_backends: dict[str, str] = field(default_factory=dict)
    """The same for the draft's layers (the speculator's own attention groups)."""
    flash_attn_versions: dict[str, int | None] = field(default_factory=dict)
    """Layer -> the FlashAttention version its FLASH_ATTN implementation runs."""
    draft_linear_kernels: set[tuple[str, str | None, str | None]] = field(default_factory=set)
    """(linear method, compressed-tensors scheme, NVFP4 kernel) of the draft's quantized
    linears."""
    mamba_groups: list[bool] = field(default_factory=list)
    """Per Mamba KV-cache group of the target: whether its builder shares the first group's
    metadata (``patches/v2_mamba_group_metadata_reuse.py``)."""


def _attention_backends(groups, keep=lambda name: True) -> dict[str, str]:
    """Layer -> backend name of the attention layers in ``groups`` (the model runner's or the
    speculator's ``attn_groups``; Mamba layers, also grouped there, are left out)."""
    from vllm.v1.kv_cache_interface import AttentionSpec

    return {
        layer: group.backend.get_name()
        for per_kv_group in groups
        for group in per_kv_group
        if isinstance(group.kv_cache_spec, AttentionSpec)
        for layer in group.layer_names
        if keep(layer)
    }


def _mamba_groups(groups) -> list[bool]:
    from vllm.v1.kv_cache_interface import MambaSpec

    from vllm_nemotron_spec.patches.v2_mamba_group_metadata_reuse import MARK

    return [
        bool(getattr(group.get_metadata_builder(0), MARK, False))
        for per_kv_group in groups
        for group in per_kv_group
        if isinstance(group.kv_cache_spec, MambaSpec)
    ]


def _linear_kernels(model) -> set[tuple[str, str | None, str | None]]:
    from vllm.model_executor.layers.linear import LinearMethodBase, UnquantizedLinearMethod

    out = set()
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if not isinstance(method, LinearMethodBase) or isinstance(method, UnquantizedLinearMethod):
            continue
        scheme = getattr(module, "scheme", None)
        kernel = getattr(method, "kernel", None) or getattr(scheme, "kernel", None)
        out.add(
            (
                type(method).__name__,
                None if scheme is None else type(scheme).__name__,
                None if kernel is None else type(kernel).__name__,
            )
        )
    return out


def _facts_in_worker(worker) -> EngineFacts:
    """Runs inside the worker (``LLM.collective_rpc``)."""
    runner = worker.model_runner
    speculator = getattr(runner, "speculator", None)
    draft_layers = set(getattr(speculator, "draft_attn_layer_names", None) or ())
    context = runner.vllm_config.compilation_config.static_forward_context
    target = _attention_backends(runner.attn_groups, keep=lambda name: name not in draft_layers)
    draft = _attention_backends(getattr(speculator, "attn_groups", None) or [])
    versions = {
        name: getattr(getattr(context.get(name), "impl", None), "vllm_flash_attn_version", None)
        for name in {**target, **draft}
    }
    draft_model = getattr(speculator, "model", None)
    spec_config = runner.vllm_config.speculative_config
    return EngineFacts(
        runner=f"{type(runner).__module__}.{type(runner).__qualname__}",
        speculator=None if speculator is None else type(speculator).__name__,
        draft_model=None if draft_model is None else type(draft_model).__name__,
        draft_quantization=(
            None if spec_config is None else spec_config.draft_model_config.quantization
        ),
        target_backends=target,
        draft_backends=draft,
        flash_attn_versions=versions,
        draft_linear_kernels=set() if draft_model is None else _linear_kernels(draft_model),
        mamba_groups=_mamba_groups(runner.attn_groups),
    )


def engine_facts(llm) -> EngineFacts:
    """:class:`EngineFacts` of an in-process engine's single worker."""
    (facts,) = llm.collective_rpc(_facts_in_worker)
    return facts


@dataclass
class Run:
    """One engine's greedy outputs, counters and build facts."""

    tokens: list[list[int]]
    counters: runs.SpecCounters
    facts: EngineFacts
    top2: list[list[list[tuple[int, float]]]] | None = None
    """Per prompt and output position, the two largest logits (token, logit), where asked for."""
    extra: dict = field(default_factory=dict)


def generate_with_top2_logits(llm, prompts, max_tokens: int):
    """Greedy outputs and, per position, the two largest logits (the engine must run with
    ``logprobs_mode="raw_logits"``, where vLLM reports logits in the logprob fields)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=2)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    tokens, top2 = [], []
    for o in outputs:
        out = o.outputs[0]
        tokens.append(list(out.token_ids))
        top2.append(
            [
                sorted(((tok, lp.logprob) for tok, lp in position.items()), key=lambda t: -t[1])[:2]
                for position in out.logprobs
            ]
        )
    return tokens, top2


@contextlib.contextmanager
def recorded_attention_decisions():
    """Every (AttentionInputs, AttentionDecision) the plugin's NemotronH config hook makes while
    the block runs (in-process engines decide in this process)."""
    from vllm_nemotron_spec import attention

    original = attention.resolve_attention_backends
    seen: list = []

    def record(inputs):
        decision = original(inputs)
        seen.append((inputs, decision))
        return decision

    attention.resolve_attention_backends = record
    try:
        yield seen
    finally:
        attention.resolve_attention_backends = original


def _walk_choices() -> set | None:
    """The DSpark Markov-walk choices the plugin's draft logged in this process (None: fused;
    a string: why vLLM's loop ran), None if its module was never imported."""
    import sys

    module = sys.modules.get("vllm_nemotron_spec.models.nemotron35_dspark")
    return None if module is None else set(module._WALK_CHOICES_LOGGED)


def _forget_walk_choices() -> None:
    import sys

    module = sys.modules.get("vllm_nemotron_spec.models.nemotron35_dspark")
    if module is not None:
        module._WALK_CHOICES_LOGGED.clear()


def prefix_cache_counters(llm) -> tuple[int, int]:
    """(hits, queries) of vLLM's prefix cache so far, in tokens."""
    hits = queries = 0
    for metric in llm.get_metrics():
        if metric.name == "vllm:prefix_cache_hits":
            hits += int(metric.value)
        elif metric.name == "vllm:prefix_cache_queries":
            queries += int(metric.value)
    return hits, queries


def second_turn(llm, prompts, first_outputs, suffix: list[int], max_tokens: int) -> dict:
    """Each prompt again, followed by its first answer and ``suffix`` (a conversation's next
    turn: its prefix, generated tokens included, is in the prefix cache); the outputs and the
    prefix-cache hits and queries of this turn."""
    turn = [
        {"prompt_token_ids": list(p["prompt_token_ids"]) + list(out) + list(suffix)}
        for p, out in zip(prompts, first_outputs)
    ]
    hits, queries = prefix_cache_counters(llm)
    result = runs.generate(llm, turn, max_tokens, "turn 2")
    after = prefix_cache_counters(llm)
    return {"tokens": result.token_ids, "hits": after[0] - hits, "queries": after[1] - queries}


def _cache_facts(llm) -> dict:
    cache = llm.llm_engine.vllm_config.cache_config
    return {
        "enable_prefix_caching": cache.enable_prefix_caching,
        "mamba_cache_mode": cache.mamba_cache_mode,
        "block_size": cache.block_size,
    }


def run_engine(
    target, speculative_config, dtype, prompts, max_tokens, *, top2=False, suffix=None, then=None
):
    """Build an engine, generate greedily, read its facts, run the second turn (``suffix``
    given: ``extra["turn2"]``) and ``then(llm)`` (``extra["then"]``), release it. ``top2``: the
    engine reports raw logits and the run keeps each position's two largest."""
    _forget_walk_choices()
    overrides = {"logprobs_mode": "raw_logits"} if top2 else {}
    extra: dict = {}
    with recorded_attention_decisions() as decisions:
        with engine(target, speculative_config, dtype, **overrides) as llm:
            if top2:
                tokens, best = generate_with_top2_logits(llm, prompts, max_tokens)
                counters = runs.SpecCounters()
            else:
                result = runs.generate(llm, prompts, max_tokens, "turn 1")
                tokens, best, counters = result.token_ids, None, result.counters
            facts = engine_facts(llm)
            extra["cache"] = _cache_facts(llm)
            if suffix is not None:
                extra["turn2"] = second_turn(llm, prompts, tokens, suffix, max_tokens)
            if then is not None:
                extra["then"] = then(llm)
    extra["walk_choices"] = _walk_choices()
    extra["attention_decisions"] = decisions
    return Run(tokens, counters, facts, best, extra)


class LazyRuns:
    """Engine runs built on first use and kept for the session (one engine at a time). A run
    that failed is not built again: later uses raise, naming the first failure."""

    def __init__(self, builders: dict):
        self._builders = builders
        self._runs: dict[str, Run] = {}
        self._failed: dict[str, BaseException] = {}

    def __getitem__(self, name: str) -> Run:
        if name in self._failed:
            exc = self._failed[name]
            raise RuntimeError(f"run {name!r} failed earlier: {type(exc).__name__}: {exc}") from exc
        if name not in self._runs:
            try:
                self._runs[name] = self._builders[name]()
            except Exception as exc:
                self._failed[name] = exc
                raise
        return self._runs[name]


# ------------------------------------------------------------------------------------------------
# A one-token prompt joining a decoding batch
# ------------------------------------------------------------------------------------------------

LATE_PROMPT = [1]
RUNNING_PROMPT = [1, 300, 301, 302, 303, 304, 305, 306]
LATE_TOKENS, RUNNING_TOKENS, JOIN_AFTER_STEPS = 16, 40, 3


def _serve(llm, requests: dict, add_late_after_steps: int | None):
    """Step the engine until every request finished; "late" is added after
    ``add_late_after_steps`` steps (None: with the others). Returns (tokens per request, the
    scheduler's first schedule of "late": (tokens scheduled, placeholder drafts))."""
    from vllm import SamplingParams

    llm_engine = llm.llm_engine
    scheduler = llm_engine.engine_core.engine_core.scheduler
    first_late: list = []
    cls = type(scheduler)  # AsyncScheduler inherits Scheduler.schedule (the patched one)
    own = vars(cls).get("schedule")
    original = cls.schedule

    def schedule(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        late = [r for r in out.num_scheduled_tokens if r.startswith("late")]  # ids may be suffixed
        if late and not first_late:
            drafts = list(out.scheduled_spec_decode_tokens.get(late[0], []))
            first_late.append((out.num_scheduled_tokens[late[0]], drafts))
        return out

    def add(name):
        prompt, max_tokens = requests[name]
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        llm_engine.add_request(name, {"prompt_token_ids": prompt}, params)

    cls.schedule = schedule
    try:
        for name in requests:
            if name != "late" or add_late_after_steps is None:
                add(name)
        outputs, steps = {}, 0
        while llm_engine.has_unfinished_requests() or len(outputs) < len(requests):
            for o in llm_engine.step():
                if o.finished:
                    name = next(n for n in requests if o.request_id.startswith(n))
                    outputs[name] = list(o.outputs[0].token_ids)
            steps += 1
            if steps == add_late_after_steps:
                add("late")
            if steps > 10_000:
                raise RuntimeError(f"requests {sorted(requests)} unfinished after 10000 steps")
    finally:
        if own is None:
            del cls.schedule
        else:
            cls.schedule = own
    return outputs, (first_late[0] if first_late else None)


def late_join(llm) -> dict:
    """The 1-token request served alone (nothing else runs: never padded), then added while
    another request decodes; both token lists and the scheduler's first schedule of each."""
    alone, alone_schedule = _serve(llm, {"late": (LATE_PROMPT, LATE_TOKENS)}, None)
    joined, joined_schedule = _serve(
        llm,
        {"running": (RUNNING_PROMPT, RUNNING_TOKENS), "late": (LATE_PROMPT, LATE_TOKENS)},
        JOIN_AFTER_STEPS,
    )
    return {
        "alone": alone["late"],
        "joined": joined["late"],
        "alone_first_schedule": alone_schedule,
        "joined_first_schedule": joined_schedule,
    }
