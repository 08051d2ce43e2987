"""The acceptance test: a resumed run continues bit for bit where the first one stopped.

    python scripts/deterministic_resume.py [--steps 30] [--interval 5] [--delete 3]
        [--resume-every | --resume-nproc M] [--section.key value ...]

See ``torchtitan/tools/deterministic_resume.py`` for what is compared. Exit status 0 only on success.
"""

import sys

from torchtitan.tools.deterministic_resume import main

if __name__ == "__main__":
    sys.exit(main())
