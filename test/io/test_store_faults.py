"""Faults of the object store, tried as a new user meets them, through train.main on the
local S3 server of harness/s3.py: each ends in the project's one ``error:`` line naming the
store and the fix, with no traceback (storage.store_fault, train.main).

The clients' own retries (s3fs's and botocore's, 5 tries each with backoff) are set to one
try here (s3fs's ``retries``, botocore's through fsspec's per-protocol config), so that a persistent fault
fails in a second rather than after ~20 s; the product's path is otherwise unchanged.
Negative control: with the store reachable and the credentials right, the same runs
succeed (the faults, not the runs, fail them).

A fault retried changes nothing a checkpoint saves: the generators after retries of the
store writer, the store reader and botocore (legacy and standard modes), and a whole run
behind a server that throttles every fifth request against one without (slow).
"""

from __future__ import annotations

import logging

import fsspec.config
import pytest
from helpers import error_lines, train_here

from harness.s3 import Traffic, local_s3, missing
from torchtitan.io import storage


@pytest.fixture(scope="module")
def server():
    reason = missing()
    if reason:
        pytest.skip(reason)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    import s3fs

    saved, tries = fsspec.config.conf.get("s3"), s3fs.S3FileSystem.retries
    fsspec.config.conf["s3"] = {"config_kwargs": {"retries": {"max_attempts": 1}}}
    s3fs.S3FileSystem.retries = 1
    traffic = Traffic()
    try:
        with local_s3(traffic) as (bucket, endpoint):
            yield bucket, endpoint, traffic
    finally:
        s3fs.S3FileSystem.retries = tries
        if saved is None:
            fsspec.config.conf.pop("s3", None)
        else:
            fsspec.config.conf["s3"] = saved


@pytest.fixture
def env(monkeypatch):
    """The AWS_* variables of this test only (the server's are restored after)."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    yield monkeypatch
    s3fs.S3FileSystem.clear_instance_cache()


def one_line(tmp_path, *args) -> str:
    status, log = train_here(tmp_path, "--training.steps", 2, *args, expect_ok=False)
    errors = error_lines(log)
    assert status == 1 and len(errors) == 1 and "Traceback" not in log, log[-3000:]
    return errors[0]


CKPT = ["--checkpoint.enable_checkpoint", "--checkpoint.interval", 2]


def test_an_endpoint_nobody_listens_on_is_one_line(server, env, tmp_path):
    bucket, _, _ = server
    env.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    line = one_line(tmp_path, *CKPT, "--checkpoint.folder", f"s3://{bucket}/run")
    assert f"checkpoint folder s3://{bucket}/run" in line
    assert "cannot be reached" in line and "AWS_ENDPOINT_URL=http://127.0.0.1:9" in line


def test_no_endpoint_variable_is_one_line(server, env, tmp_path):
    """Without AWS_ENDPOINT_URL the client goes to AWS itself: unreachable here, or (with
    a network) a refusal of the test's credentials; either way one line that says the
    variable is not set."""
    bucket, _, _ = server
    env.delenv("AWS_ENDPOINT_URL")
    line = one_line(tmp_path, *CKPT, "--checkpoint.folder", f"s3://{bucket}/run")
    assert "AWS_ENDPOINT_URL is not set" in line, line


def test_wrong_credentials_on_the_corpus_path_are_one_line(server, env, tmp_path):
    """The server refuses every request (403 InvalidAccessKeyId, injected: moto does not
    check keys) while the corpus is listed and read. Negative control: the same run with
    the server answering trains."""
    bucket, _, traffic = server
    upload_corpus(bucket)
    corpus = ["--training.dataset_path", f"s3://{bucket}/corpus",
              "--training.length_index_dir", str(tmp_path / "counts")]  # fmt: skip
    traffic.fail_next, traffic.fail_status, traffic.fail_kinds = 10_000, 403, ("GET", "GET range")
    try:
        line = one_line(tmp_path / "refused", *corpus)
    finally:
        traffic.fail_next, traffic.fail_status = 0, 503
    assert "refused the credentials (InvalidAccessKeyId" in line, line
    assert "AWS_ACCESS_KEY_ID" in line
    train_here(tmp_path / "control", "--training.steps", 2, *corpus)


def test_a_bucket_gone_is_one_line(server, env, tmp_path):
    """A server restarted empty: the bucket the run names does not exist."""
    bucket, _, _ = server
    line = one_line(tmp_path, *CKPT, "--checkpoint.folder", f"s3://{bucket}-gone/run")
    assert f"s3://{bucket}-gone/run" in line
    assert "does not exist" in line or "not writable" in line, line


def upload_corpus(bucket: str):
    import s3fs

    lines = [f"document {i}: " + " ".join(f"word{j % 97}" for j in range(200)) for i in range(200)]
    s3fs.S3FileSystem().pipe_file(f"{bucket}/corpus/part.txt", "\n".join(lines).encode())


def test_store_fault_is_none_for_other_errors():
    """Only the store's faults are turned into its line: a bug keeps its traceback."""
    assert storage.store_fault(ValueError("x")) is None
    assert storage.store_fault(FileNotFoundError("no such file: /tmp/a")) is None


@pytest.mark.slow  # three in-process runs (~15 s); the reader's own line is test_store_reader's
def test_a_checkpoint_read_that_keeps_failing_is_one_line(server, env, tmp_path):
    """Resuming from a bucket whose data GETs keep failing (503 on every try): the store
    reader retries ATTEMPTS times, then the start stops with one line naming the object
    and the number of tries, on the manager's path (StoreReadError). Negative control:
    with the first 2 GETs failing the resume goes through."""
    from torchtitan.checkpoint import store_reader

    bucket, _, traffic = server
    url = f"s3://{bucket}/resumed"
    ckpt = [*CKPT, "--checkpoint.folder", url]
    train_here(tmp_path / "first", "--training.steps", 2, *ckpt)
    env.setattr(store_reader, "BACKOFF", 0.01)
    traffic.fail_next, traffic.fail_suffix, traffic.fail_kinds = 10_000, ".distcp", ("GET range",)
    try:
        status, log = train_here(tmp_path / "again", "--training.steps", 4, *ckpt, expect_ok=False)
    finally:
        traffic.fail_next, traffic.fail_suffix = 0, ""
    errors = error_lines(log)
    assert status == 1 and len(errors) == 1 and "Traceback" not in log, log[-3000:]
    assert f"{url}/step-2/__0_" in errors[0] and f"{store_reader.ATTEMPTS} tries" in errors[0]
    traffic.fail_next, traffic.fail_suffix = 2, ".distcp"
    try:
        train_here(tmp_path / "again", "--training.steps", 4, *ckpt)
    finally:
        traffic.fail_next, traffic.fail_suffix = 0, ""


@pytest.mark.parametrize("scope", ["", ".distcp"])
def test_a_bucket_gone_mid_run_is_one_line_and_the_last_checkpoint_stays(server, env, tmp_path,
                                                                         scope):  # fmt: skip
    """The server answers 404 NoSuchBucket (a restart that lost its buckets) to every write
    of step-4, after step-2 was saved: one line naming the store, the object and the fix,
    no traceback, and step-2 is still the checkpoint a resume chooses. ``scope``: every
    write of step-4 (the first is rank 0's pending manifest), or only its data objects
    (the store writer's parts and PUTs). Negative control (with the second): the same run
    without the fault saves step-4."""
    from torchtitan.checkpoint.folder import complete_steps

    bucket, _, traffic = server
    url = f"s3://{bucket}/gone{scope.strip('.')}"
    args = ["--training.steps", 4, *CKPT, "--checkpoint.folder", url]
    traffic.fail_next, traffic.fail_status, traffic.fail_kinds = 10_000, 404, ("PUT", "POST")
    traffic.fail_within, traffic.fail_suffix = "/step-4/", scope
    try:
        status, log = train_here(tmp_path / "gone", *args, expect_ok=False)
    finally:
        traffic.fail_next, traffic.fail_status, traffic.fail_kinds = 0, 503, ("GET", "GET range")
        traffic.fail_within = traffic.fail_suffix = ""
    errors = error_lines(log)
    assert status == 1 and len(errors) == 1 and "Traceback" not in log, log[-3000:]
    line = errors[0]
    assert f"{url}/step-4/" in line and "does not exist" in line and "create it" in line, line
    assert complete_steps(url) == [2]
    if scope:  # the negative control, once
        train_here(tmp_path / "control", *args[:-1], f"{url}-control")
        assert complete_steps(f"{url}-control") == [2, 4]


# ---- a retry changes no generator a checkpoint saves ------------------------------------
def generators() -> tuple:
    """The process's generators that a checkpoint saves (checkpoint/stateful.py
    ``RNGState``): Python's ``random``, numpy's global one, torch's CPU one."""
    import random

    import numpy as np
    import torch

    name, keys, pos, has_gauss, cached = np.random.get_state()
    return random.getstate(), (name, keys.tolist(), pos, has_gauss, cached), torch.get_rng_state()


def same_generators(a: tuple, b: tuple) -> bool:
    import torch

    return a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])


@pytest.mark.parametrize("mode", ["legacy", "standard"])
def test_retries_leave_the_generators_a_checkpoint_saves_as_they_were(server, env, tmp_path,
                                                                      mode):  # fmt: skip
    """Behind 503 SlowDown answers, each request retried once: a checkpoint saved by the
    store writer (2 PUTs retried), loaded by the store reader (2 ranged GETs retried), and
    a claim written through s3fs with botocore's own retries (its ``mode``: legacy, or
    standard, whose waits ``ExponentialBackoff`` draws; s3fs's retries off, so that only
    botocore's can succeed). Python's, numpy's and torch's generators are exactly as they
    were: every wait was drawn from the OS (storage.JITTER). The retries happened (the
    server's count and the clients'). Negative control: one wait drawn as the writer drew
    it before (``random.uniform``) is seen."""
    import random

    import torch
    import torch.distributed.checkpoint as dcp

    from torchtitan.checkpoint import store_reader, store_writer

    bucket, _, traffic = server
    url = f"s3://{bucket}/generators-{mode}"
    env.setattr(store_reader, "BACKOFF", 0.01)
    env.setitem(fsspec.config.conf, "s3", {"config_kwargs": {"retries": {
        "mode": mode, "total_max_attempts": 2}}})  # fmt: skip
    saved = {"w": torch.arange(1000, dtype=torch.float32), "b": {"note": "bytes", "n": 3}}
    before = generators()
    traffic.reset()
    traffic.fail_next, traffic.fail_status, traffic.fail_kinds = 2, 503, ("PUT",)
    writer = store_writer.StoreWriter(url)
    dcp.save(saved, checkpoint_id=url, storage_writer=writer, no_dist=True)
    assert traffic.failed == 2 and writer.stats["retries"] == 2
    traffic.reset()
    traffic.fail_next, traffic.fail_kinds, traffic.fail_suffix = 2, ("GET range",), ".distcp"
    loaded = {"w": torch.zeros(1000), "b": {"note": None, "n": None}}
    reader = store_reader.StoreReader(url)
    dcp.load(loaded, checkpoint_id=url, storage_reader=reader, no_dist=True)
    assert traffic.failed == 2 and reader.stats["retries"] == 2
    assert torch.equal(loaded["w"], saved["w"]) and loaded["b"] == saved["b"]
    traffic.reset()
    traffic.fail_next, traffic.fail_kinds, traffic.fail_suffix = 1, ("PUT",), ""
    assert storage.put_object(f"{url}/claim.json", b"{}", absent=True) is not None
    assert traffic.failed == 1 and traffic.fail_next == 0
    traffic.fail_next, traffic.fail_kinds = 0, ("GET", "GET range")
    assert same_generators(generators(), before)

    random.uniform(0, store_reader.BACKOFF)
    assert not same_generators(generators(), before), "negative control"


class EveryFifth(Traffic):
    """A server that answers 503 SlowDown to every fifth request while ``on``."""

    on = False
    seen = 0

    def wrap(self, app):
        answer = super().wrap(app)

        def every_fifth(environ, start_response):
            with self.lock:
                self.seen += self.on
                if self.on and self.seen % 5 == 0:
                    kind = environ["REQUEST_METHOD"] + (
                        " range" if environ.get("HTTP_RANGE") else ""
                    )
                    self.fail_next, self.fail_status, self.fail_kinds = 1, 503, (kind,)
            return answer(environ, start_response)

        return every_fifth


def saved_entries(url: str, local) -> dict:
    """Every entry of the checkpoint at ``url``, flat (``rng.rank_0``...), as DCP reads it."""
    import s3fs
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    s3fs.S3FileSystem().get(url.split("://", 1)[1], str(local / "ck"), recursive=True)
    dcp_to_torch_save(str(local / "ck"), str(local / "ck.pt"))

    def flat(entries: dict, prefix: str = "") -> dict:
        out = {}
        for key, value in entries.items():
            out.update(flat(value, f"{prefix}{key}.") if isinstance(value, dict)
                       else {f"{prefix}{key}": value})  # fmt: skip
        return out

    return flat(torch.load(local / "ck.pt", weights_only=False))


@pytest.mark.slow  # two in-process runs on a server of its own (~20 s)
def test_a_run_behind_a_store_that_throttles_saves_the_checkpoint_of_a_run_without(env, tmp_path):
    """Corpus, counts and checkpoints in a bucket whose server answers 503 to every fifth
    request (the run's clients retry: s3fs's, botocore's, the store writer's and reader's):
    step-4 holds every entry ``torch.equal`` to a run's without the faults, the RNG states
    (``rng.rank_0``: Python's and numpy's) among them. The faulty run did retry (the
    server's count). Mutant: botocore's waits left on the global ``random`` (no
    ``_draw_privately``): ``rng.rank_0`` differs."""
    import s3fs
    import torch

    env.delitem(fsspec.config.conf, "s3", raising=False)  # the clients' own retries, as a run has
    env.setattr(s3fs.S3FileSystem, "retries", 5)  # s3fs's default
    traffic = EveryFifth()
    entries = {}
    with local_s3(traffic) as (bucket, _):
        upload_corpus(bucket)
        for name, faulty in (("clean", False), ("faulty", True)):
            traffic.on = faulty
            train_here(tmp_path / name, "--training.steps", 4, *CKPT, "--checkpoint.folder",
                       f"s3://{bucket}/{name}", "--training.dataset_path", f"s3://{bucket}/corpus",
                       "--training.length_index_dir", f"s3://{bucket}/counts-{name}")  # fmt: skip
            entries[name] = saved_entries(f"s3://{bucket}/{name}/step-4", tmp_path / name)
        traffic.on = False
    assert traffic.failed >= 10, traffic.failed
    clean, faulty = entries["clean"], entries["faulty"]
    assert clean.keys() == faulty.keys() and "rng.rank_0" in clean
    differ = [k for k in clean if not (torch.equal(clean[k], faulty[k])
              if isinstance(clean[k], torch.Tensor) else clean[k] == faulty[k])]  # fmt: skip
    assert differ == []
