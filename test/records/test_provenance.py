"""torchtitan/records/provenance.py: the checks over a run's provenance records (every token read
exactly once, every document of a finished pass read whole), each shown to see what it
must: duplicates, holes, a replayed step, a skipped or partly read document."""

from __future__ import annotations

import json

from helpers import doc_tokens, loaders

from torchtitan.records.provenance import check_complete, check_exactly_once, read_job_provenance


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


def _life(folder, lines: dict, tried: list, events: list):
    """A fault-tolerant life's records: provenance lines {step: sequences}, tries and
    fault_tolerance.jsonl events, as the loop and ReplicaGroup write them."""
    (folder / "provenance").mkdir(parents=True)
    (folder / "provenance" / "rank0.jsonl").write_text(
        "".join(json.dumps({"step": s, "sequences": q}) + "\n" for s, q in lines.items())
    )
    (folder / "provenance" / "tried_rank0.jsonl").write_text(
        "".join(
            json.dumps(
                {"step": s, "quorum": q, "participant": p, "participants": 2, "sequences": seqs}
            )
            + "\n"
            for s, q, p, seqs in tried
        )  # fmt: skip
    )
    (folder / "fault_tolerance.jsonl").write_text(
        "".join(json.dumps({"step": s, "quorum": q, "committed": ok}) + "\n" for s, q, ok in events)
    )
    return str(folder)


def test_a_dead_groups_share_counts_where_a_peer_committed_its_quorum(tmp_path):
    """Group 1 tried step 2 in quorum 7 and died after its all-reduce (no line of its
    own); group 0 committed step 2 in quorum 7: group 1's share counts. Controls: group
    1's try of step 3 in quorum 8, which nobody committed (group 0 tried again alone in
    quorum 9), does not; nor a try whose step the life recorded itself (step 1), twice;
    nor a torn last line."""
    a, b, c, d, e = ([["src", doc, 0, 4, 0, 0]] for doc in "abcde")
    g0 = _life(tmp_path / "g0", {1: [a], 2: [c], 3: [e]},
               [(1, 7, 0, [a]), (2, 7, 0, [c]), (3, 8, 0, [e]), (3, 9, 0, [e])],
               [(1, 7, True), (2, 7, True), (3, 8, False), (3, 9, True)])  # fmt: skip
    g1 = _life(tmp_path / "g1", {1: [b]}, [(1, 7, 1, [b]), (2, 7, 1, [d]), (3, 8, 1, [e])],
               [(1, 7, True)])  # fmt: skip
    with open(tmp_path / "g1" / "provenance" / "tried_rank0.jsonl", "a") as f:
        f.write(json.dumps({"step": 4, "quorum": 9, "sequences": [a]})[:-3])  # torn
    job = read_job_provenance([g0, g1])
    assert job == {(0, 0): {1: [a], 2: [c], 3: [e]}, (1, 0): {1: [b], 2: [d]}}
    assert check_exactly_once(job)["src"].duplicate_tokens == 0
    # without the peers' record of the commit, the dead share is not the job's
    (tmp_path / "g0" / "fault_tolerance.jsonl").write_text("")
    assert read_job_provenance([g0, g1])[(1, 0)] == {1: [b]}


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


def test_a_rewind_trims_skips_jsonl_on_its_one_writer_only(tmp_path):
    """Every data-parallel rank's ProvenanceWriter moves its own lines aside on a rewind;
    skips.jsonl, beside them, is rank 0's alone (it writes the skips): only rank 0 trims
    it. Negative control (the campaign's trial 700041: three ranks trimming it at once
    crossed their renames of skips.jsonl.tmp, a rank failed with FileNotFoundError): a
    second rank's rewind leaves the file as it was, and rank 0's trims it."""
    from torchtitan.records.metrics import SKIPS, ProvenanceWriter

    folder = tmp_path / "provenance"
    main = ProvenanceWriter(str(folder), 0, 0, True)
    other = ProvenanceWriter(str(folder), 1, 0, False)
    lines = [{"step": 5, "first": 3, "count": 2}, {"step": 9, "first": 7, "count": 3}]
    skips = folder / SKIPS
    skips.write_text("".join(json.dumps(x) + "\n" for x in lines))
    for writer, step in ((main, 4), (main, 8), (other, 4), (other, 8)):
        writer.write(step, [["bundled", "doc", 0, 32, 0, 1]])
    before = skips.read_text()
    other.rewind(6, 1)
    assert skips.read_text() == before
    assert [json.loads(x)["step"] for x in (folder / "rank1.jsonl").read_text().splitlines()] == [4]
    main.rewind(6, 1)
    assert [json.loads(x)["step"] for x in skips.read_text().splitlines()] == [5]
    assert [json.loads(x)["step"] for x in (folder / "rank0.jsonl").read_text().splitlines()] == [4]


def test_a_start_keeps_only_its_timelines_records_a_peers_branch_included(tmp_path):
    """Replica groups relaunched (the campaign's trial 920007): group 0's first life wrote
    steps 1-5 (branch R); group 1, up first in the relaunch, loaded step-3 and trained 4-6
    alone (branch X), saving step-6; group 0 then loads that step-6. Its own lines of
    steps 4-5 are of R, the branch the job left at step 3: the start drops them and keeps
    1-3. Negative control (a start that trims by step alone, as before lineages): 4-5
    stay, and the job's records read steps 4-5 twice. A line without a branch (records
    from before lineages) is kept."""
    from torchtitan.checkpoint import TrainState
    from torchtitan.records.metrics import ProvenanceWriter, on_lineage

    life1 = TrainState()
    life1.branch()  # a start from step 0
    root = life1.current_branch
    group1 = TrainState(step=3, lineage=[list(s) for s in life1.lineage])
    group1.branch()  # relaunched from step-3
    x = group1.current_branch
    group1.step = 6  # ... its step-6, as group 0 loads it
    group0 = TrainState()
    group0.load_state_dict(group1.state_dict())
    group0.branch()
    assert [s[0] for s in group0.lineage] == [root, x, group0.current_branch]
    assert on_lineage(group0.lineage, root, 3) and not on_lineage(group0.lineage, root, 4)
    assert on_lineage(group0.lineage, x, 6) and on_lineage(group0.lineage, None, 5)

    def records(folder, lineage):
        folder.mkdir(parents=True)
        lines = [{"step": s, "sequences": [], "branch": root} for s in range(1, 6)]
        (folder / "rank0.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        ProvenanceWriter(str(folder), 0, 6, True, lineage)
        return [json.loads(x)["step"] for x in (folder / "rank0.jsonl").read_text().splitlines()]

    assert records(tmp_path / "lineage", group0.lineage) == [1, 2, 3]
    assert records(tmp_path / "by-step", None) == [1, 2, 3, 4, 5]


def test_the_same_start_is_the_same_branch_and_an_old_checkpoint_has_no_lineage():
    """Groups that start from the same state compute the same branch (the id is a digest
    of the lineage and the step), another step another one; a checkpoint from before
    lineages holds no entry for it and loads with none (every record kept)."""
    from torchtitan.checkpoint import TrainState
    from torchtitan.checkpoint.stateful import Saved

    a, b, c = TrainState(step=4), TrainState(step=4), TrainState(step=5)
    for s in (a, b, c):
        s.branch()
    assert a.lineage == b.lineage and a.current_branch != c.current_branch
    old = Saved("step-4", {}, {"step": None, "tokens_seen": None})
    assert set(TrainState().load_targets(old)) == {"step", "tokens_seen"}
    loaded = TrainState(lineage=[["x", 1]])
    loaded.load_state_dict({"step": 4, "tokens_seen": 8})
    assert loaded.lineage == [] and loaded.step == 4


def test_a_replica_groups_old_layout_files_wait_for_its_first_commit(tmp_path):
    """A replica group relaunched with 1 data-parallel rank where its last life had 2:
    both ranks' files hold steps 1-4 of branch R. It starts at step 0 (no checkpoint in
    sight) and heals to step 3 of R before its first commit: at the start nothing is
    trimmed, at the commit of step 4 every file keeps steps 1-3 (the old layout's rank 1
    included) and drops R's step 4, which the group trains again. Catches rank 1's file
    trimmed to the start (step 0) while the group's own file waited."""
    from torchtitan.records.metrics import ProvenanceWriter

    lines = [{"step": s, "sequences": [], "branch": "R"} for s in range(1, 5)]
    for rank in (0, 1):
        (tmp_path / f"rank{rank}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))

    def steps(rank):
        return [
            json.loads(x)["step"] for x in (tmp_path / f"rank{rank}.jsonl").read_text().splitlines()
        ]

    writer = ProvenanceWriter(str(tmp_path), 0, 0, True, [["S", 1]], writers=1)
    assert steps(0) == steps(1) == [1, 2, 3, 4]
    writer.trim_own(4, [["R", 1], ["T", 4]])  # healed to R's step 3; step 4 on T
    assert steps(0) == steps(1) == [1, 2, 3]
