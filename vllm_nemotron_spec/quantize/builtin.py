"""The ``builtin`` engine: the project's reference packer, :func:`vllm_nemotron_spec.nvfp4.format.
quantize` (the same function that writes the tiny family's drafts), one module at a time.

It quantizes the BF16 weight (a source stored in fp32 / fp16 is rounded to BF16 first, as
ModelOpt's export does) with ModelOpt's weight-only recipe: global scale ``amax / (6 * 448)``,
fp8 block scales ``block_amax / 6 / global``, E2M1 codes rounded to nearest, ties to even.
Where its bytes differ from nvidia-modelopt 0.47's export (same dequantized values up to the
sign of zero, except ~0.1% of block scales one fp8 step apart) is documented and tested in
``tests/quantize/test_engines.py`` and docs/bring-your-own-draft.md.
"""

from __future__ import annotations

from vllm_nemotron_spec.checkpoint import layout

NAME = "builtin"


class BuiltinEngine:
    name = NAME
    producer_version = layout.MODELOPT_VERSION  # the ModelOpt export format this packer writes

    def describe(self) -> str:
        return "builtin (vllm_nemotron_spec.nvfp4.format.quantize)"

    def pack(self, tensors: dict, modules: list[str], progress: bool = True) -> dict:
        """``{module}.weight`` / ``.weight_scale`` / ``.weight_scale_2`` for every module of
        ``modules``, from the BF16 ``{module}.weight`` tensors in ``tensors``."""
        import torch
        from tqdm import tqdm

        from vllm_nemotron_spec._torch import torch_threads
        from vllm_nemotron_spec.nvfp4 import format as nvfp4

        out: dict[str, torch.Tensor] = {}
        # One intra-op thread: the packer's elementwise ops gain nothing from more, and on a busy
        # machine two threads ran ~30x slower (the result does not depend on the thread count).
        with torch_threads(1):
            for module in tqdm(
                modules, desc="packing NVFP4 (builtin)", unit="module", disable=not progress
            ):
                weight = tensors[f"{module}.weight"].to(torch.bfloat16).to(torch.float32)
                out.update(nvfp4.quantize(weight).tensors(module))
        return out

    def info(self) -> dict:
        return {"engine": NAME}
