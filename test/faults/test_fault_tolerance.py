"""Live fault tolerance (torchtitan/faults/fault_tolerance.py): the section's one-line errors,
the split of a step over its participants, and, in the slow tier, replica groups that
die, train on, heal and rejoin, with every committed step's tokens read exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import CONFIG, REPO, error_lines, losses, run_main, shim_env, torchrun

from torchtitan.config import parse_args
from torchtitan.data import build_dataloader
from torchtitan.data.tokenizer import build_tokenizer
from torchtitan.faults.fault_tolerance import split_loader
from torchtitan.records.provenance import (
    check_exactly_once,
    read_job_provenance,
    read_provenance,
    sequences_by_step,
)
from torchtitan.tools.launch import launcher_workers, run_env

pytest.importorskip("torchft")


# ---- the section ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra, says",
    [
        ([], "needs a lighthouse"),
        (["--fault_tolerance.lighthouse", "http://h:1", "--fault_tolerance.replica_id", "2"],
         "fault_tolerance.replica_id 2 is not below fault_tolerance.replica_groups 2"),
        (["--fault_tolerance.lighthouse", "http://h:1", "--fault_tolerance.min_replica_groups",
          "3"], "fault_tolerance.min_replica_groups 3 is above"),
        (["--fault_tolerance.lighthouse", "http://h:1", "--parallelism.pipeline_parallel_degree",
          "2"], "parallelism.pipeline_parallel_degree 2 with fault_tolerance.enable"),
        (["--fault_tolerance.lighthouse", "http://h:1", "--training.mask_document_boundaries"],
         "training.mask_document_boundaries with fault_tolerance.enable"),
    ],
)  # fmt: skip
def test_a_section_that_does_not_fit_is_one_line(extra, says, monkeypatch):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    status, log = run_main([*CONFIG, "--fault_tolerance.enable", *extra])
    assert status != 0
    lines = error_lines(log)
    assert len(lines) == 1 and says in lines[0], log[-2000:]
    assert "Traceback" not in log


def test_without_torchft_the_section_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchft", None)  # import torchft raises ImportError
    status, log = run_main([*CONFIG, "--fault_tolerance.enable"])
    lines = error_lines(log)
    assert status != 0 and len(lines) == 1 and 'pip install -e ".[ft]"' in lines[0], log
    # negative control: the same config without the section is accepted
    parse_args([*CONFIG])


# ---- the lighthouse ------------------------------------------------------------------------


def _port_nobody_listens_on() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_lighthouse_is_one_line_within_the_quorum_timeout(tmp_path):
    """The group's manager cannot reach the lighthouse: one FaultToleranceError (a user
    error: one line, no traceback) naming the address and the setting, within
    fault_tolerance.quorum_timeout_seconds (1 s here), not torchft's own 30 s."""
    from torchtitan import parallel
    from torchtitan.faults.fault_tolerance import FaultToleranceError, _torchft_manager

    address = f"http://127.0.0.1:{_port_nobody_listens_on()}"
    cfg = parse_args([*CONFIG, "--fault_tolerance.enable", "--fault_tolerance.lighthouse",
                      address, "--fault_tolerance.quorum_timeout_seconds", "1",
                      "--job.dump_folder", str(tmp_path)])  # fmt: skip
    dims = parallel.ParallelDims(0, 1, 0, torch.device("cpu"), "gloo")
    begin = time.monotonic()
    with pytest.raises(FaultToleranceError) as e:
        _torchft_manager(cfg, dims, None, None)
    took = time.monotonic() - begin
    line = str(e.value)
    assert address in line and "fault_tolerance.quorum_timeout_seconds 1" in line, line
    assert "\n" not in line and took < 5, took
    import train as train_script

    assert issubclass(FaultToleranceError, train_script.USER_ERRORS)  # said as one line
    # negative control: a lighthouse that listens is reached
    from torchtitan.tools.ft_launch import start_lighthouse

    server = start_lighthouse()
    try:
        cfg.fault_tolerance.lighthouse = server.address()
        manager, store = _torchft_manager(cfg, dims, None, None)
        manager.shutdown(wait=False)
    finally:
        server.shutdown()


def test_a_group_that_cannot_reach_its_lighthouse_leaves_no_lease(tmp_path):
    """train.py with checkpoints on and no lighthouse listening: the one line, within the
    quorum timeout, and the folder's lease (taken before the manager is built) released
    (the campaign's trial 950018 found it left; the next start took it over as stale).
    Negative control: the lease is taken before the lighthouse is asked."""
    from helpers import error_lines, train_here

    import train as train_script

    dump = tmp_path / "job" / "replica_0"
    address = f"http://127.0.0.1:{_port_nobody_listens_on()}"
    args = ["--fault_tolerance.enable", "--fault_tolerance.lighthouse", address,
            "--fault_tolerance.quorum_timeout_seconds", 1, "--checkpoint.enable_checkpoint",
            "--fault_tolerance.replica_id", 0, "--fault_tolerance.replica_groups", 2]  # fmt: skip
    taken = []
    real = train_script.CheckpointManager

    def manager(*a, **k):
        m = real(*a, **k)
        taken.append((dump / "checkpoint" / "lease.json").exists())
        return m

    train_script.CheckpointManager = manager
    try:
        status, log = train_here(dump, *args, expect_ok=False)
    finally:
        train_script.CheckpointManager = real
    assert status == 1 and "cannot reach the lighthouse" in error_lines(log)[0], log[-2000:]
    assert taken == [True], "the lease is held while the lighthouse is asked"
    assert not (dump / "checkpoint" / "lease.json").exists(), "the lease was left behind"


def test_a_groups_relaunch_keeps_one_record_per_step_of_its_timeline(tmp_path):
    """train.py as one replica group on a real lighthouse: steps 1-4 (step-2 and step-4
    written), then a relaunch from step-2 (``checkpoint.load_step``, a new branch) that
    trains 3-4 again. Its metrics, provenance and tries hold each step once, steps 3-4
    of the new branch: the loop trims them at the group's first commit
    (``ReplicaGroup.on_timeline``, not at its start). Catches the trim not wired into
    the loop (the first life's steps 3-4 kept: each read twice). Both lives run in one
    child interpreter and the lighthouse in a process of its own: torchft's threads
    (its runtime, its HTTP server) stay out of this test worker, whose later tests fork
    ranks (a fork beside them can inherit a held lock and hang)."""
    from harness.campaign import LighthouseProcess

    server = LighthouseProcess(tmp_path / "lighthouse.log")
    dump = tmp_path / "job" / "replica_0"
    args = [*CONFIG, "--job.dump_folder", dump, "--fault_tolerance.enable",
            "--fault_tolerance.lighthouse", server.address(), "--fault_tolerance.replica_id",
            0, "--fault_tolerance.replica_groups", 1, "--metrics.data_provenance",
            "--checkpoint.enable_checkpoint", "--checkpoint.interval", 2, "--training.steps",
            4, "--training.seq_len", 15, "--training.batch_size", 2]  # fmt: skip
    lives = ("import sys, train; a = sys.argv[1:]; "
             "sys.exit(train.main(a) or train.main(a + ['--checkpoint.load_step', '2']))")  # fmt: skip
    try:
        proc = subprocess.run([sys.executable, "-c", lives, *map(str, args)], cwd=REPO,
                              env=run_env(), capture_output=True, text=True, timeout=120)  # fmt: skip
    finally:
        server.shutdown()
    assert proc.returncode == 0, proc.stderr[-4000:]

    def lines(path):
        return [json.loads(line) for line in path.read_text().splitlines()]

    for path in (dump / "metrics.jsonl", dump / "provenance" / "rank0.jsonl",
                 dump / "provenance" / "tried_rank0.jsonl"):  # fmt: skip
        records = lines(path)
        assert [r["step"] for r in records] == [1, 2, 3, 4], (path, records)
        assert records[1]["branch"] != records[2]["branch"] == records[3]["branch"], path


def test_a_lighthouse_that_dies_mid_run_is_one_line_within_the_quorum_timeout(tmp_path):
    """The real ReplicaGroup on the real torchft Manager and lighthouse commits a step;
    then the lighthouse's host dies (its port relayed, and the relay cut: nobody listens,
    every connection reset). The next step's quorum fails within
    fault_tolerance.quorum_timeout_seconds (0.5 s) as one FaultToleranceError line naming
    the address and the setting, no hang. Negative control: the step before the cut, on
    the same relay, is committed. Catches: the quorum's error said without the address
    or the setting, or torchft's own exception let through (a traceback)."""
    from harness.ft_quorum import Relay
    from torchtitan import parallel
    from torchtitan.checkpoint import TrainState
    from torchtitan.faults.fault_tolerance import FaultToleranceError, ReplicaGroup
    from torchtitan.tools.ft_launch import start_lighthouse

    server = start_lighthouse()
    relay = Relay(server.address())
    cfg = parse_args([*CONFIG, "--fault_tolerance.enable", "--fault_tolerance.lighthouse",
                      relay.address, "--fault_tolerance.quorum_timeout_seconds", "0.5",
                      "--fault_tolerance.replica_groups", "1", "--job.dump_folder", str(tmp_path),
                      "--training.seq_len", "15", "--training.batch_size", "2"])  # fmt: skip
    dims = parallel.ParallelDims(0, 1, 0, torch.device("cpu"), "gloo")
    loader = build_dataloader(cfg, build_tokenizer(cfg.model), 0, 1)
    model = torch.nn.Linear(2, 1, bias=False)
    group = ReplicaGroup(cfg, dims, loader, {}, model, TrainState())
    try:
        group.next_step()
        model(torch.ones(2)).sum().backward()
        assert group.commit(torch.tensor(1.0))  # negative control: a live lighthouse
        relay.cut()
        begin = time.monotonic()
        with pytest.raises(FaultToleranceError) as e:
            group.next_step()
        took = time.monotonic() - begin
    finally:
        group.close()
        server.shutdown()
    line = str(e.value)
    assert relay.address in line and "fault_tolerance.quorum_timeout_seconds 0.5" in line, line
    assert "Timeout expired" in line and "\n" not in line and took < 2, took


@pytest.mark.slow
def test_an_unreachable_lighthouse_stops_the_run_with_one_line():
    address = f"http://127.0.0.1:{_port_nobody_listens_on()}"
    status, log = run_main([*CONFIG, "--fault_tolerance.enable", "--fault_tolerance.lighthouse",
                            address, "--fault_tolerance.quorum_timeout_seconds", "2"])  # fmt: skip
    lines = error_lines(log)
    assert status == 1 and len(lines) == 1 and address in lines[0], log[-2000:]
    assert "Traceback" not in log


# ---- the split ----------------------------------------------------------------------------


def _step_windows(loader) -> list[list[int]]:
    return [row.tolist() for b in loader.next_step() for row in b["input"]]


@pytest.mark.parametrize("schedule", ["", "0:6,3:9"])
def test_a_step_reads_the_same_windows_whatever_its_participants(schedule):
    """Participants per step change (2, 1, 2, 3, 1, ...); each step's windows, over its
    participants in order, are the one-rank loader's, and the loss weights sum to the
    ranks (so the averaged gradient is the global batch's mean)."""
    argv = [*CONFIG, "--training.seq_len", "15", "--training.batch_size", "2",
            "--training.global_batch_size", "6", "--training.batch_size_schedule", schedule]  # fmt: skip
    cfg = parse_args(argv)
    tokenizer = build_tokenizer(cfg.model)
    plain = build_dataloader(cfg, tokenizer, 0, 1)
    counts = [2, 1, 2, 3, 1, 1, 2]
    groups = [build_dataloader(cfg, tokenizer, 0, 1) for _ in range(3)]
    for step, n in enumerate(counts):
        expected = _step_windows(plain)
        got = []
        for p in range(n):
            split_loader(groups[p], p, n, 0, 1)
            batches = groups[p].next_step()
            got += [row.tolist() for b in batches for row in b["input"]]
            size = groups[p].last_global_batch
            # weight / ranks = the micro-batch's share of the global batch: the mean
            # gradient over ranks is the global batch's
            assert all(b["loss_weight"] == n * b["input"].shape[0] / size for b in batches)
        assert got == expected, f"step {step + 1} with {n} participants"
        # the groups that sat this step out are moved on to the step's position (a heal)
        for g in groups[n:]:
            g.load_state_dict(groups[0].state_dict())
        for g in groups[1:n]:
            assert g.position.windows == groups[0].position.windows


def test_an_uncommitted_step_is_read_again():
    """The rewind the commit makes (seek to where the step began, and its step number)
    gives the same windows again; without it the retry would read the next step's."""
    cfg = parse_args([*CONFIG, "--training.seq_len", "15", "--training.batch_size", "2"])
    loader = build_dataloader(cfg, build_tokenizer(cfg.model), 0, 1)
    loader.next_step()
    before = (loader.position.copy(), loader.step)
    first = _step_windows(loader)
    loader.seek(before[0])
    loader.set_step(before[1])
    assert _step_windows(loader) == first
    assert _step_windows(loader) != first  # negative control: no rewind, other windows


def test_a_healed_group_judges_spikes_as_its_peers():
    """A group that heals receives the spike check's window and counters with the rest
    (HEALED), through the same _local / _fill as the model's: afterwards it would drop
    the steps its peers drop. Negative control: a group without them misses the spike."""
    from torchtitan.checkpoint import TrainState
    from torchtitan.faults.fault_tolerance import HEALED, _fill, _local
    from torchtitan.parallel import ParallelDims
    from torchtitan.spikes import SpikeGuard

    cfg = parse_args(["--training.spike_window", "4", "--training.on_spike", "skip_step"])
    dims = ParallelDims(0, 1, 0, torch.device("cpu"), "gloo")
    peer, joined, fresh = (SpikeGuard(cfg, dims, TrainState()) for _ in range(3))
    for value in (3.0, 3.01, 2.99, 3.0):
        peer.decide(torch.tensor(value), torch.tensor(1.0), [])
    assert "spikes" in HEALED
    joined.load_state_dict(_fill(joined.state_dict(), _local(peer.state_dict())))
    assert joined.losses == peer.losses
    spike = (torch.tensor(4.0), torch.tensor(1.0), [])  # decide: a device flag, read here
    assert not peer.decide(*spike) and not joined.decide(*spike)
    assert fresh.decide(*spike)


def test_a_heal_that_fails_inside_the_quorum_is_named_not_blamed_on_the_lighthouse():
    """torchft runs the heal inside start_quorum and raises its error from there: the
    one line names the failed heal. Negative control: a quorum that timed out (no heal
    failed) names the lighthouse and the setting."""
    import threading

    from torchtitan.faults.fault_tolerance import ReplicaGroup

    group = ReplicaGroup.__new__(ReplicaGroup)
    group.cfg = parse_args(CONFIG)
    group.replica_id, group.lighthouse = 1, "http://h:1"
    group._heal_lock, group._gave_up, group._heal_failed = threading.Lock(), False, None
    timeout = TimeoutError("Timeout expired")
    assert "the lighthouse http://h:1 did not answer" in str(group._no_quorum(timeout))

    def broken(state):
        raise KeyError("model.layers.0.attention.wq.weight")

    group._load_healed = broken
    with pytest.raises(KeyError) as raised:
        group._heal({})
    line = str(group._no_quorum(raised.value))
    assert "replica group 1: healing from a live peer failed (KeyError: " in line, line
    assert "lighthouse" not in line and "\n" not in line


def test_a_quorum_is_named_by_its_members_not_only_its_number():
    """The records match a dead group's try with its peers' commit by quorum
    (provenance.read_job_provenance); a new lighthouse (a relaunched job) numbers its
    quorums from 1 again, so the name holds the members too (torchft's uuid per
    Manager): the same members in any order give one name, a restarted member another.
    Negative control: the number alone is the same for both."""
    from torchtitan.faults.fault_tolerance import quorum_key

    first = ["replica_0:aa11", "replica_1:bb22"]
    assert quorum_key(1, first) == quorum_key(1, first[::-1])
    again = ["replica_0:aa11", "replica_1:cc33"]  # group 1 started again
    assert quorum_key(1, again) != quorum_key(1, first)
    assert quorum_key(2, first) != quorum_key(1, first)


def test_a_tensor_parallel_rank_heals_its_own_loader():
    """Under TP inside a group, a checkpoint keeps each data-parallel rank's loader entry
    from its first TP rank only; a heal goes rank to rank, so the joiner's TP rank 1
    needs the position from the peer's TP rank 1: peer_state carries every rank's own,
    and the joiner reads the peer's next windows. Negative control: the checkpoint's
    view of that rank (what a heal sent before) holds no position."""
    from torchtitan.checkpoint import TrainState
    from torchtitan.checkpoint.stateful import training_components
    from torchtitan.faults.fault_tolerance import load_peer_state, peer_state
    from torchtitan.parallel import ParallelDims

    cfg = parse_args(CONFIG)
    tokenizer = build_tokenizer(cfg.model)
    tp_rank_1 = ParallelDims(1, 2, 1, torch.device("cpu"), "gloo", tp=2)
    assert (tp_rank_1.tp_rank, tp_rank_1.dp_rank) == (1, 0)

    def rank(steps: int):
        loader = build_dataloader(cfg, tokenizer, 0, 1)
        for _ in range(steps):
            loader.next_step()
        model = torch.nn.Linear(2, 2)
        components = training_components(
            cfg, tp_rank_1, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            dataloader=loader, train_state=TrainState(step=steps), fingerprint={},
        )  # fmt: skip
        return loader, components

    peer, peer_components = rank(3)
    joiner, joiner_components = rank(0)
    assert peer_components["dataloader"].state_dict() == {}  # the checkpoint's view
    load_peer_state(joiner_components, peer_state(peer_components))
    assert _step_windows(joiner) == _step_windows(peer)


def test_torchfts_report_of_an_error_it_survives_is_one_line():
    """torchft logs a peer's death in the middle of a collective with its traceback
    (``_logger.exception``); the step is not committed and tried again, which the loop
    says: the report keeps its line, not the traceback. Negative control: a logger the
    filter is not on prints the traceback."""
    import io
    import logging

    from torchtitan.faults.fault_tolerance import one_line_torchft_errors

    one_line_torchft_errors()
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    for name in ("torchft.manager", "torchft.elsewhere"):
        log = logging.getLogger(name)
        log.addHandler(handler)
        try:
            raise RuntimeError("Connection closed by peer")
        except RuntimeError as e:
            log.exception(f"[replica_0/0 - step 3] got exception waiting for work {e}")
        finally:
            log.removeHandler(handler)
    text = out.getvalue()
    first, rest = text.split("Connection closed by peer", 1)[0], text.split("\n", 1)[1]
    assert "got exception waiting for work" in first and "Traceback" not in first
    assert "Traceback" in rest, "the control logger keeps its traceback"


# ---- live recovery (slow tier) ------------------------------------------------------------

STEPS, KILL_AT, PAUSE_AT = 14, 5, 9

# The probe around the real code (never a stand-in): group 1's first life kills itself
# mid-step KILL_AT (after backward, before the cross-group all-reduce); each group holds
# before its first step until the other's manager is up (so neither trains alone first,
# on a loaded machine either: a lone group 1's commits would die with it, and group 0
# would train those steps again), and group 0 at PAUSE_AT until the restarted group 1's
# is, so the rejoin happens mid-run on any machine; every group saves its final
# weights; FT_PER_GROUP replaces the split by torchft's own sampler's (a fixed shard
# per group), the negative control.
SHIM = """
import os, signal, time
from torchtitan.faults import fault_tolerance as ft
_init, _next, _commit, _close = (ft.ReplicaGroup.__init__, ft.ReplicaGroup.next_step,
                                 ft.ReplicaGroup.commit, ft.ReplicaGroup.close)
HOLD = dict(x.split("=") for x in os.environ.get("FT_HOLD", "").split(",") if x)
def __init__(self, *a, **k):
    _init(self, *a, **k)
    if os.environ.get("FT_UP_FLAG"):
        open(os.environ["FT_UP_FLAG"], "w").close()
def next_step(self):
    flag = HOLD.get(str(self.train_state.step))
    while flag and not os.path.exists(flag):
        time.sleep(0.05)
    batches = _next(self)
    if os.environ.get("FT_PIDS") and self.dims.rank == 0:  # the loader's workers, each try
        with open(os.environ["FT_PIDS"], "a") as f:
            print(*sorted(self.loader.worker_pids()), file=f)
    return batches
def commit(self, loss):
    if os.environ.get("FT_KILL_AT") and self.train_state.step + 1 >= int(os.environ["FT_KILL_AT"]):
        os.kill(os.getpid(), signal.SIGKILL)
    return _commit(self, loss)
def close(self):
    import torch
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
             for k, v in get_model_state_dict(self.model).items()}
    if self.dims.rank == 0:
        torch.save(state, os.path.join(self.cfg.job.dump_folder, "final_weights.pt"))
    _close(self)
if os.environ.get("FT_PER_GROUP"):
    ft.ReplicaGroup.participation = lambda self: (self.replica_id, self.cfg.fault_tolerance.replica_groups)
ft.ReplicaGroup.__init__, ft.ReplicaGroup.next_step = __init__, next_step
ft.ReplicaGroup.commit, ft.ReplicaGroup.close = commit, close
"""

ARGS = [*CONFIG, "--training.steps", STEPS, "--training.global_batch_size", 8,
        "--training.batch_size", 2, "--training.seq_len", 64, "--lr_scheduler.warmup_steps", 2,
        "--metrics.data_provenance", "--metrics.log_freq", 1]  # fmt: skip


# The live scenario's run also validates every 3 steps (held-out data, 2 batches a rank)
# and saves every 4 steps with async saves (the lowest group only): group 1 dies during
# step 5, while group 0's step-4 save may still be written.
LIVE = [*ARGS, "--validation.enable", "--validation.freq", 3, "--validation.steps", 2,
        "--checkpoint.enable_checkpoint", "--checkpoint.interval", 4,
        "--checkpoint.async_mode", "async"]  # fmt: skip
SAVED = [4, 8, 12, STEPS]


def _wait(proc, what: str, timeout: float = 300) -> int:
    try:
        return proc.wait(timeout=timeout)
    except Exception:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise AssertionError(f"{what} did not finish") from None


def _faulted_run(tmp, nproc: int, per_group: bool, tp: int = 1) -> dict:
    """2 groups of ``nproc`` ranks, each rank with ``nproc`` loader workers; group 1 dies
    at KILL_AT, group 0 trains on alone, group 1 starts again and heals; returns the
    folders of the three lives."""
    args = [*LIVE, "--training.num_workers", nproc, "--parallelism.tensor_parallel_degree", tp]
    from torchtitan.tools.ft_launch import group_command, start_group, start_lighthouse

    server = start_lighthouse()
    shim = shim_env(tmp / "shim", SHIM, **({"FT_PER_GROUP": "1"} if per_group else {}))
    up0, up1, rejoined = tmp / "up0.flag", tmp / "up1.flag", tmp / "rejoined.flag"
    # The job's groups live in <job>/replica_<i> (where a group that saves must: its peers
    # look for its checkpoints there); group 1's second life in another job folder, so
    # that its first life's records stay (it heals from group 0 live, not from disk).
    lives = {"g0": tmp / "job" / "replica_0", "g1": tmp / "job" / "replica_1",
             "g1_again": tmp / "again" / "replica_1"}  # fmt: skip
    try:
        g0 = start_group(
            group_command(0, 2, nproc, server.address(), tmp, args, lives["g0"]),
            tmp / "g0.log",
            {
                **shim,
                "FT_HOLD": f"0={up1},{PAUSE_AT}={rejoined}",
                "FT_UP_FLAG": str(up0),
                "FT_PIDS": str(tmp / "g0_workers.txt"),
            },
        )
        g1 = start_group(group_command(1, 2, nproc, server.address(), tmp, args, lives["g1"]),
                         tmp / "g1.log", {**shim, "FT_KILL_AT": str(KILL_AT),
                                           "FT_UP_FLAG": str(up1), "FT_HOLD": f"0={up0}"})  # fmt: skip
        assert _wait(g1, "group 1") != 0  # SIGKILLed
        # group 0 goes on without a restart: it commits steps alone before the rejoin
        deadline = time.monotonic() + 120
        while not _committed_alone(lives["g0"]) and time.monotonic() < deadline:
            assert g0.poll() is None, (tmp / "g0.log").read_text()[-3000:]
            time.sleep(0.2)
        again = start_group(
            group_command(1, 2, nproc, server.address(), tmp, args, lives["g1_again"]),
            tmp / "g1_again.log", {**shim, "FT_UP_FLAG": str(rejoined)},
        )  # fmt: skip
        assert _wait(g0, "group 0") == 0, (tmp / "g0.log").read_text()[-4000:]
        assert _wait(again, "group 1 again") == 0, (tmp / "g1_again.log").read_text()[-4000:]
    finally:
        server.shutdown()
    return lives


def _committed(folder, step: int) -> bool:
    """Whether ``folder``'s run has logged a step at or past ``step``."""
    path = folder / "metrics.jsonl"
    return path.exists() and any(
        json.loads(line)["step"] >= step for line in path.read_text().splitlines() if line
    )


def _committed_alone(folder) -> bool:
    path = folder / "metrics.jsonl"
    return path.exists() and any(
        json.loads(line)["step"] > KILL_AT for line in path.read_text().splitlines() if line
    )


def _steps_of(*folders) -> dict[int, list]:
    """{step: every group's sequences of that step, sorted}: the committed steps' data."""
    merged: dict[int, list] = {}
    for folder in folders:
        for step, seqs in sequences_by_step(read_provenance(str(folder / "provenance"))).items():
            merged.setdefault(step, []).extend(seqs)
    return {s: sorted(map(json.dumps, seqs)) for s, seqs in merged.items()}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    dump = tmp_path_factory.mktemp("plain")
    proc = torchrun([*LIVE, "--job.dump_folder", dump], nproc=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dump


def _assert_exactly_once(lives, uninterrupted):
    steps = _steps_of(*lives.values())
    expected = _steps_of(uninterrupted)
    assert sorted(steps) == list(range(1, STEPS + 1))
    for step in expected:
        assert steps[step] == expected[step], f"step {step}: not the uninterrupted run's tokens"
    reports = check_exactly_once(read_job_provenance([str(f) for f in lives.values()]))
    assert all(r.duplicate_tokens == 0 and r.gaps == 0 for r in reports.values()), reports


@pytest.mark.slow
@pytest.mark.parametrize("nproc, tp", [(1, 1), (2, 1), (2, 2)], ids=["1", "2", "2-tp"])
def test_a_group_dies_the_other_trains_on_and_it_heals_exactly_once(tmp_path, uninterrupted, nproc,
                                                                     tp):  # fmt: skip
    """2 groups x ``nproc`` ranks (FSDP, or TP ``tp`` inside each group: the all-reduce and
    the heal go rank to rank, each rank healing its own loader), ``nproc`` loader workers a rank, validation and async
    saves on (LIVE). Group 1 dies during step 5, group 0 trains on alone (its split 2 ->
    1, the step retried), group 1 starts again, heals and rejoins (1 -> 2): every
    committed step's tokens are the uninterrupted (0-worker) run's, once; group 0's
    workers are the ones it started with (the changes reached them as requests); both
    groups log the same validation loss; only group 0 saves, and every async save it
    started (one in flight when group 1 died) is complete and verifies."""
    from torchtitan.checkpoint import complete_steps, verify_checkpoint
    from torchtitan.records.runs import validation_losses

    lives = _faulted_run(tmp_path, nproc, per_group=False, tp=tp)
    _assert_exactly_once(lives, uninterrupted)
    # group 0 trained on alone (1 participant) with no restart, and group 1 healed from it
    assert "healed from a live peer" in (tmp_path / "g1_again.log").read_text()
    g0 = losses(lives["g0"])
    assert set(range(KILL_AT, STEPS + 1)) <= set(g0)  # (it may join step 1 or 2 late)
    # Losses: the global batch's mean whoever trained it; 1 and 2 participants sum the
    # gradients in another order, so within 1e-4 relative (fp32), not bit for bit.
    plain = losses(uninterrupted)
    for step, loss in g0.items():
        assert abs(loss - plain[step]) <= 1e-4 * abs(plain[step]), (step, loss, plain[step])
    again = losses(lives["g1_again"])
    for step, loss in again.items():
        assert loss == g0[step], step  # the same all-reduced value on both groups
    w0 = torch.load(lives["g0"] / "final_weights.pt")
    w1 = torch.load(lives["g1_again"] / "final_weights.pt")
    assert w0.keys() == w1.keys() and all(torch.equal(w0[k], w1[k]) for k in w0)
    # Loader workers: started once, never restarted by a change of the participants.
    tries = (tmp_path / "g0_workers.txt").read_text().splitlines()
    assert len(tries) > STEPS and len(set(tries)) == 1 and len(tries[0].split()) == nproc, tries
    # Validation: the same held-out data and weights on both groups, the same loss (==),
    # before the death (step 3), alone (6), after the rejoin (12, 14).
    v0, v1, v1_again = (validation_losses(lives[k]) for k in ("g0", "g1", "g1_again"))
    assert {6, 9, 12, STEPS} <= set(v0) and sorted(v1_again) == [12, STEPS], (v0, v1_again)
    for v in (v1, v1_again):
        assert v == {s: v0[s] for s in v}, (v0, v)
    if nproc == 1:  # the uninterrupted run's held-out batches are the same ones
        for step, loss in validation_losses(uninterrupted).items():
            assert abs(v0[step] - loss) <= 1e-4 * abs(loss), (step, v0[step], loss)
    # Async saves: the lowest group's, each complete; none in group 1's folders.
    folder = str(lives["g0"] / "checkpoint")
    assert complete_steps(folder) == SAVED, complete_steps(folder)
    assert all(verify_checkpoint(f"{folder}/step-{s}") is None for s in SAVED)
    for life in ("g1", "g1_again"):
        ck = lives[life] / "checkpoint"
        assert not ck.exists() or complete_steps(str(ck)) == [], life


@pytest.mark.slow
def test_per_group_sharding_loses_tokens_in_the_same_scenario(tmp_path, uninterrupted):
    """Negative control: torchft's own sampler (a fixed shard per group) in the same
    scenario: the dead group's shard of the steps it missed is never read."""
    lives = _faulted_run(tmp_path, 1, per_group=True)
    with pytest.raises(AssertionError, match="not the uninterrupted run's tokens"):
        _assert_exactly_once(lives, uninterrupted)


# ---- disk checkpoints with fault tolerance (slow tier) -----------------------------------

DISK = [*ARGS, "--checkpoint.enable_checkpoint", "--checkpoint.interval", 3,
        "--fault_tolerance.min_replica_groups", 2]  # fmt: skip


# What a run has on besides training: loader workers, validation, async saves.
BUSY = ["--training.num_workers", 1, "--validation.enable", "--validation.freq", 3,
        "--validation.steps", 2, "--checkpoint.async_mode", "async"]  # fmt: skip


def _both_groups(tmp, name: str, job, *extra, groups: int = 2) -> list[str]:
    """Every group (2, or ``groups``) of 1 rank, in ``<job>/replica_<i>``, every quorum of
    all of them (the lighthouse's min_replicas: the same participants each step, so two
    runs reduce alike), to their end; their logs."""
    from torchtitan.tools.ft_launch import group_command, start_group, start_lighthouse

    server = start_lighthouse(min_replicas=groups)
    shim = shim_env(tmp / "shim", SHIM)
    logs = [tmp / f"{name}_g{i}.log" for i in range(groups)]
    try:
        procs = [start_group(group_command(i, groups, 1, server.address(), job, [*DISK, *extra]),
                             logs[i], shim)
                 for i in range(groups)]  # fmt: skip
        for i, g in enumerate(procs):
            assert _wait(g, f"{name} group {i}") == 0, logs[i].read_text()[-4000:]
    finally:
        server.shutdown()
    return [log.read_text() for log in logs]


@pytest.mark.slow
def test_a_whole_job_restart_with_another_group_count_resumes_from_the_newest_checkpoint(tmp_path):
    """Disk checkpoints with fault tolerance on: only the lowest live group (group 0)
    writes them, every 3 steps and where the job stops (step 7, stop_at_step); group 1's
    folder holds none. The whole job is then started again with 3 groups: every group,
    group 2 (no folder) and group 1 (an empty one) included, loads group 0's step-7 from
    its folder (none waits for a heal), and every step's tokens over both launches are
    an uninterrupted 2-group run's, each once (provenance); the losses of the 3-group
    steps within 1e-4 of it (3 participants sum in another order), the first launch's
    bit-equal, and the 3 groups' final weights ``torch.equal``. (The same relaunch at 2
    groups, bit-equal: the preemption test below.)"""
    from torchtitan.checkpoint import complete_steps
    from torchtitan.tools.ft_launch import group_dump

    ref, job = tmp_path / "ref", tmp_path / "run"
    _both_groups(tmp_path, "ref", ref)
    _both_groups(tmp_path, "first", job, "--training.stop_at_step", 7)
    run = [group_dump(job, i) for i in range(3)]
    assert complete_steps(str(run[0] / "checkpoint"))[-2:] == [6, 7]
    assert not (run[1] / "checkpoint").exists() or complete_steps(str(run[1] / "checkpoint")) == []
    first = {folder: losses(folder) for folder in run[:2]}
    logs = _both_groups(tmp_path, "again", job, groups=3)
    for log in logs:
        loaded = log.split("loaded checkpoint", 1)[1][:300]
        assert f"{run[0] / 'checkpoint' / 'step-7'} " in loaded, log[-3000:]
        assert "healed from a live peer" not in log, log[-3000:]
    refs = [group_dump(ref, i) for i in range(2)]
    expected, steps = _steps_of(*refs), _steps_of(*run)
    assert sorted(steps) == sorted(expected) == list(range(1, STEPS + 1))
    for step in expected:
        assert steps[step] == expected[step], f"step {step}: not the uninterrupted run's tokens"
    plain = losses(refs[0])
    assert all(first[f] == {s: plain[s] for s in range(1, 8)} for f in first), first
    for step, loss in losses(run[2]).items():
        assert abs(loss - plain[step]) <= 1e-4 * abs(plain[step]), (step, loss, plain[step])
    weights = [torch.load(folder / "final_weights.pt") for folder in run]
    assert all(torch.equal(w[k], weights[0][k]) for w in weights[1:] for k in weights[0])


@pytest.mark.slow
def test_a_preemption_reaching_the_groups_100ms_apart_saves_once_and_resumes_bit_equal(tmp_path):
    """SIGTERM to group 0's rank, and 100 ms later to group 1's (a scheduler signalling
    node by node), with fault_tolerance.min_replica_groups 2: the stop is agreed through
    the step's all-reduce, so both groups stop after the same step and exit 0; group 0
    (the lowest) writes that step's checkpoint and group 1, the next, a second copy (the
    job keeps the step where the lowest is killed before its write is durable), each
    logging it; the relaunch (each group from its own copy) equals an uninterrupted run
    bit for bit. The run as users run it: a loader worker a rank, validation every 3
    steps, async saves every 3 (the stop's own save waits for the one in flight).
    (Before: the group
    signalled first left alone, the other waited for a quorum that could not come.)"""
    from torchtitan.checkpoint import complete_steps
    from torchtitan.tools.ft_launch import (
        group_command,
        group_dump,
        kill_group,
        start_group,
        start_lighthouse,
    )

    ref, job = tmp_path / "ref", tmp_path / "run"
    _both_groups(tmp_path, "ref", ref, *BUSY)
    ref, run = [group_dump(ref, 0)], [group_dump(job, i) for i in range(2)]
    groups = []
    server = start_lighthouse(min_replicas=2)
    shim = shim_env(tmp_path / "shim", SHIM)
    logs = [tmp_path / f"signalled_g{i}.log" for i in range(2)]
    try:
        groups += [start_group(group_command(i, 2, 1, server.address(), job, [*DISK, *BUSY]),
                               logs[i], shim) for i in range(2)]  # fmt: skip
        deadline = time.monotonic() + 300
        while not _committed(run[0], 4) and time.monotonic() < deadline:
            assert groups[0].poll() is None, logs[0].read_text()[-3000:]
            time.sleep(0.05)
        for i, group in enumerate(groups):
            for pid in launcher_workers(group.pid):
                os.kill(pid, signal.SIGTERM)
            if i == 0:
                time.sleep(0.1)
        for i, g in enumerate(groups):
            assert _wait(g, f"group {i}", timeout=120) == 0, logs[i].read_text()[-4000:]
    finally:
        for g in groups:
            if g.poll() is None:
                kill_group(g)
                g.wait()
        server.shutdown()
    stopped = [max(losses(folder)) for folder in run]
    assert stopped[0] == stopped[1] < STEPS, stopped
    assert complete_steps(str(run[0] / "checkpoint"))[-1] == stopped[0]
    assert complete_steps(str(run[1] / "checkpoint")) == [stopped[0]]  # the second copy
    said = [log.read_text() for log in logs]
    for text in said:
        assert f"checkpoint step-{stopped[0]} written" in text, text[-3000:]
    _both_groups(tmp_path, "again", job, *BUSY)
    assert losses(run[0]) == losses(ref[0]) and sorted(losses(run[0])) == list(range(1, STEPS + 1))
    from torchtitan.records.runs import validation_losses

    held_out = validation_losses(ref[0])  # before the stop and after the relaunch, the same
    assert sorted(held_out) == [3, 6, 9, 12, STEPS] and validation_losses(run[0]) == held_out
    reference = torch.load(ref[0] / "final_weights.pt")
    for folder in run:
        weights = torch.load(folder / "final_weights.pt")
        assert all(torch.equal(weights[k], reference[k]) for k in reference), folder


# ---- broken steps and spikes with fault tolerance (slow tier) ------------------------------


@pytest.mark.slow
def test_a_broken_step_or_spike_on_one_group_is_dropped_by_both(tmp_path):
    """Group 1 alone makes step 4's loss NaN and step 6's 1000 times larger (a spike under
    on_spike skip_step): the commit averages the gradients and the loss over the groups,
    so both groups drop both steps (bad_steps and spikes counted on both) and end on
    the same weights (``torch.equal``). Negative control: without the faults the final
    weights differ (the dropped steps were real)."""
    from torchtitan.tools.ft_launch import group_command, start_group, start_lighthouse

    extra = ["--training.on_spike", "skip_step", "--training.spike_max_loss", 100,
             "--fault_tolerance.min_replica_groups", 2]  # fmt: skip

    def run(name: str, fault: str) -> list:
        server = start_lighthouse(min_replicas=2)
        shim = shim_env(tmp_path / "shim", SHIM)
        folders = [tmp_path / f"{name}{i}" for i in range(2)]
        logs = [tmp_path / f"{name}_g{i}.log" for i in range(2)]
        try:
            groups = [start_group(group_command(i, 2, 1, server.address(), tmp_path,
                                                [*ARGS, *extra], folders[i]), logs[i],
                                  {**shim, "TORCHTITAN_TEST_FAULT": fault if i else ""})
                      for i in range(2)]  # fmt: skip
            for i, g in enumerate(groups):
                assert _wait(g, f"{name} group {i}") == 0, logs[i].read_text()[-4000:]
        finally:
            server.shutdown()
        return folders

    faulted = run("faulted", "4:nan,6:x1000")
    for folder in faulted:
        last = json.loads((folder / "metrics.jsonl").read_text().splitlines()[-1])
        assert last["bad_steps"] == 1 and last["spikes"] == 1, folder
    weights = [torch.load(f / "final_weights.pt") for f in faulted]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    clean = torch.load(run("clean", "")[0] / "final_weights.pt")
    assert not all(torch.equal(weights[0][k], clean[k]) for k in clean)
