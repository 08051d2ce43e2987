"""Reading data provenance back: which tokens of which documents trained which step.

Owns: loading ``<dump_folder>/provenance/rank*.jsonl`` and checking that the
recorded spans cover every document they touch exactly once and without holes
(``check_exactly_once``), and that nothing was skipped (``check_complete``: every
document of a finished pass read whole, at most one partly read document per source
at the stop). Written by ``metrics.ProvenanceWriter``; each line is
``{"step": N, "sequences": [[[source, doc_id, start, end, epoch, unit], ...], ...]}``
with token offsets into the document as tokenized with its BOS/EOS, end exclusive, the
epoch in which the document was read (a document is read once per epoch) and the
unit (of the source's shuffle) that holds it.

Never: write provenance, or read the data itself (callers pass document lengths).
"""

from __future__ import annotations

import glob
import json
import os
from collections import defaultdict
from dataclasses import dataclass, field

from torchtitan.data.order import LANES
from torchtitan.records.runs import read_records


def read_provenance(folder: str) -> dict[int, dict[int, list]]:
    """{rank: {step: sequences}} from a run's provenance folder.

    Strict: a step recorded twice in one rank's file (a resume that did not trim
    it) raises ``RunRecordError`` instead of one record silently replacing the other.
    """
    files = sorted(glob.glob(os.path.join(folder, "rank*.jsonl")))
    if not files:
        raise FileNotFoundError(
            f"no provenance files (rank*.jsonl) in {folder}; run with --metrics.data_provenance"
        )
    out = {}
    for path in files:
        rank = int(os.path.basename(path)[len("rank") : -len(".jsonl")])
        out[rank] = {rec["step"]: rec["sequences"] for rec in read_records(path)}
    return out


def read_job_provenance(folders: list[str]) -> dict[tuple[int, int], dict[int, list]]:
    """{(life, rank): {step: sequences}}: the committed data of a fault-tolerant job whose
    groups' (and restarted groups') dump folders are ``folders``, each a life.

    A life's provenance lines, plus each share it tried (``provenance/tried_rank*.jsonl``,
    written before the cross-group all-reduce) and has no line of that step for: the life
    died after its all-reduce, and its share counts where some life's
    ``fault_tolerance.jsonl`` committed that step in the same quorum (the lighthouse's
    quorum id), since the committing groups' update holds it. A try whose quorum no group
    committed (a step tried again in another quorum) does not count. Cost: one pass over
    the job's provenance and tries; fault_tolerance.jsonl is read per life."""
    committed = set()
    for folder in folders:
        for event in _lines(os.path.join(folder, "fault_tolerance.jsonl")):
            if event.get("committed"):
                committed.add((event["step"], event.get("quorum")))
    out: dict[tuple[int, int], dict[int, list]] = {}
    for life, folder in enumerate(folders):
        own = os.path.join(folder, "provenance")
        kept = read_provenance(own) if glob.glob(os.path.join(own, "rank*.jsonl")) else {}
        for rank, steps in kept.items():
            out[(life, rank)] = dict(steps)
        for path in sorted(glob.glob(os.path.join(own, "tried_rank*.jsonl"))):
            rank = int(os.path.basename(path)[len("tried_rank") : -len(".jsonl")])
            steps = out.setdefault((life, rank), {})
            for tried in _lines(path):
                step = tried["step"]
                if step not in steps and (step, tried["quorum"]) in committed:
                    steps[step] = tried["sequences"]
    return out


def _lines(path: str) -> list[dict]:
    """The complete JSON lines of a file that repeats steps (a step's tries; heals), in
    order; none where it does not exist. A last line without its newline (a process
    killed while writing it) is not one."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def spans_of(provenance: dict[int, dict[int, list]]):
    for steps in provenance.values():
        for sequences in steps.values():
            for spans in sequences:
                yield from spans


def read_rewound(folder: str) -> dict[int, dict[tuple[int, int], list]]:
    """{rank: {(rewind, step): sequences}} of the steps rewinds undid
    (``rewound_rank*.jsonl``, written when a loss spike's rewind moved them aside): the
    documents the run trained on and then skipped. Empty when there was no rewind."""
    out: dict[int, dict] = {}
    for path in sorted(glob.glob(os.path.join(folder, "rewound_rank*.jsonl"))):
        rank = int(os.path.basename(path)[len("rewound_rank") : -len(".jsonl")])
        with open(path) as f:
            records = [json.loads(line) for line in f if line.endswith("\n")]
        out[rank] = {(r["rewind"], r["step"]): r["sequences"] for r in records}
    return out


def read_skips(folder: str) -> list[dict]:
    """The skips a run passed over (``skips.jsonl``): ``{"step", "skip_steps": [first,
    steps], "windows": [lo, hi]}`` each, the data of those steps dropped for the pass."""
    path = os.path.join(folder, "skips.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def documents_of_steps(folder: str, first: int, last: int) -> list[tuple]:
    """``(step, rewind, source, doc_id, start, end)`` of every span that steps
    ``first..last`` read, ranks in order: those the run kept (``rewind`` None) and those
    a rewind undid (``rewind`` its number), so a person can look at what a spike trained
    on. Cost: one pass over the provenance files."""
    rows = []
    kept = read_provenance(folder)
    for rank in sorted(kept):
        for step, sequences in sorted(kept[rank].items()):
            if first <= step <= last:
                rows += [(step, None, *span[:4]) for spans in sequences for span in spans]
    undone = read_rewound(folder)
    for rank in sorted(undone):
        for (rewind, step), sequences in sorted(undone[rank].items()):
            if first <= step <= last:
                rows += [(step, rewind, *span[:4]) for spans in sequences for span in spans]
    return sorted(rows, key=lambda r: (r[0], r[1] or 0))


@dataclass
class SourceReport:
    tokens: int = 0
    duplicate_tokens: int = 0
    gaps: int = 0
    documents: int = 0
    examples: list[str] = field(default_factory=list)


def check_exactly_once(provenance: dict[int, dict[int, list]]) -> dict[str, SourceReport]:
    """Per source: tokens consumed, tokens consumed twice in one epoch, holes inside documents.

    A document may be cut off at the end (training stopped mid-document), but its
    covered tokens must start at 0 and be contiguous.
    """
    intervals: dict[tuple, list[tuple[int, int]]] = defaultdict(list)
    for source, doc_id, start, end, epoch, *_ in spans_of(provenance):
        intervals[(source, doc_id, epoch)].append((start, end))
    reports: dict[str, SourceReport] = defaultdict(SourceReport)
    for (source, doc_id, *_), spans in intervals.items():
        report = reports[source]
        report.documents += 1
        covered = 0
        for start, end in sorted(spans):
            report.tokens += end - start
            if start < covered:
                report.duplicate_tokens += min(end, covered) - start
                _example(report, f"{doc_id}: tokens {start}..{min(end, covered)} seen twice")
            elif start > covered:
                report.gaps += 1
                _example(report, f"{doc_id}: tokens {covered}..{start} never seen")
            covered = max(covered, end)
    return dict(reports)


def _example(report, text: str):
    if len(report.examples) < 5:
        report.examples.append(text)


def sequences_by_step(provenance: dict[int, dict[int, list]]) -> dict[int, list]:
    """{step: all sequences of that step, ranks in order}: the run's data, layout aside."""
    out: dict[int, list] = defaultdict(list)
    for rank in sorted(provenance):
        for step, sequences in provenance[rank].items():
            out[step].extend(sequences)
    return dict(out)


@dataclass
class CompletenessReport:
    finished_epochs: list[int] = field(default_factory=list)
    missing: int = 0  # documents not read whole in a finished epoch
    partial: int = 0  # partly read documents beyond the one a stopped stream may hold
    examples: list[str] = field(default_factory=list)


def check_complete(
    provenance: dict[int, dict[int, list]], lengths: dict[str, dict[str, int]]
) -> dict[str, CompletenessReport]:
    """Per source: nothing skipped.

    ``lengths`` holds, per source, the token count (BOS/EOS included) of every usable
    document. A source is read as one stream, pass after pass, so every pass before
    its newest is finished, and in it every document must have been read whole. At most
    one document per lane (each lane stops inside one: order.LANES) may be partly read,
    and only in the newest pass. Cost: O(spans + documents).
    """
    covered: dict[tuple, int] = defaultdict(int)  # (source, epoch, doc) -> tokens
    last_epoch: dict[str, int] = {}
    for source, doc_id, start, end, epoch, *_ in spans_of(provenance):
        covered[(source, epoch, doc_id)] += end - start
        last_epoch[source] = max(last_epoch.get(source, 0), epoch)
    reports: dict[str, CompletenessReport] = {}
    for source, docs in lengths.items():
        report = reports[source] = CompletenessReport()
        newest = last_epoch.get(source, 0)
        report.finished_epochs = list(range(newest))
        whole: dict[int, set] = defaultdict(set)
        partial: dict[int, list] = defaultdict(list)
        for (src, epoch, doc_id), tokens in covered.items():
            if src != source:
                continue
            if tokens >= docs.get(doc_id, 0):
                whole[epoch].add(doc_id)
            else:
                partial[epoch].append(doc_id)
        for epoch in report.finished_epochs:
            for doc_id in sorted(set(docs) - whole[epoch]):
                report.missing += 1
                _example(report, f"{doc_id}: not read whole in finished pass {epoch}")
        for epoch, doc_ids in sorted(partial.items()):
            for doc_id in doc_ids[LANES if epoch == newest else 0 :]:
                report.partial += 1
                _example(report, f"{doc_id}: partly read in pass {epoch}")
    return reports
