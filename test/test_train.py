"""End-to-end: real `torchrun` jobs (2 ranks, gloo) with real DCP checkpoints."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import REPO, read_jsonl, torchrun

from torchtitan.provenance import check_exactly_once, read_provenance

CONFIG = ["--job.config_file", "train_configs/debug_model.toml"]


def train(dump, *extra, nproc=2, expect_ok=True) -> subprocess.CompletedProcess:
    proc = torchrun([*CONFIG, "--job.dump_folder", str(dump), *map(str, extra)], nproc=nproc)
    if expect_ok:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def losses(dump) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(os.path.join(dump, "metrics.jsonl"))}


def assert_exactly_once(dump):
    reports = check_exactly_once(read_provenance(os.path.join(dump, "provenance")))
    assert reports and all(r.duplicate_tokens == 0 and r.gaps == 0 for r in reports.values()), (
        reports
    )


def test_debug_model_learns_and_is_reproducible(tmp_path):
    train(tmp_path / "a", "--training.steps", 20)
    train(tmp_path / "b", "--training.steps", 20)
    records = read_jsonl(tmp_path / "a" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 21))
    assert {
        "loss",
        "grad_norm",
        "lr",
        "tokens_per_s",
        "step_ms",
        "data_wait_ms",
        "memory_gib",
    } <= set(records[0])
    a = losses(tmp_path / "a")
    assert a[20] < a[1]
    assert a == losses(tmp_path / "b")


def resume_script(tmp_path, *args, timeout=600) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        str(REPO / "scripts" / "deterministic_resume.py"),
        "--dump-folder",
        str(tmp_path / "dr"),
        *args,
    ]
    proc = subprocess.run(
        cmd,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0 and "PASS" in proc.stdout, proc.stdout[-4000:] + proc.stderr[-2000:]
    return proc


def test_deterministic_resume_script(tmp_path):
    """The acceptance test as shipped: 30 steps, delete 20/25/30, resume from 15, bit-exact."""
    out = resume_script(tmp_path).stdout
    assert "loaded checkpoint" in out and "step-15" in out
    assert out.count(" yes") == 15
    assert (tmp_path / "dr" / "loss_curves.png").stat().st_size > 0


def test_resume_with_workers_dropout_and_mixing(tmp_path):
    resume_script(
        tmp_path, "--steps", "20", "--interval", "5", "--delete", "2",
        "--training.num_workers", "2", "--model.dropout", "0.1",
        "--training.datasets", "shakespeare:0.7,kjv:0.3",
    )  # fmt: skip


def test_resume_at_every_checkpoint_across_epochs(tmp_path, tiny_corpus):
    """A new process at every checkpoint (3 resumes) on a corpus of ~1 step per epoch,
    so resumes land before, at and after epoch boundaries; every step is bit-exact."""
    resume_script(
        tmp_path, "--resume-every", "--steps", "8", "--interval", "2",
        "--training.dataset_path", str(tiny_corpus), "--training.data_shards", "4",
        "--training.seq_len", "32",
    )  # fmt: skip


def test_elastic_resume_script_sees_every_token_once(tmp_path):
    """deterministic_resume.py --resume-nproc: 2 ranks -> 1, checked by provenance."""
    args = ["--nproc", "2", "--resume-nproc", "1", "--steps", "20", "--delete", "2"]
    out = resume_script(tmp_path, *args).stdout
    assert "resharding data state from 2x0 to 1x0" in out


def test_elastic_chain_ranks_and_workers(tmp_path):
    """2 ranks x 0 workers -> 1 rank x 2 workers -> 2 ranks x 0 workers, global batch 8.

    Covers save at 2 -> resume at 1, save at 1 -> resume at 2, workers 0 -> 2 and 2 -> 0."""
    common = [
        "--training.steps",
        15,
        "--checkpoint.enable_checkpoint",
        "--checkpoint.interval",
        5,
        "--metrics.data_provenance",
    ]
    train(tmp_path, *common, "--training.stop_at_step", 5, "--training.batch_size", 4)
    proc = train(
        tmp_path,
        *common,
        "--training.stop_at_step",
        10,
        "--training.batch_size",
        8,
        "--training.num_workers",
        2,
        nproc=1,
    )
    assert "resharding data state from 2x0 to 1x2" in proc.stderr
    proc = train(tmp_path, *common, "--training.batch_size", 4)
    assert "resharding data state from 1x2 to 2x0" in proc.stderr
    assert sorted(losses(tmp_path)) == list(range(1, 16))
    assert_exactly_once(tmp_path)


def test_ddp_resumes_exactly(tmp_path):
    """The DDP wrapper (instead of FSDP2) checkpoints and resumes bit-exactly too."""
    args = ["--steps", "10", "--interval", "5", "--delete", "1", "--training.data_parallel", "ddp"]
    assert "step-5" in resume_script(tmp_path, *args).stdout
