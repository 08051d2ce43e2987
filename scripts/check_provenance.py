"""Check a run's data provenance: every token at most once, no holes, nothing skipped.

    python scripts/check_provenance.py <dump_folder>/provenance [--job.config_file X.toml --section.key value ...]

See ``torchtitan/tools/check_provenance.py``. Exit status 1 on any failure.
"""

import sys

from torchtitan.tools.check_provenance import main

if __name__ == "__main__":
    sys.exit(main())
