"""Check a run's data provenance: every token consumed at most once, no holes in documents.

    python scripts/check_provenance.py outputs/debug/provenance

Prints per source the tokens consumed, tokens consumed twice within one epoch (a
document is read once per epoch) and gaps inside
documents; exits 1 on any duplicate or gap. Resumed runs are fine: the trainer
drops the provenance lines of steps that a resume re-ran.
"""

from __future__ import annotations

import argparse
import sys

from torchtitan.provenance import check_exactly_once, read_provenance


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("folder", help="provenance folder (<dump_folder>/provenance)")
    args = parser.parse_args(argv)
    provenance = read_provenance(args.folder)
    reports = check_exactly_once(provenance)
    steps = {s for per_rank in provenance.values() for s in per_rank}
    print(f"{len(provenance)} rank files, steps {min(steps)}..{max(steps)}")
    print(f"{'source':<28}{'doc reads':>10}{'tokens':>12}{'twice':>10}{'gaps':>8}")
    bad = False
    for source, r in sorted(reports.items()):
        print(f"{source:<28}{r.documents:>10}{r.tokens:>12}{r.duplicate_tokens:>10}{r.gaps:>8}")
        for example in r.examples:
            print(f"    {example}")
        bad |= bool(r.duplicate_tokens or r.gaps)
    print("FAIL: duplicates or gaps" if bad else "OK: every token consumed exactly once, no gaps")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
