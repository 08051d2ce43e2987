"""Draw a run's loss with its spikes, rewinds and skipped data, from its records.

    python scripts/plot_spikes.py RUN_FOLDER [--out FILE.png]

The loss the run kept (``metrics.jsonl``), the steps a rewind undid
(``metrics_rewound.jsonl``, one colour per rewind), the steps whose update was dropped
and the spikes (``spikes.jsonl``), and, shaded, the steps whose data each rewind
skipped. Cost: one pass over each file.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from torchtitan.records.runs import read_records
from torchtitan.tools.plotting import plot_main


def _lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def spike_series(run_folder: str | Path) -> dict:
    """What the picture shows: ``kept`` and ``undone`` ({rewind: ...}) as (steps, losses),
    ``dropped`` and ``spikes`` (steps), ``skipped`` ([first, last] step ranges whose
    data was passed over)."""
    run_folder = Path(run_folder)
    kept = read_records(run_folder / "metrics.jsonl")
    undone: dict[int, tuple[list, list]] = {}
    for r in _lines(run_folder / "metrics_rewound.jsonl"):
        steps, values = undone.setdefault(r["rewind"], ([], []))
        steps.append(r["step"])
        values.append(r["loss"])
    events = _lines(run_folder / "spikes.jsonl")
    return {
        "kept": ([r["step"] for r in kept], [r["loss"] for r in kept]),
        "undone": undone,
        "dropped": sorted({e["step"] for e in events if e.get("action") == "skip"}),
        "spikes": sorted({e["step"] for e in events if e.get("kind") == "spike"}),
        "skipped": [
            [e["skip_steps"][0], sum(e["skip_steps"]) - 1]
            for e in events
            if e.get("kind") == "rewind"
        ],  # fmt: skip
    }


def plot_spikes(run_folder: str | Path, out: str | Path | None = None) -> Path:
    """Draw ``run_folder``'s loss, spikes and skips into ``out`` (default:
    RUN_FOLDER/spikes.png) and return the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = spike_series(run_folder)
    out = Path(out) if out else Path(run_folder) / "spikes.png"
    fig, ax = plt.subplots(figsize=(9, 4))
    for i, (first, last) in enumerate(s["skipped"]):
        ax.axvspan(first - 0.5, last + 0.5, color="0.85", zorder=0,
                   label="steps whose data was skipped" if i == 0 else None)  # fmt: skip
    steps, losses = s["kept"]
    finite = [(x, y) for x, y in zip(steps, losses) if math.isfinite(y)]
    ax.plot(*zip(*finite), color="C0", lw=1.5, label="loss (kept)")
    for n, (u_steps, u_losses) in sorted(s["undone"].items()):
        shown = [(x, y) for x, y in zip(u_steps, u_losses) if math.isfinite(y)]
        if shown:
            ax.plot(*zip(*shown), "o-", color=f"C{n + 1}", ms=3, lw=0.8,
                    label=f"undone by rewind {n}")  # fmt: skip
    for i, step in enumerate(s["spikes"]):
        ax.axvline(step, color="C3", ls=":", lw=1, label="spike" if i == 0 else None)
    for i, step in enumerate(s["dropped"]):
        ax.axvline(step, color="C1", ls="--", lw=1, label="update dropped" if i == 0 else None)
    ax.set(xlabel="step", ylabel="loss", yscale="log", title="loss, spikes and skipped data")
    ax.legend(fontsize=7, loc="upper right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    return plot_main(
        argv, "plot_spikes.py", __doc__, "spikes.png", lambda a: plot_spikes(a.run_folder, a.out)
    )
