"""Launch a fault-tolerant job on one machine: a lighthouse and N replica groups.

    python scripts/ft_launch.py --groups 2 --nproc 1 --dump outputs/ft -- \
        --job.config_file train_configs/debug_model.toml --training.steps 200

Each group is its own torchrun (``<dump>/replica_<i>/log.txt``); kill one (``kill -9``
its torchrun) and the others train on; ``--restart`` starts a dead group again, which
heals from a live peer. Without ``--lighthouse`` one runs in this process.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from torchtitan.tools.ft_launch import group_command, group_dump, start_group, start_lighthouse


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=2, help="replica groups")
    parser.add_argument("--nproc", type=int, default=1, help="ranks per group")
    parser.add_argument("--dump", default="outputs/ft", help="job folder (replica_<i> inside)")
    parser.add_argument("--lighthouse", default="", help="a running lighthouse's address")
    parser.add_argument("--restart", action="store_true", help="start a dead group again")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then train.py's")
    a = parser.parse_args()
    args = [x for x in a.train_args if x != "--"]
    server = None if a.lighthouse else start_lighthouse()
    address = a.lighthouse or server.address()
    print(f"lighthouse {address}", flush=True)

    def start(i: int):
        group_dump(a.dump, i).mkdir(parents=True, exist_ok=True)
        command = group_command(i, a.groups, a.nproc, address, a.dump, args)
        return start_group(command, group_dump(a.dump, i) / "log.txt")

    groups = {i: start(i) for i in range(a.groups)}
    signal.signal(
        signal.SIGTERM,
        lambda *_: [os.killpg(p.pid, signal.SIGTERM) for p in groups.values() if p.poll() is None],
    )
    status = 0
    while groups:
        time.sleep(0.5)
        for i, proc in list(groups.items()):
            if proc.poll() is None:
                continue
            print(f"replica group {i} exited with {proc.returncode}", flush=True)
            if proc.returncode and a.restart and any(p.poll() is None for p in groups.values()):
                groups[i] = start(i)
                print(f"replica group {i} started again", flush=True)
                continue
            status = status or proc.returncode
            del groups[i]
    if server is not None:
        server.shutdown()
    return status


if __name__ == "__main__":
    sys.exit(main())
