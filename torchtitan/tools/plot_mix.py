"""Draw a run's mix from its ``metrics.jsonl``: each source's share of the tokens read
against the weights of its steps, and each source's passes.

    python scripts/plot_mix.py RUN_FOLDER [--out FILE.png] [--window STEPS]

The share at step ``s`` is the source's part of the tokens read over the ``window``
steps around it (from the cumulative ``source_tokens/<name>``); the weight line is
``mix_weight/<name>``; the passes are ``source_pass/<name> + source_read/<name>`` (a
pass read half is 0.5 more). Cost: one pass over the file (``runs.read_records``).
"""

from __future__ import annotations

from pathlib import Path

from torchtitan.records.metrics import MIX_WEIGHT, SOURCE_PASS, SOURCE_READ, SOURCE_TOKENS
from torchtitan.records.runs import read_records
from torchtitan.tools.plotting import plot_main


def mix_series(records: list[dict], window: int) -> dict:
    """Per source: steps, weights, shares (over the ``window`` steps around each; None
    where no tokens lie there) and passes read, from the records that carry the mix."""
    records = [r for r in records if any(k.startswith(MIX_WEIGHT) for k in r)]
    names = (
        [k[len(MIX_WEIGHT) :] for k in records[-1] if k.startswith(MIX_WEIGHT)] if records else []
    )
    steps = [r["step"] for r in records]
    out = {"steps": steps, "sources": {}}
    total = [sum(r.get(f"{SOURCE_TOKENS}{n}", 0) for n in names) for r in records]
    for name in names:
        tokens = [r.get(f"{SOURCE_TOKENS}{name}", 0) for r in records]
        shares, j, k = [], 0, 0
        for step in steps:  # over (step - window / 2, step + window / 2]
            while steps[j] < step - window // 2:
                j += 1
            while k + 1 < len(steps) and steps[k + 1] <= step + window - window // 2:
                k += 1
            spread = total[k] - total[j]
            shares.append((tokens[k] - tokens[j]) / spread if k > j and spread else None)
        out["sources"][name] = {
            "weight": [r.get(f"{MIX_WEIGHT}{name}", 0.0) for r in records],
            "share": shares,
            "passes": [
                r.get(f"{SOURCE_PASS}{name}", 0) + r.get(f"{SOURCE_READ}{name}", 0.0)
                for r in records
            ],  # fmt: skip
        }
    return out


def plot_mix(run_folder: str | Path, out: str | Path | None = None, window: int = 10) -> Path:
    """Draw ``run_folder``'s mix (its metrics.jsonl) into ``out`` (default:
    RUN_FOLDER/mix.png) and return the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_folder = Path(run_folder)
    series = mix_series(read_records(run_folder / "metrics.jsonl"), window)
    if not series["sources"]:
        raise ValueError(f"{run_folder}/metrics.jsonl has no mix_weight/<source>: no mix to draw")
    out = Path(out) if out else run_folder / "mix.png"
    steps = series["steps"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 2]})  # fmt: skip
    for i, (name, s) in enumerate(series["sources"].items()):
        color = f"C{i}"
        top.plot(steps, s["weight"], color=color, lw=2, label=f"{name}: weight")
        shown = [(x, y) for x, y in zip(steps, s["share"]) if y is not None]
        top.plot(*zip(*shown), "o", color=color, ms=2.5, alpha=0.6,
                 label=f"{name}: tokens read")  # fmt: skip
        bottom.plot(steps, s["passes"], color=color, lw=2, label=name)
    title = f"the mix: weights (lines), share of the tokens read over {window} steps (dots)"
    top.set(ylabel="share of tokens", ylim=(0, 1), title=title)
    top.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    bottom.set(xlabel="step", ylabel="passes read (pass + share of it)")
    bottom.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    return plot_main(
        argv,
        "plot_mix.py",
        __doc__,
        "mix.png",
        lambda a: plot_mix(a.run_folder, a.out, a.window),
        [(("--window",), {"type": int, "default": 10, "help": "steps a share is measured over"})],
    )
