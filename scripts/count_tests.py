"""Count the tests of each tier from pytest's collection and write them into docs/testing.md.

    python scripts/count_tests.py          # print the counts and update the page
    python scripts/count_tests.py --check  # exit 1 if the page's counts are not these

test/test_docs.py checks the page against the collection on every run of the suite.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # harness/ is not installed
from harness import tiers  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="compare only; write nothing")
    args = p.parse_args(argv)
    counts = tiers.collected()
    print(f"fast {counts['fast']} (cuda {counts['cuda']})  slow {counts['slow']}")
    if args.check:
        stated = tiers.stated(tiers.PAGE.read_text())
        if stated != counts:
            print(f"docs/testing.md says {stated}: run python scripts/count_tests.py")
            return 1
        return 0
    if tiers.write(counts):
        print(f"wrote {tiers.PAGE.relative_to(tiers.REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
