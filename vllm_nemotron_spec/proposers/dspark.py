"""DSpark proposer for vLLM's V1 runner (the only runner on CPU; optional on GPU).

Why: vLLM implements DSpark only in the V2 runner (``DSparkSpeculator``); V1 rejects
``method="dspark"``. A DSpark step is a DFlash step (here causal with a sliding window and sinks,
which the model's layers carry) followed by a sequential Markov walk, so this proposer is the
multi-group DFlash proposer plus the checkpoint's query layout and the walk (:func:`markov_walk`).
Removal: when vLLM's V1 runner accepts DSpark (or V1 is retired on CPU).
"""

from __future__ import annotations

import contextlib

import torch
from typing_extensions import override
from vllm.config import VllmConfig
from vllm.v1.sample.metadata import SamplingMetadata

from vllm_nemotron_spec.checkpoint.check import draft_spec_from_vllm_config
from vllm_nemotron_spec.proposers.dflash import Nemotron35DFlashProposer


@contextlib.contextmanager
def _method_seen_as_dflash(vllm_config: VllmConfig):
    """vLLM's DFlashProposer.__init__ asserts ``method == "dflash"``; DSpark builds the same
    machinery, so the config shows ``dflash`` while the proposer is constructed."""
    spec = vllm_config.speculative_config
    method = spec.method
    spec.method = "dflash"
    try:
        yield
    finally:
        spec.method = method


def markov_walk(model, base_logits: torch.Tensor, anchor_ids: torch.Tensor, sample_step):
    """Draft gamma tokens per request from base logits ``[B, gamma, V]``: at step k the Markov
    bias of the previously drafted token (the anchor first) is added, then ``sample_step(logits_k)``
    returns ``(token_ids [B], probs [B, V] or None)``. Returns ids ``[B, gamma]`` and the list of
    per-step probs (None entries when greedy).

    From ``prev = b``, for k = 1..gamma: ``logits_k = U_k + markov_w2(markov_w1[prev])``; greedy
    takes the argmax, probabilistic drafting samples ``softmax(logits_k / T)`` and hands those
    corrected probabilities (q) to vLLM's standard rejection sampler."""
    prev = anchor_ids
    ids, probs = [], []
    for k in range(base_logits.shape[1]):
        logits = base_logits[:, k] + model.markov_bias(model.markov_embed(prev))
        token, prob = sample_step(logits)
        ids.append(token)
        probs.append(prob)
        prev = token
    return torch.stack(ids, dim=1), probs


class Nemotron35DSparkProposer(Nemotron35DFlashProposer):
    """DFlash machinery + the checkpoint's query layout + the sequential Markov walk.

    Query layout (``sample_from_anchor``, absent = true): false ("bonus anchor", Nemotron 3.5):
    ``[b, MASK x gamma]``, row 0 dropped, rows 1..gamma drafted (the DFlash layout); true:
    ``[b, MASK x (gamma - 1)]``, every row drafted, so the sampled rows are a slice of the output
    (a view: the anchor layout pays for no gather). vLLM's code paths key on
    ``speculative_config.method`` and its V1 DFlash code is what this proposer runs, so it is built
    as a DFlash proposer (:func:`_method_seen_as_dflash`) and keeps ``self.method == "dflash"``
    for those paths, while the engine's config says ``dspark``."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, runner=None):
        with _method_seen_as_dflash(vllm_config):
            super().__init__(vllm_config, device, runner)
        # the query layout from the one validated parse of the checkpoint (as the model reads it)
        spec = draft_spec_from_vllm_config(vllm_config)
        self.sample_from_anchor = spec.sample_from_anchor
        # causal block attention: a step's first k drafts are the block's, so it drafts only k
        self.drafts_only_k = spec.causal

    @property
    def bonus_anchor_row(self) -> bool:
        """Whether the query block carries the bonus token as an extra row (``[b, MASK x gamma]``)."""
        return not self.sample_from_anchor

    @override
    def query_rows_per_request(self) -> int:
        return self.num_speculative_tokens + (0 if self.sample_from_anchor else 1)

    @override
    def sample_rows(self, kernel_indices: torch.Tensor, batch_size: int):
        if self.sample_from_anchor:
            return slice(0, batch_size * self.num_speculative_tokens)
        return kernel_indices

    @override
    def _sample_draft_tokens(
        self, hidden_states: torch.Tensor, sampling_metadata: SamplingMetadata
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        gamma = self.num_speculative_tokens
        batch_size = hidden_states.shape[0] // gamma
        base = self.model.compute_draft_logits(hidden_states).view(batch_size, gamma, -1)
        probabilistic = self._enable_probabilistic_draft_probs and not sampling_metadata.all_greedy
        if probabilistic:

            def step(logits):
                return self._sample_from_logits(logits, sampling_metadata)
        else:

            def step(logits):
                return logits.argmax(dim=-1), None

        ids, probs = markov_walk(self.model, base, self._anchor_token_ids[:batch_size], step)
        ids = self.model.map_draft_to_target(ids)
        if not probabilistic:
            return ids.reshape(-1), None
        return ids.reshape(-1), torch.stack(probs, dim=1).reshape(batch_size * gamma, -1)
