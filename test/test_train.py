"""End-to-end: the acceptance script on real `torchrun` jobs (2 ranks, gloo, real DCP), and
the resume guarantees it checks, each next to a negative control that breaks them.

Multi-rank properties (FSDP and DDP sharded state, async saves on their own gloo group,
loader workers, elastic layouts) run under torchrun; single-rank properties run
in-process through ``train.main`` (same code, no interpreter start-up).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import (
    CONFIG,
    REPO,
    assert_run_read_every_token_once,
    campaign_seed,
    child_pids,
    error_lines,
    losses,
    process_alive,
    read_jsonl,
    run_main,
    torchrun,
    train,
    train_here,
    write_jsonl_file,
)

from torchtitan.checkpoint import complete_steps, own_files, read_manifest
from torchtitan.config import parse_args, resolve_path
from torchtitan.data import document_lengths
from torchtitan.records import metrics
from torchtitan.records.provenance import check_complete, read_provenance, sequences_by_step
from torchtitan.records.runs import RunRecordError
from torchtitan.tools.check_provenance import main as provenance_check
from torchtitan.tools.deterministic_resume import main as resume_check
from torchtitan.tools.launch import run_env, torchrun_command


def in_process(nproc: int, argv: list[str]) -> tuple[int, str]:
    """A launcher for resume_check: 1-rank jobs run here, through train.main."""
    assert nproc == 1, "in-process runs have one rank"
    return run_main(argv)


def check(tmp_path, *args, launcher=in_process) -> int:
    return resume_check(["--dump-folder", str(tmp_path / "dr"), "--nproc", "1", *args], launcher)


def left_out_on_resume(component: str):
    """A launcher whose resumed runs leave ``component`` out of the load: the negative
    control of a resume check. (A command that carries the option from its first launch
    would not do: its branch begins there, and its requeues load everything.)"""

    def launcher(nproc: int, argv: list[str]) -> tuple[int, str]:
        dump = argv[argv.index("--job.dump_folder") + 1]
        if complete_steps(os.path.join(dump, "checkpoint")):
            argv = [*argv, "--checkpoint.exclude_from_loading", component]
        return in_process(nproc, argv)

    return launcher


# ---- the acceptance script, as shipped, on 2 ranks with everything switched on ----------


# Slow tier: the script as shipped, 5 launches (24 s). The fast tier keeps its logic
# (resume_check in-process, with its negative controls) and 2-rank exact resumes with
# workers (the preemption test) and with dropout (test_parallel's layouts).
@pytest.mark.slow
def test_deterministic_resume_script_with_workers_dropout_mixing_and_async(tmp_path):
    """12 steps on 2 FSDP ranks with 2 loader workers each, dropout, a two-source mix,
    async checkpoints, bf16 compute, full activation checkpointing, 2 micro-batches per
    step and validation every 4 steps; delete step-12 and step-9, resume from step-6:
    steps 7..12 bit-equal (training and validation losses), the same data in the same
    order, every token once."""
    cmd = [
        sys.executable, str(REPO / "scripts" / "deterministic_resume.py"),
        "--dump-folder", str(tmp_path / "dr"), "--steps", "12", "--interval", "3", "--delete", "2",
        "--training.num_workers", "2", "--model.dropout", "0.1",
        "--training.datasets", "shakespeare:0.7,kjv:0.3", "--checkpoint.async_mode", "async",
        "--training.mixed_precision_param", "bfloat16", "--activation_checkpoint.mode", "full",
        "--training.global_batch_size", "16",
        "--validation.enable", "--validation.freq", "4", "--validation.steps", "2",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    out = proc.stdout
    assert proc.returncode == 0 and "PASS" in out, out[-4000:] + proc.stderr[-2000:]
    assert "loaded checkpoint" in out and "step-6" in out
    assert out.count(" yes") == 6
    assert "provenance of the resumed run equals the first run's: True" in out
    assert "validation losses of the resumed run equal the first run's: True" in out
    log = (tmp_path / "dr" / "runs.log").read_text()
    assert "16 sequences: 2 micro-batches of at most 4 x 128 per data-parallel rank; 2 data" in log
    assert (tmp_path / "dr" / "loss_curves.png").stat().st_size > 0
    assert "staging and writing in the background" in log
    records = read_jsonl(tmp_path / "dr" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 13))
    expected = {"loss", "grad_norm", "lr", "tokens_per_s", "step_ms", "data_wait_ms", "memory_gib"}
    assert expected <= set(records[0])
    assert [r["step"] for r in records if "validation_loss" in r] == [4, 8, 12]
    assert records[-1]["tokens_seen"] == 12 * 16 * 128
    assert records[-1]["loss"] < records[0]["loss"], "the model learns"
    # Tokens per source, cumulative: every window's 129 tokens, at the mix's weights.
    by_source = {k: records[-1][f"source_tokens/{k}"] for k in ("shakespeare", "kjv")}
    assert sum(by_source.values()) == 12 * 16 * 129
    assert abs(by_source["shakespeare"] / sum(by_source.values()) - 0.7) < 0.03
    assert "tokens by source: shakespeare" in log


# ---- the same comparison on one in-process rank, with its negative controls ------------


def test_resume_check_passes_and_fails_when_a_component_is_not_restored(tmp_path):
    """resume_check passes on an exact resume and fails when the resume is broken: not
    loading the data position (the model then sees other batches), or the optimizer."""
    common = ["--steps", "6", "--interval", "2", "--delete", "1"]
    assert check(tmp_path, *common) == 0
    assert check(tmp_path, *common, launcher=left_out_on_resume("dataloader")) == 1
    assert check(tmp_path, *common, launcher=left_out_on_resume("optimizer")) == 1


def test_block_causal_resumes_exactly_mid_document(tmp_path):
    """block_causal (with dropout, bf16 autocast and selective recompute): the resumed run
    is bit-exact, and after the resume a lane goes on in the middle of a document begun
    before it."""
    common = ["--steps", "6", "--interval", "3", "--delete", "1", "--model.dropout", "0.1",
              "--model.attention_mask", "block_causal",
              "--training.mixed_precision_param", "bfloat16",
              "--activation_checkpoint.mode", "selective"]  # fmt: skip
    assert check(tmp_path, *common) == 0
    provenance = read_provenance(str(tmp_path / "dr" / "provenance"))
    before = {(sp[1], sp[4]) for step in (1, 2, 3) for seq in provenance[0][step] for sp in seq}
    continued = [sp for step in (4, 5, 6) for seq in provenance[0][step] for sp in seq
                 if sp[2] > 0 and (sp[1], sp[4]) in before]  # fmt: skip
    assert continued, "the resumed run continues a document begun before the resume"


def test_masked_document_boundaries_resume_exactly(tmp_path, tiny_corpus):
    """training.mask_document_boundaries with block_causal and 2 micro-batches per step,
    on documents of ~100 tokens: the resumed run is bit-exact (the mask is derived from
    the data position, which the checkpoint holds). The masking is in effect: the same
    run without it logs other losses from step 1."""
    common = ["--steps", "6", "--interval", "3", "--delete", "1",
              "--training.dataset_path", str(tiny_corpus), "--model.attention_mask", "block_causal",
              "--training.global_batch_size", "8"]  # fmt: skip
    assert check(tmp_path, *common, "--training.mask_document_boundaries") == 0
    masked = losses(tmp_path / "dr")
    train_here(tmp_path / "plain", "--training.steps", 6, "--training.stop_at_step", 2,
               "--training.batch_size", 4, *common[6:])  # fmt: skip
    plain = losses(tmp_path / "plain")
    assert all(plain[step] != masked[step] for step in (1, 2))


def test_resume_at_every_checkpoint_across_epochs(tmp_path, tiny_corpus):
    """A new process at every checkpoint on a corpus of ~1 step per epoch, so resumes land
    before, at and after epoch boundaries; every step and its data equal one uninterrupted
    run. Negative control: the same chain without restoring the RNG, under dropout, fails."""
    args = [
        "--resume-every", "--steps", "8", "--interval", "2", "--model.dropout", "0.1",
        "--training.dataset_path", str(tiny_corpus), "--training.seq_len", "32",
    ]  # fmt: skip
    assert check(tmp_path, *args) == 0
    # Passes begun are reported once each ([step, source, pass]), the same in the chain.
    events = {
        name: [e for r in read_jsonl(tmp_path / name / "metrics.jsonl") for e in r.get("epoch_starts", [])]
        for name in ("dr", "dr-reference")
    }  # fmt: skip
    expected, seen = [], set()  # from the provenance: the first span of each new pass
    for step, sequences in sorted(read_provenance(str(tmp_path / "dr" / "provenance"))[0].items()):
        for source, _, _, _, epoch, _ in (sp for seq in sequences for sp in seq):
            if epoch >= 1 and (source, epoch) not in seen:
                seen.add((source, epoch))
                expected.append([step, source, epoch])
    assert events["dr"] == events["dr-reference"] == expected and expected

    assert check(tmp_path, *args, launcher=left_out_on_resume("rng")) == 1


def test_a_resumed_runs_metrics_hold_each_step_once(tmp_path, monkeypatch):
    """A run killed after its last checkpoint wrote metrics past it; the resume trims them,
    so the file lists every step once with the resumed values. Negative control: without
    the trimming the strict reader refuses the file."""
    common = ["--training.steps", 6, "--checkpoint.enable_checkpoint", "--checkpoint.interval", 3,
              "--metrics.data_provenance"]  # fmt: skip
    train_here(tmp_path / "ref", *common)
    for dump, trim in ((tmp_path / "a", True), (tmp_path / "b", False)):
        shutil.copytree(tmp_path / "ref", dump)
        shutil.rmtree(dump / "checkpoint" / "step-6")  # as if killed after logging step 6
        if not trim:
            monkeypatch.setattr(
                metrics, "truncate_jsonl_after", lambda path, step, lineage=None: None
            )
        train_here(dump, *common)
    assert losses(tmp_path / "a") == losses(tmp_path / "ref")
    assert sorted(losses(tmp_path / "a")) == list(range(1, 7))
    assert_run_read_every_token_once(tmp_path / "a")
    with pytest.raises(RunRecordError, match="step 4 appears out of order"):
        losses(tmp_path / "b")


# ---- elastic: other layouts, every token once -----------------------------------------


# Slow tier (#51): three launches (20 s). The property stays in the fast tier twice:
# test_parallel.py's chain over layouts (train.py, 4 ranks, 0 then 2 workers, provenance:
# every token once, the global batch kept) and test/data/test_loader.py's
# test_resume_on_any_rank_count_gives_the_same_global_batches (rank counts that divide
# neither the old count nor the batch, 8 -> 7 -> 2).
@pytest.mark.slow
def test_elastic_chain_ranks_workers_and_batch_sizes(tmp_path, dozen_corpus):
    """2 ranks x 0 workers (global batch 8) -> 1 rank x 3 workers (the one rank
    accumulates two micro-batches of 4) -> 3 ranks with a global batch of 10 (a rank
    count that divides neither the old layout nor the batch: slices of 4, 3 and 3) on a
    12-document corpus. Several passes go by; the provenance checker proves every token
    read once and nothing skipped (every document of each finished pass read whole)."""
    common = ["--training.steps", 9, "--checkpoint.enable_checkpoint", "--checkpoint.interval", 3,
              "--metrics.data_provenance", "--training.dataset_path", dozen_corpus,
              "--training.seq_len", 32, "--training.batch_size", 4]  # fmt: skip
    eight = ["--training.global_batch_size", 8]
    train(tmp_path, *common, *eight, "--training.stop_at_step", 3)
    # One rank, in this process (no launch), with 3 loader workers.
    _, log = train_here(tmp_path, *common, *eight, "--training.stop_at_step", 6,
                        "--training.num_workers", 3)  # fmt: skip
    assert "8 sequences: 2 micro-batches of at most 4 x 32 per data-parallel rank" in log
    proc = train(tmp_path, *common, "--training.global_batch_size", 10, nproc=3)
    assert "10 sequences: 1 micro-batches of at most 4 x 32" in proc.stderr
    assert "the busiest does 1.20 x the mean" in proc.stderr
    assert sorted(losses(tmp_path)) == list(range(1, 10))
    assert_run_read_every_token_once(tmp_path)
    config = [*CONFIG, *map(str, common)]
    assert provenance_check([str(tmp_path / "provenance"), *config]) == 0
    provenance = read_provenance(str(tmp_path / "provenance"))
    lengths = document_lengths(parse_args(config), tokenizer_of(config))
    report = check_complete(provenance, lengths)["shakespeare"]
    assert len(report.finished_epochs) >= 1 and (report.missing, report.partial) == (0, 0)
    steps = sequences_by_step(provenance)
    assert [len(steps[s]) for s in range(1, 10)] == [8] * 6 + [10] * 3


def tokenizer_of(config: list[str]):
    from torchtitan.data.tokenizer import Tokenizer

    return Tokenizer(resolve_path(parse_args(config).model.tokenizer_path))


# ---- preemption, DDP, and errors on every rank -----------------------------------------


def run_until_step(dump, args: list, step: int) -> subprocess.Popen:
    """Start a 2-rank job in its own process group; return once it has logged ``step``."""
    proc = subprocess.Popen(torchrun_command(2, [*CONFIG, "--job.dump_folder", dump, *args]),
                            cwd=REPO, env=run_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(OSError, ValueError, IndexError):
            if json.loads((dump / "metrics.jsonl").read_text().splitlines()[-1])["step"] >= step:
                return proc
        time.sleep(0.005)
    proc.kill()
    raise AssertionError(f"the job never reached step {step}: {proc.communicate()[0][-3000:]}")


def rank_pid(launcher_pid: int, rank: int) -> int:
    """The pid of one rank of a torchrun job (a child of the launcher with that RANK)."""
    for child in open(f"/proc/{launcher_pid}/task/{launcher_pid}/children").read().split():
        with contextlib.suppress(OSError):
            environ = open(f"/proc/{child}/environ", "rb").read().split(b"\0")
            if f"RANK={rank}".encode() in environ:
                return int(child)
    raise AssertionError(f"no rank {rank} under the launcher {launcher_pid}")


def preempted_step(out: str, nproc: int = 2) -> int:
    """The step every rank says it stopped after (asserting they all agree)."""
    lines = [line for line in out.splitlines() if "preempted at step" in line]
    assert len(lines) == nproc, out[-3000:]
    step = int(lines[0].split("preempted at step ")[1].split(":")[0])
    assert all(f"preempted at step {step}: checkpoint step-{step} written" in x for x in lines)
    return step


# Slow tier (#51): four 2-rank launches with loader workers (30-54 s). Its properties stay
# guarded fast: the agreement (a signal to one rank stops every rank after the same step)
# by test/faults/test_preemption.py (two forked gloo ranks, the real Preemption), the stop
# and its one save by test_a_signal_on_a_save_step_stops_there_with_one_save below, and
# the same agreement under fault tolerance by test/faults/test_replica_steps.py.
@pytest.mark.slow
def test_preemption_of_one_rank_or_all_saves_and_the_relaunches_are_exact_ddp(tmp_path):
    """A 2-rank DDP job with 2 loader workers per rank (two micro-batches per step,
    all-reduce on the last only), preempted twice: first SIGUSR1 to rank 1 alone (a
    scheduler preempting one node: every rank must still stop after the same step),
    then SIGTERM to every process of the job, loader workers included (they must leave
    the signal to their rank). Each time every rank stops after the same step N, writes
    step-N and says so in one line; the last relaunch finishes bit-exactly (losses equal
    an uninterrupted run)."""
    common = ["--training.steps", 14, "--checkpoint.enable_checkpoint", "--checkpoint.interval", 8,
              "--training.data_parallel", "ddp", "--training.batch_size", 2,
              "--training.global_batch_size", 8, "--training.num_workers", 2]  # fmt: skip
    # The uninterrupted reference runs beside the preempted job (both wait on start-up).
    log = (tmp_path / "reference.log").open("w")
    reference = subprocess.Popen(
        torchrun_command(2, [*CONFIG, "--job.dump_folder", tmp_path / "reference", *common]),
        cwd=REPO, env=run_env(), stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    dump = tmp_path / "preempted"
    proc = run_until_step(dump, common, 3)
    os.kill(rank_pid(proc.pid, 1), signal.SIGUSR1)
    out = proc.communicate(timeout=120)[0]
    first = preempted_step(out)
    assert "(SIGUSR1)" in out and "(signal to another rank)" in out
    assert 3 <= first < 14 and complete_steps(str(dump / "checkpoint"))[-1] == first

    proc = run_until_step(dump, common, first + 2)
    os.killpg(proc.pid, signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    second = preempted_step(out)
    assert "killed by signal" not in out, out[-3000:]
    assert first < second < 14 and complete_steps(str(dump / "checkpoint"))[-1] == second
    proc = train(dump, *common)
    assert f"step-{second}" in proc.stderr and "loaded checkpoint" in proc.stderr
    assert reference.wait(timeout=120) == 0, (tmp_path / "reference.log").read_text()[-3000:]
    assert losses(dump) == losses(tmp_path / "reference")


# Slow tier: three 2-rank launches (25 s); the exact resume under PP is in the fast tier
# (test_parallel.py's 4-rank launch).
@pytest.mark.slow
def test_a_signal_to_one_pipeline_stage_stops_every_stage_and_the_relaunch_is_exact(tmp_path):
    """PP 2 with dropout and 2 loader workers: SIGUSR1 to the last stage's rank alone;
    both stages stop after the same step N (the stop agreement includes every stage)
    and step-N is written; the relaunch finishes bit-exactly (losses equal an
    uninterrupted run)."""
    common = ["--training.steps", 16, "--checkpoint.enable_checkpoint", "--checkpoint.interval", 8,
              "--parallelism.pipeline_parallel_degree", 2, "--training.global_batch_size", 8,
              "--model.dropout", 0.1, "--training.num_workers", 2]  # fmt: skip
    train(tmp_path / "reference", *common)
    dump = tmp_path / "preempted"
    proc = run_until_step(dump, common, 3)
    os.kill(rank_pid(proc.pid, 1), signal.SIGUSR1)
    out = proc.communicate(timeout=120)[0]
    stopped = preempted_step(out)
    assert "(SIGUSR1)" in out and "(signal to another rank)" in out
    assert 3 <= stopped < 16 and complete_steps(str(dump / "checkpoint"))[-1] == stopped
    proc = train(dump, *common)
    assert f"step-{stopped}" in proc.stderr and "loaded checkpoint" in proc.stderr
    assert losses(dump) == losses(tmp_path / "reference")


# Slow tier: two 2-rank launches (12 s); one rank's damaged checkpoint is one line in
# the fast tier (checkpoint/test_manager.py).
@pytest.mark.slow
def test_a_damaged_file_of_a_2_rank_checkpoint_stops_both_ranks_with_one_line(tmp_path):
    """Each rank digested what it wrote (the two ranks' own files are the manifest's
    files); a damaged file of rank 1's stops both ranks with one line each naming the
    file and the command that resumes from the previous checkpoint."""
    common = ["--training.steps", 8, "--checkpoint.enable_checkpoint", "--checkpoint.interval", 4,
              "--training.data_parallel", "ddp", "--training.global_batch_size", 8]  # fmt: skip
    dump = tmp_path / "run"
    train(dump, *common)
    path = str(dump / "checkpoint" / "step-8")
    mine = [set(own_files(path, r)) for r in (0, 1)]
    assert not mine[0] & mine[1] and mine[0] | mine[1] == set(read_manifest(path)["files"])

    previous = max(s for s in complete_steps(str(dump / "checkpoint")) if s < 8)
    shard = dump / "checkpoint" / "step-8" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    proc = train(dump, *common, expect_ok=False)
    errors = error_lines(proc.stderr)
    assert proc.returncode != 0 and len(errors) == 2, proc.stderr[-3000:]
    assert {e.split("]")[0] for e in errors} == {"[rank0", "[rank1"}
    assert all("__1_0.distcp" in e and f"--checkpoint.load_step {previous}" in e for e in errors)


@pytest.mark.parametrize("interval", [1, 4])
def test_a_signal_on_a_save_step_stops_there_with_one_save(tmp_path, monkeypatch, interval):
    """SIGTERM during step 4, a save step (every step with interval 1): the job stops
    after step 4, and step-4's regular save is the preemption's (no second save).
    Negative control: with interval 1 the old loop never asked and trained to the end."""
    import train as train_script

    class SignalAtStep4(train_script.TrainStep):
        calls = 0

        def __call__(self, batches):
            SignalAtStep4.calls += 1
            if SignalAtStep4.calls == 4:
                os.kill(os.getpid(), signal.SIGTERM)
            return super().__call__(batches)

    monkeypatch.setattr(train_script, "TrainStep", SignalAtStep4)
    _, log = train_here(tmp_path, "--training.steps", 12, "--checkpoint.enable_checkpoint",
                        "--checkpoint.interval", interval)  # fmt: skip
    assert "preempted at step 4: checkpoint step-4 written (SIGTERM)" in log
    assert log.count("saved checkpoint step-4 ") == 1
    assert complete_steps(str(tmp_path / "checkpoint"))[-1] == 4
    assert sorted(losses(tmp_path)) == [1, 2, 3, 4]


def test_one_ranks_data_error_stops_every_rank_with_one_line(tmp_path):
    """Only rank 0 measures the empty document (its share of the length index); rank 1
    measures clean ones. Each rank prints the one line naming the document, and no frame
    of the project's code appears in any traceback (torchrun's own summary is all there
    is)."""
    docs = [{"id": f"d{i}", "text": "" if i == 0 else f"Line {i} of a document.\n" * 30}
            for i in range(12)]  # fmt: skip
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    proc = train(tmp_path / "run", "--training.dataset_path", tmp_path / "data",
                 "--training.shuffle", "false",
                 "--training.bad_data", "error", expect_ok=False)  # fmt: skip
    errors = error_lines(proc.stderr)
    assert proc.returncode != 0 and len(errors) == 2, proc.stderr[-3000:]
    # The ranks write at the same moment: either line may come first.
    for rank, line in enumerate(sorted(errors)):
        assert line.startswith(f"[rank{rank}] error: document 'd0'"), errors
    frames = [line for line in proc.stderr.splitlines() if line.strip().startswith("File ")]
    assert not [f for f in frames if "torchtitan" in f or "train.py" in f], frames


def test_a_bug_keeps_its_traceback(monkeypatch):
    """Only the project's own error types become one line; a ValueError from a bug does not."""
    import train as train_script

    def broken(*args, **kwargs):
        raise ValueError("a bug")

    monkeypatch.setattr(train_script, "build_optimizer", broken)
    with pytest.raises(ValueError, match="a bug"):
        run_main([*CONFIG, "--training.steps", 1])


# ---- faults: bad data (skip and count), bad config and environment --------------------


def test_a_small_partly_bad_corpus_trains_out_of_the_box(tmp_path):
    """67 documents, some empty, null or not strings, default settings: the bad ones are
    skipped and counted, and training runs (this used to stop at the first batch with
    64 shards)."""
    rows = [{"id": f"d{i}", "text": f"Document {i} of a small corpus.\n" * 5} for i in range(67)]
    for i in range(0, 67, 7):
        rows[i]["text"] = [None, "", "   ", 17][i % 4]
    folder = write_jsonl_file(tmp_path / "d" / "small.jsonl", rows)
    _, log = train_here(tmp_path / "run", "--training.dataset_path", folder,
                        "--training.steps", 3, "--training.seq_len", 64)  # fmt: skip
    assert "done: 3 steps" in log
    # The console says so, with the count the JSONL has (not only the JSONL).
    skipped = read_jsonl(tmp_path / "run" / "metrics.jsonl")[-1]["skipped_documents"]
    assert skipped > 0 and f"{skipped} documents skipped so far" in log


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
    cmd = [sys.executable, str(REPO / "scripts" / "campaigns" / "fault_injection.py"), "--trials", "1", "--kills", "2",
           "--steps", "6", "--interval", "2", "--seed", "1", "--dump-folder", str(tmp_path / "fi"),
           "--checkpoint.async_mode", "async", "--training.dataset_path", str(dozen_corpus),
           "--training.seq_len", "64"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "kills 2" in proc.stdout and "mismatched steps 0" in proc.stdout
    assert "provenance failures 0" in proc.stdout and "nothing skipped" in proc.stdout
    assert "kills during a save 0" not in proc.stdout


@pytest.mark.slow
@pytest.mark.time_limit(1800)  # its launch's own timeout
@pytest.mark.parametrize("mode", ["disabled", "async"], ids=["sync", "async"])
def test_fault_injection_campaign(tmp_path, mode):
    """2 trials x 3 kills at random moments (all ranks or one, in a step or a save), the
    moments drawn from a seed that changes daily (helpers.campaign_seed): each run short,
    the coverage growing over the days. A failure names its seed."""
    seed = campaign_seed()
    cmd = [sys.executable, str(REPO / "scripts" / "campaigns" / "fault_injection.py"), "--trials", "2", "--kills", "3",
           "--steps", "12", "--interval", "3", "--seed", seed, "--dump-folder", str(tmp_path),
           "--checkpoint.async_mode", mode]  # fmt: skip
    proc = subprocess.run(
        list(map(str, cmd)), cwd=REPO, capture_output=True, text=True, timeout=1800
    )
    assert proc.returncode == 0, f"seed {seed}:\n" + proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "mismatched steps 0" in proc.stdout and "kills 0" not in proc.stdout


# ---- SIGTERM / SIGUSR1 anywhere ----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.time_limit(2400)  # its launch's own timeout
def test_preemption_campaign(tmp_path):
    """8 trials, one per layout of {0, 2} workers x {sync, async} x {DDP, FSDP} on 2
    ranks, each signalled once (SIGTERM or SIGUSR1, every rank or one; mid-step,
    mid-save, by a validation, twice: each moment twice, paired with the layouts by a
    seed that changes daily, helpers.campaign_seed), plus one during the first compile
    where a C++ compiler exists: each stops by itself within 3 steps with its newest
    checkpoint at the stop, and its relaunch is bit-equal to an uninterrupted run."""
    compile_trials = "1" if shutil.which("g++") else "0"
    seed = campaign_seed()
    cmd = [sys.executable, str(REPO / "scripts" / "campaigns" / "preemption_campaign.py"), "--trials", "8",
           "--compile-trials", compile_trials, "--seed", seed, "--dump-folder", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(
        list(map(str, cmd)), cwd=REPO, capture_output=True, text=True, timeout=2400
    )
    assert proc.returncode == 0, f"seed {seed}:\n" + proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "failed 0" in proc.stdout and "PASS" in proc.stdout


# ---- dead and hung ranks ----------------------------------------------------------------


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
                found += [int(entry.name)] if process_alive(int(entry.name)) else []
        except OSError:
            pass
    return [p for p in found if p != os.getpid()]


def _rank_pids(launcher: int) -> dict[int, int]:
    """{rank: pid} of torchrun's children, from their environment."""
    out = {}
    for pid in child_pids(launcher):
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


def _start_fault_job(tmp_path: Path) -> tuple[Path, Path, subprocess.Popen]:
    """A 2-rank FAULT_JOB under torchrun, logging to a file: (its dump, its log, torchrun)."""
    dump, log = tmp_path / "job", tmp_path / "job.log"
    cmd = torchrun_command(2, [*FAULT_JOB, "--job.dump_folder", dump])
    with open(log, "w") as out:
        launcher = subprocess.Popen(cmd, cwd=REPO, env=run_env(), stdout=out, stderr=out)
    return dump, log, launcher


@pytest.mark.slow
def test_a_killed_launcher_stops_its_ranks_and_the_relaunch_is_exact(tmp_path, uninterrupted):
    """torchrun alone is killed -9 after step 4 of 10 (2 ranks, each with a loader worker):
    its ranks, each in a session of its own, notice within a second, stop after the same
    step as on SIGTERM, write that step's checkpoint and exit; no process of the job is
    left within 15 s. The relaunch resumes from that step, not from the last one, to
    losses equal to an uninterrupted run's. Negative control (the launcher watch off):
    the orphaned ranks train on to step 10, so no step before it is the newest."""
    dump, log, launcher = _start_fault_job(tmp_path)
    try:
        assert _wait(lambda: _steps_logged(dump) >= 4, 240) is not None, log.read_text()
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        took = _wait(lambda: not _job_processes(dump), 15)
        assert took is not None, f"left after 15 s: {_job_processes(dump)}\n{log.read_text()}"
    finally:
        for pid in _job_processes(dump):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    text = log.read_text()
    step = preempted_step(text)
    assert 4 <= step < 10 and "the launcher (pid" in text, text[-3000:]
    assert complete_steps(str(dump / "checkpoint"))[-1] == step
    relaunch = torchrun([*FAULT_JOB, "--job.dump_folder", dump])
    assert relaunch.returncode == 0, relaunch.stderr[-3000:]
    assert f"step-{step}" in relaunch.stderr.split("loaded checkpoint", 1)[1][:300]
    assert losses(dump) == uninterrupted


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
    dump, log, launcher = _start_fault_job(tmp_path)
    try:
        assert _wait(lambda: _steps_logged(dump) >= 3, 240) is not None, log.read_text()
        ranks = _rank_pids(launcher.pid)
        os.kill(ranks[1], getattr(signal, fault))
        limit = 10 + 8 if fault == "SIGSTOP" else 0.1 + 5 + 1  # monitor interval + 5 s + slack
        took = _wait(lambda: not process_alive(ranks[0]), limit)
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
