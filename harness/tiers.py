"""How many tests each tier holds, counted from pytest's own collection, never typed.

The tiers: ``fast`` (``python -m pytest -q``: every test not marked ``slow``, those
marked ``cuda`` included, skipped where no GPU is visible), ``slow`` (``-m slow``) and,
inside the fast tier, ``cuda``. ``docs/testing.md`` gives the counts between the
``COUNTS_BEGIN`` / ``COUNTS_END`` markers; ``scripts/count_tests.py`` writes them there and
``test/test_docs.py`` checks them against the collection.

Two ways to the counts: from the items of a session that collected the whole ``test/``
tree (conftest keeps them, before ``-m`` deselects any: free), or from a fresh
``pytest --collect-only`` with this module as a plugin (one collection, ~10 s).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
PAGE = REPO_ROOT / "docs" / "testing.md"
COUNTS_BEGIN, COUNTS_END = "<!-- counts: scripts/count_tests.py -->", "<!-- /counts -->"
COUNTS = pytest.StashKey[dict]()
_PRINTED = "tier counts: "


def count(items) -> dict[str, int]:
    """{"fast": n, "slow": n, "cuda": n} of collected pytest items (by their marks)."""
    counts = {"fast": 0, "slow": 0, "cuda": 0}
    for item in items:
        marks = {m.name for m in item.iter_markers()}
        counts["slow" if "slow" in marks else "fast"] += 1
        counts["cuda"] += "cuda" in marks and "slow" not in marks
    return counts


def whole_tree(config) -> bool:
    """Whether this session collects every test: no paths but the test tree, no -k, no
    --deselect or --lf (``-m`` acts after conftest keeps the items)."""
    o = config.option
    paths = {Path(a.split("::")[0]).resolve() for a in config.args}
    return (paths <= {REPO_ROOT / "test"} and "::" not in "".join(config.args)
            and not o.keyword and not o.deselect and not getattr(o, "lf", False))  # fmt: skip


def remember(config, items) -> None:
    """Keep the counts of a whole-tree session's collection (conftest, before -m)."""
    if whole_tree(config):
        config.stash[COUNTS] = count(items)


def collected() -> dict[str, int]:
    """The counts from a fresh ``pytest --collect-only`` of the whole test tree."""
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "", "-n", "0",
           "-p", "harness.tiers", str(REPO_ROOT / "test")]  # fmt: skip
    out = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300).stdout
    line = next((x for x in out.splitlines() if x.startswith(_PRINTED)), None)
    if line is None:
        raise RuntimeError(f"pytest --collect-only printed no counts:\n{out[-2000:]}")
    return json.loads(line[len(_PRINTED) :])


def pytest_collection_finish(session):
    """As a plugin (``-p harness.tiers``): print the collection's counts."""
    print(_PRINTED + json.dumps(count(session.items)))


def stated(text: str) -> dict[str, int]:
    """The counts a page gives between the markers: "**N** tests" for each tier word."""
    if COUNTS_BEGIN not in text or COUNTS_END not in text:
        raise ValueError(f"{PAGE.name} has no {COUNTS_BEGIN} ... {COUNTS_END} block")
    block = text.split(COUNTS_BEGIN, 1)[1].split(COUNTS_END, 1)[0]
    found = dict((tier, int(n)) for n, tier in re.findall(r"\*\*(\d+)\*\* (fast|slow|cuda)", block))
    return found


def sentence(counts: dict[str, int]) -> str:
    """The block docs/testing.md carries between the markers."""
    return (
        f"{COUNTS_BEGIN}\nThe suite holds **{counts['fast']}** fast tests (of which "
        f"**{counts['cuda']}** cuda tests, skipped without a GPU) and **{counts['slow']}** slow "
        f"tests.\n{COUNTS_END}"
    )


def write(counts: dict[str, int], page: Path = PAGE) -> bool:
    """Put the counts in the page; whether it changed."""
    text = page.read_text()
    before, rest = text.split(COUNTS_BEGIN, 1)
    after = rest.split(COUNTS_END, 1)[1]
    new = before + sentence(counts) + after
    if new != text:
        page.write_text(new)
    return new != text


# ---- the time budgets: docs/testing.md states them, CI checks them ----------------------

BUDGETS_BEGIN, BUDGETS_END = "<!-- budgets: checked by .ci/run -->", "<!-- /budgets -->"
_BUDGET = re.compile(r"^\|\s*(install|fast|slow|total)\b[^|]*\|\s*(\d+)\s*s\s*\|", re.M)


def budgets(text: str) -> dict[str, int]:
    """{"install"|"fast"|"slow"|"total": seconds} from the page's budget table (a row per
    part: ``| fast tier ... | 240 s | ...``)."""
    if BUDGETS_BEGIN not in text or BUDGETS_END not in text:
        raise ValueError(f"{PAGE.name} has no {BUDGETS_BEGIN} ... {BUDGETS_END} block")
    block = text.split(BUDGETS_BEGIN, 1)[1].split(BUDGETS_END, 1)[0]
    return {part: int(seconds) for part, seconds in _BUDGET.findall(block)}


def over_budget(times: dict[str, float], limits: dict[str, int]) -> list[str]:
    """A line per part of CI that took longer than its budget (``total`` is their sum)."""
    times = {**times, "total": sum(times.values())}
    return [
        f"{part} took {times[part]:.0f} s, over its budget of {limits[part]} s (docs/testing.md)"
        for part in ("install", "fast", "slow", "total")
        if part in times and part in limits and times[part] > limits[part]
    ]


FAILS_CI = ("slow", "total")  # the parts whose overrun fails CI; the others are warned of


def main(argv: list[str] | None = None) -> int:
    """``python -m harness.tiers INSTALL_S FAST_S SLOW_S``: print CI's times against the
    budgets of docs/testing.md; exit 1 if the slow tier or the total is over (a line
    each), and warn of an install or a fast tier over theirs. The fast tier's own bound is
    measured on a quiet machine (docs/testing.md); a CI machine shared with other jobs
    varies by a fifth, so its fast tier is a warning, while the slow tier, which grows by
    whole scenarios, and the total, CI's hard limit, fail the run."""
    install, fast, slow = map(float, (argv if argv is not None else sys.argv[1:]))
    times = {"install": install, "fast": fast, "slow": slow}
    limits = budgets(PAGE.read_text())
    for part, took in {**times, "total": install + fast + slow}.items():
        print(f"ci time: {part:<8} {took:7.0f} s   budget {limits.get(part, '-')} s")
    failed = False
    for line in over_budget(times, limits):
        hard = line.split(" ", 1)[0] in FAILS_CI
        failed |= hard
        print(f"{'error' if hard else 'warning'}: {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
