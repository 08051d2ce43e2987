"""The command line the plot tools share (plot_mix, plot_spikes, plot_expert_load):
``RUN_FOLDER [--out PNG]`` plus a tool's own options, the PNG's path printed, and one
``error:`` line for a folder without the records the plot needs."""

from __future__ import annotations

import argparse


def plot_main(argv, prog: str, doc: str, default_png: str, plot, options=()) -> int:
    """Parse ``argv`` and call ``plot(args)`` (it returns the PNG's path). ``options``:
    ``(flags, kwargs)`` pairs for the tool's own arguments."""
    p = argparse.ArgumentParser(prog=prog, description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("run_folder", help="the run's dump folder (holding metrics.jsonl)")
    p.add_argument(
        "--out", default=None, help=f"the PNG to write (default RUN_FOLDER/{default_png})"
    )
    for flags, kwargs in options:
        p.add_argument(*flags, **kwargs)
    args = p.parse_args(argv)
    try:
        path = plot(args)
    except (OSError, ValueError) as e:
        print(f"error: {e}")
        return 1
    print(f"plot: {path}")
    return 0
