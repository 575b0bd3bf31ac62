"""DFlash proposer for vLLM's V1 runner whose draft layers may sit in several KV-cache groups.

Why: with a NemotronH target (many Mamba layers, few attention layers) vLLM's hybrid KV-cache
allocator can split a multi-layer draft over several attention groups, each with its OWN block
table, and vLLM's V1 ``DFlashProposer`` (``v1/spec_decode/dflash.py``) asserts "All drafting layers
should belong to the same kv cache group". vLLM's V2 speculators handle several groups; V1 (the
only runner on CPU) does not. Removal: when vLLM's V1 ``DFlashProposer`` accepts draft layers in
several KV-cache groups (or V1 is retired on CPU).

Per-batch-size speculation (``num_speculative_tokens_per_batch_size``): the runner asks for k
drafts per request this step (vLLM's scheduler picks k from the batch size). DFlash attends across
its block, so the proposer drafts the whole trained block and keeps the first k, as vLLM's V2
runner does: a draft is the same token whatever k the step asked for. A causal draft (DSpark)
drafts only k: its first k drafts are the block's (``drafts_only_k``; on the V2 runner
``patches/v2_dspark_draft_k.py``). k = 0 stores the context K/V only.
"""

from __future__ import annotations

from copy import copy
from typing import Any

import torch
from typing_extensions import override
from vllm.config import VllmConfig, get_layers_from_vllm_config
from vllm.logger import init_logger
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.kv_cache_interface import KVCacheConfig, UniformTypeKVCacheSpecs
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.ops.topk_topp_sampler import (
    empty_exponential_noise_like,
    sample_with_exponential_noise,
)
from vllm.v1.spec_decode.dflash import DFlashProposer
from vllm.v1.spec_decode.utils import (
    PADDING_SLOT_ID,
    _copy_and_expand_dflash_inputs,
    next_power_of_2,
)
from vllm.v1.worker.utils import AttentionGroup

logger = init_logger("vllm.nemotron_spec.proposer")


def slots_from_block_table(
    block_table: torch.Tensor, req_index: torch.Tensor, positions: torch.Tensor, block_size: int
) -> torch.Tensor:
    """KV-cache slot of each (request row, position) in one group's block table; the block index
    is clamped to the table's width like vLLM's DFlash input kernel does."""
    block_num = torch.clamp(positions // block_size, max=block_table.shape[1] - 1)
    block_id = block_table[req_index.long(), block_num.long()].to(torch.int64)
    return block_id * block_size + positions % block_size


SAMPLING_EPS = 1e-5  # vLLM's threshold below which a temperature means greedy


def resample_seeded_rows(
    ids: torch.Tensor,
    probs: torch.Tensor,
    sampling_metadata: SamplingMetadata,
    use_fp64_gumbel: bool = False,
) -> torch.Tensor:
    """``ids`` with the rows of seeded requests re-drawn from ``probs`` with each request's own
    generator (exponential-race sampling, as vLLM draws them).

    Why: vLLM's V1 probabilistic drafting draws its noise from the global RNG ("TODO(woosuk):
    Consider seeds", ``llm_base_proposer.compute_probs_and_sample_next_token``), so a seeded
    request's drafts, and with them its output, change from run to run. Rows are request-major
    (``rows // requests`` consecutive rows a request); greedy requests keep their argmax."""
    generators = sampling_metadata.generators
    temperature = sampling_metadata.temperature
    if sampling_metadata.all_greedy or not generators or temperature is None:
        return ids
    rows_per_request = ids.shape[0] // temperature.shape[0]
    for req, generator in generators.items():
        rows = slice(req * rows_per_request, (req + 1) * rows_per_request)
        q = empty_exponential_noise_like(probs[rows], use_fp64_gumbel).exponential_(
            generator=generator
        )
        drawn = sample_with_exponential_noise(probs[rows].clone(), q).to(ids.dtype)
        # A greedy request keeps its argmax; chosen on the device (no host sync per request).
        ids[rows] = torch.where(temperature[req] < SAMPLING_EPS, ids[rows], drawn)
    return ids


class Nemotron35DFlashProposer(DFlashProposer):
    """vLLM's V1 DFlash proposer with per-KV-cache-group attention metadata and slot mappings,
    and probabilistic drafts that honour request seeds (:func:`resample_seeded_rows`).

    The same step as vLLM's proposer (its fused input kernel for the primary group, whose block
    table the runner hands over), plus, for each further group, slot mappings computed from that
    group's block table (:func:`slots_from_block_table`), an attention metadata per group,
    per-layer slot mappings for the query forward and per-layer context slot mappings for the
    context K/V insert (``precompute_and_store_context_kv`` takes a per-layer list). With one
    group every step is vLLM's own code path. The query layout is a hook
    (:meth:`query_rows_per_request`, :meth:`sample_rows`) so the DSpark proposer can use the
    anchor layout (gamma rows) on the same machinery."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, runner=None):
        super().__init__(vllm_config, device, runner)
        self.runner = runner
        # the block drafted every step: num_speculative_tokens of the config, whatever k a
        # per-batch-size schedule asks for (``propose``)
        self.block_num_speculative_tokens = self.num_speculative_tokens
        # whether a step drafts only its k (a causal draft: the first k drafts are the block's)
        self.drafts_only_k = False
        self._layer_gid: dict[str, int] = {}
        self._extra_gids: list[int] = []  # draft groups other than the runner's (kv_cache_gid)
        self._group_slots: dict[int, torch.Tensor] = {}  # gid -> query slot buffer
        self._group_context_slots: dict[int, torch.Tensor] = {}
        self._group_block_tables: dict[int, torch.Tensor] = {}

    # --- the query layout (overridden by DSpark) ------------------------------------------------

    def query_rows_per_request(self) -> int:
        """DFlash: the bonus token and one MASK per drafted token."""
        return 1 + self.num_speculative_tokens

    def sample_rows(self, kernel_indices: torch.Tensor, batch_size: int):
        """Rows of the block whose hidden states are drafted from (DFlash: all but the anchor)."""
        return kernel_indices

    @override
    def _sample_from_logits(self, logits: torch.Tensor, sampling_metadata: SamplingMetadata):
        ids, probs = super()._sample_from_logits(logits, sampling_metadata)
        if probs is None or sampling_metadata.all_greedy:
            return ids, probs
        return resample_seeded_rows(ids, probs, sampling_metadata, self.use_fp64_gumbel), probs

    # --- per-batch-size speculation ------------------------------------------------------------

    @override
    def propose(self, num_speculative_tokens: int, *args, **kwargs) -> torch.Tensor:
        """Drafts ``[batch, k]`` for the k the runner asks for this step: the whole block is
        drafted and the drafts past k are dropped (their draft probabilities too), or with
        ``drafts_only_k`` k are drafted; k = 0 stores the context K/V only
        (:meth:`store_context_only`)."""
        k = int(num_speculative_tokens)
        block = self.block_num_speculative_tokens
        if not 0 <= k <= block:
            raise ValueError(
                f"num_speculative_tokens for this step: expected 0..{block} (the configured "
                f"num_speculative_tokens), found {k}"
            )
        if k == 0:
            return self.store_context_only(*args, **kwargs)
        drafted = k if self.drafts_only_k else block
        drafts = super().propose(drafted, *args, **kwargs)
        if k == drafted:
            return drafts
        if self._last_draft_probs is not None:
            self._last_draft_probs = self._last_draft_probs[:, :k].contiguous()
        return drafts[:, :k].contiguous()

    def store_context_only(
        self,
        target_token_ids: torch.Tensor,
        target_positions: torch.Tensor,
        target_hidden_states: torch.Tensor,
        next_token_ids: torch.Tensor,
        token_indices_to_sample: torch.Tensor | None,
        common_attn_metadata: CommonAttentionMetadata,
        sampling_metadata: SamplingMetadata,
        mm_embed_inputs=None,
        num_rejected_tokens_gpu: torch.Tensor | None = None,
        slot_mappings=None,
    ) -> torch.Tensor:
        """A step that drafts nothing: the committed tokens' context K/V go into the draft's
        cache (later steps attend to them) and the query pass is skipped, as in vLLM's V2
        speculators. Returns an empty ``[batch, 0]``."""
        self.num_speculative_tokens = self.block_num_speculative_tokens
        self._last_draft_probs = None
        batch_size = common_attn_metadata.batch_size()
        self.set_inputs_first_pass(
            target_token_ids=target_token_ids,
            next_token_ids=next_token_ids,
            target_positions=target_positions,
            target_hidden_states=self.model.combine_hidden_states(target_hidden_states),
            token_indices_to_sample=token_indices_to_sample,
            cad=common_attn_metadata,
            num_rejected_tokens_gpu=num_rejected_tokens_gpu,
        )
        num_context = self._dflash_num_context
        self.model.precompute_and_store_context_kv(
            self._dflash_hidden_states,
            self._context_positions_buffer[:num_context],
            self._context_slots_per_layer(num_context),
        )
        return torch.empty(batch_size, 0, dtype=torch.int64, device=self.device)

    # --- KV-cache groups ------------------------------------------------------------------------

    @override
    def validate_same_kv_cache_group(self, kv_cache_config: KVCacheConfig) -> None:
        """Several groups are fine here; every draft layer must have one."""
        in_groups = {n for g in kv_cache_config.kv_cache_groups for n in g.layer_names}
        missing = sorted(self._draft_attn_layer_names - in_groups)
        if missing:
            raise ValueError(f"draft attention layers without a KV-cache group: {missing}")

    @override
    def initialize_attn_backend(
        self, kv_cache_config: KVCacheConfig, kernel_block_sizes: list[int] | None = None
    ) -> None:
        self.validate_same_kv_cache_group(kv_cache_config)
        all_attn_layers = get_layers_from_vllm_config(
            self.vllm_config,
            AttentionLayerBase,  # type: ignore[type-abstract]
        )
        self._layer_gid = {
            name: gid
            for gid, group in enumerate(kv_cache_config.kv_cache_groups)
            for name in group.layer_names
            if name in self._draft_attn_layer_names
        }
        gids = sorted(set(self._layer_gid.values()))
        self.kv_cache_gid = gids[0]
        self._extra_gids = gids[1:]
        groups: dict[tuple[int, str], AttentionGroup] = {}
        for name in sorted(self._draft_attn_layer_names):
            gid = self._layer_gid[name]
            backend = all_attn_layers[name].get_attn_backend()
            key = (gid, backend.full_cls_name())
            if key in groups:
                groups[key].layer_names.append(name)
                continue
            spec = kv_cache_config.kv_cache_groups[gid].kv_cache_spec
            if isinstance(spec, UniformTypeKVCacheSpecs):
                spec = spec.kv_cache_specs[name]
            kernel_block_size = (
                kernel_block_sizes[gid]
                if kernel_block_sizes is not None and gid < len(kernel_block_sizes)
                else None
            )
            group = AttentionGroup(
                backend=backend, layer_names=[name], kv_cache_spec=spec, kv_cache_group_id=gid
            )
            group.create_metadata_builders(
                self.vllm_config, self.device, kernel_block_size=kernel_block_size
            )
            groups[key] = group
        self.draft_attn_groups = list(groups.values())
        self.block_size = next(
            g.kv_cache_spec.block_size
            for g in self.draft_attn_groups
            if g.kv_cache_group_id == self.kv_cache_gid
        )
        for gid in self._extra_gids:
            self._group_slots[gid] = torch.zeros_like(self._slot_mapping_buffer)
            self._group_context_slots[gid] = torch.zeros_like(self._context_slot_mapping_buffer)
        if self._extra_gids:
            logger.info(
                "nemotron-spec: the %d draft attention layers sit in %d KV-cache groups %s; "
                "drafting with per-group attention metadata and slot mappings",
                len(self._layer_gid),
                len(gids),
                gids,
            )

    def _group_block_size(self, gid: int) -> int:
        return self.runner.input_batch.block_table[gid].block_size

    def _fill_extra_group_slots(
        self, batch_size: int, num_context: int, num_query: int, cad: CommonAttentionMetadata
    ) -> None:
        """Slot mappings of the context and query tokens in every non-primary group."""
        ctx_req = torch.repeat_interleave(
            torch.arange(batch_size, device=self.device),
            cad.query_start_loc[1 : batch_size + 1] - cad.query_start_loc[:batch_size],
            output_size=num_context,
        )
        query_req = torch.arange(batch_size, device=self.device).repeat_interleave(
            self.query_rows_per_request()
        )
        ctx_pos = self._context_positions_buffer[:num_context]
        query_pos = self.positions[:num_query]
        for gid in self._extra_gids:
            table = self.runner.input_batch.block_table[gid].get_device_tensor(batch_size)
            size = self._group_block_size(gid)
            self._group_block_tables[gid] = table
            self._group_context_slots[gid][:num_context] = slots_from_block_table(
                table, ctx_req, ctx_pos, size
            )
            self._group_slots[gid][:num_query] = slots_from_block_table(
                table, query_req, query_pos, size
            )

    # --- one drafting step ----------------------------------------------------------------------

    @override
    def set_inputs_first_pass(
        self,
        target_token_ids: torch.Tensor,
        next_token_ids: torch.Tensor,
        target_positions: torch.Tensor,
        target_hidden_states: torch.Tensor,
        token_indices_to_sample: torch.Tensor | None,
        cad: CommonAttentionMetadata,
        num_rejected_tokens_gpu: torch.Tensor | None,
    ) -> tuple[int, Any, CommonAttentionMetadata]:
        """vLLM's DFlash input step with the query rows per request taken from
        :meth:`query_rows_per_request`, plus the slot mappings of the other KV-cache groups."""
        batch_size = cad.batch_size()
        num_context = target_token_ids.shape[0]
        rows = self.query_rows_per_request()
        num_query_total = batch_size * rows
        self._dflash_num_context = num_context
        self._dflash_hidden_states = target_hidden_states
        self._anchor_token_ids = next_token_ids[:batch_size]

        kernel_indices = torch.empty(
            batch_size * self.num_speculative_tokens, dtype=torch.int32, device=self.device
        )
        max_tokens_per_req = cad.max_query_len + rows
        has_num_rejected = num_rejected_tokens_gpu is not None
        _copy_and_expand_dflash_inputs(
            next_token_ids_ptr=next_token_ids,
            target_positions_ptr=target_positions,
            out_input_ids_ptr=self.input_ids,
            out_context_positions_ptr=self._context_positions_buffer,
            out_query_positions_ptr=self.positions,
            out_context_slot_mapping_ptr=self._context_slot_mapping_buffer,
            out_query_slot_mapping_ptr=self._slot_mapping_buffer,
            out_token_indices_ptr=kernel_indices,
            block_table_ptr=cad.block_table_tensor,
            block_table_stride=cad.block_table_tensor.stride(0),
            query_start_loc_ptr=cad.query_start_loc,
            num_rejected_tokens_ptr=num_rejected_tokens_gpu if has_num_rejected else 0,
            parallel_drafting_token_id=self.parallel_drafting_token_id,
            block_size=self.block_size,
            num_query_per_req=rows,
            num_speculative_tokens=self.num_speculative_tokens,
            total_input_tokens=num_context,
            max_tokens_per_req=max_tokens_per_req,
            triton_block_size=min(256, next_power_of_2(max_tokens_per_req)),
            has_num_rejected=has_num_rejected,
        )
        if self._extra_gids:
            self._fill_extra_group_slots(batch_size, num_context, num_query_total, cad)

        effective_seq_lens = cad.seq_lens
        if has_num_rejected:
            effective_seq_lens = effective_seq_lens - num_rejected_tokens_gpu
        upper = cad.seq_lens_cpu_upper_bound
        new_cad = CommonAttentionMetadata(
            query_start_loc=self.arange[: batch_size + 1] * rows,
            seq_lens=effective_seq_lens + rows,
            query_start_loc_cpu=(
                torch.from_numpy(self.token_arange_np[: batch_size + 1]).clone() * rows
            ),
            seq_lens_cpu_upper_bound=upper + rows if upper is not None else None,
            num_reqs=cad.num_reqs,
            num_actual_tokens=num_query_total,
            max_query_len=rows,
            max_seq_len=cad.max_seq_len + rows,
            block_table_tensor=cad.block_table_tensor,
            slot_mapping=self._slot_mapping_buffer[:num_query_total],
            causal=self.dflash_causal,
        )
        return num_query_total, self.sample_rows(kernel_indices, batch_size), new_cad

    @override
    def build_model_inputs_first_pass(
        self, num_tokens: int, num_input_tokens: int, mm_embed_inputs
    ) -> tuple[dict[str, Any], int]:
        num_context = self._dflash_num_context
        self.model.precompute_and_store_context_kv(
            self._dflash_hidden_states,
            self._context_positions_buffer[:num_context],
            self._context_slots_per_layer(num_context),
        )
        return (
            dict(
                input_ids=self.input_ids[:num_input_tokens],
                positions=self._get_positions(num_input_tokens),
                inputs_embeds=None,
            ),
            num_input_tokens,
        )

    def _context_slots_per_layer(self, num_context: int):
        primary = self._context_slot_mapping_buffer[:num_context]
        if not self._extra_gids:
            return primary
        out = []
        for layer in self.model.model.layers:
            gid = self._layer_gid[layer.self_attn.attn.layer_name]
            out.append(
                primary
                if gid == self.kv_cache_gid
                else self._group_context_slots[gid][:num_context]
            )
        return out

    @override
    def build_per_group_and_layer_attn_metadata(
        self, cad: CommonAttentionMetadata, draft_index: int = 0
    ) -> tuple[list[object], dict[str, object]]:
        if not self._extra_gids:
            return super().build_per_group_and_layer_attn_metadata(cad, draft_index)
        per_group: list[object] = []
        per_layer: dict[str, object] = {}
        num_tokens = cad.num_actual_tokens
        for group in self.draft_attn_groups:
            gid = group.kv_cache_group_id
            group_cad = cad
            if gid != self.kv_cache_gid:
                group_cad = copy(cad)
                group_cad.block_table_tensor = self._group_block_tables[gid]
                group_cad.slot_mapping = self._group_slots[gid][:num_tokens]
            metadata = group.build_metadata_for_drafting(
                common_attn_metadata=group_cad, draft_index=draft_index
            )
            if not self.dflash_causal and getattr(metadata, "causal", None) is not False:
                raise ValueError(
                    f"attention backend of {group.layer_names} has no non-causal support, "
                    "which this DFlash draft needs (dflash_config.causal is false)"
                )
            per_group.append(metadata)
            for name in group.layer_names:
                per_layer[name] = metadata
        return per_group, per_layer

    @override
    def _get_slot_mapping(
        self, num_tokens: int, slot_mapping: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        views = super()._get_slot_mapping(num_tokens, slot_mapping)
        if not self._extra_gids:
            return views
        num_actual = num_tokens if slot_mapping is None else slot_mapping.shape[0]
        for gid in self._extra_gids:
            self._group_slots[gid][num_actual:num_tokens].fill_(PADDING_SLOT_ID)
        return {
            name: views[name] if gid == self.kv_cache_gid else self._group_slots[gid][:num_tokens]
            for name, gid in self._layer_gid.items()
        }
