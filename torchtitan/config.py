"""Job configuration: dataclass sections filled from TOML, then from the command line.

Owns the JobConfig dataclasses, the `--section.key value` parser generated from them,
and all validation of single values and of combinations. Precedence is
command line > TOML file (`--job.config_file`) > dataclass defaults.

Every problem is raised as one ConfigError, during parsing, before anything is built.
This module must never build models, data or process groups; it only imports the
model and data modules lazily to read their lists of valid names and to check where the
chosen attention backend can train (asking torch whether CUDA is present), and
TensorBoard, only when it is asked for, to check that it can be imported.
"""

import difflib
import json
import math
import sys
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

from torchtitan import REPO_ROOT

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

_TRUE, _FALSE = ("true", "1"), ("false", "0")
_PATH_SUFFIXES = (".parquet", ".json", ".jsonl", ".txt", ".arrow")
# A Hugging Face Hub dataset id in a command-line mix: hub:owner/name[/config[/split]]:weight
_HUB_PREFIX = "hub:"


class ConfigError(ValueError):
    """A bad configuration; the message is one line naming the key, the value and the fix."""


def resolve_path(p: str) -> str:
    """Resolve a relative path against the current directory first, then the repo root.

    Returns `p` unchanged when it is absolute or exists in neither place, so the caller's
    error names the path the user wrote.
    """
    path = Path(p)
    if path.is_absolute():
        return p
    for base in (Path.cwd(), REPO_ROOT):
        if (base / path).exists():
            return str(base / path)
    return p


def _model_flavors() -> list[str]:
    try:
        from torchtitan.models.llama import llama_configs
    except ImportError:  # the model module may not exist yet, or torch may be missing
        return ["debugmodel", "125M", "1B", "8B"]
    return list(llama_configs)


def _dataset_names() -> list[str] | None:
    """Registered dataset names, or None when the registry cannot be imported."""
    try:
        from torchtitan.data.sources import DATASET_REGISTRY
    except ImportError:
        return None
    return sorted(DATASET_REGISTRY)


def _opt(default, help, *, choices=None, ge=None, gt=None, le=None, lt=None, hint=""):
    """A config field: default, one-line help, and the checks `validate` applies to it.

    `choices` is a list or a function returning one (for lists owned by other modules).
    """
    meta = {"help": help, "choices": choices, "ge": ge, "gt": gt, "le": le, "lt": lt}
    meta["hint"] = hint
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class DatasetSpec:
    """One source in a weighted mix: a registry name, a Hub dataset id (``owner/name``)
    or a local path, and its weight. ``config`` and ``split`` choose part of a Hub
    dataset, of a folder laid out like one, or of a ``DatasetDict.save_to_disk`` folder."""

    name: str = ""
    path: str = ""
    weight: float = 1.0
    config: str = ""
    split: str = "train"


@dataclass
class Job:
    config_file: str = _opt("", "TOML file to read")
    dump_folder: str = _opt("./outputs", "folder for checkpoints, metrics, logs")
    description: str = _opt("", "free text describing the job")


@dataclass
class Model:
    name: str = _opt("llama", "model architecture", choices=["llama"])
    flavor: str = _opt("debugmodel", "model size preset", choices=_model_flavors)
    tokenizer_path: str = _opt(
        "data/tokenizer/tokenizer.model",
        "SentencePiece .model, or a tokenizers tokenizer.json (or a folder holding one); "
        "relative paths are tried in the current directory, then the repo root",
    )
    bos_token: str = _opt(
        "", "text of the token that starts each document; empty: the tokenizer files' own"
    )
    eos_token: str = _opt(
        "", "text of the token that ends each document; empty: the tokenizer files' own"
    )
    dropout: float = _opt(0.0, "dropout probability", ge=0.0, lt=1.0)
    attention_mask: str = _opt(
        "causal",
        "causal: every token sees the whole sequence before it; block_causal: only its own "
        "document, with RoPE positions restarting at each document",
        choices=["causal", "block_causal"],
    )
    attention_backend: str = _opt(
        "auto",
        "attention kernel: sdpa (per-document loop; runs everywhere), flex (FlexAttention "
        "block mask; trains on CUDA only), varlen (FlashAttention varlen; CUDA, bf16/fp16); "
        "auto: sdpa on CPU and for causal, on CUDA the fastest present for documents",
        choices=["auto", "sdpa", "flex", "varlen"],
    )


@dataclass
class Optimizer:
    name: str = _opt("AdamW", "optimizer", choices=["AdamW", "Adam", "SGD"])
    lr: float = _opt(8e-4, "peak learning rate", gt=0.0)
    weight_decay: float = _opt(0.1, "decoupled weight decay", ge=0.0)
    beta1: float = _opt(0.9, "Adam beta1 (SGD momentum)", ge=0.0, lt=1.0)
    beta2: float = _opt(0.95, "Adam beta2", ge=0.0, lt=1.0)
    eps: float = _opt(1e-8, "Adam epsilon", gt=0.0)


@dataclass
class LRScheduler:
    warmup_steps: int = _opt(200, "steps of linear warmup from 0 to optimizer.lr", ge=0)
    decay_type: str = _opt(
        "linear", "shape of the decay after warmup", choices=["linear", "cosine", "constant"]
    )
    min_lr_ratio: float = _opt(0.1, "final lr as a fraction of optimizer.lr", ge=0.0, le=1.0)


@dataclass
class Training:
    batch_size: int = _opt(
        8, "sequences per micro-batch (per forward and backward) on each data-parallel rank", ge=1
    )
    seq_len: int = _opt(2048, "tokens per sequence", ge=2)
    steps: int = _opt(10000, "number of optimizer steps to train", ge=1)
    max_norm: float = _opt(1.0, "gradient clipping norm", gt=0.0)
    dataset: str = _opt(
        "bundled", "dataset registry name, or a Hugging Face Hub dataset id (owner/name)"
    )
    dataset_path: str = _opt(
        "",
        "local file, folder or glob, a folder laid out like a Hub dataset (README.md with "
        "configs), a save_to_disk folder or a pretokenized folder; overrides training.dataset",
    )
    dataset_config: str = _opt(
        "", "config of a Hub dataset or Hub-style folder (empty: its default config)"
    )
    dataset_split: str = _opt(
        "train", "split of a Hub dataset, Hub-style folder or DatasetDict save_to_disk folder"
    )
    datasets: list[DatasetSpec] = _opt(
        [],
        "weighted mix as name_or_path:weight,... (a Hub id as hub:owner/name[/config[/split]]); "
        "replaces training.dataset",
    )
    streaming: bool = _opt(
        False,
        "read sources by units (files, parquet row groups, JSON-lines byte ranges) without "
        "loading them; a resume seeks to its unit",
    )
    shuffle: bool = _opt(True, "shuffle the document order")
    text_field: str = _opt("text", "column holding the document text")
    id_field: str = _opt("id", "column holding the document id")
    num_workers: int = _opt(0, "dataloader worker processes per rank", ge=0)
    length_index_dir: str = _opt(
        "",
        "where each corpus's token counts are cached (measured on its first start; empty: "
        "$TORCHTITAN_CACHE/length_index or ~/.cache/torchtitan/length_index)",
    )
    stop_at_step: int = _opt(
        -1,
        "stop after this step as if preempted (-1: run to training.steps); the LR schedule still spans training.steps",
        ge=-1,
    )
    seed: int = _opt(42, "seed for model init, data order and dropout")
    deterministic: bool = _opt(False, "use deterministic torch algorithms")
    data_parallel: str = _opt("fsdp", "data-parallel wrapper", choices=["fsdp", "ddp"])
    global_batch_size: int = _opt(
        0,
        "sequences per optimizer step over all ranks, split as evenly as they go over the "
        "data-parallel ranks and into micro-batches of at most batch_size (0: batch_size x ranks)",
        ge=0,
    )
    batch_size_schedule: str = _opt(
        "",
        "global batch by step, as step:sequences,... from step 0 (e.g. 0:256,2000:512); "
        "overrides global_batch_size",
    )
    mixed_precision_param: str = _opt(
        "auto",
        "dtype of the forward and backward compute; parameters and optimizer state stay "
        "float32 (auto: bfloat16 on GPU, float32 on CPU)",
        choices=["auto", "bfloat16", "float32"],
    )
    mixed_precision_reduce: str = _opt(
        "float32", "dtype of the gradient reduction across ranks (FSDP)",
        choices=["float32", "bfloat16"],
    )  # fmt: skip
    compile: bool = _opt(False, "torch.compile each transformer block and the loss")
    mask_document_boundaries: bool = _opt(
        False,
        "ignore in the loss the label that crosses from one document into the next (a "
        "document's EOS predicting the next one's BOS); the loss is the mean over the "
        "labels that count, over all micro-batches and ranks",
    )
    bad_data: str = _opt(
        "skip",
        "policy for empty, non-string or undecodable documents",
        choices=["skip", "error"],
    )


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = _opt(
        1,
        "data-parallel replicas (HSDP with training.data_parallel fsdp: each replica shards "
        "the model over data_parallel_shard_degree ranks)",
        ge=1,
    )
    data_parallel_shard_degree: int = _opt(
        -1,
        "ranks each data-parallel replica shards the model over (FSDP); -1: the world size "
        "divided by the other degrees",
        ge=-1,
    )
    tensor_parallel_degree: int = _opt(
        1,
        "ranks each layer's matrices are split over (tensor parallel, innermost: adjacent "
        "ranks); they train on the same batches",
        ge=1,
    )
    sequence_parallel: bool = _opt(
        True, "with tensor parallelism, shard the norms' and residuals' activations by sequence"
    )
    loss_parallel: bool = _opt(
        True, "with tensor parallelism, compute the loss on vocabulary-sharded logits"
    )


@dataclass
class ActivationCheckpoint:
    mode: str = _opt(
        "none",
        "recompute transformer blocks' activations in the backward pass: none, full (every "
        "block) or selective (every selective_every-th block)",
        choices=["none", "full", "selective"],
    )
    selective_every: int = _opt(2, "with mode selective, recompute every k-th block", ge=1)


@dataclass
class Validation:
    enable: bool = _opt(False, "log a held-out loss every validation.freq steps")
    dataset: str = _opt(
        "bundled", "dataset registry name or Hub dataset id (owner/name) of the held-out data"
    )
    dataset_path: str = _opt(
        "",
        "local path of the held-out data (as training.dataset_path); overrides validation.dataset",
    )
    dataset_config: str = _opt("", "config of the held-out data (as training.dataset_config)")
    dataset_split: str = _opt(
        "train", "split of the held-out data (as training.dataset_split), e.g. validation"
    )
    freq: int = _opt(100, "steps between validations (and at the last step)", ge=1)
    steps: int = _opt(10, "batches per validation, per rank, from the start of the data", ge=1)


@dataclass
class Checkpoint:
    enable_checkpoint: bool = _opt(False, "save and resume checkpoints")
    folder: str = _opt("checkpoint", "checkpoint folder, relative to job.dump_folder")
    interval: int = _opt(
        500,
        "steps between checkpoints",
        ge=1,
        hint="to disable checkpointing set checkpoint.enable_checkpoint false",
    )
    keep_latest_k: int = _opt(0, "checkpoints to keep; 0 keeps all", ge=0)
    load_step: int = _opt(-1, "step to resume from; -1 = latest", ge=-1)
    async_mode: str = _opt("disabled", "checkpoint saving mode", choices=["disabled", "async"])
    exclude_from_loading: list[str] = _opt(
        [],
        "state to skip when resuming",
        choices=["model", "optimizer", "lr_scheduler", "dataloader", "train_state", "rng"],
    )
    model_weights_only: bool = _opt(False, "save only model weights at the final step")
    create_seed_checkpoint: bool = _opt(False, "write the step-0 checkpoint and exit")
    fallback_on_corruption: bool = _opt(False, "resume from an older checkpoint if one is corrupt")
    accept_data_change: bool = _opt(False, "resume even if the data fingerprint changed")
    initial_load_path: str = _opt(
        "",
        "weights to start from when the run has no checkpoint of its own: another job's "
        "step-N folder (dcp) or a Hugging Face model folder (hf)",
    )
    initial_load_format: str = _opt(
        "dcp", "format of checkpoint.initial_load_path", choices=["dcp", "hf"]
    )
    save_on_signal: list[str] = _opt(
        ["SIGTERM", "SIGUSR1"],
        "signals on which every rank saves the current step and exits (empty: none)",
        choices=["SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT"],
    )
    lease_wait_seconds: float = _opt(
        60.0,
        "how long a job waits for a live job holding the checkpoint folder's lease to exit "
        "(a requeue's predecessor still saving) before it stops",
        ge=0,
    )
    lease_timeout_seconds: float = _opt(
        60.0,
        "a lease whose heartbeat is older than this is a killed job's and is taken over",
        ge=1,
    )


@dataclass
class Metrics:
    log_freq: int = _opt(10, "steps between metric logs", ge=1)
    enable_tensorboard: bool = _opt(False, "write TensorBoard events")
    tensorboard_folder: str = _opt("tb", "TensorBoard folder, relative to job.dump_folder")
    jsonl_file: str = _opt("", "metrics JSONL file; empty means <dump_folder>/metrics.jsonl")
    data_provenance: bool = _opt(False, "log which documents each step consumed")
    peak_tflops: float = _opt(
        0.0,
        "peak dense bf16 TFLOP/s of one accelerator, for MFU (0: known GPUs by name; "
        "MFU is not logged on an unknown device)",
        ge=0.0,
    )
    enable_wandb: bool = _opt(
        False,
        "log to Weights & Biases (rank 0; project from WANDB_PROJECT, offline with "
        "WANDB_MODE=offline; needs pip install wandb)",
    )


@dataclass
class Profiling:
    enable_profiling: bool = _opt(False, "torch profiler traces on rank 0 and the last rank")
    profile_freq: int = _opt(10, "steps between profiled steps", ge=1)
    save_traces_folder: str = _opt(
        "profile_traces", "trace folder, relative to job.dump_folder (iteration_<step>/)"
    )
    enable_memory_snapshot: bool = _opt(
        False,
        "with the traces, the CUDA allocator's memory snapshot (on CPU: a memory summary)",
    )


@dataclass
class Comm:
    init_timeout_seconds: int = _opt(
        300,
        "seconds a collective may wait until the first step is done (start-up, resume, "
        "the first step's compile), on every process group",
        ge=1,
    )
    train_timeout_seconds: int = _opt(
        300,
        "seconds a collective may wait after the first step, on every process group: a "
        "stopped or hung rank ends the job this long after it stopped answering (keep it "
        "above the longest gap between two collectives, e.g. the slowest rank's save)",
        ge=1,
    )


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    validation: Validation = field(default_factory=Validation)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)
    profiling: Profiling = field(default_factory=Profiling)
    comm: Comm = field(default_factory=Comm)

    def to_dict(self) -> dict:
        return asdict(self)

    def jsonl_path(self) -> str:
        return self.metrics.jsonl_file or str(Path(self.job.dump_folder) / "metrics.jsonl")

    def validate(self) -> None:
        """Check every field's range and choices, then the rules that span fields."""
        for section in fields(self):
            for f in fields(section.type):
                value = getattr(getattr(self, section.name), f.name)
                _check_field(f"{section.name}.{f.name}", value, f.metadata)
        t = self.training
        if t.datasets and t.dataset_path:
            raise ConfigError(
                f"training.datasets and training.dataset_path are both set "
                f"(dataset_path={t.dataset_path!r}); set only one of them"
            )
        for i, spec in enumerate(t.datasets):
            _check_dataset_spec(f"training.datasets[{i}]", spec)
        if not t.datasets and not t.dataset_path:
            _check_dataset_name("training.dataset", t.dataset)
        v = self.validation
        if v.enable and not v.dataset_path:
            _check_dataset_name("validation.dataset", v.dataset)
        if t.batch_size_schedule:
            from torchtitan.data.loader import parse_schedule

            try:
                parse_schedule(t.batch_size_schedule)
            except ValueError as e:
                raise ConfigError(
                    f"training.batch_size_schedule {t.batch_size_schedule!r}: {e}; write it as "
                    "step:sequences,... from step 0, e.g. 0:256,2000:512"
                ) from None
        _check_parallelism(self.parallelism, t.data_parallel, t.compile)
        problem = _attention_problem(self)
        if problem:
            raise ConfigError(problem)
        if t.mask_document_boundaries and self.parallelism.tensor_parallel_degree > 1:
            # The label count behind the normalizer is summed over all ranks, and TP peers
            # hold the same labels: not combined yet.
            raise ConfigError(
                "training.mask_document_boundaries with parallelism.tensor_parallel_degree "
                f"{self.parallelism.tensor_parallel_degree} is not supported yet; turn one of them off"
            )
        if self.checkpoint.create_seed_checkpoint and not self.checkpoint.enable_checkpoint:
            raise ConfigError(
                "checkpoint.create_seed_checkpoint is true but checkpoint.enable_checkpoint "
                "is false; set --checkpoint.enable_checkpoint"
            )
        ck = self.checkpoint
        if ck.enable_checkpoint and ck.lease_wait_seconds >= self.comm.init_timeout_seconds:
            # The other ranks wait for rank 0's lease in a collective.
            raise ConfigError(
                f"checkpoint.lease_wait_seconds {ck.lease_wait_seconds:g} is not below "
                f"comm.init_timeout_seconds {self.comm.init_timeout_seconds}: the other ranks "
                "would time out while rank 0 waits for the folder; lower the one or raise the other"
            )
        if self.metrics.enable_tensorboard:
            _check_importable(
                "torch.utils.tensorboard", "metrics.enable_tensorboard", "tensorboard"
            )
        if self.metrics.enable_wandb:
            _check_importable("wandb", "metrics.enable_wandb", "wandb")


def device_type() -> str:
    """Where training will run: the rule torchtitan.parallel.init_distributed applies."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def attention_backend(cfg: "JobConfig", device: str | None = None) -> str:
    """model.attention_backend with ``auto`` resolved for ``device`` (default: this
    machine's)."""
    from torchtitan.models.attention import choose_backend

    device = device or device_type()
    m = cfg.model
    return choose_backend(
        m.attention_backend, m.attention_mask, device, _compute_dtype(cfg, device), m.dropout
    )


def _compute_dtype(cfg: "JobConfig", device: str):
    import torch

    precision = cfg.training.mixed_precision_param
    if precision == "auto":  # as torchtitan.parallel.compute_dtype
        precision = "bfloat16" if device == "cuda" else "float32"
    return getattr(torch, precision)


def _attention_problem(cfg: "JobConfig") -> str | None:
    """Why the attention settings cannot train on this machine (one line), or None."""
    from torchtitan.models.attention import backend_problem

    device, m = device_type(), cfg.model
    return backend_problem(
        attention_backend(cfg, device), m.attention_mask, device, _compute_dtype(cfg, device),
        m.dropout, cfg.training.compile,
    )  # fmt: skip


def _check_parallelism(p: Parallelism, data_parallel: str, compile: bool) -> None:
    """The rules between degrees that need no world size (parallel.py checks the rest)."""
    if compile and p.tensor_parallel_degree > 1:
        # Measured with torch 2.13 on CPU: compiled TP blocks give another gradient than
        # eager ones (step-1 grad norm 0.50 against 0.64; FSDP alone agrees bit for bit).
        raise ConfigError(
            "training.compile with parallelism.tensor_parallel_degree "
            f"{p.tensor_parallel_degree}: compiled tensor-parallel blocks do not give the "
            "eager gradients (torch 2.13); turn off one of them"
        )
    if p.data_parallel_shard_degree == 0:
        raise ConfigError(
            "parallelism.data_parallel_shard_degree: 0 is out of range; use a positive "
            "degree, or -1 for the world size divided by the other degrees"
        )
    if data_parallel == "ddp" and p.tensor_parallel_degree > 1:
        raise ConfigError(
            f"parallelism.tensor_parallel_degree {p.tensor_parallel_degree} needs FSDP: DDP "
            "does not take tensor-parallel weights; use --training.data_parallel fsdp"
        )
    if data_parallel == "ddp" and p.data_parallel_replicate_degree > 1:
        raise ConfigError(
            f"parallelism.data_parallel_replicate_degree {p.data_parallel_replicate_degree} "
            "is HSDP, an FSDP layout (DDP replicates over every rank already); use "
            "--training.data_parallel fsdp, or leave the replicate degree at 1"
        )


def _check_importable(module: str, option: str, package: str) -> None:
    # Checked here, on every rank before anything is built: otherwise only rank 0 finds
    # out, with a traceback, when the metric logger imports it after the model is built.
    try:
        __import__(module)
    except ImportError as e:
        raise ConfigError(
            f"{option} is true but {module} cannot be imported ({e}); "
            f"pip install {package}, or drop --{option}"
        ) from None


def _choices(meta) -> list | None:
    choices = meta.get("choices")
    return choices() if callable(choices) else choices


def _check_field(key: str, value, meta) -> None:
    choices = _choices(meta)
    if choices is not None:
        for item in value if isinstance(value, list) else [value]:
            if item not in choices:
                raise ConfigError(
                    f"{key}: {item!r} is not a valid choice; choose from {', '.join(choices)}"
                )
    ge, gt, le, lt = (meta.get(k) for k in ("ge", "gt", "le", "lt"))
    inside = (
        (ge is None or value >= ge)
        and (gt is None or value > gt)
        and (le is None or value <= le)
        and (lt is None or value < lt)
    )
    if not inside:
        hint = f"; {meta['hint']}" if meta.get("hint") else ""
        raise ConfigError(f"{key}: {value!r} is out of range; must be {_range_text(meta)}{hint}")


def _range_text(meta) -> str:
    """The allowed range as '>= 1', '> 0.0' or 'in [0.0, 1.0)'; empty when unbounded."""
    ge, gt, le, lt = (meta.get(k) for k in ("ge", "gt", "le", "lt"))
    lo, hi = (ge if ge is not None else gt), (le if le is not None else lt)
    if lo is not None and hi is not None:
        return f"in {'[' if ge is not None else '('}{lo}, {hi}{']' if le is not None else ')'}"
    if lo is not None:
        return f"{'>=' if ge is not None else '>'} {lo}"
    if hi is not None:
        return f"{'<=' if le is not None else '<'} {hi}"
    return ""


def _check_dataset_name(key: str, name: str) -> None:
    names = _dataset_names()
    if "/" in name:  # a Hub dataset id; whether it exists is known only when it is read
        return
    if names is not None and name not in names:
        raise ConfigError(
            f"{key}: unknown dataset {name!r}; choose from {', '.join(names)}, a Hugging Face "
            "Hub dataset id (owner/name), or give a local file with training.dataset_path"
        )


def _check_dataset_spec(key: str, spec: DatasetSpec) -> None:
    if bool(spec.name) == bool(spec.path):
        raise ConfigError(
            f"{key}: set exactly one of name and path, got name={spec.name!r} path={spec.path!r}"
        )
    if not spec.weight > 0 or not math.isfinite(spec.weight):
        raise ConfigError(f"{key}.weight: {spec.weight!r} is out of range; must be > 0")
    if spec.name:
        _check_dataset_name(f"{key}.name", spec.name)


def _type_name(tp) -> str:
    if tp == list[DatasetSpec]:
        return "list[name_or_path:weight]"
    return tp.__name__ if isinstance(tp, type) else str(tp)


def _lookup(section: str, key: str, where: str):
    """The dataclass field for section.key, or a ConfigError listing what is valid."""
    sections = {f.name: f.type for f in fields(JobConfig)}
    if section not in sections:
        raise ConfigError(
            f"unknown section {section!r} in {where}; valid sections: {', '.join(sections)}"
        )
    by_name = {f.name: f for f in fields(sections[section])}
    if key not in by_name:
        close = difflib.get_close_matches(key, by_name, n=1)
        guess = f"did you mean {section}.{close[0]}? " if close else ""
        raise ConfigError(
            f"unknown key {section}.{key} in {where}; {guess}"
            f"valid keys of [{section}]: {', '.join(by_name)}"
        )
    return by_name[key]


def _parse_dataset_item(key: str, item: str) -> DatasetSpec:
    hub = item.strip().startswith(_HUB_PREFIX)
    source, weight = item.strip().removeprefix(_HUB_PREFIX), 1.0
    if ":" in source:
        source, text = source.rsplit(":", 1)
        try:
            weight = float(text)
        except ValueError:
            raise ConfigError(
                f"{key}: weight {text!r} in {item!r} is not a number; write name_or_path:weight"
            ) from None
    source = source.strip()
    if hub:
        parts = source.split("/")
        if not 2 <= len(parts) <= 4 or not all(parts):
            raise ConfigError(
                f"{key}: {item!r} is not a Hub dataset; write hub:owner/name[/config[/split]]:weight"
            )
        config, split = (parts + ["", "train"][len(parts) - 2 :])[2:4]
        return DatasetSpec(name="/".join(parts[:2]), config=config, split=split, weight=weight)
    if "/" in source or source.endswith(_PATH_SUFFIXES):
        return DatasetSpec(path=source, weight=weight)
    return DatasetSpec(name=source, weight=weight)


def _from_text(key: str, tp, text: str):
    """Convert one command-line string to the field's type."""
    items = [s.strip() for s in text.split(",") if s.strip()]
    if tp == list[DatasetSpec]:
        return [_parse_dataset_item(key, item) for item in items]
    if tp == list[str]:
        return items
    if tp is bool:
        if text.lower() in _TRUE + _FALSE:
            return text.lower() in _TRUE
        raise ConfigError(f"{key}: expected bool (true, false, 1 or 0), got {text!r}")
    try:
        value = tp(text)
    except ValueError:
        raise ConfigError(f"{key}: expected {tp.__name__}, got {text!r}") from None
    if tp is float and not math.isfinite(value):
        raise ConfigError(f"{key}: expected a finite float, got {text!r}")
    return value


def _from_toml(key: str, tp, value):
    """Check and convert one TOML value to the field's type."""
    if tp == list[DatasetSpec]:
        if isinstance(value, str):
            return _from_text(key, tp, value)
        if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
            raise ConfigError(f"{key}: expected an array of tables [[{key}]], got {value!r}")
        types = {f.name: f.type for f in fields(DatasetSpec)}
        specs = []
        for i, table in enumerate(value):
            for name in set(table) - set(types):
                raise ConfigError(f"unknown key {key}[{i}].{name}; valid keys: {', '.join(types)}")
            spec = {n: _from_toml(f"{key}[{i}].{n}", types[n], v) for n, v in table.items()}
            specs.append(DatasetSpec(**spec))
        return specs
    if tp == list[str]:
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return list(value)
        raise ConfigError(f"{key}: expected an array of strings, got {value!r}")
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise ConfigError(f"{key}: expected {tp.__name__}, got {value!r}")
    if tp is float and not math.isfinite(value):
        raise ConfigError(f"{key}: expected a finite float, got {value!r}")
    return value


def _read_toml(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(
            f"job.config_file: file not found: {path!r}; pass an existing TOML file"
        ) from None
    except OSError as e:
        raise ConfigError(f"job.config_file: cannot read {path!r}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        message = str(e).replace("\n", " ")
        raise ConfigError(f"job.config_file: {path!r} is not valid TOML: {message}") from None


def _parse_cli(argv: list[str]) -> list[tuple[str, str, object]]:
    """Split argv into (section, key, typed value) triples, in the order given."""
    overrides, i = [], 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not arg.startswith("--"):
            raise ConfigError(
                f"unexpected argument {arg!r}; options are written --section.key value"
            )
        name, has_value, text = arg[2:].partition("=")
        section, dot, key = name.partition(".")
        if not dot:
            raise ConfigError(f"option {arg!r} is not of the form --section.key; see --help")
        f = _lookup(section, key, f"--{name}")
        if not has_value:
            following = argv[i] if i < len(argv) else None
            if f.type is bool:
                # A bare flag means true; a following true/false/1/0 is its value.
                text = "true"
                if following is not None and following.lower() in _TRUE + _FALSE:
                    text = following
                    i += 1
            elif following is None or following.startswith("--"):
                raise ConfigError(
                    f"--{name} is missing its value; write --{name} VALUE ({_type_name(f.type)})"
                )
            else:
                text = following
                i += 1
        overrides.append((section, key, _from_text(name, f.type, text)))
    return overrides


def parse_args(argv: list[str] | None = None) -> JobConfig:
    """Build a validated JobConfig from defaults, the TOML file and command-line overrides."""
    argv = sys.argv[1:] if argv is None else list(argv)
    overrides = _parse_cli(argv)
    cfg = JobConfig()
    config_file = next(
        (v for s, k, v in reversed(overrides) if (s, k) == ("job", "config_file")), ""
    )
    if config_file:
        path = resolve_path(config_file)
        for section, table in _read_toml(path).items():
            if not isinstance(table, dict):
                raise ConfigError(
                    f"{section} = {table!r} in {path}: top-level keys must be [section] tables"
                )
            for key, value in table.items():
                f = _lookup(section, key, path)
                setattr(getattr(cfg, section), key, _from_toml(f"{section}.{key}", f.type, value))
    for section, key, value in overrides:
        setattr(getattr(cfg, section), key, value)
    cfg.validate()
    return cfg


def help_text() -> str:
    """Every option with its type, default and one-line help."""
    lines = ["usage: [--job.config_file FILE.toml] [--section.key VALUE ...]", ""]
    for section in fields(JobConfig):
        lines.append(f"[{section.name}]")
        for f in fields(section.type):
            default = f.default if f.default_factory is MISSING else f.default_factory()
            default = [asdict(d) for d in default] if f.type == list[DatasetSpec] else default
            choices, limits = _choices(f.metadata), _range_text(f.metadata)
            extra = f" (choices: {', '.join(choices)})" if choices else ""
            extra += f" (range: {limits})" if limits else ""
            lines.append(
                f"  --{section.name}.{f.name} {_type_name(f.type)} "
                f"(default: {json.dumps(default)}): {f.metadata['help']}{extra}"
            )
        lines.append("")
    return "\n".join(lines)


def load_config_or_exit(argv: list[str] | None = None) -> JobConfig:
    """parse_args for scripts: --help prints the options and exits 0; errors exit 2."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        print(help_text())
        sys.exit(0)
    try:
        return parse_args(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
