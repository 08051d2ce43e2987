"""Hugging Face datasets beyond plain files, each turned into an ordinary SourceSpec:
a Hub dataset id (``allenai/c4``), a local folder laid out like a Hub dataset
repository (a README.md whose YAML lists ``configs:``), and a folder written by
``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``.

Owns: telling these folders apart, choosing a config and a split through the
``datasets`` library's own resolution (``load_dataset_builder``: the data files a
README's ``configs:`` give that config and split), and what each kind adds to the
identity and fingerprint (a Hub id is named ``hub:<id>/<config>/<split>`` and stamped
with its revision; a ``save_to_disk`` folder with its own ``_fingerprint``). Once
resolved, a source is a list of files like any other, so map-style, streaming, exact
resume and provenance are the same code for every kind.

Never: read documents (sources.py does), download data files (a Hub id resolves to
URLs; reading them is the readers' work), or cache a resolution (the data may change
between two calls, and the fingerprint must see it).
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

from torchtitan.data.spec import DEFAULT_SPLIT, DataError, SourceSpec, is_remote, local_path

logger = logging.getLogger(__name__)

# hf://datasets/<owner>/<name>@<revision>/<path in the repo>: what the Hub resolves to.
_HUB_URL = re.compile(r"^(hf://datasets/[^/]+/[^/@]+)(?:@([^/]+))?/")


def is_saved(folder: Path) -> bool:
    """A ``Dataset.save_to_disk`` folder (state.json beside dataset_info.json) or a
    ``DatasetDict.save_to_disk`` folder (dataset_dict.json): the rule ``load_from_disk``,
    which reads it, applies. A state.json alone is another tool's, not one."""
    if (folder / "dataset_dict.json").is_file():
        return True
    return (folder / "state.json").is_file() and (folder / "dataset_info.json").is_file()


def is_hub_folder(folder: Path) -> bool:
    """A folder laid out like a Hub dataset repository: its README.md lists ``configs:``."""
    return bool(_configs(folder))


def _configs(folder: Path) -> list[dict]:
    from huggingface_hub.repocard import metadata_load

    readme = folder / "README.md"
    if not readme.is_file():
        return []
    try:
        configs = (metadata_load(readme) or {}).get("configs")
    except Exception as e:  # noqa: BLE001 - a README that is not YAML-headed is no Hub repo
        logger.debug("%s: no dataset card metadata (%s)", readme, e)
        return []
    return configs if isinstance(configs, list) else []


def hub_source(hub_id: str, config: str, split: str, weight: float = 1.0) -> SourceSpec:
    """A Hub dataset id -> its config's split as a list of ``hf://`` file URLs, named
    ``hub:<id>/<config>/<split>`` (so its order does not depend on where it is cached)
    and stamped with the revision the URLs pin. Cost: the Hub requests of
    ``load_dataset_builder`` (the README and a file listing), no data."""
    if local_path(hub_id).exists():
        raise DataError(
            f"training.dataset {hub_id!r} is a local path, not a Hub dataset id; set "
            "training.dataset_path to it"
        )
    builder = _builder(hub_id, config, hub_id, fix=_HUB_FIX.format(id=hub_id))
    files = _split_files(builder, split, hub_id)
    match = _HUB_URL.match(files[0])
    if match:
        root, revision = match.group(0).rstrip("/"), match.group(2)
    else:  # a local cache or mirror: the files' common folder
        root, revision = os.path.commonpath([os.path.dirname(f) for f in files]), None
    return SourceSpec(
        name=f"hub:{hub_id}/{builder.config.name}/{split}", files=files, weight=weight,
        root=root, location=hub_id, named=True,
        stamps=[["revision", revision]] if revision else [],
    )  # fmt: skip


_HUB_FIX = (
    "check the id and the network (HF_HUB_OFFLINE must be unset), or download it "
    "(hf download --repo-type dataset {id} --local-dir DIR) and set training.dataset_path DIR"
)


def folder_source(
    folder: Path, config: str, split: str, weight: float = 1.0, location: str = ""
) -> SourceSpec:
    """A folder laid out like a Hub dataset repository -> the data files of one config's
    split, named ``<folder>/<config>/<split>``. Its identity is its files' (relative to
    the folder), so a Hub download and a copy of it read alike wherever they lie."""
    names = [c.get("config_name", "default") for c in _configs(folder)]
    if config and config not in names:
        raise DataError(
            f"dataset {location or str(folder)!r} has no config {config!r} (configs: "
            f"{', '.join(names)}); set training.dataset_config to one of them"
        )
    where = location or str(folder)
    builder = _builder(str(folder), config, where, fix="set training.dataset_config")
    files = [f for f in _split_files(builder, split, where) if os.path.getsize(f) > 0]
    if not files:
        raise DataError(f"dataset {where!r} split {split!r} has only empty files; add data")
    return SourceSpec(
        name=f"{folder.resolve().name}/{builder.config.name}/{split}", files=files,
        weight=weight, root=str(folder), location=where, named=False,
    )  # fmt: skip


def saved_source(
    folder: Path, config: str, split: str, weight: float = 1.0, location: str = ""
) -> SourceSpec:
    """A ``save_to_disk`` folder -> its Arrow files (a DatasetDict: those of ``split``),
    read map-style with ``load_from_disk``, stamped with the dataset's own fingerprint
    (state.json's ``_fingerprint``, which ``datasets`` derives from the content)."""
    where = location or str(folder)
    if config:
        raise DataError(
            f"dataset {where!r} is a save_to_disk folder, which has no configs, but config "
            f"{config!r} is set; unset training.dataset_config"
        )
    part, name = folder, folder.resolve().name
    if (folder / "dataset_dict.json").is_file():
        splits = _read_json(folder / "dataset_dict.json", where).get("splits", [])
        if split not in splits:
            raise DataError(
                f"dataset {where!r} has no split {split!r} (splits: {', '.join(splits)}); set "
                "training.dataset_split to one of them"
            )
        part, name = folder / split, f"{name}/{split}"
    elif split != DEFAULT_SPLIT:
        raise DataError(
            f"dataset {where!r} is one saved Dataset, which has no splits, but split {split!r} "
            "is set; unset training.dataset_split"
        )
    state = _read_json(part / "state.json", where)
    files = [str(part / f["filename"]) for f in state.get("_data_files", [])]
    missing = [f for f in files if not os.path.isfile(f)]
    if not files or missing:
        raise DataError(
            f"dataset {where!r} is missing its data files {missing or ['data-*.arrow']}; save "
            "it again with save_to_disk"
        )
    stamp = f"{os.path.relpath(part, folder)}/state.json _fingerprint".removeprefix("./")
    return SourceSpec(
        name=name, files=files, weight=weight, root=str(folder), location=where, named=False,
        disk_path=str(part), stamps=[[stamp, state.get("_fingerprint", "")]],
    )  # fmt: skip


def _read_json(path: Path, where: str) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DataError(
            f"dataset {where!r}: {path.name} cannot be read ({e}); save it again with save_to_disk"
        ) from None


def import_datasets():
    """The ``datasets`` library with its download counting off. Otherwise every
    ``load_dataset`` and ``load_dataset_builder`` sends a HEAD request for its packaged
    builder (json, parquet) to the Hub's bucket, local files included. Where the Hub
    cannot be reached (a cluster's compute nodes, this machine), the name lookup alone
    held the process ~5 s (the DNS timeout; seen in 1 of 3 loader builds of the test
    suite), per source, in every rank and every loader worker that opens one. What a
    job reads is no download of anyone's: nothing is sent. Cost: none."""
    import datasets

    datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = False
    return datasets


def _builder(path: str, config: str, where: str, fix: str):
    datasets = import_datasets()
    try:
        return datasets.load_dataset_builder(path, name=config or None)
    except Exception as e:  # noqa: BLE001 - one line that names the dataset and the fix
        message = " ".join(str(e).split())
        raise DataError(
            f"dataset {where!r} (config {config or '(default)'!r}) could not be resolved: "
            f"{type(e).__name__}: {message}; {fix}"
        ) from None


def _split_files(builder, split: str, where: str) -> list[str]:
    data_files = builder.config.data_files or {}
    if split not in data_files:
        raise DataError(
            f"dataset {where!r} config {builder.config.name!r} has no split {split!r} (splits: "
            f"{', '.join(data_files)}); set training.dataset_split to one of them"
        )
    files = [str(f) for f in data_files[split]]
    if not files:
        raise DataError(f"dataset {where!r} split {split!r} lists no data files")
    return [f if is_remote(f) else os.path.abspath(f) for f in files]
