"""Tests for torchtitan/data/tokenizer.py: the bundled SentencePiece model and the corpus it was
trained on, and tokenizer.json files trained here on that corpus, through the whole pipeline."""

import hashlib
import json
import pickle
import re
import shutil
from collections import Counter
from pathlib import Path

import pytest
import tokenizers
import torch
from helpers import (
    CONFIG,
    assert_two_ranks_restore_at_every_step,
    assert_workers_give_the_main_batches,
    bundled_documents,
    losses,
    train_here,
    write_jsonl,
)

from torchtitan.checkpoint import read_manifest
from torchtitan.config import parse_args
from torchtitan.data.hub import import_datasets
from torchtitan.data.packing import LONG_DOCUMENT_CHARS, encode_document
from torchtitan.data.tokenizer import (
    DEFAULT_TOKENIZER_PATH,
    REPO_ROOT,
    Tokenizer,
    TokenizerError,
    build_tokenizer,
    split_lines,
)

datasets = import_datasets()  # its download counter off: no lookup of the Hub's host
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


# ---- tokenizer.json (the tokenizers library) -------------------------------------------

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
HF_VOCAB = 1024


def train_bpe(texts: list[str], pre_tokenizer, special_tokens: list[str]) -> tokenizers.Tokenizer:
    """A byte-level BPE trained on ``texts`` (under a second on a few hundred documents)."""
    tk = tokenizers.Tokenizer(tokenizers.models.BPE())
    tk.pre_tokenizer = pre_tokenizer
    tk.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=HF_VOCAB,
        special_tokens=special_tokens,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(texts, trainer)
    return tk


@pytest.fixture(scope="module")
def corpus_sample(corpus) -> list[str]:
    """Every seventh document of the bundled corpus: ~300 documents of all three sources."""
    return list(corpus["text"][::7])


@pytest.fixture(scope="module")
def hf_dir(corpus_sample, tmp_path_factory) -> Path:
    """A folder as Llama 3-style models ship one: tokenizer.json and tokenizer_config.json.

    Every "\\n" is split off as its own piece before byte-level BPE, so lines encode
    alone exactly as within the whole text. The post-processor adds BOS, which the
    pipeline must not let it do.
    """
    pre = tokenizers.pre_tokenizers
    tk = train_bpe(
        corpus_sample,
        pre.Sequence([pre.Split("\n", "isolated"), pre.ByteLevel(add_prefix_space=False)]),
        [BOS, EOS],
    )
    tk.post_processor = tokenizers.processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, tk.token_to_id(BOS))]
    )
    folder = tmp_path_factory.mktemp("llama3_style")
    tk.save(str(folder / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": {"content": EOS, "special": True}}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def hf_tokenizer(hf_dir) -> Tokenizer:
    return Tokenizer(hf_dir / "tokenizer.json")


@pytest.fixture(scope="module")
def gpt2_style(corpus_sample, tmp_path_factory) -> Path:
    """A tokenizer.json with the library's default byte-level pre-tokenizer, which groups
    runs of whitespace across newlines, and one special token with no BOS/EOS name."""
    tk = train_bpe(
        corpus_sample, tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False), ["<|doc|>"]
    )
    path = tmp_path_factory.mktemp("gpt2_style") / "tokenizer.json"
    tk.save(str(path))
    return path


def test_tokenizer_json_round_trips_and_ignores_its_post_processor(hf_tokenizer, corpus_sample):
    assert (hf_tokenizer.bos_id, hf_tokenizer.eos_id) == (0, 1)
    texts = corpus_sample[:40] + ["", "\n", "  two  spaces\r\n\n", f"{BOS} written in text {EOS}"]
    for text in texts:
        ids = hf_tokenizer.encode(text)
        assert {0, 1}.isdisjoint(ids), "no special id from the tokenizer itself or from text"
        assert hf_tokenizer.decode(ids) == text
        assert hf_tokenizer.encode(text, bos=True, eos=True) == [0, *ids, 1]
        assert hf_tokenizer.decode(torch.tensor([0, *ids, 1, hf_tokenizer.pad_id])) == text
    assert hf_tokenizer.encode_batch(texts, bos=True) == [
        hf_tokenizer.encode(text, bos=True) for text in texts
    ]


def test_tokenizer_json_batches_do_not_depend_on_threads(hf_tokenizer, corpus_sample, monkeypatch):
    serial = hf_tokenizer.encode_batch(corpus_sample[:100])
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")  # the library reads it at each call
    assert hf_tokenizer.encode_batch(corpus_sample[:100]) == serial


def test_tokenizer_json_vocab_pad_folder_and_pickle(hf_dir, hf_tokenizer, tmp_path):
    assert hf_tokenizer.vocab_size == HF_VOCAB
    assert hf_tokenizer.pad_id == hf_tokenizer.eos_id  # the files name no pad token
    padded = tokenizers.Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    padded.add_special_tokens(["<|pad|>"])  # an added token past the trained vocabulary
    padded.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"pad_token": "<|pad|>"}))
    with_pad = Tokenizer(tmp_path)
    assert (with_pad.vocab_size, with_pad.pad_id) == (HF_VOCAB + 1, HF_VOCAB)
    assert Tokenizer(hf_dir).path == hf_tokenizer.path == str(hf_dir / "tokenizer.json")
    clone = pickle.loads(pickle.dumps(hf_tokenizer))
    text = f"Exeunt {EOS}\n"
    assert clone.encode(text) == hf_tokenizer.encode(text)
    assert clone.sha256() == hf_tokenizer.sha256()


def test_tokenizer_json_bos_eos_from_each_source(hf_dir, gpt2_style, tmp_path):
    bare = tmp_path / "tokenizer.json"  # no tokenizer_config.json beside it
    shutil.copy(hf_dir / "tokenizer.json", bare)
    from_template_and_names = Tokenizer(bare)  # BOS from the post-processor, EOS by name
    assert (from_template_and_names.bos_id, from_template_and_names.eos_id) == (0, 1)
    swapped = Tokenizer(hf_dir, bos_token=EOS, eos_token=BOS)  # config beats the files
    assert (swapped.bos_id, swapped.eos_id) == (1, 0)

    with pytest.raises(TokenizerError, match=re.escape(str(gpt2_style))) as err:
        Tokenizer(gpt2_style)
    message = str(err.value)
    assert "\n" not in message and str(gpt2_style) in message and "--model.bos_token" in message
    doc = Tokenizer(gpt2_style, bos_token="<|doc|>", eos_token="<|doc|>")
    assert doc.bos_id == doc.eos_id == 0
    with pytest.raises(TokenizerError, match=r"^model.eos_token '<\|nope\|>' is not a token"):
        Tokenizer(gpt2_style, bos_token="<|doc|>", eos_token="<|nope|>")


def test_build_tokenizer_reads_the_model_section(hf_dir):
    cfg = parse_args(["--model.tokenizer_path", str(hf_dir), "--model.eos_token", BOS])
    tokenizer = build_tokenizer(cfg.model)
    assert (tokenizer.bos_id, tokenizer.eos_id) == (0, 0)


def test_tokenizer_json_sha256_covers_every_file_that_sets_ids(hf_dir, tmp_path):
    folder = tmp_path / "tok"
    shutil.copytree(hf_dir, folder)
    before = Tokenizer(folder).sha256()
    assert Tokenizer(hf_dir).sha256() == before
    assert Tokenizer(folder, eos_token=BOS).sha256() != before
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": EOS}))
    changed_config = Tokenizer(folder).sha256()
    (folder / "tokenizer_config.json").unlink()
    without_config = Tokenizer(folder).sha256()
    data = (folder / "tokenizer.json").read_bytes()
    assert without_config == hashlib.sha256(data).hexdigest()
    spec = json.loads(data)
    spec["post_processor"] = None
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    changed_file = Tokenizer(folder, bos_token=BOS).sha256()
    assert len({before, changed_config, without_config, changed_file}) == 4


def test_splits_at_newlines_is_proven_or_false(hf_tokenizer, gpt2_style, corpus_sample):
    """Newline-isolating pre-tokenizer: proven, and lines encode as the whole text, so the
    long-document fast path keeps every token. Negative control: the default byte-level
    pre-tokenizer groups whitespace across newlines, and does encode some text differently
    line by line, so it must be (and is) False."""
    assert hf_tokenizer.splits_at_newlines
    long_text = "\n".join(corpus_sample)[: LONG_DOCUMENT_CHARS + 1000]
    whole = hf_tokenizer.encode(long_text, bos=True, eos=True)
    assert encode_document(hf_tokenizer, long_text).tolist() == whole

    gpt2 = Tokenizer(gpt2_style, bos_token="<|doc|>", eos_token="<|doc|>")
    assert not gpt2.splits_at_newlines
    text = "Amen.\n\n    And"  # "\n" and the indent after it merge into one token
    by_line = [t for ids in gpt2.encode_batch(split_lines(text)) for t in ids]
    assert by_line != gpt2.encode(text)
    assert encode_document(gpt2, long_text).tolist() == gpt2.encode(long_text, bos=True, eos=True)


def test_unreadable_tokenizer_json_is_one_line(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": 42}')
    with pytest.raises(TokenizerError, match="is not a tokenizer.json") as err:
        Tokenizer(tmp_path)
    assert "\n" not in str(err.value) and str(tmp_path / "tokenizer.json") in str(err.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizerError, match="holds no tokenizer.json"):
        Tokenizer(tmp_path / "empty")


# ---- the pipeline with a tokenizer.json ------------------------------------------------


@pytest.fixture(scope="module")
def six_documents(tmp_path_factory) -> Path:
    """6 very short real documents: the restore check (helpers'
    ``assert_two_ranks_restore_at_every_step``) asks for two passes in 14 steps of 6 x 32
    tokens, which tiny_corpus (1,367 tokens in this vocabulary) misses."""
    folder = tmp_path_factory.mktemp("six") / "shakespeare"
    return write_jsonl(folder, bundled_documents("shakespeare", 6, 300))


def test_one_corpus_measured_with_two_tokenizers_keeps_two_indexes(
    six_documents, tokenizer, hf_tokenizer, tmp_path
):
    """The token counts' key holds the tokenizer: one corpus measured with two tokenizers
    into one folder gives two sets of count files, and each later start finds the counts
    of its own tokenizer (a reused one would hold the other's)."""
    from torchtitan.data import build_stream

    training = parse_args([*CONFIG, "--training.dataset_path", str(six_documents),
                           "--training.length_index_dir", str(tmp_path / "cache")]).training  # fmt: skip
    files = sorted(str(p) for p in six_documents.glob("*.jsonl"))
    texts = datasets.load_dataset("json", data_files=files, split="train")["text"]
    for tok in (tokenizer, hf_tokenizer):
        build_stream(training, tok).orders[0].pass_tokens()
    assert len([p for p in (tmp_path / "cache").iterdir() if p.is_dir()]) == 2
    counts = {}
    for tok in (tokenizer, hf_tokenizer):
        order = build_stream(training, tok).orders[0]  # from the folder now
        units = order.units(order.source.extent())
        counts[tok.sha256()] = [n for u in units for n in order.counts.counts(tuple(u)).lengths]
        assert order.counts.measured == 0
        assert counts[tok.sha256()] == [len(tok.encode(t, bos=True, eos=True)) for t in texts]
    assert len(set(map(tuple, counts.values()))) == 2


@pytest.mark.parametrize("streaming", ["false", "true"], ids=["map", "streaming"])
def test_data_pipeline_restores_at_every_step_with_tokenizer_json(
    six_documents, hf_tokenizer, streaming
):
    # The loader's check, as is: 2 ranks, the length index measured with this tokenizer.
    assert_two_ranks_restore_at_every_step(six_documents, hf_tokenizer, streaming, workers=0)


def test_loader_workers_resume_exactly_with_tokenizer_json(
    six_documents, heavy_corpus, hf_tokenizer, monkeypatch
):
    # The loader's checks, as are: 2 workers give the main process's micro-batches (none
    # repeated or reordered), and loaders with 2 workers restore exactly.
    assert_workers_give_the_main_batches(heavy_corpus, hf_tokenizer, 2, monkeypatch)
    assert_two_ranks_restore_at_every_step(six_documents, hf_tokenizer, "false", workers=2)


def test_training_runs_on_a_tokenizer_json(hf_dir, hf_tokenizer, small_corpus, tmp_path):
    train_here(
        tmp_path, "--model.tokenizer_path", hf_dir / "tokenizer.json",
        "--training.dataset_path", small_corpus, "--training.steps", 3,
        "--checkpoint.enable_checkpoint", "true", "--checkpoint.interval", 3,
    )  # fmt: skip
    assert sorted(losses(tmp_path)) == [1, 2, 3]
    manifest = read_manifest(str(tmp_path / "checkpoint" / "step-3"))
    assert manifest["data_fingerprint"]["tokenizer_sha256"] == hf_tokenizer.sha256()
