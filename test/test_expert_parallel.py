"""Expert parallelism on 2 CPU ranks (gloo): the seed plan, EP 2 against EP 1 in one
forward and backward, and resumes EP 2 -> 1 and 1 -> 2 against uninterrupted runs.

Every check reads ONE 2-rank launch (test/dist/expert_parallel.py), in the slow tier
(a launch costs seconds of interpreter start-up; the fast tier's MoE tests are
test/models/test_moe.py, in-process). Each test names its negative control.

What is exact and what is not: the seed plan, the balancing bias and counts and the
data are bit-equal across expert-parallel degrees, on any CPU. The forward outputs are
not, on every CPU: at EP 2 an expert's group holds both ranks' rows, at EP 1 only its
own rank's, and a CPU's matmul may give a row other bits in a matrix of another row
count (AVX-512 and AVX2 kernels block rows differently; test_moe.py checks the dispatch
bit for bit on equal shapes instead). Nor is an expert's weight gradient: at EP 2 the
rank holding an expert sums the rows of both ranks in one matmul, at EP 1 each rank
sums its own and FSDP's reduce-scatter adds the two, another order of float additions
(measured 9e-13 apart in a gradient of 3e-6: a few ulps). So outputs, and losses after
a change of degree, are compared to a relative 1e-6: the tolerance allows for those
ulps, and the negative controls (experts swapped; the bias dropped on resume) are far
(outputs) or 8e-6 (losses) away.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from helpers import losses, torchrun

from torchtitan.hf import read_dcp_model
from torchtitan.models import build_model

pytestmark = pytest.mark.slow
REL = 1e-6


@pytest.fixture(scope="module")
def ep(tmp_path_factory, dozen_corpus):
    out = tmp_path_factory.mktemp("ep")
    proc = torchrun([str(out), str(dozen_corpus)], nproc=2, timeout=600,
                    script="test/dist/expert_parallel.py")  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    records = {r: json.loads((out / "records" / f"rank{r}.json").read_text()) for r in range(2)}
    return SimpleNamespace(out=out, records=records, corpus=dozen_corpus)


def recorded(ep, rank: int, scenario: str, what: str) -> list:
    return [v for w, v in ep.records[rank][scenario] if w == what]


def test_the_seed_plan_is_bit_equal_at_ep_2(ep):
    """debug_moe built on meta and materialized at EP 2 x FSDP 2 (each rank drawing its
    own experts, by global index) holds, gathered, exactly the one-process model's
    weights and zero balancing state. Negative control: experts drawn from the global
    RNG on each rank differ."""
    saved = torch.load(ep.out / "init.pt")
    reference = build_model("debug_moe", 4096, device="cpu", seed=42).state_dict()
    assert saved["ep2"].keys() == reference.keys()
    for name, value in reference.items():
        assert torch.equal(saved["ep2"][name], value), name
    assert any(
        not torch.equal(saved["naive"][n], reference[n]) for n in reference if ".experts." in n
    )


def test_ep_2_computes_what_ep_1_computes(ep):
    """The same batch per rank: the outputs at EP 2 (tokens to the other rank's experts
    and back by all-to-all) and the expert gradient, gathered, agree with EP 1's to a
    relative 1e-6 (the module docstring says why not to the bit; the dispatch itself is
    checked bit for bit in test_moe.py). Every expert has rows of the batch. Negative
    control: the two ranks' experts swapped move the outputs far beyond that."""
    for rank in (0, 1):
        saved = torch.load(ep.out / f"forward-rank{rank}.pt")
        assert saved["smallest_group"] >= 1
        scale = saved["ep1"].abs().max()
        assert (saved["ep1"] - saved["ep2"]).abs().max() <= REL * scale
        assert (saved["swapped"] - saved["ep2"]).abs().max() > 1e3 * REL * scale
        scale = saved["grad1"].abs().max()
        assert (saved["grad1"] - saved["grad2"]).abs().max() <= REL * scale


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=REL, abs_tol=0.0)


def test_a_checkpoint_written_at_ep_2_resumes_at_ep_1_and_back(ep):
    """4 steps at EP 2, resumed from step 2 at EP 1: steps 3-4 read the same tokens
    (digests, exact), start from the bias the step-2 checkpoint holds (exact, and not
    zero) and log the uninterrupted run's losses (to REL). The same from EP 1 to EP 2.
    Negative control: the bias zeroed after the load moves the losses beyond REL."""
    saved = read_dcp_model(str(ep.out / "ep2" / "checkpoint" / "step-2"))
    for first, resumed in (("ep2", "ep2-to-1"), ("ep1", "ep1-to-2")):
        whole, again = losses(ep.out / first), losses(ep.out / resumed)
        assert sorted(again) == [1, 2, 3, 4]  # 1-2 from the first run's records
        assert all(close(again[s], whole[s]) for s in (3, 4)), (whole, again)
        for rank in (0, 1):
            tokens = recorded(ep, rank, first, "tokens")
            assert recorded(ep, rank, resumed, "tokens") == tokens[2:]
    for layer, bias in enumerate(recorded(ep, 0, "ep2-to-1", "bias")):
        key = f"layers.{layer}.feed_forward.expert_bias"
        assert torch.equal(torch.tensor(bias), saved[key]) and saved[key].abs().sum() > 0
    dropped = losses(ep.out / "ep2-to-1-nobias")
    assert not all(close(dropped[s], losses(ep.out / "ep2")[s]) for s in (3, 4))


def test_an_ep_2_checkpoint_resumes_in_one_process(ep, tmp_path):
    """Elastic: the EP 2 x FSDP 2 step-2 checkpoint resumed by one process (its 8
    sequences a step as 2 micro-batches of 4) logs the 2-rank run's losses at steps 3-4
    to REL (the gradient is summed in another order). Negative control: the same
    resume with the model left out of the load is far off."""
    import shutil

    from helpers import train_here

    data = ["--training.dataset_path", str(ep.corpus), "--training.seq_len", 32,
            "--training.batch_size", 4, "--training.global_batch_size", 8,
            "--training.steps", 4, "--checkpoint.enable_checkpoint",
            "--checkpoint.interval", 2, "--lr_scheduler.warmup_steps", 2]  # fmt: skip
    whole = losses(ep.out / "ep2")
    for name, extra in (("one", []), ("fresh", ["--checkpoint.exclude_from_loading", "model"])):
        shutil.copytree(ep.out / "ep2", tmp_path / name)
        shutil.rmtree(tmp_path / name / "checkpoint" / "step-4")
        train_here(tmp_path / name, "--model.flavor", "debug_moe", *data, *extra)
    one, fresh = losses(tmp_path / "one"), losses(tmp_path / "fresh")
    assert all(close(one[s], whole[s]) for s in (3, 4)), (whole, one)
    assert not any(close(fresh[s], whole[s]) for s in (3, 4))
