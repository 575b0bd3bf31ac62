"""The engine environment ``bench`` and ``demo`` set: offline only for local models."""

from __future__ import annotations

from vllm_nemotron_spec import runs


def test_a_hub_model_stays_downloadable_and_local_models_run_offline(monkeypatch, tmp_path):
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(key, raising=False)
    runs.set_cpu_engine_defaults(
        str(tmp_path), "nvidia/NVIDIA-Nemotron-3.5-Lightning-30B-A3B-NVFP4"
    )
    import os

    assert "HF_HUB_OFFLINE" not in os.environ and "TRANSFORMERS_OFFLINE" not in os.environ
    runs.set_cpu_engine_defaults(str(tmp_path), None)
    assert os.environ["HF_HUB_OFFLINE"] == "1" and os.environ["TRANSFORMERS_OFFLINE"] == "1"
