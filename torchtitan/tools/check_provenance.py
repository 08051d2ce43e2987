"""Check a run's data provenance: every token at most once, no holes, nothing skipped.

    python scripts/check_provenance.py <dump_folder>/provenance [--job.config_file X.toml --section.key value ...]
    python scripts/check_provenance.py <dump_folder>/provenance --steps 120-140

With ``--steps first-last``: the documents those steps read, with their token ranges,
including steps a loss spike's rewind undid (marked ``rewound #n``): what a spike
trained on, to look at. Nothing is checked then.

Per source: tokens consumed, tokens consumed twice within one epoch, gaps inside
documents. Given the run's config (the same ``--section.key`` arguments as training),
it also reads every document with the run's tokenizer and proves completeness: every
document of a finished pass was read whole, and each source holds at most one partly
read document, at the stop. Exit status 1 on any failure. Resumed runs are
fine: the trainer drops the provenance lines of steps that a resume re-ran.
"""

from __future__ import annotations

import argparse

from torchtitan.records.provenance import (
    check_complete,
    check_exactly_once,
    documents_of_steps,
    read_provenance,
    read_skips,
)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="check_provenance.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("folder", help="provenance folder (<dump_folder>/provenance)")
    parser.add_argument("--steps", help="list the documents of these steps (first-last)")
    args, config_args = parser.parse_known_args(argv)
    if args.steps:
        return list_documents(args.folder, args.steps)
    provenance = read_provenance(args.folder)
    steps = {s for per_rank in provenance.values() for s in per_rank}
    print(f"{len(provenance)} rank files, steps {min(steps)}..{max(steps)}")
    print(f"{'source':<28}{'doc reads':>10}{'tokens':>12}{'twice':>10}{'gaps':>8}")
    bad = False
    for source, r in sorted(check_exactly_once(provenance).items()):
        print(f"{source:<28}{r.documents:>10}{r.tokens:>12}{r.duplicate_tokens:>10}{r.gaps:>8}")
        for example in r.examples:
            print(f"    {example}")
        bad |= bool(r.duplicate_tokens or r.gaps)
    if config_args:
        bad |= not _completeness(provenance, config_args)
    else:
        print("completeness not checked: pass the run's config (--job.config_file ...)")
    print("FAIL" if bad else "OK: every token consumed exactly once, no gaps, nothing skipped")
    return 1 if bad else 0


def list_documents(folder: str, steps: str) -> int:
    first, _, last = steps.partition("-")
    first, last = int(first), int(last or first)
    rows = documents_of_steps(folder, first, last)
    for skip in read_skips(folder):
        lo, hi = skip["windows"]
        if "skip_steps" not in skip:  # training.skip_windows: at the step that reached it
            if first <= skip["step"] <= last:
                print(f"skipped: windows {lo}-{hi - 1}, passed over in step {skip['step']}; "
                      "never read")  # fmt: skip
            continue
        a, n = skip["skip_steps"]
        if a <= last and a + n - 1 >= first:
            print(f"skipped: the data of steps {a}-{a + n - 1} (windows {lo}-{hi - 1}), passed "
                  f"over before step {skip['step']}; never read")  # fmt: skip
    if not rows:
        print(f"no provenance of steps {steps} in {folder}")
        return 1
    for step, rewind, source, doc_id, start, end in rows:
        undone = f"  (rewound #{rewind})" if rewind is not None else ""
        print(f"step {step:>6}  {source}:{doc_id}  tokens {start}-{end}{undone}")
    return 0


def _completeness(provenance, config_args: list[str]) -> bool:
    from torchtitan.config import parse_args
    from torchtitan.data import document_lengths
    from torchtitan.data.tokenizer import build_tokenizer

    cfg = parse_args(config_args)
    lengths = document_lengths(cfg, build_tokenizer(cfg.model))
    reports = check_complete(provenance, lengths)
    print(f"{'source':<28}{'documents':>10}{'finished epochs':>17}{'missing':>9}{'partial':>9}")
    ok = True
    for source, r in sorted(reports.items()):
        print(f"{source:<28}{len(lengths[source]):>10}{len(r.finished_epochs):>17}"
              f"{r.missing:>9}{r.partial:>9}")  # fmt: skip
        for example in r.examples:
            print(f"    {example}")
        ok &= not (r.missing or r.partial)
    return ok
