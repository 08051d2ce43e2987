"""Object storage end to end, through train.py: the corpus (parquet files), its token
counts and the checkpoints all in one bucket of the real S3 API of harness/s3.py (moto's
server on 127.0.0.1, reached through fsspec → s3fs → botocore and the AWS_* variables,
as a job reaches a bucket). Each property next to a negative control.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import pytest
from helpers import REPO, bundled_documents, cfg, error_lines, losses, run_main, train_here

from harness import s3
from harness.corpus import write_parquet_files
from torchtitan.checkpoint import complete_steps
from torchtitan.data import build_dataloader
from torchtitan.tools.deterministic_resume import main as resume_check
from torchtitan.tools.deterministic_resume import torchrun_launcher

pytestmark = pytest.mark.skipif(s3.missing() is not None, reason=str(s3.missing()))

# 12 short real documents, 3 rows a row group, in 2 files: with windows of 32 tokens a
# few steps cross units, files and passes.
SHORT = ["--training.seq_len", "32", "--training.streaming", "true"]


@pytest.fixture
def bucket():
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # the server's request log
    with s3.local_s3() as (name, _):
        yield name


def upload_corpus(bucket: str, tmp_path: Path, compression: str = "snappy") -> str:
    """The corpus written locally as parquet, uploaded with s3fs: its URL."""
    import s3fs

    local = write_parquet_files(tmp_path / "corpus", bundled_documents("shakespeare", 12, 300),
                                2, row_group=3, compression=compression)  # fmt: skip
    s3fs.S3FileSystem().put(str(local), f"{bucket}/corpus", recursive=True)
    return f"s3://{bucket}/corpus"


def on_bucket(bucket: str, corpus: str) -> list[str]:
    return ["--training.dataset_path", corpus, "--training.length_index_dir",
            f"s3://{bucket}/counts", "--checkpoint.folder", f"s3://{bucket}/ckpt", *SHORT]  # fmt: skip


# ---- the seed plan on buckets: 2 gloo ranks under torchrun ------------------------------


def excluding_on_resume(component: str):
    """A torchrun launcher whose resumed runs leave ``component`` out of the load (the
    negative control of a resume check), a resume being a run that finds a checkpoint."""

    def launcher(nproc: int, argv: list[str]) -> tuple[int, str]:
        url = argv[argv.index("--checkpoint.folder", argv.index("--training.steps")) + 1]
        if complete_steps(url):
            argv = [*argv, "--checkpoint.exclude_from_loading", component]
        return torchrun_launcher(nproc, argv)

    return launcher


@pytest.mark.slow
def test_a_run_restarted_at_every_checkpoint_on_buckets_equals_an_uninterrupted_one(
    bucket, tmp_path
):
    """Corpus, counts and checkpoints in the bucket, 2 ranks with a loader worker each (a
    forked process reading the bucket): a new job at every checkpoint (steps 2 and 4 of 6) gives every step's loss == one uninterrupted job's, on
    the same data (the seed plan of deterministic_resume). Negative control: the same
    chain resuming without the loader's entry differs."""
    corpus = upload_corpus(bucket, tmp_path)
    args = ["--nproc", "2", "--resume-every", "--steps", "6", "--interval", "2",
            *on_bucket(bucket, corpus), "--training.num_workers", "1"]  # fmt: skip
    dump = tmp_path / "dr"
    assert resume_check(["--dump-folder", str(dump), *args]) == 0
    log = (dump / "runs.log").read_text()
    assert f"loaded checkpoint s3://{bucket}/ckpt/step-4" in log
    assert f"loaded checkpoint s3://{bucket}/ckpt/step-2" in log
    assert complete_steps(f"s3://{bucket}/ckpt") == [2, 4, 6]
    assert complete_steps(f"s3://{bucket}/ckpt-reference") == [2, 4, 6]
    assert not (dump / "checkpoint").exists(), "no checkpoint in the local dump folder"
    reference = losses(tmp_path / "dr-reference")
    assert sorted(reference) == list(range(1, 7)) and losses(dump) == reference

    control = tmp_path / "control"  # 4 steps: one resume, from step 2
    args[args.index("--steps") + 1] = "4"
    assert resume_check(["--dump-folder", str(control), *args],
                        excluding_on_resume("dataloader")) == 1  # fmt: skip
    assert "loaded checkpoint" in (control / "runs.log").read_text()
    assert losses(control)[2] == reference[2] and losses(control)[3] != reference[3]


def in_process(component: str | None = None):
    """A launcher for resume_check: 1-rank jobs in this process, through train.main; with
    ``component``, its resumed runs (those that find a checkpoint) leave it out."""

    def launcher(nproc: int, argv: list[str]) -> tuple[int, str]:
        url = argv[argv.index("--checkpoint.folder", argv.index("--training.steps")) + 1]
        if component and complete_steps(url):
            argv = [*argv, "--checkpoint.exclude_from_loading", component]
        return run_main(argv)

    return launcher


def test_the_resume_check_deletes_and_resumes_checkpoints_in_a_bucket(bucket, tmp_path):
    """deterministic_resume's default mode with everything in the bucket (one in-process
    rank): the last checkpoint (step 4) deleted from the bucket, the rerun resumes from
    step 2 and is exact. Negative control: the resume without the loader's entry fails."""
    corpus = upload_corpus(bucket, tmp_path)
    args = ["--nproc", "1", "--steps", "4", "--interval", "2", "--delete", "1",
            *on_bucket(bucket, corpus)]  # fmt: skip
    assert resume_check(["--dump-folder", str(tmp_path / "dr"), *args], in_process()) == 0
    log = (tmp_path / "dr" / "runs.log").read_text()
    assert f"loaded checkpoint s3://{bucket}/ckpt/step-2" in log
    assert resume_check(["--dump-folder", str(tmp_path / "control"), *args],
                        in_process("dataloader")) == 1  # fmt: skip


# ---- an object rewritten in place, through a train.py resume (one rank, in-process) -----


def rewrite_in_place(url: str, old: bytes, new: bytes):
    """The object at ``url`` written again with its first ``old`` replaced by ``new`` (of
    the same length): the same size, other bytes."""
    import s3fs

    fs = s3fs.S3FileSystem()
    data = fs.cat_file(url)
    assert len(old) == len(new) and old in data
    fs.pipe_file(url, data.replace(old, new, 1))
    fs.invalidate_cache()
    assert fs.size(url) == len(data)


def test_an_object_rewritten_in_place_stops_the_resume_naming_it(bucket, tmp_path):
    """A run on an s3 corpus saves at step 2; resumed with the objects untouched it goes on
    (the negative control: the check does not refuse every store resume) and saves step 4;
    then one parquet object is rewritten at the same size with other bytes (a letter of a
    document changed) and the resume stops with one line naming that file."""
    corpus = upload_corpus(bucket, tmp_path, compression="none")  # the text lies as it is
    args = [*on_bucket(bucket, corpus), "--checkpoint.enable_checkpoint",
            "--checkpoint.interval", 2]  # fmt: skip
    train_here(tmp_path / "a", "--training.steps", 4, "--training.stop_at_step", 2, *args)
    status, log = train_here(tmp_path / "b", "--training.steps", 4, *args)
    assert status == 0 and f"loaded checkpoint s3://{bucket}/ckpt/step-2" in log

    text = bundled_documents("shakespeare", 12, 300)[1]["text"][:40].encode()
    rewrite_in_place(f"{corpus}/part-00000.parquet", text, text.swapcase())
    status, log = train_here(tmp_path / "c", "--training.steps", 6, *args, expect_ok=False)
    assert status != 0 and "Traceback" not in log
    (line,) = error_lines(log)
    assert "file part-00000.parquet changed" in line and "step-4" in line, line
    assert "part-00001.parquet" not in line


# ---- scripts/prepare_data.py into a bucket ----------------------------------------------


def prepare_data(argv: list) -> int:
    spec = importlib.util.spec_from_file_location(
        "prepare_data", REPO / "scripts" / "prepare_data.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main([str(a) for a in argv])


def test_prepare_data_measures_a_corpus_in_a_bucket_into_the_bucket(bucket, tmp_path, tokenizer):
    """``scripts/prepare_data.py`` with the corpus and the counts folder as URLs measures
    every unit into the bucket; a job's loader then measures none over more than a pass,
    and a second run finds nothing to do. Negative control: the same loader over an
    empty counts prefix measures as it goes."""
    import s3fs

    corpus = upload_corpus(bucket, tmp_path)
    counts = f"s3://{bucket}/counts"
    argv = ["--job.config_file", "train_configs/debug_model.toml", "--training.dataset_path",
            corpus, "--training.length_index_dir", counts, "--training.streaming", "true",
            "--num-proc", 2]  # fmt: skip
    assert prepare_data(argv) == 0
    fs = s3fs.S3FileSystem()
    fs.invalidate_cache()
    written = fs.find(f"{bucket}/counts")
    assert not [p for p in written if p.endswith(".tokens")], "no reader: no tokens kept"

    c = cfg(corpus, length_index_dir=counts, streaming="true")
    loader = build_dataloader(c, tokenizer, 0, 1)
    order = loader.stream.orders[0]
    assert len([p for p in written if p.endswith(".npz")]) == len(
        order.units(order.source.extent())
    )
    for _ in range(16):  # 1,562 tokens a pass, 128 a step
        loader.next_step()
    assert loader.position.cursors[0].pass_ >= 1, "the loader read more than a pass"
    assert order.counts.measured == 0
    cold = build_dataloader(cfg(corpus, length_index_dir=f"s3://{bucket}/empty",
                                streaming="true"), tokenizer, 0, 1)  # fmt: skip
    cold.next_step()
    assert cold.stream.orders[0].counts.measured > 0
