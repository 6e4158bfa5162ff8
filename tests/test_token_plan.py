"""Tests of the token-mode plan: match with respellings, bridge, full render and attribution."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from skycap.graph import Tokens
from skycap.hashing import token_match, tools_hash
from skycap.tokens.commit import commit_turn
from skycap.tokens.engine import EngineOutput
from skycap.tokens.interned import turn_lists as _turn_lists
from skycap.tokens.library_renderer import LibraryRenderer
from skycap.tokens.plan import Plan, PlanError, TurnLists, attribute, plan_turn
from skycap.tokens.renderer import Rendered
from skycap.trajectory import Trajectory

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search.",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
]
TOOL_CALL = (
    "<think>\nlook it up\n</think>\n\n<tool_call>\n"
    '{"name": "search", "arguments": {"q": "x"}}\n</tool_call>'
)
START = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "find x"}]


def new_trajectory() -> Trajectory:
    return Trajectory("tr_00000000000000aa", capture={"mode": "tokens"})


def encode(renderer: LibraryRenderer, text: str, stop: bool = True) -> list[int]:
    ids = renderer._tokenizer.encode(text, add_special_tokens=False)
    return ids + [renderer.stop_token_ids[0]] if stop else ids


def decode(renderer: LibraryRenderer, ids: Any) -> str:
    return renderer._tokenizer.decode(list(ids), skip_special_tokens=False)


def plan(
    traj: Trajectory,
    renderer: Any,
    messages: list[dict[str, Any]],
    tools=TOOLS,
    previous: TurnLists | None = None,
) -> Plan:
    return plan_turn(traj.graph, renderer, messages, tools, tools_hash(tools), "policy", previous)


def hashes(messages: list[dict[str, Any]]) -> list[str]:
    return [token_match(m, tools_hash(TOOLS), "policy") for m in messages]


def turn(
    traj: Trajectory, renderer: LibraryRenderer, messages: list[dict[str, Any]], text: str
) -> tuple[Plan, dict[str, Any]]:
    """Plan, 'sample' `text`, commit; return the plan and the parsed reply."""
    p = plan(traj, renderer, messages)
    ids = encode(renderer, text)
    reply = renderer.parse(ids, TOOLS, p.prompt_ids)
    output = EngineOutput(ids, [-0.5] * len(ids), "stop")
    call = {"t_start": time.time(), "t_end": time.time(), "model": "policy", "sampling": {}}
    commit_turn(traj, p, output, reply, call, tools=TOOLS, model="policy")
    return p, reply


def flat(p: Plan) -> list[int]:
    parts = [m.ids for m in p.new] + [p.scaffold]
    return np.concatenate(parts).tolist()


def test_empty_messages_is_a_plan_error(qwen3_renderer: LibraryRenderer) -> None:
    with pytest.raises(PlanError, match="`messages` is empty"):
        plan(new_trajectory(), qwen3_renderer, [])


def test_first_turn_is_a_full_render_with_null_bridged(qwen3_renderer: LibraryRenderer) -> None:
    p = plan(new_trajectory(), qwen3_renderer, START)
    assert p.bridged is None and p.parent is None and p.reused == 0 and p.routes_from == 0
    assert p.prompt_ids == qwen3_renderer.render(START, TOOLS).token_ids
    assert flat(p) == p.prompt_ids
    assert decode(qwen3_renderer, p.scaffold) == "<|im_start|>assistant\n"
    assert decode(qwen3_renderer, p.new[1].ids) == "<|im_start|>user\nfind x<|im_end|>\n"
    assert [m.match_hash for m in p.new] == hashes(START)


def test_render_errors_are_plan_errors(qwen3_renderer: LibraryRenderer) -> None:
    with pytest.raises(PlanError, match="cannot render these messages"):
        plan(new_trajectory(), qwen3_renderer, [{"content": "no role"}])


def test_second_turn_bridges_from_the_model_node(qwen3_renderer: LibraryRenderer) -> None:
    traj = new_trajectory()
    first, reply = turn(traj, qwen3_renderer, START, TOOL_CALL)
    model_node = traj.graph[2]
    messages = [*START, reply, {"role": "tool", "tool_call_id": "c", "content": "x=1"}]
    p = plan(traj, qwen3_renderer, messages)
    prev = first.prompt_ids + encode(qwen3_renderer, TOOL_CALL)
    assert p.bridged is True and p.parent == model_node.id
    assert p.reused == len(prev) and p.prompt_ids[: len(prev)] == prev
    assert p.prompt_ids[p.reused :] == flat(p)
    assert [m.message for m in p.new] == [messages[-1]]
    # The separator after the sampled stop token is scaffold of the tool message.
    assert decode(qwen3_renderer, p.new[0].ids).startswith("\n<|im_start|>user\n<tool_response>")
    assert p.routes_from == 0  # no node holds routed experts


def test_routes_from_is_the_prefix_end_when_every_node_has_complete_rows(
    qwen3_renderer: LibraryRenderer,
) -> None:
    traj = new_trajectory()
    _, reply = turn(traj, qwen3_renderer, START, TOOL_CALL)
    for node in traj.graph:
        node.tokens.experts = np.zeros((node.tokens.length, 2, 2), dtype=np.uint8)
    messages = [*START, reply, {"role": "tool", "tool_call_id": "c", "content": "x=1"}]
    p = plan(traj, qwen3_renderer, messages)
    assert p.routes_from == p.reused - 1
    traj.graph[0].tokens.experts = traj.graph[0].tokens.experts[:-1]  # incomplete rows
    assert plan(traj, qwen3_renderer, messages).routes_from == 0


def test_dropped_reasoning_misses_and_forks_with_a_full_render(
    qwen3_renderer: LibraryRenderer,
) -> None:
    traj = new_trajectory()
    _, reply = turn(traj, qwen3_renderer, START, TOOL_CALL)
    edited = {k: v for k, v in reply.items() if k != "reasoning_content"}
    messages = [*START, edited, {"role": "tool", "tool_call_id": "c", "content": "x=1"}]
    p = plan(traj, qwen3_renderer, messages)
    assert p.bridged is False and p.parent == 1  # under the user node, beside the model node
    assert [m.message for m in p.new] == messages[2:]
    assert p.prompt_ids == qwen3_renderer.render(messages, TOOLS).token_ids
    assert p.reused == traj.graph[0].tokens.length + traj.graph[1].tokens.length
    assert traj.graph.aliases == {}


def test_respelled_reply_is_aliased_after_a_render_check_and_bridges(
    qwen3_renderer: LibraryRenderer,
) -> None:
    traj = new_trajectory()
    _, reply = turn(traj, qwen3_renderer, START, TOOL_CALL)
    assert reply["content"] == ""
    respelled = {**reply, "content": None, "refusal": None}  # same render, other hash
    messages = [*START, respelled, {"role": "tool", "tool_call_id": "c", "content": "x=1"}]
    p = plan(traj, qwen3_renderer, messages)
    assert p.bridged is True and p.parent == 2
    assert traj.graph.aliases == {(1, hashes([respelled])[0]): 2}
    # The alias now serves the walk directly; no render check is needed.
    assert traj.graph.walk(hashes(messages)) == [0, 1, 2]


def test_full_render_keeps_a_model_node_it_reproduces_and_gives_its_separator_to_the_next(
    qwen3_renderer: LibraryRenderer,
) -> None:
    traj = new_trajectory()
    _, reply = turn(traj, qwen3_renderer, START, "Hello.")
    written = {"role": "assistant", "content": "written by the harness"}
    messages = [
        *START,
        reply,
        {"role": "user", "content": "a"},
        written,
        {"role": "user", "content": "b"},
    ]
    p = plan(traj, qwen3_renderer, messages)
    assert p.bridged is False  # the tail holds an assistant message
    assert p.parent == 2 and p.reused == sum(traj.graph[i].tokens.length for i in range(3))
    assert p.prompt_ids == qwen3_renderer.render(messages, TOOLS).token_ids
    assert decode(qwen3_renderer, p.new[0].ids) == "\n<|im_start|>user\na<|im_end|>\n"


def test_full_render_forks_at_a_node_whose_tokens_disagree(qwen3_renderer: LibraryRenderer) -> None:
    traj = new_trajectory()
    turn(traj, qwen3_renderer, START, "Hello.")
    traj.graph[1].tokens = Tokens(ids=np.asarray([1, 2, 3], dtype=np.int32))
    p = plan(traj, qwen3_renderer, [*START, {"role": "user", "content": "more"}])
    assert p.bridged is False and p.parent == 0 and p.reused == traj.graph[0].tokens.length
    assert [m.message for m in p.new] == [START[1], {"role": "user", "content": "more"}]


class FakeRenderer:
    """Message i renders as [7, 100 + i, 200 + number of its keys]; 7 is scaffold (index -1).

    The key count makes a respelling with an extra empty field render differently when
    `counts_keys` is set. Indices can be replaced to test attribution errors. Never bridges.
    """

    name = "fake"
    stop_token_ids = [9]

    def __init__(self, indices: list[int] | None = None, counts_keys: bool = False) -> None:
        self.indices = indices
        self.counts_keys = counts_keys

    def render(self, messages: list[dict[str, Any]], tools: Any) -> Rendered:
        ids: list[int] = []
        indices: list[int] = []
        for i, message in enumerate(messages):
            ids += [7, 100 + i, 200 + (len(message) if self.counts_keys else 0)]
            indices += [-1, i, i]
        ids.append(8)
        indices.append(-1)
        return Rendered(ids, self.indices if self.indices is not None else indices)

    def bridge(self, *args: Any, **kwargs: Any) -> None:
        return None


def fake_turn(traj: Trajectory, renderer: FakeRenderer, messages: list[dict[str, Any]]) -> Plan:
    p = plan(traj, renderer, messages, tools=None)
    output = EngineOutput([55, 9], [-0.1, -0.2], "stop")
    call = {"t_start": 1.0, "t_end": 2.0, "model": "policy", "sampling": {}}
    reply = {"role": "assistant", "content": "ok"}
    commit_turn(traj, p, output, reply, call, tools=None, model="policy")
    return p


USER_A = {"role": "user", "content": "a"}


def test_a_loose_equal_respelling_that_renders_alike_is_aliased() -> None:
    traj = new_trajectory()
    fake = FakeRenderer()
    fake_turn(traj, fake, [USER_A])
    respelled = {"role": "user", "content": "a", "name": ""}
    p = plan(traj, fake, [respelled], tools=None)
    assert traj.graph.aliases == {(None, token_match(respelled, "", "policy")): 0}
    assert p.parent == 0 and p.new == [] and p.reused == 3  # node 0 reproduces exactly


def test_a_loose_equal_respelling_that_renders_differently_forks() -> None:
    traj = new_trajectory()
    fake = FakeRenderer(counts_keys=True)
    fake_turn(traj, fake, [USER_A])
    respelled = {"role": "user", "content": "a", "name": ""}
    p = plan(traj, fake, [respelled], tools=None)
    assert traj.graph.aliases == {}
    assert p.parent is None and p.bridged is False  # a new root beside node 0


def test_a_message_differing_in_more_than_empty_strings_is_not_render_checked() -> None:
    traj = new_trajectory()
    fake_turn(traj, FakeRenderer(), [USER_A])
    renders: list[int] = []

    class Counting(FakeRenderer):
        def render(self, messages: list[dict[str, Any]], tools: Any) -> Rendered:
            renders.append(len(messages))
            return super().render(messages, tools)

    plan(traj, Counting(), [{"role": "user", "content": "b"}], tools=None)
    assert renders == [1]  # the full render only


def test_full_render_model_node_leftover_is_scaffold_of_the_next_message() -> None:
    """A kept model node may end before its message's last rendered token."""
    traj = new_trajectory()
    fake = FakeRenderer()
    first = fake_turn(traj, fake, [USER_A])
    assert first.scaffold.tolist() == [8]

    class Wrapped(FakeRenderer):
        """Renders an assistant message as scaffold [8] + sampled [55, 9] + separator [3]."""

        def render(self, messages: list[dict[str, Any]], tools: Any) -> Rendered:
            ids, indices = [7, 100, 200], [-1, 0, 0]
            for i, m in enumerate(messages[1:], start=1):
                if m["role"] == "assistant":
                    ids += [8, 55, 9, 3]
                    indices += [i, i, i, i]
                else:
                    ids += [7, 100 + i, 200]
                    indices += [-1, i, i]
            return Rendered([*ids, 8], [*indices, -1])

    messages = [USER_A, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "b"}]
    p = plan(traj, Wrapped(), messages, tools=None)
    assert p.parent == 1 and p.reused == 6 and p.bridged is False
    assert [m.ids.tolist() for m in p.new] == [[3, 7, 102, 200]]
    assert p.scaffold.tolist() == [8]


def test_full_render_client_node_must_end_on_its_message_boundary() -> None:
    traj = new_trajectory()
    fake_turn(traj, FakeRenderer(), [USER_A])

    class Longer(FakeRenderer):
        """Renders the user message one token longer than it was committed."""

        def render(self, messages: list[dict[str, Any]], tools: Any) -> Rendered:
            return Rendered([7, 100, 200, 4, 8], [-1, 0, 0, 0, -1])

    p = plan(traj, Longer(), [USER_A], tools=None)
    assert p.parent is None and [m.ids.tolist() for m in p.new] == [[7, 100, 200, 4]]


class DropsAsides(FakeRenderer):
    """Renders no tokens at all for role `aside`, as Qwen3's template does for unknown roles."""

    def render(self, messages: list[dict[str, Any]], tools: Any) -> Rendered:
        ids: list[int] = []
        indices: list[int] = []
        for i, message in enumerate(messages):
            if message.get("role") != "aside":
                ids += [7, 100 + i, 200]
                indices += [-1, i, i]
        return Rendered([*ids, 8], [*indices, -1])


CALLS = [{"id": "c1", "type": "function", "function": {"name": "search", "arguments": "{}"}}]


@pytest.mark.parametrize(
    "aside",
    [
        {"role": "aside", "content": "x"},
        {"role": "aside", "content": [{"type": "text", "text": "x"}]},
        {"role": "aside", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]},
        {"role": "aside", "content": None, "tool_calls": CALLS},
        {"role": "aside", "content": "", "reasoning_content": "hmm"},
    ],
)
def test_a_message_with_content_that_renders_to_no_tokens_is_a_plan_error(
    aside: dict[str, Any],
) -> None:
    messages = [USER_A, aside, {"role": "user", "content": "b"}]
    with pytest.raises(PlanError) as refused:
        plan(new_trajectory(), DropsAsides(), messages, tools=None)
    assert str(refused.value) == (
        "message 1 (role 'aside') renders to no tokens with this chat template, so the model "
        "would never see it; send it with a role the template renders, such as 'system'"
    )


@pytest.mark.parametrize(
    "aside",
    [
        {"role": "aside"},
        {"role": "aside", "content": ""},
        {"role": "aside", "content": None, "tool_calls": [], "reasoning_content": None},
        {"role": "aside", "content": [{"type": "text", "text": ""}]},
    ],
)
def test_a_message_with_nothing_to_render_still_gets_its_empty_chunk(
    aside: dict[str, Any],
) -> None:
    p = plan(new_trajectory(), DropsAsides(), [USER_A, aside], tools=None)
    assert [m.message for m in p.new] == [USER_A, aside]
    assert [m.ids.tolist() for m in p.new] == [[7, 100, 200], []]


def test_a_bridge_that_drops_a_message_gives_way_to_the_full_render() -> None:
    traj = new_trajectory()
    fake_turn(traj, FakeRenderer(), [USER_A])

    class BridgeDropsTools(FakeRenderer):
        def bridge(self, prompt: Any, completion: Any, new: Any, *args: Any) -> Rendered:
            ids, indices = [*prompt, *completion], []
            for i, message in enumerate(new):
                if message["role"] != "tool":
                    ids += [7, 150 + i, 200]
                    indices += [-1, i, i]
            return Rendered([*ids, 8], [*indices, -1], reused=len(prompt) + len(completion))

    tool = {"role": "tool", "tool_call_id": "c1", "content": "r"}
    messages = [USER_A, {"role": "assistant", "content": "ok"}, tool, USER_A]
    p = plan(traj, BridgeDropsTools(), messages, tools=None)
    assert p.bridged is False
    assert all(m.ids.shape[0] > 0 for m in p.new) and p.new[-2].message == tool


@pytest.mark.parametrize(
    ("indices", "error"),
    [
        ([-1, 0, 0, -1, 3, 3, -1], "attributed a token to message 3 of 2"),
        ([-1, 1, 1, -1, 0, 0, -1], "not in message order: message 0 after message 1"),
        ([-2, 0, 0, -1, 1, 1, -1], "message -2"),
        ([-1, 0, 0], "7 token ids but 3 message indices"),
    ],
)
def test_bad_renderer_attribution_is_a_plan_error(indices: list[int], error: str) -> None:
    messages = [USER_A, {"role": "user", "content": "b"}]
    with pytest.raises(PlanError, match=error):
        plan(new_trajectory(), FakeRenderer(indices), messages, tools=None)


def test_attribute_gives_scaffold_to_the_following_message_and_the_tail_to_the_model() -> None:
    ids = np.arange(10, dtype=np.int32)
    chunks, scaffold = attribute(ids, [-1, 0, 0, -1, -1, 2, -1, -1, -1, -1], 3)
    assert [c.tolist() for c in chunks] == [[0, 1, 2], [], [3, 4, 5]]
    assert scaffold.tolist() == [6, 7, 8, 9]


# -- the previous turn's lists -------------------------------------------------------


def tool_call(step: int) -> str:
    """A sampled reply with thinking and a tool call, different at every step."""
    return (
        f"<think>\nstep {step}: look again\n</think>\n\n<tool_call>\n"
        f'{{"name": "search", "arguments": {{"q": "x{step}"}}}}\n</tool_call>'
    )


def plan_fields(p: Plan) -> tuple[Any, ...]:
    new = [(m.message, m.match_hash, m.ids.dtype, m.ids.tolist()) for m in p.new]
    scaffold = (p.scaffold.dtype, p.scaffold.tolist())
    return p.prompt_ids, p.parent, new, scaffold, p.bridged, p.reused, p.routes_from


class Kept:
    """Turns committed as the backend does, keeping each model node's lists.

    Every plan is made with and without the `previous` given, and must be the same.
    """

    def __init__(self, renderer: LibraryRenderer) -> None:
        self.renderer = renderer
        self.traj = new_trajectory()
        self.lists: dict[int, TurnLists] = {}

    def turn(
        self, messages: list[dict[str, Any]], text: str, previous: TurnLists | None
    ) -> tuple[Plan, dict[str, Any], TurnLists]:
        p = self.check(messages, previous)
        ids = encode(self.renderer, text)
        reply = self.renderer.parse(ids, TOOLS, p.prompt_ids)
        output = EngineOutput(ids, [-0.5] * len(ids), "stop")
        call = {"t_start": 1.0, "t_end": 2.0, "model": "policy", "sampling": {}}
        node = commit_turn(self.traj, p, output, reply, call, tools=TOOLS, model="policy")
        assert node is not None
        lists = _turn_lists(self.traj.graph, node.id, p, output, previous)
        self.lists[node.id] = lists
        return p, reply, lists

    def check(self, messages: list[dict[str, Any]], previous: TurnLists | None) -> Plan:
        expected = plan(self.traj, self.renderer, messages)
        got = plan(self.traj, self.renderer, messages, previous=previous)
        assert plan_fields(got) == plan_fields(expected)
        return got


def tool_result(reply: dict[str, Any], content: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": content}


def test_previous_lists_give_the_same_plan_and_only_for_their_own_node(
    qwen3_renderer: LibraryRenderer,
) -> None:
    kept = Kept(qwen3_renderer)
    first, reply1, lists1 = kept.turn(START, tool_call(1), None)
    assert first.bridged is None
    turn2 = [*START, reply1, tool_result(reply1, "x1 is 1")]
    second, reply2, lists2 = kept.turn(turn2, tool_call(2), lists1)
    assert second.bridged is True and second.parent == lists1.node  # the lists were usable
    turn3 = [*turn2, reply2, tool_result(reply2, "x2 is 2")]
    third, reply3, lists3 = kept.turn(turn3, tool_call(3), lists2)
    assert third.bridged is True and third.parent == lists2.node

    # A rewind to turn 2 with another tool result bridges from node 1's model node while
    # the latest lists are turn 3's: they must be skipped.
    rewound, _, _ = kept.turn([*START, reply1, tool_result(reply1, "x1 is 7")], "Done.", lists3)
    assert rewound.bridged is True and rewound.parent == lists1.node != lists3.node
    kept.check(turn2, lists3)
    kept.check(turn2, lists2)  # a later node's lists for an earlier bridge point

    # A fork: the reply sent back without its reasoning misses and renders in full.
    edited = {k: v for k, v in reply1.items() if k != "reasoning_content"}
    forked_messages = [*START, edited, tool_result(reply1, "x1 is 1")]
    forked, fork_reply, fork_lists = kept.turn(forked_messages, tool_call(4), lists3)
    assert forked.bridged is False and forked.parent == 1
    on_fork = [*forked_messages, fork_reply, tool_result(fork_reply, "x4 is 4")]
    after_fork = kept.check(on_fork, fork_lists)
    assert after_fork.bridged is True and after_fork.parent == fork_lists.node
    kept.check(on_fork, lists3)  # the main branch's lists, on the fork
    kept.check([*turn3, reply3, tool_result(reply3, "x3 is 3")], fork_lists)  # and vice versa

    # The same node id in another trajectory's graph is another node.
    other = Kept(qwen3_renderer)
    _, _, foreign = other.turn(START, "Hello.", None)
    assert foreign.node == lists1.node and foreign.graph is not lists1.graph
    kept.check(turn2, foreign)

    # The check is not vacuous: lists that do belong to the node are what the bridge extends.
    poisoned = TurnLists(
        lists1.graph, lists1.node, [7, *lists1.prompt_ids[1:]], lists1.completion_ids
    )
    assert plan(kept.traj, qwen3_renderer, turn2, previous=poisoned).prompt_ids[0] == 7
