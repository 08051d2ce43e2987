"""The training loop's features: mixed precision, activation checkpointing,
gradient accumulation, validation, throughput, compile and the shipped configs.

Exact resume with them switched on is checked where resumes are: the 2-rank acceptance
run in test_train.py carries bf16, full recompute, accumulation and validation, and the
elastic chain there resumes 2 ranks on 1 with two micro-batches per step.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
from helpers import CONFIG, REPO, read_jsonl, train_here

from torchtitan import parallel
from torchtitan.config import parse_args
from torchtitan.data import build_validation_loader
from torchtitan.data.schedule import BatchSchedule
from torchtitan.loss import BatchLoss
from torchtitan.models import build_model, count_parameters
from torchtitan.models.llama import flops_per_token, llama_configs
from torchtitan.records.metrics import peak_tflops
from torchtitan.step import TrainStep
from torchtitan.validate import Validator

ONE_RANK = parallel.ParallelDims(0, 1, 0, torch.device("cpu"), "gloo")


def config(*argv) -> object:
    return parse_args([*CONFIG, *map(str, argv)])


def model_for(cfg):
    return parallel.parallelize(build_model(cfg.model.flavor, 4096, device="meta"), cfg, ONE_RANK)


def sequences(count: int, seq_len: int = 32) -> dict:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 4096, (count, seq_len + 1), generator=g)
    return {"input": tokens[:, :-1], "label": tokens[:, 1:]}


def split(batch: dict, parts: int) -> list[dict]:
    return [dict(zip(batch, values)) for values in zip(*(v.chunk(parts) for v in batch.values()))]


def split_as_the_loader_does(batch: dict, micro: int, weights: bool = True) -> list[dict]:
    """``batch`` (one rank's whole global batch) cut into the loader's micro-batches of at
    most ``micro``, each with the loader's loss weight (or none: the negative control)."""
    size = len(batch["input"])
    schedule = BatchSchedule([(0, size)], micro, 1)
    parts, at = [], 0
    for n in schedule.micro_sizes(size, schedule.accumulation(size)):
        part = {k: v[at : at + n] for k, v in batch.items()}
        if weights:
            part["loss_weight"] = n / size
        parts.append(part)
        at += n
    return parts


def gradients_of(cfg, batches: list[dict], scale=None) -> dict:
    """The gradient TrainStep applies for ``batches``, read just before the update."""
    model = model_for(cfg)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    seen = {}

    def capture():
        seen.update({n: p.grad.clone() for n, p in model.named_parameters()})

    cfg.training.max_norm = 1e9  # no clipping: compare the raw gradients
    loss = BatchLoss(cfg, model, ONE_RANK)
    if scale is not None:  # negative control: a different loss scaling
        inner = loss.cross_entropy
        loss.cross_entropy = lambda *args: inner(*args) * scale
    TrainStep(cfg, model, optimizer, scheduler, loss, capture)(batches)
    return seen


# ---- gradient accumulation -------------------------------------------------------------


def test_accumulated_gradient_equals_the_gradient_of_one_big_batch():
    """4 micro-batches of 2 give the gradient of one batch of 8 (to float rounding: the
    sums run in another order), each micro-batch's loss weighted 1/4; and 8 sequences in
    micro-batches of at most 3 (3, 3, 2) do too, weighted 3/8, 3/8, 2/8 as the loader sets
    them. Negative controls: a loss scaled 4 times, and equal weights on the unequal
    micro-batches, give other gradients."""
    batch = sequences(8)
    big = gradients_of(config("--training.batch_size", 8), [batch])
    cfg = config("--training.batch_size", 2, "--training.global_batch_size", 8)
    assert BatchSchedule.from_config(cfg.training, 1).accumulation(8) == 4
    accumulated = gradients_of(cfg, split(batch, 4))
    unscaled = gradients_of(cfg, split(batch, 4), scale=4.0)
    uneven = split_as_the_loader_does(batch, 3)
    assert [len(p["input"]) for p in uneven] == [3, 3, 2]
    weighted = gradients_of(cfg, uneven)
    equal = gradients_of(cfg, split_as_the_loader_does(batch, 3, weights=False))
    for name, grad in big.items():
        torch.testing.assert_close(accumulated[name], grad, rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(weighted[name], grad, rtol=1e-4, atol=1e-7)
        assert not torch.allclose(unscaled[name], grad, rtol=1e-2, atol=1e-6), name
    assert any(not torch.allclose(equal[n], g, rtol=1e-3, atol=1e-7) for n, g in big.items())


def test_the_loss_over_chunks_of_rows_is_the_loss_over_all_of_them():
    """The cross-entropy runs over chunks of rows (buffers that fit malloc's heap on CPU,
    a bounded fp32 copy on GPU): its sum and its mean over the labels that count equal
    F.cross_entropy's over the whole batch, to float rounding (the sum runs in another
    order), with chunks that do not divide the rows and ignored labels. Negative
    control: the mean taken over every label, ignored ones included, is off."""
    from torchtitan.loss import IGNORE_INDEX, _cross_entropy

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 37, 64, generator=g)
    labels = torch.randint(0, 64, (3, 37), generator=g)
    labels[0, ::5] = IGNORE_INDEX
    flat, target = logits.flatten(0, 1), labels.flatten()
    chunk_bytes = 4 * 64 * 10  # 10 rows per chunk, 12 chunks, the last of 1 row
    for reduction in ("sum", "mean"):
        expected = F.cross_entropy(flat, target, reduction=reduction)
        got = _cross_entropy(logits, labels, reduction, chunk_bytes)
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
    every_label = F.cross_entropy(flat, target, reduction="sum") / target.numel()
    assert not torch.allclose(_cross_entropy(logits, labels, "mean", chunk_bytes), every_label)


def with_documents(batch: dict, seed: int = 0) -> dict:
    """``batch`` cut into documents of 1 to 12 tokens, laid out as the loader's collate
    lays them out: ids over each window, inputs' and labels' views of them."""
    B, T = batch["input"].shape
    g = torch.Generator().manual_seed(seed)
    sizes = [torch.randint(1, 13, (T + 1,), generator=g) for _ in range(B)]
    window_ids = torch.stack(
        [torch.repeat_interleave(torch.arange(T + 1), n)[: T + 1] for n in sizes]
    )
    positions = torch.stack([torch.cat([torch.arange(k) for k in n.tolist()])[:T] for n in sizes])
    return {**batch, "positions": positions, "document_ids": window_ids[:, :-1],
            "label_document_ids": window_ids[:, 1:]}  # fmt: skip


def test_masked_boundaries_are_normalized_by_the_labels_that_count_in_the_whole_batch(
    monkeypatch,
):
    """With training.mask_document_boundaries, micro-batches hold different numbers of
    labels that count; 4 micro-batches of 2 still give the gradient of one batch of 8 (to
    float rounding), the mean over every label that counts. Negative controls: dividing by
    all labels instead of those that count, and not masking, give other gradients."""
    batch = with_documents(sequences(8))
    mask = "--training.mask_document_boundaries"
    big = gradients_of(config("--training.batch_size", 8, mask), [batch])
    cfg = config("--training.batch_size", 2, "--training.global_batch_size", 8, mask)
    parts = split(batch, 4)
    counted = [BatchLoss(cfg, None, ONE_RANK).counted(p) for p in parts]
    assert len(set(counted)) > 1 and sum(counted) < batch["label"].numel()
    accumulated = gradients_of(cfg, parts)
    unmasked = gradients_of(config("--training.batch_size", 8), [batch])
    monkeypatch.setattr(BatchLoss, "counted", lambda self, b: b["label"].numel())
    all_labels = gradients_of(cfg, parts)
    for name, grad in big.items():
        torch.testing.assert_close(accumulated[name], grad, rtol=1e-4, atol=1e-7)
        for wrong in (unmasked, all_labels):
            assert not torch.allclose(wrong[name], grad, rtol=1e-2, atol=1e-6), name


def test_a_batch_size_schedule_sets_each_steps_batch_and_a_bad_one_is_one_line(tmp_path):
    """0:4,2:6,3:5 in micro-batches of 4: steps 1-2 take 4 sequences, step 3 six (two
    micro-batches, 3 and 3), step 4 five; tokens_seen counts what each step took. A
    schedule that does not start at step 0 is one config line, status 2."""
    _, log = train_here(tmp_path / "run", "--training.steps", 4, "--metrics.log_freq", 1,
                        "--training.batch_size_schedule", "0:4,2:6,3:5")  # fmt: skip
    seen = [r["tokens_seen"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")]
    assert seen == [4 * 128, 8 * 128, 14 * 128, 19 * 128]
    status, log = train_here(tmp_path / "bad", "--training.batch_size_schedule", "5:4",
                             expect_ok=False)  # fmt: skip
    assert (
        status == 2
        and "training.batch_size_schedule '5:4': the first point must be at step 0" in log
    )


def test_a_data_restart_under_a_schedule_takes_each_steps_batch(tmp_path):
    """Resumed at step 2 with ``--checkpoint.exclude_from_loading dataloader`` (the data
    starts over, so the loader's own step is not restored) under the schedule 0:4,2:8:
    train.py hands the loader the resumed step, and steps 3-4 take 8 sequences each, as
    ``tokens_seen`` counts (step 0's batch would count 4)."""
    args = ["--training.steps", 4, "--metrics.log_freq", 1, "--training.batch_size_schedule",
            "0:4,2:8", "--checkpoint.enable_checkpoint", "--checkpoint.interval", 2]  # fmt: skip
    train_here(tmp_path / "run", *args, "--training.stop_at_step", 2)
    _, log = train_here(tmp_path / "run", *args, "--checkpoint.exclude_from_loading",
                        "dataloader")  # fmt: skip
    (loaded,) = [line for line in log.splitlines() if "loaded checkpoint" in line]
    assert "dataloader" not in loaded
    seen = [r["tokens_seen"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")]
    assert seen == [4 * 128, 8 * 128, 16 * 128, 24 * 128]


# ---- activation checkpointing and mixed precision --------------------------------------


def test_activation_checkpointing_recomputes_blocks_and_changes_no_gradient():
    """full recomputes every block in the backward pass, selective every k-th; the
    gradients are bit-equal to keeping the activations (with dropout: the recompute
    replays the RNG). Counting forward calls is what fails if nothing is recomputed."""
    batch = [sequences(2)]
    reference = None
    for mode, every, expected in (("none", 2, [1, 1]), ("full", 2, [2, 2]),
                                  ("selective", 2, [2, 1])):  # fmt: skip
        cfg = config("--activation_checkpoint.mode", mode,
                     "--activation_checkpoint.selective_every", every, "--model.dropout", 0.1)  # fmt: skip
        calls = [0, 0]
        model = model_for(cfg)
        for i, block in enumerate(model.layers.values()):
            original = block.compute

            def counted(*args, i=i, original=original, calls=calls):
                calls[i] += 1
                return original(*args)

            block.compute = counted
        torch.manual_seed(0)
        loss = BatchLoss(cfg, model, ONE_RANK)(batch[0])
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        assert calls == expected, mode
        if reference is None:
            reference = grads
        for name, grad in grads.items():
            assert torch.equal(grad, reference[name]), (mode, name)


def test_bf16_without_fsdp_autocasts_and_keeps_float32_parameters():
    """One process (no FSDP): training.mixed_precision_param bfloat16 runs the matmuls in
    bf16 under autocast; parameters, gradients and the loss stay float32."""
    for precision, expected in (("bfloat16", torch.bfloat16), ("float32", torch.float32),
                                ("auto", torch.float32)):  # fmt: skip
        cfg = config("--training.mixed_precision_param", precision)
        model = model_for(cfg)
        seen = []
        model.layers["0"].feed_forward.w1.register_forward_hook(
            lambda mod, inp, out, seen=seen: seen.append(out.dtype)
        )
        loss = BatchLoss(cfg, model, ONE_RANK)(sequences(2))
        loss.backward()
        assert seen == [expected] and loss.dtype == torch.float32
        assert {p.dtype for p in model.parameters()} == {torch.float32}
        assert {p.grad.dtype for p in model.parameters()} == {torch.float32}


# ---- validation ------------------------------------------------------------------------


def test_validation_changes_nothing_in_training(tmp_path, monkeypatch):
    """With dropout, the training losses of a run with validation every 2 steps are
    bit-equal to those of a run without; validation losses are logged at 2, 4 and 6
    (the last step), and the same batches give the same loss each time (validating
    an unchanged model twice gives one value). Negative control: validating in train
    mode draws dropout masks from the training RNG, and the training losses move."""
    common = ["--training.steps", 6, "--model.dropout", 0.1, "--validation.steps", 2]
    train_here(tmp_path / "plain", *common)
    train_here(tmp_path / "validated", *common, "--validation.enable", "--validation.freq", 2)
    plain = read_jsonl(tmp_path / "plain" / "metrics.jsonl")
    validated = read_jsonl(tmp_path / "validated" / "metrics.jsonl")
    assert [r["loss"] for r in plain] == [r["loss"] for r in validated]
    assert [r["step"] for r in validated if "validation_loss" in r] == [2, 4, 6]

    cfg = config("--validation.enable", "--validation.steps", 2, "--model.dropout", 0.1)
    model = model_for(cfg)
    loader = build_validation_loader(cfg, _tokenizer(), 0, 1)
    validator = Validator(cfg.validation, loader, BatchLoss(cfg, model, ONE_RANK))
    assert validator.run(model) == validator.run(model)

    monkeypatch.setattr(torch.nn.Module, "eval", lambda self: self)
    train_here(tmp_path / "broken", *common, "--validation.enable", "--validation.freq", 2)
    broken = read_jsonl(tmp_path / "broken" / "metrics.jsonl")
    assert [r["loss"] for r in broken] != [r["loss"] for r in plain]


def _tokenizer():
    from torchtitan.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer

    return Tokenizer(DEFAULT_TOKENIZER_PATH)


# ---- throughput ------------------------------------------------------------------------


def test_flops_per_token_counts_every_matmul_weight_and_attention():
    """6 x (parameters but the embedding table) + 12 x layers x dim x seq_len."""
    for flavor in ("debugmodel", "8B"):
        args = llama_configs[flavor]
        model = build_model(flavor, args.vocab_size, device="meta")
        norms = (2 * args.n_layers + 1) * args.dim
        matmuls = count_parameters(model) - args.vocab_size * args.dim - norms
        expected = 6 * matmuls + 12 * args.n_layers * args.dim * 2048
        assert flops_per_token(args, 2048) == expected
    assert (
        6 * 7.0e9 < flops_per_token(llama_configs["8B"], 8192) < 6 * 8.0e9 + 12 * 32 * 4096 * 8192
    )


def test_tokens_per_second_per_rank_and_mfu_in_the_log(tmp_path):
    """tokens_per_s is per rank; mfu_pct follows from it, the FLOPs per token and
    metrics.peak_tflops, and is absent on a device of unknown peak (this CPU)."""
    train_here(tmp_path / "a", "--training.steps", 2)
    assert "mfu_pct" not in read_jsonl(tmp_path / "a" / "metrics.jsonl")[-1]
    train_here(tmp_path / "b", "--training.steps", 2, "--metrics.peak_tflops", 0.5)
    record = read_jsonl(tmp_path / "b" / "metrics.jsonl")[-1]
    cfg = config()
    args = build_model("debugmodel", 4096, device="meta").args
    per_token = flops_per_token(args, cfg.training.seq_len)
    assert record["mfu_pct"] == 100 * record["tokens_per_s"] * per_token / 0.5e12
    assert record["tokens_per_s"] == pytest.approx(4 * 128 / (record["step_ms"] / 1000))


@pytest.mark.parametrize(
    "name,peak",
    [
        ("NVIDIA H100 80GB HBM3", 989.5),  # SXM5
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.5),  # was read as SXM
        ("NVIDIA H200", 989.5),
        ("NVIDIA H200 NVL", 835.5),
        ("NVIDIA GH200 480GB", 989.5),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A100-SXM4-40GB", 312.0),
        ("NVIDIA A100-PCIE-40GB", 312.0),
        ("NVIDIA A100 80GB PCIe", 312.0),
        ("NVIDIA A10G", 125.0),
        ("NVIDIA A10", 125.0),
        ("NVIDIA L40S", 362.05),
        ("NVIDIA L40", 181.05),  # was read as L4
        ("NVIDIA L4", 121.0),
        # Negative controls: devices not in the table get no MFU, not a neighbour's peak.
        ("NVIDIA RTX A1000", 0.0),
        ("NVIDIA GeForce RTX 4090", 0.0),
        ("NVIDIA B200", 0.0),
    ],
)
def test_peak_tflops_by_exact_device_model(monkeypatch, name, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert peak_tflops(config(), torch.device("cuda")) == peak


def test_configured_peak_wins_and_cpu_has_none(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 NVL")
    assert peak_tflops(config("--metrics.peak_tflops", 100), torch.device("cuda")) == 100
    assert peak_tflops(config(), torch.device("cpu")) == 0.0


# ---- compile ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("flavor", ["debugmodel", "debug_moe"])
def test_compiled_blocks_train_like_eager_and_resume_exactly(tmp_path, flavor):
    """training.compile on CPU (inductor, needs a C++ compiler): the losses match eager
    to float rounding (another implementation of the same math), and a compiled run
    resumed from step 2 repeats the uninterrupted compiled run bit for bit. The MoE
    model compiles around its expert dispatch (test_compile.py counts the regions)."""
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("torch.compile on CPU needs a C++ compiler (g++), and none is installed")
    common = ["--training.steps", 4, "--checkpoint.enable_checkpoint", "--checkpoint.interval", 2,
              "--model.flavor", flavor]  # fmt: skip
    train_here(tmp_path / "eager", *common)
    train_here(tmp_path / "compiled", *common, "--training.compile")
    eager = [r["loss"] for r in read_jsonl(tmp_path / "eager" / "metrics.jsonl")]
    compiled = [r["loss"] for r in read_jsonl(tmp_path / "compiled" / "metrics.jsonl")]
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-5)
    train_here(tmp_path / "resumed", *common, "--training.compile", "--training.stop_at_step", 2)
    train_here(tmp_path / "resumed", *common, "--training.compile")
    resumed = [r["loss"] for r in read_jsonl(tmp_path / "resumed" / "metrics.jsonl")]
    assert resumed == compiled


# ---- the shipped configs ---------------------------------------------------------------


@pytest.mark.parametrize(
    "name, flavor, low, high",
    [("llama3_125m", "125M", 0.1e9, 0.2e9), ("llama3_1b", "1B", 1.0e9, 1.6e9),
     ("llama3_8b", "8B", 7.0e9, 8.5e9)],
)  # fmt: skip
def test_real_size_configs_parse_and_build_on_meta(name, flavor, low, high):
    """Each config parses, names its flavor, trains in bf16 with activation checkpointing
    and warmup, and its model builds on the meta device at the expected size."""
    cfg = parse_args(["--job.config_file", str(REPO / "train_configs" / f"{name}.toml")])
    assert cfg.model.flavor == flavor
    assert cfg.training.mixed_precision_param == "bfloat16"
    assert cfg.activation_checkpoint.mode in ("full", "selective")
    assert cfg.lr_scheduler.warmup_steps > 0 and cfg.training.global_batch_size > 0
    args = llama_configs[flavor]
    model = build_model(flavor, args.vocab_size, device="meta")
    assert low < count_parameters(model) < high
    assert cfg.training.seq_len <= model.args.max_seq_len
