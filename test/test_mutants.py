"""The one-line mutants kept beside the code (harness/mutants.py, scripts/mutants.py):
every one still applies and names fast tests of the tree (fast tier), and every one is
caught by its tests (slow tier: each applied alone in a copy of the tree)."""

from __future__ import annotations

import shutil

import pytest
from helpers import REPO

from harness import mutants

# What the list must cover (issue #68): the spike guard, the lease, Muon, the WSD branch,
# the loader's windows, the campaign's oracle, and the write guard.
COVERED = {"torchtitan/spikes.py", "torchtitan/checkpoint/lease.py", "torchtitan/config/schema.py",
           "torchtitan/optim.py", "torchtitan/data/loader.py", "harness/campaign.py",
           "torchtitan/io/storage.py", "torchtitan/checkpoint/store.py"}  # fmt: skip


def test_every_mutant_still_applies_and_names_fast_tests():
    """Each mutant's ``old`` is once in the line below it, its name is its own, and the
    tests it names are fast tests of the tree; the list covers the guarded areas.
    Negative controls, in a copy: a mutated line edited since (``old`` gone) and a
    test renamed are each reported stale."""
    found = mutants.find()
    assert mutants.stale(found) == []
    assert COVERED <= {m.path for m in found}
    m = found[0]
    text = (REPO / m.path).read_text()
    changed = [a != b for a, b in zip(text.splitlines(), m.apply(text).splitlines())]
    assert sum(changed) == 1 and changed.index(True) == m.line - 1


def test_a_mutant_whose_line_or_test_changed_is_stale(tmp_path):
    """A copy of the tree where the first mutant's line was rewritten, and one where the
    test it names was renamed: both are named stale, each for its reason."""
    m = mutants.find()[0]
    for what in ("line", "test"):
        root = tmp_path / what
        for name in (m.path, m.tests[0].split("::")[0]):
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(REPO / name, root / name)
        if what == "line":
            path = root / m.path
            lines = path.read_text().splitlines(keepends=True)
            lines[m.line - 1] = lines[m.line - 1].replace(m.old, "rewritten")
            path.write_text("".join(lines))
        else:
            path = root / m.tests[0].split("::")[0]
            test = m.tests[0].split("::")[1].split("[")[0]
            path.write_text(path.read_text().replace(f"def {test}(", f"def {test}_renamed("))
        (problem,) = mutants.stale([m], root)
        assert ("is not once in the line" if what == "line" else "is not a fast test") in problem


@pytest.mark.slow
@pytest.mark.time_limit(1500)
def test_every_mutant_is_caught_by_the_fast_tests_it_names():
    """Each mutant applied alone to a copy of the tree fails the fast tests it names
    (scripts/mutants.py: 100 % caught)."""
    verdicts = mutants.run(mutants.find())
    survived = [f"{v.mutant.name}: {v.output}" for v in verdicts if not v.caught]
    assert not survived, "\n\n".join(survived)
