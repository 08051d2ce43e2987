"""CheckpointManager and the dataloader through real DCP, under real torchrun."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from conftest import read_jsonl, torchrun
from test_train import losses, train

from torchtitan.checkpoint import MANIFEST, complete_steps, verify_checkpoint

CK = ["--checkpoint.enable_checkpoint"]


@pytest.mark.parametrize("workers", [0, 2])
def test_dataloader_through_dcp_into_a_never_iterated_loader(tmp_path, tiny_corpus, workers):
    proc = torchrun(
        [str(tiny_corpus), str(tmp_path / "ckpt"), str(workers)],
        script="test/dist/dataloader_dcp.py",
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count("restored exactly") == 2


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """7 steps, a checkpoint every 3, keep the latest 2: expect step-6 and step-7 (the last)."""
    dump = tmp_path_factory.mktemp("ck") / "run"
    train(
        dump,
        "--training.steps",
        7,
        *CK,
        "--checkpoint.interval",
        3,
        "--checkpoint.keep_latest_k",
        2,
    )
    return dump


def copy_run(trained, tmp_path):
    dump = tmp_path / "run"
    shutil.copytree(trained, dump)
    return dump


def test_interval_last_step_and_keep_latest_k(trained):
    folder = trained / "checkpoint"
    assert complete_steps(str(folder)) == [6, 7]
    assert not [n for n in os.listdir(folder) if n.endswith(".partial")]
    manifest = json.loads((folder / "step-7" / MANIFEST).read_text())
    assert manifest["step"] == 7 and manifest["world_size"] == 2
    assert {"sources", "tokenizer_sha256", "seq_len", "seed"} <= set(manifest["data_fingerprint"])
    assert verify_checkpoint(str(folder / "step-7")) is None


def test_load_step_and_a_missing_step(trained, tmp_path):
    dump = copy_run(trained, tmp_path)
    proc = train(
        dump, "--training.steps", 7, *CK, "--checkpoint.interval", 3, "--checkpoint.load_step", 6
    )
    assert "step-6" in proc.stderr and "loaded checkpoint" in proc.stderr
    assert sorted(losses(dump)) == list(range(1, 8))
    assert losses(dump)[7] == losses(trained)[7]  # re-running step 7 from step 6 is exact

    proc = train(dump, "--training.steps", 7, *CK, "--checkpoint.load_step", 3, expect_ok=False)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 2, "every rank names the problem"
    assert "no complete checkpoint step-3" in errors[0] and "complete steps: [6, 7]" in errors[0]


def test_exclude_from_loading_restarts_the_data(trained, tmp_path):
    dump = copy_run(trained, tmp_path)
    proc = train(
        dump, "--training.steps", 9, *CK, "--checkpoint.interval", 3,
        "--checkpoint.exclude_from_loading", "dataloader", "--checkpoint.accept_data_change",
    )  # fmt: skip
    assert "not loading dataloader" in proc.stderr
    assert "(model, optimizer, lr_scheduler, train_state, rng)" in proc.stderr


def test_async_checkpoint_resumes_exactly(tmp_path):
    common = [
        "--training.steps",
        10,
        *CK,
        "--checkpoint.interval",
        5,
        "--checkpoint.async_mode",
        "async",
    ]
    train(tmp_path, *common)
    reference = losses(tmp_path)
    shutil.rmtree(tmp_path / "checkpoint" / "step-10")
    proc = train(tmp_path, *common)
    assert "step-5" in proc.stderr and "staging and writing in the background" in proc.stderr
    assert losses(tmp_path) == reference
    assert complete_steps(str(tmp_path / "checkpoint")) == [5, 10]


def test_seed_checkpoint_gives_the_same_start(tmp_path):
    seeded = tmp_path / "seeded"
    proc = torchrun(
        [
            *CONFIG_ARGS,
            "--job.dump_folder",
            str(seeded),
            *CK,
            "--checkpoint.create_seed_checkpoint",
        ],
        nproc=1,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert complete_steps(str(seeded / "checkpoint")) == [0]
    proc = train(seeded, "--training.steps", 3, *CK)
    assert "step-0 (model)" in proc.stderr
    train(tmp_path / "plain", "--training.steps", 3)
    assert losses(seeded) == losses(tmp_path / "plain")


CONFIG_ARGS = ["--job.config_file", "train_configs/debug_model.toml"]


def test_damaged_checkpoint_is_named_and_fallback_is_loud(trained, tmp_path):
    dump = copy_run(trained, tmp_path)
    shard = dump / "checkpoint" / "step-7" / "__1_0.distcp"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    proc = train(dump, "--training.steps", 7, *CK, expect_ok=False)
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 2
    assert (
        "__1_0.distcp" in errors[0]
        and "truncated" in errors[0]
        and "--checkpoint.load_step 6" in errors[0]
    )

    proc = train(dump, "--training.steps", 7, *CK, "--checkpoint.fallback_on_corruption")
    assert "IS DAMAGED" in proc.stderr and "step-6" in proc.stderr
    assert losses(dump)[7] == losses(trained)[7]


def test_incomplete_checkpoint_is_ignored_and_removed(trained, tmp_path):
    dump = copy_run(trained, tmp_path)
    folder = dump / "checkpoint"
    os.rename(folder / "step-7", folder / "step-7.partial")  # as if killed before the rename
    proc = train(dump, "--training.steps", 7, *CK)
    assert "ignoring and removing incomplete checkpoint" in proc.stderr
    assert "step-6" in proc.stderr
    assert losses(dump)[7] == losses(trained)[7]
    assert complete_steps(str(folder)) == [6, 7]


def test_changed_data_settings_are_refused(trained, tmp_path):
    dump = copy_run(trained, tmp_path)
    proc = train(dump, "--training.steps", 7, *CK, "--training.seed", 43, expect_ok=False)
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 2 and "seed: 42 -> 43" in errors[0] and "accept_data_change" in errors[0]


def test_metrics_file_describes_the_run_as_it_finally_counts(trained):
    steps = [r["step"] for r in read_jsonl(trained / "metrics.jsonl")]
    assert steps == list(range(1, 8))
