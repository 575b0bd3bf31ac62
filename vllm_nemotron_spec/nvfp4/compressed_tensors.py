"""NVFP4 weight-only drafts from llm-compressor (compressed-tensors ``nvfp4-pack-quantized``).

Registers ``nemotron_ct_w4a16_nvfp4`` (:data:`NAME`), a ``CompressedTensorsConfig`` subclass. The
packed codes and fp8 block scales are ModelOpt's; ``weight_global_scale`` is the reciprocal of
ModelOpt's ``weight_scale_2`` (format and arithmetic: docs/bring-your-own-draft.md). On CPU, where
vLLM has no NVFP4 kernel, it claims checkpoints whose every quantized group is NVFP4 weight-only
and dequantizes each such linear once after loading, each fused shard with its own global scale
(:class:`CompressedTensorsW4A16NvFp4Dequantized`). On GPU vLLM's own scheme and kernels run, and
only Nemotron 3.5 drafts are claimed, for their module names: llm-compressor's ignore list names
modules from the draft's root, while vLLM prefixes, renumbers and fuses them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn import Parameter
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
    CompressedTensorsConfig,
)
from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
    CompressedTensorsScheme,
)
from vllm.model_executor.layers.quantization.compressed_tensors.utils import should_ignore_layer
from vllm.model_executor.parameter import (
    GroupQuantScaleParameter,
    ModelWeightParameter,
    PerTensorScaleParameter,
)

from vllm_nemotron_spec.checkpoint import layout
from vllm_nemotron_spec.nvfp4 import format as nvfp4

NAME = "nemotron_ct_w4a16_nvfp4"
"""The quantization method name this module registers with vLLM."""

CT_QUANT_METHOD = "compressed-tensors"
CT_NVFP4_FORMAT = "nvfp4-pack-quantized"

QWEN3_FUSED_MODULES = {fused: list(shards) for fused, shards in layout.FUSED_MODULES.items()}
"""The fused linears of the drafts' Qwen3 layers and the checkpoint modules they load, as vLLM's
``packed_modules_mapping`` takes them."""

_DESCRIPTION = f"quantization {NAME} (compressed-tensors NVFP4A16 on CPU)"


def register() -> list[str]:
    """Register :class:`NemotronCTW4A16NvFp4Config` with vLLM under :data:`NAME` (idempotent)."""
    from vllm_nemotron_spec.nvfp4.config import register_quantization_config_once

    register_quantization_config_once(NAME, NemotronCTW4A16NvFp4Config)
    return [_DESCRIPTION]


def _field(args: Any, key: str):
    return args.get(key) if isinstance(args, dict) else getattr(args, key, None)


def _lower(value) -> str:
    value = getattr(value, "value", value)
    return str(value).lower() if value is not None else ""


def is_nvfp4_weight_args(weights: Any) -> bool:
    """Quantization args (dict or QuantizationArgs) of an NVFP4 weight: 4-bit float, tensor_group
    strategy, group 16, symmetric."""
    if weights is None:
        return False
    return (
        _field(weights, "num_bits") == 4
        and _lower(_field(weights, "type")) == "float"
        and _lower(_field(weights, "strategy")) == "tensor_group"
        and _field(weights, "group_size") == nvfp4.GROUP_SIZE
        and _field(weights, "symmetric") in (True, None)
    )


def ct_nvfp4_weight_only(hf_quant_cfg: Any) -> bool:
    """Whether a ``quantization_config`` is compressed-tensors NVFP4 weight-only in the
    ``nvfp4-pack-quantized`` format, in every config group that quantizes weights."""
    if not isinstance(hf_quant_cfg, dict):
        return False
    if str(hf_quant_cfg.get("quant_method") or "").lower() != CT_QUANT_METHOD:
        return False
    groups = hf_quant_cfg.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        return False
    top_format = hf_quant_cfg.get("format")
    found = False
    for group in groups.values():
        if not isinstance(group, dict):
            return False
        weights = group.get("weights")
        if weights is None:
            continue
        if not is_nvfp4_weight_args(weights):
            return False
        if group.get("input_activations") is not None:
            return False  # W4A4: not weight-only
        if (group.get("format") or top_format) != CT_NVFP4_FORMAT:
            return False
        found = True
    return found


class NemotronCTW4A16NvFp4Config(CompressedTensorsConfig):
    """vLLM's compressed-tensors config with an exact CPU scheme for NVFP4 W4A16 (module doc)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.ignore, list):
            self.ignore = list(self.ignore or ())
        # vLLM's DFlash draft names its layers after the target's (``layers.{i + num target
        # layers}``) and aliases checkpoint-local exclusions through ``exclude_modules`` only
        # (``qwen3_dflash._add_global_draft_layer_exclusions``, written for ModelOpt). The same
        # list object here, so those aliases land in the compressed-tensors ignore list too.
        self.exclude_modules = self.ignore

    def get_name(self) -> str:  # type: ignore[override]
        return NAME

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None) -> str | None:
        if user_quant not in (None, NAME):
            return None  # an explicit choice of another method wins
        from vllm.platforms import current_platform

        if not ct_nvfp4_weight_only(hf_quant_cfg):
            if user_quant == NAME:
                raise ValueError(
                    f"quantization={NAME!r} loads compressed-tensors {CT_NVFP4_FORMAT} "
                    "checkpoints quantized NVFP4 weight-only (NVFP4A16); this checkpoint's "
                    "quantization_config is not"
                )
            return None
        if user_quant == NAME or current_platform.is_cpu():
            return NAME
        # GPU: only Nemotron 3.5 drafts, for the layer-name fixes above (the scheme and kernels
        # stay vLLM's); every other checkpoint keeps vLLM's own compressed-tensors config.
        return NAME if _is_nemotron35_draft(hf_config) else None

    def get_scheme_dict(self, layer: torch.nn.Module, layer_name: str | None = None):
        """vLLM's lookup, after trying the ignore list on every tail of the module path (the
        checkpoint names modules from the draft's root, vLLM under ``model.``), with the Qwen3
        fused layers' shards known even when vLLM passed no ``packed_modules_mapping`` (it does
        not for the config instance a DFlash draft builds for itself)."""
        if layer_name:
            fused = {**QWEN3_FUSED_MODULES, **(self.packed_modules_mapping or {})}
            parts = layer_name.split(".")
            for start in range(len(parts)):
                if should_ignore_layer(
                    ".".join(parts[start:]), ignore=self.ignore, fused_mapping=fused
                ):
                    return None
        return super().get_scheme_dict(layer, layer_name)

    def _get_scheme_from_parts(
        self, weight_quant, input_quant, output_quant=None, format=None, layer_name=None
    ):
        from vllm.platforms import current_platform

        if current_platform.is_cpu() and input_quant is None and is_nvfp4_weight_args(weight_quant):
            return CompressedTensorsW4A16NvFp4Dequantized(layer_name)
        return super()._get_scheme_from_parts(
            weight_quant=weight_quant,
            input_quant=input_quant,
            output_quant=output_quant,
            format=format,
            layer_name=layer_name,
        )


def _is_nemotron35_draft(hf_config) -> bool:
    from vllm_nemotron_spec.checkpoint.spec import is_nemotron35_draft_config

    if hf_config is None:
        return False
    cfg = hf_config.to_dict() if hasattr(hf_config, "to_dict") else hf_config
    return isinstance(cfg, dict) and is_nemotron35_draft_config(cfg)


def _shape(shape) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


def _checked(
    weight_loader, layer_name: str | None, tensor: str, dtype, in_features: int, per_input: int
):
    """vLLM's loader of ``{layer}.{tensor}``, after checking the checkpoint tensor's dtype and its
    input dimension (``in_features / per_input``)."""

    def load(param, loaded_weight: torch.Tensor, *args, **kwargs):
        expected_cols = in_features // per_input
        if (
            loaded_weight.dtype != dtype
            or loaded_weight.dim() != 2
            or loaded_weight.shape[1] != expected_cols
        ):
            raise ValueError(
                f"{layer_name}.{tensor}: found {loaded_weight.dtype} "
                f"{_shape(loaded_weight.shape)}, expected {dtype} [rows, {expected_cols}] "
                f"(NVFP4 {CT_NVFP4_FORMAT}: logical input size {in_features})"
            )
        return weight_loader(param, loaded_weight, *args, **kwargs)

    return load


class CompressedTensorsW4A16NvFp4Dequantized(CompressedTensorsScheme):
    """CPU: the compressed-tensors NVFP4 tensors, dequantized once after loading (module doc)."""

    def __init__(self, layer_name: str | None = None):
        self.layer_name = layer_name

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    def create_weights(
        self,
        layer: torch.nn.Module,
        output_partition_sizes: list[int],
        input_size_per_partition: int,
        params_dtype: torch.dtype,
        weight_loader,
        **kwargs,
    ):
        if input_size_per_partition % nvfp4.GROUP_SIZE:
            raise ValueError(
                f"{self.layer_name}: NVFP4 needs the input size per partition divisible by "
                f"{nvfp4.GROUP_SIZE}, got {input_size_per_partition}"
            )
        out_features = sum(output_partition_sizes)
        layer.logical_widths = list(output_partition_sizes)
        layer.input_size_per_partition = input_size_per_partition
        layer.output_size_per_partition = out_features
        self.params_dtype = params_dtype
        weight = ModelWeightParameter(
            data=torch.empty(out_features, input_size_per_partition // 2, dtype=torch.uint8),
            input_dim=1,
            output_dim=0,
            weight_loader=_checked(
                weight_loader,
                self.layer_name,
                "weight_packed",
                torch.uint8,
                input_size_per_partition,
                2,
            ),
        )
        # NaN marks "never loaded".
        scale = GroupQuantScaleParameter(
            data=torch.full(
                (out_features, input_size_per_partition // nvfp4.GROUP_SIZE), float("nan")
            ).to(torch.float8_e4m3fn),
            input_dim=1,
            output_dim=0,
            weight_loader=_checked(
                weight_loader,
                self.layer_name,
                "weight_scale",
                torch.float8_e4m3fn,
                input_size_per_partition,
                nvfp4.GROUP_SIZE,
            ),
        )
        global_scale = PerTensorScaleParameter(
            data=torch.full((len(output_partition_sizes),), float("nan"), dtype=torch.float32),
            weight_loader=weight_loader,
        )
        layer.register_parameter("weight_packed", weight)
        layer.register_parameter("weight_scale", scale)
        layer.register_parameter("weight_global_scale", global_scale)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        from vllm_nemotron_spec.nvfp4.config import dequantize_shards

        if torch.isnan(layer.weight_scale.data.float()).any():
            raise RuntimeError(
                f"{self.layer_name}.weight_scale was never loaded: the checkpoint has no NVFP4 "
                "tensors for this module (stored unquantized?); add it to the quantization "
                "config's ignore list"
            )
        global_scales = layer.weight_global_scale.data.to(torch.float32)
        missing = torch.isnan(global_scales).nonzero().flatten().tolist()
        if missing:
            raise RuntimeError(
                f"{self.layer_name}.weight_global_scale was never loaded for "
                f"shard(s) {missing} of {len(layer.logical_widths)}"
            )
        dense = dequantize_shards(
            layer.weight_packed.data,
            layer.weight_scale.data,
            to_modelopt_global_scale(global_scales),
            layer.logical_widths,
            dtype=self.params_dtype,
        )
        del layer.weight_packed, layer.weight_scale, layer.weight_global_scale
        layer.weight = Parameter(dense, requires_grad=False)

    def apply_weights(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


def to_modelopt_global_scale(weight_global_scale: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' ``weight_global_scale`` -> ModelOpt's ``weight_scale_2`` (float32
    ``1 / g``, the value vLLM's scheme hands its kernels)."""
    return torch.reciprocal(weight_global_scale.to(torch.float32))


def dequantize(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_global_scale: torch.Tensor,
    dtype: torch.dtype = torch.float32,
):
    """Dense weight of one compressed-tensors NVFP4 module (what the CPU scheme computes)."""
    return nvfp4.dequantize(
        weight_packed,
        weight_scale,
        to_modelopt_global_scale(weight_global_scale).reshape(()),
        dtype=dtype,
    )
