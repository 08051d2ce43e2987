"""torchtitan/data/sources.py (and hub.py): what a configured source resolves to. Plain
files and folders, a folder laid out like a Hugging Face Hub dataset (README configs),
Hub dataset ids, ``save_to_disk`` folders (Dataset and DatasetDict) and pretokenized
corpora (whose own tests are in test_pretokenized.py). Each restores at every step, has a
fingerprint that follows its data and not its location, and fails with one line that
names the fix.

Loaders are built as a job builds them (helpers' ``loaders``: the config parsed, the data
plan and length index made by the real code).

No network here: a Hub id is resolved through a local folder standing in for the Hub.
"""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import pytest
from helpers import (
    CONFIG,
    GOOD_DOCUMENTS,
    assert_restores_at_every_step,
    bundled_documents,
    error_lines,
    loaders,
    read_jsonl,
    read_unit,
    train_here,
    write_jsonl,
    write_jsonl_file,
    write_parquet,
)

from torchtitan.config import ConfigError, DatasetEntry, parse_args
from torchtitan.data import source_specs
from torchtitan.data.fingerprint import fingerprint_diff
from torchtitan.data.pretokenized_write import pretokenize
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


def test_opening_local_data_looks_up_no_host(hub_repo, tiny_corpus, monkeypatch):
    """A Hub-style folder resolved and a map-style source opened (``load_dataset_builder``
    and ``load_dataset`` on local files) look up no host: ``datasets``' download counter,
    a HEAD request to the Hub's bucket on every call, is off (where the Hub cannot be
    reached, its name lookup held each process ~5 s a source). Lookups are seen at the
    socket (this thread's, where ``datasets`` makes them) and refused at once. Negative
    control: ``load_dataset`` on the same files with the counter on looks up the bucket's
    host."""
    import socket
    import threading

    import datasets

    asked, real, here = [], socket.getaddrinfo, threading.current_thread()

    def lookup(host, *args, **kwargs):
        if threading.current_thread() is not here:  # another test's thread left running
            return real(host, *args, **kwargs)
        asked.append(host)
        raise socket.gaierror(socket.EAI_NONAME, "no host is looked up in this test")

    monkeypatch.setattr(socket, "getaddrinfo", lookup)
    hub = resolve_source(path=str(hub_repo), config="kjv")
    plain = resolve_source(path=str(tiny_corpus))
    for spec in (hub, plain):
        assert len(open_source(spec, "text", "id", False).ds) > 0
    assert asked == []
    monkeypatch.setattr(datasets.config, "HF_UPDATE_DOWNLOAD_COUNTS", True)
    datasets.load_dataset("json", data_files=plain.files, split="train")
    assert asked and all(host == "s3.amazonaws.com" for host in asked), asked


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
        DatasetEntry(name="allenai/c4", config="en", weight=0.3),
        DatasetEntry(name="shakespeare", weight=0.7),
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
    source = open_source(spec, "text", "id", False)
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


@pytest.mark.parametrize("append", [False, True], ids=["edited", "edited-and-appended"])
def test_a_file_edited_in_place_is_refused_on_resume(tmp_path, small_corpus, append):
    """Through train.py's plan, whose ranks sign their shares of the files: a corpus file
    edited in place between a save and a resume (its size unchanged, so only its bytes'
    CRC tells) stops the resume with one line naming the file and the way on;
    ``--checkpoint.accept_data_change`` resumes on the edited data. An edit is refused
    as well when a file is appended at the same time: growth is only growth when every
    saved file is unchanged."""
    corpus = shutil.copytree(small_corpus, tmp_path / "corpus")
    dump = tmp_path / "run"
    args = ["--training.dataset_path", corpus, "--checkpoint.enable_checkpoint",
            "--training.seq_len", 32, "--training.batch_size", 2]  # fmt: skip
    train_here(dump, *args, "--training.steps", 3, "--training.stop_at_step", 2)

    edited = corpus / "part-001.jsonl"
    text = edited.read_text()
    assert " the " in text
    edited.write_text(text.replace(" the ", " thy ", 1))  # same size, other bytes
    if append:
        (corpus / "part-999.jsonl").write_text(text)
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
    source = open_source(spec, "text", "id", streaming)
    return [
        (doc_id, value) for unit in source.units() for _, doc_id, value in read_unit(source, unit)
    ]


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


# ---- paths, columns, ids, the registry ----------------------------------------------------


def test_missing_path_and_column_are_clear_errors(small_corpus, tokenizer):
    with pytest.raises(DataError, match="matches no data files"):
        resolve_source(path="/nonexistent/corpus")
    with pytest.raises(DataError, match="no column 'body'"):
        loaders(small_corpus, tokenizer, 1, text_field="body")


def test_id_less_documents_get_stable_ids(tmp_path, tokenizer):
    (tmp_path / "a.txt").write_text("A plain text document.\nWith two lines.\n")
    (tmp_path / "b.txt").write_text("Another document entirely.\n")
    for streaming in ("false", "true"):
        (loader,) = loaders(tmp_path, tokenizer, 1, shuffle="false", streaming=streaming)
        ids = {sp[1] for _ in range(2) for s in next(loader)["spans"] for sp in s}
        assert len(ids) == 2, ids


def test_source_registry_covers_bundled_corpus():
    spec = resolve_source(name="bundled")
    assert len(spec.files) == 20 and spec.fmt == "parquet"
    names = ("shakespeare", "milton", "kjv")
    assert list(itertools.chain(*[resolve_source(name=n).files for n in names])) == spec.files


def test_empty_files_and_empty_datasets(tmp_path, tokenizer):
    folder = write_jsonl_file(tmp_path / "d" / "a.jsonl", GOOD_DOCUMENTS)
    (folder / "empty.jsonl").write_text("")
    assert len(resolve_source(path=str(folder)).files) == 1  # the empty file is skipped
    empty = write_jsonl_file(tmp_path / "e" / "a.jsonl", raw=b"")
    with pytest.raises(DataError, match="only empty files"):
        resolve_source(path=str(empty))
