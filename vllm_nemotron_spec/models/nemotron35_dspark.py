"""The Nemotron 3.5 DSpark draft (``NVIDIA-Nemotron-3.5-Lightning-*-DSpark``), registered as
``DSparkNemotron35DraftModel``.

vLLM's ``qwen3_dspark.Qwen3DSparkForCausalLM`` builds exactly the official draft's modules (shared
doc, "DSpark step"), so this class reuses it. It is chosen only for drafts that pass the
structural check (``target_hook`` routes them here; with method ``dspark`` vLLM would otherwise
rewrite an unknown architecture to DeepSeek-V4), checks at start-up that what vLLM built matches
the checkpoint, and gives ``markov_w2`` the plugin's NVFP4 W4A16 method. The query layout and the
Markov walk belong to the proposer, except for the fused greedy walk on CUDA
(:meth:`sample_sequential`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

import torch
from vllm.config import VllmConfig
from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM

from vllm_nemotron_spec import patches
from vllm_nemotron_spec.checkpoint.check import draft_spec_from_vllm_config
from vllm_nemotron_spec.checkpoint.spec import DraftSpec, DraftSpecError
from vllm_nemotron_spec.models.nemotron35_dflash import (
    check_built_model_matches_spec,
)
from vllm_nemotron_spec.patches import v2_dspark_anchor_ids
from vllm_nemotron_spec.target_hook import checked_weights

logger = logging.getLogger("vllm.nemotron_spec.dspark")  # under "vllm": printed by its handler

ARCHITECTURE = "DSparkNemotron35DraftModel"
FUSED_MARKOV_ENV = "NEMOTRON_SPEC_FUSED_MARKOV"
_MARKOV_W2 = "markov_head.markov_w2."


class Nemotron35DSparkForCausalLM(Qwen3DSparkForCausalLM):
    """vLLM's DSpark Qwen3 draft, checked against the Nemotron 3.5 draft's validated spec.

    The step: the DFlash backbone (context ``hidden_norm(fc(concat(aux)))`` as K/V of every layer)
    over a query block with CAUSAL attention, a sliding window and per-head attention sinks; the
    rows go through the final norm and the TARGET's lm_head (base logits ``U_k``); then a
    sequential Markov walk adds ``markov_w2(markov_w1[prev])`` to ``U_k``, ``prev`` being the
    previously drafted token (the anchor first). After building, the modules vLLM built are
    compared with the checkpoint (layers, causality, sliding window, sinks, Markov rank, fc width),
    naming the field on mismatch. ``markov_w2`` is dequantized once on CPU and runs on vLLM's FP4
    kernels on GPU; ``markov_w1`` stays a BF16 embedding, as in the checkpoint."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        spec = draft_spec_from_vllm_config(vllm_config)
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.draft_spec = spec
        self.draft_model_config = vllm_config.speculative_config.draft_model_config
        check_built_model_matches_spec(self, spec, vllm_config, source=ARCHITECTURE)
        check_dspark_modules(self, spec)
        self.tensor_parallel_size = vllm_config.parallel_config.tensor_parallel_size
        self.fused_walk_off: str | None = "weights not loaded yet"  # why the fused walk is off
        self._packed_markov_w2: dict[str, torch.Tensor] = {}
        self._markov_w1_by_phase: torch.Tensor | None = None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        """vLLM's loading, keeping for the fused walk a copy of ``markov_w2``'s packed NVFP4 tensors
        (the linear method re-lays them out for its GEMM kernel after loading) and of
        ``markov_w1`` with its columns grouped by the kernel's phases (contiguous embedding loads;
        the raw layout made the walk 1.6x slower at batch 16 inside the engine than in isolation);
        the tensor headers are checked first when start-up could not."""

        device = self.model.markov_head.markov_w1.weight.device
        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        if capability is not None and torch.version.hip is not None:
            capability = ("ROCm", *capability)  # an AMD GPU's numbers are not NVIDIA's SM versions
        self.fused_walk_off = fused_walk_switch_reason(self.tensor_parallel_size, capability)
        keep = (
            device.type == "cuda"
            and self.fused_walk_off is None
            and self.draft_spec.is_quantized("markov_head.markov_w2")
        )

        def keep_markov_w2(items):
            for name, tensor in items:
                if keep and name.startswith(_MARKOV_W2):
                    self._packed_markov_w2[name[len(_MARKOV_W2) :]] = tensor.to(device, copy=True)
                yield name, tensor

        loaded = super().load_weights(
            keep_markov_w2(checked_weights(self.draft_spec, self.draft_model_config, weights))
        )
        if keep:
            self._markov_w1_by_phase = markov_w1_by_phase(self.model.markov_head.markov_w1.weight)
        return loaded

    def sample_sequential(self, speculator, num_reqs: int, head_hidden: torch.Tensor) -> bool:
        """vLLM 0.33 ``DSparkSpeculator`` hook: run the greedy Markov walk fused; False (nothing
        done) where vLLM's own loop must run. Which of the two runs is logged once per reason.

        The query layout (``sample_from_anchor``) and the walk otherwise belong to the proposer
        (``proposers/dspark.py`` on vLLM's V1 runner, vLLM's ``DSparkSpeculator`` on V2). The
        fused walk (``kernels/markov.py``; ``markov_w2`` kept packed at load, 36 MiB at the real
        shape, and ``markov_w1`` by phase, 128 MiB) runs for greedy drafting on one Hopper GPU
        (elsewhere with ``NEMOTRON_SPEC_FUSED_MARKOV=1``): in the CUDA-graph engine at
        Lightning widths on the H200 it cut the draft step from 1.02 to 0.92 ms at concurrency 1
        and from 1.38 to 1.16 ms at 16 (DSpark 7, benchmarks/RESULTS.md).
        ``NEMOTRON_SPEC_FUSED_MARKOV=0`` keeps vLLM's loop; every other case (sampling,
        top-k drafting, confidence heads, acceptance estimation, tensor parallelism, other GPUs,
        CPU) runs vLLM's loop."""
        declined = self.fused_walk_declined(speculator, head_hidden)
        _log_walk_choice_once(declined)
        if declined:
            return False
        from vllm_nemotron_spec.kernels.markov import markov_walk_greedy

        packed = self._packed_markov_w2
        n = speculator.num_speculative_steps
        hidden = head_hidden[speculator.sample_indices[: num_reqs * n]]
        base = self.compute_draft_logits(hidden).view(num_reqs, n, -1)
        anchors = v2_dspark_anchor_ids.anchor_token_ids(speculator, num_reqs)
        by_phase = self._markov_w1_by_phase
        ids = markov_walk_greedy(
            base,
            anchors,
            self.model.markov_head.markov_w1.weight if by_phase is None else by_phase,
            packed["weight"],
            packed["weight_scale"],
            packed["weight_scale_2"],
            bias_scale=self.logits_processor.scale,
            w1_permuted=by_phase is not None,
        )
        speculator.draft_tokens[:num_reqs, :n].copy_(self.map_draft_to_target(ids))
        return True

    def fused_walk_declined(self, speculator, head_hidden: torch.Tensor) -> str | None:
        """Why the fused walk cannot run this step (None: it can)."""
        if self.fused_walk_off is not None:
            return self.fused_walk_off
        if not head_hidden.is_cuda:
            return f"hidden states on {head_hidden.device.type}, the fused walk is CUDA only"
        missing = {"weight", "weight_scale", "weight_scale_2"} - set(self._packed_markov_w2)
        if missing:
            return f"no packed NVFP4 markov_w2 ({', '.join(sorted(missing))} not kept at load)"
        if getattr(speculator, "draft_logits", None) is not None:
            return "probabilistic drafts (draft_sample_method) need the draft logits"
        if not v2_dspark_anchor_ids.installed():
            return f"patch v2_dspark_anchor_ids is {patches.state('v2_dspark_anchor_ids')}"
        if v2_dspark_anchor_ids.draft_topk(speculator) is not None:
            return "top-k drafting"
        if getattr(speculator, "use_confidence_head", False):
            return "confidence head"
        if getattr(speculator, "acceptance_estimator", None) is not None:
            return "acceptance estimator"
        return None


def fused_walk_switch_reason(tensor_parallel_size: int, capability: tuple | None) -> str | None:
    """Why the fused walk is off for the whole engine (None: on), decided at load so that its
    weight copies are kept only when it can run. On by default where it was measured faster than
    vLLM's loop: one NVIDIA Hopper GPU (``capability`` (9, x); ROCm devices come as ("ROCm",
    major, minor)). ``NEMOTRON_SPEC_FUSED_MARKOV=1`` turns it on for other GPUs, ``=0`` off
    everywhere."""
    setting = os.environ.get(FUSED_MARKOV_ENV, "")
    if setting == "0":
        return f"{FUSED_MARKOV_ENV}=0"
    if tensor_parallel_size > 1:
        # Each rank would walk the whole vocabulary with its own copy of markov_w2: not yet run on
        # GPUs under tensor parallelism, so vLLM's (vocab-parallel) loop runs there.
        return f"tensor_parallel_size {tensor_parallel_size} (the fused walk runs on one GPU)"
    if setting != "1" and capability is not None and capability[0] != 9:
        gpu = ".".join(str(c) for c in capability).replace("ROCm.", "ROCm ")
        return (
            f"compute capability {gpu}: the fused walk is measured faster on NVIDIA Hopper only "
            f"({FUSED_MARKOV_ENV}=1 runs it here)"
        )
    return None


def markov_w1_by_phase(w1: torch.Tensor) -> torch.Tensor:
    """A copy of ``markov_w1`` [V, r] with its columns grouped by the fused kernel's phases (every
    default launch config of one rank uses the same variant, so one copy serves every batch size;
    134 MB at the real shape, kept only when the fused walk is on)."""
    from vllm_nemotron_spec.kernels.markov import default_config, permute_w1_columns

    return permute_w1_columns(w1.detach(), default_config(1, w1.shape[1]).phases)


_WALK_CHOICES_LOGGED: set[str | None] = set()


def _log_walk_choice_once(declined: str | None) -> None:
    if declined in _WALK_CHOICES_LOGGED:
        return
    _WALK_CHOICES_LOGGED.add(declined)
    if declined is None:
        logger.info("nemotron-spec: DSpark Markov walk runs fused (kernels/markov.py, greedy)")
    else:
        logger.info("nemotron-spec: DSpark Markov walk runs vLLM's loop: %s", declined)


def check_dspark_modules(model, spec: DraftSpec) -> None:
    """The DSpark-only parts: sliding window and sinks per layer, the Markov head's shapes."""
    problems = []
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        window = getattr(attn, "sliding_window", None)
        if window != spec.sliding_window:
            problems.append(
                f"layer {i}: sliding window {window} != the checkpoint's {spec.sliding_window} "
                "(dflash_config.swa_window_size / sliding_window)"
            )
        has_sinks = getattr(attn, "attention_sink_bias", None) is not None
        if has_sinks != spec.has_attention_sinks:
            problems.append(
                f"layer {i}: attention sinks {'built' if has_sinks else 'missing'}, "
                f"dflash_config.attention_sink_bias is {spec.has_attention_sinks}"
            )
    head = model.model.markov_head
    rank = head.markov_w1.embedding_dim
    if rank != spec.markov_rank:
        problems.append(f"Markov head rank {rank} != config.json markov_rank {spec.markov_rank}")
    if problems:
        raise DraftSpecError(problems, source=ARCHITECTURE)
