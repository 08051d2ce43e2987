"""CheckpointManager as train.py drives it: choosing, verifying, loading, refusing.

One in-process rank (``train.main``) for what does not depend on the rank count; the
dataloader's per-rank entries go through real DCP under real torchrun.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
from conftest import error_lines, losses, torchrun, train_here

from torchtitan.checkpoint import MANIFEST, complete_steps, verify_checkpoint

CK = ["--checkpoint.enable_checkpoint"]


def test_dataloader_through_dcp_into_a_never_iterated_loader(tmp_path, tiny_corpus):
    """2 ranks, 0 and then 2 workers each: every rank's entry survives DCP, and a fresh
    loader given them yields exactly what the original yielded next."""
    proc = torchrun([str(tiny_corpus), str(tmp_path)], script="test/dist/dataloader_dcp.py")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count("restored exactly") == 4


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """7 steps, a checkpoint every 3, keep the latest 2: expect step-6 and step-7 (the last)."""
    dump = tmp_path_factory.mktemp("ck") / "run"
    train_here(dump, "--training.steps", 7, *CK, "--checkpoint.interval", 3,
               "--checkpoint.keep_latest_k", 2)  # fmt: skip
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
    assert manifest["step"] == 7 and manifest["world_size"] == 1
    assert {"sources", "tokenizer_sha256", "seq_len", "seed"} <= set(manifest["data_fingerprint"])
    assert verify_checkpoint(str(folder / "step-7")) is None


def test_load_step_and_a_missing_step(trained, tmp_path):
    dump = copy_run(trained, tmp_path)
    _, log = train_here(dump, "--training.steps", 7, *CK, "--checkpoint.interval", 3,
                        "--checkpoint.load_step", 6)  # fmt: skip
    assert "step-6" in log and "loaded checkpoint" in log
    assert sorted(losses(dump)) == list(range(1, 8))
    assert losses(dump)[7] == losses(trained)[7]  # re-running step 7 from step 6 is exact

    status, log = train_here(dump, "--training.steps", 7, *CK, "--checkpoint.load_step", 3,
                             expect_ok=False)  # fmt: skip
    errors = error_lines(log)
    assert status == 1 and len(errors) == 1
    assert "no complete checkpoint step-3" in errors[0] and "complete steps: [6, 7]" in errors[0]


def test_exclude_from_loading_restarts_the_data(trained, tmp_path):
    dump = copy_run(trained, tmp_path)
    _, log = train_here(dump, "--training.steps", 9, *CK, "--checkpoint.interval", 3,
                        "--checkpoint.exclude_from_loading", "dataloader")  # fmt: skip
    assert "not loading dataloader" in log
    assert "(model, optimizer, lr_scheduler, train_state, rng)" in log


def test_seed_checkpoint_gives_the_same_start(tmp_path):
    seeded = tmp_path / "seeded"
    train_here(seeded, *CK, "--checkpoint.create_seed_checkpoint")
    assert complete_steps(str(seeded / "checkpoint")) == [0]
    _, log = train_here(seeded, "--training.steps", 3, *CK)
    assert "step-0 (model)" in log
    train_here(tmp_path / "plain", "--training.steps", 3)
    train_here(tmp_path / "other", "--training.steps", 3, "--training.seed", 5)
    assert losses(seeded) == losses(tmp_path / "plain")
    assert losses(tmp_path / "other") != losses(tmp_path / "plain"), "the check can fail"


def test_damaged_checkpoint_is_named_and_fallback_is_loud(trained, tmp_path):
    dump = copy_run(trained, tmp_path)
    shard = dump / "checkpoint" / "step-7" / "__0_0.distcp"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    status, log = train_here(dump, "--training.steps", 7, *CK, expect_ok=False)
    errors = error_lines(log)
    assert status == 1 and len(errors) == 1
    assert "__0_0.distcp" in errors[0] and "truncated" in errors[0]
    assert "--checkpoint.load_step 6" in errors[0]

    _, log = train_here(dump, "--training.steps", 7, *CK, "--checkpoint.fallback_on_corruption")
    assert "IS DAMAGED" in log and "step-6" in log
    assert losses(dump)[7] == losses(trained)[7]


def test_a_flipped_byte_is_caught_by_the_checksum(trained, tmp_path):
    dump = copy_run(trained, tmp_path)
    shard = dump / "checkpoint" / "step-7" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the CRC can see it
    shard.write_bytes(bytes(data))
    assert "fails its checksum" in verify_checkpoint(str(dump / "checkpoint" / "step-7"))


def test_incomplete_checkpoint_is_ignored_and_removed(trained, tmp_path):
    dump = copy_run(trained, tmp_path)
    folder = dump / "checkpoint"
    os.rename(folder / "step-7", folder / "step-7.partial")  # as if killed before the rename
    _, log = train_here(dump, "--training.steps", 7, *CK)
    assert "ignoring and removing incomplete checkpoint" in log
    assert "step-6" in log
    assert losses(dump)[7] == losses(trained)[7]
    assert complete_steps(str(folder)) == [6, 7]


def test_changed_data_settings_are_refused(trained, tmp_path):
    dump = copy_run(trained, tmp_path)
    status, log = train_here(dump, "--training.steps", 7, *CK, "--training.seed", 43,
                             expect_ok=False)  # fmt: skip
    errors = error_lines(log)
    assert status == 1 and len(errors) == 1
    assert "seed: 42 -> 43" in errors[0] and "accept_data_change" in errors[0]
