"""The engine environment ``bench`` and ``demo`` set: offline only for local models."""

from __future__ import annotations

from vllm_nemotron_spec import runs


def test_a_hub_model_stays_downloadable_and_local_models_run_offline(monkeypatch, tmp_path):
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(key, raising=False)
    runs.set_engine_defaults(str(tmp_path), "nvidia/NVIDIA-Nemotron-3.5-Lightning-30B-A3B-NVFP4")
    import os

    assert "HF_HUB_OFFLINE" not in os.environ and "TRANSFORMERS_OFFLINE" not in os.environ
    runs.set_engine_defaults(str(tmp_path), None)
    assert os.environ["HF_HUB_OFFLINE"] == "1" and os.environ["TRANSFORMERS_OFFLINE"] == "1"


def test_the_engine_runs_in_process_on_cpu_and_in_its_own_process_on_a_gpu(monkeypatch):
    """On a GPU the engine core keeps vLLM's own process, as served (a released in-process
    engine would also keep its weights held)."""
    import os

    from vllm.platforms import current_platform

    for is_cpu in (False, True):
        for key in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE"):
            monkeypatch.delenv(key, raising=False)
        monkeypatch.setattr(type(current_platform), "is_cpu", lambda self, c=is_cpu: c)
        runs.set_engine_defaults()
        expected = ("0", "1") if is_cpu else (None, None)
        assert (
            os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING"),
            os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
        ) == expected
