"""Hostile inputs and crashes: bad data, bad config and environment, SIGKILL anywhere."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import resource
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import (
    CONFIG,
    REPO,
    bundled_documents,
    error_lines,
    loaders,
    losses,
    read_jsonl,
    run_main,
    torchrun,
    train_here,
)

from torchtitan.data.sources import DataError, resolve_source
from torchtitan.runs import run_env, torchrun_command


def write(path, rows: list[dict] | None = None, raw: bytes | None = None):
    path.parent.mkdir(parents=True, exist_ok=True)
    if raw is not None:
        path.write_bytes(raw)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path.parent


GOOD = [{"id": f"g{i}", "text": f"Good document number {i}.\n" * 4} for i in range(4)]


def read(folder, tokenizer, windows: int, **kw) -> tuple:
    """(the loader, the spans of its first ``windows`` windows): one rank, unshuffled,
    one window a step, so that passes go by."""
    (loader,) = loaders(folder, tokenizer, 1, shuffle="false", batch=1, **kw)
    return loader, [sp for _ in range(windows) for seq in next(loader)["spans"] for sp in seq]


# ---- bad data (policy: skip and count; or a clear error before training) ---------------


@pytest.mark.parametrize("streaming", ["false", "true"], ids=["map", "streaming"])
def test_invalid_utf8_is_skipped_and_counted(tmp_path, tokenizer, streaming):
    good = b"".join(json.dumps(r).encode() + b"\n" for r in GOOD)
    folder = write(
        tmp_path / "d" / "a.jsonl", raw=good + b'{"id": "bad", "text": "caf\xe9 \xff"}\n'
    )
    loader, spans = read(folder, tokenizer, 12, streaming=streaming)
    assert loader.skipped_documents() >= 1
    assert {sp[1] for sp in spans} == {"g0", "g1", "g2", "g3"}


def test_null_missing_and_non_string_text_are_skipped_and_counted(tmp_path, tokenizer):
    folder = write(tmp_path / "d" / "a.jsonl", [*GOOD, {"id": "n", "text": None}, {"id": "m"}])
    loader, spans = read(folder, tokenizer, 12)
    assert {sp[1] for sp in spans} == {"g0", "g1", "g2", "g3"}
    passes = max(sp[4] for sp in spans)
    assert passes >= 1
    assert 2 * passes <= loader.skipped_documents() <= 2 * passes + 2  # 2 skips in every pass
    ints = write(tmp_path / "i" / "a.jsonl", [{"text": 5}, {"text": 7}])
    with pytest.raises(DataError, match="no usable document"):
        loaders(ints, tokenizer, 1)


def test_empty_files_and_empty_datasets(tmp_path, tokenizer):
    folder = write(tmp_path / "d" / "a.jsonl", GOOD)
    (folder / "empty.jsonl").write_text("")
    assert len(resolve_source(path=str(folder)).files) == 1  # the empty file is skipped
    empty = write(tmp_path / "e" / "a.jsonl", raw=b"")
    with pytest.raises(DataError, match="only empty files"):
        resolve_source(path=str(empty))


def test_a_5_mb_document_packs_and_restores(tmp_path, tokenizer):
    """Windows of 2,048 tokens inside one 5 MB document: the state after 3 is a position
    of a few bytes, and a fresh loader resumed there gives the next 2 windows, which
    start 3 x 2,048 tokens into the document."""
    line = "And thus the whirligig of time brings in his revenges.\n"
    huge = {"id": "huge", "text": line * (5_000_000 // len(line))}
    folder = write(tmp_path / "d" / "a.jsonl", [huge, *GOOD])
    loader, _ = read(folder, tokenizer, 3, seq=2047)
    state = loader.state_dict()
    assert len(pickle.dumps(state)) < 1000, "the state holds a position, not the 5 MB buffer"
    reference = [next(loader) for _ in range(2)]
    (fresh,) = loaders(folder, tokenizer, 1, shuffle="false", batch=1, seq=2047)
    fresh.load_state_dict(state)
    for a, b in zip([next(fresh) for _ in range(2)], reference):
        assert torch.equal(a["input"], b["input"]) and a["spans"] == b["spans"]
    assert reference[0]["spans"][0] == [["d", "huge", 3 * 2048, 4 * 2048, 0, 0]]


LONG_TEXT = ("  Leading spaces,\ttabs \u2028 and\r\nCRLF;\n\n\n" * 4000) + "no final newline"


def test_long_documents_tokenize_as_one_string_would(tokenizer):
    from torchtitan.data import packing

    assert len(LONG_TEXT) > packing.LONG_DOCUMENT_CHARS
    assert tokenizer.splits_at_newlines, "the bundled tokenizer takes the fast path"
    expected = tokenizer.encode(LONG_TEXT, bos=True, eos=True)
    assert packing.encode_document(tokenizer, LONG_TEXT).tolist() == expected


def test_a_dummy_prefix_tokenizer_never_takes_the_line_by_line_path(tmp_path):
    """A Llama-2-style SentencePiece model (dummy prefix on) would tokenize each line as a
    new input; the tokenizer refuses the fast path and the tokens match the whole text.
    Negative control: forcing the fast path on this model changes the tokens."""
    import sentencepiece as spm

    from torchtitan.data import packing
    from torchtitan.data.tokenizer import Tokenizer

    text = "\n".join(d["text"] for d in bundled_documents("shakespeare", 40))
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text.splitlines()), model_prefix=str(tmp_path / "llama2ish"),
        vocab_size=400, model_type="bpe", add_dummy_prefix=True, byte_fallback=True,
        bos_id=1, eos_id=2, unk_id=0, user_defined_symbols=["\n"], minloglevel=2,
    )  # fmt: skip
    tok = Tokenizer(tmp_path / "llama2ish.model")
    assert not tok.splits_at_newlines
    whole = tok.encode(LONG_TEXT, bos=True, eos=True)
    assert packing.encode_document(tok, LONG_TEXT).tolist() == whole
    tok.splits_at_newlines = True  # the old behaviour, for this model
    assert packing.encode_document(tok, LONG_TEXT).tolist() != whole


def test_a_small_partly_bad_corpus_trains_out_of_the_box(tmp_path):
    """67 documents, some empty, null or not strings, default settings: the bad ones are
    skipped and counted, and training runs (this used to stop at the first batch with
    64 shards)."""
    rows = [{"id": f"d{i}", "text": f"Document {i} of a small corpus.\n" * 5} for i in range(67)]
    for i in range(0, 67, 7):
        rows[i]["text"] = [None, "", "   ", 17][i % 4]
    folder = write(tmp_path / "d" / "small.jsonl", rows)
    _, log = train_here(tmp_path / "run", "--training.dataset_path", folder,
                        "--training.steps", 3, "--training.seq_len", 64)  # fmt: skip
    assert "done: 3 steps" in log
    # The console says so, with the count the JSONL has (not only the JSONL).
    skipped = read_jsonl(tmp_path / "run" / "metrics.jsonl")[-1]["skipped_documents"]
    assert skipped > 0 and f"{skipped} documents skipped so far" in log


# ---- bad config and environment ---------------------------------------------------------


def test_bad_config_and_environment_give_one_clear_line(tmp_path):
    status, log = train_here(tmp_path / "a", "--training.seq_len", 5000, expect_ok=False)
    assert status == 1 and "max_seq_len 4096" in error_lines(log)[0]

    not_a_model = tmp_path / "tok.model"
    not_a_model.write_text("not a sentencepiece model")
    status, log = train_here(tmp_path / "b", "--model.tokenizer_path", not_a_model,
                             expect_ok=False)  # fmt: skip
    assert status == 1 and str(not_a_model) in error_lines(log)[0]

    blocker = tmp_path / "file"
    blocker.write_text("a file where a folder should be")
    status, log = train_here(blocker / "run", "--checkpoint.enable_checkpoint", expect_ok=False)
    assert status == 1 and "is not writable" in error_lines(log)[0]

    status, log = run_main([*CONFIG, "--checkpoint.interval", 0])
    assert status == 2 and "checkpoint.interval" in log
    assert "Traceback" not in log


@pytest.mark.slow  # a 2-rank job filling a small disk: a fault scenario, like the campaign
def test_disk_full_during_a_save_stops_every_rank_with_a_clear_error(tmp_path):
    def small_disk():  # files above 1 MB fail with EFBIG, as on a full disk
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1_000_000, 1_000_000))

    cmd = torchrun_command(2, [*CONFIG, "--job.dump_folder", tmp_path, "--training.steps", 4,
                               "--checkpoint.enable_checkpoint", "--checkpoint.interval", 2])  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                          preexec_fn=small_disk, env=run_env())  # fmt: skip
    assert proc.returncode != 0
    errors = error_lines(proc.stderr)
    assert len(errors) == 2 and all(
        "saving checkpoint step-2" in e and "free space" in e for e in errors
    )
    assert os.listdir(tmp_path / "checkpoint") == [], (
        "no partial or fake-complete checkpoint is left"
    )


# ---- SIGKILL anywhere -------------------------------------------------------------------


@pytest.mark.slow
def test_kill_anywhere_then_resume_matches_an_uninterrupted_run(tmp_path, dozen_corpus):
    """CI-sized fault injection with async saves: 1 trial, 2 kills, the first during a
    checkpoint write (the slow campaign covers sync saves too). On a 12-document corpus
    epochs end, so the provenance check proves nothing was skipped across the kills."""
    cmd = [sys.executable, str(REPO / "scripts" / "fault_injection.py"), "--trials", "1", "--kills", "2",
           "--steps", "6", "--interval", "2", "--seed", "1", "--dump-folder", str(tmp_path / "fi"),
           "--checkpoint.async_mode", "async", "--training.dataset_path", str(dozen_corpus),
           "--training.seq_len", "64"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "kills 2" in proc.stdout and "mismatched steps 0" in proc.stdout
    assert "provenance failures 0" in proc.stdout and "nothing skipped" in proc.stdout
    assert "kills during a save 0" not in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["disabled", "async"], ids=["sync", "async"])
def test_fault_injection_campaign(tmp_path, mode):
    """3 trials x 3 kills at random moments (all ranks or one, in a step or a save)."""
    cmd = [sys.executable, str(REPO / "scripts" / "fault_injection.py"), "--trials", "3", "--kills", "3",
           "--steps", "12", "--interval", "3", "--seed", "0", "--dump-folder", str(tmp_path),
           "--checkpoint.async_mode", mode]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "mismatched steps 0" in proc.stdout and "kills 0" not in proc.stdout


# ---- SIGTERM / SIGUSR1 anywhere ----------------------------------------------------------


@pytest.mark.slow
def test_preemption_campaign(tmp_path):
    """24 trials over {0, 2} workers x {sync, async} x {DDP, FSDP} on 2 ranks, each
    signalled once (SIGTERM or SIGUSR1, every rank or one; mid-step, mid-save, by a
    validation, twice), plus one during the first compile where a C++ compiler exists:
    each stops by itself within 3 steps with its newest checkpoint at the stop, and its
    relaunch is bit-equal to an uninterrupted run."""
    compile_trials = "1" if shutil.which("g++") else "0"
    cmd = [sys.executable, str(REPO / "scripts" / "preemption_campaign.py"), "--trials", "24",
           "--compile-trials", compile_trials, "--seed", "0", "--dump-folder", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=2400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "failed 0" in proc.stdout and "PASS" in proc.stdout


# ---- dead and hung ranks ----------------------------------------------------------------


def _alive(pid: int) -> bool:
    """Running, not a zombie (an orphan's zombie waits on whoever adopted it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _children(pid: int) -> list[int]:
    return [int(c) for task in Path(f"/proc/{pid}/task").glob("*")
            for c in (task / "children").read_text().split()]  # fmt: skip


def test_a_loader_worker_ends_with_its_rank_however_it_dies(tmp_path, small_corpus, tokenizer):
    """A "rank" (a fork of this process) starts a real loader with one worker, then dies
    by SIGKILL: its worker, which ignores the stop signals, is gone within 2 s instead
    of living on with the rank's memory and sockets."""
    read, write = os.pipe()
    rank = os.fork()
    if rank == 0:  # the rank: never returns into pytest
        try:
            (loader,) = loaders(small_corpus, tokenizer, 1, num_workers=1)
            next(loader)
            os.write(write, " ".join(map(str, _children(os.getpid()))).encode() + b"\n")
            time.sleep(60)
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:  # a rank stuck before it answers is killed all the same
        answered = select.select([f], [], [], 120)[0]
        workers = [int(p) for p in f.readline().split()] if answered else []
    os.kill(rank, signal.SIGKILL)
    os.waitpid(rank, 0)
    deadline = time.monotonic() + 2
    while any(map(_alive, workers)) and time.monotonic() < deadline:
        time.sleep(0.02)
    left = [p for p in workers if _alive(p)]
    for pid in left:  # leave nothing behind, even when failing
        os.kill(pid, signal.SIGKILL)
    assert workers and not left, f"loader worker(s) {left} outlived their rank"


def test_comm_timeouts_reach_every_process_group(monkeypatch):
    """``[comm]``: the init timeout is every group's until the first step, then the train
    timeout (a one-rank gloo job in this process: the groups are real)."""
    from torchtitan import parallel
    from torchtitan.config import parse_args
    from torchtitan.runs import free_port

    status, log = run_main([*CONFIG, "--comm.train_timeout_seconds", 0])
    assert status == 2 and "comm.train_timeout_seconds" in log
    cfg = parse_args([*CONFIG, "--comm.init_timeout_seconds", "7",
                      "--comm.train_timeout_seconds", "3"])  # fmt: skip
    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(free_port())).items():  # fmt: skip
        monkeypatch.setenv(key, value)
    dims = parallel.init_distributed(cfg.comm.init_timeout_seconds)
    try:

        def timeouts() -> list[float]:
            groups = parallel.process_groups(dims)
            assert len(groups) == 3  # the default, checkpoint and control groups
            return [g._get_backend(torch.device("cpu")).options._timeout.total_seconds()
                    for g in groups]  # fmt: skip

        assert timeouts() == [7, 7, 7]
        dims = parallel.apply_layout(dims, cfg)
        assert timeouts() == [7, 7, 7]
        parallel.set_timeout(dims, cfg.comm.train_timeout_seconds)
        assert timeouts() == [3, 3, 3]
    finally:
        parallel.destroy_distributed()


def test_a_broken_collective_names_the_ranks_that_did_not_answer():
    """Through a real store: ranks that saw the collective break say so; the silent one is
    named, and a reported failure is passed on instead."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from torchtitan import parallel

    store = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5))
    ranks = [parallel.ParallelDims(r, 3, r, torch.device("cpu"), "gloo", store=store)
             for r in range(3)]  # fmt: skip
    timed_out = RuntimeError(
        "[/x/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms for recv "
        "operation to complete"
    )
    assert parallel.collective_broke(timed_out) and not parallel.collective_broke(ValueError())
    store.set(f"torchtitan/saw_collective_break/0/{2}", "1")  # rank 2 answered
    line = parallel.why_collective_broke(ranks[0], timed_out, wait_s=0.2)
    assert line.startswith("rank 1 stopped answering: a collective failed (Timed out waiting")
    store.set(f"torchtitan/saw_collective_break/0/{1}", "1")
    assert parallel.why_collective_broke(ranks[0], timed_out, wait_s=0.2) is None  # all did
    parallel.report_failure(ranks[2], "disk full")
    assert parallel.why_collective_broke(ranks[1], timed_out) == "rank 2 failed: disk full"


def test_a_torchrun_restart_stops_at_once_with_one_line(monkeypatch):
    """torchrun's own restarts (--max-restarts) cannot form the process groups again
    (README): a restarted rank says so in one line instead of failing later."""
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    status, log = run_main(CONFIG)
    assert status == 1 and "--max-restarts 0" in error_lines(log)[0]
    assert "Traceback" not in log


FAULT_JOB = [*CONFIG, "--training.steps", 10, "--checkpoint.enable_checkpoint",
             "--checkpoint.interval", 2, "--metrics.log_freq", 1, "--training.num_workers", 1,
             "--comm.train_timeout_seconds", 10]  # fmt: skip


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    """The per-step losses of the fault jobs run without a fault."""
    dump = tmp_path_factory.mktemp("uninterrupted")
    proc = torchrun([*FAULT_JOB, "--job.dump_folder", dump])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return losses(dump)


def _job_processes(dump: Path) -> list[int]:
    """Live processes of the job writing to ``dump``: torchrun, its ranks and their loader
    workers (forks of a rank, with its command line)."""
    marker, found = str(dump).encode(), []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker in (entry / "cmdline").read_bytes():
                found += [int(entry.name)] if _alive(int(entry.name)) else []
        except OSError:
            pass
    return [p for p in found if p != os.getpid()]


def _rank_pids(launcher: int) -> dict[int, int]:
    """{rank: pid} of torchrun's children, from their environment."""
    out = {}
    for pid in _children(launcher):
        env = dict(
            v.split(b"=", 1)
            for v in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            if b"=" in v
        )
        out[int(env[b"RANK"])] = pid
    return out


def _steps_logged(dump: Path) -> int:
    try:
        return (dump / "metrics.jsonl").read_text().count("}\n")
    except OSError:
        return 0


def _wait(condition, seconds: float) -> float | None:
    """Seconds until ``condition()`` held, or None if it did not within ``seconds``."""
    begin = time.monotonic()
    while time.monotonic() - begin < seconds:
        if condition():
            return time.monotonic() - begin
        time.sleep(0.05)
    return None


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["SIGSTOP", "SIGKILL"])
def test_a_stopped_or_killed_rank_ends_the_job_promptly_and_the_relaunch_is_exact(
    tmp_path, uninterrupted, fault
):
    """Rank 1 of 2 (each with a loader worker) is stopped or killed after step 3.
    SIGSTOP: rank 0 exits within the train timeout (10 s) + 8 s, with one line naming
    rank 1; torchrun kills the stopped rank 30 s later (its shutdown grace). SIGKILL: rank
    0 exits within 5 s of torchrun's SIGTERM. Either way no process of the job is left
    once torchrun returns, and the relaunch resumes from the newest complete checkpoint
    to losses equal to an uninterrupted run's."""
    dump = tmp_path / "job"
    log = tmp_path / "job.log"
    cmd = torchrun_command(2, [*FAULT_JOB, "--job.dump_folder", dump])
    with open(log, "w") as out:
        launcher = subprocess.Popen(cmd, cwd=REPO, env=run_env(), stdout=out, stderr=out)
    try:
        assert _wait(lambda: _steps_logged(dump) >= 3, 240) is not None, log.read_text()
        ranks = _rank_pids(launcher.pid)
        os.kill(ranks[1], getattr(signal, fault))
        limit = 10 + 8 if fault == "SIGSTOP" else 0.1 + 5 + 1  # monitor interval + 5 s + slack
        took = _wait(lambda: not _alive(ranks[0]), limit)
        assert took is not None, f"rank 0 still alive {limit} s after rank 1's {fault}"
        launcher.wait(timeout=60)
        assert _wait(lambda: not _job_processes(dump), 3) is not None, _job_processes(dump)
    finally:
        for pid in [*_job_processes(dump), launcher.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        launcher.wait()
    text = log.read_text()
    rank0 = [line for line in error_lines(text) if line.startswith("[rank0]")]
    if fault == "SIGSTOP":
        assert len(rank0) == 1 and "rank 1 stopped answering" in rank0[0], text[-3000:]
    assert "preempted at step" not in text  # no save completed without the peer
    complete = [int(m.group(1)) for e in os.scandir(dump / "checkpoint")
                if (m := re.fullmatch(r"step-(\d+)", e.name))]  # fmt: skip
    relaunch = torchrun([*FAULT_JOB, "--job.dump_folder", dump])
    assert relaunch.returncode == 0, relaunch.stderr[-3000:]
    assert f"step-{max(complete)}" in relaunch.stderr.split("loaded checkpoint", 1)[1][:300]
    assert losses(dump) == uninterrupted
