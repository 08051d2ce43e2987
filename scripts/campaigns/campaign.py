"""Every fault at once: seeded trials of jobs and fault schedules, judged against the uninterrupted run.

    python scripts/campaigns/campaign.py --trials 20 --seed 0      # seeds 0..19
    python scripts/campaigns/campaign.py --minutes 8 --seed 1234   # as many as fit
    python scripts/campaigns/campaign.py --hours 6                 # a soak
    python scripts/campaigns/campaign.py --replay '<a trial's JSON>'

A run starts with one trial of each class of ``campaign.PROPERTIES`` (a kill just after a
rewind, a kill in a save and in an upload, a paused store and a requeue, a replica group
killed in its quorum, a change of rank count, a spike planted under PP), each the moment
that one documented property guards; drawn trials fill the rest (``--no-strata``: drawn
trials only). Each drawn trial is drawn from its seed (harness/campaign.py says what a
trial draws and what the oracle checks). A failing trial prints its seed, its schedule as JSON and the command
that replays it; the run ends with trials, faults by kind, moments hit and violations,
and writes them to ``<root>/report.json``. Exits 1 on any violation. The SIGKILL and
SIGTERM campaigns (fault_injection.py, preemption_campaign.py) remain as the single-fault
modes they were.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import logging
import sys
import time
from pathlib import Path

from torchtitan import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT))
from harness import campaign, s3  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--trials", type=int, default=0, help="trials (seeds seed..seed+N-1)")
    p.add_argument("--seed", type=int, default=0, help="the first trial's seed")
    p.add_argument("--minutes", type=float, default=0, help="run trials while time is left")
    p.add_argument("--hours", type=float, default=0, help="a soak of this many hours")
    p.add_argument("--replay", default="", help="one trial's JSON, as a failure printed it")
    p.add_argument("--root", default="outputs/campaign", help="where trials run")
    p.add_argument("--no-bucket", action="store_true", help="no loopback S3 server")
    p.add_argument("--no-strata", action="store_true", help="no trial of each class first")
    p.add_argument("--stop-at-violation", action="store_true", help="end at the first one")
    p.add_argument(
        "--only",
        choices=["all", "groups", "plain"],
        default="all",
        help="run only the seeds that draw replica groups, or none (others skipped)",
    )
    args = p.parse_args(argv)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # the S3 server's request lines
    root = Path(args.root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    budget = args.minutes * 60 + args.hours * 3600
    bucket_ok = not args.no_bucket and s3.missing() is None
    traffic = campaign.Writes()
    server = s3.local_s3(traffic) if bucket_ok else contextlib.nullcontext((None, None))
    tally = {"trials": 0, "violations": 0, "faults": collections.Counter(),
             "moments": collections.Counter(), "failed": [], "strata": {}}  # fmt: skip
    begin = time.monotonic()
    with server as (bucket, endpoint):
        runner = campaign.Runner(root, (bucket, endpoint, traffic) if bucket_ok else None)
        seed = args.seed
        # One trial of each class first (those on a bucket where there is one), then drawn ones.
        first = [] if args.replay or args.no_strata or args.only != "all" else [
            t for t in campaign.strata(args.seed) if bucket_ok or not t.job.bucket]  # fmt: skip
        while True:
            if args.replay:
                trial = campaign.Trial.from_json(args.replay)
            elif first:
                trial = first.pop(0)
            else:
                if args.trials and tally["trials"] >= args.trials:
                    break
                if budget and time.monotonic() - begin > budget:
                    break
                if not args.trials and not budget:
                    break
                trial = campaign.draw(seed, bucket_ok)
                seed += 1
                if args.only != "all" and bool(trial.job.groups) != (args.only == "groups"):
                    continue  # another kind of trial: its seed is skipped, not counted
            traffic.hold, traffic.fail_next = None, 0
            started = time.monotonic()
            try:
                out = runner.run(trial)
            except Exception as e:  # noqa: BLE001 - the campaign's own failure is a verdict too
                out = campaign.Outcome(violations=[f"the campaign failed: {e!r}"])
            tally["trials"] += 1
            if trial.stratum:
                tally["strata"][trial.stratum] = "ok" if not out.violations else "violation"
            tally["faults"].update(f.kind for f in trial.faults)
            tally["moments"].update(out.moments)
            verdict = "ok" if not out.violations else "VIOLATION: " + "; ".join(out.violations)
            print(f"trial {trial.seed}{'/' + trial.stratum if trial.stratum else ''}: {_summary(trial)} | lives {out.lives} | "
                  f"{', '.join(out.moments) or 'no fault hit'} | {time.monotonic() - started:.0f}s"
                  f" | {verdict}", flush=True)  # fmt: skip
            if out.violations:
                tally["violations"] += 1
                tally["failed"].append(json.loads(trial.to_json()))
                print(f"  seed {trial.seed}, schedule {trial.to_json()}\n"
                      f"  replay: {campaign.replay_command(trial)}", flush=True)  # fmt: skip
                if out.evidence:
                    print("  stacks of the hung life:\n    " + out.evidence.replace("\n", "\n    "),
                          flush=True)  # fmt: skip
            if args.replay or (args.stop_at_violation and out.violations):
                break
    report = {**tally, "faults": dict(tally["faults"]), "moments": dict(tally["moments"]),
              "seconds": round(time.monotonic() - begin)}  # fmt: skip
    (root / "report.json").write_text(json.dumps(report, indent=1))
    print(
        f"\ntrials {report['trials']}  violations {report['violations']}  "
        f"faults {report['faults']}  moments {report['moments']}  {report['seconds']}s"
    )
    return 1 if report["violations"] else 0


def _summary(t: campaign.Trial) -> str:
    j = t.job
    ft = f"{j.groups}x{j.ranks}r ft" + (f" min{j.min_groups}" if j.min_groups > 1 else "")
    parts = [ft if j.groups else f"{j.ranks}r {j.layout}", f"w{j.workers}",
             "async" if j.async_mode == "async" else "sync", "bucket" if j.bucket else "local"]  # fmt: skip
    parts += ["tier"] * j.local_tier + ([j.mix] if j.mix != "none" else [])
    parts += [f"spike:{j.spike}" + (f"/w{j.spike_window}" if j.spike_window else "")] * (
        j.spike != "none"
    )
    parts += [f"log/{j.log_freq}"] * (j.log_freq > 1)
    parts += [f"{p.kind}@{p.step}{'*' if p.recurs else ''}" for p in t.plants]
    faults = [f.kind + (f"/{f.moment}" if f.kind in ("kill", "store") else "")
              + (f"/{f.target}/{f.moment}" if f.kind == "group" else "") for f in t.faults]  # fmt: skip
    return " ".join(parts) + " | " + " ".join(faults)


if __name__ == "__main__":
    sys.exit(main())
