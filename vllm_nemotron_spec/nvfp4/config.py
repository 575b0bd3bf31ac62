"""W4A16 NVFP4 (ModelOpt) checkpoints through vLLM's quantization registry.

Registers ``nemotron_w4a16_nvfp4`` (:data:`NAME`), a ``ModelOptNvFp4Config`` subclass that claims
ModelOpt ``W4A16_NVFP4`` checkpoints only (flat config.json and nested ``hf_quant_config.json``
forms), so a draft loads without a flag and every other checkpoint loads as in plain vLLM. Only
quantized linears differ from vLLM's: on CPU :class:`NvFp4DequantizedLinearMethod` dequantizes
once after loading (bit-exact); on GPU :class:`NvFp4KernelLinearMethod` runs vLLM's W4A16 NVFP4
kernels and keeps fused shards with different ``weight_scale_2`` exact. Tensors are checked as
they load: a wrong dtype or packed shape raises an error naming the tensor.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn import Parameter
from vllm.logger import init_logger
from vllm.model_executor.layers.linear import (
    LinearMethodBase,
    UnquantizedLinearMethod,
    register_weight_loader_v2_supported_method,
)
from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config
from vllm.model_executor.parameter import ModelWeightParameter, PerTensorScaleParameter

from vllm_nemotron_spec.checkpoint import layout
from vllm_nemotron_spec.checkpoint.layout import modelopt_quant_algo
from vllm_nemotron_spec.nvfp4 import format as nvfp4

logger = init_logger(__name__)

NAME = "nemotron_w4a16_nvfp4"
"""The quantization method name this module registers with vLLM."""

QUANT_ALGO = layout.QUANT_ALGO
"""The ModelOpt ``quant_algo`` this config claims (weight-only NVFP4, bf16/fp16 activations)."""

_DESCRIPTION = f"quantization {NAME} (ModelOpt {QUANT_ALGO})"


def register() -> list[str]:
    """Register :class:`NemotronW4A16NvFp4Config` with vLLM under :data:`NAME` (idempotent)."""
    register_quantization_config_once(NAME, NemotronW4A16NvFp4Config)
    return [_DESCRIPTION]


def register_quantization_config_once(name: str, config_cls: type) -> None:
    """``vllm...quantization.register_quantization_config(name)(config_cls)`` unless ``name`` is
    already registered to ``config_cls`` (plugins are loaded again in every process)."""
    from vllm.model_executor.layers import quantization as vllm_quant

    registered = getattr(vllm_quant, "_CUSTOMIZED_METHOD_TO_QUANT_CONFIG", {}).get(name)
    if registered is not config_cls or name not in vllm_quant.QUANTIZATION_METHODS:
        vllm_quant.register_quantization_config(name)(config_cls)


class NemotronW4A16NvFp4Config(ModelOptNvFp4Config):
    """vLLM's ModelOpt NVFP4 config for W4A16 checkpoints, with our linear methods (module doc)."""

    def __init__(
        self,
        quant_method: str = QUANT_ALGO,
        is_checkpoint_nvfp4_serialized: bool = True,
        kv_cache_quant_algo: str | None = None,
        exclude_modules: list[str] | None = None,
        group_size: int = nvfp4.GROUP_SIZE,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            quant_method,
            is_checkpoint_nvfp4_serialized,
            kv_cache_quant_algo,
            exclude_modules,
            group_size,
            **kwargs,
        )
        if self.quant_method != QUANT_ALGO:
            raise ValueError(
                f"quantization {NAME!r} loads ModelOpt quant_algo {QUANT_ALGO!r} checkpoints; "
                f"this checkpoint's quant_algo is {self.quant_method!r}"
            )
        if group_size != nvfp4.GROUP_SIZE:
            raise ValueError(
                f"{QUANT_ALGO} needs group_size {nvfp4.GROUP_SIZE} in the quantization config, "
                f"got {group_size}"
            )
        self.group_size = group_size

    def get_name(self) -> str:  # type: ignore[override]
        return NAME

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        from vllm.platforms import current_platform

        if current_platform.is_cpu():  # dequantized weights: any float dtype is exact
            return [torch.float32, torch.bfloat16, torch.float16]
        return [torch.bfloat16, torch.float16]  # vLLM's W4A16 kernels

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None) -> str | None:
        algo = modelopt_quant_algo(hf_quant_cfg)
        if user_quant == NAME and algo != QUANT_ALGO:
            raise ValueError(
                f"quantization={NAME!r} loads ModelOpt checkpoints with quant_algo {QUANT_ALGO!r}; "
                f"this checkpoint's quantization_config has quant_algo {algo!r}"
            )
        if user_quant not in (None, NAME):
            return None  # an explicit choice of another method wins
        return NAME if algo == QUANT_ALGO else None

    def is_layer_excluded(self, prefix: str) -> bool:
        """vLLM's ModelOpt rule (exact names, fused shards, substrings, wildcards), applied to the
        module path and to each of its tails at a module boundary: the checkpoint names a draft's
        modules from its own root ("layers.*.self_attn*"), while vLLM may build the draft under
        "model." or "draft_model.model." (vLLM's rule already matches plain names anywhere)."""
        parts = prefix.split(".")
        for start in range(len(parts)):
            if super().is_layer_excluded(".".join(parts[start:])):
                return True
        return False

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        method = super().get_quant_method(layer, prefix)
        if isinstance(method, LinearMethodBase) and not isinstance(method, UnquantizedLinearMethod):
            from vllm.platforms import current_platform

            return linear_method_class(current_platform)(self, prefix)
        return method


def linear_method_class(platform) -> type[_W4A16LinearMethod]:
    """The linear method for a vLLM platform: exact dequantized compute on CPU, vLLM's kernels
    elsewhere."""
    if platform.is_cpu():
        return NvFp4DequantizedLinearMethod
    return NvFp4KernelLinearMethod


def _shape(shape) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


def _checkpoint_rows(layer: torch.nn.Module, shard_id) -> int | None:
    """Rows of the checkpoint tensor loaded with ``shard_id`` (None where it cannot be known)."""
    if hasattr(layer, "org_vocab_size"):  # ParallelLMHead (e.g. DSpark's markov_w2)
        return int(layer.org_vocab_size)
    if shard_id is None:
        return int(layer.output_size) if hasattr(layer, "output_size") else None
    if isinstance(shard_id, int) and hasattr(layer, "output_sizes"):
        return int(layer.output_sizes[shard_id])
    if shard_id in ("q", "k", "v") and hasattr(layer, "total_num_kv_heads"):
        heads = layer.total_num_heads if shard_id == "q" else layer.total_num_kv_heads
        head_size = layer.v_head_size if shard_id == "v" else layer.head_size
        return int(heads * head_size)
    return None


def _checked_loader(weight_loader, layer, prefix: str, name: str, in_features: int):
    """Wrap vLLM's loader of ``prefix.name`` with a check of the checkpoint tensor's dtype and
    shape (``name`` is ``weight`` or ``weight_scale``)."""

    def load(param, loaded_weight: torch.Tensor, *args, **kwargs):
        shard_id = args[0] if args else kwargs.get("loaded_shard_id")
        tensor = f"{prefix}.{name}" + ("" if shard_id is None else f" (shard {shard_id!r})")
        rows = _checkpoint_rows(layer, shard_id)
        logical = (rows if rows is not None else int(loaded_weight.shape[0]), in_features)
        if name == "weight":
            expected, dtype, what = nvfp4.packed_shape(logical), torch.uint8, "packed NVFP4 weight"
            layout = "two E2M1 codes per byte along the input dim"
        else:
            expected, dtype, what = nvfp4.scale_shape(logical), torch.float8_e4m3fn, "block scale"
            layout = f"one scale per {nvfp4.GROUP_SIZE} inputs"
        found = tuple(loaded_weight.shape)
        shape_ok = len(found) == 2 and (
            found == expected or (rows is None and found[1] == expected[1])
        )
        if loaded_weight.dtype != dtype or not shape_ok:
            hint = ""
            if loaded_weight.is_floating_point() and name == "weight":
                hint = (
                    f"; a {loaded_weight.dtype} weight means the checkpoint stores this module "
                    f"unquantized: it is missing from the quantization config's exclusions "
                    f"(ignore / exclude_modules)"
                )
            raise ValueError(
                f"{tensor}: found {loaded_weight.dtype} {_shape(found)}, expected the {what} as "
                f"{dtype} {_shape(expected)} ({layout}) for the logical {_shape(logical)} weight"
                f"{hint}"
            )
        return weight_loader(param, loaded_weight, *args, **kwargs)

    return load


class _W4A16LinearMethod(LinearMethodBase):
    """The checkpoint side, the same on every platform: the four ModelOpt tensors of a module."""

    def __init__(self, quant_config: NemotronW4A16NvFp4Config, prefix: str = "") -> None:
        self.quant_config = quant_config
        self.prefix = prefix

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ) -> None:
        if input_size_per_partition % nvfp4.GROUP_SIZE:
            raise ValueError(
                f"{self.prefix}: NVFP4 needs the input size per partition divisible by "
                f"{nvfp4.GROUP_SIZE}, got {input_size_per_partition} (input size {input_size})"
            )
        loader = extra_weight_attrs.get("weight_loader")
        out_features = sum(output_partition_sizes)
        num_shards = len(output_partition_sizes)
        layer.logical_widths = list(output_partition_sizes)
        layer.input_size_per_partition = input_size_per_partition
        layer.output_size_per_partition = out_features
        self.params_dtype = params_dtype

        def checked(name):
            return _checked_loader(loader, layer, self.prefix, name, input_size)

        weight = ModelWeightParameter(
            data=torch.empty(out_features, input_size_per_partition // 2, dtype=torch.uint8),
            input_dim=1,
            output_dim=0,
            weight_loader=checked("weight"),
        )
        # NaN marks "never loaded" (a checkpoint that stores this module in BF16).
        weight_scale = ModelWeightParameter(
            data=torch.full(
                (out_features, input_size_per_partition // nvfp4.GROUP_SIZE), float("nan")
            ).to(torch.float8_e4m3fn),
            input_dim=1,
            output_dim=0,
            weight_loader=checked("weight_scale"),
        )
        weight_scale_2 = PerTensorScaleParameter(
            data=torch.full((num_shards,), float("nan"), dtype=torch.float32), weight_loader=loader
        )
        # ModelOpt may write an input_scale for W4A16: loaded (so the name exists), then dropped.
        input_scale = PerTensorScaleParameter(
            data=torch.full((num_shards,), float("nan"), dtype=torch.float32), weight_loader=loader
        )
        layer.register_parameter("weight", weight)
        layer.register_parameter("weight_scale", weight_scale)
        layer.register_parameter("weight_scale_2", weight_scale_2)
        layer.register_parameter("input_scale", input_scale)

    def _check_loaded(self, layer: torch.nn.Module) -> None:
        if torch.isnan(layer.weight_scale.data.float()).any():
            raise RuntimeError(
                f"{self.prefix}.weight_scale was never loaded: the checkpoint has no NVFP4 tensors "
                f"for this module (stored in BF16?); add it to the quantization config's exclusions"
            )
        missing = torch.isnan(layer.weight_scale_2.data).nonzero().flatten().tolist()
        if missing:
            raise RuntimeError(
                f"{self.prefix}.weight_scale_2 was never loaded for shard(s) {missing} "
                f"of {len(layer.logical_widths)}"
            )
        if hasattr(layer, "input_scale"):
            del layer.input_scale


def dequantize_shards(
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_scale_2: torch.Tensor,
    widths: list[int],
    dtype: torch.dtype,
) -> torch.Tensor:
    """Dense weight of a (possibly fused) NVFP4 layer: each shard of ``widths`` rows with its own
    global scale, exactly :func:`format.dequantize` per shard."""
    if sum(widths) != weight.shape[0] or weight_scale_2.numel() != len(widths):
        raise ValueError(
            f"shard widths {widths} and {weight_scale_2.numel()} global scales do not fit a weight "
            f"of {weight.shape[0]} rows"
        )
    parts, start = [], 0
    for width, global_scale in zip(widths, weight_scale_2.reshape(-1)):
        rows = slice(start, start + width)
        parts.append(nvfp4.dequantize(weight[rows], weight_scale[rows], global_scale, dtype=dtype))
        start += width
    return torch.cat(parts) if len(parts) > 1 else parts[0]


@register_weight_loader_v2_supported_method
class NvFp4DequantizedLinearMethod(_W4A16LinearMethod):
    """CPU: dequantize once after loading, then ``F.linear`` (bit-exact with the reference).

    vLLM has no CPU NVFP4 kernel. Dequantizing in every call instead was 5-64x slower per call at
    the real draft shapes (benchmarks/RESULTS.md, "NVFP4 linear on CPU"), and the CPU path serves
    tiny drafts, whose dense weights take little memory."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        self._check_loaded(layer)
        dense = dequantize_shards(
            layer.weight.data,
            layer.weight_scale.data,
            layer.weight_scale_2.data,
            layer.logical_widths,
            dtype=self.params_dtype,
        )
        del layer.weight_scale, layer.weight_scale_2
        layer.weight = Parameter(dense, requires_grad=False)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None):
        return F.linear(x, layer.weight, bias)


def fold_global_scales(
    weight_scale: torch.Tensor, weight_scale_2: torch.Tensor, widths: list[int]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One global scale for a fused layer, when that is exact; None when it is not.

    Shard i's block scales are multiplied by ``r_i = gs_i / max(gs)``. This is exact when every
    ``r_i`` is a power of two (so ``r_i * max(gs) == gs_i``) and every scaled block scale is still
    an exact float8_e4m3fn value: then ``E2M1 * scale' * max(gs)`` is the same real number as
    ``E2M1 * scale * gs_i`` and the dequantized weight is bit-identical. Returns
    ``(folded block scales, 0-dim global scale)``.
    """
    global_scales = weight_scale_2.detach().to(torch.float32).reshape(-1)
    if global_scales.numel() != len(widths) or sum(widths) != weight_scale.shape[0]:
        raise ValueError(
            f"{global_scales.numel()} global scales and shard widths {widths} do not fit block "
            f"scales of shape {_shape(weight_scale.shape)}"
        )
    top = global_scales.max()
    if not bool(torch.all(global_scales > 0)) or not bool(torch.isfinite(global_scales).all()):
        return None
    if bool(torch.all(global_scales == top)):
        return weight_scale, top.clone()
    parts, start = [], 0
    for width, gs in zip(widths, global_scales):
        block = weight_scale[start : start + width]
        start += width
        ratio = gs / top
        mantissa, _ = torch.frexp(ratio)
        if float(mantissa) != 0.5 or float(ratio * top) != float(gs):
            return None  # not a power of two
        folded = (block.to(torch.float32) * ratio).to(torch.float8_e4m3fn)
        # Dividing by a power of two is exact in fp32: equality means nothing was rounded away
        # (a block scale that falls off the e4m3 grid, e.g. into the subnormals, fails here).
        if not torch.equal(folded.to(torch.float32) / ratio, block.to(torch.float32)):
            return None
        parts.append(folded)
    return torch.cat(parts), top.clone()


def vllm_w4a16_kernel():
    """vLLM's choice of NVFP4 weight-only kernel for this platform (Marlin, CuTe-DSL, ...)."""
    from vllm.model_executor.kernels.linear import init_nvfp4_linear_kernel

    return init_nvfp4_linear_kernel(use_a16=True)


class _Shard(torch.nn.Module):
    """One shard of a fused layer, shaped like the layer vLLM's NVFP4 kernels expect: the
    attributes of a vLLM linear layer that their weight preparation reads (Marlin's the sizes;
    Humming's, vLLM 0.33's choice on Hopper when installed, also the partition sizes and bias)."""

    def __init__(self, weight, weight_scale, global_scale, params_dtype) -> None:
        super().__init__()
        self.weight = Parameter(weight, requires_grad=False)
        self.weight_scale = Parameter(weight_scale, requires_grad=False)
        self.weight_global_scale = Parameter(global_scale, requires_grad=False)
        self.output_size_per_partition = self.output_size = int(weight.shape[0])
        self.input_size_per_partition = self.input_size = int(weight.shape[1]) * 2
        self.output_partition_sizes = [self.output_size_per_partition]
        self.logical_widths = [self.output_size_per_partition]
        self.params_dtype = params_dtype
        self.has_bias = False
        self.bias = None


@register_weight_loader_v2_supported_method
class NvFp4KernelLinearMethod(_W4A16LinearMethod):
    """GPU: vLLM's W4A16 NVFP4 kernel, with per-shard global scales handled exactly."""

    kernel = None
    shard_kernels: list | None = None

    def create_weights(self, layer: torch.nn.Module, *args, **kwargs) -> None:
        super().create_weights(layer, *args, **kwargs)
        self.kernel = vllm_w4a16_kernel()  # fail at build time on a platform without one

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        self._check_loaded(layer)
        layer.is_w4a16_nvfp4 = True  # read by vLLM's DSpark Markov head (gathered projection)
        folded = fold_global_scales(
            layer.weight_scale.data, layer.weight_scale_2.data, layer.logical_widths
        )
        global_scales = layer.weight_scale_2.data.flatten().tolist()
        if folded is None:
            logger.warning(
                "%s: the fused shards' weight_scale_2 %s differ by ratios that cannot be folded "
                "exactly into the fp8 block scales; running one NVFP4 GEMM per shard",
                self.prefix,
                global_scales,
            )
            self._split_shards(layer)
            return
        if len(set(global_scales)) > 1:
            logger.info(
                "%s: folded the fused shards' weight_scale_2 %s into their block scales (exact)",
                self.prefix,
                global_scales,
            )
        weight_scale, global_scale = folded
        del layer.weight_scale_2
        layer.weight_scale = Parameter(weight_scale, requires_grad=False)
        layer.weight_global_scale = Parameter(global_scale, requires_grad=False)
        if getattr(layer, "_retain_weight_for_gather", False):
            # The packed tensors before the kernel repacks them (as vLLM's ModelOptLinearMethod).
            layer.register_buffer(
                "_nvfp4_weight_for_gather", layer.weight.detach(), persistent=False
            )
            layer.register_buffer(
                "_nvfp4_weight_scale_for_gather", layer.weight_scale.detach(), persistent=False
            )
            layer.register_buffer(
                "_nvfp4_weight_global_scale_for_gather",
                layer.weight_global_scale.detach(),
                persistent=False,
            )
            layer._nvfp4_group_size_for_gather = nvfp4.GROUP_SIZE
        self.kernel.process_weights_after_loading(layer)

    def _split_shards(self, layer: torch.nn.Module) -> None:
        if getattr(layer, "_retain_weight_for_gather", False):
            raise NotImplementedError(f"{self.prefix}: gathered projection of a fused NVFP4 layer")
        shards, kernels, start = [], [], 0
        global_scales = layer.weight_scale_2.data.to(torch.float32)
        for width, gs in zip(layer.logical_widths, global_scales):
            rows = slice(start, start + width)
            start += width
            shard = _Shard(
                layer.weight.data[rows].contiguous(),
                layer.weight_scale.data[rows].contiguous(),
                gs.clone(),
                self.params_dtype,
            )
            kernel = vllm_w4a16_kernel() if kernels else self.kernel  # one kernel object per shard
            kernel.process_weights_after_loading(shard)
            shards.append(shard)
            kernels.append(kernel)
        device = layer.weight.device
        del layer.weight_scale, layer.weight_scale_2
        empty = torch.empty(0, dtype=torch.uint8, device=device)
        layer.weight = Parameter(empty, requires_grad=False)
        layer.nvfp4_shards = torch.nn.ModuleList(shards)
        self.shard_kernels = kernels

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None):
        if self.shard_kernels is None:
            return self.kernel.apply_weights(layer, x, bias)
        out = torch.cat(
            [k.apply_weights(s, x, None) for k, s in zip(self.shard_kernels, layer.nvfp4_shards)],
            dim=-1,
        )
        return out if bias is None else out + bias
