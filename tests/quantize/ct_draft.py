"""A tiny draft quantized to NVFP4 weight-only (``nvfp4-pack-quantized``) WITH the compressed-tensors
library, the way llm-compressor's NVFP4A16 recipe does it (llm-compressor itself is not installed
here; it drives exactly these compressed-tensors calls):

1. the draft's tensors go into a module tree with the checkpoint's names (``nn.Linear`` for the
   linears, ``nn.Embedding`` for ``embed_tokens`` / ``markov_w1``);
2. ``apply_quantization_config`` attaches the ``NVFP4A16`` preset scheme (targets ``Linear``) and
   initialises ``weight_scale`` / ``weight_global_scale`` on every targeted module; the ignore list
   is the Nemotron 3.5 layout's BF16 linears (attention projections, lm_head);
3. qparams as llm-compressor's min-max weight observer computes them: the global scale
   ``generate_gparam(min, max)`` of the whole weight (``448 * 6 / amax``: the RECIPROCAL of
   ModelOpt's ``weight_scale_2``), gate_proj / up_proj of a layer sharing the smaller one (as
   llm-compressor fuses the global scales of linears vLLM fuses), then the fp8 group scales
   ``calculate_qparams(group min, group max, args, global_scale)``;
4. ``ModelCompressor.from_pretrained_model(model, "nvfp4-pack-quantized").compress_model`` packs
   them (``weight_packed`` uint8, ``weight_scale`` fp8, ``weight_global_scale`` fp32) and
   ``update_config`` writes the ``quantization_config`` into config.json.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from torch import nn

CT_FORMAT = "nvfp4-pack-quantized"


def _module_tree(tensors: dict) -> nn.Module:
    root = nn.Module()
    for name, tensor in sorted(tensors.items()):
        module_name, _, leaf = name.rpartition(".")
        parent = root
        parts = module_name.split(".") if module_name else []
        for i, part in enumerate(parts):
            child = getattr(parent, part, None)
            if not isinstance(child, nn.Module):
                if i == len(parts) - 1 and leaf == "weight" and tensor.dim() == 2:
                    if part in ("embed_tokens", "markov_w1"):
                        child = nn.Embedding(*tensor.shape)
                    else:
                        child = nn.Linear(tensor.shape[1], tensor.shape[0], bias=False)
                else:
                    child = nn.Module()
                parent.add_module(part, child)
            parent = child
        param = nn.Parameter(tensor.detach().to(torch.bfloat16).clone(), requires_grad=False)
        if isinstance(parent, (nn.Linear, nn.Embedding)) and leaf == "weight":
            parent.weight = param
        else:
            parent.register_parameter(leaf, param)
    return root


def build_ct_draft(
    bf16_draft: str | Path, outdir: str | Path, *, fuse_gate_up: bool = True
) -> Path:
    """Quantize the BF16 draft at ``bf16_draft`` into ``outdir`` with compressed-tensors (module
    doc)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam
    from safetensors.torch import load_file, save_file

    from vllm_nemotron_spec.checkpoint.layout import is_nvfp4_module

    bf16_draft, outdir = Path(bf16_draft), Path(outdir)
    tensors = load_file(str(bf16_draft / "model.safetensors"))
    model = _module_tree(tensors)
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    ignored = sorted(n for n in linears if not is_nvfp4_module(n))
    scheme: QuantizationScheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    config = QuantizationConfig(
        config_groups={"group_0": scheme},
        ignore=ignored,
        quantization_status=QuantizationStatus.INITIALIZED,
    )
    apply_quantization_config(model, config)
    quantized = {n: m for n, m in model.named_modules() if hasattr(m, "quantization_scheme")}
    assert sorted(quantized) == sorted(n for n in linears if is_nvfp4_module(n)), sorted(quantized)

    with torch.no_grad():
        for module in quantized.values():
            w = module.weight.float()
            module.weight_global_scale.data.copy_(generate_gparam(w.min(), w.max()))
        if fuse_gate_up:
            for name, module in quantized.items():
                if name.endswith("mlp.gate_proj"):
                    up = quantized[name[: -len("gate_proj")] + "up_proj"]
                    shared = torch.min(module.weight_global_scale, up.weight_global_scale)
                    module.weight_global_scale.data.copy_(shared)
                    up.weight_global_scale.data.copy_(shared)
        for module in quantized.values():
            args = module.quantization_scheme.weights
            groups = module.weight.float().unflatten(-1, (-1, args.group_size))
            scale, _ = calculate_qparams(
                groups.amin(-1), groups.amax(-1), args, global_scale=module.weight_global_scale
            )
            module.weight_scale.data.copy_(scale.to(module.weight_scale.dtype))

    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=CT_FORMAT)
    compressor.compress_model(model)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    state = {k: v for k, v in state.items() if not k.endswith("weight_zero_point")}

    outdir.mkdir(parents=True, exist_ok=True)
    save_file(state, str(outdir / "model.safetensors"), metadata={"format": "pt"})
    for f in bf16_draft.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy2(f, outdir / f.name)
    compressor.update_config(str(outdir))
    return outdir
