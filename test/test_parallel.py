"""Layouts where data-parallel ranks are not all ranks: FSDP x TP and HSDP, the loader
keyed by data-parallel rank, and resumes across layouts.

Every multi-rank property comes from ONE 4-rank launch (test/dist/parallel_layouts.py,
gloo on CPU: starting interpreters is what costs on a small machine), whose records
each test reads; each test names its negative control. The layout's config errors are
checked in-process.
"""

from __future__ import annotations

import json
import re
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import (
    CONFIG,
    assert_run_read_every_token_once,
    error_lines,
    losses,
    read_jsonl,
    run_main,
    torchrun,
)

from torchtitan import parallel
from torchtitan.config import ConfigError, parse_args
from torchtitan.data import document_lengths
from torchtitan.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer
from torchtitan.models import build_model
from torchtitan.models.llama import llama_configs
from torchtitan.parallel import tensor_parallel
from torchtitan.records.provenance import (
    check_complete,
    check_exactly_once,
    read_provenance,
    sequences_by_step,
)

TP_GROUPS = ((0, 1), (2, 3))  # rank = dp_rank x 2 + tp_rank


@pytest.fixture(scope="module")
def layouts(tmp_path_factory, dozen_corpus):
    out = tmp_path_factory.mktemp("layouts")
    begin = time.perf_counter()
    proc = torchrun([str(out), str(dozen_corpus)], nproc=4, timeout=600,
                    script="test/dist/parallel_layouts.py")  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    records = {r: json.loads((out / "records" / f"rank{r}.json").read_text()) for r in range(4)}
    return SimpleNamespace(out=out, log=proc.stderr, stdout=proc.stdout, records=records,
                           corpus=dozen_corpus, wall_s=time.perf_counter() - begin)  # fmt: skip


def digests(layouts, rank: int, scenario: str, what: str) -> list[str]:
    return [d for w, d in layouts.records[rank][scenario] if w == what]


def steps_of(items: list, per_step: int, steps: range, first_step: int = 1) -> list:
    return [x for s in steps for x in items[(s - first_step) * per_step : (s - first_step + 1) * per_step]]  # fmt: skip


# ---- the loader through DCP, the log line's view of the ranks --------------------------


def test_dataloader_through_dcp_into_a_never_iterated_loader(layouts):
    """4 ranks, 0 and then 2 workers each: every rank's entry survives DCP, and a fresh
    loader given the one it picks yields exactly what the original yielded next."""
    assert layouts.stdout.count("restored exactly") == 8, layouts.stdout[-2000:]


def test_a_start_reads_what_it_needs_once_per_job_on_rank_0(layouts):
    """Every start of the 4-rank job (16 before the world splits, 7 of them resumes): rank 0 alone
    lists the unfinished saves and reads manifests (the candidates' and the chosen one,
    which it sends to the others, for the verification and the load); every rank read
    the chosen one twice and listed (on a store: ~6 requests a rank per start on one
    prefix). Control: rank 0 did, at least once per start."""
    reads = [layouts.records[r]["start_reads"] for r in range(4)]
    starts = reads[0]["loads"]
    assert starts >= 14 and all(r["loads"] == starts for r in reads), reads
    assert reads[0]["partial_steps"] >= 7 and reads[0]["read_manifest"] >= 7, reads
    assert [(r["partial_steps"], r["read_manifest"]) for r in reads[1:]] == [(0, 0)] * 3, reads


def test_a_4_rank_job_resolves_a_hub_style_folder_once(layouts):
    """The Hub-style folder is resolved by rank 0 alone (counted on every rank by a wrapper
    around the resolution); before the plan each rank resolved it twice (loader and
    fingerprint). Control: the one step trained on it."""
    assert [layouts.records[r]["hub_resolutions"] for r in range(4)] == [1, 0, 0, 0]
    assert sorted(losses(layouts.out / "hub")) == [1]


def test_the_log_line_names_the_slowest_rank(layouts):
    """metrics.across_ranks over one real gather: rank r took 10 (r + 1) ms."""
    assert "across ranks: the slowest rank named" in layouts.stdout


# ---- the loss over ranks ----------------------------------------------------------------


def test_masked_boundaries_on_4_ranks_give_the_one_rank_gradient(layouts):
    """Under mask_document_boundaries, ranks holding different numbers of labels that
    count (FSDP 4) apply the gradient of the mean over every counted label of the global
    batch: the one-rank gradient, to float rounding (the reduction sums in another
    order). Negative control: each rank normalizing by its own count (times the ranks)
    gives another gradient."""
    saved = torch.load(layouts.out / "masked.pt")
    assert len(set(saved["counted"])) == 4, saved["counted"]
    # Rank 0's shard: the first rows of each parameter (FSDP2 splits dim 0 in chunks).
    reference = {n: g[: len(saved["fsdp"][n])] for n, g in saved["one_rank"].items()}
    assert saved["fsdp"].keys() == reference.keys()
    for name, grad in reference.items():
        torch.testing.assert_close(saved["fsdp"][name], grad, rtol=1e-4, atol=1e-7)
    assert any(
        not torch.allclose(saved["own_counts"][n], g, rtol=1e-3, atol=1e-7)
        for n, g in reference.items()
    )


# ---- initialization ---------------------------------------------------------------------


def test_step0_weights_are_the_same_on_every_layout(layouts):
    """Built on meta and sharded before materializing, each rank drawing only what it
    holds: the step-0 weights are bit-equal for 1 rank, 2 ranks (pairs of the 4-rank
    job), FSDP 4, FSDP 2 x TP 2 (strided row splits and column splits) and HSDP 2 x 2.
    Drawing each shard from the global RNG (the naive way) gives other weights. With
    bf16 the blocks compute in bf16 while the parameters and RoPE tables stay fp32."""
    reference = build_model("debugmodel", 4096, device="cpu", seed=42).state_dict()
    saved = torch.load(layouts.out / "init.pt")
    for layout in ("weights", "on_two", "tp", "hsdp"):
        assert saved[layout].keys() == reference.keys()
        for name, value in reference.items():
            assert torch.equal(saved[layout][name], value), (layout, name)
    assert any(not torch.equal(saved["naive"][n], v) for n, v in reference.items())
    assert saved["params"] == ["torch.float32"]
    assert saved["compute"] == "torch.bfloat16"
    assert saved["rope"] == "torch.float32", "FSDP must not cast the RoPE tables to bf16"


# ---- data by data-parallel rank -----------------------------------------------------------


def test_tp_peers_train_on_identical_batches_and_dp_ranks_on_their_own(layouts):
    """A digest of every training forward's input tokens: equal within each TP group,
    different between the two data-parallel ranks at every micro-batch, in each TP
    scenario, also after resuming on 1 DP x 2 TP. Negative control: under FSDP 4 (TP 1)
    all four ranks differ, so the digest does tell batches apart."""
    for scenario, micro_batches in (("chain-2x2", 4), ("dropout", 6), ("dropout-resumed", 4)):
        tokens = [digests(layouts, r, scenario, "tokens") for r in range(4)]
        assert len(tokens[0]) == micro_batches
        for a, b in TP_GROUPS:
            assert tokens[a] == tokens[b], scenario
        assert all(x != y for x, y in zip(tokens[0], tokens[2])), scenario
    for scenario, (a, b) in (("chain-1x2", (0, 1)), ("dropout-1x2", (2, 3))):
        tokens = [digests(layouts, r, scenario, "tokens") for r in (a, b)]
        assert len(tokens[0]) == 8 and tokens[0] == tokens[1], scenario
    tokens = [digests(layouts, r, "fsdp4", "tokens") for r in range(4)]
    assert all(len(set(step)) == 4 for step in zip(*tokens))


def test_checkpoints_hold_one_dataloader_entry_per_data_parallel_rank(layouts):
    """The saved metadata has exactly one ``dataloader.dp_rank_<d>`` entry per DP rank of
    the layout that wrote it (2 at 2 x 2, 4 under HSDP and FSDP, 1 at 1 x 2), the shared
    dropout stream one per DP rank too, and Python/numpy RNG one per rank. Negative
    control: the same count read from the FSDP 4 checkpoint is 4, not 2."""
    chain = layouts.out / "chain" / "checkpoint"
    for step, dp, world in ((2, 2, 4), (4, 4, 4), (6, 4, 4), (8, 1, 2)):
        keys = dcp.FileSystemReader(str(chain / f"step-{step}")).read_metadata()
        keys = set(keys.state_dict_metadata)
        assert {k for k in keys if k.startswith("dataloader.")} == {
            f"dataloader.dp_rank_{d}" for d in range(dp)
        }, step
        assert {k for k in keys if k.startswith("rng.dp_rank_")} == {
            f"rng.dp_rank_{d}" for d in range(dp)
        }
        assert {k for k in keys if k.startswith("rng.rank_")} == {
            f"rng.rank_{r}" for r in range(world)
        }


# ---- the same training on any layout ------------------------------------------------------


def test_tp_losses_equal_tp1_losses_on_the_same_global_batch(layouts):
    """The chain 2 DP x 2 TP (steps 1-2) -> HSDP 2 x 2 (3-4) -> FSDP 4 (5-6) -> 1 DP x 2 TP
    (7-8) trains on exactly the batches of an unbroken FSDP 4 run (the same sequences
    at every step, by provenance), and its losses equal that run's to 1e-6 relative
    (observed: at most 1.2e-7, float32 rounding): not bit for bit, since TP splits the
    matmuls and the loss over the vocabulary, and HSDP and accumulation sum in another
    order. Negative control: the tolerance tells consecutive steps apart (neighbouring
    losses differ by 3.7e-5 relative and more)."""
    chain, reference = losses(layouts.out / "chain"), losses(layouts.out / "fsdp4")
    assert sorted(chain) == sorted(reference) == list(range(1, 9))
    by_step = [
        sequences_by_step(read_provenance(str(layouts.out / run / "provenance")))
        for run in ("chain", "fsdp4")
    ]
    for step in range(1, 9):
        assert sorted(map(json.dumps, by_step[0][step])) == sorted(
            map(json.dumps, by_step[1][step])
        ), step
        assert chain[step] == pytest.approx(reference[step], rel=1e-6, abs=0), step
    for step in range(1, 8):
        assert reference[step + 1] != pytest.approx(reference[step], rel=1e-6, abs=0)


def assert_chain_read_every_token_once(layouts, name: str):
    """The run in ``name`` read every token once, and every document of each finished
    pass whole (the provenance checker, given the corpus's documents)."""
    assert_run_read_every_token_once(layouts.out / name)
    config = [*CONFIG, "--training.dataset_path", str(layouts.corpus), "--training.seq_len", "32"]
    lengths = document_lengths(parse_args(config), Tokenizer(DEFAULT_TOKENIZER_PATH))
    chain = read_provenance(str(layouts.out / name / "provenance"))
    report = check_complete(chain, lengths)["shakespeare"]
    assert len(report.finished_epochs) >= 1 and (report.missing, report.partial) == (0, 0)


def test_the_chain_over_layouts_reads_every_token_once_and_keeps_the_global_batch(layouts):
    """Across the four layouts the provenance checker finds every token read once and no
    gap, and every document of each finished pass read whole; each leg sought the one
    global position the one before saved; the global batch stayed 12 sequences (2 DP x 3
    x 2 micro-batches, 4 x 3 x 1, 1 x 3 x 4). Negative control: the same records with one
    step's data written twice make the checker count duplicates."""
    assert_chain_read_every_token_once(layouts, "chain")
    log = layouts.log
    assert "2 micro-batches of at most 3 x 32 per data-parallel rank; 2 data-parallel x 2" in log
    assert "1 micro-batches of at most 3 x 32 per data-parallel rank; 4 data-parallel (HSDP" in log
    assert "4 micro-batches of at most 3 x 32 per data-parallel rank; 1 data-parallel x 2" in log
    assert read_jsonl(layouts.out / "chain" / "metrics.jsonl")[-1]["tokens_seen"] == 8 * 12 * 32
    provenance = read_provenance(str(layouts.out / "chain" / "provenance"))
    provenance[99] = {7: provenance[0][7]}  # a TP peer that also wrote its provenance
    assert sum(r.duplicate_tokens for r in check_exactly_once(provenance).values()) > 0


# ---- randomness and exact resume -----------------------------------------------------------


def masks(layouts, rank: int, scenario: str) -> list[str]:
    return digests(layouts, rank, scenario, "mask")


def test_replicated_dropout_masks_agree_within_a_tp_group_also_after_a_layout_change(layouts):
    """Without sequence parallel every TP peer holds the whole residual stream, so its
    dropout masks must be the same on both peers: they are, at 2 DP x 2 TP, and on
    1 DP x 2 TP resumed from FSDP 4, whose two ranks had streams of their own (the
    group takes its DP rank's). Data-parallel ranks draw their own: the two DP ranks'
    masks differ, and so do all four ranks' after 2 x 2 resumed on FSDP 4 (the new DP
    ranks 0 and 1 took the streams of the old DP ranks, not those of one TP group)."""
    drawn = [masks(layouts, r, "dropout") for r in range(4)]
    assert len(drawn[0]) == 3 * 2 * 2  # steps x micro-batches x blocks
    for a, b in TP_GROUPS:
        assert drawn[a] == drawn[b]
    assert all(x != y for x, y in zip(drawn[0], drawn[2]))
    fsdp4 = [masks(layouts, r, "dropout-fsdp4") for r in range(4)]
    assert len(fsdp4[0]) == 2 and all(len(set(m)) == 4 for m in zip(*fsdp4))
    after = [masks(layouts, r, "dropout-1x2") for r in (2, 3)]
    assert len(after[0]) == 2 * 4 * 2 and after[0] == after[1]


def test_sequence_parallel_draws_its_own_masks_on_each_tp_rank(layouts):
    """Under sequence parallel each TP peer holds its own chunk of the sequence: one
    forward with dropout 0.5 drops each chunk with a mask of its own, not one mask
    repeated (the digest is of the mask alone, so equal chunks' masks would match).
    The peers saw the same tokens; the data-parallel ranks drew differently too."""
    drawn = [masks(layouts, r, "sp_masks") for r in range(4)]
    tokens = [digests(layouts, r, "sp_masks", "tokens") for r in range(4)]
    assert len(drawn[0]) == 2 and len(set(tokens[0] + tokens[1])) == 1
    for a, b in TP_GROUPS:
        assert all(x != y for x, y in zip(drawn[a], drawn[b]))
    assert all(x != y for x, y in zip(drawn[0], drawn[2]))


def test_a_resume_at_a_fixed_tp_layout_is_bit_exact(layouts):
    """2 DP x 2 TP with dropout, resumed from its step-1 checkpoint: steps 2-3 repeat the
    unbroken run bit for bit: losses, every input batch and every dropout mask on every
    rank. Negative control: step 2's masks differ from step 1's, which a resume that
    kept its freshly seeded RNG (instead of the checkpoint's) would draw again."""
    first, resumed = losses(layouts.out / "dropout"), losses(layouts.out / "dropout-resumed")
    assert {s: first[s] for s in (2, 3)} == {s: resumed[s] for s in (2, 3)}
    for rank in range(4):
        for what, per_step in (("tokens", 2), ("mask", 4)):
            unbroken = digests(layouts, rank, "dropout", what)
            again = digests(layouts, rank, "dropout-resumed", what)
            assert again == steps_of(unbroken, per_step, range(2, 4)), (rank, what)
        drawn = masks(layouts, rank, "dropout")
        assert steps_of(drawn, 4, range(1, 2)) != steps_of(drawn, 4, range(2, 3))


# ---- pipeline parallel ----------------------------------------------------------------------

PP_STAGE0, PP_STAGE1 = (0, 1), (2, 3)  # pipeline outermost: rank = pp_rank x 2 + dp_rank


def reads(layouts, rank: int, scenario: str) -> list[int]:
    return [int(n) for n in digests(layouts, rank, scenario, "reads")]


def test_pipeline_stages_share_their_data_parallel_ranks_data_and_only_the_first_reads(layouts):
    """PP 2 x DP 2, global batch 12: each first stage reads its DP rank's 6 sequences a
    step; the second stages read nothing (their inputs come from the first, the labels
    too); the checkpoint holds one loader entry per DP rank, a dropout stream per DP rank
    and stage, and the provenance is written once per DP rank. Negative control: the
    FSDP 4 leg of the same chain read on every rank."""
    for rank in PP_STAGE0:
        assert reads(layouts, rank, "pp-2x2") == [6, 6, 6]
    for rank in PP_STAGE1:
        assert reads(layouts, rank, "pp-2x2") == []
        assert reads(layouts, rank, "pp-dp4") == [3, 3]
    keys = dcp.FileSystemReader(str(layouts.out / "pp-chain" / "checkpoint" / "step-3"))
    keys = set(keys.read_metadata().state_dict_metadata)
    assert {k for k in keys if k.startswith("dataloader.")} == {
        "dataloader.dp_rank_0",
        "dataloader.dp_rank_1",
    }
    assert {k for k in keys if "dp_rank_" in k and k.startswith("rng.")} == {
        "rng.dp_rank_0", "rng.dp_rank_1", "rng.pp_rank_1_dp_rank_0", "rng.pp_rank_1_dp_rank_1"}  # fmt: skip
    files = sorted(p.name for p in (layouts.out / "pp-dropout" / "provenance").iterdir())
    assert files == ["rank0.jsonl", "rank1.jsonl"]


def test_pipeline_losses_agree_with_one_stage_on_the_same_global_batch(layouts):
    """PP 2 x DP 2 (steps 1-3 of the pipeline chain) against FSDP 4 on the same global
    batches: the losses agree within 1e-5 relative, not bit for bit (2 data-parallel
    ranks reduce the gradients in another order than 4, and the pipeline adds the
    micro-batches' losses one at a time). Negative control: the same steps with dropout
    0.5 are outside that tolerance."""
    pp, one = losses(layouts.out / "pp-chain"), losses(layouts.out / "fsdp4")
    for step in (1, 2, 3):
        assert pp[step] == pytest.approx(one[step], rel=1e-5), step
    # The gradient norm is over every stage's parameters (a stage's own would be smaller).
    norms = [{r["step"]: r["grad_norm"] for r in read_jsonl(layouts.out / run / "metrics.jsonl")}
             for run in ("pp-chain", "fsdp4")]  # fmt: skip
    for step in (1, 2, 3):
        assert norms[0][step] == pytest.approx(norms[1][step], rel=1e-5), step
    dropped = losses(layouts.out / "pp-dropout")
    assert dropped[2] != pytest.approx(one[2], rel=1e-5)


def test_masked_boundaries_under_a_pipeline_give_the_one_stage_losses(layouts):
    """With document boundaries masked, the last stage divides each micro-batch's summed
    loss by the labels that count over all data-parallel ranks: PP 2 x DP 2 gives the
    FSDP 4 losses (within 1e-5 relative), unshuffled, so that the windows cross document
    boundaries. Negative control: the masking changes the loss of these batches (the
    unmasked FSDP 4 run's differs)."""
    masked, pp = losses(layouts.out / "masked-fsdp4"), losses(layouts.out / "masked-pp")
    for step in (1, 2):
        assert pp[step] == pytest.approx(masked[step], rel=1e-5), step
    plain = losses(layouts.out / "unmasked-fsdp4")
    assert all(masked[s] != pytest.approx(plain[s], rel=1e-5) for s in (1, 2))


def test_the_pipeline_chain_reads_every_token_once_and_keeps_the_global_batch(layouts):
    """PP 2 x DP 2 -> FSDP 4 -> PP 2 x TP 2: every token read once, every document of a
    finished pass read whole, 12 sequences a step throughout (tokens_seen), each leg
    loading the one before's checkpoint (the names are the unsplit model's)."""
    assert_chain_read_every_token_once(layouts, "pp-chain")
    assert "2 pipeline x 2 data-parallel x 1 tensor-parallel" in layouts.log
    assert "2 pipeline x 1 data-parallel x 2 tensor-parallel" in layouts.log
    assert read_jsonl(layouts.out / "pp-chain" / "metrics.jsonl")[-1]["tokens_seen"] == 8 * 12 * 32


def test_a_pipeline_resume_is_bit_exact(layouts):
    """PP 2 x DP 2 with dropout, resumed from its step-2 checkpoint: steps 3-4 repeat the
    unbroken run bit for bit: losses and every dropout mask of every stage. Negative
    control: step 2's masks differ from step 1's (a resume that kept its seeded RNG would
    draw those again)."""
    first, resumed = losses(layouts.out / "pp-dropout"), losses(layouts.out / "pp-dropout-resumed")
    assert {s: first[s] for s in (3, 4)} == {s: resumed[s] for s in (3, 4)}
    for rank in range(4):
        # A run's first step runs each stage once more to learn the shapes (torch's
        # pipelining; on a later stage with a stand-in input) with the RNG put back: its
        # first record is that run's.
        unbroken, resumed = (
            masks(layouts, rank, s)[1:] for s in ("pp-dropout", "pp-dropout-resumed")
        )
        per = len(unbroken) // 4
        assert resumed == steps_of(unbroken, per, range(3, 5))
        assert steps_of(unbroken, per, range(1, 2)) != steps_of(unbroken, per, range(2, 3))


def test_a_pipeline_checkpoint_has_the_unsplit_names_and_initial_loads_work(layouts):
    """The PP 2 x DP 2 checkpoint's model entries are exactly the unsplit model's (its HF
    export has every weight), and a PP 2 x DP 2 model started from the FSDP 4 checkpoint
    (initial_load_path) holds exactly its weights on every stage. Negative control:
    before the load it did not."""
    assert (layouts.out / "pp-hf" / "config.json").exists()
    for rank in range(4):
        assert layouts.records[rank]["pp_names"] == []
        assert layouts.records[rank]["pp_initial_load"] == [True, False]


# ---- initial weights, HF export, errors -----------------------------------------------------


def test_initial_loads_and_hf_export_from_a_tp_checkpoint(layouts):
    """A TP model started from a TP checkpoint (dcp: each rank reads its shard, resharded
    by DCP) and from the HF export of that checkpoint (hf: rank 0 reads and sends) holds
    exactly the checkpoint's weights. Negative control: before the load it did not."""
    assert (layouts.out / "hf" / "config.json").exists()
    for rank in range(4):
        assert layouts.records[rank]["initial_loads"] == [["dcp", True, False], ["hf", True, False]]


def test_a_layout_that_cannot_be_is_one_line_on_every_rank(layouts):
    """train.main on 2 ranks with TP degree 4 (degrees that do not make the world), and
    with seq_len 33 under sequence parallel: each rank prints one error line naming the
    key and the fix, and no traceback."""
    for rank in range(4):
        status, text = layouts.records[rank]["errors"]
        lines = text.strip().splitlines()
        assert status == 1 and len(lines) == 1 and "Traceback" not in text, text
        assert lines[0].startswith(f"[rank{rank % 2}] error: ")
        wanted = "parallelism.tensor_parallel_degree 4" if rank < 2 else "training.seq_len 33"
        assert wanted in lines[0]


def test_layout_config_errors_name_the_key_and_the_fix():
    """Degrees that do not make the world size, DDP with TP or HSDP, shard degree 0, TP
    with compile, and a model or sequence that does not split: one ConfigError line
    each, before anything is built (the degrees need only the world size)."""
    four = parallel.ParallelDims(0, 4, 0, torch.device("cpu"), "gloo")

    def layout_error(fragment: str, *argv):
        with pytest.raises(ConfigError, match=re.escape(fragment)):
            parallel.apply_layout(four, parse_args([*CONFIG, *map(str, argv)]))

    layout_error("= 8, not the world size 4",
                 "--parallelism.data_parallel_shard_degree", 4,
                 "--parallelism.tensor_parallel_degree", 2)  # fmt: skip
    layout_error("world size 4 is not a multiple", "--parallelism.tensor_parallel_degree", 3)
    dims = parallel.apply_layout(four, parse_args([*CONFIG, "--parallelism.tensor_parallel_degree", "2"]))  # fmt: skip
    assert (dims.dp_world, dims.dp_shard, dims.tp, dims.dp_rank, dims.tp_rank) == (2, 2, 2, 0, 0)
    for argv, fragment in (
        (["--parallelism.tensor_parallel_degree", "2", "--training.data_parallel", "ddp"],
         "--training.data_parallel fsdp"),
        (["--parallelism.data_parallel_replicate_degree", "2", "--training.data_parallel", "ddp"],
         "is HSDP, an FSDP layout"),
        (["--parallelism.data_parallel_shard_degree", "0"], "or -1 for the world size"),
        (["--parallelism.tensor_parallel_degree", "2", "--training.compile"],
         "do not give the eager gradients"),
        (["--parallelism.tensor_parallel_degree", "2", "--training.mask_document_boundaries"],
         "is not supported yet"),
    ):  # fmt: skip
        with pytest.raises(ConfigError, match="parallelism") as e:
            parse_args([*CONFIG, *argv])
        assert fragment in str(e.value)
    args = llama_configs["debugmodel"]  # n_heads 4, n_kv_heads 2, vocab set below
    with pytest.raises(ConfigError, match=r"n_kv_heads 2 of model flavor 'debugmodel'; use a degree among \[1, 2\]"):  # fmt: skip
        tensor_parallel.check_fits(_with_vocab(args, 4096), 4, 128, True, "debugmodel")
    with pytest.raises(ConfigError, match="vocabulary 4097"):
        tensor_parallel.check_fits(_with_vocab(args, 4097), 2, 128, True, "debugmodel")
    with pytest.raises(ConfigError, match="--parallelism.sequence_parallel false"):
        tensor_parallel.check_fits(_with_vocab(args, 4096), 2, 127, True, "debugmodel")
    tensor_parallel.check_fits(_with_vocab(args, 4096), 2, 127, False, "debugmodel")


def test_pipeline_layouts_that_cannot_work_are_one_line_each():
    """Pipeline parallel: what it cannot be combined with (yet) is refused at parse time;
    layers that do not divide into the stages, split points that do not fit, micro-batches
    too few to fill the pipeline (or not a multiple of it, interleaved), and a global
    batch that does not split evenly over the data-parallel ranks, where the pipeline is
    built: one ConfigError each, naming the key and the fix. Negative control: a layout
    that fits gives its stages' layers."""
    from torchtitan.data.schedule import BatchSchedule
    from torchtitan.parallel import pipeline

    pp2 = ["--parallelism.pipeline_parallel_degree", "2"]
    for argv, fragment in (
        (["--training.data_parallel", "ddp"], "use --training.data_parallel fsdp"),
        (["--validation.enable"], "no forward-only schedule yet"),
        (["--model.attention_mask", "block_causal"], "do not cross stages yet"),
        (["--parallelism.tensor_parallel_degree", "2"], "--parallelism.loss_parallel false"),
    ):  # fmt: skip
        with pytest.raises(ConfigError, match="with parallelism.pipeline_parallel_degree 2") as e:
            parse_args([*CONFIG, *pp2, *argv])
        assert fragment in str(e.value)
    with pytest.raises(ConfigError, match="2 layers, not divisible into 4 pipeline stages"):
        pipeline.stage_layers(2, 4, [], "debugmodel")
    with pytest.raises(ConfigError, match=r"split_points \[3, 2\] must increase strictly"):
        pipeline.stage_layers(4, 3, [3, 2], "debugmodel_4layers")
    with pytest.raises(ConfigError, match="has 1 points for 3 stages; give 2"):
        pipeline.stage_layers(4, 3, [1], "debugmodel_4layers")
    assert pipeline.stage_layers(4, 3, [1, 3], "x") == [range(0, 1), range(1, 3), range(3, 4)]
    assert pipeline.stage_layers(4, 2, [], "x") == [range(0, 2), range(2, 4)]
    with pytest.raises(ConfigError, match="3 pipeline micro-batches a step for 4 pipeline ranks"):
        pipeline.micro_batches(3, 1, 4, "1F1B")
    with pytest.raises(ConfigError, match="need a multiple of 2"):
        pipeline.micro_batches(6, 2, 4, "Interleaved1F1B")
    with pytest.raises(ConfigError, match="do not split into pipeline micro-batches of"):
        pipeline.micro_batches(6, 4, 2, "1F1B")
    assert pipeline.micro_batches(8, 2, 4, "Interleaved1F1B") == 4
    stages = pipeline.Pipeline([None], "1F1B", 1, None, 2, 0)
    with pytest.raises(ConfigError, match="does not split evenly over 2 data-parallel ranks"):
        pipeline.check_batches(BatchSchedule([(0, 8), (4, 9)], 4, 2), stages, 2)
    pipeline.check_batches(BatchSchedule([(0, 8), (4, 12)], 4, 2), stages, 2)


def _with_vocab(args, vocab: int):
    from dataclasses import replace

    return replace(args, vocab_size=vocab)


# ---- process groups under faults: timeouts, broken collectives, restarts ------------------


def test_comm_timeouts_reach_every_process_group(monkeypatch):
    """``[comm]``: the init timeout is every group's until the first step, then the train
    timeout (a one-rank gloo job in this process: the groups are real)."""
    from torchtitan import parallel
    from torchtitan.config import parse_args
    from torchtitan.tools.launch import free_port

    status, log = run_main([*CONFIG, "--comm.train_timeout_seconds", 0])
    assert status == 2 and "comm.train_timeout_seconds" in log
    cfg = parse_args([*CONFIG, "--comm.init_timeout_seconds", "7",
                      "--comm.train_timeout_seconds", "3"])  # fmt: skip
    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(free_port())).items():  # fmt: skip
        monkeypatch.setenv(key, value)
    dims = parallel.init_distributed(cfg.comm.init_timeout_seconds)
    try:

        def timeouts() -> list[float]:
            groups = parallel.process_groups(dims)
            assert len(groups) == 3  # the default, checkpoint and control groups
            return [g._get_backend(torch.device("cpu")).options._timeout.total_seconds()
                    for g in groups]  # fmt: skip

        assert timeouts() == [7, 7, 7]
        dims = parallel.apply_layout(dims, cfg)
        assert timeouts() == [7, 7, 7]
        parallel.set_timeout(dims, cfg.comm.train_timeout_seconds)
        assert timeouts() == [3, 3, 3]
    finally:
        parallel.destroy_distributed()


def test_a_broken_collective_names_the_ranks_that_did_not_answer():
    """Through a real store: ranks that saw the collective break say so; the silent one is
    named, and a reported failure is passed on instead."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from torchtitan import parallel

    store = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5))
    ranks = [parallel.ParallelDims(r, 3, r, torch.device("cpu"), "gloo", store=store)
             for r in range(3)]  # fmt: skip
    timed_out = RuntimeError(
        "[/x/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms for recv "
        "operation to complete"
    )
    assert parallel.collective_broke(timed_out) and not parallel.collective_broke(ValueError())
    store.set(f"torchtitan/saw_collective_break/0/{2}", "1")  # rank 2 answered
    line = parallel.why_collective_broke(ranks[0], timed_out, wait_s=0.2)
    assert line.startswith("rank 1 stopped answering: a collective failed (Timed out waiting")
    store.set(f"torchtitan/saw_collective_break/0/{1}", "1")
    assert parallel.why_collective_broke(ranks[0], timed_out, wait_s=0.2) is None  # all did
    parallel.report_failure(ranks[2], "disk full")
    assert parallel.why_collective_broke(ranks[1], timed_out) == "rank 2 failed: disk full"


def test_a_torchrun_restart_stops_at_once_with_one_line(monkeypatch):
    """torchrun's own restarts (--max-restarts) cannot form the process groups again
    (README): a restarted rank says so in one line instead of failing later."""
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    status, log = run_main(CONFIG)
    assert status == 1 and "--max-restarts 0" in error_lines(log)[0]
    assert "Traceback" not in log
