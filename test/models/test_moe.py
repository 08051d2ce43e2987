"""The mixture-of-experts layer (models/moe.py): grouped dispatch against a dense
reference, routing that reads only a token's own row, the gate weights free of the
balancing bias, the balancing rule, the balancing state in the model's state dict and
through a resume, the flavors' sizes. Each test names its negative control.
The expert gradient at EP 2 on two forked gloo ranks is here too; the whole
expert-parallel training step over ranks: test_expert_parallel.py, slow tier."""

import shutil

import pytest
import torch
import torch.nn.functional as F
from helpers import losses, rank_context, train_here

import train as train_script
from torchtitan.config import ConfigError, parse_args
from torchtitan.models import ModelArgs, build_model, count_parameters, llama_configs
from torchtitan.models.llama import active_matmul_weights, flops_per_token
from torchtitan.models.moe import MoE


def moe_layer(seed: int = 0, **overrides) -> MoE:
    args = dict(dim=32, n_heads=4, vocab_size=64, n_experts=8, n_active_experts=2,
                n_shared_experts=1, moe_hidden_dim=16)  # fmt: skip
    args.update(overrides)
    layer = MoE(ModelArgs(**args))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    layer.reset_balance()
    return layer


def inputs(rows: int, seq: int = 32, dim: int = 32, seed: int = 1) -> torch.Tensor:
    return torch.randn(rows, seq, dim, generator=torch.Generator().manual_seed(seed))


def grouped_reference(layer: MoE, batches: list, chosen_of=None) -> list:
    """The layer's outputs on each of ``batches`` (one per expert-parallel rank; one
    batch: a single process) computed without a sort, a permutation or an all-to-all:
    each token's experts read off its routing, each expert's group picked by a mask, the
    ranks' rows in rank order, tokens in order within a rank, then each token's chosen
    outputs weighted by its gates. The kernels run on the same shapes, and the same rows
    at the same places, as the layer's: a matmul's row may take other bits in a matrix of
    another row count (AVX-512 and AVX2 CPUs block by rows differently), so the
    comparison is made where that cannot happen. ``chosen_of``: the routing to use per
    batch (a control with it wrong)."""
    w = layer.experts
    tokens = [b.reshape(-1, b.shape[-1]) for b in batches]
    routes = [layer.route(t) for t in tokens]
    chosen = [c if chosen_of is None else chosen_of(c) for _, c, _ in routes]
    outs = [torch.empty(*c.shape, t.shape[-1]) for c, t in zip(chosen, tokens)]
    for e in range(layer.n_experts):
        hit = [(c == e).any(-1) for c in chosen]  # top-k: an expert at most once a token
        rows = torch.cat([t[h] for t, h in zip(tokens, hit)])
        done = F.linear(F.silu(F.linear(rows, w.w1[e])) * F.linear(rows, w.w3[e]), w.w2[e])
        for out, c, h, part in zip(outs, chosen, hit, done.split([int(h.sum()) for h in hit])):
            out[h.nonzero()[:, 0], (c[h] == e).int().argmax(-1)] = part
    return [
        (layer.shared(t) + (out * gates.unsqueeze(-1)).sum(1)).view(b.shape)
        for t, out, (_, _, gates), b in zip(tokens, outs, routes, batches)
    ]


def test_grouped_dispatch_equals_each_token_through_its_experts():
    """The grouped path (tokens sorted by expert, one matmul per expert group, outputs
    put back in token order) gives, bit for bit, each token's chosen experts' outputs
    found with no sort at all (``grouped_reference``: the same kernels on the same
    shapes, so on any CPU). Every expert has a group here, checked. Negative control:
    the reference with each token's outputs taken from the next token's experts
    differs."""
    layer = moe_layer()
    x = inputs(4)
    _, chosen, _ = layer.route(x.reshape(-1, 32))
    assert torch.bincount(chosen.flatten(), minlength=8).min() >= 4
    (reference,) = grouped_reference(layer, [x])
    assert torch.equal(layer(x), reference)
    (wrong,) = grouped_reference(layer, [x], chosen_of=lambda c: c.roll(1, 0))
    assert not torch.equal(layer(x), wrong)


def test_a_tokens_experts_do_not_depend_on_the_rest_of_the_batch():
    """Routing one row of the batch alone chooses, for every token, the experts that
    routing the whole batch chose: no capacity, nothing dropped, so the split of a batch
    over ranks or micro-batches does not change routing (exact, on any CPU). The outputs
    are the same to a relative 1e-6 of their scale, not to the bit: the expert groups
    have other row counts, and a CPU's matmul may give a row other bits in a matrix of
    another size (docs/parallelism.md, What is exact). Negative control: expert-choice
    routing (each expert takes its top tokens of the batch) does change with the batch."""
    layer = moe_layer()
    layer.expert_bias.copy_(torch.linspace(-0.05, 0.05, 8))  # a trained bias in play
    x = inputs(6, 256)
    _, whole, _ = layer.route(x.reshape(-1, 32))
    alone = torch.cat([layer.route(x[i])[1] for i in range(6)])
    assert torch.equal(whole, alone)
    out = layer(x)
    for i in range(6):
        apart = layer(x[i : i + 1])
        assert (apart - out[i : i + 1]).abs().max() <= 1e-6 * out.abs().max()

    def expert_choice(rows):
        scores = layer.route(rows.reshape(-1, 32))[0]
        return torch.topk(scores, 16, dim=0).indices  # each expert's 16 top tokens

    assert not torch.equal(expert_choice(x[:1]), expert_choice(x)[:, :])


def test_gate_weights_are_the_unbiased_scores():
    """The bias chooses experts, it never weights them: with expert 3's bias far above
    the rest every token chooses it, and the gates are the chosen experts' sigmoid
    scores normalized to sum to one. Negative control: gates taken from the biased
    scores differ."""
    layer = moe_layer()
    layer.expert_bias[3] = 10.0
    tokens = inputs(2).reshape(-1, 32)
    scores, chosen, gates = layer.route(tokens)
    assert (chosen == 3).any(-1).all()
    plain = torch.sigmoid(F.linear(tokens, layer.router.weight).float()).gather(-1, chosen)
    assert torch.equal(gates, plain / plain.sum(-1, keepdim=True))
    biased = (scores + layer.expert_bias).gather(-1, chosen)
    assert not torch.allclose(gates, biased / biased.sum(-1, keepdim=True))


def balanced_after(rate: float, steps: int = 300) -> tuple[float, float]:
    """max/mean expert load of a skewed router, before and after ``steps`` balancing
    updates (each from one forward's loads, as after each optimizer step)."""
    layer = moe_layer(moe_bias_rate=rate).train()
    with torch.no_grad():  # inputs leaning one way, and expert 0's router row that way
        layer.router.weight[0] += 0.1
    ratios = []
    with torch.no_grad():
        for step in range(steps):
            layer(inputs(8, 64, seed=step) + 0.5)
            load = layer.step_load
            ratios.append((load.max() / load.float().mean()).item())
            layer.balance(load)
    return ratios[0], sum(ratios[-20:]) / 20


def test_the_balancing_rule_evens_a_skewed_router():
    """DeepSeek-V3's sign rule at rate 1e-3: a router that sends 2.7x the mean load to
    one expert is within 1.2x of even after 300 steps of 1024 choices (the rest is the
    noise of 128 choices per expert). Negative control: rate 0 stays as skewed; the
    sign flipped makes it worse."""
    first, last = balanced_after(1e-3)
    assert first > 2.5 and last < 1.2, (first, last)
    assert balanced_after(0.0, steps=100)[1] > 2.5
    assert balanced_after(-1e-3, steps=100)[1] > first


def test_balancing_state_is_in_the_state_dict_and_counts_a_step_once():
    """The bias and the token counts are persistent buffers (a checkpoint holds what
    get_model_state_dict gives, persistent buffers included); a step's loads are
    counted in its forward and not again when activation checkpointing recomputes it.
    Negative control: the per-step accumulator is not state."""
    model = build_model("debug_moe", 256, device="cpu", seed=0)
    for block in model.layers.values():
        block.recompute = True
    keys = set(model.state_dict())
    for i in range(2):
        assert {
            f"layers.{i}.feed_forward.expert_bias",
            f"layers.{i}.feed_forward.expert_tokens",
        } <= keys
    assert not any("step_load" in k for k in keys)
    model.train()
    tokens = torch.randint(0, 256, (2, 16))
    model(tokens).float().mean().backward()
    loads = model.expert_loads()
    assert loads.sum(1).tolist() == [2 * 16 * 2] * 2  # tokens x top-2, per layer
    model.balance_experts(loads)
    assert model.layers["0"].feed_forward.expert_tokens.sum() == 64
    assert model.layers["0"].feed_forward.expert_bias.abs().sum() > 0


MOE_RUN = ["--model.flavor", "debug_moe", "--training.seq_len", 32, "--training.batch_size", 2,
           "--training.steps", 4, "--checkpoint.enable_checkpoint", "--checkpoint.interval", 2]  # fmt: skip


def test_resume_restores_the_balancing_bias(tmp_path, monkeypatch):
    """4 steps of debug_moe with a checkpoint at step 2; the same resumed from step 2 in
    a new run logs steps 3-4 with exactly the losses of the uninterrupted run. Negative
    control: resuming with the bias dropped (zeroed after the load, as a checkpoint
    without it would leave it) changes the losses after the resume."""
    train_here(tmp_path / "whole", *MOE_RUN)
    whole = losses(tmp_path / "whole")

    def resumed(name: str) -> dict:
        shutil.copytree(tmp_path / "whole", tmp_path / name)
        shutil.rmtree(tmp_path / name / "checkpoint" / "step-4")
        train_here(tmp_path / name, *MOE_RUN)
        return losses(tmp_path / name)

    again = resumed("resumed")
    assert [again[s] for s in (3, 4)] == [whole[s] for s in (3, 4)]

    load = train_script.resume

    def resume_dropping_bias(run):
        load(run)
        for moe in run.model.moe_layers():
            moe.expert_bias.zero_()

    monkeypatch.setattr(train_script, "resume", resume_dropping_bias)
    dropped = resumed("dropped")
    assert [dropped[s] for s in (3, 4)] != [whole[s] for s in (3, 4)]


def test_a_dropped_step_leaves_the_balancing_state_where_it_was(tmp_path, monkeypatch):
    """A step the guard drops (a NaN loss planted at step 3) moves no expert's bias and
    no token count: after it, every layer's balancing buffers equal step 2's
    (torch.equal), as its weights do; the bias moves by what the loads say only with an
    applied step. Negative control: the applied steps around it (2, 4) move the bias."""
    from torchtitan.spikes import FAULT_ENV

    monkeypatch.setenv(FAULT_ENV, "3:nan")
    after: list[dict] = []
    real = train_script.feed_and_step

    def feed_and_step(run, batch_loss):
        feed, step = real(run, batch_loss)

        def stepped(batches):
            out = step(batches)
            after.append({name: b.detach().clone() for name, b in run.model.named_buffers()
                          if "expert" in name})  # fmt: skip
            return out

        return feed, stepped

    monkeypatch.setattr(train_script, "feed_and_step", feed_and_step)
    _, log = train_here(tmp_path, "--model.flavor", "debug_moe", "--training.seq_len", 32,
                        "--training.batch_size", 2, "--training.steps", 4)  # fmt: skip
    assert "step 3: loss nan" in log and len(after) == 4
    biases = [n for n in after[0] if n.endswith("expert_bias")]
    assert biases and set(after[0]) > set(biases)  # the counts are kept too
    assert all(torch.equal(after[2][n], after[1][n]) for n in after[0])
    for moved in (1, 3):
        assert not all(torch.equal(after[moved][n], after[moved - 1][n]) for n in biases)


def test_metrics_hold_each_layers_expert_load(tmp_path):
    """The JSONL has, every logged step, each MoE layer's max/mean load and the loads
    themselves (tokens x top-k per layer, over all ranks)."""
    from helpers import read_jsonl

    train_here(tmp_path, "--model.flavor", "debug_moe", "--training.seq_len", 32,
               "--training.batch_size", 2, "--training.steps", 2)  # fmt: skip
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert len(r["expert_loads"]) == 2 and all(sum(x) == 2 * 32 * 2 for x in r["expert_loads"])
        assert r["expert_load_max_mean/0"] >= 1.0 and "expert_load_max_mean/1" in r


def test_plot_expert_load_draws_each_layers_loads(tmp_path):
    """plot_expert_load reads each logged step's loads: per layer, [expert][step] over
    the even share, and draws them. Negative control: a run's records without loads (a
    dense model's) are refused in one line."""
    import json

    from torchtitan.tools.plot_expert_load import load_series, plot_expert_load

    records = [{"step": s, "loss": 1.0, "expert_loads": [[s, 3, 0, 0], [1, 1, 1, 1]]}
               for s in (1, 2)]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    steps, series = load_series(records)
    assert steps == [1, 2] and series[0][1] == [3.0, 3 * 4 / 5] and series[1][0] == [1.0, 1.0]
    assert plot_expert_load(tmp_path).stat().st_size > 0
    dense = tmp_path / "dense"
    dense.mkdir()
    (dense / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    with pytest.raises(ValueError, match="not an MoE run"):
        plot_expert_load(dense)


def test_sequence_aux_loss_is_added_and_trains_the_router():
    """With moe_aux_loss_weight the layer's sequence-level balance loss is positive and
    gives the router a gradient of its own. Negative control: weight 0 adds none."""
    layer = moe_layer(moe_aux_loss_weight=0.01).train()
    layer(inputs(2))
    assert layer.aux_loss > 0
    layer.aux_loss.backward()
    assert layer.router.weight.grad.abs().sum() > 0
    plain = moe_layer().train()
    plain(inputs(2))
    assert plain.aux_loss is None


def test_moe_flavors_sizes_and_active_flops():
    """moe_1B: ~1B parameters in all, ~0.2B active per token; MFU counts the active
    ones only (6 per active matmul weight). debug_moe has the dense debug model's active
    feed-forward width (plus the router). Negative control: counting every expert would
    give ~4x the FLOPs."""
    args = llama_configs["moe_1B"]
    total = count_parameters(build_model("moe_1B", args.vocab_size))
    active = active_matmul_weights(args) + args.vocab_size * args.dim  # + the embedding
    assert 0.9e9 < total < 1.1e9 and 0.18e9 < active < 0.25e9, (total, active)
    all_experts = active_matmul_weights(
        ModelArgs(**{**args.__dict__, "n_active_experts": args.n_experts})
    )
    assert flops_per_token(args, 0) == 6 * active_matmul_weights(args) < 6 * all_experts / 3
    dense, moe = llama_configs["debugmodel"], llama_configs["debug_moe"]
    assert active_matmul_weights(moe) - active_matmul_weights(dense) == 2 * 64 * 8


@pytest.mark.parametrize("bad", [dict(n_active_experts=9), dict(moe_hidden_dim=0)])
def test_impossible_moe_args_are_refused(bad):
    with pytest.raises(ValueError, match="flavor"):
        moe_layer(**bad)


@pytest.mark.parametrize(
    "flavor, argv, says",
    [
        ("debug_moe", ["--parallelism.tensor_parallel_degree", "2"], "tensor_parallel_degree 2"),
        ("debug_moe", ["--parallelism.pipeline_parallel_degree", "2"], "pipeline_parallel"),
        ("debug_moe", ["--parallelism.expert_parallel_degree", "3"], "divide the flavor's 8"),
        ("debugmodel", ["--parallelism.expert_parallel_degree", "2"], "has no experts"),
    ],
)
def test_what_moe_cannot_be_combined_with_is_refused_in_one_line(flavor, argv, says):
    """Negative control: debug_moe at expert-parallel degree 2 is accepted."""
    with pytest.raises(ConfigError, match=says) as refused:
        parse_args(["--model.flavor", flavor, *argv])
    assert "\n" not in str(refused.value)
    parse_args(["--model.flavor", "debug_moe", "--parallelism.expert_parallel_degree", "2"])


def two_rank_outputs(full: MoE, batches: list, regroup: bool = True) -> list:
    """Each of 2 simulated expert-parallel ranks' layer outputs: rank r holds experts
    4r..4r+3; the all-to-alls are done here by slicing (what all_to_all_single moves),
    and each rank's experts run through ``run_received``, the product path (or, with
    ``regroup`` False, on the rows in arrival order: the negative control)."""
    import copy

    layers = []
    for r in range(2):
        layer = copy.deepcopy(full)
        for name in ("w1", "w2", "w3"):
            whole = getattr(full.experts, name).detach()
            setattr(layer.experts, name, torch.nn.Parameter(whole[4 * r : 4 * r + 4].clone()))
        layer.ep_size, layer.ep_rank = 2, r
        layers.append(layer)
    sent = {}

    def capture(r):
        def remote(rows, counts):
            sent[r] = (rows, counts.view(2, 4))
            return torch.zeros_like(rows)

        return remote

    for r, layer in enumerate(layers):  # the dispatch: what each rank sends where
        layer._run_remote = capture(r)
        layer(batches[r])
    parts = {r: rows.split(counts.sum(1).tolist()) for r, (rows, counts) in sent.items()}
    back = {}
    for d, layer in enumerate(layers):  # each rank's experts over what it received
        got = torch.cat([parts[r][d] for r in range(2)])
        received = torch.stack([sent[r][1][d] for r in range(2)])
        if regroup:
            out = layer.run_received(got, received)
        else:
            out = layer.experts(got, received.sum(0).tolist())
        back[d] = out.split(received.sum(1).tolist())
    outputs = []
    for r, layer in enumerate(layers):  # the combine: each rank's rows back from both
        returned = torch.cat([back[d][r] for d in range(2)])
        layer._run_remote = lambda rows, counts, returned=returned: returned
        outputs.append(layer(batches[r]))
    return outputs


def test_expert_parallel_dispatch_computes_what_one_rank_computes():
    """Two expert-parallel ranks simulated in one process (the all-to-alls by slicing):
    each rank's outputs equal, bit for bit, each token through its experts with every
    expert's group holding rank 0's rows, then rank 1's (``grouped_reference`` over both
    batches: the same kernels on the same shapes, so on any CPU). Negative control: the
    received rows run in arrival order (by source rank) instead of grouped by expert give
    other outputs. (The real all-to-all on 2 ranks: test_expert_parallel.py, slow tier.)"""
    full = moe_layer()
    batches = [inputs(2, 64, seed=1), inputs(2, 64, seed=2)]
    reference = grouped_reference(full, batches)
    for out, expected in zip(two_rank_outputs(full, batches), reference):
        assert torch.equal(out, expected)
    wrong = two_rank_outputs(full, batches, regroup=False)
    assert not all(torch.equal(out, expected) for out, expected in zip(wrong, reference))


# ---- the expert gradient over two real expert-parallel ranks (forked, gloo) --------------


class _OneLayer(torch.nn.Module):
    """What parallel/expert_parallel.apply reads of a model: its MoE layers."""

    def __init__(self, layer: MoE):
        super().__init__()
        self.layer = layer

    def moe_layers(self) -> list[MoE]:
        return [self.layer]


def _ep_rank(rank: int, store: str, out) -> None:
    """One of 2 ranks: the layer at EP 2 over a real gloo group, this rank's batch, its
    own mean loss backward; reports the gradients of the experts it holds, as the
    layer computes them and (the negative control) left undivided."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan.parallel import expert_parallel

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        torch.set_num_threads(1)
        layer = moe_layer()
        expert_parallel.apply(_OneLayer(layer), init_device_mesh("cpu", (2,)))
        e, grads = layer.experts, {}
        for case, divisor in (("applied", e.grad_divisor), ("undivided", 1)):
            e.grad_divisor = divisor
            layer.zero_grad()
            layer(inputs(2, 64, seed=1 + rank)).square().mean().backward()
            # As arrays: a tensor would travel as shared memory that ends with this process.
            grads[case] = {
                n: getattr(e, n).grad.to_local().numpy().copy() for n in ("w1", "w2", "w3")
            }
        out.put((rank, grads))
    finally:
        dist.destroy_process_group()


def _ep_gradients(tmp_path) -> dict:
    ctx = rank_context()
    out = ctx.Queue()
    procs = [ctx.Process(target=_ep_rank, args=(r, str(tmp_path / "store"), out)) for r in range(2)]
    for p in procs:
        p.start()
    grads = dict(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    return grads


def test_an_experts_gradient_at_ep_2_is_the_mean_over_the_ranks_as_fsdp_gives_the_rest(tmp_path):
    """Two forked ranks at EP 2 (real all-to-alls on gloo), each with its own batch and
    its own mean loss: the rank holding an expert applies the gradient of the mean of
    both ranks' losses (what FSDP's average gives every other weight), the one-process
    gradient to float rounding (rows summed in another order). Negative control: the
    expert gradient left undivided (``grad_divisor`` 1: the sum over the ranks) is twice
    that. (The whole training step at EP 2 against EP 1: test_expert_parallel.py, slow
    tier.)"""
    full = moe_layer()
    loss = sum(full(inputs(2, 64, seed=1 + r)).square().mean() for r in range(2)) / 2
    loss.backward()
    local = full.n_experts // 2
    grads = _ep_gradients(tmp_path)
    for case, scale in (("applied", 1.0), ("undivided", 2.0)):
        for rank in range(2):
            for name, grad in grads[rank][case].items():
                reference = getattr(full.experts, name).grad[rank * local : (rank + 1) * local]
                torch.testing.assert_close(torch.from_numpy(grad), reference * scale,
                                           rtol=1e-5, atol=1e-8)  # fmt: skip
