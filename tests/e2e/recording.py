"""Recording what the V1 DFlash-family proposers receive and propose (shared by the e2e tests)."""

from __future__ import annotations

import contextlib
from typing import NamedTuple


class Step(NamedTuple):
    positions: list[int]  # context positions handed to the draft this step (rejected ones cut)
    tokens: list[int]  # the tokens at those positions
    aux: "object"  # torch.Tensor [n, num_aux * hidden]: vLLM's target aux hidden states
    bonus: int
    drafts: list[int]


@contextlib.contextmanager
def record_proposals():
    """Record what vLLM's DFlash proposer (and the plugin's proposers built on it) receives
    (context positions, tokens, aux hidden states, bonus token) and proposes, for a batch of ONE
    request."""
    from vllm.v1.spec_decode.dflash import DFlashProposer

    steps: list[Step] = []
    original = DFlashProposer.propose
    own = vars(DFlashProposer).get("propose")  # None: inherited from SpecDecodeBaseProposer

    def propose(
        self,
        num_speculative_tokens,
        target_token_ids,
        target_positions,
        target_hidden_states,
        next_token_ids,
        *args,
        **kwargs,
    ):
        drafts = original(
            self,
            num_speculative_tokens,
            target_token_ids,
            target_positions,
            target_hidden_states,
            next_token_ids,
            *args,
            **kwargs,
        )
        assert next_token_ids.shape[0] == 1, "record one request at a time"
        rejected = kwargs.get("num_rejected_tokens_gpu")
        n = target_positions.shape[0] - (int(rejected[0]) if rejected is not None else 0)
        steps.append(
            Step(
                target_positions[:n].tolist(),
                target_token_ids[:n].tolist(),
                target_hidden_states[:n].clone(),
                int(next_token_ids[0]),
                drafts[0].tolist(),
            )
        )
        return drafts

    DFlashProposer.propose = propose
    try:
        yield steps
    finally:
        if own is None:
            del DFlashProposer.propose  # the class as it was: inheriting the base's method
        else:
            DFlashProposer.propose = own
