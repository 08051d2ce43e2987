"""Tests for torchtitan.config: defaults, TOML and CLI precedence, and every error case."""

import json
import os
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
from helpers import REPO

from torchtitan import parallel
from torchtitan.config import ConfigError, DatasetEntry, JobConfig, parse_args, resolve_path
from torchtitan.data import checks as data_checks
from torchtitan.models import attention


@pytest.fixture(autouse=True)
def fixed_registry(monkeypatch):
    """Pin the dataset registry so these tests do not depend on its contents."""
    monkeypatch.setattr(data_checks, "dataset_names", lambda: ["bundled", "kjv", "shakespeare"])


def write_toml(tmp_path, text: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


def raises(argv, first, *fragments):
    """parse_args(argv) is one ConfigError line holding ``first`` and every fragment."""
    with pytest.raises(ConfigError, match=re.escape(first)) as info:
        parse_args(argv)
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_defaults():
    cfg = parse_args([])
    assert cfg == JobConfig()
    assert cfg.training.batch_size == 8
    assert cfg.optimizer.lr == 8e-4
    assert cfg.training.shuffle is True
    assert cfg.checkpoint.exclude_from_loading == []
    assert cfg.training.datasets == []
    assert cfg.jsonl_path() == str(Path("./outputs") / "metrics.jsonl")


def test_to_dict_is_plain_json():
    cfg = parse_args(["--training.datasets", "shakespeare:0.7,kjv:0.3"])
    d = json.loads(json.dumps(cfg.to_dict()))
    assert d["training"]["batch_size"] == 8
    assert d["training"]["datasets"][0] == {
        "name": "shakespeare", "path": "", "weight": 0.7, "config": "", "split": "train"
    }  # fmt: skip


TOML = """
[training]
batch_size = 4
max_norm = 2
dataset = "kjv"
shuffle = false
[optimizer]
lr = 1e-3
[checkpoint]
enable_checkpoint = true
exclude_from_loading = ["dataloader"]
"""


def test_toml_overrides_defaults(tmp_path):
    cfg = parse_args(["--job.config_file", write_toml(tmp_path, TOML)])
    assert cfg.training.batch_size == 4
    assert cfg.training.max_norm == 2.0 and isinstance(cfg.training.max_norm, float)
    assert cfg.training.dataset == "kjv"
    assert cfg.training.shuffle is False
    assert cfg.optimizer.lr == 1e-3
    assert cfg.checkpoint.enable_checkpoint is True
    assert cfg.checkpoint.exclude_from_loading == ["dataloader"]
    assert cfg.training.seq_len == 2048  # untouched default


def test_cli_overrides_toml(tmp_path):
    path = write_toml(tmp_path, TOML)
    cfg = parse_args(
        [
            "--training.batch_size=16",
            "--job.config_file",
            path,
            "--optimizer.lr",
            "3e-4",
            "--training.dataset",
            "shakespeare",
            "--training.shuffle",
            "--checkpoint.enable_checkpoint",
            "false",
            "--checkpoint.exclude_from_loading",
            "optimizer,rng",
            "--checkpoint.load_step",
            "-1",
        ]
    )
    assert cfg.training.batch_size == 16
    assert cfg.optimizer.lr == 3e-4
    assert cfg.training.dataset == "shakespeare"
    assert cfg.training.shuffle is True
    assert cfg.checkpoint.enable_checkpoint is False
    assert cfg.checkpoint.exclude_from_loading == ["optimizer", "rng"]
    assert cfg.job.config_file == path


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--training.deterministic"], True),
        (["--training.deterministic", "true"], True),
        (["--training.deterministic", "1"], True),
        (["--training.deterministic=0"], False),
        (["--training.deterministic", "False"], False),
    ],
)
def test_bool_forms(argv, expected):
    assert parse_args(argv).training.deterministic is expected


def test_bare_bool_flag_followed_by_option():
    cfg = parse_args(["--training.streaming", "--training.seed", "7"])
    assert cfg.training.streaming is True and cfg.training.seed == 7


def test_datasets_array_of_tables(tmp_path):
    path = write_toml(
        tmp_path,
        """
[[training.datasets]]
name = "shakespeare"
weight = 0.7

[[training.datasets]]
path = "data/corpus.jsonl"
weight = 1
""",
    )
    cfg = parse_args(["--job.config_file", path])
    assert cfg.training.datasets == [
        DatasetEntry(name="shakespeare", weight=0.7),
        DatasetEntry(path="data/corpus.jsonl", weight=1.0),
    ]


def test_datasets_cli_form():
    cfg = parse_args(["--training.datasets", "shakespeare:0.7,kjv:0.3,dump.parquet:2,a/b:1"])
    assert cfg.training.datasets == [
        DatasetEntry(name="shakespeare", weight=0.7),
        DatasetEntry(name="kjv", weight=0.3),
        DatasetEntry(path="dump.parquet", weight=2.0),
        DatasetEntry(path="a/b", weight=1.0),
    ]


def test_datasets_errors(tmp_path):
    raises(["--training.datasets", "shakespeare:heavy"], "training.datasets", "'heavy'")
    raises(["--training.datasets", "shakespeare:0"], "training.datasets[0].weight", "> 0")
    raises(["--training.datasets", "nope:1"], "training.datasets[0].name", "shakespeare")
    raises(
        ["--training.datasets", "kjv:1", "--training.dataset_path", "x.txt"],
        "training.datasets",
        "training.dataset_path",
    )
    path = write_toml(tmp_path, '[[training.datasets]]\nname = "kjv"\nsize = 3\n')
    raises(["--job.config_file", path], "training.datasets[0].size", "name, path, weight")
    path = write_toml(tmp_path, '[[training.datasets]]\nname = "kjv"\npath = "a.txt"\n')
    raises(["--job.config_file", path], "training.datasets[0]", "exactly one")


def test_unknown_section():
    raises(["--trainig.batch_size", "4"], "trainig", "training", "checkpoint")


def test_unknown_key_suggests_close_match():
    raises(["--training.batchsize", "4"], "training.batchsize", "did you mean training.batch_size")


def test_unknown_key_in_toml(tmp_path):
    path = write_toml(tmp_path, "[training]\nbatch_sise = 4\n")
    raises(["--job.config_file", path], "training.batch_sise", "training.batch_size", path)


def test_unknown_section_in_toml(tmp_path):
    path = write_toml(tmp_path, "[trainer]\nbatch_size = 4\n")
    raises(["--job.config_file", path], "trainer", "valid sections")


@pytest.mark.parametrize(
    "argv, fragments",
    [
        (["--training.batch_size", "x"], ["training.batch_size", "int", "'x'"]),
        (["--training.batch_size", "1.5"], ["training.batch_size", "int", "'1.5'"]),
        (["--optimizer.lr", "fast"], ["optimizer.lr", "float", "'fast'"]),
        (["--optimizer.lr", "inf"], ["optimizer.lr", "finite"]),
        (["--training.shuffle=maybe"], ["training.shuffle", "bool", "'maybe'"]),
    ],
)
def test_wrong_type_cli(argv, fragments):
    raises(argv, *fragments)


@pytest.mark.parametrize(
    "toml, fragments",
    [
        ('[training]\nbatch_size = "8"\n', ["training.batch_size", "int", "'8'"]),
        ("[training]\nbatch_size = true\n", ["training.batch_size", "int"]),
        ("[training]\nshuffle = 1\n", ["training.shuffle", "bool"]),
        ('[checkpoint]\nexclude_from_loading = "rng"\n', ["checkpoint.exclude_from_loading"]),
        ("training = 3\n", ["training", "[section]"]),
    ],
)
def test_wrong_type_toml(tmp_path, toml, fragments):
    raises(["--job.config_file", write_toml(tmp_path, toml)], *fragments)


@pytest.mark.parametrize(
    "argv, fragments",
    [
        (["--checkpoint.interval", "0"], ["checkpoint.interval", ">= 1", "enable_checkpoint"]),
        (["--training.batch_size", "0"], ["training.batch_size", ">= 1"]),
        (["--model.dropout", "1.5"], ["model.dropout", "[0.0, 1.0)"]),
        (["--optimizer.lr", "0"], ["optimizer.lr", "> 0"]),
        (["--training.seq_len", "1"], ["training.seq_len", ">= 2"]),
        (["--checkpoint.load_step", "-2"], ["checkpoint.load_step", ">= -1"]),
        (["--lr_scheduler.min_lr_ratio", "1.1"], ["lr_scheduler.min_lr_ratio", "[0.0, 1.0]"]),
    ],
)
def test_out_of_range(argv, fragments):
    raises(argv, *fragments)


@pytest.mark.parametrize(
    "argv, fragments",
    [
        (["--training.data_parallel", "foo"], ["training.data_parallel", "'foo'", "fsdp, ddp"]),
        (["--optimizer.name", "lion"], ["optimizer.name", "AdamW"]),
        (["--model.flavor", "huge"], ["model.flavor", "debugmodel"]),
        (["--checkpoint.exclude_from_loading", "model,weights"], ["'weights'", "dataloader"]),
        (["--training.dataset", "nope"], ["training.dataset", "'nope'", "bundled"]),
    ],
)
def test_bad_choice(argv, fragments):
    raises(argv, *fragments)


def test_dataset_path_skips_registry_check():
    cfg = parse_args(["--training.dataset", "nope", "--training.dataset_path", "x.jsonl"])
    assert cfg.training.dataset_path == "x.jsonl"


def test_seed_checkpoint_needs_checkpointing():
    raises(["--checkpoint.create_seed_checkpoint"], "checkpoint.enable_checkpoint")


def test_missing_file(tmp_path):
    missing = str(tmp_path / "absent.toml")
    raises(["--job.config_file", missing], "job.config_file", missing)


def test_bad_toml(tmp_path):
    path = write_toml(tmp_path, "[training\nbatch_size = 4\n")
    raises(["--job.config_file", path], "job.config_file", path, "line 1")


@pytest.mark.parametrize(
    "argv, fragments",
    [
        (["--training.batch_size"], ["--training.batch_size", "missing its value", "int"]),
        (["--job.dump_folder", "--training.seed", "3"], ["--job.dump_folder", "missing"]),
        (["train.toml"], ["'train.toml'", "--section.key"]),
        (["--batch_size", "4"], ["'--batch_size'", "--section.key"]),
    ],
)
def test_malformed_cli(argv, fragments):
    raises(argv, *fragments)


def test_resolve_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_path("pyproject.toml") == str(REPO / "pyproject.toml")
    (tmp_path / "pyproject.toml").write_text("")
    assert resolve_path("pyproject.toml") == str(tmp_path / "pyproject.toml")
    assert resolve_path("no/such/file") == "no/such/file"
    assert resolve_path("/abs/path") == "/abs/path"


def test_jsonl_path():
    cfg = parse_args(["--job.dump_folder", "/tmp/run"])
    assert cfg.jsonl_path() == "/tmp/run/metrics.jsonl"
    cfg = parse_args(["--metrics.jsonl_file", "m.jsonl"])
    assert cfg.jsonl_path() == "m.jsonl"


def test_real_dataset_registry_knows_the_default():
    sources = pytest.importorskip("torchtitan.data.sources")
    assert JobConfig().training.dataset in sources.DATASET_REGISTRY


def run_cli(*args):
    code = "from torchtitan.config import load_config_or_exit; load_config_or_exit()"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=120
    )


def test_process_exits_2_with_one_error_line():
    result = run_cli("--training.batch_size", "x")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert "training.batch_size" in lines[0]


def test_process_help_lists_every_key():
    result = run_cli("--help")
    assert result.returncode == 0
    defaults = JobConfig().to_dict()
    for section in fields(JobConfig):
        for f in fields(section.type):
            line = next(
                (
                    ln
                    for ln in result.stdout.splitlines()
                    if ln.strip().startswith(f"--{section.name}.{f.name} ")
                ),
                None,
            )
            assert line is not None, f"{section.name}.{f.name} missing from --help"
            default = json.dumps(defaults[section.name][f.name])
            assert f"(default: {default})" in line
            assert f.metadata["help"] in line


def test_tensorboard_missing_is_one_error_line_before_anything_is_built(tmp_path, monkeypatch):
    """Without tensorboard, --metrics.enable_tensorboard stops the job at start-up with one
    line naming the option and the fix, instead of a traceback from the metric logger
    after the model is built. Importing a module whose sys.modules entry is None fails,
    as it does when the package is not installed."""
    from helpers import error_lines, train_here

    for name in ("tensorboard", "torch.utils.tensorboard"):
        monkeypatch.setitem(sys.modules, name, None)
    dump = tmp_path / "run"
    status, log = train_here(dump, "--metrics.enable_tensorboard", "true", expect_ok=False)
    assert status != 0
    assert "Traceback" not in log
    [line] = error_lines(log)
    assert "metrics.enable_tensorboard" in line and "pip install tensorboard" in line
    assert not dump.exists()  # nothing was built or written


# ---- attention backends: where each can train, checked before anything is built -------


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(parallel, "device_type", lambda: "cpu")


@pytest.fixture
def on_gpu(monkeypatch):
    """Validate as on a machine with CUDA and torch's varlen kernel."""
    monkeypatch.setattr(parallel, "device_type", lambda: "cuda")
    monkeypatch.setattr(attention, "varlen_available", lambda: True)


@pytest.mark.parametrize(
    "argv,fragments",
    [
        (["--model.attention_backend", "flex"], ["model.attention_backend flex", "CPU", "sdpa"]),
        (["--model.attention_backend", "varlen"], ["model.attention_backend varlen", "CUDA", "sdpa"]),
        (["--training.compile", "--model.attention_mask", "block_causal"],
         ["training.compile", "block_causal", "sdpa", "flex or varlen"]),
    ],
)  # fmt: skip
def test_attention_that_cannot_train_on_cpu_is_one_line(on_cpu, argv, fragments):
    raises(argv, *fragments)


@pytest.mark.parametrize(
    "argv,fragments",
    [
        (["--model.attention_backend", "varlen", "--training.mixed_precision_param", "float32"],
         ["varlen", "bfloat16 or float16", "float32", "training.mixed_precision_param"]),
        (["--model.attention_backend", "flex", "--model.dropout", "0.1"],
         ["model.dropout 0.1", "flex", "sdpa"]),
        (["--model.attention_backend", "varlen", "--model.dropout", "0.1"],
         ["model.dropout 0.1", "varlen", "sdpa"]),
        (["--model.attention_backend", "sdpa", "--training.compile", "--model.attention_mask",
          "block_causal"], ["training.compile", "recompile"]),
    ],
)  # fmt: skip
def test_attention_that_cannot_train_on_a_gpu_is_one_line(on_gpu, argv, fragments):
    raises(argv, *fragments)


def test_attention_that_can_train_passes(on_gpu):
    """Negative control of the refusals above: each backend where it runs."""
    for argv in (
        ["--model.attention_backend", "flex", "--training.compile", "--model.attention_mask",
         "block_causal"],
        ["--model.attention_backend", "varlen", "--training.compile", "--model.attention_mask",
         "block_causal"],
        ["--model.attention_backend", "sdpa", "--model.dropout", "0.1"],
    ):  # fmt: skip
        parse_args(argv)


def test_auto_backend_is_sdpa_on_cpu_and_the_fastest_present_on_a_gpu(monkeypatch):
    def chosen(*argv, device="cuda", varlen=True):
        monkeypatch.setattr(attention, "varlen_available", lambda: varlen)
        return attention.attention_backend(parse_args(list(argv)), device)

    block = ["--model.attention_mask", "block_causal"]
    assert chosen(*block, device="cpu") == "sdpa"
    assert chosen(*block) == "varlen"  # auto precision on a GPU: bf16
    assert chosen(*block, varlen=False) == "flex"
    assert chosen(*block, "--training.mixed_precision_param", "float32") == "flex"
    assert chosen(*block, "--model.dropout", "0.1") == "sdpa"
    assert chosen() == "sdpa"  # plain causal: torch picks its own flash/cuDNN kernel
    # Asked for (set after parsing: on this CPU machine the parser refuses flex training).
    asked = parse_args(block)
    asked.model.attention_backend = "flex"
    assert attention.attention_backend(asked, "cuda") == "flex"
