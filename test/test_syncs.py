"""The host's synchronisations with the device inside training steps (harness/syncs.py
counts them on a CPU): none on a step that logs nothing, whatever the spike guard does,
and one batched read on a log step; the guard's verdict reaches the host a step later
and its rewind stays exact.

Every fast run is the debug model in this process (train.main) for a few steps.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import CONFIG, error_lines, read_jsonl, torchrun, train_here

import train as train_script
from harness.syncs import counting
from torchtitan.records.provenance import read_provenance, sequences_by_step
from torchtitan.records.runs import losses
from torchtitan.spikes import FAULT_ENV, SpikeGuard

# Logs at steps 1, 3 and 6 (the last); 2, 4 and 5 log nothing.
COMMON = ["--training.steps", 6, "--training.seq_len", 32, "--training.batch_size", 2,
          "--metrics.log_freq", 3]  # fmt: skip
LOGGED = {1, 3, 6}
BOUND = ["--training.spike_max_loss", 100]  # x1000 at a step is a spike from step 1
# name: (arguments, planted faults); each fault lands on a step that logs nothing.
CONFIGS = {
    "log": ([*BOUND], "2:x1000,4:nan"),
    "skip_step, accumulation": (
        [*BOUND, "--training.on_spike", "skip_step", "--training.global_batch_size", 8],
        "2:nan,4:x1000,5:nan_grad",
    ),
    "rewind, masked boundaries": (
        [
            *BOUND,
            "--training.on_spike",
            "rewind",
            "--checkpoint.enable_checkpoint",
            "--checkpoint.interval",
            2,
            "--training.mask_document_boundaries",
            "--model.attention_mask",
            "block_causal",
        ],
        "5:x1000",
    ),  # fmt: skip
}


def counted(dump, argv: list, monkeypatch, faults: str = ""):
    """The run's steps as counted (harness/syncs.py), in order."""
    monkeypatch.setenv(FAULT_ENV, faults)
    with counting(train_script) as counter:
        train_here(dump, *COMMON, *argv)
    return counter.steps


def saving(read) -> bool:
    """A save's own reads: the checkpoint's copies, the guard's state, and the guard's
    verdict of the saved step (learned before the save, at once)."""
    return (
        read.site.startswith("torchtitan/checkpoint/")
        or read.site.startswith("torchtitan/spikes.py")
        and read.site.endswith((" _read_state", " read"))
    )


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_step_that_logs_nothing_reads_nothing_of_the_device(tmp_path, monkeypatch, name):
    """Under each policy, with its faults (a NaN, a spike) on steps that log nothing,
    gradient accumulation and masked document boundaries (whose label counts are host
    data): a step that neither logs nor saves reads nothing of the device; a log step
    reads once (StepMetrics.read: every logged value and the guard's verdict stacked);
    a save step reads only for the save. The faults were seen (events, counters).
    Negative control: a guard that reads the loss on the host (a planted ``float``)
    is counted, once per step."""
    argv, faults = CONFIGS[name]
    steps = counted(tmp_path / "a", argv, monkeypatch, faults)
    assert [s.step for s in steps][:6] == [1, 2, 3, 4, 5, 6]
    saves = {2, 4, 6} if "--checkpoint.enable_checkpoint" in argv else set()
    for s in steps:
        reads = [r for r in s.reads if not (s.step in saves and saving(r))]
        want = [("tolist", "torchtitan/records/metrics.py")] if s.step in LOGGED else []
        assert [(r.kind, r.site.split(":")[0]) for r in reads] == want, s
    lines = (tmp_path / "a" / "spikes.jsonl").read_text().splitlines()
    events = [json.loads(line) for line in lines]  # a rewind's line repeats its spike's step
    assert {e["step"] for e in events if e["kind"] != "rewind"} == {
        int(f.split(":")[0]) for f in faults.split(",")
    }
    real = SpikeGuard.decide

    def planted(self, loss, grad_norm, batches):
        float(loss)  # the mutant: the host reads the loss
        return real(self, loss, grad_norm, batches)

    monkeypatch.setattr(SpikeGuard, "decide", planted)
    mutant = counted(tmp_path / "b", argv, monkeypatch, faults)
    assert [len(s.reads) for s in mutant] == [len(s.reads) + 1 for s in steps]


def test_a_rewind_learned_a_step_late_trains_as_the_skip_list(tmp_path, monkeypatch):
    """A spike at step 7, which neither logs nor saves (log_freq 10, checkpoints every
    5): its update is dropped on the device at once; the host learns it at step 8 and
    rewinds to step-5 (at least rewind_steps 2 before the spike), skipping the data of
    steps 6-8 (to the spike, plus skip_after 1). Step 8, trained before the host knew,
    is undone with the rest (its provenance line moved aside). The run equals one
    started with --training.skip_steps 6-8: losses ==, provenance ==, final weights
    torch.equal. Negative control: the skip list one step short (6-7) differs."""
    rewind = ["--training.steps", 10, "--training.seq_len", 32, "--training.batch_size", 2,
              "--checkpoint.enable_checkpoint", "--checkpoint.interval", 5,
              "--training.spike_window", 0, "--training.spike_max_loss", 100,
              "--training.on_spike", "rewind", "--training.rewind_steps", 2,
              "--training.skip_after", 1, "--metrics.log_freq", 10, "--model.dropout", 0.1,
              "--metrics.data_provenance"]  # fmt: skip
    weights = {}
    real = train_script.train_loop

    def keep_weights(run, preemption):
        real(run, preemption)
        weights[run.cfg.job.dump_folder] = [p.detach().clone() for p in run.model.parameters()]

    monkeypatch.setattr(train_script, "train_loop", keep_weights)
    monkeypatch.setenv(FAULT_ENV, "7:x1000")
    _, log = train_here(tmp_path / "rewound", *rewind)
    assert "rewound to checkpoint step-5" in log and "--training.skip_steps 6-8" in log
    undone = read_jsonl(tmp_path / "rewound" / "provenance" / "rewound_rank0.jsonl")
    assert [u["step"] for u in undone] == [6, 7, 8]
    monkeypatch.delenv(FAULT_ENV)
    train_here(tmp_path / "listed", *rewind, "--training.skip_steps", "6-8")
    assert losses(tmp_path / "rewound") == losses(tmp_path / "listed")
    assert sequences_by_step(read_provenance(tmp_path / "rewound" / "provenance")) == (
        sequences_by_step(read_provenance(tmp_path / "listed" / "provenance"))
    )
    a, b = (weights[str(tmp_path / d)] for d in ("rewound", "listed"))
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    train_here(tmp_path / "short", *rewind, "--training.skip_steps", "6-7")
    assert losses(tmp_path / "short")[10] != losses(tmp_path / "listed")[10]


def test_broken_steps_learned_late_stop_as_before(tmp_path, monkeypatch):
    """NaNs at steps 2-4, none of which logs (log_freq 10): the host learns step 4's
    verdict at step 5 and stops with the line a run logging every step gives (steps
    2-4, max_bad_steps 3), nothing saved after them. Negative control: 2, 3 and 5 (not
    in a row) do not stop the run."""
    args = ["--training.steps", 8, "--training.seq_len", 32, "--training.batch_size", 2]
    monkeypatch.setenv(FAULT_ENV, "2:nan,3:nan,4:nan")
    lines = []
    for freq in (10, 1):
        status, log = train_here(tmp_path / f"f{freq}", *args, "--metrics.log_freq", freq,
                                 expect_ok=False)  # fmt: skip
        assert status == 1
        lines.append(error_lines(log))
    assert lines[0] == lines[1] and len(lines[0]) == 1
    assert "steps 2-4 had a non-finite loss" in lines[0][0]
    monkeypatch.setenv(FAULT_ENV, "2:nan,3:nan,5:nan")
    train_here(tmp_path / "b", *args, "--metrics.log_freq", 10)
    assert read_jsonl(tmp_path / "b" / "metrics.jsonl")[-1]["bad_steps"] == 3


def test_the_guard_resumes_exactly_from_a_save_that_logs_nothing(tmp_path, monkeypatch):
    """A run stopped after step 4 (a save that logs nothing: the guard's state is read
    from the device then) and resumed detects the spike at step 6 (a window of 3) as
    the uninterrupted run does: the same losses. Negative control: the guard left out
    of the load misses it."""
    monkeypatch.setenv(FAULT_ENV, "6:x1000")
    common = ["--training.steps", 7, "--training.seq_len", 32, "--training.batch_size", 2,
              "--training.spike_window", 3, "--checkpoint.enable_checkpoint",
              "--checkpoint.interval", 4, "--training.on_spike", "skip_step",
              "--metrics.log_freq", 7]  # fmt: skip
    train_here(tmp_path / "ref", *common)
    train_here(tmp_path / "a", *common, "--training.stop_at_step", 4)
    train_here(tmp_path / "a", *common)
    ref, a = losses(tmp_path / "ref"), losses(tmp_path / "a")
    assert {k: a[k] for k in ref} == ref  # a also logged step 4, where it stopped
    assert read_jsonl(tmp_path / "ref" / "metrics.jsonl")[-1]["spikes"] == 1
    train_here(tmp_path / "b", *common, "--training.stop_at_step", 4)
    train_here(tmp_path / "b", *common, "--checkpoint.exclude_from_loading", "spikes")
    assert read_jsonl(tmp_path / "b" / "metrics.jsonl")[-1]["spikes"] == 0
    assert losses(tmp_path / "b")[7] != ref[7]


# ---- two ranks: FSDP, TP, PP (slow tier: three 2-rank launches) -------------------------

LAYOUTS = {
    "fsdp": [],
    "tp": ["--parallelism.tensor_parallel_degree", 2],
    "pp": ["--parallelism.pipeline_parallel_degree", 2, "--training.global_batch_size", 8],
}
# Pipeline parallelism's own reads (parallel/pipeline.py), through host tensors for the
# gloo pipeline group: the squared norm summed over the stages (every stage) and the
# last stage's loss sent to the others (the last stage).
PIPELINE_READS = {0: ["clip_grad_norm"], 1: ["from_last", "clip_grad_norm"]}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_ranks_read_nothing_of_the_device_on_a_step_that_logs_nothing(tmp_path, monkeypatch,
                                                                          layout):  # fmt: skip
    """2 ranks (FSDP, TP 2 or PP 2), skip_step with a spike on rank 0 alone at step 4
    (seen through the mean over the ranks: an all-reduce on the training group, no host
    read; PipelineStep has no fault hook): on a step that logs nothing, no read but,
    under PP, the pipeline's own (named above); on a log step, one batched read more
    (none under PP: the values it logs are on the host already, and so is the guard).
    Both ranks drop step 4. Negative control: the fast tier's planted read."""
    out = tmp_path / "syncs"
    monkeypatch.setenv(FAULT_ENV, "4:x1000@0")
    proc = torchrun([out, *CONFIG, "--job.dump_folder", tmp_path / "run", *COMMON, *BOUND,
                     "--training.on_spike", "skip_step", *LAYOUTS[layout]], nproc=2,
                    script="harness/syncs.py")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    spiked = sum("step 4: loss spike" in line for line in proc.stderr.splitlines())
    assert spiked == (0 if layout == "pp" else 2)
    for rank in (0, 1):
        steps = json.loads((tmp_path / f"syncs.rank{rank}.json").read_text())
        assert [s["step"] for s in steps] == [1, 2, 3, 4, 5, 6]
        for s in steps:
            sites = [(r["kind"], r["site"].split()[-1]) for r in s["reads"]]
            pipeline = [("cpu", f) for f in PIPELINE_READS[rank]] if layout == "pp" else []
            logged = [("tolist", "read")] if s["step"] in LOGGED and layout != "pp" else []
            assert sorted(sites) == sorted(pipeline + logged), s
