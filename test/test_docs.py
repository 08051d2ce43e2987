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
