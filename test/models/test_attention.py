"""torchtitan/models/attention.py: document-aware attention on CPU (sdpa's per-document
loop, flex's forward, varlen's layout through a stand-in kernel), each against a
reference computed here; the CUDA-only halves are in test_attention_gpu.py."""

import pytest
import torch
import torch.nn.functional as F
from helpers import many_documents

from torchtitan.models import Transformer, build_model


def _debug_model(backend: str = "sdpa"):
    torch.manual_seed(0)
    return build_model("debugmodel", 4096, device="cpu", attention_backend=backend)


def _fixed_weights(model):
    """Weights from a recipe of their own: norm weights away from 1, so a reference that
    forgot them would disagree."""
    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            noise = torch.randn(p.shape, generator=torch.Generator().manual_seed(i))
            p.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else 0.02 * noise)
    return model


def _reference_logits(model: Transformer, tokens: torch.Tensor, mask: torch.Tensor):
    """The Llama forward written out plainly in float64 from the model's weights: RoPE
    as complex rotation, GQA by repeating kv heads, attention as explicit
    softmax(QK^T / sqrt(d) masked by ``mask`` [T, T], True = may attend) V."""
    a = model.args
    w = {name: p.detach().double() for name, p in model.named_parameters()}
    B, T = tokens.shape

    def norm(x, weight):
        return x / (x.pow(2).mean(-1, keepdim=True) + a.norm_eps).sqrt() * weight

    freqs = a.rope_theta ** (-torch.arange(0, a.head_dim, 2, dtype=torch.float64) / a.head_dim)
    angles = torch.arange(T, dtype=torch.float64)[:, None] * freqs
    rotation = torch.polar(torch.ones_like(angles), angles)[:, None]  # [T, 1, D/2]

    def rope(x):  # [B, T, H, D]: channel pairs (2i, 2i+1) are complex numbers
        pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(pairs * rotation).flatten(-2)

    group = a.n_heads // a.n_kv_heads
    h = w["tok_embeddings.weight"][tokens]
    for i in range(a.n_layers):
        p = f"layers.{i}."
        x = norm(h, w[p + "attention_norm.weight"])
        q = rope((x @ w[p + "attention.wq.weight"].T).view(B, T, a.n_heads, a.head_dim))
        k = rope((x @ w[p + "attention.wk.weight"].T).view(B, T, a.n_kv_heads, a.head_dim))
        v = (x @ w[p + "attention.wv.weight"].T).view(B, T, a.n_kv_heads, a.head_dim)
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / a.head_dim**0.5
        weights = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        y = torch.einsum("bhqk,bkhd->bqhd", weights, v).reshape(B, T, -1)
        h = h + y @ w[p + "attention.wo.weight"].T
        x = norm(h, w[p + "ffn_norm.weight"])
        gate = F.silu(x @ w[p + "feed_forward.w1.weight"].T)
        h = h + (gate * (x @ w[p + "feed_forward.w3.weight"].T)) @ w[p + "feed_forward.w2.weight"].T
    return norm(h, w["norm.weight"]) @ w["output.weight"].T


def test_causal_attention_is_unchanged():
    """The default (causal) path is the plain Llama forward, checked against a float64
    reference computed here, not against numbers recorded on one CPU (they differ in the
    last bits between AVX2 and AVX-512). Tolerance: the model runs in fp32 (eps 1.2e-7)
    through ~10 rounded stages with logits below 1, so it sits ~1e-6 from the exact
    result (3e-7 measured); 1e-5 allows for that, and a wrong mask moves logits by >0.1.
    Same computation, bit for bit: the default path equals block-causal with one document
    per row. Negative controls: a non-causal mask and a mask shifted one token ahead."""
    model = _fixed_weights(build_model("debugmodel", 4096, device="cpu"))
    T = 64
    tokens = torch.randint(0, 4096, (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(tokens)
        one_document = model(
            tokens, torch.arange(T).expand(2, T), torch.zeros(2, T, dtype=torch.long)
        )
        allowed = torch.ones(T, T, dtype=torch.bool)
        reference = _reference_logits(model, tokens, allowed.tril())
        torch.testing.assert_close(logits.double(), reference, rtol=0, atol=1e-5)
        assert torch.equal(logits, one_document)
        for wrong in (allowed, allowed.tril(1)):
            off = (logits.double() - _reference_logits(model, tokens, wrong)).abs().max()
            assert off > 0.1, off


def _stand_in_varlen(q, k, v, layout, gqa):
    """varlen_attn's contract on CPU (the kernel is CUDA-only): causal attention within
    each [cu_seqlens[i], cu_seqlens[i+1]) of the flattened batch, one sdpa call each."""
    cu = layout.cu_seqlens.tolist()
    assert layout.max_seqlen == max(e - s for s, e in zip(cu, cu[1:]))
    out = [F.scaled_dot_product_attention(*(t[s:e].transpose(0, 1).unsqueeze(0) for t in (q, k, v)),
                                          is_causal=True, enable_gqa=gqa)[0].transpose(0, 1)
           for s, e in zip(cu, cu[1:])]  # fmt: skip
    return torch.cat(out)


@pytest.fixture
def cpu_varlen(monkeypatch):
    from torchtitan.models import attention

    monkeypatch.setattr(attention, "_varlen", _stand_in_varlen)


def _packed(seed: int = 2):
    """Three real-sized documents (30, 20, 14 tokens) packed in one row, the middle one also
    alone: (packed tokens, positions, document ids), (alone ...), where the middle one sits."""
    tokens = torch.randint(0, 4096, (3, 40), generator=torch.Generator().manual_seed(seed))
    doc, before, after = tokens[0, :20], tokens[1, :30], tokens[2, :14]
    packed = torch.cat([before, doc, after]).unsqueeze(0)
    positions = torch.cat([torch.arange(30), torch.arange(20), torch.arange(14)]).unsqueeze(0)
    ids = torch.repeat_interleave(torch.arange(3), torch.tensor([30, 20, 14])).unsqueeze(0)
    alone = (doc.unsqueeze(0), torch.arange(20).unsqueeze(0), torch.zeros(1, 20, dtype=torch.long))
    return (packed, positions, ids), alone


def _other_neighbours(packed: torch.Tensor) -> torch.Tensor:
    """The packed row with the two other documents' tokens replaced, the middle one kept."""
    other = torch.randint(0, 4096, packed.shape, generator=torch.Generator().manual_seed(9))
    return torch.cat([other[:, :30], packed[:, 30:50], other[:, 50:]], 1)


@pytest.mark.parametrize("backend", ["sdpa", "flex", "varlen"])
@torch.no_grad()
def test_block_causal_logits_of_a_document_do_not_depend_on_its_neighbours(backend, request):
    """Per backend, a document's logits are identical (fp32, torch.equal) whatever the
    documents packed around it: the same row, the neighbours' tokens replaced, so every
    kernel runs on the same shapes and any CPU gives the same bits where the mask keeps
    the document to itself. Alone in a sequence of its own length its logits agree to
    1e-5 (its positions restart at 0), not to the bit: the projections then run on
    another row count, and a CPU's matmul may give a row other bits in a matrix of
    another size. (flex runs its forward eagerly on CPU; varlen's CUDA kernel is
    replaced by a stand-in with its contract, so what is checked on CPU is the layout fed
    to it; the kernel itself is checked in test_attention_gpu.py.) Negative controls,
    per backend: plain causal attention over the packed row lets the document see its
    predecessor: its logits change with the neighbours, and sit far from alone's."""
    if backend == "varlen":
        request.getfixturevalue("cpu_varlen")
    model = _debug_model(backend)
    (packed, positions, ids), alone = _packed()
    together = model(packed, positions, ids)[0, 30:50]
    assert torch.equal(model(_other_neighbours(packed), positions, ids)[0, 30:50], together)
    torch.testing.assert_close(model(*alone)[0], together, rtol=0, atol=1e-5)
    causal = model(packed, positions)[0, 30:50]
    assert not torch.equal(model(_other_neighbours(packed), positions)[0, 30:50], causal)
    assert (model(packed)[0, 30:50] - together).abs().max() > 1e-2


@torch.no_grad()
def test_flex_forward_matches_the_per_document_loop():
    """flex (one masked kernel per layer) against sdpa's per-document loop, fp32, on rows
    of many short documents: within 1e-5. A tolerance because these are two
    implementations of the same math (flex masks the scores of the whole row, the loop
    never computes them, so sums run in another order: ~1e-6 measured); a wrong mask
    moves the logits by more than 1e-2. Negative control: flex with plain causal."""
    tokens, positions, ids = many_documents()
    loop = _debug_model("sdpa")(tokens, positions, ids)
    flex = _debug_model("flex")
    torch.testing.assert_close(flex(tokens, positions, ids), loop, rtol=0, atol=1e-5)
    assert (flex(tokens, positions) - loop).abs().max() > 1e-2


@torch.no_grad()
def test_varlen_layout_equals_the_per_document_loop(cpu_varlen):
    """varlen's cumulative lengths, cut across the whole flattened batch, give exactly the
    per-document loop (torch.equal: the stand-in runs the same sdpa per document), for
    causal rows too. Negative control: one off-by-one boundary changes the logits."""
    from torchtitan.models import attention

    tokens, positions, ids = many_documents()
    varlen = _debug_model("varlen")
    assert torch.equal(varlen(tokens, positions, ids), _debug_model("sdpa")(tokens, positions, ids))
    assert torch.equal(varlen(tokens), _debug_model("sdpa")(tokens))
    layout = attention.document_mask("varlen", *tokens.shape, tokens.device, ids)
    assert layout.cu_seqlens.dtype == torch.int32 and layout.cu_seqlens[-1] == tokens.numel()
    shifted = ids.clone()
    first_end = int((ids[0] == 0).sum())
    shifted[0, first_end] = 0  # the second document's first token joins the first
    assert not torch.equal(varlen(tokens, positions, shifted), varlen(tokens, positions, ids))


@torch.no_grad()
def test_the_mask_is_built_once_per_batch_and_shared_by_all_layers(monkeypatch):
    """document_mask runs once per forward, not once per layer (the flex block mask is the
    costly part of a batch's setup); every layer receives that same object."""
    from torchtitan.models import attention

    built, seen = [], []
    build = attention.document_mask
    monkeypatch.setattr(attention, "document_mask", lambda *a: built.append(build(*a)) or built[-1])
    attend = attention.attend
    monkeypatch.setattr(
        attention, "attend", lambda q, k, v, m, p=0.0: seen.append(m) or attend(q, k, v, m, p)
    )
    model = _debug_model("flex")
    tokens, positions, ids = many_documents(B=2, T=64)
    model(tokens, positions, ids)
    assert len(built) == 1 and len(seen) == model.args.n_layers
    assert all(m is built[0] for m in seen)
