"""Apply each one-line mutant kept beside the code (``# mutant name: `old` -> `new`; tests``)
to a copy of the tree and run the fast tests it names: caught or survived.

    python scripts/mutants.py              # all of them; exit 1 if one survives
    python scripts/mutants.py --list       # what they are
    python scripts/mutants.py NAME [NAME]  # only these

The slow tier runs them all (test/test_mutants.py); harness/mutants.py says how.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # harness/ is not installed
from harness import mutants  # noqa: E402

if __name__ == "__main__":
    sys.exit(mutants.main())
