"""Puts the repository's root first on ``sys.path``: every benchmark imports this module
before anything of the repository's, so that ``harness`` is importable and the
``torchtitan`` measured is this checkout's, not whichever one is installed.

A script run as ``python scripts/benchmarks/bench_x.py`` has only its own folder on the
path; this is the one place that adds the root.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if sys.path[:1] != [str(ROOT)]:
    sys.path.insert(0, str(ROOT))
