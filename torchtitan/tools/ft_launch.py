"""Launching a fault-tolerant job on one machine: a lighthouse and N replica groups,
each its own ``torchrun`` (scripts/ft_launch.py; the tests and bench_ft.py use it too).

Owns: the lighthouse settings (``LIGHTHOUSE``), starting a lighthouse in this process
(``start_lighthouse``) and the command line of one replica group (``group_command``):
its own rendezvous port, ``--fault_tolerance.*`` and a dump folder of its own
(``<dump>/replica_<i>``: its logs, provenance and checkpoints).

Never: train, or decide whether a run is correct.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from torchtitan import REPO_ROOT
from torchtitan.tools.launch import launcher_workers, run_env, torchrun_command

# join_timeout_ms: how long a quorum waits for a live (heartbeating) group that has not
# asked yet; long, so a group that is slower than its peer between two steps is waited
# for, never left out (a split into two quorums). heartbeat_timeout_ms: how soon a dead
# group is left out of the next quorum.
LIGHTHOUSE = {"min_replicas": 1, "join_timeout_ms": 60_000, "quorum_tick_ms": 20,
              "heartbeat_timeout_ms": 1_500}  # fmt: skip


def start_lighthouse(port: int = 0, min_replicas: int = 1, **settings):
    """A lighthouse in this process (torchft's Rust server, in the wheel); ``.address()``
    is what the groups are given, ``.shutdown()`` stops it."""
    from torchft.coordination import LighthouseServer

    return LighthouseServer(bind=f"[::]:{port}", **{**LIGHTHOUSE, "min_replicas": min_replicas,
                                                    **settings})  # fmt: skip


def group_dump(dump: str | Path, replica: int) -> Path:
    return Path(dump) / f"replica_{replica}"


def group_command(replica: int, groups: int, nproc: int, lighthouse: str, dump: str | Path,
                  args: list[str], dump_folder: str | Path | None = None) -> list[str]:  # fmt: skip
    """The torchrun command line of replica group ``replica`` of ``groups``, in
    ``<dump>/replica_<replica>`` (where a group that saves must live: its peers find its
    checkpoints there) or ``dump_folder``."""
    folder = dump_folder or group_dump(dump, replica)
    return torchrun_command(nproc, [
        *map(str, args), "--job.dump_folder", str(folder), "--fault_tolerance.enable",
        "--fault_tolerance.replica_id", str(replica), "--fault_tolerance.replica_groups",
        str(groups), "--fault_tolerance.lighthouse", lighthouse,
    ])  # fmt: skip


def start_group(command: list[str], log: str | Path, env: dict | None = None) -> subprocess.Popen:
    """Start one group in a session of its own (``os.killpg`` ends all its processes)."""
    out = open(log, "w")  # noqa: SIM115 - the child holds it; closed with the process
    return subprocess.Popen(command, cwd=REPO_ROOT, env=env or run_env(), stdout=out,
                            stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip


def kill_group(proc: subprocess.Popen):
    """SIGKILL a group: its torchrun and its workers (torchrun starts each worker in a
    session of its own, so a signal to torchrun's process group misses them)."""
    import signal

    for pid in [*launcher_workers(proc.pid), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def lighthouse_env() -> str | None:
    return os.environ.get("TORCHFT_LIGHTHOUSE")
