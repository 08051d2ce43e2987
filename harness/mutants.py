"""One-line mutants, kept beside the code they mutate, and the run that says which the
fast tests catch.

A mutant is a comment on its own line directly above the line it mutates (the next line
that is not itself a mutant's comment)::

    # mutant spike-row-lost: `self.bad_in_row, self.spikes_in_row` -> `0, self.spikes_in_row`; test/test_spikes.py::test_x

``old`` must occur exactly once in that line; ``new`` replaces it; the pytest node ids
after ``;`` are fast-tier tests that must fail on the mutant. The mutants are the bugs a
tired developer would write (MAX for MIN, a restore dropped, a position saved one step
early): each one that survives its tests names a property no fast test guards.

Owns: finding the mutants in the tree (``find``), saying which no longer apply
(``stale``: the line changed, a named test is gone or is not in the fast tier), and
running them (``run``): each applied alone in a copy of the tree, its tests run there
(``pytest -x -n 0``), caught where they fail, survived where they pass. The slow tier
runs them all (``test/test_mutants.py``); the fast tier checks that none is stale.

Never: touch the tree it reads. Mutants are applied in a temporary copy only, so a kill
-9 mid-run leaves a stray copy in the temporary folder, never a mutated source file.

Cost: one copy of the tracked files per run (~11 MB, the bundled corpus most of it);
per mutant, one pytest process (~3 s of start-up) and its tests' time.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from torchtitan import REPO_ROOT

# Where mutants may be kept: the package, the recipe and the campaign's oracle.
SEARCHED = ("torchtitan", "train.py", "harness")
MARKER = re.compile(r"^\s*# mutant (?P<name>[\w.-]+): `(?P<old>[^`]+)` -> `(?P<new>[^`]*)`; "
                    r"(?P<tests>\S.*)$")  # fmt: skip
TEST_TIMEOUT_S = 300


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # relative to the repository's root
    line: int  # 1-based: the line it mutates
    old: str
    new: str
    tests: tuple[str, ...]

    def apply(self, text: str) -> str:
        """``text`` (the file's) with this mutant applied."""
        lines = text.splitlines(keepends=True)
        lines[self.line - 1] = lines[self.line - 1].replace(self.old, self.new, 1)
        return "".join(lines)


def _sources(root: Path) -> list[Path]:
    found = []
    for name in SEARCHED:
        path = root / name
        found += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return [p for p in found if p.resolve() != Path(__file__).resolve()]


def find(root: Path = REPO_ROOT) -> list[Mutant]:
    """Every mutant kept in the tree at ``root``. Cost: one read of each source file."""
    mutants = []
    for path in _sources(root):
        lines = path.read_text().splitlines()
        for i, text in enumerate(lines):
            m = MARKER.match(text)
            if m is None:
                continue
            target = i + 1
            while target < len(lines) and MARKER.match(lines[target]):
                target += 1
            tests = tuple(t.strip() for t in m["tests"].split(",") if t.strip())
            mutants.append(Mutant(m["name"], str(path.relative_to(root)), target + 1,
                                  m["old"], m["new"], tests))  # fmt: skip
    return mutants


def _is_slow(decorators: list[ast.expr]) -> bool:
    return any("slow" in ast.unparse(d) for d in decorators)


def _fast_tests(path: Path) -> set[str] | None:
    """The names of the fast-tier test functions of a test file (None: no such file)."""
    if not path.is_file():
        return None
    tree = ast.parse(path.read_text())
    module_slow = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark"
                      for t in n.targets) and "slow" in ast.unparse(n.value)
                      for n in tree.body)  # fmt: skip
    if module_slow:
        return set()
    return {n.name for n in tree.body
            if isinstance(n, ast.FunctionDef) and n.name.startswith("test")
            and not _is_slow(n.decorator_list)}  # fmt: skip


def stale(mutants: list[Mutant], root: Path = REPO_ROOT) -> list[str]:
    """One line for each mutant that no longer applies: its name taken twice, its
    ``old`` not exactly once in its line, ``old == new``, no test named, or a named test
    that is not a fast-tier test of the tree. Cost: a parse of each named test file."""
    problems, seen, tests = [], set(), {}
    for m in mutants:
        where = f"{m.path}:{m.line} (mutant {m.name})"
        if m.name in seen:
            problems.append(f"{where}: the name is taken by another mutant")
        seen.add(m.name)
        line = (root / m.path).read_text().splitlines()[m.line - 1 : m.line]
        if not line or line[0].count(m.old) != 1:
            problems.append(f"{where}: `{m.old}` is not once in the line below it")
        if m.old == m.new:
            problems.append(f"{where}: it changes nothing")
        if not m.tests:
            problems.append(f"{where}: it names no test")
        for test in m.tests:
            file, _, name = test.partition("::")
            if file not in tests:
                tests[file] = _fast_tests(root / file)
            if tests[file] is None or name.split("[")[0] not in tests[file]:
                problems.append(f"{where}: {test} is not a fast test of the tree")
    return problems


@dataclass
class Verdict:
    mutant: Mutant
    caught: bool
    seconds: float
    output: str  # the tests' last lines

    def line(self) -> str:
        what = "caught" if self.caught else "SURVIVED"
        return f"{what:9s} {self.mutant.name:32s} {self.mutant.path}:{self.mutant.line} ({self.seconds:.0f} s)"


def _copy_tree(root: Path, into: Path) -> Path:
    """The files git tracks, and those not ignored, copied under ``into``."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=root, capture_output=True, check=True).stdout  # fmt: skip
    copy = into / "tree"
    for name in filter(None, listed.decode().split("\0")):
        src = root / name
        if src.is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, copy / name)
    return copy


def _run_tests(copy: Path, tests: tuple[str, ...]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(copy), str(copy / "test")])}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p",
                           "no:cacheprovider", *tests], cwd=copy, env=env, capture_output=True,
                          text=True, timeout=TEST_TIMEOUT_S)  # fmt: skip


def run(mutants: list[Mutant], root: Path = REPO_ROOT, report=print) -> list[Verdict]:
    """Each mutant applied alone to a copy of the tree, its tests run there: caught where
    they fail (pytest's exit 1), survived where they pass. A run whose tests cannot be
    collected or did not run (exit 2-5 without a failure: the mutant broke the import,
    a test is gone) raises: that is no verdict. Cost: one copy; a pytest process per mutant."""
    verdicts = []
    with tempfile.TemporaryDirectory(prefix="mutants-") as tmp:
        copy = _copy_tree(root, Path(tmp))
        probe = _run_tests(copy, ("--collect-only", *sorted({t for m in mutants for t in m.tests})))
        if probe.returncode != 0:
            raise RuntimeError(
                "the mutants' tests do not collect in the copy:\n" + probe.stdout[-3000:]
            )
        for m in mutants:
            target = copy / m.path
            original = target.read_text()
            target.write_text(m.apply(original))
            begin = time.monotonic()
            try:
                proc = _run_tests(copy, m.tests)
            finally:
                target.write_text(original)
            output = proc.stdout + proc.stderr
            # Exit 1: a test failed. Exit 3 (pytest's internal error) after a failure that
            # a test's loader workers outlived: torch's SIGCHLD handler raised in pytest's
            # reporting; the failure stands.
            failed = proc.returncode == 1 or (proc.returncode == 3
                                              and re.search(r"\b\d+ failed\b", output))  # fmt: skip
            if proc.returncode != 0 and not failed:
                raise RuntimeError(f"mutant {m.name}: its tests did not run (pytest exit "
                                   f"{proc.returncode}):\n{output[-3000:]}")  # fmt: skip
            tail = "\n".join(output.splitlines()[-15:])
            verdicts.append(Verdict(m, bool(failed), time.monotonic() - begin, tail))
            report(verdicts[-1].line())
    return verdicts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="only these mutants (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    args = parser.parse_args(argv)
    mutants = find()
    problems = stale(mutants)
    if problems:
        print("\n".join(["stale mutants (fix the comment or the test it names):", *problems]))
        return 2
    unknown = set(args.names) - {m.name for m in mutants}
    if unknown:
        print(f"no mutant named {', '.join(sorted(unknown))}; --list lists them")
        return 2
    chosen = [m for m in mutants if not args.names or m.name in args.names]
    if args.list:
        for m in chosen:
            print(f"{m.name:32s} {m.path}:{m.line}  `{m.old}` -> `{m.new}`")
        return 0
    verdicts = run(chosen)
    caught = sum(v.caught for v in verdicts)
    print(
        f"{caught} of {len(verdicts)} mutants caught ({100 * caught / max(1, len(verdicts)):.0f} %)"
    )
    for v in verdicts:
        if not v.caught:
            print(
                f"\nsurvived: {v.mutant.name} ({v.mutant.path}:{v.mutant.line}); its tests said:\n{v.output}"
            )
    return 0 if caught == len(verdicts) else 1
