"""The benchmark harness (``harness/``) and its scenarios (``scenarios/``); run them with
``python3 benchmarks/run.py``."""
