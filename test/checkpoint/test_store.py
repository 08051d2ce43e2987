"""Checkpoints on an object store: the real S3 API of harness/s3.py (moto's server on
127.0.0.1), reached through fsspec/s3fs and the AWS_* variables as a job reaches a bucket.

Runs train.main in this process (one rank) where the rank count does not matter, and
torchrun (2 gloo ranks, slow tier) where it does. Each property has a negative control.
"""

from __future__ import annotations

import ast
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import (
    CONFIG,
    REPO,
    error_lines,
    losses,
    run_main,
    shim_env,
    torchrun,
    train_here,
)

from harness.s3 import local_s3, missing
from torchtitan.checkpoint import (
    MANIFEST,
    PENDING,
    complete_steps,
    read_manifest,
    verify_checkpoint,
)
from torchtitan.checkpoint import store as stores
from torchtitan.tools.launch import torchrun_command

CK = ["--checkpoint.enable_checkpoint", "--checkpoint.interval", 2]


@pytest.fixture(scope="module")
def bucket():
    reason = missing()
    if reason:
        pytest.skip(reason)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # the server's request log
    with local_s3() as (name, _):
        yield name


def s3fs():
    import s3fs as module

    return module.S3FileSystem()


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The per-step losses of 6 uninterrupted steps (one rank, no checkpoint)."""
    dump = tmp_path_factory.mktemp("reference")
    train_here(dump, "--training.steps", 6)
    return losses(dump)


@pytest.fixture(scope="module")
def on_bucket(bucket, tmp_path_factory) -> str:
    """A run that stopped at step 4 of 6, saving (async) to s3://<bucket>/run every 2 steps."""
    url = f"s3://{bucket}/run"
    train_here(tmp_path_factory.mktemp("on_bucket"), "--training.steps", 6, *CK,
               "--checkpoint.async_mode", "async", "--checkpoint.folder", url,
               "--training.stop_at_step", 4)  # fmt: skip
    return url


def copy_prefix(src: str, dst: str) -> str:
    s3fs().copy(src, dst, recursive=True)
    return dst


def resume(dump, url: str, *extra) -> str:
    _, log = train_here(dump, "--training.steps", 6, *CK, "--checkpoint.folder", url, *extra)
    return log


def loaded_step(log: str) -> int:
    line = next(x for x in log.splitlines() if "loaded checkpoint" in x)
    return int(line.split("/step-")[1].split()[0])


def test_a_run_on_a_bucket_resumes_bit_exactly(on_bucket, bucket, reference, tmp_path):
    """Saved async to the bucket (manifest last, signed by size and ETag), resumed from it
    to losses equal to an uninterrupted run's. Negative control: the same resume leaving
    the data position out differs (the comparison can fail)."""
    assert complete_steps(on_bucket) == [2, 4]
    manifest = read_manifest(f"{on_bucket}/step-4")
    assert manifest["step"] == 4 and {".metadata", "__0_0.distcp"} <= set(manifest["files"])
    assert all("etag" in sig for sig in manifest["files"].values())
    assert verify_checkpoint(f"{on_bucket}/step-4") is None

    url = copy_prefix(on_bucket, f"s3://{bucket}/exact")
    dump = tmp_path / "exact"
    log = resume(dump, url)
    assert loaded_step(log) == 4 and f"{url}/step-4" in log
    assert "(1.000x) in" in log, "read by the store reader, each byte once"
    assert losses(dump) == {s: v for s, v in reference.items() if s > 4}
    assert not (dump / "checkpoint").exists(), "nothing written to the local dump folder"

    url = copy_prefix(on_bucket, f"s3://{bucket}/control")
    dump = tmp_path / "control"
    resume(dump, url, "--checkpoint.exclude_from_loading", "dataloader")
    assert losses(dump) != {s: v for s, v in reference.items() if s > 4}


def test_a_step_without_its_manifest_is_never_chosen(on_bucket, bucket, reference, tmp_path):
    """A ``step-4/`` whose manifest is missing (an upload killed before rank 0 wrote it)
    is not listed, not resumed from, and removed at the next start: the resume takes
    step-2 and is exact. Negative control: with the manifest, step-4 is chosen."""
    url = copy_prefix(on_bucket, f"s3://{bucket}/torn")
    s3fs().rm_file(f"{url}/step-4/{MANIFEST}")
    assert complete_steps(url) == [2]
    dump = tmp_path / "torn"
    log = resume(dump, url)
    assert loaded_step(log) == 2 and "removing incomplete checkpoint" in log
    assert losses(dump) == {s: v for s, v in reference.items() if s > 2}
    assert complete_steps(url) == [2, 4, 6], "step-4 written again, whole"

    url = copy_prefix(on_bucket, f"s3://{bucket}/whole")
    assert loaded_step(resume(tmp_path / "whole", url)) == 4


def test_an_upload_killed_after_its_data_is_finished_on_restart(on_bucket, bucket, tmp_path):
    """Killed after every rank's data and DCP's ``.metadata`` were uploaded, before the
    manifest (the pending one is there): the restart signs the files, writes the manifest
    and resumes from step-4. Negative control: without DCP's ``.metadata`` it is removed
    and step-2 is taken."""
    for name, drop, step in (("finished", MANIFEST, 4), ("unfinished", ".metadata", 2)):
        url = copy_prefix(on_bucket, f"s3://{bucket}/{name}")
        manifest = read_manifest(f"{url}/step-4")
        manifest.pop("files")
        fs = s3fs()
        fs.pipe_file(f"{url}/step-4/{PENDING}", json.dumps(manifest).encode())
        fs.rm_file(f"{url}/step-4/{MANIFEST}")
        if drop != MANIFEST:
            fs.rm_file(f"{url}/step-4/{drop}")
        assert complete_steps(url) == [2]
        log = resume(tmp_path / name, url)
        assert loaded_step(log) == step, log
        if step == 4:
            assert "finishing checkpoint" in log
            assert verify_checkpoint(f"{url}/step-4") is None


def test_a_replaced_object_is_named_before_loading(on_bucket, bucket, tmp_path):
    """An object changed after the manifest was written (same size, other bytes: another
    ETag) stops the start with one line naming it. Negative control: the untouched copy
    verifies."""
    url = copy_prefix(on_bucket, f"s3://{bucket}/replaced")
    assert verify_checkpoint(f"{url}/step-4") is None
    fs, name = s3fs(), f"{url}/step-4/__0_0.distcp"
    data = bytearray(fs.cat_file(name))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(name, bytes(data))
    status, log = train_here(tmp_path / "replaced", "--training.steps", 6, *CK,
                             "--checkpoint.folder", url, expect_ok=False)  # fmt: skip
    errors = error_lines(log)
    assert status == 1 and len(errors) == 1 and "__0_0.distcp was replaced" in errors[0], log


def test_a_delete_or_a_set_aside_touches_that_folder_only(bucket):
    """On a store a folder is a key prefix: deleting ``step-4`` (manifest first) must not
    take ``step-40`` or ``step-4.abandoned`` with it, and setting ``step-40`` aside moves
    every object. Control: ``step-4`` itself is gone."""
    from torchtitan.checkpoint.folder import remove_checkpoint, set_aside

    url = f"s3://{bucket}/prefixes"
    names = ["step-4/a", f"step-4/{MANIFEST}", "step-40/a", f"step-40/{MANIFEST}",
             "step-4.abandoned/a"]  # fmt: skip
    for name in names:
        s3fs().pipe_file(f"{url}/{name}", b"x")
    remove_checkpoint(f"{url}/step-4")
    assert complete_steps(url) == [40]
    assert set_aside(f"{url}/step-40") == f"{url}/step-40.abandoned"
    left = sorted(p.split("/prefixes/", 1)[1] for p in s3fs().find(f"{bucket}/prefixes"))
    assert left == ["step-4.abandoned/a", "step-40.abandoned/a", f"step-40.abandoned/{MANIFEST}"]


def test_an_unreachable_bucket_is_one_line_at_start(bucket, tmp_path):
    """A bucket that does not exist: one line naming the folder and the fix, at start."""
    status, log = train_here(tmp_path, "--training.steps", 2, *CK,
                             "--checkpoint.folder", f"s3://{bucket}-absent/run", expect_ok=False)  # fmt: skip
    errors = error_lines(log)
    assert status == 1 and len(errors) == 1 and "does not exist" in errors[0], log
    assert f"checkpoint folder s3://{bucket}-absent/run" in errors[0]


# A probe around the real DCP writer: SIGKILL this process once DCP is about to write the
# ``.metadata`` of the save named by KILL_SAVE, i.e. after the rank's data is uploaded.
KILL_SHIM = """
import os, signal
from torch.distributed.checkpoint import filesystem

from torchtitan.checkpoint import store_writer

def killing(writer):
    _finish = writer.finish

    def finish(self, metadata, results):
        if str(self.path).rstrip("/").endswith(os.environ["KILL_SAVE"]):
            os.kill(os.getpid(), signal.SIGKILL)
        return _finish(self, metadata, results)

    writer.finish = finish

killing(filesystem.FileSystemWriter)
killing(store_writer.StoreWriter)  # the writer on s3:// (store_writer.py)
"""


@pytest.mark.slow
def test_a_save_killed_mid_upload_is_never_chosen(bucket, reference, tmp_path):
    """``kill -9`` of the job while step-4 is being uploaded (its data is in the bucket,
    DCP's ``.metadata`` and the manifest are not): step-4 is not complete, the relaunch
    resumes from step-2 and its losses equal an uninterrupted run's. (Its negative
    control, a step-4 holding its manifest being chosen, is the fast test's.)"""
    url = f"s3://{bucket}/killed"
    args = [*CONFIG, "--job.dump_folder", tmp_path / "killed", "--training.steps", 6, *CK,
            "--checkpoint.folder", url]  # fmt: skip
    env = shim_env(tmp_path / "shim", KILL_SHIM, KILL_SAVE="step-4")
    proc = subprocess.run([sys.executable, "train.py", *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert complete_steps(url) == [2]
    names = {p.rsplit("/", 1)[1] for p in s3fs().ls(f"{url}/step-4", refresh=True)}
    assert "__0_0.distcp" in names and MANIFEST not in names, names
    log = resume(tmp_path / "killed", url)
    assert loaded_step(log) == 2
    assert losses(tmp_path / "killed") == reference


@pytest.mark.slow
def test_two_ranks_save_to_a_bucket_and_resume_exactly(bucket, tmp_path):
    """2 gloo ranks under torchrun, async saves to the bucket: each rank uploads its own
    shard, the manifest names both ranks' files, and the resume (a new launch) equals an
    uninterrupted 2-rank run. Negative control: the resume without the data position
    differs."""
    url = f"s3://{bucket}/two"
    common = [*CONFIG, "--training.steps", 6, *CK, "--checkpoint.async_mode", "async"]
    runs = {
        "ref": [*common, "--job.dump_folder", tmp_path / "ref"],
        "first": [*common, "--job.dump_folder", tmp_path / "run", "--checkpoint.folder", url,
                  "--training.stop_at_step", 4],
        "resume": [*common, "--job.dump_folder", tmp_path / "run", "--checkpoint.folder", url],
    }  # fmt: skip
    for name, args in runs.items():
        proc = torchrun(list(map(str, args)))
        assert proc.returncode == 0, f"{name}: {proc.stderr[-3000:]}"
        if name == "first":
            files = read_manifest(f"{url}/step-4")["files"]
            assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(files)
    assert "step-4" in proc.stderr.split("loaded checkpoint", 1)[1][:300]
    assert losses(tmp_path / "run") == losses(tmp_path / "ref")
    expected = {s: v for s, v in losses(tmp_path / "ref").items() if s > 4}

    control = [*common, "--job.dump_folder", tmp_path / "control", "--checkpoint.folder",
               copy_prefix(url, f"s3://{bucket}/two-control"), "--checkpoint.load_step", 4,
               "--checkpoint.exclude_from_loading", "dataloader"]  # fmt: skip
    assert torchrun(list(map(str, control))).returncode == 0
    assert losses(tmp_path / "control") != expected


def test_no_store_variable_comes_from_the_config():
    """Credentials and endpoint only from the AWS_* variables: no config key names them."""
    from torchtitan.config import JobConfig

    keys = str(JobConfig().to_dict()).lower()
    assert "endpoint" not in keys and "aws" not in keys and "secret" not in keys


def first_loss(dump) -> float:
    return losses(dump)[1]


def test_initial_weights_and_a_hf_export_from_a_bucket(on_bucket, bucket, tmp_path):
    """``checkpoint.initial_load_path s3://.../step-4`` (written on the store, signed by
    ETags) starts a run from the same weights as the local step-4 of the same training
    (equal first loss); so does a HF export written to the bucket and read back from it
    (``initial_load_format hf``). Negative controls: a fresh start's first loss differs,
    and a step that is not in the bucket is one line."""
    pytest.importorskip("safetensors")
    from torchtitan.hf import export

    local = tmp_path / "local"
    train_here(local, "--training.steps", 6, *CK, "--training.stop_at_step", 4)
    one = ["--training.steps", 1]
    train_here(tmp_path / "from_local", *one, "--checkpoint.initial_load_path",
               local / "checkpoint" / "step-4")  # fmt: skip
    _, log = train_here(tmp_path / "from_s3", *one, "--checkpoint.initial_load_path",
                        f"{on_bucket}/step-4")  # fmt: skip
    assert f"model weights from {on_bucket}/step-4 (dcp)" in log
    assert first_loss(tmp_path / "from_s3") == first_loss(tmp_path / "from_local")

    export(f"{on_bucket}/step-4", f"s3://{bucket}/hf")
    assert {"config.json", "model.safetensors"} <= {
        p.rsplit("/", 1)[1] for p in s3fs().ls(f"{bucket}/hf", refresh=True)
    }
    train_here(tmp_path / "from_hf", *one, "--checkpoint.initial_load_path",
               f"s3://{bucket}/hf", "--checkpoint.initial_load_format", "hf")  # fmt: skip
    assert first_loss(tmp_path / "from_hf") == first_loss(tmp_path / "from_local")

    train_here(tmp_path / "scratch", *one)
    assert first_loss(tmp_path / "scratch") != first_loss(tmp_path / "from_local")
    status, log = train_here(tmp_path / "absent", *one, "--checkpoint.initial_load_path",
                             f"{on_bucket}/step-3", expect_ok=False)  # fmt: skip
    errors = error_lines(log)
    assert status == 1 and len(errors) == 1 and f"{on_bucket}/step-3" in errors[0], log


# ---- tiers: checkpoint.local_interval to a local folder, checkpoint.interval to the store --


@pytest.fixture(scope="module")
def tiered(bucket, tmp_path_factory) -> tuple:
    """8 steps stopped at 6: the local tier every 2 steps, the store every 4: local
    step-2 and step-6 (the stop), store step-4. Returns (dump, url, reference losses)."""
    root = tmp_path_factory.mktemp("tiered")
    train_here(root / "ref", "--training.steps", 8)
    url = f"s3://{bucket}/tiered"
    train_here(root / "run", *tier_args(url), "--training.stop_at_step", 6)
    return root / "run", url, losses(root / "ref")


def tier_args(url: str) -> list:
    """Async saves: the two tiers share one stager and never write at once."""
    return ["--training.steps", 8, "--checkpoint.enable_checkpoint", "--checkpoint.interval", 4,
            "--checkpoint.local_interval", 2, "--checkpoint.folder", url,
            "--checkpoint.async_mode", "async"]  # fmt: skip


def fresh_copy(tiered, bucket, tmp_path, name: str):
    """A copy of the tiered run (its dump with the local tier, its store prefix)."""
    dump, url, reference = tiered
    shutil.copytree(dump, tmp_path / name)
    return tmp_path / name, copy_prefix(url, f"s3://{bucket}/{name}"), reference


def test_the_local_tier_is_resumed_when_newer_and_the_store_once_it_is_wiped(
    tiered, bucket, tmp_path
):
    """Local step-6 is newer than the store's step-4: the resume takes it; with the local
    folder wiped (a new node), the store's step-4. Both finish equal to an uninterrupted
    run. Negative control: a local tier that lacks a rank's shard (the file gone) is not
    taken; the store's step-4 is, and the run is exact."""
    dump, url, _ = tiered
    assert complete_steps(str(dump / "checkpoint_local")) == [2, 6]
    assert complete_steps(url) == [4]

    dump, url, reference = fresh_copy(tiered, bucket, tmp_path, "newer")
    _, log = train_here(dump, *tier_args(url))
    assert f"{dump}/checkpoint_local/step-6" in log and loaded_step(log) == 6
    assert losses(dump) == reference
    assert complete_steps(url) == [4, 8], "the last step goes to the store"

    dump, url, reference = fresh_copy(tiered, bucket, tmp_path, "wiped")
    shutil.rmtree(dump / "checkpoint_local")
    _, log = train_here(dump, *tier_args(url))
    assert f"{url}/step-4" in log and loaded_step(log) == 4
    assert losses(dump) == reference

    dump, url, reference = fresh_copy(tiered, bucket, tmp_path, "shard")
    (dump / "checkpoint_local" / "step-6" / "__0_0.distcp").unlink()
    _, log = train_here(dump, *tier_args(url))
    assert "not every rank holds its files" in log and loaded_step(log) == 4, log
    assert losses(dump) == reference


def test_a_local_folder_or_a_dump_folder_that_is_a_url_is_refused(tmp_path):
    status, log = train_here(tmp_path, "--checkpoint.enable_checkpoint",
                             "--checkpoint.local_interval", 2,
                             "--checkpoint.local_folder", "s3://b/x", expect_ok=False)  # fmt: skip
    assert status != 0 and "checkpoint.local_folder 's3://b/x' is a URL" in log
    status, log = run_main([*CONFIG, "--job.dump_folder", "s3://b/run"])
    assert status != 0 and "set --checkpoint.folder to the URL" in log


# Another node's view of a node-local folder: rank 1 does not see the files rank 0 wrote
# there (it holds only its own). One machine cannot have two local disks; this hides
# rank 0's files from rank 1's listing and existence tests, nothing else.
OTHER_NODE_SHIM = """
import os
if os.environ.get("RANK") == "1" and os.environ.get("HIDE_UNDER"):
    from torchtitan.checkpoint import store

    _isfile = store.LocalStore.isfile

    def isfile(self, path):
        path = str(path)
        if path.startswith(os.environ["HIDE_UNDER"]) and os.path.basename(path).startswith("__0_"):
            return False
        return _isfile(self, path)

    store.LocalStore.isfile = isfile
"""


@pytest.mark.slow
def test_two_ranks_take_the_local_tier_only_when_both_hold_its_files(bucket, tmp_path):
    """2 gloo ranks, the local tier every 2 steps, the store every 4, stopped at 6: the
    relaunch resumes from local step-6 and equals an uninterrupted run. Negative control:
    where rank 1 does not see rank 0's shard in the local folder (another node's disk),
    both ranks agree (all-reduce) on the store's step-4, and the run is exact too."""
    common = [*CONFIG, *tier_args(f"s3://{bucket}/two-tiers")]
    ref = torchrun(list(map(str, [*CONFIG, "--training.steps", 8, "--job.dump_folder",
                                  tmp_path / "ref"])))  # fmt: skip
    assert ref.returncode == 0, ref.stderr[-3000:]
    first = torchrun(list(map(str, [*common, "--job.dump_folder", tmp_path / "run",
                                    "--training.stop_at_step", 6])))  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    shutil.copytree(tmp_path / "run", tmp_path / "other")
    copy_prefix(f"s3://{bucket}/two-tiers", f"s3://{bucket}/two-tiers-other")

    again = torchrun(list(map(str, [*common, "--job.dump_folder", tmp_path / "run"])))
    assert again.returncode == 0, again.stderr[-3000:]
    assert loaded_step(again.stderr) == 6 and "checkpoint_local/step-6" in again.stderr
    assert losses(tmp_path / "run") == losses(tmp_path / "ref")

    other = [*CONFIG, *tier_args(f"s3://{bucket}/two-tiers-other"), "--job.dump_folder",
             tmp_path / "other"]  # fmt: skip
    env = shim_env(tmp_path / "shim", OTHER_NODE_SHIM,
                   HIDE_UNDER=str(tmp_path / "other" / "checkpoint_local"))  # fmt: skip
    proc = subprocess.run(torchrun_command(2, list(map(str, other))), cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "not every rank holds its files" in proc.stderr and loaded_step(proc.stderr) == 4
    assert losses(tmp_path / "other") == losses(tmp_path / "ref")


def _tree(store, folder: str) -> dict:
    """{relative name: bytes} of every file under ``folder`` (a store's or a disk's)."""
    if stores.is_url(folder):
        fs = store.fs
        return {k[len(folder.split("://", 1)[1]) + 1 :]: fs.cat_file(k)
                for k in fs.find(folder, refresh=True)}  # fmt: skip
    return {str(p.relative_to(folder)): p.read_bytes() for p in Path(folder).rglob("*")
            if p.is_file()}  # fmt: skip


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_every_write_request_under_a_guarded_folder_asks_its_guard_first(kind, bucket, tmp_path):
    """A lease's folder (``storage.guard_writes``, as Lease.acquire registers it): every
    writer of the package (the list ``test_the_write_guard_covers_every_writer`` keeps
    whole) asks the guard first and sends nothing where it raises, a lapsed lease's
    LeaseLost: the stores' writes, removes, trees and moves (a folder of files: each
    copy asked), storage's records (a rewind's), DCP's writer (each file a rank writes)
    and a folder's upload. The folder's files are the same bytes after. (The slow
    two-job test's failure: a save's preparation deleted and wrote manifests 2.9 s past
    its deadline, its requests having waited behind a paused store's listings.) Reads,
    and writes elsewhere, pass; only the guard's own owner removes it. Negative control:
    unguarded, the same writes are sent."""
    import torch.distributed.checkpoint as dcp

    from torchtitan.checkpoint.lease import LeaseLost
    from torchtitan.io import storage

    folder = f"s3://{bucket}/guarded-{tmp_path.name}" if kind == "s3" else str(tmp_path / "guarded")
    store = stores.store_for(folder)
    store.makedirs(folder)
    store.write_bytes(stores.join(folder, "kept.json"), b"{}")
    store.makedirs(stores.join(folder, "a"))
    for name in ("__0_0.distcp", "manifest.json"):
        store.write_bytes(stores.join(folder, f"a/{name}"), b"x" * 10)
    local = tmp_path / "export"
    local.mkdir()
    (local / "config.json").write_text("{}")
    before = _tree(store, folder)

    def lapsed():
        raise LeaseLost("lost the lease")

    # In an order the control can send them in, unguarded: each folder made before a
    # write into it.
    writes = {
        "makedirs": lambda: store.makedirs(stores.join(folder, "step-1")),
        "write_bytes": lambda: store.write_bytes(stores.join(folder, "step-1/x.json"), b"{}"),
        "remove": lambda: store.remove(stores.join(folder, "kept.json")),
        "rmtree": lambda: store.rmtree(stores.join(folder, "a")),
        "move_folder": lambda: store.move_folder(stores.join(folder, "a"),
                                                 stores.join(folder, "b"), "manifest.json"),
        "storage.makedirs": lambda: storage.makedirs(stores.join(folder, "rewinds")),
        "publish": lambda: storage.publish(stores.join(folder, "rewinds/rewind-1.json"),
                                           lambda f: f.write(b"{}")),
        "storage.remove": lambda: storage.remove(stores.join(folder, "kept.json")),
        "dcp": lambda: dcp.save({"w": torch.ones(4)}, no_dist=True,
                                storage_writer=store.writer(stores.join(folder, "step-2"))),
        "upload_folder": lambda: stores.upload_folder(str(local), stores.join(folder, "hf"),
                                                      "config.json"),
    }  # fmt: skip
    storage.guard_writes(folder, lapsed)
    try:
        for name, write in writes.items():
            if kind == "s3" and name.endswith("makedirs"):
                continue  # a store has no folders: nothing is sent (the control checks)
            if kind == "local" and name == "upload_folder":
                continue  # an upload's target is a URL
            try:
                write()
            except BaseException as e:  # noqa: BLE001 - DCP wraps it in a BaseException
                assert "lost the lease" in str(e), name
            else:
                raise AssertionError(f"{name} was sent")
        assert _tree(store, folder) == before  # nothing was sent
        assert sorted(store.listdir(folder)) == ["a", "kept.json"]  # reads pass
        elsewhere = f"{folder}-other" if kind == "s3" else str(tmp_path / "other" / "f")
        if kind == "local":
            os.makedirs(os.path.dirname(elsewhere))
        store.write_bytes(elsewhere, b"{}")
        storage.unguard_writes(folder, lambda: None)  # not its owner: the guard stays
        with pytest.raises(LeaseLost):
            store.remove(stores.join(folder, "kept.json"))
    finally:
        storage.unguard_writes(folder, lapsed)
    kept = {"rmtree", "remove", "storage.remove"}  # what the other writes need stays
    for name, write in writes.items():  # control: unguarded, each is sent
        if name not in kept and (kind == "s3" or name != "upload_folder"):
            write()
    after = _tree(store, folder)
    sent = {"step-1/x.json", "b/manifest.json", "rewinds/rewind-1.json", "step-2/.metadata"}
    assert sent | ({"hf/config.json"} if kind == "s3" else set()) <= set(after)
    assert "a/manifest.json" not in after  # moved
    store.remove(stores.join(folder, "kept.json"))
    assert not store.isfile(stores.join(folder, "kept.json"))


# ---- every writer of the package, and why it is guarded or outside a leased folder ----
# A write primitive (a file opened for writing, a rename, a remove, a folder made, a
# store's PUT, copy or delete) called in a function that does not ask the write guard
# itself: the function, and why its writes never need the guard. Writers that ask it
# (``storage.before_write``) are not listed: they are found guarded.
UNGUARDED_WRITERS = {
    # The lease's own record: conditional on the record its writer saw (claims.py).
    "torchtitan/io/claims.py:_write_new": "a claim's record, written aside before its link",
    "torchtitan/io/claims.py:create": "an exclusive create (a link; If-None-Match)",
    "torchtitan/io/claims.py:take_over": "conditional on the stale record seen (If-Match)",
    "torchtitan/io/claims.py:touch": "conditional on this holder's record (If-Match)",
    "torchtitan/io/claims.py:release": "conditional on this holder's token (If-Match)",
    "torchtitan/io/storage.py:put_object": "claims' conditional PUT; publish asks first",
    "torchtitan/io/storage.py:delete_object": "claims' conditional delete",
    # A rank's own unfinished upload: publishes and deletes nothing anyone can read.
    "torchtitan/checkpoint/store_writer.py:ObjectStream.abort": "this rank's own upload",
    "torchtitan/checkpoint/store_writer.py:abort_uploads": "ObjectStore.rmtree asks first",
    "torchtitan/checkpoint/store.py:local_copy": "a temporary folder of this process",
    # The dump folder's records and other folders: never under the checkpoint folder.
    "torchtitan/data/index.py:SourceCounts._write_whole": "the counts cache",
    "torchtitan/data/pretokenized_write.py:pretokenize": "the pretokenized output folder",
    "torchtitan/faults/fault_tolerance.py:ReplicaGroup.__init__": "the dump folder's events",
    "torchtitan/faults/fault_tolerance.py:ReplicaGroup._write_tried": "the dump folder",
    "torchtitan/hf.py:_write_json": "the export's folder",
    "torchtitan/hf.py:export": "the export's folder",
    "torchtitan/records/metrics.py:MetricLogger.__init__": "the dump folder",
    "torchtitan/records/metrics.py:MetricLogger.log": "the dump folder",
    "torchtitan/records/metrics.py:ProvenanceWriter.__init__": "the dump folder",
    "torchtitan/records/metrics.py:ProvenanceWriter.write": "the dump folder",
    "torchtitan/records/metrics.py:ProvenanceWriter.write_skip": "the dump folder",
    "torchtitan/records/metrics.py:StepMetrics.event": "the dump folder",
    "torchtitan/records/metrics.py:move_jsonl_after": "the dump folder",
    "torchtitan/records/metrics.py:truncate_jsonl_after": "the dump folder",
    "torchtitan/records/profiling.py:Profiler._write": "the dump folder's traces",
    "torchtitan/tools/deterministic_resume.py:delete_last_checkpoints": "a script's own runs",
    "torchtitan/tools/deterministic_resume.py:launch": "a script's own runs",
    "torchtitan/tools/deterministic_resume.py:main": "a script's own runs",
    "torchtitan/tools/ft_launch.py:start_group": "a launcher's log",
    "torchtitan/tools/gpu_check.py:_async_checkpoint": "the GPU check's report",
    "torchtitan/tools/gpu_check.py:_resume_check": "the GPU check's report",
    "torchtitan/tools/gpu_check.py:_steady": "the GPU check's report",
    "torchtitan/tools/gpu_check.py:_throughput": "the GPU check's report",
    "torchtitan/tools/gpu_check.py:main": "the GPU check's report and scratch folder",
}
_OS_WRITES = {
    "replace",
    "rename",
    "renames",
    "remove",
    "unlink",
    "makedirs",
    "mkdir",
    "rmdir",
    "removedirs",
    "link",
    "symlink",
    "utime",
    "truncate",
    "ftruncate",
    "fdopen",
}
_STORE_WRITES = {
    "pipe_file",
    "pipe",
    "rm_file",
    "rm",
    "mv",
    "put_file",
    "put",
    "copy",
    "cp_file",
    "touch",
    "makedirs",
    "mkdir",
}
_S3_WRITES = {
    "put_object",
    "delete_object",
    "delete_objects",
    "copy_object",
    "upload_part",
    "create_multipart_upload",
    "complete_multipart_upload",
    "abort_multipart_upload",
}


def _writes(call: ast.Call) -> bool:
    """Whether ``call`` is a write primitive (by its name and receiver, as written)."""
    f, text = call.func, ast.unparse(call)
    mode = call.args[1] if len(call.args) > 1 else next(
        (k.value for k in call.keywords if k.arg == "mode"), None)  # fmt: skip
    writing = isinstance(mode, ast.Constant) and bool(set(str(mode.value)) & set("wax+"))
    if isinstance(f, ast.Name):
        return (f.id == "open" and writing) or f.id in ("mkstemp", "NamedTemporaryFile")
    if not isinstance(f, ast.Attribute):
        return False
    receiver = ast.unparse(f.value)
    if receiver == "os":
        return f.attr in _OS_WRITES or (f.attr == "open" and ("O_CREAT" in text or "O_WR" in text))
    if receiver == "shutil":
        return f.attr in ("rmtree", "move", "copy", "copyfile", "copy2", "copytree")
    if receiver == "tempfile":
        return f.attr in ("mkstemp", "mkdtemp", "NamedTemporaryFile", "TemporaryDirectory")
    if receiver in ("torch", "np", "numpy"):
        return f.attr in ("save", "savez", "savez_compressed")
    if f.attr == "call_s3":
        return bool(call.args) and getattr(call.args[0], "value", None) in _S3_WRITES
    if receiver.endswith("fs"):
        return f.attr in _STORE_WRITES or (f.attr == "open" and writing)
    return f.attr in _S3_WRITES or (f.attr in ("write_text", "write_bytes", "touch")
                                    and "store" not in receiver and receiver != "claims")  # fmt: skip


def package_writers() -> dict[str, bool]:
    """{"file:function": whether it asks the write guard itself} for every function of
    the package and train.py that calls a write primitive (a call at a module's top
    level is its ``<module>``'s). Cost: one parse a file."""
    found: dict[str, bool] = {}
    for path in [*sorted((REPO / "torchtitan").rglob("*.py")), REPO / "train.py"]:
        stack = [(ast.parse(path.read_text()), "<module>", False)]
        while stack:
            node, scope, asks = stack.pop()
            for child in ast.iter_child_nodes(node):
                inner, inner_asks = scope, asks
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    inner = child.name if scope == "<module>" else f"{scope}.{child.name}"
                    inner_asks = any(isinstance(n, ast.Call)
                                     and ast.unparse(n.func).endswith("before_write")
                                     for n in ast.walk(child))  # fmt: skip
                elif isinstance(child, ast.Call) and _writes(child):
                    name = f"{path.relative_to(REPO)}:{scope}"
                    found[name] = found.get(name, False) or asks
                stack.append((child, inner, inner_asks))
    return found


def test_the_write_guard_covers_every_writer():
    """Every function of the package that writes a file or an object either asks the
    leased folder's write guard itself, or is in ``UNGUARDED_WRITERS`` with why its
    writes never need it (a guarded writer under it, the lease's own conditional record,
    a folder that is never the checkpoint folder). A new writer fails here until it asks
    the guard or says why not, and a listed one that is gone fails too. Negative
    control: a writer that asks the guard is found guarded (the stores', storage's
    publish), and one planted in a copy of a module is found unguarded."""
    found = package_writers()
    guarded = {name for name, asks in found.items() if asks}
    assert {"torchtitan/io/storage.py:publish", "torchtitan/checkpoint/store.py:LocalStore.rmtree",
            "torchtitan/checkpoint/store.py:ObjectStore.move_folder"} <= guarded  # fmt: skip
    unguarded = {name for name, asks in found.items() if not asks}
    assert unguarded == set(UNGUARDED_WRITERS), (
        f"writers that do not ask storage.before_write and are not listed: "
        f"{sorted(unguarded - set(UNGUARDED_WRITERS))}; listed but gone or now guarded: "
        f"{sorted(set(UNGUARDED_WRITERS) - unguarded)}"
    )
    planted = ast.parse("def f(path):\n    with open(path, 'wb') as out:\n        out.write(b'')\n")
    assert _writes(planted.body[0].body[0].items[0].context_expr)
