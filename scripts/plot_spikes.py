"""Draw a run's loss with its spikes, rewinds and skipped data.

    python scripts/plot_spikes.py RUN_FOLDER [--out FILE.png]

See ``torchtitan/tools/plot_spikes.py``.
"""

import sys

from torchtitan.tools.plot_spikes import main

if __name__ == "__main__":
    sys.exit(main())
