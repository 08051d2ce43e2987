"""The job configuration's schema: one dataclass per section, with each field's default,
one-line help, choices and range.

Owns: the sections and fields of JobConfig, their defaults, and the metadata the
command line (`cli.py`) shows and the validation (`validate.py`) checks: `choices`
(a fixed list) and `ge`/`gt`/`le`/`lt` bounds, with `range_text` to say them.

Never: import anything from torchtitan (every component may import this module), parse
text, or check more than a field's own metadata says; lists owned by a component
(model flavors, dataset names, attention backends) are that component's to check.
Cost: nothing beyond building the dataclasses.
"""

from dataclasses import asdict, dataclass, field
from pathlib import Path


def _opt(default, help, *, choices=None, ge=None, gt=None, le=None, lt=None, hint=""):
    """A config field: default, one-line help, and the checks `validate` applies to it
    (the choices and range that need nothing but the value itself)."""
    meta = {"help": help, "choices": choices, "ge": ge, "gt": gt, "le": le, "lt": lt}
    meta["hint"] = hint
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class DatasetEntry:
    """One entry of ``training.datasets`` as the config says it: a registry name, a Hub
    dataset id (``owner/name``) or a local path, and its weight. ``config`` and ``split``
    choose part of a Hub dataset, of a folder laid out like one, or of a
    ``DatasetDict.save_to_disk`` folder. The data package resolves it to a
    ``data.spec.SourceSpec`` (its files, identity and kind)."""

    name: str = ""
    path: str = ""
    weight: float = 1.0
    config: str = ""
    split: str = "train"


@dataclass
class MixPoint:
    """One point of ``training.mix_schedule``: from training step ``step`` the source
    weights move in a straight line to ``weights`` (by source name; a source not named
    is at 0), reaching them at ``step + ramp`` (at once for ramp 0). The data package
    checks it (``data.checks``)."""

    step: int = 0
    weights: dict[str, float] = field(default_factory=dict)
    ramp: int = 0


@dataclass
class Job:
    config_file: str = _opt("", "TOML file to read")
    dump_folder: str = _opt("./outputs", "folder for checkpoints, metrics, logs")
    description: str = _opt("", "free text describing the job")


@dataclass
class Model:
    name: str = _opt("llama", "model architecture", choices=["llama"])
    flavor: str = _opt(
        "debugmodel", "model size preset, a name in torchtitan.models.llama.llama_configs"
    )
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
    name: str = _opt(
        "AdamW",
        "optimizer; Muon: Muon on the hidden matrices (experts: per expert), AdamW on the rest",
        choices=["AdamW", "Adam", "SGD", "Muon"],
    )
    lr: float = _opt(8e-4, "peak learning rate (Muon: of the hidden matrices)", gt=0.0)
    weight_decay: float = _opt(0.1, "decoupled weight decay", ge=0.0)
    beta1: float = _opt(0.9, "Adam beta1 (SGD momentum)", ge=0.0, lt=1.0)
    beta2: float = _opt(0.95, "Adam beta2", ge=0.0, lt=1.0)
    eps: float = _opt(1e-8, "Adam epsilon", gt=0.0)
    muon_momentum: float = _opt(0.95, "Muon momentum", ge=0.0, lt=1.0)
    muon_nesterov: bool = _opt(True, "Muon: Nesterov momentum")
    # mutant muon-six-ns-steps: `_opt(5,` -> `_opt(6,`; test/test_muon.py::test_the_configs_muon_defaults_are_torchs
    muon_ns_steps: int = _opt(5, "Muon: Newton-Schulz iterations", ge=1, lt=100)
    muon_ns_a: float = _opt(3.4445, "Muon: Newton-Schulz coefficient a (of X)")
    muon_ns_b: float = _opt(-4.775, "Muon: Newton-Schulz coefficient b (of A X, A = X X^T)")
    muon_ns_c: float = _opt(2.0315, "Muon: Newton-Schulz coefficient c (of A^2 X)")
    muon_eps: float = _opt(1e-7, "Muon: floor of the norm a matrix is divided by", gt=0.0)
    muon_adjust_lr: str = _opt(
        "original",
        "Muon: LR scale per matrix: original (sqrt(max(1, rows/cols)); lr ~0.02) or "
        "match_rms_adamw (0.2 sqrt(max(rows, cols)); an AdamW lr and weight decay carry over)",
        choices=["original", "match_rms_adamw"],
    )
    muon_adamw_lr: float = _opt(
        0.0,
        "Muon: peak LR of the AdamW part (embeddings, output, norms, router); 0: optimizer.lr",
        ge=0.0,
    )
    muon_adamw_weight_decay: float = _opt(
        -1.0,
        "Muon: weight decay of the AdamW part; negative: optimizer.weight_decay",
    )


@dataclass
class LRScheduler:
    warmup_steps: int = _opt(200, "steps of linear warmup from 0 to optimizer.lr", ge=0)
    decay_type: str = _opt(
        "linear",
        "shape of the decay to min_lr_ratio: linear, cosine, sqrt (1 - sqrt of its progress) "
        "or constant (none)",
        choices=["linear", "cosine", "sqrt", "constant"],
    )
    decay_ratio: float = _opt(
        0.0,
        "warmup-stable-decay: optimizer.lr after warmup, then the decay over the last "
        "decay_ratio of training.steps (rounded to a step); 0: the decay follows the warmup",
        ge=0.0,
        le=1.0,
    )
    decay_steps: int = _opt(
        0,
        "warmup-stable-decay with the decay over the last decay_steps of training.steps "
        "(instead of decay_ratio); 0: unset",
        ge=0,
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
    datasets: list[DatasetEntry] = _opt(
        [],
        "weighted mix as name_or_path:weight,... (a Hub id as hub:owner/name[/config[/split]]); "
        "replaces training.dataset",
    )
    mix_schedule: list[MixPoint] = _opt(
        [],
        "source weights by step: a TOML array of tables {step, weights = {name = w}, ramp}, "
        'or JSON on the command line ([{"step": 1000, "weights": {"web": 1, "code": 1}, '
        '"ramp": 200}]); before the first point, training.datasets\' weights',
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
        "where each unit's token counts are kept, measured when the order first reaches the "
        "unit and shared by every process, job and node that reads the folder (multi-node: "
        "a folder every node shares, or a bucket: s3://bucket/prefix; empty: "
        "$TORCHTITAN_CACHE/length_index or ~/.cache/torchtitan/length_index)",
    )
    length_index_wait_seconds: float = _opt(
        600.0,
        "seconds a process waits for a unit's token counts that another process is "
        "measuring before it stops, naming that process",
        ge=0,
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
    compile: bool = _opt(
        False,
        "torch.compile each transformer block and the loss, each whole (fullgraph: a graph "
        "break is an error, not a silent fall back to eager); an MoE block's expert "
        "dispatch, whose group sizes are data, runs eager between its compiled parts",
    )
    compile_backend: str = _opt(
        "inductor", "torch.compile's backend: inductor (fused kernels), or aot_eager / "
        "eager to check tracing alone (graph breaks, recompiles) without building kernels",
        choices=["inductor", "aot_eager", "eager"],
    )  # fmt: skip
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
    max_bad_steps: int = _opt(
        3,
        "stop the job after this many steps in a row with a non-finite loss or gradient "
        "norm (each one's update is dropped on every rank)",
        ge=1,
    )
    spike_window: int = _opt(
        128,
        "steps of loss and gradient norm the spike check compares a step with (checks begin "
        "once it is full; 0: no z-score check)",
        ge=0,
    )
    spike_sigma: float = _opt(
        6.0, "a loss or gradient norm this many standard deviations above the window's mean "
        "is a spike", gt=0.0,
    )  # fmt: skip
    spike_max_loss: float = _opt(
        0.0, "a loss above this is a spike from step 1 on (0: no bound)", ge=0.0
    )
    spike_max_grad_norm: float = _opt(
        0.0, "a gradient norm (before clipping) above this is a spike (0: no bound)", ge=0.0
    )
    on_spike: str = _opt(
        "log",
        "what a detected spike does: log it; skip_step (drop its update); rewind (reload the "
        "newest checkpoint at least rewind_steps before it and skip the data from there)",
        choices=["log", "skip_step", "rewind"],
    )
    rewind_steps: int = _opt(
        1, "on_spike rewind: the checkpoint reloaded is at least this many steps before the "
        "spike", ge=1,
    )  # fmt: skip
    skip_after: int = _opt(
        0, "on_spike rewind: steps of data after the spike skipped as well", ge=0
    )
    max_rewinds: int = _opt(
        3, "on_spike rewind: stop the job at the spike after this many rewinds", ge=0
    )
    skip_steps: str = _opt(
        "",
        "the data of these training steps is passed over, as a rewind does: first-last,... "
        "(e.g. 101-300); kept with the ones the checkpoint holds",
    )
    skip_windows: str = _opt(
        "",
        "these windows of the global order are passed over when the position reaches them, "
        "at the weights of the step that reaches them: first-last,... (e.g. 4000-4999); kept "
        "with the ones the checkpoint holds",
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
    expert_parallel_degree: int = _opt(
        1,
        "ranks a mixture-of-experts flavor's experts are sharded over (expert parallel: "
        "tokens go to the rank holding their expert by all-to-all); for now the "
        "data-parallel shard degree, or 1",
        ge=1,
    )
    pipeline_parallel_degree: int = _opt(
        1,
        "pipeline ranks the model's layers are split over (pipeline parallel, the outermost "
        "dimension: each data-parallel rank's batch runs through all of them)",
        ge=1,
    )
    pipeline_parallel_schedule: str = _opt(
        "1F1B",
        "how the step's micro-batches flow through the stages (Interleaved1F1B: two stages "
        "per rank)",
        choices=["GPipe", "1F1B", "Interleaved1F1B"],
    )
    pipeline_parallel_microbatch_size: int = _opt(
        1, "sequences per pipeline micro-batch (a rank's batch of a step is cut into them)", ge=1
    )
    pipeline_parallel_split_points: str = _opt(
        "",
        "the first layer of each stage after the first, e.g. 2,5 (empty: an even split)",
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
    folder: str = _opt(
        "checkpoint",
        "checkpoint folder, relative to job.dump_folder, or a URL (s3://bucket/prefix; "
        "credentials and endpoint from the AWS_* variables)",
    )
    interval: int = _opt(
        500,
        "steps between checkpoints",
        ge=1,
        hint="to disable checkpointing set checkpoint.enable_checkpoint false",
    )
    local_interval: int = _opt(
        0,
        "steps between checkpoints to checkpoint.local_folder, a fast local tier beside "
        "checkpoint.folder (steps that checkpoint.interval saves go there); 0: no local tier",
        ge=0,
    )
    local_folder: str = _opt(
        "checkpoint_local",
        "the local tier's folder (checkpoint.local_interval), relative to job.dump_folder; "
        "a local path, never a URL",
    )
    keep_latest_k: int = _opt(0, "checkpoints to keep; 0 keeps all", ge=0)
    load_step: int = _opt(-1, "step to resume from; -1 = latest", ge=-1)
    async_mode: str = _opt("disabled", "checkpoint saving mode", choices=["disabled", "async"])
    exclude_from_loading: list[str] = _opt(
        [],
        "state to skip when resuming",
        choices=[
            "model",
            "optimizer",
            "lr_scheduler",
            "dataloader",
            "train_state",
            "rng",
            "spikes",
        ],
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
    branch_from: str = _opt(
        "",
        "another run's step-N checkpoint folder to start from whole (weights, optimizer, data "
        "position, RNG, step, spike guard) while this run has no checkpoint of its own: a "
        "cooldown or any branch, saved in this run's folder; the source is only read",
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
class FaultTolerance:
    """Live fault tolerance with torchft (docs/fault_tolerance.md): replica groups, each
    its own torchrun job, are the outer data-parallel dimension; a group that dies is
    dropped from the next step's quorum and a group that (re)joins heals from a peer."""

    enable: bool = _opt(False, "train as one replica group of a fault-tolerant job (torchft)")
    replica_id: int = _opt(0, "this replica group's index, 0 .. replica_groups - 1", ge=0)
    replica_groups: int = _opt(2, "the most replica groups the job has", ge=1)
    min_replica_groups: int = _opt(
        1, "the fewest live replica groups a step is committed with (fewer: it waits)", ge=1
    )
    lighthouse: str = _opt(
        "", "the lighthouse's address (http://host:port); empty: $TORCHFT_LIGHTHOUSE"
    )
    timeout_seconds: float = _opt(
        30.0, "seconds a cross-group collective, commit vote or heal transfer may take", gt=0.0
    )
    quorum_timeout_seconds: float = _opt(
        120.0, "seconds a step waits for its quorum (enough live groups) before it fails", gt=0.0
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
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)

    def to_dict(self) -> dict:
        return asdict(self)

    def jsonl_path(self) -> str:
        return self.metrics.jsonl_file or str(Path(self.job.dump_folder) / "metrics.jsonl")


def range_text(meta) -> str:
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
