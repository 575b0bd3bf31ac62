"""The benchmarks' one entry point: ``python3 benchmarks/run.py SCENARIO --out DIR [--smoke]``.

Scenarios: speed, serving, anchor, nvfp4-linear, draft-breakdown, tp, mamba-metadata
(``--help`` on each); ``models`` builds the Lightning models, ``caches`` packs or restores the
start-up caches.
"""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.harness.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
