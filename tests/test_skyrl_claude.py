"""The SkyRL generator with the pinned Claude Code CLI as its harness (a subprocess given the
trajectory's address), in token mode on the scripted engine: 2 prompts x 2 repetitions, one
harness crashing once; the rows are the counting attempts' and keep SkyRL's rules."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from skyrl_rules import check_output, key, token_block

from skycap.index import RecordIndex
from skycap.integrations.skyrl import (
    Rollout,
    SkycapConfig,
    SkycapGenerator,
    SkycapRuntime,
    TrajectoryID,
)
from skycap.mock.engine import ScriptedEngine

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import claude_code_smoke as smoke  # noqa: E402

CLAUDE = smoke.find_claude()
pytestmark = pytest.mark.skipif(
    CLAUDE is None and os.environ.get("CI") != "true",
    reason="Claude Code is not installed (.ci/run installs it into .ci/npm)",
)


class ClaudeCode(SkycapGenerator):
    """Claude Code, unchanged, pointed at the trajectory: `ANTHROPIC_BASE_URL` is the base URL
    without `/v1`; `env` (proxy mode's variables, when the server has a proxy) is added too.
    The entry `crash_once` names has its scorer raise once, after the CLI ran."""

    crashed: set[str]

    async def run_rollout(
        self, prompt: Any, *, base_url: str, api_key: str, sampling: dict[str, Any], env: Any
    ) -> Rollout:
        assert CLAUDE is not None
        task = prompt["messages"][-1]["content"]
        with tempfile.TemporaryDirectory(prefix="skycap-skyrl-claude-") as tmp:
            (Path(tmp) / "home").mkdir()
            created = {"anthropic_base_url": base_url.removesuffix("/v1"), "api_key": api_key}
            environ = {**smoke.claude_env(created, "base_url", Path(tmp) / "home"), **env}
            process = await asyncio.create_subprocess_exec(
                CLAUDE,
                *("-p", task, "--output-format", "json", "--allowedTools", "Bash(echo:*)"),
                env=environ,
                cwd=tmp,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            out, err = await process.communicate()
        if process.returncode != 0:
            raise RuntimeError(f"claude exited {process.returncode}: {err.decode()[-500:]}")
        answer = json.loads(out.decode().strip().splitlines()[-1]).get("result", "")
        if prompt.get("crash_once") == prompt["name"] and prompt["name"] not in self.crashed:
            self.crashed.add(prompt["name"])
            raise RuntimeError("the scorer crashed")
        return Rollout(1.0 if smoke.MARKER in str(answer) else 0.0)


@pytest.fixture(scope="module")
def runtime(
    qwen3_tokenizer: Any, qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SkycapRuntime]:
    records = tmp_path_factory.mktemp("skyrl-claude")
    with ScriptedEngine(qwen3_tokenizer, script=smoke.EngineScript(qwen3_tokenizer)) as engine:
        block = token_block(engine.url, qwen3_dir, records)
        started = SkycapRuntime.start(SkycapConfig.from_mapping(block))
        try:
            yield started
        finally:
            assert started.stop()


def test_claude_code_rollouts_become_step_rows_skyrl_accepts(runtime: SkycapRuntime) -> None:
    records = Path(runtime.config.record_dir)
    index = RecordIndex("skyrl-claude", record_dir=records)
    agent = runtime.generator(ClaudeCode, concurrency=2, attempts=2, progress=False, index=index)
    agent.crashed = set()
    prompts, ids, extras = [], [], []
    for name in ("first", "second"):
        for rep in range(2):
            prompts.append([{"role": "user", "content": smoke.TASK}])
            ids.append(TrajectoryID(name, rep))
            extras.append({"name": f"{name}-{rep}", "crash_once": "second-0"})
    batch = {
        "prompts": prompts,
        "env_classes": ["claude"] * 4,
        "env_extras": extras,
        "sampling_params": None,
        "trajectory_ids": ids,
        "batch_metadata": {"global_step": 1, "training_phase": "train"},
    }
    output = asyncio.run(agent.generate(batch))
    check_output(output, 4)
    order = [key(t) for t in output["trajectory_ids"]]
    assert list(dict.fromkeys(order)) == ["first_0", "first_1", "second_0", "second_1"]
    # Each rollout is at least the tool round trip: the Bash call, then the answer.
    assert all(order.count(k) >= 2 for k in set(order))
    rewards = zip(output["rewards"], output["is_last_step"], strict=True)
    assert [r[-1] for r, last in rewards if last] == [1.0] * 4
    assert all(any(mask) for mask in output["loss_masks"])
    assert output["rollout_metrics"]["generate/retried_rollouts"] == 1

    attempts = agent.record_log.entries("train", 1)
    (superseded,) = [a for a in attempts if a.superseded]
    assert len(attempts) == 5 and (superseded.instance_id, superseded.repetition_id) == (
        "second",
        0,
    )
    document = agent.on_step_end(1, output["trajectory_ids"])
    assert document is not None
    trained = {row["id"] for row in document["rows"] if row["trained"]}
    counting = {a.id for a in attempts if not a.superseded}
    assert trained == counting and superseded.id not in trained
    index.close()
