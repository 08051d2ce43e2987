"""Draw a run's mix: each source's share of tokens against its weights, and its passes.

    python scripts/plot_mix.py RUN_FOLDER [--out FILE.png] [--window STEPS]

See ``torchtitan/tools/plot_mix.py``.
"""

import sys

from torchtitan.tools.plot_mix import main

if __name__ == "__main__":
    sys.exit(main())
