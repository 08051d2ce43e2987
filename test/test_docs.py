"""The README and the docs/ pages: what their commands and links name exists.

Collected from README.md and docs/*.md (fenced blocks only, indented ones too, as in a
list item): every shell block (bash, sh, shell, console) and every TOML block. Checked:
- each ``--section.key`` (or ``--section.key=value``) in a shell block is an option the
  command line accepts, looked up by the command line's own ``_lookup`` (so an unknown
  section fails as an unknown key does); no script takes a dotted option of its own, so
  every dotted flag is a config key;
- each key of a TOML block is one the TOML reader accepts, with a value of its type;
- each ``scripts/...`` or ``train_configs/...`` path in a shell block exists;
- each relative link (and image) points at a file that exists, and its ``#anchor`` at a
  heading of that file;
- the README is a front page (at most 250 lines) and gives CI's test commands exactly.

Nothing is launched; the cost is reading the pages once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness import tiers
from torchtitan import REPO_ROOT
from torchtitan.config import cli
from torchtitan.config.errors import ConfigError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

README = REPO_ROOT / "README.md"
README_MAX_LINES = 250
SHELL = {"bash", "sh", "shell", "console"}
# The pages' stand-in for "any option" (`train.py ... [--section.key value ...]`).
PLACEHOLDER = ("section", "key")

_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
_FLAG = re.compile(r"(?<![\w-])--([A-Za-z_][\w-]*)\.([^\s=\]\)'\"`,;|]*)")
_PATH = re.compile(r"(?<![\w./-])((?:scripts|train_configs)/[\w./-]*[\w/])")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_CODE_SPAN = re.compile(r"`([^`]+)`")


@dataclass
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO_ROOT)}:{self.line}"


def pages() -> list[Path]:
    return [README, *sorted((REPO_ROOT / "docs").glob("*.md"))]


def split_page(text: str) -> tuple[list[tuple[int, str, str]], list[str]]:
    """The fenced blocks of a page as (line, lang, text), and its lines outside them."""
    blocks, prose, lines, i = [], [], text.splitlines(), 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            prose.append(lines[i])
            i += 1
            continue
        indent, fence, lang = m.groups()
        start, body, i = i + 1, [], i + 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            line = lines[i]
            body.append(line[len(indent) :] if line.startswith(indent) else line.lstrip())
            i += 1
        blocks.append((start, lang.lower(), "\n".join(body)))
        i += 1  # the closing fence
    return blocks, prose


def blocks_of(page: Path) -> list[Block]:
    found, _ = split_page(page.read_text())
    return [Block(page, line, lang, text) for line, lang, text in found]


def all_blocks(langs: set[str]) -> list[Block]:
    return [b for page in pages() for b in blocks_of(page) if b.lang in langs]


def flag_problems(text: str, where: str) -> list[str]:
    """Each dotted ``--section.key`` in shell text that the command line would refuse."""
    problems = []
    for section, key in _FLAG.findall(text):
        if (section, key) == PLACEHOLDER:
            continue
        try:
            cli._lookup(section, key, f"--{section}.{key}")
        except ConfigError as e:
            problems.append(f"{where}: {e}")
    return problems


def toml_problems(text: str, where: str) -> list[str]:
    """Each key of a TOML snippet that the config reader would refuse, or a wrong type."""
    try:
        tables = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        return [f"{where}: not valid TOML: {e}"]
    problems = []
    for section, table in tables.items():
        for key, value in table.items():
            try:
                f = cli._lookup(section, key, where)
                cli._from_toml(f"{section}.{key}", f.type, value)
            except ConfigError as e:
                problems.append(f"{where}: {e}")
    return problems


def path_problems(text: str, where: str) -> list[str]:
    """Each scripts/ or train_configs/ path in shell text that does not exist."""
    return [
        f"{where}: {path} does not exist"
        for path in _PATH.findall(text)
        if not (REPO_ROOT / path).exists()
    ]


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, '-' for ' '."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """A page's heading anchors; a repeated heading gets -1, -2, ... as on GitHub."""
    _, prose = split_page(text)
    found, seen = set(), {}
    for line in prose:
        m = _HEADING.match(line)
        if m:
            base = slug(m.group(2))
            n = seen.get(base, 0)
            found.add(f"{base}-{n}" if n else base)
            seen[base] = n + 1
    return found


def link_problems(page: Path, text: str) -> list[str]:
    """Each relative link of a page whose file, or heading, does not exist."""
    _, prose = split_page(text)
    problems = []
    for target in _LINK.findall(re.sub(r"`[^`]*`", "", "\n".join(prose))):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        name, _, anchor = target.partition("#")
        file = (page.parent / name).resolve() if name else page
        if name and not file.exists():
            problems.append(f"{page.name}: link {target!r}: {name} does not exist")
        elif anchor and file.suffix == ".md":
            own = text if file == page else file.read_text()
            if anchor not in anchors(own):
                problems.append(f"{page.name}: link {target!r}: no heading #{anchor}")
    return problems


# ---- the pages --------------------------------------------------------------------------


def test_the_pages_have_shell_blocks_to_check():
    # A collector that finds nothing would pass every check below.
    shell = all_blocks(SHELL)
    assert len(shell) >= 20
    assert {b.page.name for b in shell} >= {"README.md", "benchmarks.md"}
    assert sum(len(_FLAG.findall(b.text)) for b in shell) >= 20


def test_every_dotted_flag_in_a_shell_block_is_a_config_key():
    problems = [p for b in all_blocks(SHELL) for p in flag_problems(b.text, b.where)]
    assert not problems, "\n".join(problems)


def test_every_toml_block_holds_config_keys_of_their_types():
    blocks = all_blocks({"toml"})
    assert blocks
    problems = [p for b in blocks for p in toml_problems(b.text, b.where)]
    assert not problems, "\n".join(problems)


def test_every_script_and_config_a_shell_block_names_exists():
    problems = [p for b in all_blocks(SHELL) for p in path_problems(b.text, b.where)]
    assert not problems, "\n".join(problems)


def test_every_relative_link_points_at_a_file_and_heading_that_exist():
    problems = [p for page in pages() for p in link_problems(page, page.read_text())]
    assert not problems, "\n".join(problems)


def test_no_script_takes_a_dotted_option_of_its_own():
    # The flag check treats every dotted flag as a config key; a script's own dotted
    # argparse option would be reported as an unknown section.
    sources = [*(REPO_ROOT / "scripts").rglob("*.py"), *(REPO_ROOT / "torchtitan").rglob("*.py")]
    own = [
        f"{p.relative_to(REPO_ROOT)}: {m}"
        for p in sources
        for m in re.findall(r"add_argument\(\s*[\"']--[\w-]+\.[\w-]+", p.read_text())
    ]
    assert not own, "\n".join(own)


def test_the_readme_is_a_front_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"


def test_the_readme_gives_the_ci_test_commands_exactly():
    ci = [
        line.strip()
        for line in (REPO_ROOT / ".ci" / "run").read_text().splitlines()
        if line.strip().startswith("python -m pytest")
    ]
    assert ci == ["python -m pytest -q", "python -m pytest -q -m slow"]
    _, prose = split_page(README.read_text())
    commands = {c.split("#")[0].strip() for c in _CODE_SPAN.findall("\n".join(prose))}
    for b in blocks_of(README):
        if b.lang in SHELL:
            for line in b.text.splitlines():
                commands.update(c.strip() for c in line.split("#")[0].split("&&"))
    missing = [c for c in ci if c not in commands]
    assert not missing, f"README.md does not give CI's command(s) {missing}"


# ---- the checkers catch what they should (planted pages) --------------------------------


def test_the_flag_check_reports_a_wrong_key_and_a_wrong_section_and_passes_good_ones():
    text = (
        "torchrun --nproc_per_node=2 train.py --job.config_file=train_configs/debug_model.toml \\\n"
        "  --training.seq_len 128 --checkpoint.enable_checkpoint --num-proc 4 [--section.key v]\n"
        "python train.py --training.no_such_key 1 --trainin.seq_len 64\n"
    )
    problems = flag_problems(text, "planted")
    assert len(problems) == 2, problems
    assert "unknown key training.no_such_key" in problems[0]
    assert "unknown section 'trainin'" in problems[1]
    assert flag_problems("python train.py --training.seq_len=64 --model.flavor 125M", "ok") == []


def test_the_toml_check_reports_a_wrong_key_and_a_wrong_type():
    good = '[checkpoint]\ninterval = 5\n[[training.datasets]]\nname = "kjv"\nweight = 0.3\n'
    assert toml_problems(good, "ok") == []
    bad = '[checkpoint]\nintervall = 5\n[training]\nseq_len = "long"\n[[training.datasets]]\nnom = 1\n'
    problems = toml_problems(bad, "planted")
    assert len(problems) == 3, problems
    assert "checkpoint.intervall" in problems[0] and "training.seq_len" in problems[1]


def test_the_path_check_reports_a_missing_script():
    text = "python scripts/deterministic_resume.py && python scripts/no_such_bench.py --smoke\n"
    assert path_problems(text, "planted") == ["planted: scripts/no_such_bench.py does not exist"]
    assert path_problems("./run_train.sh train_configs/debug_model.toml", "ok") == []


def test_the_block_collector_takes_shell_blocks_and_indented_ones_only():
    page = (
        "# Title\n```bash\npython train.py --a.b 1\n```\n- item\n\n  ```sh\n  --c.d 2\n  ```\n"
        "```python\nx = '--e.f'\n```\n```console\n$ --g.h\n```\n    --i.j indented, unfenced\n"
    )
    blocks, prose = split_page(page)
    shell = [(lang, text) for _, lang, text in blocks if lang in SHELL]
    assert shell == [("bash", "python train.py --a.b 1"), ("sh", "--c.d 2"), ("console", "$ --g.h")]
    assert "    --i.j indented, unfenced" in prose


def test_the_link_check_reports_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n## Section: `a.b` 2\n")
    page = tmp_path / "page.md"
    text = (
        "# Page\n[fine](other.md#section-ab-2) [also](#page) [web](https://x.org/#no)\n"
        "[gone](missing.md) [lost](other.md#no-such-heading) [self](#nope)\n"
        "```bash\n# [in code](ignored.md)\n```\n"
    )
    problems = link_problems(page, text)
    assert len(problems) == 3, problems
    assert "missing.md does not exist" in problems[0]
    assert "#no-such-heading" in problems[1] and "#nope" in problems[2]


@pytest.mark.parametrize(
    "heading, anchor",
    [
        ("Proving the GPU path: `scripts/gpu_check.sh`", "proving-the-gpu-path-scriptsgpu_checksh"),
        ("5b. An interval shorter than the write", "5b-an-interval-shorter-than-the-write"),
        ("Recovery options are safe to requeue", "recovery-options-are-safe-to-requeue"),
    ],
)
def test_anchors_are_githubs(heading, anchor):
    assert slug(heading) == anchor


# ---- figures a script computes: the tiers' counts ---------------------------------------


def test_the_testing_page_gives_the_tiers_counts_of_this_tree(request):
    """docs/testing.md's counts are the collection's (this session's, when it collected the
    whole tree; else a fresh pytest --collect-only). The fix: scripts/count_tests.py."""
    counts = request.config.stash.get(tiers.COUNTS, None) or tiers.collected()
    assert counts["fast"] > 400 and counts["slow"] > 20, f"the count saw the tree: {counts}"
    stated = tiers.stated(tiers.PAGE.read_text())
    assert stated == counts, f"docs/testing.md says {stated}; run python scripts/count_tests.py"


def test_the_counts_check_reads_what_the_script_writes_and_sees_a_stale_count(tmp_path):
    """Negative control: a page written with other counts is read back with those counts
    (so the comparison above fails on it), and a page without the block is refused."""
    page = tmp_path / "testing.md"
    page.write_text(f"# Tests\n{tiers.COUNTS_BEGIN}\nold\n{tiers.COUNTS_END}\nafter\n")
    counts = {"fast": 500, "slow": 40, "cuda": 7}
    assert tiers.write(counts, page) and not tiers.write(counts, page)
    assert tiers.stated(page.read_text()) == counts and page.read_text().endswith("after\n")
    assert tiers.write({**counts, "slow": 41}, page)
    assert tiers.stated(page.read_text()) != counts
    with pytest.raises(ValueError, match="no <!-- counts"):
        tiers.stated("# Tests\nThe suite holds **500** fast tests.\n")


# ---- the layout page names the tree as it is --------------------------------------------

LAYOUT = REPO_ROOT / "docs" / "layout.md"
_ENTRY = re.compile(r"^(\S+)\s")  # a line of the layout block that starts a path's entry


def layout_entries(text: str) -> dict[str, str]:
    """{path: its description} of the layout page's block (a path at a line's start, its
    description running on over the indented lines below it)."""
    block = next(b for _, lang, b in split_page(text)[0] if "torchtitan/" in b)
    entries, current = {}, None
    for line in block.splitlines():
        m = _ENTRY.match(line)
        if m:
            current = m.group(1)
            entries[current] = line[len(current) :]
        elif current is not None:
            entries[current] += " " + line.strip()
    return entries


def layout_problems(entries: dict[str, str], root: Path) -> list[str]:
    """What the layout's entries say that the tree under ``root`` does not hold, and each
    package, module, script and harness file of the tree that they do not name."""
    problems = [f"{path} does not exist" for path in entries if not (root / path).exists()]
    package = root / "torchtitan"
    for child in sorted(package.iterdir()):
        if child.name.startswith(("_", ".")):
            continue
        key = f"torchtitan/{child.name}" + ("/" if child.is_dir() else "")
        if child.is_dir() and not (child / "__init__.py").exists():
            continue
        if key not in entries:
            problems.append(f"{key} is not in the layout")
        elif child.is_dir():
            said = entries[key]
            problems += [
                f"{key}{module.name} is not named in its entry"
                for module in sorted(child.glob("*.py"))
                if module.stem != "__init__" and not re.search(rf"\b{module.stem}\b", said)
            ]
    text = " ".join(entries.values())
    for folder in ("scripts", "scripts/benchmarks", "scripts/campaigns", "harness"):
        for f in sorted((root / folder).glob("*")):
            if f.suffix in (".py", ".sh") and not f.name.startswith("_"):
                if f.name.startswith("bench_") or f.name == "__init__.py":
                    continue  # the benchmarks are named as bench_*.py
                if not re.search(rf"\b{re.escape(f.stem)}\b", text):
                    problems.append(f"{folder}/{f.name} is not named in the layout")
    return problems


def test_the_layout_page_matches_the_tree():
    problems = layout_problems(layout_entries(LAYOUT.read_text()), REPO_ROOT)
    assert not problems, "docs/layout.md:\n" + "\n".join(problems)


def test_the_layout_check_sees_a_missing_module_a_gone_path_and_an_unnamed_package(tmp_path):
    """Negative control on a planted tree and page."""
    for path in ("torchtitan/io/__init__.py", "torchtitan/io/claims.py", "torchtitan/io/disk.py",
                 "torchtitan/faults/__init__.py", "torchtitan/step.py", "scripts/run.py",
                 "harness/__init__.py"):  # fmt: skip
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("")
    page = (
        "```\ntorchtitan/io/     claims.py (the claims)\n"
        "torchtitan/step.py  one step\ntorchtitan/gone.py  no more\nscripts/  run.py\n```\n"
    )
    problems = layout_problems(layout_entries(page), tmp_path)
    assert problems == [
        "torchtitan/gone.py does not exist",
        "torchtitan/faults/ is not in the layout",
        "torchtitan/io/disk.py is not named in its entry",
    ], problems


# ---- the time budgets CI holds itself to -------------------------------------------------


def test_the_testing_page_states_a_budget_per_part_of_ci_within_45_minutes():
    """CI (python -m harness.tiers in .ci/run) reads these; the total is the issue's 45
    minutes and the fast tier the README's 4."""
    limits = tiers.budgets(tiers.PAGE.read_text())
    assert set(limits) == {"install", "fast", "slow", "total"}, limits
    assert limits["fast"] <= 240 and limits["total"] <= 45 * 60
    assert limits["install"] + limits["fast"] + limits["slow"] <= limits["total"]
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    assert "python -m harness.tiers $((t1 - t0)) $((t2 - t1)) $((t3 - t2))" in ci


def test_a_part_over_its_budget_fails_ci_with_one_line(capsys, tmp_path, monkeypatch):
    """Negative control: a slow tier 1 s over its budget (and so the total, when the rest
    fill it) is named and fails CI; a fast tier over is a warning; a run inside every
    budget passes."""
    page = tmp_path / "testing.md"
    page.write_text(f"{tiers.BUDGETS_BEGIN}\n| part | budget |\n|---|---|\n| install and lint "
                    f"| 120 s |\n| fast tier | 240 s |\n| slow tier | 1500 s |\n| total | 1860 s |\n"
                    f"{tiers.BUDGETS_END}\n")  # fmt: skip
    limits = tiers.budgets(page.read_text())
    assert limits == {"install": 120, "fast": 240, "slow": 1500, "total": 1860}
    assert tiers.over_budget({"install": 100, "fast": 240, "slow": 1500}, limits) == []
    over = tiers.over_budget({"install": 120, "fast": 240, "slow": 1501}, limits)
    assert over == [
        "slow took 1501 s, over its budget of 1500 s (docs/testing.md)",
        "total took 1861 s, over its budget of 1860 s (docs/testing.md)",
    ]
    monkeypatch.setattr(tiers, "PAGE", page)
    assert tiers.main(["120", "240", "1501"]) == 1
    assert "error: slow took 1501 s" in capsys.readouterr().out
    assert tiers.main(["10", "250", "30"]) == 0  # a fast tier over: warned of, not failed
    assert "warning: fast took 250 s" in capsys.readouterr().out
    assert tiers.main(["10", "20", "30"]) == 0
    with pytest.raises(ValueError, match="no <!-- budgets"):
        tiers.budgets("| fast tier | 240 s |\n")
