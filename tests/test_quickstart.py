"""The Quick start holds: the README's commands run as written in a clone (`uv run skycap
…`), the demo's sync leaves the heavy test-only packages to `uv run pytest`, and nothing
stray sits at the repository's root."""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
from heavy_group import GROUP, MODULES

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
#: What the repository's root holds, and nothing else (a scratch file there is a mistake).
ROOT_ENTRIES = {
    ".ci", ".gitignore", ".python-version", "README.md", "addons", "docs", "examples",
    "pyproject.toml", "records", "scripts", "skycap", "tests", "uv.lock",
}  # fmt: skip


def test_every_skycap_command_in_the_readme_runs_through_uv() -> None:
    """`skycap` is not on the PATH after the Quick start; `uv run skycap` is."""
    fenced = re.findall(r"^```([^\n`]*)\n(.*?)^```", README, re.S | re.M)
    blocks = [text for info, text in fenced if info.strip() in ("", "bash", "sh")]
    lines = [line.strip() for block in blocks for line in block.splitlines()]
    spans = re.findall(r"`([^`\n]+)`", re.sub(r"^```.*?^```", "", README, flags=re.S | re.M))
    command = re.compile(r"skycap (serve|demo|check|summary|view|validate|top|ca)\b")
    # A span naming a subcommand in prose (`skycap top` (the live view)) is a name, not a
    # command to copy; one with arguments is a command.
    bare = [c for c in lines if command.match(c)] + [
        c for c in spans if command.match(c) and len(c.split()) > 2
    ]
    assert not bare, f"spell these `uv run skycap …`: {bare}"
    assert "uv run skycap demo" in README and "source .venv/bin/activate" in README


@pytest.mark.skipif(shutil.which("uv") is None and "UV" not in os.environ, reason="needs uv")
def test_uv_run_skycap_works_in_the_clone() -> None:
    uv = os.environ.get("UV") or shutil.which("uv")
    assert uv is not None
    done = subprocess.run(
        [uv, "run", "--no-sync", "skycap", "--version"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0 and done.stdout.startswith("skycap "), done.stderr


def test_the_heavy_packages_are_a_group_of_their_own() -> None:
    """The demo syncs `dev` only; `uv run pytest` syncs `test-heavy` itself (heavy_group)."""
    groups = tomllib.loads((ROOT / "pyproject.toml").read_text())["dependency-groups"]
    name = re.compile(r"[A-Za-z0-9_.-]+")
    heavy = {name.match(req).group(0) for req in groups[GROUP]}
    dev = {name.match(req).group(0) for req in groups["dev"]}
    assert not heavy & dev
    assert {"ray", "wandb", "litellm", "playwright", "moto"} <= heavy
    provided = importlib.metadata.packages_distributions()
    for module in MODULES:
        assert set(provided.get(module, ())) & heavy, f"{module} is not from {GROUP}"
    assert len(MODULES) == len(heavy)
    assert (ROOT / ".ci" / "run").read_text().rstrip().endswith("\nuv run pytest")


def test_nothing_stray_at_the_root() -> None:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    entries = {path.split("/")[0] for path in listed.stdout.split()}
    assert entries <= ROOT_ENTRIES, f"stray at the root: {sorted(entries - ROOT_ENTRIES)}"
