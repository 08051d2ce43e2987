"""Source kinds beyond plain files: a folder laid out like a Hugging Face Hub dataset (README
configs), Hub dataset ids, ``save_to_disk`` folders (Dataset and DatasetDict) and
pretokenized corpora. Each restores at every step, has a fingerprint that follows its
data and not its location, and fails with one line that names the fix; a pretokenized
corpus yields the batches of tokenizing its original on the fly, and is never tokenized.

Loaders are built as a job builds them (helpers' ``loaders``: the config parsed, the data
plan and length index made by the real code).

No network here: a Hub id is resolved through a local folder standing in for the Hub.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import (
    CONFIG,
    assert_restores_at_every_step,
    bundled_documents,
    cfg,
    error_lines,
    global_steps,
    loaders,
    losses,
    read_jsonl,
    train_here,
    write_jsonl,
    write_parquet,
)

from torchtitan.checkpoint import fingerprint_diff
from torchtitan.config import ConfigError, DatasetSpec, parse_args
from torchtitan.data import document_lengths, source_specs
from torchtitan.data.pretokenize import pretokenize
from torchtitan.data.sources import DataError, open_source, resolve_source

README = """---
configs:
- config_name: shakespeare
  default: true
  data_files:
  - split: train
    path: shakespeare/train-*.parquet
  - split: validation
    path: shakespeare/validation-*.parquet
- config_name: kjv
  data_files:
  - split: train
    path: kjv/*.jsonl
---
# A folder laid out like a Hub dataset repository
"""


def write_hub_repo(folder: Path) -> Path:
    shakespeare, kjv = bundled_documents("shakespeare", 12, 300), bundled_documents("kjv", 8, 300)
    write_parquet(folder / "shakespeare" / "train-00000-of-00002.parquet", shakespeare[:4])
    write_parquet(folder / "shakespeare" / "train-00001-of-00002.parquet", shakespeare[4:8])
    write_parquet(folder / "shakespeare" / "validation-00000-of-00001.parquet", shakespeare[8:])
    write_jsonl(folder / "kjv", kjv, files=2)
    (folder / "README.md").write_text(README)
    return folder


@pytest.fixture(scope="session")
def hub_repo(tmp_path_factory) -> Path:
    """Two configs (shakespeare: train and validation; kjv: train) as on the Hub."""
    return write_hub_repo(tmp_path_factory.mktemp("hub") / "corpus")


def save_dataset(folder: Path, docs: list[dict]) -> Path:
    import datasets

    datasets.Dataset.from_list(docs).save_to_disk(str(folder))
    return folder


@pytest.fixture(scope="session")
def saved(tmp_path_factory) -> Path:
    """A Dataset.save_to_disk folder of 8 short documents."""
    return save_dataset(
        tmp_path_factory.mktemp("saved") / "ds", bundled_documents("milton", 8, 300)
    )


@pytest.fixture(scope="session")
def saved_dict(tmp_path_factory) -> Path:
    """A DatasetDict.save_to_disk folder: train (kjv) and test (shakespeare)."""
    import datasets

    folder = tmp_path_factory.mktemp("saved_dict") / "dd"
    parts = {
        "train": bundled_documents("kjv", 8, 300),
        "test": bundled_documents("shakespeare", 8, 300),
    }
    datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in parts.items()}).save_to_disk(
        str(folder)
    )
    return folder


@pytest.fixture(scope="session")
def pretokenized(tmp_path_factory, tiny_corpus, tokenizer) -> Path:
    """tiny_corpus, pretokenized in this process."""
    out = tmp_path_factory.mktemp("pretok") / "tok"
    pretokenize(resolve_source(path=str(tiny_corpus)), tokenizer, str(out), workers=1)
    return out


@pytest.fixture(scope="session")
def pretokenized_dozen(tmp_path_factory, dozen_corpus, tokenizer) -> Path:
    out = tmp_path_factory.mktemp("pretok_dozen") / "tok"
    pretokenize(resolve_source(path=str(dozen_corpus)), tokenizer, str(out), workers=1)
    return out


# ---- restore at every step, for every kind ----------------------------------------------

# kind -> the training.* settings that choose it, from the session's folders.
KINDS = {
    "hub_folder": lambda f: dict(dataset_path=f["hub_repo"], dataset_config="kjv"),
    "hub_id": lambda f: dict(dataset="someone/corpus", dataset_config="kjv"),
    "saved": lambda f: dict(dataset_path=f["saved"]),
    "saved_dict": lambda f: dict(dataset_path=f["saved_dict"], dataset_split="test"),
    "pretokenized": lambda f: dict(dataset_path=f["pretokenized"]),
}


def spec_of(kind: str, folders: dict):
    """The source a kind's settings resolve to, as the job resolves it."""
    args = [*CONFIG, *(str(a) for k, v in KINDS[kind](folders).items()
                       for a in (f"--training.{k}", v))]  # fmt: skip
    (spec,) = source_specs(parse_args(args).training)
    return spec


@pytest.fixture(scope="session")
def kind_folders(hub_repo, saved, saved_dict, pretokenized) -> dict:
    return {"hub_repo": hub_repo, "saved": saved, "saved_dict": saved_dict,
            "pretokenized": pretokenized}  # fmt: skip


@pytest.mark.parametrize("streaming", ["false", "true"], ids=["map", "streaming"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_kind_restores_at_every_step(kind, streaming, kind_folders, tokenizer, monkeypatch):
    """The state after k steps, loaded into fresh loaders, gives exactly the rest, for
    k = 0..10 across document and pass ends (8 short documents, 2 ranks, 6 sequences a
    step). Negative control: a position one token off does not reproduce the reference."""
    if kind == "hub_id":
        hub_from_folder(monkeypatch, kind_folders["hub_repo"])
    kw = dict(KINDS[kind](kind_folders), streaming=streaming, global_batch_size=6)
    assert_restores_at_every_step(
        lambda: loaders(None, tokenizer, 2, **kw),
        steps=14,
        ahead=3,
        ks=range(11),
        control=5,
        delta=-1,
    )


# ---- Hub-style folders ------------------------------------------------------------------


def test_hub_folder_config_and_split_choose_the_files(hub_repo):
    default = resolve_source(path=str(hub_repo))
    assert default.name == "corpus/shakespeare/train" and default.fmt == "parquet"
    assert [default.relative_name(f) for f in default.files] == [
        "shakespeare/train-00000-of-00002.parquet", "shakespeare/train-00001-of-00002.parquet"
    ]  # fmt: skip
    validation = resolve_source(path=str(hub_repo), split="validation")
    assert [validation.relative_name(f) for f in validation.files] == [
        "shakespeare/validation-00000-of-00001.parquet"
    ]
    kjv = resolve_source(path=str(hub_repo), config="kjv")
    assert kjv.fmt == "json"
    assert [kjv.relative_name(f) for f in kjv.files] == ["kjv/part-000.jsonl", "kjv/part-001.jsonl"]
    assert len({default.identity(), validation.identity(), kjv.identity()}) == 3


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(config="welsh"), r"has no config 'welsh' \(configs: shakespeare, kjv\); set training.dataset_config"),
        (dict(config="kjv", split="validation"), r"config 'kjv' has no split 'validation' \(splits: train\); set training.dataset_split"),
    ],
    ids=["config", "split"],
)  # fmt: skip
def test_hub_folder_unknown_config_or_split_is_one_line(hub_repo, kw, message):
    with pytest.raises(DataError, match=message) as e:
        resolve_source(path=str(hub_repo), **kw)
    assert "\n" not in str(e.value)


def test_config_or_split_on_a_source_without_them_is_one_line(tiny_corpus, saved):
    with pytest.raises(DataError, match="has no configs .* unset training.dataset_config"):
        resolve_source(path=str(tiny_corpus), config="en")
    with pytest.raises(DataError, match="has no splits .* unset training.dataset_split"):
        resolve_source(name="kjv", split="test")
    with pytest.raises(DataError, match="one saved Dataset, which has no splits"):
        resolve_source(path=str(saved), split="test")


# ---- Hub dataset ids --------------------------------------------------------------------


class FakeBuilder:
    def __init__(self, name: str, data_files: dict):
        self.config = type("Config", (), {"name": name, "data_files": data_files})()


def test_hub_id_is_named_and_stamped_with_its_revision(monkeypatch):
    """A Hub id resolves to hf:// URLs pinned at a revision: the source is named after
    the id, config and split (its order does not depend on any local path), its files
    are named relative to the repository, and nothing is read to fingerprint it."""
    import datasets

    url = "hf://datasets/allenai/c4@1588ec45/en/c4-train.{:05d}-of-01024.json.gz"
    asked = []

    def builder(path, name=None):
        asked.append((path, name))
        return FakeBuilder("en", {"train": [url.format(i) for i in range(2)]})

    monkeypatch.setattr(datasets, "load_dataset_builder", builder)
    spec = resolve_source(name="allenai/c4", config="en")
    assert asked == [("allenai/c4", "en")]
    assert (spec.name, spec.identity(), spec.fmt) == (
        "hub:allenai/c4/en/train", "name:hub:allenai/c4/en/train", "json"
    )  # fmt: skip
    assert spec.fingerprint() == [
        ["en/c4-train.00000-of-01024.json.gz"], ["en/c4-train.00001-of-01024.json.gz"],
        ["revision", "1588ec45"],
    ]  # fmt: skip


def hub_from_folder(monkeypatch, folder: Path):
    """Every Hub id resolves to ``folder``, as if it were the repository on the Hub."""
    import datasets

    real = datasets.load_dataset_builder
    monkeypatch.setattr(
        datasets, "load_dataset_builder", lambda path, name=None: real(str(folder), name=name)
    )


def test_training_on_a_hub_id(tmp_path, hub_repo, monkeypatch):
    """``training.dataset owner/name`` with a config, trained in this process, validated
    on another config's validation split of the same repository (given as a folder); the
    Hub is a local folder here (no network), reached through the same resolution."""
    hub_from_folder(monkeypatch, hub_repo)
    args = ["--training.dataset", "someone/corpus", "--training.dataset_config", "kjv",
            "--training.steps", 2, "--training.seq_len", 32, "--metrics.data_provenance",
            "--validation.enable", "--validation.dataset_path", hub_repo, "--validation.steps", 1,
            "--validation.dataset_config", "shakespeare", "--validation.dataset_split",
            "validation"]  # fmt: skip
    train_here(tmp_path, *args)
    assert "validation_loss" in read_jsonl(tmp_path / "metrics.jsonl")[-1]
    records = "".join(p.read_text() for p in (tmp_path / "provenance").iterdir())
    assert "hub:someone/corpus/kjv/train" in records


def test_unreachable_hub_id_is_one_line(tmp_path, monkeypatch):
    import datasets
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    status, log = train_here(tmp_path, "--training.dataset", "allenai/c4",
                             "--training.dataset_config", "en", expect_ok=False)  # fmt: skip
    (line,) = error_lines(log)
    assert status == 1 and "dataset 'allenai/c4' (config 'en') could not be resolved" in line
    assert "set training.dataset_path" in line


def test_mix_entries_take_hub_ids_configs_and_splits(tmp_path, hub_repo):
    cfg = parse_args([*CONFIG, "--training.datasets", "hub:allenai/c4/en:0.3,shakespeare:0.7"])
    assert cfg.training.datasets == [
        DatasetSpec(name="allenai/c4", config="en", weight=0.3),
        DatasetSpec(name="shakespeare", weight=0.7),
    ]
    assert (
        parse_args([*CONFIG, "--training.dataset", "allenai/c4"]).training.dataset == "allenai/c4"
    )
    with pytest.raises(ConfigError, match="write hub:owner/name"):
        parse_args([*CONFIG, "--training.datasets", "hub:c4:0.3"])
    toml = tmp_path / "mix.toml"
    toml.write_text(
        f'[training]\n[[training.datasets]]\npath = "{hub_repo}"\nconfig = "shakespeare"\n'
        f'split = "validation"\n[[training.datasets]]\npath = "{hub_repo}"\nconfig = "kjv"\n'
    )
    cfg = parse_args(["--job.config_file", str(toml)])
    from torchtitan.data import source_specs

    assert [s.name for s in source_specs(cfg.training)] == [
        "corpus/shakespeare/validation", "corpus/kjv/train"
    ]  # fmt: skip


# ---- save_to_disk -----------------------------------------------------------------------


def test_saved_dict_chooses_its_split_and_reads_without_copying(saved_dict):
    spec = resolve_source(path=str(saved_dict), split="test")
    assert spec.name == "dd/test" and spec.fmt == "arrow"
    source = open_source(spec, "text", "id", 7, True, False)
    assert [f["filename"] for f in source.ds.cache_files] == spec.files  # memory-mapped in place
    with pytest.raises(DataError, match=r"has no split 'validation' \(splits: train, test\)"):
        resolve_source(path=str(saved_dict), split="validation")


# ---- fingerprints -----------------------------------------------------------------------


def fingerprint(spec) -> dict:
    return {"sources": [{"name": spec.name, "identity": spec.identity(), "weight": spec.weight,
                         "files": spec.fingerprint()}]}  # fmt: skip


@pytest.mark.parametrize("kind", ["hub_folder", "saved", "pretokenized"])
def test_fingerprint_follows_the_data_not_its_location(kind, kind_folders, tmp_path, tokenizer):
    """Moving the folder keeps the identity and the fingerprint; editing the data changes
    the fingerprint, and the difference names what changed."""
    key = {"hub_folder": "hub_repo"}.get(kind, kind)
    moved = tmp_path / "elsewhere" / Path(kind_folders[key]).name
    shutil.copytree(kind_folders[key], moved)
    before = spec_of(kind, kind_folders)
    after = spec_of(kind, {**kind_folders, key: moved})
    assert fingerprint(after) == fingerprint(before)
    if kind == "hub_folder":
        write_jsonl(moved / "kjv", bundled_documents("kjv", 7, 300))
        changed = "kjv/part-001.jsonl changed"
    elif kind == "saved":
        shutil.rmtree(moved)
        save_dataset(moved, bundled_documents("milton", 7, 300))
        changed = "state.json _fingerprint changed"
    else:
        shutil.rmtree(moved)
        fewer = write_jsonl(
            tmp_path / "fewer" / "shakespeare", bundled_documents("shakespeare", 7, 300)
        )
        pretokenize(resolve_source(path=str(fewer)), tokenizer, str(moved), workers=1)
        changed = "tokens-00000.parquet changed"
    edited = spec_of(kind, {**kind_folders, key: moved})
    diffs = fingerprint_diff(fingerprint(before), fingerprint(edited))
    assert any(changed in d for d in diffs), diffs


def test_a_file_edited_in_place_is_refused_on_resume(tmp_path, small_corpus):
    """Through train.py's plan, whose ranks sign their shares of the files: a corpus file
    edited in place between a save and a resume (its size unchanged, so only its bytes'
    CRC tells) stops the resume with one line naming the file and the way on;
    ``--checkpoint.accept_data_change`` resumes on the edited data."""
    corpus = shutil.copytree(small_corpus, tmp_path / "corpus")
    dump = tmp_path / "run"
    args = ["--training.dataset_path", corpus, "--checkpoint.enable_checkpoint",
            "--training.seq_len", 32, "--training.batch_size", 2]  # fmt: skip
    train_here(dump, *args, "--training.steps", 3, "--training.stop_at_step", 2)

    edited = corpus / "part-001.jsonl"
    text = edited.read_text()
    assert " the " in text
    edited.write_text(text.replace(" the ", " thy ", 1))  # same size, other bytes
    status, log = train_here(dump, *args, "--training.steps", 3, expect_ok=False)
    errors = error_lines(log)
    assert status == 1 and len(errors) == 1, log[-2000:]
    assert "file part-001.jsonl changed" in errors[0] and "accept_data_change" in errors[0]
    train_here(dump, *args, "--training.steps", 3, "--checkpoint.accept_data_change")


# ---- plain folders with another tool's files ---------------------------------------------

STRAYS = {  # what other tools leave in a data folder, under the names the kinds look for
    "stats.json": json.dumps({"documents": 6, "tokens": 1234}),  # one line, as json.dump writes
    "manifest.json": json.dumps({"files": ["part-000.jsonl"], "created": "2026-01-01"}),
    "state.json": json.dumps({"step": 3}, indent=2),
    "meta/info.json": json.dumps([{"text": "an array, not JSON lines"}]),
}


def documents(spec, streaming: bool) -> list[tuple]:
    source = open_source(spec, "text", "id", 7, True, streaming)
    if streaming:
        return list(source.all_documents())
    return [source.document(i) for i in range(len(source))]


@pytest.mark.parametrize("ext", ["jsonl", "parquet", "json"])
def test_a_folder_with_stray_json_files_reads_only_its_data(tmp_path, ext):
    """Another tool's stats.json, manifest.json or state.json beside the data makes the
    folder neither a pretokenized corpus nor a save_to_disk folder, and is not read as
    documents: the folder reads the documents, identity and fingerprint of the same folder
    without them. A folder of JSON lines named .json keeps them, and skips the strays
    that are not JSON lines. Negative control: a pretokenized manifest of another
    version is still refused."""
    docs = bundled_documents("shakespeare", 6, 300)
    clean, stray = tmp_path / "clean" / "c", tmp_path / "stray" / "c"
    if ext == "parquet":
        write_parquet(clean / "part-000.parquet", docs)
    else:
        write_jsonl(clean, docs)
        for f in clean.glob("*.jsonl"):
            f.rename(f.with_suffix(f".{ext}"))
    shutil.copytree(clean, stray)
    # Beside .json data a one-line JSON object could be a one-document file: keep the
    # strays that are not JSON lines (pretty-printed, an array).
    strays = STRAYS if ext != "json" else {k: STRAYS[k] for k in ("state.json", "meta/info.json")}
    for name, text in strays.items():
        (stray / name).parent.mkdir(exist_ok=True)
        (stray / name).write_text(text)
    expected, got = resolve_source(path=str(clean)), resolve_source(path=str(stray))
    assert [Path(f).name for f in got.files] == [Path(f).name for f in expected.files]
    assert (got.identity(), fingerprint(got)) == (expected.identity(), fingerprint(expected))
    for streaming in (False, True):
        read = [documents(spec, streaming) for spec in (expected, got)]
        assert read[1] == read[0] and len(read[0]) == len(docs), streaming
    (stray / "manifest.json").write_text(json.dumps({"format": "torchtitan-pretokenized/v0"}))
    with pytest.raises(DataError, match="has format 'torchtitan-pretokenized/v0'"):
        resolve_source(path=str(stray))


# ---- pretokenized -----------------------------------------------------------------------


def bad_corpus(folder: Path) -> Path:
    docs = bundled_documents("shakespeare", 10, 300)
    docs[2]["text"], docs[5]["text"], docs[7]["text"] = "", "  \n\t ", None
    return write_jsonl(folder, docs)


def test_pretokenized_batches_equal_on_the_fly(tmp_path, tokenizer):
    """Through the loaders of 2 ranks: the same tokens and spans at every step, and the
    same skipped-document counts, as tokenizing the original on the fly, across passes,
    with unusable documents (empty, whitespace, null) stored as null and skipped alike.
    Negative control: one stored token changed in a copy shows up in the batches."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    original = bad_corpus(tmp_path / "bad")
    manifest = pretokenize(resolve_source(path=str(original)), tokenizer, str(tmp_path / "tok"),
                           workers=1)  # fmt: skip
    assert manifest["unusable_documents"] == {"has no text": 1, "is empty or whitespace-only": 2}

    def steps(path) -> list[tuple]:
        """Per step: its windows, their spans, and each rank's skipped-document count."""
        ranks = loaders(path, tokenizer, 2, global_batch_size=8)
        out = []
        for _ in range(12):
            (step,) = global_steps(ranks, 1)
            skipped = [r.skipped_documents() for r in ranks]
            out.append(([w for w, _ in step], [s for _, s in step], skipped))
        return out

    fly, pre = steps(original), steps(tmp_path / "tok")
    assert pre == fly
    assert pre[-1][2][0] > 0 and len({sp[4] for _, spans, _ in pre for s in spans for sp in s}) > 1
    shutil.copytree(tmp_path / "tok", tmp_path / "tampered")
    path = tmp_path / "tampered" / "tokens-00000.parquet"
    table = pq.read_table(path)
    rows = table.column("tokens").to_pylist()
    rows[0][3] = (rows[0][3] + 1) % tokenizer.vocab_size
    pq.write_table(table.set_column(1, "tokens", pa.array(rows, pa.list_(pa.int32()))), path)
    tampered = steps(tmp_path / "tampered")
    assert [t[0] for t in tampered] != [f[0] for f in fly]  # the tokens differ,
    assert [t[1:] for t in tampered] == [f[1:] for f in fly]  # nothing else does


def test_pretokenize_output_does_not_depend_on_workers(tmp_path, small_corpus, tokenizer):
    """1 and 2 processes write the same bytes: the chunks (and so row groups and file
    boundaries) are fixed by the data alone. Here 3 files of chunks of 5 documents."""
    spec = resolve_source(path=str(small_corpus))
    for workers in (1, 2):
        pretokenize(spec, tokenizer, str(tmp_path / f"w{workers}"), workers=workers,
                    chunk_documents=5, file_tokens=2000)  # fmt: skip
    names = sorted(p.name for p in (tmp_path / "w1").iterdir())
    assert len(names) >= 3 and names == sorted(p.name for p in (tmp_path / "w2").iterdir())
    assert all(
        (tmp_path / "w1" / n).read_bytes() == (tmp_path / "w2" / n).read_bytes() for n in names
    )
    manifest = json.loads((tmp_path / "w1" / "manifest.json").read_text())
    assert manifest["documents"] == 24 and manifest["source"]["identity"] == spec.identity()


def test_pretokenized_lengths_are_read_not_tokenized(tmp_path, tiny_corpus, pretokenized,
                                                     tokenizer):  # fmt: skip
    """The provenance check's document lengths come from the stored token lists (a
    tokenizer that cannot encode is never asked) and equal the on-the-fly ones; the
    length index (measured here, in a fresh cache) and the loader's windows neither
    tokenize, and give the original's steps."""

    class NoEncoding:
        path, sha256 = tokenizer.path, tokenizer.sha256
        bos_id, eos_id = tokenizer.bos_id, tokenizer.eos_id

        def encode(self, *a, **k):
            raise AssertionError("a pretokenized source was tokenized")

        encode_batch = encode

    def lengths(path, tok):
        return document_lengths(parse_args([*CONFIG, "--training.dataset_path", str(path)]), tok)

    assert lengths(pretokenized, NoEncoding()) == lengths(tiny_corpus, tokenizer)
    with pytest.raises(AssertionError, match="tokenized"):
        lengths(tiny_corpus, NoEncoding())
    pre = loaders(pretokenized, NoEncoding(), 1, length_index_dir=tmp_path / "index")
    assert list((tmp_path / "index").glob("*.npz")), "the index was measured here"
    assert global_steps(pre, 4) == global_steps(loaders(tiny_corpus, tokenizer, 1), 4)
    with pytest.raises(AssertionError, match="tokenized"):
        loaders(tiny_corpus, NoEncoding(), 1, length_index_dir=tmp_path / "index")


def test_pretokenized_trains_like_the_original_and_refuses_another_tokenizer(
    tmp_path, tiny_corpus, pretokenized
):
    """In-process training: the pretokenized corpus gives the original's losses to the
    bit; trained with another tokenizer (here: another EOS, which changes the ids) it
    stops with one line naming both and the fix."""
    args = ["--training.steps", 3, "--training.seq_len", 32]
    train_here(tmp_path / "fly", *args, "--training.dataset_path", tiny_corpus)
    train_here(tmp_path / "pre", *args, "--training.dataset_path", pretokenized)
    assert (
        losses(tmp_path / "pre") == losses(tmp_path / "fly") and len(losses(tmp_path / "pre")) == 3
    )
    status, log = train_here(tmp_path / "other", *args, "--training.dataset_path", pretokenized,
                             "--model.eos_token", "<s>", expect_ok=False)  # fmt: skip
    (line,) = error_lines(log)
    assert status == 1 and "was made with tokenizer" in line and "training uses" in line
    assert "set --model.tokenizer_path to the one it was made with" in line


def test_missing_or_incomplete_folders_are_one_line(tmp_path, pretokenized):
    with pytest.raises(DataError, match="matches no data files"):
        resolve_source(path=str(tmp_path / "nowhere"))
    partial = tmp_path / "partial"
    shutil.copytree(pretokenized, partial)
    (partial / "tokens-00000.parquet").unlink()
    with pytest.raises(DataError, match=r"is missing \['tokens-00000.parquet'\] that its manifest"):
        resolve_source(path=str(partial))
    with pytest.raises(DataError, match="is not empty; choose a new or empty folder"):
        pretokenize(resolve_source(name="kjv"), None, str(pretokenized))


# ---- elastic resume over a pretokenized source ------------------------------------------


def test_elastic_resume_over_a_pretokenized_source(pretokenized_dozen, tokenizer):
    """2 ranks x micro-batch 4 -> 1 rank x 2 micro-batches of 4 (global batch 8 kept) over
    a pretokenized 12-document corpus, through more than one pass: the provenance checks
    find every token read exactly once and, with the lengths from the stored token counts,
    every document of each finished pass read whole. Negative control: a step read twice
    (a replay at the change of layout) is seen.

    In process: the loaders are what a rank runs (test_train's elastic chain launches
    real jobs); train.py over a pretokenized corpus is tested above."""
    from torchtitan.provenance import check_complete, check_exactly_once

    provenance = {0: {}, 1: {}}
    ranks = loaders(pretokenized_dozen, tokenizer, 2, global_batch_size=8)
    for step in range(1, 7):
        for r, loader in enumerate(ranks):
            provenance[r][step] = [s for b in loader.next_step() for s in b["spans"]]
    (one,) = loaders(pretokenized_dozen, tokenizer, 1, global_batch_size=8)
    one.load_state_dict(ranks[1].state_dict())
    for step in range(7, 13):
        batches = one.next_step()
        assert [len(b["spans"]) for b in batches] == [4, 4]
        provenance[0][step] = [s for b in batches for s in b["spans"]]
    reports = check_exactly_once(provenance)
    assert all(r.duplicate_tokens == r.gaps == 0 for r in reports.values()), reports
    lengths = document_lengths(cfg(pretokenized_dozen), tokenizer)
    report = check_complete(provenance, lengths)["shakespeare"]
    assert len(report.finished_epochs) >= 1 and (report.missing, report.partial) == (0, 0)
    replayed = {0: {**provenance[0], 13: provenance[0][6]}, 1: provenance[1]}
    assert check_exactly_once(replayed)["shakespeare"].duplicate_tokens > 0
