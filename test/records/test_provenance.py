"""torchtitan/records/provenance.py: the checks over a run's provenance records (every token read
exactly once, every document of a finished pass read whole), each shown to see what it
must: duplicates, holes, a replayed step, a skipped or partly read document."""

from __future__ import annotations

from helpers import doc_tokens, loaders

from torchtitan.records.provenance import check_complete, check_exactly_once


def test_exactly_once_check_sees_duplicates_and_holes():
    def report(*spans):
        seqs = [[["src", doc, a, b, e, 0]] for doc, a, b, e in spans]
        return check_exactly_once({0: {1: seqs}})["src"]

    fine = report(("d", 0, 10, 0), ("d", 10, 25, 0), ("d", 0, 5, 1))  # a new pass reads again
    assert (fine.duplicate_tokens, fine.gaps, fine.tokens) == (0, 0, 30)
    assert report(("d", 0, 10, 0), ("d", 6, 12, 0)).duplicate_tokens == 4
    assert report(("d", 0, 10, 0), ("d", 12, 20, 0)).gaps == 1
    assert report(("d", 3, 10, 0)).gaps == 1, "a document must be read from its start"


def test_exactly_once_check_counts_a_replayed_step():
    """A step trained twice repeats its spans exactly: every token of them is a duplicate
    (a checker keeping a set of spans would see each once and report nothing)."""
    step = [[["src", "a", 0, 10, 0, 0], ["src", "b", 0, 6, 0, 1]], [["src", "a", 10, 16, 0, 0]]]
    later = [[["src", "a", 16, 20, 0, 0]]]
    replayed = check_exactly_once({0: {1: step, 2: later, 3: step}})["src"]
    assert (replayed.duplicate_tokens, replayed.gaps, replayed.tokens) == (22, 0, 48)
    two_ranks = check_exactly_once({0: {1: step}, 1: {1: step}})["src"]
    assert (two_ranks.duplicate_tokens, two_ranks.gaps) == (22, 0)


def test_completeness_check_sees_a_skipped_document(tiny_corpus, tokenizer):
    """Two ranks read several passes; check_complete finds every document of every
    finished pass read whole. Negative controls: a document dropped from one pass, and a
    second partly read document, are each reported."""
    lengths = {"shakespeare": {k: len(v) for k, v in doc_tokens(tiny_corpus, tokenizer).items()}}
    ranks = loaders(tiny_corpus, tokenizer, 2, global_batch_size=6)
    provenance = {0: {}, 1: {}}
    for step in range(20):
        for r, loader in enumerate(ranks):
            provenance[r][step] = [s for b in loader.next_step() for s in b["spans"]]
    report = check_complete(provenance, lengths)["shakespeare"]
    assert len(report.finished_epochs) >= 2 and (report.missing, report.partial) == (0, 0)

    doc = provenance[0][0][0][0][1]
    dropped = {r: {k: [[sp for sp in seq if not (sp[1] == doc and sp[4] == 0)] for seq in v]
                   for k, v in steps.items()} for r, steps in provenance.items()}  # fmt: skip
    assert check_complete(dropped, lengths)["shakespeare"].missing >= 1
    cut = {r: {k: [[sp if sp[2] > 0 or sp[1] != doc else [*sp[:3], 1, *sp[4:]] for sp in seq]
               for seq in v] for k, v in steps.items()} for r, steps in provenance.items()}  # fmt: skip
    assert check_complete(cut, lengths)["shakespeare"].partial >= 1
