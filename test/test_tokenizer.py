"""Tests for the bundled tokenizer (torchtitan/data/tokenizer.py) and the corpus it was trained on."""

import hashlib
import pickle
from collections import Counter
from pathlib import Path

import datasets
import pytest
import torch

from torchtitan.data.tokenizer import (
    DEFAULT_TOKENIZER_PATH,
    REPO_ROOT,
    Tokenizer,
    TokenizerError,
)

CORPUS_DIR = REPO_ROOT / "data" / "corpus"
SHARDS_PER_SOURCE = {"shakespeare": 8, "kjv": 8, "milton": 4}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(DEFAULT_TOKENIZER_PATH)


@pytest.fixture(scope="module")
def corpus() -> datasets.Dataset:
    files = sorted(str(path) for path in CORPUS_DIR.glob("*/*.parquet"))
    return datasets.load_dataset("parquet", data_files=files, split="train")


def test_every_corpus_document_round_trips(tokenizer, corpus):
    texts = list(corpus["text"])
    decoded = [tokenizer.decode(ids) for ids in tokenizer.encode_batch(texts)]
    broken = [doc_id for doc_id, text, back in zip(corpus["id"], texts, decoded) if back != text]
    assert not broken, f"{len(broken)} documents do not round-trip, e.g. {broken[:5]}"


@pytest.mark.parametrize(
    "text",
    [
        "",
        "\n",
        "  leading spaces",
        "trailing spaces   ",
        "runs    of\tmixed  \t whitespace",
        "line one\n\n\n  indented line three\n",
        " \n \n",
        "Digits 1611 and 0.5; CRLF\r\nend",
    ],
)
def test_whitespace_and_newlines_are_kept_exactly(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_rare_characters_fall_back_to_bytes(tokenizer):
    text = "emoji \U0001f600\U0001f3f3\ufe0f CJK 日本語の文章 accents e\u0301 \u00e9 Ελληνικά"
    ids = tokenizer.encode(text)
    assert 0 not in ids, "byte fallback should leave nothing unknown"
    assert tokenizer.decode(ids) == text
    assert [tokenizer.decode(x) for x in tokenizer.encode_batch([text, text])] == [text, text]


def test_special_ids(tokenizer):
    assert tokenizer.vocab_size == 4096
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (1, 2, 3)
    plain = tokenizer.encode("To be, or not to be")
    assert {1, 2, 3}.isdisjoint(plain)
    assert tokenizer.encode("To be, or not to be", bos=True, eos=True) == [1, *plain, 2]
    assert tokenizer.encode("To be, or not to be", bos=True) == [1, *plain]
    assert tokenizer.encode("To be, or not to be", eos=True) == [*plain, 2]


def test_encode_batch_matches_encode(tokenizer):
    texts = ["In the beginning", "", "  Of Mans First Disobedience,\n"]
    expected = [tokenizer.encode(text, bos=True, eos=True) for text in texts]
    assert tokenizer.encode_batch(texts, bos=True, eos=True) == expected


def test_decode_skips_special_ids_and_accepts_tensors(tokenizer):
    ids = tokenizer.encode("Get thee to a nunnery", bos=True, eos=True)
    assert tokenizer.decode(ids) == "Get thee to a nunnery"
    assert tokenizer.decode(torch.tensor(ids + [tokenizer.pad_id])) == "Get thee to a nunnery"


def test_sha256_is_the_hash_of_the_file(tokenizer):
    expected = hashlib.sha256(Path(DEFAULT_TOKENIZER_PATH).read_bytes()).hexdigest()
    assert tokenizer.sha256() == expected


def test_pickles_for_data_loader_workers(tokenizer):
    clone = pickle.loads(pickle.dumps(tokenizer))
    text = "And God said, Let there be light\n"
    assert clone.encode(text) == tokenizer.encode(text)
    assert clone.sha256() == tokenizer.sha256()


def test_missing_file_names_the_path(tmp_path):
    path = tmp_path / "missing.model"
    with pytest.raises(TokenizerError, match="missing.model") as err:
        Tokenizer(path)
    assert str(path) in str(err.value)
    assert "train_tokenizer.py" in str(err.value)


def test_non_model_file_names_the_path(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("this is not a SentencePiece model\n")
    with pytest.raises(TokenizerError, match="not a SentencePiece model") as err:
        Tokenizer(path)
    assert str(path) in str(err.value)


def test_corpus_layout_and_contents(corpus):
    shards = Counter(path.parent.name for path in CORPUS_DIR.glob("*/*.parquet"))
    assert shards == SHARDS_PER_SOURCE
    assert set(corpus["source"]) == set(SHARDS_PER_SOURCE)
    ids = list(corpus["id"])
    assert len(set(ids)) == len(ids), "document ids must be unique"
    assert all(doc_id.startswith(f"{source}/") for doc_id, source in zip(ids, corpus["source"]))
    texts = list(corpus["text"])
    assert all(text.strip() for text in texts), "no empty documents"
    assert all(title for title in corpus["title"])
    total = sum(len(text.encode()) for text in texts)
    assert 5_000_000 <= total <= 15_000_000, f"corpus holds {total} bytes of text"
