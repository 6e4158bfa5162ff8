"""The render cache with the real Qwen3 tokenizer: a cached or extended prompt is token for token
a fresh render (fuzzed messages, tools and templates; the demo's conversations), its record
byte-identical to an uncached one, planned on a renderer thread or, for a new trajectory's
first call, on the event loop; the key, the bound, the counters and the pool built at start."""

from __future__ import annotations

import functools
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skycap import demo
from skycap.hashing import tools_hash
from skycap.record.writer import write_record
from skycap.tokens.backend import TokenBackend
from skycap.tokens.interned import turn_lists
from skycap.tokens.library_renderer import LibraryRenderer
from skycap.tokens.plan import Plan, plan_turn
from skycap.tokens.render_cache import CachedRenderer, RenderCache, prefix_keys
from skycap.tokens.renderer import _SHARED_INTS, Rendered, RenderError
from skycap.tokens.renderer_pool import RendererPool
from skycap.tokens.turn import LOOP_LOOKUP_BUDGET, LOOP_VALUE_COST, fits_on_loop
from skycap.trajectory import Trajectory

TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the notes.",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
    },
}
#: The same tool with its keys in another order: a template writes the schema as given.
TOOL_REORDERED = {"function": dict(reversed(list(TOOL["function"].items()))), "type": "function"}


@pytest.fixture(scope="module")
def no_thinking(qwen3_dir: Path) -> LibraryRenderer:
    """Qwen3 with thinking off: another template output (an empty think block)."""
    return LibraryRenderer(
        qwen3_dir, renderer_name="qwen3", chat_template_kwargs={"enable_thinking": False}
    )


class Counting:
    """A renderer whose full renders are counted; everything else is the real one's."""

    def __init__(self, inner: LibraryRenderer) -> None:
        self.inner = inner
        self.renders = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def render(self, messages: list[dict[str, Any]], tools: list[Any] | None) -> Rendered:
        self.renders += 1
        return self.inner.render(messages, tools)


def cached(renderer: Any, max_bytes: int = 1 << 26) -> CachedRenderer:
    return CachedRenderer(renderer, RenderCache(max_bytes), renderer.render_digest)


def same(left: Rendered, right: Rendered) -> None:
    assert left.token_ids == right.token_ids
    assert left.message_indices == right.message_indices


TEXT = st.lists(
    st.sampled_from(["a", "b", " ", "\n", "é", "字", "<think>", "</think>", "<|im_end|>", "{"]),
    max_size=12,
).map("".join)


@st.composite
def message(draw: st.DrawFn) -> dict[str, Any]:
    role = draw(st.sampled_from(["user", "user", "system", "assistant", "tool"]))
    out: dict[str, Any] = {"role": role, "content": draw(TEXT)}
    if role == "assistant":
        if draw(st.booleans()):
            out["reasoning_content"] = draw(TEXT)
        if draw(st.booleans()):
            arguments = json.dumps({"q": draw(st.sampled_from(["x", "café", ""]))})
            call = {"name": "search", "arguments": arguments}
            out["tool_calls"] = [{"id": "call_1", "type": "function", "function": call}]
    if role == "tool":
        out["tool_call_id"] = "call_1"
    return out


#: A head of system and user messages (what a cached first call extends) and any tail.
CONVERSATIONS = st.tuples(
    st.tuples(
        st.lists(message().filter(lambda m: m["role"] in ("system", "user")), max_size=3),
        st.lists(message(), max_size=4),
    )
    .map(lambda parts: [*parts[0], *parts[1]])
    .filter(bool),
    st.sampled_from([None, [TOOL], [TOOL_REORDERED], [TOOL, TOOL_REORDERED]]),
    st.sampled_from(["thinking", "no_thinking"]),
    st.integers(min_value=1, max_value=5),
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(CONVERSATIONS)
def test_cached_and_extended_renders_are_fresh_renders(
    qwen3_renderer: LibraryRenderer, no_thinking: LibraryRenderer, case: Any
) -> None:
    messages, tools, template, cut = case
    renderer = qwen3_renderer if template == "thinking" else no_thinking
    try:
        fresh = renderer.render(messages, tools)
    except RenderError:
        with pytest.raises(RenderError):
            cached(renderer).render(messages, tools)
        return
    view = cached(renderer)
    prefix = messages[: min(cut, len(messages))]
    try:
        view.render(prefix, tools)  # cached first, so the longer call may extend it
    except RenderError:
        pass
    same(view.render(messages, tools), fresh)  # a miss: extended or rendered in full
    same(view.render(messages, tools), fresh)  # a hit


def test_a_group_renders_its_shared_prompt_once(qwen3_renderer: LibraryRenderer) -> None:
    counting = Counting(qwen3_renderer)
    cache = RenderCache(1 << 26)
    view = CachedRenderer(counting, cache, qwen3_renderer.render_digest)
    start = [demo.SYSTEM, {"role": "user", "content": "Investigate the group task."}]
    fresh = qwen3_renderer.render(start, demo.TOOLS)
    for _ in range(8):
        same(view.render([dict(m) for m in start], demo.TOOLS), fresh)
    assert counting.renders == 1
    assert cache.counters()["render_cache_hits"] == 7
    assert cache.counters()["render_cache_misses"] == 1
    assert cache.counters()["render_cache_bytes"] > 8 * len(fresh.token_ids)


def test_a_first_call_adding_a_user_message_renders_only_the_new_part(
    qwen3_renderer: LibraryRenderer,
) -> None:
    counting = Counting(qwen3_renderer)
    view = CachedRenderer(counting, RenderCache(1 << 26), qwen3_renderer.render_digest)
    start = [demo.SYSTEM, {"role": "user", "content": "Investigate the group task."}]
    view.render(start, demo.TOOLS)
    longer = [*start, {"role": "user", "content": "Also: keep it short."}]
    same(view.render(longer, demo.TOOLS), qwen3_renderer.render(longer, demo.TOOLS))
    assert counting.renders == 1  # the longer prompt came from the bridge, not a render


def test_a_prefix_ending_in_a_tool_reply_is_not_a_token_prefix_and_is_rendered_in_full(
    qwen3_renderer: LibraryRenderer,
) -> None:
    """Consecutive tool replies share one wrap: the shorter render closes it, the longer one
    does not, so reusing the shorter render would be wrong."""
    call = {"name": "search", "arguments": '{"q": "x"}'}
    prefix = [
        demo.SYSTEM,
        {"role": "user", "content": "find x"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "function": call}]},
        {"role": "tool", "tool_call_id": "c", "content": "one"},
    ]
    longer = [*prefix, {"role": "tool", "tool_call_id": "c", "content": "two"}]
    short, fresh = qwen3_renderer.render(prefix, [TOOL]), qwen3_renderer.render(longer, [TOOL])
    body = len(short.token_ids) - short.message_indices[::-1].index(3)
    assert fresh.token_ids[:body] != short.token_ids[:body]
    counting = Counting(qwen3_renderer)
    view = CachedRenderer(counting, RenderCache(1 << 26), qwen3_renderer.render_digest)
    view.render(prefix, [TOOL])
    same(view.render(longer, [TOOL]), fresh)
    assert counting.renders == 2


def test_keys_keep_order_and_type_and_refuse_what_json_cannot_name() -> None:
    scope = b"scope"
    user = {"role": "user", "content": "x"}
    assert prefix_keys(scope, [user], [TOOL]) != prefix_keys(scope, [user], [TOOL_REORDERED])
    assert prefix_keys(scope, [user], None) != prefix_keys(b"other", [user], None)
    one, one_float = [{**user, "n": 1}], [{**user, "n": 1.0}]
    assert prefix_keys(scope, one, None) != prefix_keys(scope, one_float, None)
    assert prefix_keys(scope, [{**user, "n": True}], None) != prefix_keys(scope, one, None)
    assert prefix_keys(scope, [{**user, "content": ("x",)}], None) is None
    keys = prefix_keys(scope, [user, user], None)
    assert keys is not None and keys[0] == prefix_keys(scope, [user], None)[0]  # type: ignore[index]


def test_the_cache_holds_at_most_its_bytes_and_evicts_the_least_recently_used() -> None:
    cache = RenderCache(3 * (4000 * 8 + 256))
    renders = {key: Rendered(list(range(4000)), [0] * 4000) for key in (b"a", b"b", b"c", b"d")}
    for key in (b"a", b"b", b"c"):
        cache.store(key, renders[key])
    assert cache.lookup(b"a") is not None  # now the most recent
    cache.store(b"d", renders[b"d"])
    assert cache.lookup(b"b") is None and cache.lookup(b"a") is not None
    assert cache.bytes <= cache.max_bytes
    hit = cache.lookup(b"a")
    assert hit is not None
    hit.token_ids.append(7)  # a caller changing its lists changes no later hit
    assert cache.lookup(b"a") == renders[b"a"]


def _turns(renderer: Any, messages_by_turn: list[list[dict[str, Any]]]) -> Trajectory:
    """Plan and commit each call of a conversation the demo's way; the engine 'samples' a
    fixed reply, so only the renderer differs between two runs."""
    from skycap.tokens.commit import commit_turn
    from skycap.tokens.engine import EngineOutput

    trajectory = Trajectory("tr_00000000000000cc", capture={"mode": "tokens"})
    tools = demo.TOOLS
    for messages in messages_by_turn:
        plan = plan_turn(trajectory.graph, renderer, messages, tools, tools_hash(tools), "policy")
        ids = renderer._tokenizer.encode("Done: read it.", add_special_tokens=False)
        ids.append(renderer.stop_token_ids[0])
        reply = renderer.parse(ids, tools, plan.prompt_ids)
        output = EngineOutput(ids, [-0.25] * len(ids), "stop")
        call = {"t_start": 1.0, "t_end": 2.0, "model": "policy", "sampling": {}}
        commit_turn(trajectory, plan, output, reply, call, tools=tools, model="policy")
    return trajectory


def test_a_record_of_cached_renders_is_byte_identical_to_an_uncached_one(
    qwen3_renderer: LibraryRenderer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(time, "time", lambda: 1_700_000_000.0)
    first = [demo.SYSTEM, {"role": "user", "content": "Investigate agent-a."}]
    # The demo's first calls, a compaction's restart, and one extended by a user message.
    calls = [first, [*first, {"role": "user", "content": "Summary of the work so far."}], first]
    view = cached(qwen3_renderer)
    for warm in calls:
        view.render(warm, demo.TOOLS)
    records = []
    for name, renderer in (("plain", qwen3_renderer), ("cached", view)):
        out = tmp_path / name
        out.mkdir()
        written = write_record(_turns(renderer, calls), out)
        records.append([(out / file).read_bytes() for file in written])
    assert records[0] == records[1]
    assert view._cache.hits >= 3


async def test_the_pool_builds_every_slot_at_start_on_its_workers() -> None:
    built_on: list[str] = []
    lock = threading.Lock()

    class Slot:
        name = "slot"

        def __init__(self) -> None:
            with lock:
                built_on.append(threading.current_thread().name)

    pool = RendererPool(Slot, 3)
    try:
        assert pool.fill() >= 0.0
        assert len(built_on) == 3 and all(n.startswith("skycap-render") for n in built_on[1:])
        both_in = threading.Barrier(3, timeout=5)

        def hold(slot: Any) -> int:
            both_in.wait()
            return id(slot)

        import asyncio

        ids = await asyncio.gather(pool.run(hold), pool.run(hold), pool.run(hold))
        assert len(set(ids)) == 3 and len(built_on) == 3  # nothing built on the hot path
        assert pool.fill() >= 0.0 and len(built_on) == 3
    finally:
        pool.close()


def test_a_renderer_without_a_digest_is_never_cached() -> None:
    class Plain:
        name = "plain"
        stop_token_ids = [0]

    pool = RendererPool(Plain, 1, RenderCache(1 << 20))
    try:
        assert pool.cache is None
        assert pool.call(lambda r: type(r)) is Plain
    finally:
        pool.close()


def _plan_fields(plan: Plan) -> tuple[Any, ...]:
    new = [(m.message, m.match_hash, m.ids.dtype, m.ids.tolist()) for m in plan.new]
    scaffold = (plan.scaffold.dtype, plan.scaffold.tolist())
    return plan.prompt_ids, plan.parent, new, scaffold, plan.bridged, plan.reused, plan.routes_from


def test_a_cached_first_call_is_planned_from_the_cache_alone_exactly_as_a_render(
    qwen3_renderer: LibraryRenderer,
) -> None:
    start = [demo.SYSTEM, {"role": "user", "content": "Investigate the group task."}]
    tools, key = demo.TOOLS, tools_hash(demo.TOOLS)
    fresh = plan_turn(
        Trajectory("tr_00000000000000d0", capture={}).graph, qwen3_renderer, start, tools, key, "m"
    )
    pool = RendererPool(lambda: qwen3_renderer, 1, RenderCache(1 << 26))
    try:
        graphs = [Trajectory(f"tr_00000000000000d{n}", capture={}).graph for n in (1, 2)]

        def planned(graph: Any) -> Any:
            return lambda r: plan_turn(graph, r, start, tools, key, "m")

        assert pool.from_cache(planned(graphs[0])) is None  # nothing cached: the thread's work
        assert pool.cache is not None and pool.cache.counters()["render_cache_misses"] == 0
        first = pool.call(planned(graphs[0]))
        again = pool.from_cache(planned(graphs[1]))
        assert again is not None
        assert _plan_fields(first) == _plan_fields(again) == _plan_fields(fresh)
        counters = pool.cache.counters()
        assert (counters["render_cache_hits"], counters["render_cache_misses"]) == (1, 1)
        # A hit's ids are the shared int objects, so the kept lists are its very list.
        assert again.shared and not first.shared
        assert all(t is _SHARED_INTS[t] for t in again.prompt_ids)
    finally:
        pool.close()


def _first_plan(graph: Any, renderer: Any) -> Plan:
    start = [demo.SYSTEM, {"role": "user", "content": "Investigate agent-a."}]
    return plan_turn(graph, renderer, start, demo.TOOLS, tools_hash(demo.TOOLS), "policy")


def _repetitions(view: Any, pool: RendererPool, count: int) -> list[Trajectory]:
    """New trajectories whose first calls repeat the demo's, each planned from the cache on
    the calling thread where it can be, else by `view`; committed the backend's way."""
    from skycap.tokens.commit import commit_turn
    from skycap.tokens.engine import EngineOutput

    trajectories = []
    for n in range(count):
        trajectory = Trajectory(f"tr_00000000000000c{n}", capture={"mode": "tokens"})
        planned = functools.partial(_first_plan, trajectory.graph)
        plan = pool.from_cache(planned) or planned(view)
        ids = view._tokenizer.encode("Done: read it.", add_special_tokens=False)
        ids.append(view.stop_token_ids[0])
        reply = view.parse(ids, demo.TOOLS, plan.prompt_ids)
        output = EngineOutput(ids, [-0.25] * len(ids), "stop")
        call = {"t_start": 1.0, "t_end": 2.0, "model": "policy", "sampling": {}}
        node = commit_turn(trajectory, plan, output, reply, call, tools=demo.TOOLS, model="policy")
        assert node is not None
        kept = turn_lists(trajectory.graph, node.id, plan, output, None)
        assert kept.prompt_ids == plan.prompt_ids
        trajectories.append(trajectory)
    return trajectories


def test_records_of_first_calls_planned_from_the_cache_are_byte_identical(
    qwen3_renderer: LibraryRenderer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(time, "time", lambda: 1_700_000_000.0)
    records = []
    for name, cache in (("plain", None), ("cached", RenderCache(1 << 26))):
        pool = RendererPool(lambda: qwen3_renderer, 1, cache)
        view: Any = qwen3_renderer
        if cache is not None:
            view = CachedRenderer(qwen3_renderer, cache, qwen3_renderer.render_digest)
        try:
            written = []
            for n, trajectory in enumerate(_repetitions(view, pool, 3)):
                out = tmp_path / f"{name}{n}"
                out.mkdir()
                written.append([(out / f).read_bytes() for f in write_record(trajectory, out)])
            records.append(written)
        finally:
            pool.close()
    assert cache is not None and cache.counters()["render_cache_hits"] == 2
    assert records[0] == records[1]


async def test_a_repeated_first_call_through_the_backend_skips_the_renderer_thread(
    qwen3_renderer: LibraryRenderer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine answers in-process; the second trajectory's plan needs no renderer thread,
    and its nodes are token for token the first one's."""
    import orjson

    from skycap.dialects.chat import DIALECT as CHAT

    backend = TokenBackend(upstream_url="http://engine", model="policy", renderer=qwen3_renderer)
    stop = qwen3_renderer.stop_token_ids[0]
    ids = [*qwen3_renderer._tokenizer.encode("Done.", add_special_tokens=False), stop]

    async def generate(session_id: str, payload: bytes) -> tuple[int, bytes]:
        logprobs = {"content": [{"logprob": -0.5} for _ in ids]}
        choice = {"index": 0, "token_ids": ids, "logprobs": logprobs, "finish_reason": "stop"}
        return 200, orjson.dumps({"choices": [choice]})

    monkeypatch.setattr(backend.client, "generate", generate)
    hops = []
    run = backend.settings.pool.run

    async def counted(fn: Any) -> Any:
        hops.append(fn)
        return await run(fn)

    monkeypatch.setattr(backend.settings.pool, "run", counted)
    start = [demo.SYSTEM, {"role": "user", "content": "Investigate the group task."}]
    body = {"model": "policy", "messages": start, "tools": demo.TOOLS}
    try:
        trajectories = [
            Trajectory(f"tr_00000000000000e{n}", capture=backend.capture) for n in (1, 2)
        ]
        for traj in trajectories:
            reply = await backend.call(traj, CHAT.read(dict(body)), CHAT)
            assert reply.status == 200, reply.body
        assert len(hops) == 3  # plan and parse, then the parse alone
        nodes = [[(n.message, n.tokens.ids.tolist()) for n in t.graph] for t in trajectories]
        assert nodes[0] == nodes[1]
        counters = backend.settings.cache_counters()
        assert (counters["render_cache_hits"], counters["render_cache_misses"]) == (1, 1)
    finally:
        await backend.close()


def test_what_is_looked_up_on_the_loop_is_bounded() -> None:
    user = {"role": "user", "content": "x" * 1000}
    assert fits_on_loop([user], None)
    assert not fits_on_loop([{"role": "user", "content": "x" * LOOP_LOOKUP_BUDGET}], None)
    assert not fits_on_loop([user], [{"n": n} for n in range(LOOP_LOOKUP_BUDGET // 100)])
    many = list(range(LOOP_LOOKUP_BUDGET // LOOP_VALUE_COST + 1))
    assert not fits_on_loop([{"role": "user", "content": many}], None)
