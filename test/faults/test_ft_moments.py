"""A replica group killed at each moment of a step, on the real torchft: the real
``ReplicaGroup`` (torchtitan/faults/fault_tolerance.py) over torchft's ``Manager``, gloo
process group, checkpoint transport and lighthouse, each group and the lighthouse a
process forked from one fresh interpreter (``zygote``). Group 1 SIGKILLs itself (the
test's patch, ``_kill_at``: the product has no hook) at one moment of step KILL_AT:
before its quorum, inside it (the lighthouse answered), in the forward/backward, in
the cross-group all-reduce (its buffer handed to gloo), at the vote (the all-reduce
done), or after its commit and before its update. Group 0 trains on alone; group 1
starts again, heals from group 0 and trains to the end with it.

What is checked, for each moment (``check``):
- **trained once, by the quorum that committed it**: the model is a histogram (a
  weight per token, plain SGD on the sum of the windows' weights times the
  participants, so the all-reduced mean is the sum over the quorum's windows: integers,
  exact in any order). Every group's final weights ``==`` the histogram of an
  uninterrupted run's windows of steps 1..N: no window twice, none skipped, the dead
  group's share of the step it died in counted where group 0 committed it with it.
- **recorded once**: each life's record of a committed step (written after the commit,
  as the loop's provenance is) is its share of the uninterrupted step for (its
  participant index, the participants); each share of each step is recorded once; a
  share without a record is only the dead group's, in the step it died in after its
  all-reduce, and group 0's own ``fault_tolerance.jsonl`` says it committed that step as
  one of the participants that trained it.
- **state**: group 0's and the rejoined group's loader step and position are the
  uninterrupted run's at the last step, and the rejoined group healed.

Each moment's negative control (``PLANTED``) plants a bug in every process of the same
scenario, and the same check fails. All twelve runs go at once, in the first test's
setup: 10-15 s on two cores under a load of 5-8 (about 3 s of it the fresh
interpreter's imports), for the six tests.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import CONFIG

from torchtitan import parallel
from torchtitan.checkpoint import TrainState
from torchtitan.checkpoint.stateful import training_components
from torchtitan.config import parse_args
from torchtitan.data import build_dataloader
from torchtitan.data.tokenizer import build_tokenizer
from torchtitan.records.provenance import read_job_provenance

pytest.importorskip("torchft")

ONE_RANK = parallel.ParallelDims(0, 1, 0, torch.device("cpu"), "gloo")
# Global batch 4, 8 from step 3, 6 from step 6: a rewind's step number one off reads
# another size. Group 1 dies during step KILL_AT; group 0 holds after step HOLD_AT
# until group 1 has started again; the job ends at step STEPS.
SCHEDULE = ["--training.seq_len", "15", "--training.batch_size", "2",
            "--training.batch_size_schedule", "0:4,3:8,6:6"]  # fmt: skip
KILL_AT, HOLD_AT, STEPS = 3, 4, 6
HEARTBEAT_MS = 1000  # how soon the lighthouse leaves a dead group out of a quorum
LIVES = ("g0", "g1", "again")  # group 0, group 1's first life, group 1 started again
MOMENTS = ["before_quorum", "in_quorum", "forward_backward", "allreduce", "vote",
           "after_commit"]  # fmt: skip
# Each moment's negative control: a bug planted in every process of the same scenario,
# which the same check must catch.
PLANTED = {"before_quorum": "stale_split", "in_quorum": "no_rewind",
           "forward_backward": "no_rewind", "allreduce": "own_gradient",
           "vote": "own_gradient", "after_commit": "heal_without_loader"}  # fmt: skip


def _cfg(folder, lighthouse: str, gid: int):
    return parse_args([*CONFIG, *SCHEDULE, "--fault_tolerance.enable",
                       "--fault_tolerance.lighthouse", lighthouse,
                       "--fault_tolerance.replica_id", str(gid),
                       "--fault_tolerance.timeout_seconds", "10",
                       "--fault_tolerance.quorum_timeout_seconds", "30",
                       "--metrics.data_provenance", "--job.dump_folder", str(folder)])  # fmt: skip


class Histogram(torch.nn.Module):
    """One weight per token: its gradient is the count of the token in the windows."""

    def __init__(self, vocab: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(vocab))


def _die():
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_at(replicas, state, moment: str, step: int):
    """Patch this process's ReplicaGroup and torchft Manager so that it SIGKILLs itself
    at ``moment`` of ``step`` (the test's injection: the product has no hook)."""
    manager = replicas.manager
    now = lambda: state.step + 1 == step  # noqa: E731 - the step being tried

    if moment == "before_quorum":
        start = manager.start_quorum

        def start_quorum(*a, **k):
            if now():
                _die()
            return start(*a, **k)

        manager.start_quorum = start_quorum
    elif moment == "in_quorum":  # the lighthouse has answered; before the PG is set up

        class Client:
            def __init__(self, client):
                self._c = client

            def _quorum(self, *a, **k):
                got = self._c._quorum(*a, **k)
                if now():
                    _die()
                return got

            def __getattr__(self, name):
                return getattr(self._c, name)

        manager._client = Client(manager._client)
    elif moment == "allreduce":  # its buffer handed to gloo, not waited for
        allreduce = manager.allreduce

        def dying_allreduce(*a, **k):
            work = allreduce(*a, **k)
            if now():
                _die()
            return work

        manager.allreduce = dying_allreduce
    elif moment == "vote":  # the all-reduce done, before the vote
        vote = manager.should_commit

        def should_commit(*a, **k):
            if now():
                _die()
            return vote(*a, **k)

        manager.should_commit = should_commit


def _group(gid: int, lighthouse: str, folder, out: str, kill: str | None, planted: str | None,
           up: str, peer_up: str | None = None, hold: str | None = None):  # fmt: skip
    """One replica group of one rank in this (forked) process: trains to STEPS (a
    survivor that expects a rejoin, until the rejoined group trained a step with it),
    writing a JSON line per try, per commit and at the end to ``out``."""
    from torchtitan.faults import fault_tolerance, replica_steps
    from torchtitan.records.metrics import ProvenanceWriter

    log = open(out, "a")  # noqa: SIM115 - closed by the process's end

    def write(**fields):
        log.write(json.dumps({**fields, "t": time.time()}) + "\n")
        log.flush()

    _plant(planted, fault_tolerance, replica_steps)
    # The group's store, as torchrun's would be (by address: no name to resolve).
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port))
    cfg = _cfg(folder, lighthouse, gid)
    # the loop's provenance line, written after the update (StepMetrics.report's)
    provenance = ProvenanceWriter(os.path.join(folder, "provenance"), 0, 0, True)
    tokenizer = build_tokenizer(cfg.model)
    loader = build_dataloader(cfg, tokenizer, 0, 1)
    model = Histogram(tokenizer.vocab_size)
    state = TrainState()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    components = training_components(cfg, ONE_RANK, model=model, optimizer=optimizer,
                                     dataloader=loader, train_state=state, fingerprint={})  # fmt: skip
    replicas = fault_tolerance.ReplicaGroup(cfg, ONE_RANK, loader, components, model, state)
    if kill:
        _kill_at(replicas, state, kill, KILL_AT)
    open(up, "w").close()  # its manager is up: the peer may ask for a quorum with it
    while peer_up and not os.path.exists(peer_up):  # neither trains alone at the start
        time.sleep(0.02)
    together = False
    while state.step < STEPS or (hold and not together):
        if hold and state.step == HOLD_AT:
            while not os.path.exists(hold):
                time.sleep(0.02)
            time.sleep(0.2)  # its quorum request is in: the next quorum holds both
        batches = replicas.next_step()
        windows = [row.tolist() for b in batches for row in b["input"]]
        participant, participants = replicas.participant, replicas.participants
        write(kind="try", step=state.step + 1, participant=participant,
              participants=participants, windows=windows)  # fmt: skip
        if kill == "forward_backward" and state.step + 1 == KILL_AT:
            _die()
        optimizer.zero_grad()
        loss = sum(model.weight[b["input"]].sum() for b in batches) * participants
        loss.backward()
        ok = replicas.commit(loss.detach().clone())
        if not ok:
            continue
        if kill == "after_commit" and state.step + 1 == KILL_AT:
            _die()
        optimizer.step()
        state.step += 1
        provenance.write(state.step, [spans for b in batches for spans in b["spans"]])
        together = participants == 2 and state.step > HOLD_AT
        write(kind="commit", step=state.step, participant=participant,
              participants=participants, windows=windows, healed_at=replicas.healed_at)  # fmt: skip
    write(kind="end", step=state.step, loader_step=loader.step,
          position=loader.position.windows, weight=model.weight.detach().tolist())  # fmt: skip
    replicas.close()


def _plant(planted, fault_tolerance, replica_steps):
    """The negative controls: a bug planted in this process's copy of the product."""
    ReplicaGroup = fault_tolerance.ReplicaGroup
    if planted == "no_rewind":  # the rewind of an uncommitted step not run
        replica_steps.StepTry.settle = lambda self, committed: committed
    elif planted == "stale_split":  # the split of the step before, not of this quorum's
        participation = ReplicaGroup.participation

        def stale(self):
            now, before = participation(self), getattr(self, "_before", None)
            self._before = now
            return before or now

        ReplicaGroup.participation = stale
    elif planted == "own_gradient":  # the all-reduced buffer never copied back
        commit = ReplicaGroup.commit

        def own(self, loss):
            allreduce = self.manager.allreduce
            self.manager.allreduce = lambda flat: allreduce(flat.clone())
            try:
                return commit(self, loss)
            finally:
                self.manager.allreduce = allreduce

        ReplicaGroup.commit = own
    elif planted == "heal_without_loader":
        fault_tolerance.HEALED = tuple(h for h in fault_tolerance.HEALED if h != "dataloader")


def _fork(fn, *args) -> int:
    """``fn(*args)`` in a child of this process, which never returns here."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fn(*args)
            code = 0
        except BaseException:  # noqa: BLE001 - said on stderr; the exit code fails the run
            import traceback

            traceback.print_exc()
        finally:
            os._exit(code)
    return pid


def _wait(pid: int, timeout: float) -> int:
    """``pid``'s exit code (minus the signal that ended it); killed after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _lighthouse(conn: int):
    """A lighthouse in this process, its address written to ``conn``, until killed."""
    from torchtitan.tools.ft_launch import start_lighthouse

    server = start_lighthouse(heartbeat_timeout_ms=HEARTBEAT_MS)
    os.write(conn, server.address().encode())
    while True:
        time.sleep(1)


def _scenario(folder: str, moment: str, planted: str | None):
    """Group 0 and group 1 on a lighthouse of their own; group 1 dies at ``moment`` of
    step KILL_AT; once it is dead and group 0 has committed a step alone, it starts again
    (and heals). Each life's records in
    ``<folder>/<life>.jsonl``, the exit codes in ``<folder>/codes.json``."""
    os.makedirs(folder)
    here, there = os.pipe()
    lighthouse = _fork(_lighthouse, there)
    address = os.read(here, 200).decode()
    outs = {k: os.path.join(folder, f"{k}.jsonl") for k in LIVES}
    ups = {k: os.path.join(folder, f"{k}.up") for k in LIVES}

    def group(name, gid, kill=None, peer=None, hold=None):
        return _fork(_group, gid, address, os.path.join(folder, name), outs[name], kill, planted,
                     ups[name], peer and ups[peer], hold and ups[hold])  # fmt: skip

    g0, g1 = group("g0", 0, peer="g1", hold="again"), group("g1", 1, kill=moment, peer="g0")
    codes = {"g1": _wait(g1, 60)}
    deadline = time.monotonic() + 60  # group 0 trains alone before group 1 comes back
    while time.monotonic() < deadline and not any(
        r["kind"] == "commit" and r["participants"] == 1 for r in _records(outs["g0"])
    ):
        time.sleep(0.02)
    again = group("again", 1)
    codes.update(g0=_wait(g0, 60), again=_wait(again, 60))
    os.kill(lighthouse, signal.SIGKILL)
    os.waitpid(lighthouse, 0)
    with open(os.path.join(folder, "codes.json"), "w") as f:
        json.dump(codes, f)


def zygote(folder: str, runs: list):
    """Every run of ``runs`` ([moment, planted]) at once, each in ``<folder>/<i>``, forked
    from this process: a fresh interpreter (started by the test), which loads the data
    once and never runs torchft's Rust runtime itself (a process that did, as a test's
    may have, forks children that crash in it)."""
    import torchft  # noqa: F401 - its modules, loaded once (its runtime is never started here)

    cfg = _cfg(folder, "http://127.0.0.1:1", 0)
    build_dataloader(cfg, build_tokenizer(cfg.model), 0, 1)  # the data, read once
    model = Histogram(1)  # the optimizer's first use loads torch._dynamo: once, here
    model.weight.sum().backward()
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    pids = [_fork(_scenario, os.path.join(folder, str(i)), *run) for i, run in enumerate(runs)]
    code = max(abs(_wait(pid, 120)) for pid in pids)
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown (a second or more of it)


def _records(path) -> list[dict]:
    if not os.path.exists(path):
        return []
    return [json.loads(line) for line in open(path).read().splitlines() if line]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """{(moment, planted): {life: records, "codes": exit codes}} for every moment (no
    planted bug) and every negative control, all run at once in one fresh process."""
    from torchtitan import REPO_ROOT

    folder = tmp_path_factory.mktemp("moments")
    wanted = [(m, None) for m in MOMENTS] + list(PLANTED.items())
    here = os.path.dirname(__file__)
    # Offline: the data is local, and a hub request without a network waits for DNS.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([here, os.path.dirname(here), str(REPO_ROOT)])}  # fmt: skip
    code = f"import test_ft_moments as m; m.zygote({str(folder)!r}, {wanted!r})"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=180)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    out = {}
    for i, run in enumerate(wanted):
        lives = {k: _records(os.path.join(folder, str(i), f"{k}.jsonl")) for k in LIVES}
        with open(os.path.join(folder, str(i), "codes.json")) as f:
            lives["codes"] = json.load(f)
        # group 0's own record of each try (fault_tolerance.jsonl, the product's)
        lives["g0_events"] = _records(os.path.join(folder, str(i), "g0", "fault_tolerance.jsonl"))
        lives["folders"] = [os.path.join(folder, str(i), k) for k in LIVES]
        out[run] = lives
    return out


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The uninterrupted run, step by step past STEPS (a late rejoin ends the job a
    step or two later): each step's windows, and after each step the loader's step and
    position and the histogram trained so far."""
    cfg = _cfg(tmp_path_factory.mktemp("plain"), "http://127.0.0.1:1", 0)
    tokenizer = build_tokenizer(cfg.model)
    loader = build_dataloader(cfg, tokenizer, 0, 1)
    weight = torch.zeros(tokenizer.vocab_size)
    out = {"steps": [], "spans": [], "after": [(0, loader.position.windows, weight.tolist())]}
    for _ in range(STEPS + 4):
        batches = loader.next_step()
        windows = [row.tolist() for b in batches for row in b["input"]]
        out["spans"].append(sorted(json.dumps(spans) for b in batches for spans in b["spans"]))
        weight -= torch.bincount(torch.tensor(windows).reshape(-1),
                                 minlength=tokenizer.vocab_size).float()  # fmt: skip
        out["steps"].append(windows)
        out["after"].append((loader.step, loader.position.windows, weight.tolist()))
    return out


def _share(windows: list, participant: int, participants: int) -> list:
    per = len(windows) // participants
    return windows[participant * per : (participant + 1) * per]


def check(lives: dict, plain: dict):
    """The three properties of the module's docstring; an AssertionError names the first
    that fails."""
    assert lives["codes"] == {"g1": -signal.SIGKILL, "g0": 0, "again": 0}, lives["codes"]
    g1, again = lives["g1"], lives["again"]
    # trained once: every group's weights are the uninterrupted run's histogram
    ends = {k: [r for r in lives[k] if r["kind"] == "end"] for k in ("g0", "again")}
    assert ends["g0"] and ends["again"], "a group did not reach the end"
    end = ends["g0"][0]["step"]
    assert STEPS <= end == ends["again"][0]["step"] < len(plain["after"]), end
    loader_step, position, weight = plain["after"][end]
    for name, (got,) in ends.items():
        assert got["weight"] == weight, f"{name}: not the windows of steps 1..{end} once each"
        # state: the step, the loader's step and position where the plain run's are
        assert (got["loader_step"], got["position"]) == (loader_step, position), name
    # recorded once: each share of each step by one life, and only the dead one's missing
    recorded: dict[int, dict[int, tuple]] = {}
    for name in LIVES:
        for r in lives[name]:
            if r["kind"] != "commit":
                continue
            share = _share(plain["steps"][r["step"] - 1], r["participant"], r["participants"])
            assert r["windows"] == share, f"{name} step {r['step']}: not its share"
            shares = recorded.setdefault(r["step"], {})
            assert r["participant"] not in shares, f"step {r['step']} recorded twice"
            shares[r["participant"]] = (name, r["participants"])
    assert sorted(recorded) == list(range(1, end + 1)), sorted(recorded)
    last_try = [r for r in g1 if r["kind"] == "try"][-1]
    unrecorded = []
    for step, shares in recorded.items():
        participants = {p for _, p in shares.values()}
        assert len(participants) == 1, f"step {step}: {shares}"
        missing = set(range(participants.pop())) - set(shares)
        if missing:  # only the dead group's share of the step it died in, after its
            # all-reduce; the survivor's own record names the share it did not train
            assert (step, missing) == (last_try["step"], {last_try["participant"]}), (step, shares)
            said = [(e["participant"], e["participants"]) for e in lives["g0_events"]
                    if e.get("step") == step and e.get("committed")]  # fmt: skip
            mine = next(p for p, (name, _) in shares.items() if name == "g0")
            assert said == [(mine, len(missing) + len(shares))], (step, said)
            unrecorded.append(step)
    # the product's provenance says so: the job's committed data (each life's lines, and
    # the dead group's share where a peer committed its quorum) is each step's, once
    tries = [e for e in lives["g0_events"] if "step" in e]
    assert tries and all(re.fullmatch(r"\d+-[0-9a-f]{12}", e["quorum"]) for e in tries), tries[:2]
    job: dict[int, list] = {}
    for steps in read_job_provenance(lives["folders"]).values():
        for step, sequences in steps.items():
            job.setdefault(step, []).extend(json.dumps(spans) for spans in sequences)
    assert {s: sorted(v) for s, v in job.items()} == {
        s: plain["spans"][s - 1] for s in range(1, end + 1)
    }, "the job's provenance is not every committed step's data once"
    healed = [r["healed_at"] for r in again if r["kind"] == "commit"]
    assert healed and healed[0] is not None, "the group started again did not heal"
    return unrecorded


@pytest.mark.parametrize("moment", MOMENTS)
def test_a_group_killed_at_each_moment_of_a_step(runs, plain, moment):
    unrecorded = check(runs[(moment, None)], plain)
    # Killed after its all-reduce (at the vote, after its commit), group 1 leaves its
    # share of the step trained by group 0's commit but recorded only there; killed
    # before it, the step is not committed and is tried again; killed in it, either.
    if moment in ("vote", "after_commit"):
        assert unrecorded == [KILL_AT], unrecorded
    elif moment != "allreduce":
        assert unrecorded == [], unrecorded
    with pytest.raises(AssertionError, match="not the windows|not its share"):
        check(runs[(moment, PLANTED[moment])], plain)
