"""Citations in the code resolve: no decision numbers in comments or docstrings, and every
docs section a .py file names (`http.md §2.3`, docs/format.md "Mirror copies") exists."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted(
    path
    for folder in ("skycap", "addons", "scripts", "examples", "tests")
    for path in (ROOT / folder).rglob("*.py")
)
DECISION = re.compile(r"\bD-\d+\b")
SECTION_SIGN = "\u00a7"
NUMBER = r"\d+(?:\.\d+)*"
# `format.md §6.1`, or several sections of one file: `graph.md §4, §5`.
NUMBERED = re.compile(
    rf"\b([\w-]+)\.md {SECTION_SIGN}({NUMBER}(?:, {SECTION_SIGN}{NUMBER})*)(?!\.?\d)"
)
# docs/viewer.md "Health band": a heading named by its text.
BY_HEADING = re.compile(r'\bdocs/([\w-]+)\.md "([^"\n]+)"')
# What is left of one after the whole citations are taken out: a heading split over lines.
UNCLOSED = re.compile(r'\bdocs/[\w-]+\.md "')
SPLIT_AFTER_FILE = re.compile(r"\bdocs/[\w-]+\.md$")
HEADING = re.compile(r"^#+\s+(.*?)\s*$", re.M)
HEADING_NUMBER = re.compile(rf"^({NUMBER})\.?\s")


@cache
def headings(name: str) -> tuple[set[str], set[str]] | None:
    """(section numbers, heading texts without backticks) of docs/<name>.md, None if absent."""
    path = ROOT / "docs" / f"{name}.md"
    if not path.is_file():
        return None
    texts = [m.group(1).replace("`", "") for m in HEADING.finditer(path.read_text())]
    numbers = {m.group(1) for text in texts if (m := HEADING_NUMBER.match(text))}
    return numbers, set(texts)


def heading_exists(cited: str, texts: set[str]) -> bool:
    """A heading's whole text, or its part before a colon or a parenthesis."""
    return any(t == cited or t.startswith((f"{cited}:", f"{cited} (")) for t in texts)


def comments_and_docstrings(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring: where prose, not behaviour, lives."""
    source = path.read_text()
    if not DECISION.search(source):
        return []  # nothing to look for: skip tokenizing and parsing (most files)
    found = [
        (tok.start[0], tok.string)
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            if isinstance(node.value.value, str):
                found.append((node.lineno, node.value.value))
    return found


def where(path: Path, line: int) -> str:
    return f"{path.relative_to(ROOT)}:{line}"


def test_no_decision_numbers_in_comments_or_docstrings() -> None:
    leaks = [
        f"{where(path, line)}: {match.group(0)}"
        for path in SOURCES
        for line, text in comments_and_docstrings(path)
        for match in DECISION.finditer(text)
    ]
    assert not leaks, "say the reason instead of a decision number:\n" + "\n".join(leaks)


def test_docs_citations_resolve() -> None:
    broken = []
    lines = [
        (path, number, line)
        for path in SOURCES
        for number, line in enumerate(path.read_text().splitlines(), 1)
    ]
    for path, number, line in lines:
        if SECTION_SIGN not in line and "docs/" not in line:
            continue
        for match in NUMBERED.finditer(line):
            found = headings(match.group(1))
            for section in match.group(2).split(f", {SECTION_SIGN}"):
                if found is None or section not in found[0]:
                    broken.append(
                        f"{where(path, number)}: {match.group(1)}.md has no {SECTION_SIGN}{section}"
                    )
        for match in BY_HEADING.finditer(line):
            found = headings(match.group(1))
            if found is None or not heading_exists(match.group(2), found[1]):
                broken.append(
                    f'{where(path, number)}: docs/{match.group(1)}.md has no "{match.group(2)}"'
                )
        if UNCLOSED.search(BY_HEADING.sub("", line)) or SPLIT_AFTER_FILE.search(line):
            broken.append(f"{where(path, number)}: a heading cited across lines")
        if SECTION_SIGN in NUMBERED.sub("", line):
            broken.append(f"{where(path, number)}: a section sign without its docs file")
    assert not broken, "\n".join(broken)


def test_the_checks_catch_what_they_look_for() -> None:
    assert DECISION.search("# retried (D-12)")
    assert not heading_exists("Nowhere", headings("http")[1])
    assert heading_exists("Groups", headings("viewer")[1])
    assert "2.3" in headings("http")[0] and "99" not in headings("http")[0]
    assert NUMBERED.search(f"graph.md {SECTION_SIGN}4, {SECTION_SIGN}5").group(2) == (
        f"4, {SECTION_SIGN}5"
    )
