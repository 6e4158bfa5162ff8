"""`skycap demo`: capture a few scripted agent rollouts live and show what was recorded."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

HELP = (
    "run a live capture of scripted agent rollouts (no network, no GPU) into a new run "
    "folder under ./records"
)

EPILOG = """\
The demo drives the same capture a trainer uses. To capture a real engine instead, run
a server and point your harness at the per-trajectory base_url that POST /trajectories
returns (docs/walkthrough.md does it step by step):

  uv run skycap serve --mode tokens --upstream-url http://engine:8000 \\
      --tokenizer Qwen/Qwen3-8B --max-model-len 32768 --record-dir ./records/my-run

  uv run skycap serve --mode text --upstream-url http://engine:8000/v1 \\
      --record-dir ./records/my-run

or embed it in a trainer: CaptureService("http://engine:8000", mode="tokens",
tokenizer="Qwen/Qwen3-8B", record_dir="./records/my-run").start(). Each demo run writes
its own folder under ./records; `uv run skycap view records` lists every run there, and
`uv run skycap check`/`summary` read one run's folder (the demo prints its name).
"""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "--mode",
        choices=["auto", "tokens", "text"],
        default="auto",
        help="auto: token mode when the bundled Qwen3 tokenizer is installed, else text "
        "(default auto)",
    )
    parser.add_argument(
        "--record-dir",
        type=Path,
        default=Path("records"),
        help="the folder under which each demo run writes a new folder demo-<date>-<time> "
        "(default ./records)",
    )


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from rich.console import Console

    from skycap.demo import run_demo

    try:
        import openai  # noqa: F401
    except ImportError:
        print("skycap demo drives harnesses with the `openai` package: `pip install openai`")
        return 2
    from skycap.record.layout import new_run_dir

    root = args.record_dir.resolve()
    try:
        record_dir = new_run_dir(root, "demo")
    except OSError as exc:
        print(
            f"skycap demo: error: cannot create a run folder in --record-dir {root}: {exc.strerror}"
        )
        return 2
    return run_demo(args.mode, record_dir, Console())
