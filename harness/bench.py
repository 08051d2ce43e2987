"""The benchmarks' harness: what every ``scripts/benchmarks/bench_*.py`` shares.

Owns: the common arguments (``--smoke`` and the sizes it sets, ``--json PATH``,
``--work DIR``, ``--rounds``, ``--peer-python``, ``--require-quiet``) and the work
folder; a program run in a fresh interpreter that answers with one ``RESULT`` line (ours,
another checkout, or the peer: torchtitan 0.3.0 in a virtual environment of its own,
which ``peer_check`` admits or skips, saying why); the report (markdown tables, the JSON dump, what was run where);
the machine every run records (``harness.machine``: the CPU, its vector level, and the
share of the machine other processes used from the arguments' parse to the save: over
``machine.QUIET_PCT`` the run says so, and with ``--require-quiet`` refuses).

Never: measure or decide a figure (each benchmark keeps its measurement and its JSON
keys), or install a peer. Corpora are ``harness.corpus``'s.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from harness import machine
from torchtitan import REPO_ROOT

PEER_VERSION = "0.3.0"
# Set to 1, as --require-quiet: a run on a busy machine exits 2 and writes no JSON.
REQUIRE_QUIET_ENV = "TORCHTITAN_BENCH_REQUIRE_QUIET"


class Arguments(argparse.ArgumentParser):
    """A benchmark's command line: its docstring as the help, ``--smoke`` (setting each of
    ``smoke``'s arguments, which its help lists) and ``--json PATH``; ``--rounds`` where
    ``rounds`` (its default) is given, ``--work DIR`` where ``work`` is (its default; ""
    is a temporary folder removed at the end), ``--peer-python`` where ``peer``, and
    ``--require-quiet``."""

    def __init__(self, doc: str, *, smoke: dict, rounds: int | None = None,
                 work: str | None = None, peer: bool = False):  # fmt: skip
        super().__init__(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
        self.smoke = smoke
        sizes = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in smoke.items())
        self.add_argument("--smoke", action="store_true", help="tiny sizes, to check the script "
                          "runs" + (f" ({sizes})" if sizes else ""))  # fmt: skip
        self.add_argument("--json", default="", metavar="PATH", help="the result as JSON, to PATH")
        self.add_argument("--require-quiet", action="store_true",
                          help=f"refuse (exit 2) where other processes keep more than "
                          f"{machine.QUIET_PCT:g} %% of the machine busy: checked for 1 s "
                          f"before and over the whole run ({REQUIRE_QUIET_ENV}=1 sets it)")  # fmt: skip
        if rounds is not None:
            self.add_argument("--rounds", type=int, default=rounds,
                              help="interleaved rounds; the figures are their medians")  # fmt: skip
        if work is not None:
            self.add_argument("--work", default=work, metavar="DIR",
                              help="where corpora and runs go (kept; default: "
                              + (work or "a temporary folder, removed") + ")")  # fmt: skip
        if peer:
            self.add_argument("--peer-python", default="", metavar="PYTHON",
                              help=f"python of a virtual environment with torchtitan "
                              f"{PEER_VERSION} (without it the peer is skipped, saying why)")  # fmt: skip

    def parse(self, argv=None) -> argparse.Namespace:
        """The arguments; the run's load is measured from here (``args.load_from``) to
        ``save``."""
        args = self.parse_args(argv)
        if args.smoke:
            for key, value in self.smoke.items():
                assert hasattr(args, key), f"--smoke sets {key}, which is no argument"
                setattr(args, key, value)
        # Taken from the environment once: the processes this run starts (its ranks parse
        # too) must not refuse for the load their siblings make.
        args.require_quiet |= os.environ.pop(REQUIRE_QUIET_ENV, "") == "1"
        if args.require_quiet:  # a busy machine is refused before the work, not after it
            load = machine.sample(1.0)
            if not load["quiet"]:
                print(refusal(load), file=sys.stderr)
                raise SystemExit(2)
        args.load_from = machine.read()
        return args


@contextmanager
def work_folder(args, prefix: str) -> Iterator[Path]:
    """``--work DIR`` (made if need be, kept), else a temporary folder removed at the end."""
    if args.work:
        folder = Path(args.work).resolve()
        folder.mkdir(parents=True, exist_ok=True)
        yield folder
    else:
        with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
            yield Path(tmp)


# ---- programs in a fresh interpreter: ours, another checkout, the peer ------------------


class PeerUnavailable(Exception):
    """The peer cannot run here (the message says why); the benchmark skips it."""


def peer_check(imports: str, what: str) -> str:
    """Python source a peer's program starts with: ``args`` (its JSON argument), then
    ``imports`` (the peer's modules, ``import torchtitan`` first); it prints SKIP with the
    reason and exits 0 where they fail, or where the torchtitan imported is not
    PEER_VERSION or is this checkout (``args["repo"]``)."""
    body = textwrap.indent(textwrap.dedent(imports).strip(), "    ")
    return f"""import importlib.metadata, json, os, statistics, sys, time
args = json.loads(sys.argv[1])
try:
    import torchtitan
{body}
    version = importlib.metadata.version("torchtitan")
except Exception as e:
    print("SKIP cannot import torchtitan {PEER_VERSION}'s {what}:", repr(e))
    sys.exit(0)
if version != "{PEER_VERSION}" or os.path.realpath(torchtitan.__file__).startswith(args["repo"]):
    print(f"SKIP torchtitan {{version}} at {{torchtitan.__file__}} is not torchtitan {PEER_VERSION}")
    sys.exit(0)
"""


def program_env(pythonpath: str | None = None) -> dict:
    """One thread per process, and ``PYTHONPATH`` only ``pythonpath`` (None: none), so that
    the path alone decides whose torchtitan a program imports."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return env


def run_program(program: str, args: dict, *, python: str = sys.executable,
                pythonpath: str | None = None, cwd: str | Path | None = None,
                timeout: float | None = None, what: str = "") -> dict:  # fmt: skip
    """The JSON after ``RESULT`` in the output of Python source ``program``, run by
    ``python`` with ``args`` as JSON in ``sys.argv[1]`` (``repo``, this checkout's root,
    unless ``args`` names another), in ``program_env(pythonpath)``, from ``cwd`` (default:
    the temporary folder, so that no checkout is on the path by chance). Raises
    PeerUnavailable where the program printed SKIP, SystemExit where it failed, and
    subprocess.TimeoutExpired past ``timeout``."""
    argument = json.dumps({"repo": str(REPO_ROOT), **args})
    proc = subprocess.run([python, "-c", program, argument], cwd=cwd or tempfile.gettempdir(),
                          env=program_env(pythonpath), capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip
    if "SKIP" in proc.stdout:
        raise PeerUnavailable(proc.stdout.split("SKIP", 1)[1].strip())
    if proc.returncode != 0 or "RESULT" not in proc.stdout:
        raise SystemExit(f"{what or python} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.split("RESULT", 1)[1])


# ---- the report -------------------------------------------------------------------------


def markdown_table(header: list[str], rows: list[list]) -> str:
    """``rows`` (cells already formatted, or anything ``str`` takes) under ``header``."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def print_table(header: list[str], rows: list[list], title: str = ""):
    if title:
        print(f"\n{title}\n")
    print(markdown_table(header, rows))


def about(argv, commit: bool = False) -> dict:
    """What was run, when and where (and at which commit of this checkout, if ``commit``)."""
    facts = {"command": " ".join([Path(sys.argv[0]).name,
                                  *(argv if argv is not None else sys.argv[1:])]),
             "date": datetime.date.today().isoformat()}  # fmt: skip
    if commit:
        proc = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO_ROOT,
                              capture_output=True, text=True)  # fmt: skip
        facts["commit"] = proc.stdout.strip()
    cpus = f"{os.cpu_count()} CPUs, {platform.platform()}"
    return facts | {"platform": f"{cpus}, Python {platform.python_version()}"}


def machine_report(args) -> dict:
    """{"cpu", "vector", "torch_capability", "cores", "others_busy_pct", "quiet", "wall_s"}:
    the machine, and the share of it that other processes used since ``parse``."""
    return machine.cpu_facts() | machine.load_between(args.load_from, machine.read())


def load_lines(facts: dict) -> list[str]:
    """What the table output ends with: the machine and its load, and a warning where
    others kept it busy."""
    lines = [f"machine: {machine.describe(facts)}; other processes used "
             f"{facts['others_busy_pct']:.1f} % of it over {facts['wall_s']:.1f} s"]  # fmt: skip
    if not facts["quiet"]:
        lines.append(f"WARNING: not a quiet machine: other processes used "
                     f"{facts['others_busy_pct']:.1f} % of its {facts['cores']} cores while "
                     f"this ran (over {machine.QUIET_PCT:g} %): its figures are not a quiet "
                     f"machine's")  # fmt: skip
    return lines


def refusal(load: dict) -> str:
    return (f"refused (--require-quiet): other processes used {load['others_busy_pct']:.1f} % "
            f"of this machine over {load['wall_s']:.1f} s, over {machine.QUIET_PCT:g} %; "
            f"run it when the machine is quiet")  # fmt: skip


def save(args, result: dict) -> int:
    """Print the machine and its load under the tables; ``result`` with ``"machine"`` (see
    ``machine_report``) as JSON to ``--json PATH``, where given. The benchmark's exit
    status: 0, or 2 with one line where ``--require-quiet`` and the machine was busy
    (nothing written)."""
    assert isinstance(result, dict), "a benchmark's result is a dict (rows under a key)"
    facts = machine_report(args)
    print("\n" + "\n".join(load_lines(facts)))
    if args.require_quiet and not facts["quiet"]:
        print(refusal(facts), file=sys.stderr)
        return 2
    if args.json:
        Path(args.json).write_text(json.dumps(result | {"machine": facts}, indent=1))
    return 0
