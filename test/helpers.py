"""What tests share: corpora written from the bundled text, ways to run training, records
read back, the data loaders as a job builds them, and the checks several test files make.

Owns the one definition of each helper; test modules import from here (``from helpers
import ...``, importable from every folder of ``test/``), never from each other, and
conftest.py holds only fixtures and the guards. Never: a fixture, or a test.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import multiprocessing
import multiprocessing.context
import os
import subprocess
from collections import defaultdict
from pathlib import Path

import torch

import train as train_script
from harness.corpus import write_jsonl, write_parquet  # noqa: F401 - re-exported for the tests
from harness.jobs import torchrun as _torchrun
from torchtitan import REPO_ROOT
from torchtitan.config import parse_args
from torchtitan.data import build_dataloader, local_plan
from torchtitan.data.hub import import_datasets
from torchtitan.data.sources import resolve_source
from torchtitan.data.state import from_tensor, to_tensor
from torchtitan.records.provenance import check_exactly_once, read_provenance
from torchtitan.records.runs import losses as losses  # noqa: PLC0414 - re-exported for the tests
from torchtitan.records.runs import read_records
from torchtitan.tools.launch import DEBUG_CONFIG

REPO = REPO_ROOT  # the repository's root, wherever the test file lies under test/
CONFIG = ["--job.config_file", DEBUG_CONFIG]


# ---- corpora ----------------------------------------------------------------------------


def bundled_documents(source: str, count: int, max_chars: int = 1200) -> list[dict]:
    """Real documents from the bundled corpus, shortened so tests cross many boundaries."""
    datasets = import_datasets()
    files = resolve_source(name=source).files
    ds = datasets.load_dataset("parquet", data_files=files, split="train")
    return [
        {"id": ds[i]["id"], "text": ds[i]["text"][: 200 + (i * 97) % max_chars]}
        for i in range(count)
    ]


def heavy_tailed_documents(count: int, seed: int = 0) -> list[dict]:
    """``count`` documents of real text (KJV and Shakespeare) whose lengths are heavy-tailed
    like a web corpus's: log-normal characters, median ~500, from 60 to ~12,000."""
    import numpy as np

    text = "\n".join(
        d["text"] for s in ("kjv", "shakespeare") for d in bundled_documents(s, 40, 30000)
    )
    rng = np.random.default_rng(seed)
    sizes = np.clip(rng.lognormal(np.log(500), 1.1, count), 60, 12000).astype(int)
    starts = rng.integers(0, len(text) - 12001, count)
    return [
        {"id": f"h{i:04d}", "text": text[a : a + n]} for i, (a, n) in enumerate(zip(starts, sizes))
    ]


def write_jsonl_file(path: Path, rows: list[dict] | None = None, raw: bytes | None = None) -> Path:
    """One file at ``path``: ``rows`` as JSON lines, or the bytes ``raw`` as they are (bad
    data); returns its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if raw is not None:
        path.write_bytes(raw)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path.parent


GOOD_DOCUMENTS = [{"id": f"g{i}", "text": f"Good document number {i}.\n" * 4} for i in range(4)]


# ---- runs -------------------------------------------------------------------------------


def campaign_seed() -> int:
    """The seed of a campaign's trials in this run: TORCHTITAN_CAMPAIGN_SEED if set (to
    replay a failure), else today's date as a day number, so that CI draws other moments
    and pairings each day while one run stays short (a failure prints its seed)."""
    return int(os.environ.get("TORCHTITAN_CAMPAIGN_SEED", datetime.date.today().toordinal()))


def torchrun(
    args: list, nproc: int = 2, timeout: int = 300, script: str = "train.py"
) -> subprocess.CompletedProcess:
    """Launch a real multi-process job; returns the finished process (check returncode)."""
    return _torchrun(nproc, list(args), script=script, timeout=timeout)


def shim_env(folder: Path, code: str, **env: str) -> dict:
    """The environment of a launched job whose every interpreter runs ``code`` first (a
    ``sitecustomize`` module in ``folder``): a probe wrapped around the real code, to
    count or slow it, never a stand-in for it."""
    import os

    from torchtitan.tools.launch import run_env

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(code)
    return {**run_env(), "PYTHONPATH": os.pathsep.join([str(folder), str(REPO)]), **env}


def train(dump, *extra, nproc=2, expect_ok=True) -> subprocess.CompletedProcess:
    """The debug config as a real ``nproc``-rank torchrun job."""
    proc = torchrun([*CONFIG, "--job.dump_folder", str(dump), *map(str, extra)], nproc=nproc)
    if expect_ok:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def run_main(argv: list) -> tuple[int, str]:
    """``train.main(argv)`` in this process: (exit status, what it wrote to stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            status = train_script.main([str(a) for a in argv])
        except SystemExit as e:  # config errors exit before anything is built
            status = e.code
    return status, err.getvalue()


def train_here(dump, *extra, expect_ok=True) -> tuple[int, str]:
    """The debug config as one in-process rank (no interpreter start-up)."""
    status, log = run_main([*CONFIG, "--job.dump_folder", dump, *extra])
    if expect_ok:
        assert status == 0, log[-4000:]
    return status, log


def process_alive(pid: int) -> bool:
    """Running, not a zombie (an orphan's zombie waits on whoever adopted it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def child_pids(pid: int) -> list[int]:
    """The pids of a live process's children (Linux: /proc)."""
    return [int(c) for task in Path(f"/proc/{pid}/task").glob("*")
            for c in (task / "children").read_text().split()]  # fmt: skip


# ---- ranks in processes of their own ----------------------------------------------------

# What the ranks' targets import, loaded once into the forkserver (not once per rank).
RANK_PRELOAD = ["helpers", "torch._dynamo"]


class _RankProcess(multiprocessing.context.ForkServerProcess):
    """A rank forked from the forkserver, which runs with the environment of the test
    that started it, not the server's (that of whichever test started the server)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._environ = dict(os.environ)

    def run(self):
        os.environ.clear()
        os.environ.update(self._environ)
        super().run()


class _RankContext(multiprocessing.context.ForkServerContext):
    Process = _RankProcess


def rank_context() -> multiprocessing.context.BaseContext:
    """The multiprocessing context for a test's ranks (its ``Process`` and ``Queue``):
    each rank is forked from multiprocessing's forkserver, a process with one thread that
    has imported ``RANK_PRELOAD``, never from the xdist worker. The worker holds the
    threads of the tests it ran before (fsspec's loop, the tokenizer's pool, a lighthouse's
    runtime: 10-30 of them); a rank forked from it could inherit a lock one of them held,
    and hang or crash (CI: a forked DDP rank hung in ``test_ddp_buckets``). A target is
    found by its module's name, so it lies at the top of a test module; the rank sees the
    test's environment, but not what the test patched in this process."""
    multiprocessing.set_forkserver_preload(RANK_PRELOAD)
    return _RankContext()


def rank_results(out, ranks: list, timeout: float = 600) -> list:
    """One result from ``out`` per rank in ``ranks``, then each rank joined with exit
    status 0. Waits as long as the ranks live (up to ``timeout``: a busy machine's bound,
    not a quiet one's); a rank that ends without its result fails at once, naming its exit
    status, rather than at a timeout sized for a quiet machine."""
    import queue
    import time

    results, deadline = [], time.monotonic() + timeout
    while len(results) < len(ranks):
        try:
            results.append(out.get(timeout=1))
        except queue.Empty:
            died = [(r, p.exitcode) for r, p in enumerate(ranks) if p.exitcode not in (None, 0)]
            assert not died, f"rank(s) ended without a result: (rank, exit status) {died}"
            assert time.monotonic() < deadline, f"{len(results)} of {len(ranks)} in {timeout} s"
    for r, p in enumerate(ranks):
        p.join(timeout=timeout)
        assert p.exitcode == 0, (r, p.exitcode)
    return results


def start_rank_server() -> None:
    """Start the forkserver and wait until it serves (it imports ``RANK_PRELOAD``: a few
    CPU-seconds alone, over 60 s beside two CPU hogs). conftest calls it before the first
    test of a session that has rank tests, so that a test's time limit never holds the
    server's start-up (the first rank test of a worker failed its 60 s there)."""
    rank = rank_context().Process(target=os.getpid)
    rank.start()
    rank.join()


# ---- records of a run -------------------------------------------------------------------


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "error:" in line]


def read_jsonl(path) -> list[dict]:
    return read_records(path)


def assert_run_read_every_token_once(dump):
    """The provenance records of the run in ``dump`` show no token read twice and no
    document left with a hole (``provenance.check_exactly_once``), for every source."""
    reports = check_exactly_once(read_provenance(str(Path(dump) / "provenance")))
    assert reports and all(r.duplicate_tokens == 0 and r.gaps == 0 for r in reports.values()), (
        reports
    )


# ---- the data loaders, as a job builds them ---------------------------------------------

SEQ = 31  # windows of 32 tokens: documents of a few hundred tokens span many windows


def distinct_parquet(folder: Path, files: int, docs: int, row_group: int,
                     text) -> tuple[Path, dict[str, str]]:  # fmt: skip
    """``files`` parquet files of ``docs`` documents each, ``text(f, i)`` the text of row
    ``i`` of file ``f`` (each distinct, so that a call of the tokenizer names its
    document), ids ``d<f>-<i>``, ``row_group`` rows a group; and the texts by id."""
    texts = {}
    for f in range(files):
        rows = [{"id": f"d{f}-{i}", "text": text(f, i)} for i in range(docs)]
        texts.update((r["id"], r["text"]) for r in rows)
        write_parquet(folder / f"part-{f:03d}.parquet", rows, row_group=row_group)
    return folder, texts


def cfg(corpus, *extra, seq=SEQ, batch=4, **kw):
    """The debug config over ``corpus`` (None: the sources come from ``kw``), parsed;
    each keyword is a ``training.*`` setting."""
    argv = [*CONFIG, "--training.seq_len", seq, "--training.batch_size", batch,
            "--training.seed", 7]  # fmt: skip
    if corpus is not None:
        argv += ["--training.dataset_path", str(corpus)]
    for key, value in kw.items():
        argv += [f"--training.{key}", value]
    return parse_args([str(a) for a in [*argv, *extra]])


def bucket_cfg(url: str, counts: str, **kw):
    """The debug config streaming the corpus at ``url`` (a bucket), its token counts in
    ``counts``, 8 sequences a step."""
    return cfg(url, length_index_dir=counts, streaming="true", global_batch_size=8, **kw)


def bucket_loader(tokenizer, url: str, counts: str, prefetch: int, **kw):
    """A loader over ``bucket_cfg`` (rank 0 of 1) fetching ``prefetch`` steps ahead."""
    loader = build_dataloader(bucket_cfg(url, counts, **kw), tokenizer, 0, 1)
    loader.prefetch_steps = prefetch
    return loader


def same_steps(a: list[list[dict]], b: list[list[dict]]) -> bool:
    """Whether two lists of steps (each its micro-batches) hold the same inputs and spans."""
    return all(
        len(x) == len(y)
        and all(
            torch.equal(p["input"], q["input"]) and p["spans"] == q["spans"] for p, q in zip(x, y)
        )  # fmt: skip
        for x, y in zip(a, b, strict=True)
    )


def assert_workers_fetch_their_own(tokenizer, url: str, counts: str, steps: int):
    """2 loader workers fetching 2 steps ahead give the first ``steps`` steps of a loader
    without workers or prefetch, and the rank's own process fetches nothing (each
    worker's prefetch is its own)."""
    plain = bucket_loader(tokenizer, url, counts, 0)
    reference = [plain.next_step() for _ in range(steps)]
    workers = bucket_loader(tokenizer, url, counts, 2, num_workers=2)
    try:
        assert same_steps([workers.next_step() for _ in range(steps)], reference)
        assert workers.stream.sources[0].prefetch.fetched == 0
    finally:
        workers.close()


def loaders(corpus, tokenizer, world=1, *extra, **kw) -> list:
    """The loaders of ``world`` data-parallel ranks, built as a job builds them (the data
    plan and length index made by the real code); each rank's loader is all a rank runs
    of the data path, so several ranks are several loaders in one process."""
    c = cfg(corpus, *extra, **kw)
    plan = local_plan(c.training, tokenizer)
    return [build_dataloader(c, tokenizer, r, world, plan) for r in range(world)]


def doc_tokens(corpus, tokenizer) -> dict[str, list[int]]:
    """Every document of a folder of JSON lines, tokenized as the loader does."""
    datasets = import_datasets()
    ds = datasets.load_dataset(
        "json", data_files=sorted(str(p) for p in corpus.glob("*.jsonl")), split="train"
    )
    return {row["id"]: tokenizer.encode(row["text"], bos=True, eos=True) for row in ds}


def window_of(batch, i) -> list[int]:
    """Sequence ``i`` of a batch as the window of tokens it was cut from."""
    return torch.cat([batch["input"][i], batch["label"][i, -1:]]).tolist()


def global_steps(ranks: list, steps: int) -> list[list]:
    """Each step's sequences over all ranks, in rank order: (tokens, spans) per sequence."""
    out = []
    for _ in range(steps):
        step = []
        for loader in ranks:
            for batch in loader.next_step():
                step += [
                    (window_of(batch, i), batch["spans"][i]) for i in range(len(batch["spans"]))
                ]
        out.append(step)
    return out


def assert_spans_tile_every_document(sequences, lengths: dict[str, int], epochs=(0,)):
    """The spans of ``sequences`` (each a list of ``[source, doc, start, end, pass,
    unit]``) read every document of ``lengths`` in each pass of ``epochs``, and each
    document's spans in a pass start at its first token and follow one another without a
    gap or an overlap."""
    covered = defaultdict(list)
    for spans in sequences:
        for _, doc_id, start, end, epoch, _ in spans:
            covered[(doc_id, epoch)].append((start, end))
    for epoch in epochs:
        assert {d for d, e in covered if e == epoch} == set(lengths), f"pass {epoch} incomplete"
    for (doc_id, _), spans in covered.items():
        spans = sorted(spans)
        assert spans[0][0] == 0, (doc_id, spans)
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), (doc_id, spans)


def assert_restores_at_every_step(build, steps: int, ahead: int, ks, control: int,
                                  delta: int = 1):  # fmt: skip
    """``build()`` gives fresh loaders of every rank. Over ``steps`` steps (which must cross
    more than two passes), the state after each step k in ``ks``, loaded into fresh loaders
    (each rank its own entry), gives exactly the next ``ahead`` steps. Negative control:
    the position after step ``control`` moved ``delta`` tokens does not."""
    ranks = build()
    reference, states = [], []
    for _ in range(steps):
        states.append([r.state_dict() for r in ranks])
        reference += global_steps(ranks, 1)
    assert ranks[0].position.cursors[0].pass_ >= 2

    def same(k, state) -> bool:
        fresh = build()
        for r, loader in enumerate(fresh):
            loader.load_state_dict(state[r])
        return global_steps(fresh, ahead) == reference[k : k + ahead]

    for k in ks:
        assert same(k, states[k]), k
    entry = from_tensor(states[control][0]["dp_rank_0"])
    entry["cursors"][0][8] += delta  # the first lane's token in its unit
    assert not same(control, [{"dp_rank_0": to_tensor(entry)}] * len(ranks))


def assert_two_ranks_restore_at_every_step(corpus, tokenizer, streaming: str, workers: int):
    """The state after k steps, loaded into fresh loaders, gives exactly the rest: 2
    ranks, 6 sequences a step over a corpus of a few short documents, so that 14 steps
    cross document and pass boundaries (k = 0..10; every fifth with workers)."""
    extra = dict(streaming=streaming, num_workers=workers, global_batch_size=6)
    assert_restores_at_every_step(
        lambda: loaders(corpus, tokenizer, 2, **extra), steps=14, ahead=3,
        ks=range(0, 11, 1 if workers == 0 else 5), control=4,
    )  # fmt: skip


def assert_workers_give_the_main_batches(corpus, tokenizer, workers: int, monkeypatch):
    """A loader with ``workers`` workers, sending groups of several micro-batches per
    message, gives the micro-batches of the loader without workers, in order, with their
    weights (6 steps of 7 micro-batches)."""
    import torchtitan.data.loader as loader_module

    monkeypatch.setattr(loader_module, "GROUP_TOKENS", 3 * 4 * (SEQ + 1))
    kw = dict(global_batch_size=20, batch_size=3)
    (plain,) = loaders(corpus, tokenizer, 1, **kw)
    (workers_loader,) = loaders(corpus, tokenizer, 1, num_workers=workers, **kw)
    assert workers_loader.group == 4
    for _ in range(6):
        a, b = plain.next_step(), workers_loader.next_step()
        assert len(a) == len(b) == 7
        for x, y in zip(a, b):
            assert torch.equal(x["input"], y["input"]) and x["spans"] == y["spans"]
            assert x["loss_weight"] == y["loss_weight"]


# ---- model inputs -----------------------------------------------------------------------


def many_documents(B: int = 3, T: int = 160, seed: int = 4, longest: int = 40):
    """B rows of T tokens cut into documents of 1 to ``longest`` tokens (a row may start
    with the tail of a document, whose positions also start at 0): tokens, positions, ids."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 4096, (B, T), generator=g)
    positions, ids = torch.empty(B, T, dtype=torch.long), torch.empty(B, T, dtype=torch.long)
    for b in range(B):
        t, d = 0, 0
        while t < T:
            n = min(T - t, int(torch.randint(1, longest + 1, (1,), generator=g)))
            positions[b, t : t + n], ids[b, t : t + n] = torch.arange(n), d
            t, d = t + n, d + 1
    return tokens, positions, ids


def assert_pieces_tile(steps, order, passes: int):
    """The pieces of ``steps`` (each a list of windows ``(source, pieces)``) read every
    unit of passes ``0 .. passes - 1`` whole, each token once (per unit, the ranges laid
    end to end from 0 to its total, with no gap or overlap), and a pass's last piece
    comes no later than the step where the next pass begins."""
    ranges: dict[tuple, list] = defaultdict(list)
    first_step, last_step = {}, {}
    for i, step in enumerate(steps):
        for _, pieces in step:
            for pass_, _, u, lo, hi, _ in pieces:
                ranges[(pass_, u)].append((lo, hi))
                first_step.setdefault(pass_, i)
                last_step[pass_] = i
    for (pass_, u), spans in ranges.items():
        spans = sorted(spans)
        ends = [0] + [b for _, b in spans[:-1]]
        assert [a for a, _ in spans] == ends, ("gap or overlap", pass_, u, spans[:4])
    units = order.units(order.source.extent())
    for p in range(passes):
        for u, unit in enumerate(units):
            total = order.counts.counts(tuple(int(x) for x in unit)).total
            got = max((b for _, b in ranges.get((p, u), [])), default=0)
            assert got == total, ("unit not read whole", p, u)
        if p + 1 in first_step:
            assert last_step[p] <= first_step[p + 1], "a pass began before the last ended"


def assert_units_read_in_order(sequences: list[list[list]], lengths: dict[str, int]):
    """Per (source, pass, unit), the spans of ``sequences`` (in reading order) go on where
    the last one ended: the same document from its last token, or the next one from 0
    once the last is read whole. A lane never skips or repeats a token."""
    last: dict[tuple, tuple] = {}
    for spans in sequences:
        for name, doc_id, start, end, pass_, unit in spans:
            prev = last.get((name, pass_, unit))
            if prev is not None:
                same = prev[0] == doc_id and prev[1] == start
                onward = start == 0 and prev[1] == lengths[prev[0]]
                assert same or onward, ("gap or overlap", name, pass_, unit, prev, doc_id, start)
            last[(name, pass_, unit)] = (doc_id, end)


def read_unit(source, unit) -> list[tuple[int, str, object]]:
    """``(at, doc_id, value)`` of every row of one unit of a source, in order."""
    rows, at = [], unit[1]
    while at is not None:
        docs, at, _ = source.read(unit, at)
        rows += [(start, doc_id, value) for start, _, doc_id, value in docs]
    return rows


@contextlib.contextmanager
def served_bucket():
    """A module's local S3 server (harness/s3.py), its request log quiet: ``(bucket,
    traffic)``; the module's tests are skipped, with the reason, where it cannot run."""
    import logging

    import pytest

    from harness.s3 import Traffic, local_s3, missing

    reason = missing()
    if reason:
        pytest.skip(reason)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    traffic = Traffic()
    with local_s3(traffic) as (bucket, _):
        yield bucket, traffic
