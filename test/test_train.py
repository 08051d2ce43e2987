"""End-to-end: the acceptance script on real `torchrun` jobs (2 ranks, gloo, real DCP), and
the resume guarantees it checks, each next to a negative control that breaks them.

Multi-rank properties (FSDP and DDP sharded state, async saves on their own gloo group,
loader workers, elastic layouts) run under torchrun; single-rank properties run
in-process through ``train.main`` (same code, no interpreter start-up).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from conftest import (
    REPO,
    assert_exactly_once,
    error_lines,
    losses,
    read_jsonl,
    run_main,
    train,
    train_here,
)

from torchtitan import metrics
from torchtitan.resume_check import main as resume_check
from torchtitan.runs import RunRecordError


def in_process(nproc: int, argv: list[str]) -> tuple[int, str]:
    """A launcher for resume_check: 1-rank jobs run here, through train.main."""
    assert nproc == 1, "in-process runs have one rank"
    return run_main(argv)


def check(tmp_path, *args) -> int:
    return resume_check(["--dump-folder", str(tmp_path / "dr"), "--nproc", "1", *args], in_process)


# ---- the acceptance script, as shipped, on 2 ranks with everything switched on ----------


def test_deterministic_resume_script_with_workers_dropout_mixing_and_async(tmp_path):
    """12 steps on 2 FSDP ranks with 2 loader workers each, dropout, a two-source mix and
    async checkpoints; delete step-12 and step-9, resume from step-6: steps 7..12 bit-equal,
    the same data in the same order, every token once."""
    cmd = [
        sys.executable, str(REPO / "scripts" / "deterministic_resume.py"),
        "--dump-folder", str(tmp_path / "dr"), "--steps", "12", "--interval", "3", "--delete", "2",
        "--training.num_workers", "2", "--model.dropout", "0.1",
        "--training.datasets", "shakespeare:0.7,kjv:0.3", "--checkpoint.async_mode", "async",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    out = proc.stdout
    assert proc.returncode == 0 and "PASS" in out, out[-4000:] + proc.stderr[-2000:]
    assert "loaded checkpoint" in out and "step-6" in out
    assert out.count(" yes") == 6
    assert "provenance of the resumed run equals the first run's: True" in out
    assert (tmp_path / "dr" / "loss_curves.png").stat().st_size > 0
    log = (tmp_path / "dr" / "runs.log").read_text()
    assert "staging and writing in the background" in log
    records = read_jsonl(tmp_path / "dr" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 13))
    expected = {"loss", "grad_norm", "lr", "tokens_per_s", "step_ms", "data_wait_ms", "memory_gib"}
    assert expected <= set(records[0])
    assert records[-1]["loss"] < records[0]["loss"], "the model learns"


# ---- the same comparison on one in-process rank, with its negative controls ------------


def test_resume_check_passes_and_fails_when_a_component_is_not_restored(tmp_path):
    """resume_check passes on an exact resume and fails when the resume is broken: not
    loading the data position (the model then sees other batches), or the optimizer."""
    common = ["--steps", "6", "--interval", "2", "--delete", "1"]
    assert check(tmp_path, *common) == 0
    assert check(tmp_path, *common, "--checkpoint.exclude_from_loading", "dataloader") == 1
    assert check(tmp_path, *common, "--checkpoint.exclude_from_loading", "optimizer") == 1


def test_resume_at_every_checkpoint_across_epochs(tmp_path, tiny_corpus):
    """A new process at every checkpoint on a corpus of ~1 step per epoch, so resumes land
    before, at and after epoch boundaries; every step and its data equal one uninterrupted
    run. Negative control: the same chain without restoring the RNG, under dropout, fails."""
    args = [
        "--resume-every", "--steps", "8", "--interval", "2", "--model.dropout", "0.1",
        "--training.dataset_path", str(tiny_corpus), "--training.data_shards", "4",
        "--training.seq_len", "32",
    ]  # fmt: skip
    assert check(tmp_path, *args) == 0
    assert check(tmp_path, *args, "--checkpoint.exclude_from_loading", "rng") == 1


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
            monkeypatch.setattr(metrics, "truncate_jsonl_after", lambda path, step: None)
        train_here(dump, *common)
    assert losses(tmp_path / "a") == losses(tmp_path / "ref")
    assert sorted(losses(tmp_path / "a")) == list(range(1, 7))
    assert_exactly_once(tmp_path / "a")
    with pytest.raises(RunRecordError, match="step 4 appears out of order"):
        losses(tmp_path / "b")


# ---- elastic: other layouts, every token once -----------------------------------------


def test_elastic_chain_ranks_and_workers(tmp_path):
    """2 ranks x 0 workers -> 1 rank x 2 workers -> 2 ranks x 0 workers, global batch 8.

    Covers save at 2 -> resume at 1, save at 1 -> resume at 2, workers 0 -> 2 and 2 -> 0,
    and the exactly-once provenance check over the whole chain."""
    common = ["--training.steps", 9, "--checkpoint.enable_checkpoint", "--checkpoint.interval", 3,
              "--metrics.data_provenance"]  # fmt: skip
    train(tmp_path, *common, "--training.stop_at_step", 3, "--training.batch_size", 4)
    proc = train(tmp_path, *common, "--training.stop_at_step", 6, "--training.batch_size", 8,
                 "--training.num_workers", 2, nproc=1)  # fmt: skip
    assert "resharding data state from 2x0 to 1x2" in proc.stderr
    proc = train(tmp_path, *common, "--training.batch_size", 4)
    assert "resharding data state from 1x2 to 2x0" in proc.stderr
    assert sorted(losses(tmp_path)) == list(range(1, 10))
    assert_exactly_once(tmp_path)


# ---- DDP, and errors on every rank ------------------------------------------------------


def test_ddp_resumes_exactly_and_a_damaged_checkpoint_stops_every_rank(tmp_path):
    """DDP (instead of FSDP2) checkpoints and resumes bit-exactly on 2 ranks; a damaged
    shard then stops both ranks with one line each that names the file and the fix."""
    common = ["--training.steps", 4, "--checkpoint.enable_checkpoint", "--checkpoint.interval", 2,
              "--training.data_parallel", "ddp"]  # fmt: skip
    train(tmp_path, *common)
    reference = losses(tmp_path)
    shutil.rmtree(tmp_path / "checkpoint" / "step-4")
    proc = train(tmp_path, *common)
    assert "step-2" in proc.stderr and "loaded checkpoint" in proc.stderr
    assert losses(tmp_path) == reference

    shard = tmp_path / "checkpoint" / "step-4" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    proc = train(tmp_path, *common, expect_ok=False)
    errors = error_lines(proc.stderr)
    assert proc.returncode != 0 and len(errors) == 2, proc.stderr[-3000:]
    assert {e.split("]")[0] for e in errors} == {"[rank0", "[rank1"}
    assert all("__1_0.distcp" in e and "--checkpoint.load_step 2" in e for e in errors)
