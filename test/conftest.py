"""Shared fixtures: the real tokenizer, small real-text corpora, and a torchrun launcher."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

warnings.filterwarnings("ignore", message=".*set_vital.*")

from torchtitan.data.sources import resolve_source  # noqa: E402
from torchtitan.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return Tokenizer(DEFAULT_TOKENIZER_PATH)


def bundled_documents(source: str, count: int, max_chars: int = 1200) -> list[dict]:
    """Real documents from the bundled corpus, shortened so tests cross many boundaries."""
    import datasets

    files = resolve_source(name=source).files
    ds = datasets.load_dataset("parquet", data_files=files, split="train")
    return [
        {"id": ds[i]["id"], "text": ds[i]["text"][: 200 + (i * 97) % max_chars]}
        for i in range(count)
    ]


def write_jsonl(folder: Path, docs: list[dict], files: int = 2) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    per_file = (len(docs) + files - 1) // files
    for f in range(files):
        with open(folder / f"part-{f:03d}.jsonl", "w") as out:
            for doc in docs[f * per_file : (f + 1) * per_file]:
                out.write(json.dumps(doc) + "\n")
    return folder


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> Path:
    """24 short real documents (Shakespeare) in two jsonl files."""
    return write_jsonl(
        tmp_path_factory.mktemp("small") / "shakespeare", bundled_documents("shakespeare", 24)
    )


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> Path:
    """8 very short real documents: a rank's shards wrap into a new epoch within ~15 sequences."""
    return write_jsonl(
        tmp_path_factory.mktemp("tiny") / "shakespeare", bundled_documents("shakespeare", 8, 300)
    )


@pytest.fixture(scope="session")
def second_corpus(tmp_path_factory) -> Path:
    """16 short real documents (KJV) in two jsonl files, for mixing."""
    return write_jsonl(tmp_path_factory.mktemp("second") / "kjv", bundled_documents("kjv", 16))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(
    args: list[str], nproc: int = 2, timeout: int = 300, script: str = "train.py"
) -> subprocess.CompletedProcess:
    """Launch a real multi-process job; returns the finished process (check returncode)."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
        f"--master_port={free_port()}", str(REPO / script), *args,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def read_jsonl(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
