"""A save to S3 killed (SIGKILL) mid-upload, for real: a child process saves through the
project's Saver and store writer to the local S3 server of harness/s3.py and kills itself
once a chosen number of its data requests were acknowledged, with others in flight (some
objects stored, a multipart upload begun and some of its parts sent). What the restart
finds is checked here, in this process, through the same code a restart runs
(``partial_steps`` / ``Saver.finish_partial``, then ``timeline``'s choice and a save of
the same step).

Negative controls: before the restart's clean-up the bucket does hold the torn step's
objects and its incomplete multipart upload (the kill did land between parts); the
restart's own save of the step, not killed, is chosen.
"""

from __future__ import annotations

import inspect
import os
import signal
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import REPO, served_bucket

from torchtitan.checkpoint import store_reader
from torchtitan.checkpoint.folder import MANIFEST, complete_steps, partial_steps, read_manifest
from torchtitan.checkpoint.lifecycle import Saver
from torchtitan.checkpoint.timeline import plan_resume, survey
from torchtitan.parallel import init_distributed

MIB = 1 << 20

# The child: step-2 saved whole, then step-4 with the killer armed. Sizes small enough for
# a fast test, at S3's smallest part (5 MiB): objects of 1 MiB, a 12 MiB entry sent as a
# multipart upload of 3 parts, 2 requests in flight.
CHILD = """
import os, signal, sys, threading
import torch
from torchtitan.checkpoint import store_reader, store_writer
from torchtitan.checkpoint.lifecycle import Saver
from torchtitan.parallel import init_distributed

MIB = 1 << 20
store_writer.StoreWriter.__init__.__defaults__ = (MIB, 5 * MIB, 2, 6 * MIB)
client = store_reader._s3_client()
acked, lock = [0], threading.Lock()
kill_after = int(os.environ["KILL_AFTER"])

class Killing:
    # The real client; the process is killed once kill_after data requests of step-4 were
    # answered (the others in flight die with it).
    def __getattr__(self, method):
        call = getattr(client, method)
        def counted(**args):
            reply = call(**args)
            if method in ("put_object", "upload_part") and "/step-4/" in "/" + args["Key"]:
                with lock:
                    acked[0] += 1
                    if acked[0] == kill_after:
                        os.kill(os.getpid(), signal.SIGKILL)
            return reply
        return counted

store_reader._s3_client = lambda: Killing()
saver = Saver(os.environ["FOLDER"], init_distributed(), "sync", 0)
for step in (2, 4):
    saver.save(step, state(step), {"step": step, "contents": ["train_state"]})
print("not killed")
"""


def state(step: int) -> dict:
    """24 tensors of 256 KiB (objects of 1 MiB), one of 12 MiB (multipart), a bytes entry."""
    g = torch.Generator().manual_seed(step)
    return {
        "small": {f"w{i}": torch.randn(256, 256, generator=g) for i in range(24)},
        "big": torch.randn(3 * MIB, generator=g),
        "extra": {"step": step},
    }


def blank() -> dict:
    s = state(0)
    return {"small": {k: torch.zeros_like(v) for k, v in s["small"].items()},
            "big": torch.zeros_like(s["big"]), "extra": {"step": -1}}  # fmt: skip


def loads_as(url: str, step: int) -> bool:
    got = blank()
    dcp.load(got, checkpoint_id=url, storage_reader=store_reader.StoreReader(url), no_dist=True)
    want = state(step)
    return (
        got["extra"] == want["extra"]
        and torch.equal(got["big"], want["big"])
        and all(torch.equal(got["small"][k], v) for k, v in want["small"].items())
    )


@pytest.fixture(scope="module")
def server():
    with served_bucket() as served:
        yield served


def chosen(folder: str) -> int:
    return plan_resume(survey(folder), None, {}).candidates[0]


def test_a_save_killed_between_its_parts_leaves_the_previous_one_chosen(server, tmp_path):
    """SIGKILL once 8 data requests of step-4 were answered (of 6 single PUTs and 3 parts,
    2 in flight; the 12 MiB entry's upload begun). Then, as a restart runs it: step-4 is
    a partial step, never complete; ``finish_partial`` removes its objects and aborts its
    multipart upload; step-2 is chosen and loads torch.equal; the restart's save of
    step-4 succeeds, holds exactly its own objects (nothing stale from the killed one)
    and loads torch.equal. Negative controls: before the clean-up the torn objects and
    the incomplete upload are there; after the new save step-4 is the one chosen."""
    bucket, _ = server
    folder = f"s3://{bucket}/killed"
    env = {**os.environ, "FOLDER": folder, "KILL_AFTER": "8", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}  # fmt: skip
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    source = f"{inspect.getsource(state)}\n{CHILD}"  # the child saves the same states
    child = subprocess.run([sys.executable, "-c", source], env=env, cwd=REPO,
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert child.returncode == -signal.SIGKILL, child.stdout + child.stderr[-3000:]

    client = store_reader._s3_client()
    prefix = "killed/step-4/"
    torn = [
        o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
    ]
    uploads = client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", [])
    assert any(k.endswith(".distcp") for k in torn), f"negative control: torn objects {torn}"
    assert len(uploads) == 1, "negative control: the kill left the big entry's upload open"
    parts = client.list_parts(Bucket=bucket, Key=uploads[0]["Key"], UploadId=uploads[0]["UploadId"])
    assert 1 <= len(parts.get("Parts", [])) < 3, "killed between its parts"
    assert complete_steps(folder) == [2] and partial_steps(folder) == [4]
    assert chosen(folder) == 2

    saver = Saver(folder, init_distributed(), "sync", 0)
    for step in partial_steps(folder):  # what CheckpointManager.load does first
        saver.finish_partial(step)
    assert partial_steps(folder) == [] and complete_steps(folder) == [2]
    assert not client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents")
    assert not client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads"), (
        "the killed save's multipart upload is aborted"
    )
    assert chosen(folder) == 2 and loads_as(f"{folder}/step-2", 2)

    saver.save(4, state(4), {"step": 4, "contents": ["train_state"]})
    assert complete_steps(folder) == [2, 4] and chosen(folder) == 4, "negative control"
    stored = {o["Key"].rsplit("/", 1)[1]
              for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]}  # fmt: skip
    manifest = read_manifest(f"{folder}/step-4")
    assert stored == {*manifest["files"], MANIFEST}, "exactly the new save's objects"
    assert loads_as(f"{folder}/step-4", 4) and not loads_as(f"{folder}/step-4", 2)
