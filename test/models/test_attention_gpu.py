"""GPU-only checks (marked ``cuda``; skipped with the reason elsewhere): the attention
kernels that exist only on CUDA (varlen; flex compiled, forward and backward), and the
backends chosen and trained there. scripts/gpu_check.sh runs them; the CPU half of each
property (flex's forward, varlen's layout through a stand-in) is in test_attention.py.

Tolerances compare two implementations in bf16 (eps 7.8e-3): relative errors, stated
per test, with a negative control that is off by far more.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import losses, many_documents, train_here

from torchtitan.config import parse_args
from torchtitan.models import build_model
from torchtitan.models.attention import attention_backend, varlen_available

pytestmark = pytest.mark.cuda

BACKENDS = ["flex", "varlen"]


def model_for(backend: str):
    torch.manual_seed(0)
    return build_model("debugmodel", 4096, device="cuda", attention_backend=backend)


def documents(B: int = 4, T: int = 512, seed: int = 3):
    """B rows of T tokens cut into documents of 1 to 200 tokens: tokens, positions, ids."""
    tokens, positions, ids = many_documents(B, T, seed, longest=200)
    return tokens.cuda(), positions.cuda(), ids


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def forward_backward(model, *inputs):
    """bf16 logits and fp32 parameter gradients of a next-token loss."""
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(*inputs)
    tokens = inputs[0]
    F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
    return logits, {n: p.grad for n, p in model.named_parameters()}


def skip_without_varlen(backend: str):
    if backend == "varlen" and not varlen_available():
        pytest.skip("torch.nn.attention.varlen is not in this torch")


@pytest.mark.parametrize("backend", BACKENDS)
def test_gpu_kernel_matches_the_per_document_loop_forward_and_backward(backend):
    """flex (compiled) and varlen against sdpa's per-document loop, bf16 autocast, rows of
    many documents: logits and every gradient within 2 % relative error (two kernels
    rounding bf16 differently: ~0.5 % expected). Negative control: the same backend with
    plain causal attention is off by more than 10 %."""
    skip_without_varlen(backend)
    tokens, positions, ids = documents()
    loop_logits, loop_grads = forward_backward(model_for("sdpa"), tokens, positions, ids)
    logits, grads = forward_backward(model_for(backend), tokens, positions, ids)
    assert relative(logits, loop_logits) < 2e-2
    for name, grad in loop_grads.items():
        assert relative(grads[name], grad) < 2e-2, name
    causal, _ = forward_backward(model_for(backend), tokens, positions)
    assert relative(causal, loop_logits) > 0.1


@pytest.mark.parametrize("backend", BACKENDS)
@torch.no_grad()
def test_gpu_document_logits_do_not_depend_on_neighbours(backend):
    """A document packed between two others, bf16: bit-equal, with every backend, to the
    same row with the neighbours' tokens replaced (the same shapes, so the same kernels:
    what the mask keeps out adds exact zeros). Alone, against packed: within 1 % (the
    projections run on another row count, where cuBLAS may choose other tiles, and
    flex's 128-token blocks fall elsewhere in the document). Negative control: plain
    causal attention over the packed row, off by >10 %."""
    skip_without_varlen(backend)
    model = model_for(backend)
    g = torch.Generator().manual_seed(5)
    before, doc, after = (torch.randint(0, 4096, (n,), generator=g) for n in (300, 200, 140))
    packed = torch.cat([before, doc, after]).unsqueeze(0).cuda()
    positions = torch.cat([torch.arange(n) for n in (300, 200, 140)]).unsqueeze(0).cuda()
    ids = torch.repeat_interleave(torch.arange(3), torch.tensor([300, 200, 140])).unsqueeze(0)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        together = model(packed, positions, ids)[0, 300:500]
        alone = model(doc.unsqueeze(0).cuda(), torch.arange(200).unsqueeze(0).cuda(),
                      torch.zeros(1, 200, dtype=torch.long))[0]  # fmt: skip
        others = torch.randint(0, 4096, packed.shape, generator=g).cuda()
        others[:, 300:500] = packed[:, 300:500]
        neighbours_changed = model(others, positions, ids)[0, 300:500]
        causal = model(packed)[0, 300:500]
    assert torch.equal(together, neighbours_changed)
    assert relative(together, alone) < 1e-2
    assert relative(causal, alone) > 0.1


def test_auto_is_varlen_or_flex_for_documents_on_a_gpu():
    cfg = parse_args(["--model.attention_mask", "block_causal"])
    assert attention_backend(cfg, "cuda") == ("varlen" if varlen_available() else "flex")
    assert attention_backend(parse_args([]), "cuda") == "sdpa"


@pytest.mark.parametrize("backend,compile", [("flex", True), ("varlen", False)])
def test_gpu_backend_trains_and_resumes_exactly(tmp_path, backend, compile):
    """train.py on the GPU with block_causal in bf16 (auto precision) and the backend
    (flex compiled, as gpu_check.sh's resume row): a run stopped at step 2 and resumed
    equals the uninterrupted run bit for bit. Negative control: the sdpa loop, another
    kernel, logs other losses."""
    skip_without_varlen(backend)
    base = ["--training.steps", "4", "--metrics.log_freq", "1", "--model.attention_mask",
            "block_causal", "--checkpoint.enable_checkpoint", "--checkpoint.interval", "2"]  # fmt: skip
    mine = [*base, "--model.attention_backend", backend] + ["--training.compile"] * compile
    train_here(tmp_path / "whole", *mine)
    train_here(tmp_path / "resumed", *mine, "--training.stop_at_step", "2")
    train_here(tmp_path / "resumed", *mine)
    whole = losses(tmp_path / "whole")
    assert losses(tmp_path / "resumed") == whole and len(whole) == 4
    train_here(tmp_path / "loop", *base, "--model.attention_backend", "sdpa")
    assert losses(tmp_path / "loop") != whole
