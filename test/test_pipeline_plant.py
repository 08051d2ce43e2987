"""The test-only fault hook under pipeline parallelism (step.PipelineStep): a planted
spike or NaN gradient fires where the loss and the gradients are made, and the guard's
verdict is the same on every stage. The campaign's PP trials plant through it."""

from __future__ import annotations

import json

import torch
from helpers import train

from harness import campaign
from torchtitan.records.runs import losses
from torchtitan.spikes import FAULT_ENV

PP2 = ["--parallelism.pipeline_parallel_degree", 2, "--training.steps", 4,
       "--training.seq_len", 32, "--training.batch_size", 2, "--training.global_batch_size", 6,
       "--checkpoint.enable_checkpoint", "--checkpoint.interval", 1, "--metrics.log_freq", 1,
       "--training.spike_window", 0, "--training.spike_max_loss", campaign.SPIKE_LOSS,
       "--training.on_spike", "skip_step", "--training.max_bad_steps", 3,
       "--model.dropout", 0.0]  # fmt: skip


def _model(dump, step: int) -> dict:
    state = campaign.read_tensors(dump / "checkpoint" / f"step-{step}")
    return {k: v for k, v in state.items() if k.startswith("model.")}


def test_a_plant_fires_under_pipeline_parallelism_and_every_stage_drops_the_step(
    tmp_path, monkeypatch
):
    """PP 2 on 2 ranks, on_spike skip_step: a x1000 at step 2 (made on the last stage)
    logs a spike and a NaN gradient on rank 0 alone (the first stage) at step 3 a non-finite
    step; neither is applied on either stage (the weights of both stages' layers after
    steps 2 and 3 ``==`` those after step 1). Negative controls: the unplanted steps 1
    and 4 log the debug model's loss, and step 4 moves the weights of both stages."""
    monkeypatch.setenv(FAULT_ENV, "2:x1000,3:nan_grad@0")
    dump = tmp_path / "pp"
    train(dump, *PP2)
    loss = losses(dump)
    assert loss[2] > campaign.SPIKE_LOSS and loss[1] < 20 and loss[4] < 20, loss
    events = [json.loads(line) for line in (dump / "spikes.jsonl").read_text().splitlines()]
    assert {(e["step"], e["kind"]) for e in events} >= {(2, "spike"), (3, "non-finite")}, events
    one, two, three, four = (_model(dump, s) for s in (1, 2, 3, 4))
    stage0, stage1 = "model.tok_embeddings.weight", "model.output.weight"
    assert stage0 in one and stage1 in one, sorted(one)
    assert all(torch.equal(one[k], two[k]) and torch.equal(one[k], three[k]) for k in one)
    assert not torch.equal(three[stage0], four[stage0])
    assert not torch.equal(three[stage1], four[stage1])
