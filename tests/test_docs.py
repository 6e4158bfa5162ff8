"""The repository's docs stand alone and their code works: every file they name exists, no
decision numbers leak into them, Python blocks compile with every name defined, shell lines
that call `skycap` parse with skycap's own argparse, and blocks that target the mocks run."""

from __future__ import annotations

import ast
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from skycap.cli.main import build_parser
from skycap.server.flags import ADDON_PREFIX, FLAGS

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted(
    [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "records").glob("*.md")]
    + list((ROOT / "examples").glob("*.md"))
)
LINK = re.compile(r"\]\(([^)\s]+)\)")
# A file name a reader would look for: `http.md`, docs/proxy.md, ../shared/spec/format.md.
NAMED_FILE = re.compile(r"(?<![\w/.-])((?:\.\.?/)?[\w./-]*\w\.(?:md|py))\b")
DECISION = re.compile(r"\bD-\d+\b")
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```", re.S | re.M)
SHELL = {"sh", "bash", "shell", "console", ""}
MOCKS = ("skycap.mock", "ScriptedEngine", "ScriptedUpstream")


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int
    info: str
    text: str

    def __str__(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def blocks() -> list[Block]:
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for match in FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append(Block(doc, line, match.group(1).strip(), match.group(2)))
    return found


def _prose(doc: Path) -> str:
    """The text outside fenced blocks (blocks are checked as code below)."""
    return FENCE.sub("", doc.read_text())


def _repository_files() -> list[str]:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    return listed.stdout.split() if listed.returncode == 0 else []


FILES = _repository_files()


def _exists(doc: Path, name: str) -> bool:
    """A link or a doc's name resolves from the doc, the root or docs/; a source file (a
    module a table names by its short path) may be anywhere in the repository."""
    name = name.split("#")[0]
    if not name or "://" in name or name.startswith("mailto:"):
        return True
    candidates = [doc.parent / name, ROOT / name, ROOT / "docs" / name]
    if any(path.exists() for path in candidates):
        return True
    return not name.endswith(".md") and any(f.endswith("/" + name.lstrip("./")) for f in FILES)


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_every_file_a_doc_names_is_in_the_repository(doc: Path) -> None:
    prose = _prose(doc)
    named = LINK.findall(prose) + NAMED_FILE.findall(prose)
    missing = sorted({name for name in named if not _exists(doc, name)})
    assert not missing, f"{doc.relative_to(ROOT)} names files the repository lacks: {missing}"
    assert "shared/spec" not in prose and "DECISIONS" not in prose


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_docs_cite_no_decision_numbers(doc: Path) -> None:
    cited = sorted(set(DECISION.findall(doc.read_text())))
    assert not cited, f"{doc.relative_to(ROOT)} cites {cited}: say what was decided instead"


def _python_blocks() -> list[Block]:
    return [b for b in blocks() if b.info.split()[:1] == ["python"]]


@pytest.mark.parametrize("block", _python_blocks(), ids=str)
def test_python_blocks_compile_with_every_name_defined(block: Block, tmp_path: Path) -> None:
    """A block may use what the doc's earlier Python blocks defined, as a reader would.

    A block marked ```python fragment``` (an excerpt that continues the prose, such as a
    statement inside the reader's own loop) is only compiled, with top-level await.
    """
    if "fragment" in block.info.split():
        compile(block.text, str(block), "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        return
    compile(block.text, str(block), "exec")
    earlier = [b.text for b in _python_blocks() if b.doc == block.doc and b.line < block.line]
    prefix = "".join(text if text.endswith("\n") else text + "\n" for text in earlier)
    script = tmp_path / "block.py"
    script.write_text(prefix + block.text)
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    lint = subprocess.run(
        [
            ruff,
            "check",
            "--isolated",
            "--select",
            "F821,F822,F823",
            "--output-format",
            "concise",
            str(script),
        ],
        capture_output=True,
        text=True,
    )
    first = prefix.count("\n") + 1
    found = [
        line
        for line in lint.stdout.splitlines()
        if (m := re.match(r".*?:(\d+):\d+: (F\d+ .*)", line)) and int(m.group(1)) >= first
    ]
    assert not found, f"{block}: " + "; ".join(found)


@pytest.mark.parametrize(
    "block", [b for b in _python_blocks() if any(m in b.text for m in MOCKS)], ids=str
)
def test_python_blocks_on_the_mocks_run(block: Block, tmp_path: Path) -> None:
    script = tmp_path / "block.py"
    script.write_text(block.text)
    run = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, f"{block}:\n{run.stdout}\n{run.stderr}"


def commands(text: str) -> list[list[str]]:
    """The shell lines of a block (continuations joined), split into words, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    found = []
    for line in joined.splitlines():
        line = line.strip().removeprefix("$ ")
        if not line or line.startswith("#"):
            continue
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
            words = words[1:]  # VAR=value prefixes
        if words[:2] == ["uv", "run"]:
            words = words[2:]
        if words[-1:] == ["&"]:  # started in the background
            words = words[:-1]
        if words:
            found.append(words)
    return found


def _shell_blocks() -> list[Block]:
    return [b for b in blocks() if b.info.split()[:1] in ([], *([s] for s in SHELL - {""}))]


ADDON_OPTIONS = {ADDON_PREFIX + flag.dest for flag in FLAGS if flag.addon}


@pytest.mark.parametrize("block", _shell_blocks(), ids=str)
def test_shell_lines_that_call_skycap_parse(block: Block) -> None:
    parser, _ = build_parser()
    for words in commands(block.text):
        if words[0] == "skycap":
            try:
                parser.parse_args(words[1:])
            except SystemExit as exc:
                pytest.fail(f"{block}: `{shlex.join(words)}` does not parse (exit {exc.code})")
        elif words[0] == "mitmdump":
            settings = [w.split("=")[0] for w in words if w.startswith(ADDON_PREFIX)]
            unknown = sorted(set(settings) - ADDON_OPTIONS)
            assert not unknown, f"{block}: mitmdump sets unknown skycap options {unknown}"
