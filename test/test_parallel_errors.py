"""Rank 0's error in work it does for every rank (``parallel.on_main``) reaches every rank
with its causes, and so is said in one line on every rank, as train.main says it: a
project error as itself, its causes named in its message; another error (a store's
refusal as s3fs raises it, a local file's permission, a bug) as ``RankZeroFailed`` on
the other ranks, its causes linked again so that ``storage.store_fault`` finds the
store's fault there as on rank 0.

Two forked ranks on a real gloo group (``file://`` store), no launcher. Each property
has its negative control: the same error raised in one process loses its cause when
pickled (what the other ranks got before).
"""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed as dist
from helpers import rank_context

import train
from torchtitan import parallel
from torchtitan.data.spec import DataError
from torchtitan.io import storage


def refused_listing() -> PermissionError:
    """What s3fs raises for a listing the store refuses: a PermissionError caused by
    botocore's ClientError (AccessDenied)."""
    from botocore.exceptions import ClientError

    reply = {"Error": {"Code": "AccessDenied", "Message": "Access Denied"},
             "ResponseMetadata": {"HTTPStatusCode": 403}}  # fmt: skip
    try:
        try:
            raise ClientError(reply, "ListObjectsV2")
        except ClientError as e:
            raise PermissionError("Access Denied") from e
    except PermissionError as e:
        return e


class TwoArguments(Exception):
    """A foreign error whose ``__init__`` takes other arguments than its message: it
    pickles, and does not unpickle."""

    def __init__(self, path, code):
        super().__init__(f"{path}: code {code}")


def corpus_denied():
    raise DataError("dataset path /data/corpus cannot be read") from PermissionError(
        13, "Permission denied", "/data/corpus/part-0.jsonl"
    )


def store_denied():
    raise refused_listing()


def file_denied():
    raise PermissionError(13, "Permission denied", "/data/corpus/part-0.jsonl")


def two_arguments():
    raise TwoArguments("/data/x", 7)


def a_bug():
    return {}["missing"]


CASES = {"corpus": corpus_denied, "store": store_denied, "file": file_denied,
         "two_arguments": two_arguments, "bug": a_bug}  # fmt: skip


def what_main_says(dims, error: BaseException) -> str:
    """The line train.main writes for ``error`` on this rank (its branches, in its order:
    a project error's message; a store's or a file's fault; a broken collective's cause,
    another rank's reported failure)."""
    if isinstance(error, train.USER_ERRORS):
        return str(error)
    fault = storage.store_fault(error)
    if fault is not None:
        return fault
    if parallel.collective_broke(error):
        return f"stopped because {parallel.why_collective_broke(dims, error)}"
    parallel.report_failure(dims, train._first_line(error))
    return "traceback: " + train._first_line(error)


def _rank(rank: int, store: str, out) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        seen = {}
        for name, fn in CASES.items():
            kv = dist.FileStore(f"{store}.{name}", 2)  # a case's failure report its own
            dims = parallel.ParallelDims(rank, 2, 0, torch.device("cpu"), "gloo", store=kv)
            try:
                parallel.on_main(dims, fn)
            except Exception as e:  # noqa: BLE001 - what this rank got, as main gets it
                said = what_main_says(dims, e)
                seen[name] = (type(e).__name__, str(e), said)
            dist.barrier()
        out.put((rank, seen))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def seen(tmp_path_factory, monkeypatch_module) -> dict:
    ctx = rank_context()
    out = ctx.Queue()
    store = str(tmp_path_factory.mktemp("ranks") / "store")
    procs = [ctx.Process(target=_rank, args=(r, store, out)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    return got


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("AWS_ENDPOINT_URL", raising=False)  # the store's line names it
        yield mp


def test_a_project_error_is_itself_on_every_rank_naming_its_cause(seen):
    """``DataError(...) from PermissionError(...)`` on rank 0: a DataError on both ranks
    (``except DataError`` holds), whose one line names the cause."""
    line = ("dataset path /data/corpus cannot be read (caused by PermissionError: [Errno 13] "
            "Permission denied: '/data/corpus/part-0.jsonl')")  # fmt: skip
    assert seen[0]["corpus"] == ("DataError", line, line)
    assert seen[1]["corpus"] == ("DataError", line, line)


def test_a_stores_refusal_is_the_stores_line_on_every_rank(seen):
    """s3fs's PermissionError (caused by botocore's AccessDenied) on rank 0: rank 0
    raises it as it is, rank 1 ``RankZeroFailed`` caused by it; both say the store's one
    line, the one rank 0's own error gives."""
    expected = storage.store_fault(refused_listing())
    assert expected is not None and "refused the credentials (AccessDenied" in expected
    assert seen[0]["store"] == ("PermissionError", "Access Denied", expected)
    rank1 = ("rank 0 failed: PermissionError: Access Denied (caused by ClientError: An error "
             "occurred (AccessDenied) when calling the ListObjectsV2 operation: Access Denied)")  # fmt: skip
    assert seen[1]["store"] == ("RankZeroFailed", rank1, expected)


def test_a_local_files_permission_is_one_line_on_every_rank(seen):
    line = ("permission denied on /data/corpus/part-0.jsonl (Permission denied): give the "
            "job's user access to it (chmod / chown), or point the run at files it may read "
            "and folders it may write")  # fmt: skip
    assert seen[0]["file"][2] == line and seen[1]["file"][2] == line
    assert seen[1]["file"][0] == "RankZeroFailed"


def test_an_error_that_cannot_unpickle_and_a_bug_are_rank_zeros_failure_elsewhere(seen):
    """A foreign error whose class cannot be rebuilt from its message travels as its
    line; a bug keeps its traceback on rank 0 (main raises it) and is, on rank 1, rank 0's
    reported failure in one line (a broken collective's path in main)."""
    assert seen[0]["two_arguments"][:2] == ("TwoArguments", "/data/x: code 7")
    assert seen[1]["two_arguments"] == (
        "RankZeroFailed", "rank 0 failed: TwoArguments: /data/x: code 7",
        "stopped because rank 0 failed: TwoArguments: /data/x: code 7")  # fmt: skip
    assert seen[0]["bug"] == ("KeyError", "'missing'", "traceback: KeyError: 'missing'")
    assert seen[1]["bug"] == ("RankZeroFailed", "rank 0 failed: KeyError: 'missing'",
                              "stopped because rank 0 failed: KeyError: 'missing'")  # fmt: skip


def test_pickling_drops_the_cause_negative_control():
    """What broadcasting the exception itself gave rank 1: no cause, so neither the
    store's line nor the cause's name."""
    copy = pickle.loads(pickle.dumps(refused_listing()))
    assert copy.__cause__ is None and storage.store_fault(copy) is None
    try:
        corpus_denied()
    except DataError as e:
        plain = pickle.loads(pickle.dumps(e))
    assert str(plain) == "dataset path /data/corpus cannot be read"
    with pytest.raises(TypeError):
        pickle.loads(pickle.dumps(TwoArguments("/data/x", 7)))


@pytest.mark.slow  # two 2-rank torchrun jobs (~30 s)
def test_a_corpus_no_rank_may_read_is_one_line_on_every_rank(tmp_path):
    """A local corpus whose 2 files are mode 000, 2 ranks under torchrun (as root, with the
    capabilities that bypass file modes dropped: ``setpriv``): each rank meets the
    PermissionError on its own share of the files, and says it in one line naming the
    file, no traceback. Negative control: the same corpus readable trains."""
    import os
    import shutil
    import subprocess

    from helpers import CONFIG, bundled_documents, error_lines, write_jsonl

    from torchtitan import REPO_ROOT
    from torchtitan.tools.launch import run_env, torchrun_command

    drop = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root reads any file, and setpriv (to drop that) is not installed")
        caps = "-dac_override,-dac_read_search"
        drop = ["setpriv", f"--bounding-set={caps}", f"--inh-caps={caps}"]
    corpus = write_jsonl(tmp_path / "corpus", bundled_documents("shakespeare", 40), files=2)

    def job(name: str) -> subprocess.CompletedProcess:
        args = [*CONFIG, "--job.dump_folder", str(tmp_path / name), "--training.steps", "2",
                "--training.dataset_path", str(corpus)]  # fmt: skip
        return subprocess.run([*drop, *torchrun_command(2, args, "train.py")], cwd=REPO_ROOT,
                              env=run_env(), capture_output=True, text=True, timeout=300)  # fmt: skip

    files = sorted(corpus.iterdir())
    for f in files:
        f.chmod(0)
    denied = job("denied")
    log = denied.stdout + denied.stderr
    assert denied.returncode != 0 and "]: Traceback" not in log, log[-3000:]  # a rank's
    fix = ("give the job's user access to it (chmod / chown), or point the run at files it "
           "may read and folders it may write")  # fmt: skip
    assert sorted(error_lines(log)) == [
        f"[rank{r}] error: permission denied on {files[r]} (Permission denied): {fix}"
        for r in range(2)
    ], log[-3000:]
    for f in files:
        f.chmod(0o644)
    readable = job("readable")
    assert readable.returncode == 0, (readable.stdout + readable.stderr)[-3000:]
