"""The acceptance test: a resumed run continues bit for bit where the first one stopped.

Run as ``python scripts/deterministic_resume.py [options] [--section.key value ...]``.

Default mode:
  1. train --steps (30) with a checkpoint every --interval (5) on --nproc (2) ranks;
  2. delete the last --delete (3) checkpoints (steps 30, 25, 20);
  3. run the same command again: it resumes from step 15;
  4. compare the per-step losses of steps 16..30 bit for bit and print a table;
  5. save a PNG of both loss curves into the dump folder.
Data provenance is recorded too: the resumed run's must equal the first run's, and
every token must be consumed exactly once.

--resume-every: restart the job at every checkpoint (a new process at 5, 10, ...),
and compare every step with one uninterrupted run.

--resume-nproc M: resume on M ranks instead (elastic). The per-rank batch size is
scaled to keep the global batch, and the exactly-once provenance check replaces
the bit-exact loss comparison (a different layout draws batches in another order).

Extra ``--section.key value`` arguments are passed to every run, e.g.
``--training.num_workers 2`` or ``--model.dropout 0.1``. Exit status 0 only on success.

``--checkpoint.folder s3://bucket/prefix`` (any URL) keeps the checkpoints in a store:
it is emptied first, as the dump folder is, and with --resume-every the uninterrupted
run saves beside it, to ``<prefix>-reference`` (its own timeline, as its dump folder).
The corpus and its counts may be URLs too (``--training.dataset_path``,
``--training.length_index_dir``): they are only read, and the counts are shared.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
from collections.abc import Callable

from torchtitan import REPO_ROOT
from torchtitan.checkpoint import MANIFEST, complete_steps
from torchtitan.checkpoint.store import is_url, store_for
from torchtitan.records.provenance import check_exactly_once, read_provenance, sequences_by_step
from torchtitan.records.runs import losses, validation_losses
from torchtitan.tools.launch import DEBUG_CONFIG, run_env, torchrun_command

# launcher(nproc, argv) -> (exit status, log text): how one training job is run.
Launcher = Callable[[int, list[str]], tuple[int, str]]


def torchrun_launcher(nproc: int, argv: list[str]) -> tuple[int, str]:
    """Each job in its own ``torchrun`` (the default; tests may run 1-rank jobs in-process)."""
    cmd = torchrun_command(nproc, argv)
    print("$ " + " ".join(cmd[1:]), flush=True)
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=run_env(), capture_output=True, text=True)
    return proc.returncode, proc.stdout + proc.stderr


def launch(launcher: Launcher, nproc: int, dump: str, args, extra: list[str], overrides: list[str]):
    argv = [
        "--job.config_file", args.config, "--job.dump_folder", dump,
        "--training.steps", str(args.steps), "--checkpoint.enable_checkpoint",
        "--checkpoint.interval", str(args.interval), "--metrics.log_freq", "1",
        "--metrics.data_provenance", *overrides, *extra,
    ]  # fmt: skip
    status, log = launcher(nproc, argv)
    with open(os.path.join(dump, "runs.log"), "a") as f:
        f.write(f"$ train.py {' '.join(argv)}\n{log}\n")
    for line in log.splitlines():
        if "loaded checkpoint" in line or "resharding" in line or "error" in line.lower():
            print("  " + line.strip())
    if status != 0:
        print(log[-4000:])
        raise SystemExit(f"training exited with status {status}; full log in {dump}/runs.log")


def checkpoint_url(extra: list[str]) -> str | None:
    """The ``--checkpoint.folder`` of ``extra`` where it is a URL (a store), else None."""
    found = [v for k, v in zip(extra, extra[1:]) if k == "--checkpoint.folder"]
    return found[-1] if found and is_url(found[-1]) else None


def with_checkpoint_folder(extra: list[str], folder: str) -> list[str]:
    """``extra`` with its ``--checkpoint.folder`` replaced by ``folder``."""
    out = list(extra)
    for i, key in enumerate(out[:-1]):
        if key == "--checkpoint.folder":
            out[i + 1] = folder
    return out


def empty_store_folder(url: str):
    """Remove every object under ``url``: each check starts from no checkpoint, as from
    an emptied dump folder."""
    store_for(url).rmtree(url)


def delete_last_checkpoints(dump: str, count: int, url: str | None = None) -> list[int]:
    if url is not None:  # a store: the complete steps, each manifest deleted first
        doomed = complete_steps(url)[-count:] if count else []
        for step in doomed:
            store_for(url).rmtree(f"{url.rstrip('/')}/step-{step}", first=MANIFEST)
        return doomed
    folder = os.path.join(dump, "checkpoint")
    steps = sorted(
        int(n.split("-")[1]) for n in os.listdir(folder) if n.startswith("step-") and "." not in n
    )
    doomed = steps[-count:] if count else []
    for step in doomed:
        shutil.rmtree(os.path.join(folder, f"step-{step}"))
    return doomed


def compare(reference: dict[int, float], resumed: dict[int, float], steps: range) -> bool:
    print(f"\n{'step':>5}  {'first run':>22}  {'resumed run':>22}  equal")
    ok = True
    for step in steps:
        a, b = reference.get(step), resumed.get(step)
        equal = a is not None and a == b
        ok &= equal
        print(f"{step:>5}  {a!r:>22}  {b!r:>22}  {'yes' if equal else 'NO'}")
    return ok


def provenance_ok(dump: str) -> bool:
    reports = check_exactly_once(read_provenance(os.path.join(dump, "provenance")))
    ok = True
    for source, r in sorted(reports.items()):
        print(
            f"provenance {source}: {r.tokens} tokens in {r.documents} documents, {r.duplicate_tokens} twice, {r.gaps} gaps"
        )
        for example in r.examples:
            print(f"    {example}")
        ok &= r.duplicate_tokens == 0 and r.gaps == 0
    return ok


def plot(reference: dict[int, float], resumed: dict[int, float], resume_step: int, path: str):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -e '.[dev]')")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(list(reference), list(reference.values()), label="first run", lw=3, alpha=0.5)
    tail = {s: v for s, v in resumed.items() if s > resume_step}
    ax.plot(list(tail), list(tail.values()), "o--", ms=3, label=f"resumed from step {resume_step}")
    ax.axvline(resume_step, color="grey", ls=":")
    ax.set(xlabel="step", ylabel="loss", title="deterministic resume")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot: {path}")


def main(argv=None, launcher: Launcher = torchrun_launcher) -> int:
    p = argparse.ArgumentParser(
        prog="deterministic_resume.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--interval", type=int, default=5)
    p.add_argument("--delete", type=int, default=3, help="checkpoints to delete before resuming")
    p.add_argument("--config", default=DEBUG_CONFIG)
    p.add_argument("--dump-folder", default="outputs/deterministic_resume")
    p.add_argument("--resume-every", action="store_true", help="restart at every checkpoint")
    p.add_argument(
        "--resume-nproc", type=int, default=0, help="resume on this many ranks (elastic)"
    )
    p.add_argument("--batch-size", type=int, default=4, help="per-rank batch size of the first run")
    args, extra = p.parse_known_args(argv)
    dump = os.path.abspath(args.dump_folder)
    shutil.rmtree(dump, ignore_errors=True)
    os.makedirs(dump)
    batch = ["--training.batch_size", str(args.batch_size)]
    url = checkpoint_url(extra)
    if url is not None:
        empty_store_folder(url)

    if args.resume_every:
        reference_dump = dump + "-reference"
        shutil.rmtree(reference_dump, ignore_errors=True)
        os.makedirs(reference_dump)
        reference_extra = extra
        if url is not None:  # its own timeline, as its own dump folder
            reference_extra = with_checkpoint_folder(extra, url.rstrip("/") + "-reference")
            empty_store_folder(url.rstrip("/") + "-reference")
        launch(launcher, args.nproc, reference_dump, args, reference_extra, batch)
        for stop in range(args.interval, args.steps + 1, args.interval):
            launch(
                launcher,
                args.nproc,
                dump,
                args,
                extra,
                [*batch, "--training.stop_at_step", str(stop)],
            )
        reference, resumed, resume_step = losses(reference_dump), losses(dump), 0
        ok = compare(reference, resumed, range(1, args.steps + 1))
        ok &= sequences_by_step(
            read_provenance(os.path.join(reference_dump, "provenance"))
        ) == sequences_by_step(read_provenance(os.path.join(dump, "provenance")))
    else:
        launch(launcher, args.nproc, dump, args, extra, batch)
        reference, reference_validation = losses(dump), validation_losses(dump)
        first_provenance = sequences_by_step(read_provenance(os.path.join(dump, "provenance")))
        deleted = delete_last_checkpoints(dump, args.delete, url)
        resume_step = args.steps - args.delete * args.interval
        print(f"deleted checkpoints {deleted}; resuming from step {resume_step}")
        nproc = args.resume_nproc or args.nproc
        if any(a.startswith("--training.global_batch_size") for a in extra):
            resume_batch = batch  # the job keeps its global batch by accumulating more or less
        else:
            global_batch = args.batch_size * args.nproc
            if global_batch % nproc:
                raise SystemExit(f"global batch {global_batch} does not split over {nproc} ranks")
            resume_batch = ["--training.batch_size", str(global_batch // nproc)]
        launch(launcher, nproc, dump, args, extra, resume_batch)
        resumed = losses(dump)
        if args.resume_nproc and args.resume_nproc != args.nproc:
            print(
                f"\nelastic resume {args.nproc} -> {args.resume_nproc} ranks: checking provenance, not losses"
            )
            ok = sorted(resumed) == list(range(1, args.steps + 1))
        else:
            ok = compare(reference, resumed, range(resume_step + 1, args.steps + 1))
            same = (
                sequences_by_step(read_provenance(os.path.join(dump, "provenance")))
                == first_provenance
            )
            print(f"provenance of the resumed run equals the first run's: {same}")
            ok &= same
            validation = validation_losses(dump)
            if reference_validation:
                after = {s: v for s, v in reference_validation.items() if s > resume_step}
                same = after == {s: v for s, v in validation.items() if s > resume_step}
                print(f"validation losses of the resumed run equal the first run's: {same}")
                ok &= same and bool(after)
    ok &= provenance_ok(dump)
    plot(reference, resumed, resume_step, os.path.join(dump, "loss_curves.png"))
    print("\nPASS: resumed run is exact" if ok else "\nFAIL: the resumed run differs")
    return 0 if ok else 1
