"""Draw a mixture-of-experts run's expert load over steps, a heatmap per layer.

    python scripts/plot_expert_load.py RUN_FOLDER [--out FILE.png]

See ``torchtitan/tools/plot_expert_load.py``.
"""

import sys

from torchtitan.tools.plot_expert_load import main

if __name__ == "__main__":
    sys.exit(main())
