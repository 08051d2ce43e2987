"""torch.compile inside training steps (harness/compiles.py counts it): each region
compiles on the first step and never again, with no graph break, for the debug and the
MoE model, accumulation and activation checkpointing included, and across a resume.

Fast: dynamo's tracing, guards and graph breaks are the backend's input, the same for
``aot_eager`` (no kernels built) as for inductor; test_loop.py's slow test runs inductor.
Every run is in this process (train.main), 20 steps or fewer.
"""

from __future__ import annotations

import pytest
import torch
from helpers import train_here

import train as train_script
from harness.compiles import counting
from torchtitan.models.llama import TransformerBlock
from torchtitan.parallel import wrapping
from torchtitan.records.runs import losses

COMPILED = ["--training.compile", "--training.compile_backend", "aot_eager",
            "--metrics.log_freq", 5, "--training.seq_len", 32, "--training.batch_size", 2]  # fmt: skip
# Regions compiled on step 1: the blocks' computation (one cache entry for every layer:
# the parameters are the graph's inputs) and the loss; an MoE block's attention
# sublayer, router and shared expert around its dispatch, and the loss.
REGIONS = {"debugmodel": 2, "debug_moe": 4}


def counted(dump, *argv):
    with counting(train_script) as counter:
        status, log = train_here(dump, *COMPILED, *argv, expect_ok=False)
    return status, log, counter.steps


def assert_compiled_once(steps, regions: int):
    assert [s.step for s in steps] == list(range(steps[0].step, steps[0].step + len(steps)))
    assert len(steps[0].compiles) == regions, steps[0]
    for s in steps:
        assert s.breaks == {}, (s.step, s.breaks)
        assert s.recompiles == [], (s.step, s.recompiles)
        assert s is steps[0] or s.compiles == [], (s.step, s.compiles)


@pytest.mark.parametrize("flavor", list(REGIONS))
def test_twenty_compiled_steps_compile_each_region_once_with_no_break_and_no_recompile(tmp_path,
                                                                                       flavor):  # fmt: skip
    """4 micro-batches a step and every block recomputed in the backward (activation
    checkpointing): 20 steps, step 1 compiles each region, steps 2-20 nothing."""
    status, log, steps = counted(tmp_path / "run", "--model.flavor", flavor, "--training.steps", 20,
                                 "--training.global_batch_size", 8,
                                 "--activation_checkpoint.mode", "full")  # fmt: skip
    assert status == 0, log[-3000:]
    assert len(steps) == 20
    assert_compiled_once(steps, REGIONS[flavor])


def test_a_resumed_compiled_run_compiles_once_and_repeats_the_uninterrupted_run(tmp_path):
    """The MoE model (its balancing bias changes every step, a buffer the compiled
    router reads): stopped at step 6 and resumed, the second life compiles each region
    on its first step only, and its losses are the uninterrupted run's, bit for bit."""
    common = ["--model.flavor", "debug_moe", "--training.steps", 12, "--model.dropout", 0.1,
              "--checkpoint.enable_checkpoint", "--checkpoint.interval", 3, "--metrics.log_freq", 1]  # fmt: skip
    assert counted(tmp_path / "whole", *common)[0] == 0
    assert counted(tmp_path / "resumed", *common, "--training.stop_at_step", 6)[0] == 0
    status, log, steps = counted(tmp_path / "resumed", *common)
    assert status == 0 and "loaded checkpoint" in log, log[-3000:]
    assert steps[0].step == 7 and len(steps) == 6
    assert_compiled_once(steps, REGIONS["debug_moe"])
    assert losses(tmp_path / "resumed") == losses(tmp_path / "whole")


def test_a_validation_compiles_the_evaluation_variant_once(tmp_path):
    """Evaluation (grad off, dropout off) fails the training graphs' guards: the first
    validation recompiles each region once, later ones reuse it."""
    status, log, steps = counted(tmp_path / "run", "--training.steps", 9, "--validation.enable",
                                 "--validation.freq", 3, "--validation.steps", 2)  # fmt: skip
    assert status == 0, log[-3000:]
    by_step = {s.step: s for s in steps}
    assert len(by_step[3].recompiles) == REGIONS["debugmodel"]
    assert all(s.recompiles == [] and s.breaks == {} for s in steps if s.step != 3)
    assert all(s.compiles == [] for s in steps if s.step not in (1, 3))


# ---- negative controls: what the count must see -----------------------------------------


def test_a_python_value_that_changes_every_step_is_counted_as_recompiles(tmp_path, monkeypatch):
    """A tired developer's block reads a Python number that grows every call (a step
    count kept on the module): dynamo guards on it and recompiles."""
    real = TransformerBlock.attend

    def attend(self, x, rotation, mask=None):
        self.calls = getattr(self, "calls", 0) + 1
        out, normed = real(self, x, rotation, mask)
        return out * (1.0 + 0.0 * self.calls), normed

    monkeypatch.setattr(TransformerBlock, "attend", attend)
    status, log, steps = counted(tmp_path / "run", "--training.steps", 4)
    assert status == 0, log[-3000:]
    assert all(s.recompiles for s in steps[1:]), [s.recompiles for s in steps]


def test_a_planted_host_read_is_a_graph_break_counted_or_refused(tmp_path, monkeypatch):
    """An ``.item()`` in a block: compiled without ``fullgraph`` (the mutant), the count
    sees the break where the region is traced (step 1); as the project compiles (fullgraph) the run stops."""
    real = TransformerBlock.attend

    def attend(self, x, rotation, mask=None):
        out, normed = real(self, x, rotation, mask)
        if out.sum().item() > 1e30:
            out = out + 1
        return out, normed

    monkeypatch.setattr(TransformerBlock, "attend", attend)
    with pytest.raises(torch._dynamo.exc.TorchDynamoException, match=r"\.item\(\)"):
        counted(tmp_path / "guarded", "--training.steps", 3)

    monkeypatch.setattr(wrapping, "FULLGRAPH", False)
    status, log, steps = counted(tmp_path / "unguarded", "--training.steps", 3)
    assert status == 0, log[-3000:]
    assert sum(steps[0].breaks.values()) > 0, [s.breaks for s in steps]


# ---- document layouts that change every batch (block-causal) -------------------------------


def _compiled_forwards(backend: str, batches: int = 5) -> list[list[str]]:
    """The debug model's compiled blocks (aot_eager) in evaluation, over batches whose
    document layouts all differ: each forward's dynamo compiles."""
    from dataclasses import replace

    from torch._dynamo import callback

    from torchtitan.models import llama
    from torchtitan.models.llama import Transformer

    torch._dynamo.reset()
    args = replace(llama.llama_configs["debugmodel"], vocab_size=256, attention_backend=backend)
    model = Transformer(args)
    model.init_weights(0)
    model.eval()
    wrapping.apply_compile(model, "aot_eager")
    seen: list[str] = []

    def on_start(a):
        if a.callback_trigger == callback.CallbackTrigger.DYNAMO:
            seen.append(str(a.compile_id))

    callback.on_compile_start(on_start)
    B, T, per_batch = 2, 128, []
    try:
        for i in range(batches):
            g = torch.Generator().manual_seed(i)
            documents = torch.zeros(B, T, dtype=torch.int64)
            for b in range(B):  # 2 + i documents in each row, at drawn boundaries
                for cut in torch.randperm(T - 1, generator=g)[: 1 + i] + 1:
                    documents[b, cut:] += 1
            positions = torch.arange(T).expand(B, T).contiguous()
            tokens = torch.randint(0, 256, (B, T), generator=g)
            with torch.no_grad():
                model(tokens, positions, documents)
            per_batch.append(list(seen))
            seen.clear()
    finally:
        callback.callback_handler.remove_start_callback(on_start)
    return per_batch


def test_flex_block_masks_of_every_layout_run_one_compiled_graph():
    """flex (the block-causal backend under compile on a GPU; forward only on CPU): a
    new ``BlockMask`` every batch, its documents elsewhere, and no recompile."""
    per_batch = _compiled_forwards("flex")
    assert per_batch[0] == ["0/0"] and per_batch[1:] == [[]] * 4, per_batch


def test_varlen_layouts_recompile_once_then_run_symbolic(monkeypatch):
    """varlen (CUDA: a stand-in kernel reads the same layout here): the first batch whose
    document count and longest document differ recompiles each block's region once, with
    both made symbolic (dynamo's automatic dynamic); no batch after it compiles."""
    from torchtitan.models import attention

    def varlen_here(q, k, v, layout, gqa):  # reads the layout's tensor and int as varlen does
        return q + layout.cu_seqlens[-1].to(q.dtype) * 0 + layout.max_seqlen * 0

    monkeypatch.setattr(attention, "_varlen", varlen_here)
    per_batch = _compiled_forwards("varlen")
    assert per_batch[0] == ["0/0"] and per_batch[1] == ["0/1"], per_batch
    assert per_batch[2:] == [[]] * 3, per_batch
