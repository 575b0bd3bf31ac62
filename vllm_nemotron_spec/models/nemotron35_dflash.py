"""The Nemotron 3.5 DFlash draft (``NVIDIA-Nemotron-3.5-Lightning-*-DFlash``), registered as
``DFlashNemotron35DraftModel``.

vLLM's DFlash Qwen3 backbone (``qwen3_dflash.DFlashQwen3ForCausalLM``) computes exactly the
official draft's step (shared doc, "DFlash step"), so this class reuses it layer for layer. It is
chosen only for drafts that pass the structural check (``target_hook`` routes them here; every
other DFlash draft keeps vLLM's class), checks at start-up that what vLLM built matches the
checkpoint, and its linear layers get the plugin's NVFP4 W4A16 method.
"""

from __future__ import annotations

from vllm.config import VllmConfig
from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM

from vllm_nemotron_spec.checkpoint.check import draft_spec_from_vllm_config
from vllm_nemotron_spec.checkpoint.spec import DraftSpec, DraftSpecError
from vllm_nemotron_spec.target_hook import checked_weights

ARCHITECTURE = "DFlashNemotron35DraftModel"


class Nemotron35DFlashForCausalLM(DFlashQwen3ForCausalLM):
    """vLLM's DFlash backbone, checked against the Nemotron 3.5 draft's validated spec.

    The step: context ``hidden_norm(fc(concat(aux)))`` becomes K/V of every layer (k_norm + RoPE
    on K, no input_layernorm); the query block ``[b, MASK x gamma]`` is embedded with the draft's
    OWN ``embed_tokens``, attends non-causally to the context and to itself, and rows 1..gamma go
    through the final norm and the TARGET's lm_head. It holds the validated
    :class:`~vllm_nemotron_spec.checkpoint.spec.DraftSpec`; after building, the modules vLLM built
    are compared with it (:func:`check_built_model_matches_spec`), so a mismatch fails at start-up
    with the field named instead of drafting garbage."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        spec = draft_spec_from_vllm_config(vllm_config)
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.draft_spec = spec
        self.draft_model_config = vllm_config.speculative_config.draft_model_config
        check_built_model_matches_spec(self, spec, vllm_config)

    def load_weights(self, weights):
        """vLLM's loading, after the tensor headers are checked when start-up could not."""
        return super().load_weights(
            checked_weights(self.draft_spec, self.draft_model_config, weights)
        )


def check_built_model_matches_spec(
    model, spec: DraftSpec, vllm_config: VllmConfig, source: str = ARCHITECTURE
) -> None:
    """Compare what vLLM built with what the checkpoint's config says (fc width = aux ids x
    target hidden, mask token, causality, layer count); raise naming each field."""
    target_hidden = vllm_config.model_config.get_hidden_size()
    problems = []
    fc_in = model.model.fc.input_size
    if fc_in != len(spec.aux_hidden_state_ids) * target_hidden:
        problems.append(
            f"fc input width {fc_in} != {len(spec.aux_hidden_state_ids)} aux ids x target hidden "
            f"{target_hidden}: vLLM did not pick up eagle_aux_hidden_state_layer_ids "
            f"{list(spec.aux_hidden_state_ids)}"
        )
    if len(model.model.layers) != spec.num_hidden_layers:
        problems.append(
            f"built {len(model.model.layers)} layers, config.json num_hidden_layers is "
            f"{spec.num_hidden_layers}"
        )
    if model.model.mask_token_id != spec.mask_token_id:
        problems.append(
            f"mask token {model.model.mask_token_id} != config.json mask_token_id "
            f"{spec.mask_token_id}"
        )
    causal = set(model.get_draft_attn_causal())
    if causal != {spec.causal}:
        problems.append(f"layer causality {sorted(causal)} != dflash_config.causal {spec.causal}")
    if problems:
        raise DraftSpecError(problems, source=source)
