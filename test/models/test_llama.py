"""Tests for the Llama model: shapes, deterministic init, flavors, dropout, GQA, causality."""

import pytest
import torch
import torch.nn.functional as F

from torchtitan.models import (
    ModelArgs,
    Transformer,
    build_model,
    count_parameters,
    llama_configs,
    model_registry,
)
from torchtitan.models.llama import apply_rope, rope_cos_sin

VOCAB = 256


def tiny_model(seed: int = 0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    args = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, max_seq_len=64)
    args.update(overrides)
    model = Transformer(ModelArgs(**args))
    model.init_weights(seed)
    return model


def build_model_seeded(flavor: str, seed: int, device: str = "cpu") -> Transformer:
    return build_model(flavor, vocab_size=VOCAB, device=device, seed=seed)


def tokens(B: int = 2, T: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module):
    sa, sb = dict(a.named_parameters()), dict(b.named_parameters())
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name
    for (name, ba), (_, bb) in zip(a.named_buffers(), b.named_buffers()):
        assert torch.equal(ba, bb), name


def test_forward_shape_loss_and_backward():
    model = tiny_model()
    x = tokens(3, 16)
    logits = model(x)
    assert logits.shape == (3, 16, VOCAB)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
    assert torch.isfinite(loss)
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name


def test_build_model_debugmodel_trains_one_step():
    torch.manual_seed(0)
    model = build_model("debugmodel", vocab_size=VOCAB, device="cpu")
    x = tokens(4, 33)
    losses = []
    for _ in range(3):
        logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        # Plain SGD by hand: torch.optim's first step imports torch._dynamo (seconds).
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.5 * p.grad
                p.grad = None
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_same_seed_same_weights_different_seed_different():
    a = build_model_seeded("debugmodel", seed=0)
    b = build_model_seeded("debugmodel", seed=0)
    c = build_model_seeded("debugmodel", seed=1)
    assert_same_weights(a, b)
    # Every randomly initialised tensor must change with the seed (norms are ones).
    for (name, pa), (_, pc) in zip(a.named_parameters(), c.named_parameters()):
        if "norm" not in name:
            assert not torch.equal(pa, pc), name


def test_meta_build_then_to_empty_matches_direct_cpu_build():
    direct = build_model_seeded("debugmodel", seed=7, device="cpu")
    meta = build_model("debugmodel", vocab_size=VOCAB, device="meta")
    assert all(p.is_meta for p in meta.parameters())
    assert meta.rope_cos.is_meta
    torch.manual_seed(123)  # the global RNG plays no part in the init
    meta.to_empty(device="cpu")
    meta.init_weights(7)
    assert_same_weights(direct, meta)
    x = tokens()
    assert torch.equal(direct(x), meta(x))


def test_init_weights_is_a_full_reset():
    model = build_model_seeded("debugmodel", seed=3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
        model.rope_cos.zero_()
    model.init_weights(3)
    assert_same_weights(model, build_model_seeded("debugmodel", seed=3))


def test_init_draws_each_block_of_rows_independently_of_the_others(monkeypatch):
    """A shard that starts mid-tensor gets the rows the whole tensor would have: the
    basis of sharding-independent init (the torchrun test checks 1, 2 and 4 ranks)."""
    from torchtitan.models import llama

    monkeypatch.setattr(llama, "INIT_BLOCK_ROWS", 3)
    whole = torch.empty(10, 4)
    llama.fill_normal(whole, 0.02, 5, "w")
    # Rows 4..9 filled as a rank holding only them would (blocks 1..3, kept from row 4).
    part = torch.empty(6, 4)
    monkeypatch.setattr(llama, "_local", lambda p: (p, torch.arange(4, 10), None, (10, 4)))
    llama.fill_normal(part, 0.02, 5, "w")
    assert torch.equal(part, whole[4:])
    # Columns 1 and 3 of rows 4..9 (a tensor-parallel column split), strided rows.
    cols = torch.empty(6, 2)
    monkeypatch.setattr(
        llama, "_local", lambda p: (p, torch.arange(4, 10), torch.tensor([1, 3]), (10, 4))
    )
    llama.fill_normal(cols, 0.02, 5, "w")
    assert torch.equal(cols, whole[4:, [1, 3]])
    strided = torch.empty(3, 4)
    monkeypatch.setattr(llama, "_local", lambda p: (p, torch.tensor([1, 5, 9]), None, (10, 4)))
    llama.fill_normal(strided, 0.02, 5, "w")
    assert torch.equal(strided, whole[[1, 5, 9]])
    # Negative control: the same rows drawn as if they started the tensor differ.
    monkeypatch.setattr(llama, "_local", lambda p: (p, torch.arange(0, 6), None, (10, 4)))
    llama.fill_normal(part, 0.02, 5, "w")
    assert not torch.equal(part, whole[4:])


def test_rope_buffers_are_not_checkpointed():
    model = tiny_model()
    keys = model.state_dict().keys()
    assert not any("rope" in k for k in keys)


def expected_param_count(args: ModelArgs, vocab_size: int) -> int:
    d, hd = args.dim, args.head_dim
    attn = d * args.n_heads * hd * 2 + d * args.n_kv_heads * hd * 2
    ffn = 3 * d * args.hidden_dim
    norms = 2 * d
    return 2 * vocab_size * d + d + args.n_layers * (attn + ffn + norms)


# (flavor, vocab, low, high): the flavor's own vocab gives the published size
# (plus an untied output head for 1B, which Llama 3.2 ties).
FLAVOR_SIZES = [
    ("debugmodel", 4096, 3e5, 2e6),
    ("125M", 32000, 1.2e8, 1.45e8),
    ("1B", 128256, 1.4e9, 1.6e9),
    ("8B", 128256, 7.95e9, 8.1e9),
    ("8B", 4096, 6.9e9, 7.1e9),
]


@pytest.mark.parametrize("flavor,vocab,low,high", FLAVOR_SIZES)
def test_flavor_builds_on_meta_with_expected_size(flavor, vocab, low, high):
    model = build_model(flavor, vocab_size=vocab, device="meta")
    n = count_parameters(model)
    assert n == expected_param_count(llama_configs[flavor], vocab)
    assert low <= n <= high, f"{flavor}: {n:.3e}"
    assert model.output.weight.shape == (vocab, model.args.dim)


def test_8b_flavor_has_llama3_shapes():
    a = llama_configs["8B"]
    assert (a.dim, a.n_layers, a.n_heads, a.n_kv_heads, a.hidden_dim, a.vocab_size) == (
        4096,
        32,
        32,
        8,
        14336,
        128256,
    )


def test_debugmodel_supports_long_sequences():
    assert llama_configs["debugmodel"].max_seq_len >= 2048


def test_build_model_overrides_vocab_seq_len_and_dropout():
    model = build_model("1B", vocab_size=1000, max_seq_len=128, dropout=0.1, device="meta")
    assert model.args.vocab_size == 1000
    assert model.args.max_seq_len == 128
    assert model.args.dropout == 0.1
    assert model.rope_cos.shape == (128, model.args.head_dim // 2)
    # The shared flavor table must not be mutated by a build.
    assert llama_configs["1B"].vocab_size == 128256
    assert llama_configs["1B"].dropout == 0.0


def test_unknown_flavor_names_flavor_and_choices():
    with pytest.raises(ValueError, match="unknown llama flavor 'nope'") as err:
        build_model("nope", vocab_size=VOCAB)
    for name in llama_configs:
        assert repr(name) in str(err.value)


def test_model_registry_maps_llama_to_configs_and_builder():
    configs, builder = model_registry["llama"]
    assert configs is llama_configs
    assert builder is build_model


def test_blocks_are_in_layers_for_per_block_sharding():
    """Keyed by index, so a pipeline stage keeps its blocks' unsplit names."""
    model = tiny_model()
    assert isinstance(model.layers, torch.nn.ModuleDict)
    assert list(model.layers) == [str(i) for i in range(model.args.n_layers)]


def test_dropout_uses_global_rng():
    model = tiny_model(dropout=0.1)
    model.train()
    x = tokens()
    assert not torch.equal(model(x), model(x))
    state = torch.get_rng_state()
    first = model(x)
    torch.set_rng_state(state)
    assert torch.equal(first, model(x))


def test_eval_mode_is_deterministic_with_dropout():
    model = tiny_model(dropout=0.1)
    model.eval()
    x = tokens()
    assert torch.equal(model(x), model(x))


def test_zero_dropout_train_equals_eval():
    model = tiny_model(dropout=0.0)
    x = tokens()
    assert torch.equal(model.train()(x), model.eval()(x))


def test_gqa_matches_mha_with_repeated_kv_heads():
    gqa = tiny_model(n_heads=4, n_kv_heads=2)
    assert gqa.layers["0"].attention.wk.weight.shape == (2 * 8, 32)
    mha = tiny_model(n_heads=4, n_kv_heads=4)
    state = gqa.state_dict()
    for key, w in state.items():
        if key.endswith(("attention.wk.weight", "attention.wv.weight")):
            # Rows are [kv_head, head_dim]; query head h reads kv head h // group.
            state[key] = w.view(2, 1, 8, 32).expand(2, 2, 8, 32).reshape(4 * 8, 32)
    mha.load_state_dict(state)
    x = tokens()
    # Different attention kernels, so equal up to float rounding, not bitwise.
    torch.testing.assert_close(gqa(x), mha(x))


def test_causal_later_tokens_do_not_change_earlier_logits():
    model = tiny_model()
    x = tokens(2, 16)
    y = x.clone()
    y[:, 10:] = (y[:, 10:] + 1) % VOCAB
    a, b = model(x), model(y)
    assert torch.equal(a[:, :10], b[:, :10])
    assert not torch.equal(a[:, 10:], b[:, 10:])


def test_rope_scores_depend_only_on_relative_position():
    cos, sin = rope_cos_sin(head_dim=8, max_seq_len=32, theta=10000.0)
    rotation = torch.stack((cos, sin), -1)
    q = torch.randn(1, 1, 1, 8).expand(1, 32, 1, 8)
    k = torch.randn(1, 1, 1, 8).expand(1, 32, 1, 8)
    rq, rk = apply_rope(q, rotation)[0, :, 0], apply_rope(k, rotation)[0, :, 0]
    torch.testing.assert_close(rq[5] @ rk[2], rq[25] @ rk[22])
    torch.testing.assert_close(rq.norm(dim=-1), q[0, :, 0].norm(dim=-1))


@pytest.mark.parametrize("compiling", [False, True])
def test_rope_rotates_channel_pairs(compiling, monkeypatch):
    """apply_rope rotates pairs (2i, 2i+1) by (x0 cos - x1 sin, x0 sin + x1 cos), with the
    table's rows and with per-token positions, and the gradient flows through it; eagerly
    as one complex product, and in the written-out form it takes inside torch.compile
    (taken here by telling it that it is compiling). Within one ulp of values below 8
    (4.8e-7), not bit-equal: the complex kernel may fuse a multiply-add the written-out
    formula rounds twice (2.4e-7 measured). Negative controls, off by O(1): the opposite
    angle, and pairs (i, i + D/2)."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiling)
    B, T, H, D = 2, 24, 3, 8
    cos, sin = rope_cos_sin(head_dim=D, max_seq_len=T, theta=10000.0)
    x = torch.randn(B, T, H, D, generator=torch.Generator().manual_seed(0))
    positions = torch.randint(0, T, (B, T), generator=torch.Generator().manual_seed(1))

    def written_out(x, cos, sin):  # cos, sin: [B, T, 1, D/2]
        x0, x1 = x[..., 0::2], x[..., 1::2]
        out = torch.empty_like(x)
        out[..., 0::2], out[..., 1::2] = x0 * cos - x1 * sin, x0 * sin + x1 * cos
        return out

    def close(a, b):
        return (a - b).abs().max() <= 4.8e-7

    rotation = torch.stack((cos, sin), -1)
    table = written_out(x, cos.view(1, T, 1, -1), sin.view(1, T, 1, -1))
    assert close(apply_rope(x, rotation), table)
    gathered = written_out(x, cos[positions].unsqueeze(2), sin[positions].unsqueeze(2))
    assert close(apply_rope(x, rotation[positions]), gathered)
    assert not close(apply_rope(x, torch.stack((cos, -sin), -1)), table)
    perm = torch.arange(D).view(2, D // 2).T.flatten()  # channel i next to i + D/2
    rotate_half = written_out(x[..., perm], cos.view(1, T, 1, -1), sin.view(1, T, 1, -1))
    assert not close(apply_rope(x, rotation), rotate_half[..., perm.argsort()])
    leaf = x.clone().requires_grad_()
    apply_rope(leaf, rotation).pow(2).sum().backward()
    # A rotation keeps the norm: the gradient of |R x|^2 is 2x.
    torch.testing.assert_close(leaf.grad, 2 * x)


def test_sequence_at_max_seq_len_is_accepted():
    model = tiny_model(max_seq_len=16)
    assert model(tokens(1, 16)).shape == (1, 16, VOCAB)


def test_sequence_longer_than_max_seq_len_raises():
    model = build_model("debugmodel", vocab_size=VOCAB, max_seq_len=16, device="cpu")
    with pytest.raises(ValueError, match="sequence length 17") as err:
        model(tokens(1, 17))
    msg = str(err.value)
    assert "sequence length 17" in msg
    assert "max_seq_len 16" in msg
    assert "'debugmodel'" in msg
    assert "--training.seq_len" in msg


@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(dim=30, n_heads=4), "not divisible by n_heads"),
        (dict(dim=24, n_heads=8), "odd"),
        (dict(dim=32, n_heads=4, n_kv_heads=3), "not divisible by n_kv_heads"),
        (dict(dropout=1.0), "dropout"),
    ],
)
def test_invalid_model_args_raise(bad, match):
    with pytest.raises(ValueError, match=match):
        ModelArgs(**bad)
