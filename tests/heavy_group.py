"""`uv run pytest` sets up everything the tests need in one command: the heavy test-only
packages (pyproject.toml's `test-heavy` group) are synced here, once, before collection.

They are a group of their own so that the Quick start's `uv run skycap demo`, which syncs
only the default `dev` group, does not download them. `uv sync --inexact` adds the group
without removing anything, and `uv run` syncs inexactly too, so a later demo keeps it.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

GROUP = "test-heavy"
#: The import name of each package of the group: the group is synced when all are found.
MODULES = ("playwright", "litellm", "fsspec", "s3fs", "moto", "agents", "wandb", "ray")
ROOT = Path(__file__).resolve().parent.parent


def missing() -> list[str]:
    return [name for name in MODULES if importlib.util.find_spec(name) is None]


def ensure_synced() -> None:
    """Sync the group when some of it is missing and uv started these tests; else say how."""
    absent = missing()
    if not absent or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    uv = os.environ.get("UV")  # set by `uv run` to its own executable
    command = ["sync", "--inexact", "--group", GROUP]
    if uv is None:
        print(
            f"skycap tests: {', '.join(absent)} missing; run the tests with `uv run pytest`, "
            f"or `uv sync {' '.join(command[1:])}` first",
            file=sys.stderr,
        )
        return
    print(
        f"skycap tests: installing the test-only group `{GROUP}` ({', '.join(absent)} "
        f"missing): uv {' '.join(command)}",
        file=sys.stderr,
        flush=True,
    )
    done = subprocess.run([uv, *command, "--quiet"], cwd=ROOT)
    if done.returncode != 0:
        print(
            f"skycap tests: `uv {' '.join(command)}` failed; tests needing it fail", file=sys.stderr
        )
    importlib.invalidate_caches()
