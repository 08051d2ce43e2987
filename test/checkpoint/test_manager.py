"""CheckpointManager as train.py drives it: choosing, verifying, loading, refusing.

One in-process rank (``train.main``) for what does not depend on the rank count; the
dataloader's per-rank entries go through real DCP in test_parallel.py's 4-rank launch.
"""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest
from helpers import error_lines, losses, read_jsonl, train_here

from torchtitan.checkpoint import MANIFEST, PENDING, complete_steps, verify_checkpoint

CK = ["--checkpoint.enable_checkpoint"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """7 steps, a checkpoint every 3, keep the latest 2: expect step-6 and step-7 (the last)."""
    dump = tmp_path_factory.mktemp("ck") / "run"
    train_here(dump, "--training.steps", 7, *CK, "--checkpoint.interval", 3,
               "--checkpoint.keep_latest_k", 2)  # fmt: skip
    return dump


def copy_run(trained, tmp_path):
    dump = tmp_path / "run"
    shutil.copytree(trained, dump)
    return dump


def test_interval_last_step_and_keep_latest_k(trained):
    folder = trained / "checkpoint"
    assert complete_steps(str(folder)) == [6, 7]
    assert not [n for n in os.listdir(folder) if n.endswith(".partial")]
    manifest = json.loads((folder / "step-7" / MANIFEST).read_text())
    assert manifest["step"] == 7 and manifest["world_size"] == 1
    assert {"sources", "tokenizer_sha256", "seed"} <= set(manifest["data_fingerprint"])
    assert "seq_len" not in manifest["data_fingerprint"], "a resume may change it"
    assert verify_checkpoint(str(folder / "step-7")) is None


def test_load_step_and_a_missing_step(trained, tmp_path):
    dump = copy_run(trained, tmp_path)
    _, log = train_here(dump, "--training.steps", 7, *CK, "--checkpoint.interval", 3,
                        "--checkpoint.load_step", 6)  # fmt: skip
    assert "step-6" in log and "loaded checkpoint" in log
    assert sorted(losses(dump)) == list(range(1, 8))
    assert losses(dump)[7] == losses(trained)[7]  # re-running step 7 from step 6 is exact

    status, log = train_here(dump, "--training.steps", 7, *CK, "--checkpoint.load_step", 3,
                             expect_ok=False)  # fmt: skip
    errors = error_lines(log)
    assert status == 1 and len(errors) == 1
    assert "no complete checkpoint step-3" in errors[0] and "complete steps: [6, 7]" in errors[0]


def test_exclude_from_loading_restarts_the_data(trained, tmp_path):
    dump = copy_run(trained, tmp_path)
    _, log = train_here(dump, "--training.steps", 9, *CK, "--checkpoint.interval", 3,
                        "--checkpoint.exclude_from_loading", "dataloader")  # fmt: skip
    assert "not loading dataloader" in log
    assert "(model, optimizer, lr_scheduler, train_state, spikes, rng)" in log


def test_seed_checkpoint_gives_the_same_start(tmp_path):
    seeded = tmp_path / "seeded"
    train_here(seeded, *CK, "--checkpoint.create_seed_checkpoint")
    assert complete_steps(str(seeded / "checkpoint")) == [0]
    _, log = train_here(seeded, "--training.steps", 3, *CK)
    assert "step-0 (model)" in log
    train_here(tmp_path / "plain", "--training.steps", 3)
    train_here(tmp_path / "other", "--training.steps", 3, "--training.seed", 5)
    assert losses(seeded) == losses(tmp_path / "plain")
    assert losses(tmp_path / "other") != losses(tmp_path / "plain"), "the check can fail"


def test_damaged_checkpoint_is_named_and_fallback_is_loud(trained, tmp_path):
    dump = copy_run(trained, tmp_path)
    shard = dump / "checkpoint" / "step-7" / "__0_0.distcp"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    status, log = train_here(dump, "--training.steps", 7, *CK, expect_ok=False)
    errors = error_lines(log)
    assert status == 1 and len(errors) == 1
    assert "__0_0.distcp" in errors[0] and "truncated" in errors[0]
    assert "--checkpoint.load_step 6" in errors[0]

    _, log = train_here(dump, "--training.steps", 7, *CK, "--checkpoint.fallback_on_corruption")
    assert "IS DAMAGED" in log and "step-6" in log
    assert losses(dump)[7] == losses(trained)[7]


def test_a_flipped_byte_is_caught_by_the_checksum(trained, tmp_path):
    dump = copy_run(trained, tmp_path)
    shard = dump / "checkpoint" / "step-7" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the CRC can see it
    shard.write_bytes(bytes(data))
    assert "fails its checksum" in verify_checkpoint(str(dump / "checkpoint" / "step-7"))


def as_if_killed_before_the_rename(folder, step: int):
    """Turn a finished step-N back into the step-N.partial a kill after DCP's write leaves."""
    final, partial = folder / f"step-{step}", folder / f"step-{step}.partial"
    manifest = json.loads((final / MANIFEST).read_text())
    del manifest["files"]
    (final / PENDING).write_text(json.dumps(manifest))
    (final / MANIFEST).unlink()
    os.rename(final, partial)
    return partial


def test_a_written_checkpoint_is_finished_on_restart_never_deleted(trained, tmp_path):
    """Killed after every byte was written but before the rename: the restart finishes
    step-7 and resumes from it (nothing to re-run). Negative control: the same partial
    without one data file is an interrupted write, and is removed."""
    dump = copy_run(trained, tmp_path)
    folder = dump / "checkpoint"
    as_if_killed_before_the_rename(folder, 7)
    _, log = train_here(dump, "--training.steps", 8, *CK)
    assert "finishing checkpoint" in log and "loaded checkpoint" in log and "step-7" in log
    assert "training steps 8..8" in log
    assert verify_checkpoint(str(folder / "step-7")) is None

    dump = copy_run(trained, tmp_path / "b")
    folder = dump / "checkpoint"
    partial = as_if_killed_before_the_rename(folder, 7)
    (partial / "__0_0.distcp").unlink()
    _, log = train_here(dump, "--training.steps", 7, *CK)
    assert "ignoring and removing incomplete checkpoint" in log and "step-6" in log
    assert losses(dump)[7] == losses(trained)[7]
    assert complete_steps(str(folder)) == [6, 7]


class StageCounter:
    """A component the manager has never heard of: a per-rank counter (as a pipeline
    stage's own state would be), saved and loaded through its own adapter."""

    def __init__(self, value: int, loads: bool = True):
        import torch

        from torchtitan.checkpoint.stateful import Adapter

        outer = self

        class CounterState(Adapter):
            data_only = True

            def state_dict(self):
                return {"rank_0": torch.tensor(outer.value)}

            def load_targets(self, saved):
                return super().load_targets(saved) if loads else None

            def load_state_dict(self, state):
                outer.value = int(state["rank_0"])

        self.value, self.adapter = value, CounterState()


def test_a_new_component_is_an_adapter_not_a_change_to_the_manager(tmp_path):
    """An adapter the manager does not know is saved and loaded like the others, under
    its own name; the manager's source names no component. Negative control: an adapter
    that expects nothing from the checkpoint (load_targets None) keeps its value."""
    import inspect

    import torch

    import torchtitan.checkpoint.manager as manager_module
    from torchtitan.checkpoint import CheckpointManager, TrainState
    from torchtitan.checkpoint.stateful import training_components
    from torchtitan.config import parse_args
    from torchtitan.models import build_model
    from torchtitan.parallel import init_distributed

    cfg = parse_args(["--job.dump_folder", str(tmp_path), *CK])
    dims = init_distributed()

    def manager(counter: StageCounter) -> CheckpointManager:
        model = build_model("debugmodel", 4096, device="cpu")
        components = training_components(
            cfg, dims, model=model, optimizer=torch.optim.AdamW(model.parameters()),
            train_state=TrainState(step=5), fingerprint={},
        )  # fmt: skip
        return CheckpointManager(cfg, dims, {**components, "stage": counter.adapter}, {})

    first = manager(StageCounter(41))
    first.save(5)
    first.close()
    assert (
        "stage"
        in json.loads((tmp_path / "checkpoint" / "step-5" / MANIFEST).read_text())["contents"]
    )
    for loads, expected in ((True, 41), (False, 7)):
        counter = StageCounter(7, loads=loads)
        again = manager(counter)
        loaded = again.load()
        again.close()
        assert counter.value == expected and ("stage" in loaded) == loads
    source = inspect.getsource(manager_module)
    named = [n for n in ("model", "optimizer", "lr_scheduler", "dataloader", "train_state", "rng")
             if f'"{n}"' in source or f"'{n}'" in source]  # fmt: skip
    assert not named, f"the manager names components {named}"


def test_an_async_save_is_durable_without_a_later_save(tmp_path):
    """Async: step-N is renamed and complete as soon as its write ends, with the loop
    still running and no further save or close (a kill now would resume from it)."""
    import torch

    from torchtitan.checkpoint import CheckpointManager, TrainState
    from torchtitan.checkpoint.stateful import training_components
    from torchtitan.config import parse_args
    from torchtitan.models import build_model
    from torchtitan.parallel import init_distributed

    cfg = parse_args(["--job.dump_folder", str(tmp_path), *CK, "--checkpoint.async_mode", "async"])
    model = build_model("debugmodel", 4096, device="cpu")
    dims = init_distributed()
    components = training_components(
        cfg, dims, model=model, optimizer=torch.optim.AdamW(model.parameters()),
        train_state=TrainState(step=3), fingerprint={},
    )  # fmt: skip
    manager = CheckpointManager(cfg, dims, components, fingerprint={})
    manager.save(3)
    deadline = time.monotonic() + 60
    while complete_steps(str(tmp_path / "checkpoint")) != [3] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert complete_steps(str(tmp_path / "checkpoint")) == [3], "finalized in the background"
    assert verify_checkpoint(str(tmp_path / "checkpoint" / "step-3")) is None
    manager.close()


def test_weights_only_checkpoints_do_not_become_the_resume_point(tmp_path):
    """A run ending in a weights-only step-6, extended to 9 steps: it resumes from the
    full step-3 (not from scratch), the weights-only step is moved aside, and
    keep_latest_k counts only full checkpoints."""
    common = [*CK, "--checkpoint.interval", 3, "--checkpoint.keep_latest_k", 2]
    train_here(tmp_path, "--training.steps", 6, *common, "--checkpoint.model_weights_only")
    _, log = train_here(tmp_path, "--training.steps", 9, *common)
    assert "not resuming from step-6: it holds model weights only" in log
    assert "loaded checkpoint" in log and "step-3" in log and "training steps 4..9" in log
    assert sorted(losses(tmp_path)) == list(range(1, 10))
    folder = tmp_path / "checkpoint"
    assert complete_steps(str(folder)) == [6, 9]
    assert (folder / "step-6.abandoned").is_dir(), "moved aside, not deleted"


def test_a_job_stopped_early_saves_in_full_where_it_stops(tmp_path):
    """The loop saves where the job stops (training.stop_at_step 4 of 6, no interval save
    before it) and the training's last step: step-4 in full, so the relaunch resumes
    from it, and step-6, the training's end, as weights only under
    checkpoint.model_weights_only. Negative controls: each is the other's (a save that
    took the job's stop for the training's end would make step-4 weights only)."""
    common = [*CK, "--checkpoint.interval", 10, "--checkpoint.model_weights_only",
              "--training.steps", 6]  # fmt: skip
    train_here(tmp_path, *common, "--training.stop_at_step", 4)
    folder = tmp_path / "checkpoint"
    assert complete_steps(str(folder)) == [4]
    full = json.loads((folder / "step-4" / MANIFEST).read_text())["contents"]
    assert {"model", "optimizer", "dataloader", "train_state"} <= set(full)
    _, log = train_here(tmp_path, *common)
    assert "loaded checkpoint" in log and "training steps 5..6" in log
    assert json.loads((folder / "step-6" / MANIFEST).read_text())["contents"] == ["model"]
    assert sorted(losses(tmp_path)) == list(range(1, 7))


def test_load_step_abandons_the_newer_timeline(trained, tmp_path):
    """Resume at step-6 of a run that reached 7, stop at 6 again: the next automatic
    resume takes the new timeline's step, not the abandoned step-7."""
    dump = copy_run(trained, tmp_path)
    folder = dump / "checkpoint"
    _, log = train_here(dump, "--training.steps", 7, *CK, "--checkpoint.load_step", 6,
                        "--training.stop_at_step", 6)  # fmt: skip
    assert "moved" in log and "step-7.abandoned" in log
    assert complete_steps(str(folder)) == [6] and (folder / "step-7.abandoned").is_dir()
    _, log = train_here(dump, "--training.steps", 7, *CK)
    assert "training steps 7..7" in log


def test_the_config_wins_for_lr_schedule_and_steps(tmp_path):
    """Resumed with a new peak LR and a longer schedule, step 5 trains at the LR that
    config gives from scratch (the checkpoint holds the schedule's step count only)."""
    train_here(tmp_path / "a", "--training.steps", 4, *CK, "--checkpoint.interval", 2)
    new = ["--training.steps", 8, "--optimizer.lr", 1e-4, "--optimizer.weight_decay", 0.05]
    _, log = train_here(tmp_path / "a", *new, *CK, "--checkpoint.interval", 2)
    assert "config changed since" in log and "optimizer.lr: 0.0008 -> 0.0001" in log
    assert "training.steps: 4 -> 8" in log
    train_here(tmp_path / "b", *new)
    lr = {p.name: {r["step"]: r["lr"] for r in read_jsonl(p / "metrics.jsonl")}
          for p in (tmp_path / "a", tmp_path / "b")}  # fmt: skip
    assert lr["a"][5] == lr["b"][5] and lr["a"][8] == lr["b"][8]
    assert lr["a"][4] != lr["b"][4], "steps before the resume followed the old config"


def test_changed_data_settings_are_refused(trained, tmp_path):
    dump = copy_run(trained, tmp_path)
    status, log = train_here(dump, "--training.steps", 7, *CK, "--training.seed", 43,
                             expect_ok=False)  # fmt: skip
    errors = error_lines(log)
    assert status == 1 and len(errors) == 1
    assert "seed: 42 -> 43" in errors[0] and "accept_data_change" in errors[0]


def test_fingerprint_keys_files_by_their_path_under_the_source(tmp_path):
    """FineWeb-style a/000 and b/000 stay distinct, so an edit to either one shows."""
    from torchtitan.data.fingerprint import fingerprint_diff
    from torchtitan.data.sources import resolve_source

    root = tmp_path / "src"
    for sub in ("a", "b"):
        (root / sub).mkdir(parents=True)
        (root / sub / "000.jsonl").write_text(json.dumps({"text": f"document in {sub}"}) + "\n")

    def fingerprint(path: str) -> dict:
        return {
            "sources": [
                {"name": "s", "weight": 1.0, "files": resolve_source(path=path).fingerprint()}
            ]
        }

    before = fingerprint(str(root))
    assert [f[0] for f in before["sources"][0]["files"]] == ["a/000.jsonl", "b/000.jsonl"]
    assert fingerprint(str(root / "*" / "*.jsonl")) == before, "a glob names files the same way"
    (root / "a" / "000.jsonl").write_text(json.dumps({"text": "document in A"}) + "\n")
    assert fingerprint_diff(before, fingerprint(str(root))) == [
        "source 's' file a/000.jsonl changed"
    ]


def test_moving_the_data_between_two_halves_of_a_run(tiny_corpus, tmp_path, monkeypatch):
    """The document order comes from the data's identity, not its path: a run whose corpus
    moves to another folder (and is then named by a relative path) resumes bit-exactly,
    the fingerprint agreeing, with the same documents in the same order."""
    first, second = tmp_path / "mnt1" / "corpus", tmp_path / "mnt2" / "corpus"
    shutil.copytree(tiny_corpus, first)
    common = ["--training.steps", 6, *CK, "--checkpoint.interval", 3, "--metrics.data_provenance",
              "--training.seq_len", 32]  # fmt: skip
    train_here(tmp_path / "ref", *common, "--training.dataset_path", first)
    shutil.copytree(tmp_path / "ref", tmp_path / "run")
    shutil.rmtree(tmp_path / "run" / "checkpoint" / "step-6")
    shutil.move(first, second)
    monkeypatch.chdir(tmp_path / "mnt2")
    _, log = train_here(tmp_path / "run", *common, "--training.dataset_path", "./corpus")
    assert "loaded checkpoint" in log and "step-3" in log
    assert losses(tmp_path / "run") == losses(tmp_path / "ref")
    # (Each line also names its branch of the timeline: the resume began one at step 3.)
    run, ref = (read_jsonl(tmp_path / d / "provenance" / "rank0.jsonl") for d in ("run", "ref"))
    assert [(r["step"], r["sequences"]) for r in run] == [(r["step"], r["sequences"]) for r in ref]
    # Negative control: renaming a file changes the data's identity, and the resume is refused.
    shutil.rmtree(tmp_path / "run" / "checkpoint" / "step-6")
    os.rename(second / "part-001.jsonl", second / "part-009.jsonl")
    status, log = train_here(tmp_path / "run", *common, "--training.dataset_path", "./corpus",
                             expect_ok=False)  # fmt: skip
    assert status == 1 and "file part-009.jsonl added" in error_lines(log)[0]


# ---- recovery that is safe to requeue (timeline branches) ---------------------------------


def test_a_requeued_load_step_continues_its_branch(trained, tmp_path):
    """The command that rewound to step-6 is relaunched as it was (a scheduler's requeue):
    it continues the branch from its newest checkpoint (step-8), rewinding nothing and
    setting nothing more aside. Negative control: without the branch record (an old
    manifest), the same command rewinds to step-6 again."""
    dump = copy_run(trained, tmp_path)
    folder = dump / "checkpoint"
    rewind = [*CK, "--checkpoint.interval", 3, "--checkpoint.load_step", 6]
    train_here(dump, "--training.steps", 9, *rewind, "--training.stop_at_step", 8)
    assert complete_steps(str(folder)) == [6, 8] and (folder / "step-7.abandoned").is_dir()
    origin = json.loads((folder / "step-8" / MANIFEST).read_text())["timeline"]
    assert origin == {"generation": 1, "origin": {"load_step": 6, "exclude_from_loading": []}}

    control = copy_run(dump, tmp_path / "control")
    _, log = train_here(dump, "--training.steps", 9, *rewind)
    assert "continuing the timeline that --checkpoint.load_step 6 began" in log
    assert "training steps 9..9" in log and "moved" not in log
    assert sorted(losses(dump)) == list(range(1, 10))

    manifest = control / "checkpoint" / "step-8" / MANIFEST
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "timeline": None}))
    _, log = train_here(control, "--training.steps", 9, *rewind)
    assert "training steps 7..9" in log and "step-8.abandoned" in log, "the check can fail"


def test_a_requeued_data_restart_restarts_the_data_once(trained, tmp_path):
    """--checkpoint.exclude_from_loading dataloader, preempted after step 8 and requeued
    with the same command: the requeue loads the branch's data position, so its steps
    are bit-equal to the same restart run without interruption (a second restart would
    train the first documents again and differ)."""
    restart = [*CK, "--checkpoint.interval", 3, "--checkpoint.exclude_from_loading", "dataloader"]
    whole = copy_run(trained, tmp_path / "whole")
    train_here(whole, "--training.steps", 10, *restart)
    dump = copy_run(trained, tmp_path / "requeued")
    train_here(dump, "--training.steps", 10, *restart, "--training.stop_at_step", 8)
    _, log = train_here(dump, "--training.steps", 10, *restart)
    assert "continuing the timeline" in log and "not loading" not in log
    assert "(model, optimizer, lr_scheduler, dataloader, train_state, spikes, rng)" in log
    assert losses(dump) == losses(whole)


def test_keep_latest_k_never_removes_the_checkpoint_just_written(trained, tmp_path):
    """train_state excluded: the step count restarts at 0 below the old timeline's steps.
    keep_latest_k counts in timeline order, so the new step-3 and step-4 are kept and the
    old step-6/7 go; the requeue continues from step-4."""
    dump = copy_run(trained, tmp_path)
    again = [*CK, "--checkpoint.interval", 3, "--checkpoint.keep_latest_k", 2,
             "--checkpoint.exclude_from_loading", "train_state"]  # fmt: skip
    _, log = train_here(dump, "--training.steps", 4, *again)
    assert "removed old checkpoint step-3" not in log
    assert complete_steps(str(dump / "checkpoint")) == [3, 4]
    _, log = train_here(dump, "--training.steps", 5, *again)
    assert "training steps 5..5" in log


def test_plan_resume_matches_a_branch_by_its_options_and_data():
    """The rule itself, with negative controls: other options, or a data restart whose
    data changed again, begin a new branch."""
    from torchtitan.checkpoint.timeline import Entry, generation_for, plan_resume, recovery_options

    restart = recovery_options(-1, ["dataloader"])
    entries = [
        Entry(6),
        Entry(7),
        Entry(3, 1, restart, True, {"seed": 1}),
        Entry(4, 1, restart, True, {"seed": 1}),
    ]
    plan = plan_resume(entries, restart, {"seed": 1})
    assert (plan.candidates, plan.exclude, plan.branch) == ([4, 3], [], False)
    assert generation_for(entries, plan, 4) == (1, restart)
    plan = plan_resume(entries, restart, {"seed": 2})  # the data changed again
    assert (plan.candidates[0], plan.exclude, plan.branch) == (4, ["dataloader"], True)
    assert generation_for(entries, plan, 4) == (2, restart)
    plan = plan_resume(entries, recovery_options(6, []), {"seed": 1})
    assert (plan.candidates, plan.branch) == ([6], True)
    plan = plan_resume(entries, None, {"seed": 1})
    assert plan.candidates == [4, 3, 7, 6], "newest by generation, then step"


def test_a_group_left_out_of_a_branch_never_wins_the_next_start():
    """Fault tolerance: the job rewound to step-20 (``load_step``) with groups 0 and 1,
    group 2 left out; group 2's folder still holds step-30 of the abandoned timeline. At
    the next start of all three, the branch's step-25 wins, though step-30 is larger: the
    job's newest checkpoint is the newest by (generation, step), as in one folder. And the
    branch, begun where group 2's folder held generation 3, takes generation 4. Negative
    control: where step-30 is of the branch's generation, it wins. (The manager's use of
    the generations of every folder it read: test_ft_elastic.)"""
    from torchtitan.checkpoint.timeline import Entry, generation_for, plan_resume, resume_order

    rewind = {"load_step": 20, "exclude_from_loading": []}
    old = [Entry(10, 3), Entry(20, 3)]
    own = [*old, Entry(25, 4, rewind)]
    left_out = [*old, Entry(30, 3)]

    def start(own_entries, peer_entries):
        peers = [("replica_2", peer_entries, plan_resume(peer_entries, None, {}))]
        return resume_order(("replica_0", own_entries, plan_resume(own_entries, None, {})),
                            peers)  # fmt: skip

    assert start(own, left_out)[0] == (25, "replica_0")
    assert start(own, [*old, Entry(30, 4, rewind)])[0] == (30, "replica_2"), "control"
    assert start(own, own)[0] == (25, "replica_0"), "a tie: this group's own folder"
    # A checkpoint of weights only (a seed, an export) never outranks a training state.
    assert start(own, [Entry(40, 5, None, False)])[0] == (25, "replica_0")
    assert start(old, [Entry(40, 5, None, False)])[0] == (20, "replica_0")
    # The branch's generation, from every folder the start read (its own and its peers').
    plan = plan_resume(old, rewind, {})
    assert generation_for([*left_out, *old], plan, 20) == (4, rewind)


# ---- a kill anywhere inside the finalization ----------------------------------------------


@pytest.mark.parametrize("pending_removed", [False, True])
def test_a_kill_inside_the_publish_leaves_a_checkpoint_that_is_finished(
    trained, tmp_path, pending_removed
):
    """Killed after manifest.json was written inside step-7.partial (before or after the
    pending manifest's removal, before the rename): the restart verifies it against its
    manifest, renames it and resumes from it; it is neither called damaged nor removed."""
    dump = copy_run(trained, tmp_path)
    folder = dump / "checkpoint"
    final, partial = folder / "step-7", folder / "step-7.partial"
    manifest = json.loads((final / MANIFEST).read_text())
    if not pending_removed:
        (final / PENDING).write_text(
            json.dumps({k: v for k, v in manifest.items() if k != "files"})
        )
    os.rename(final, partial)
    _, log = train_here(dump, "--training.steps", 8, *CK, "--checkpoint.interval", 3)
    assert "finishing checkpoint" in log and "training steps 8..8" in log
    assert verify_checkpoint(str(folder / "step-7")) is None
    assert not partial.exists()


def test_the_writable_probe_never_collides_between_ranks_sharing_a_pid(tmp_path):
    """Ranks in containers on different nodes often share a pid: 16 concurrent probers
    in one process (one pid) x 100 probes each, none may fail."""
    from concurrent.futures import ThreadPoolExecutor

    from torchtitan.checkpoint import check_writable

    def probe(_):
        for _ in range(100):
            check_writable(str(tmp_path))

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(probe, range(16)))
    assert os.listdir(tmp_path) == []


# ---- a checkpoint that does not fit this run: one line ------------------------------------


def test_another_optimizer_or_model_is_one_line(trained, tmp_path):
    dump = copy_run(trained, tmp_path)
    status, log = train_here(dump, "--training.steps", 8, *CK, "--optimizer.name", "SGD",
                             expect_ok=False)  # fmt: skip
    errors = error_lines(log)
    assert status == 1 and len(errors) == 1 and "Traceback" not in log, log[-2000:]
    assert "exp_avg" in errors[0] and "--optimizer.name AdamW" in errors[0]
    # Adam keeps the same moments as AdamW: it resumes, and the config wins.
    _, log = train_here(dump, "--training.steps", 8, *CK, "--optimizer.name", "Adam")
    assert "optimizer.name: 'AdamW' -> 'Adam'" in log

    dump = copy_run(trained, tmp_path / "flavor")
    status, log = train_here(dump, "--training.steps", 8, *CK, "--model.flavor", "125M",
                             expect_ok=False)  # fmt: skip
    errors = error_lines(log)
    assert status == 1 and len(errors) == 1 and "Traceback" not in log, log[-2000:]
    assert "does not fit this model" in errors[0] and "'debugmodel'" in errors[0]


def test_a_damaged_checkpoint_with_a_copy_in_a_peer_folder_names_the_right_fix(tmp_path):
    """Fault tolerance: this group's step-5 is damaged and a peer group's folder holds
    step-5 too. The one line names the previous step (load_step 3), not step-5 again;
    with no previous step it names the peer's copy and fallback_on_corruption, which
    then loads that copy (the control: the fix it names works)."""
    import torch

    from torchtitan.checkpoint import CheckpointError, CheckpointManager, TrainState
    from torchtitan.checkpoint.stateful import training_components
    from torchtitan.config import parse_args
    from torchtitan.models import build_model
    from torchtitan.parallel import init_distributed

    dims = init_distributed()

    def manager(folder, *extra) -> CheckpointManager:
        cfg = parse_args(["--job.dump_folder", str(folder), *CK, *extra])
        model = build_model("debugmodel", 4096, device="cpu")
        components = training_components(
            cfg, dims, model=model, optimizer=torch.optim.AdamW(model.parameters()),
            train_state=TrainState(), fingerprint={},
        )  # fmt: skip
        return CheckpointManager(cfg, dims, components, fingerprint={})

    own, peer = tmp_path / "replica_0", tmp_path / "replica_1"
    for folder, steps in ((own, (3, 5)), (peer, (5,))):
        writer = manager(folder)
        for step in steps:
            writer.save(step)
        writer.close()
    shard = own / "checkpoint" / "step-5" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    peers = [str(peer / "checkpoint")]

    def error(folder) -> str:
        loader = manager(folder)
        try:
            with pytest.raises(CheckpointError) as caught:
                loader.load(peers)
        finally:
            loader.close()
        return str(caught.value)

    message = error(own)
    assert "step-5" in message and "--checkpoint.load_step 3" in message, message
    shutil.rmtree(own / "checkpoint" / "step-3")
    message = error(own)
    assert "--checkpoint.load_step" not in message, message
    assert f"fallback_on_corruption to resume from step-5 in {peers[0]}" in message
    loader = manager(own, "--checkpoint.fallback_on_corruption")
    loader.load(peers)
    loader.close()
    assert loader.loaded_from == str(peer / "checkpoint" / "step-5")


def test_the_purge_after_a_save_runs_behind_the_loop_and_the_next_save_waits_for_it(
    tmp_path, monkeypatch
):
    """keep_latest_k 1, sync saves: the purge after step-1 runs on its own thread (held
    here until released) and ``save(1)`` returns without it; ``save(2)`` does not begin
    its write until that purge has ended, and its own purge removes step-1. Catches a
    purge on the caller's thread again (``save(1)`` would wait for the release) and a
    ``wait()`` that forgets it (``save(2)`` would write beside the purge)."""
    import threading

    import torch

    from torchtitan.checkpoint import CheckpointManager, TrainState, lifecycle, timeline
    from torchtitan.checkpoint.stateful import training_components
    from torchtitan.config import parse_args
    from torchtitan.models import build_model
    from torchtitan.parallel import init_distributed

    cfg = parse_args(["--job.dump_folder", str(tmp_path), *CK, "--checkpoint.keep_latest_k", "1"])
    model = build_model("debugmodel", 4096, device="cpu")
    dims = init_distributed()
    components = training_components(
        cfg, dims, model=model, optimizer=torch.optim.AdamW(model.parameters()),
        train_state=TrainState(), fingerprint={},
    )  # fmt: skip
    manager = CheckpointManager(cfg, dims, components, fingerprint={})
    events, started, release = [], threading.Event(), threading.Event()
    purge, save = timeline.purge, lifecycle.dcp.save

    def held_purge(folder, keep):
        events.append(("purge", threading.current_thread().name))
        started.set()
        release.wait(timeout=10)
        removed = purge(folder, keep)
        events.append(("purged", removed))
        return removed

    def logged_save(*args, **kwargs):
        events.append(("write", None))
        return save(*args, **kwargs)

    monkeypatch.setattr(timeline, "purge", held_purge)
    monkeypatch.setattr(lifecycle.dcp, "save", logged_save)
    manager.save(1)
    assert not release.is_set() and started.wait(timeout=10) and events[0] == ("write", None)
    assert events[1][0] == "purge" and events[1][1].startswith("ckpt-purge"), events
    second = threading.Thread(target=manager.save, args=(2,))
    second.start()
    second.join(timeout=0.5)
    assert second.is_alive(), "save(2) waits for step-1's purge"
    release.set()
    second.join()
    manager.close()
    assert [e[0] for e in events] == ["write", "purge", "purged", "write", "purge", "purged"]
    assert events[-1] == ("purged", [1]) and complete_steps(str(tmp_path / "checkpoint")) == [2]
