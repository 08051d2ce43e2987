"""Draw a mixture-of-experts run's expert load from its ``metrics.jsonl``: one heatmap
per MoE layer, steps across, experts down, each cell the expert's share of the step's
routed tokens over the even share (1.0 even; above 1 busier).

    python scripts/plot_expert_load.py RUN_FOLDER [--out FILE.png]

Reads ``expert_loads`` (the step's tokens per expert, per layer, over all ranks) of
every logged step. Cost: one pass over the file (``runs.read_records``).
"""

from __future__ import annotations

from pathlib import Path

from torchtitan.records.metrics import EXPERT_LOADS
from torchtitan.records.runs import read_records
from torchtitan.tools.plotting import plot_main


def load_series(records: list[dict]) -> tuple[list[int], list[list[list[float]]]]:
    """(steps, per layer [expert][step] load over the mean) of the records with loads."""
    records = [r for r in records if EXPERT_LOADS in r]
    steps = [r["step"] for r in records]
    if not records:
        return steps, []
    layers = len(records[0][EXPERT_LOADS])
    series = []
    for layer in range(layers):
        rows = [r[EXPERT_LOADS][layer] for r in records]
        ratio = [[x * len(row) / (sum(row) or 1) for x in row] for row in rows]
        series.append([list(col) for col in zip(*ratio)])  # [expert][step]
    return steps, series


def plot_expert_load(run_folder: str | Path, out: str | Path | None = None) -> Path:
    """Draw ``run_folder``'s expert load (its metrics.jsonl) into ``out`` (default:
    RUN_FOLDER/expert_load.png) and return the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_folder = Path(run_folder)
    steps, series = load_series(read_records(run_folder / "metrics.jsonl"))
    if not series:
        raise ValueError(f"{run_folder}/metrics.jsonl has no {EXPERT_LOADS}: not an MoE run")
    out = Path(out) if out else run_folder / "expert_load.png"
    fig, axes = plt.subplots(len(series), 1, figsize=(9, 1.2 + 1.6 * len(series)), squeeze=False)
    top = max(2.0, max(v for layer in series for row in layer for v in row))
    for layer, (ax, grid) in enumerate(zip(axes[:, 0], series)):
        image = ax.imshow(grid, aspect="auto", cmap="magma", vmin=0.0, vmax=top,
                          extent=(steps[0] - 0.5, steps[-1] + 0.5, len(grid) - 0.5, -0.5),
                          interpolation="nearest")  # fmt: skip
        ax.set(ylabel=f"layer {layer}\nexpert")
    axes[-1, 0].set(xlabel="step (logged steps)")
    axes[0, 0].set_title("tokens per expert over the even share (1.0: balanced)")
    fig.colorbar(image, ax=axes[:, 0].tolist(), fraction=0.04)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    return plot_main(
        argv,
        "plot_expert_load.py",
        __doc__,
        "expert_load.png",
        lambda a: plot_expert_load(a.run_folder, a.out),
    )
