"""Graph placement: dedup by delta, the chosen sibling, the deepest-match walk, paths."""

from __future__ import annotations

from skycap.dialects.chat import DIALECT as CHAT
from skycap.graph import CLIENT, MODEL, Graph
from skycap.text.commit import commit_text_call
from skycap.trajectory import Trajectory


def _add(graph: Graph, parent: int | None, match: str, delta: str, author: str = CLIENT) -> int:
    return graph.add(
        parent,
        author=author,
        message={"role": "user" if author == CLIENT else "assistant", "content": match},
        match_hash=match,
        delta_hash=delta,
        created_at=0.0,
    ).id


def test_add_deduplicates_on_parent_and_delta() -> None:
    graph = Graph()
    a = _add(graph, None, "m", "d")
    assert _add(graph, None, "m", "d") == a
    b = _add(graph, a, "m", "d")
    assert b != a and graph[b].depth == 1 and graph[b].parent == a
    assert graph.roots == [a] and graph[a].children == [b]


def test_chosen_sibling_prefers_newest_model_node() -> None:
    graph = Graph()
    root = _add(graph, None, "u", "u")
    client = _add(graph, root, "r", "c1")
    assert graph.chosen(root, "r") == client
    model = _add(graph, root, "r", "m1", MODEL)
    assert graph.chosen(root, "r") == model
    _add(graph, root, "r", "c2")  # a later client twin never displaces a model node
    assert graph.chosen(root, "r") == model
    newer = _add(graph, root, "r", "m2", MODEL)
    assert graph.chosen(root, "r") == newer
    assert graph.shadowed_by(graph[model]) == newer
    assert graph.shadowed_by(graph[newer]) is None


def test_walk_descends_where_the_rest_matches_deepest() -> None:
    graph = Graph()
    root = _add(graph, None, "a", "a")
    shallow = _add(graph, root, "b", "b1", MODEL)
    deep = _add(graph, root, "b", "b2")
    below = _add(graph, deep, "c", "c")
    # `shallow` is chosen (model), but only `deep` continues with "c".
    assert graph.walk(["a", "b", "c", "x"]) == [root, deep, below]
    # A tie goes to the chosen sibling.
    assert graph.walk(["a", "b"]) == [root, shallow]
    assert graph.walk(["z"]) == []


def test_walk_follows_aliases() -> None:
    graph = Graph()
    root = _add(graph, None, "a", "a")
    node = _add(graph, root, "b", "b")
    graph.aliases[(root, "respelled")] = node
    assert graph.walk(["a", "respelled"]) == [root, node]


def test_walk_handles_very_long_conversations() -> None:
    graph = Graph()
    parent = None
    for i in range(5000):
        parent = _add(graph, parent, str(i), str(i))
    assert len(graph.walk([str(i) for i in range(5000)])) == 5000


def test_paths_are_ordered_by_leaf_id() -> None:
    graph = Graph()
    root = _add(graph, None, "a", "a")
    left = _add(graph, root, "b", "b")
    right = _add(graph, root, "c", "c")
    deeper = _add(graph, left, "d", "d")
    assert graph.paths() == [[root, right], [root, left, deeper]]
    assert graph.branch_points() == [root]


def _call(t: float = 1.0, **sampling: float) -> dict:
    return {
        "t_start": t,
        "t_end": t + 0.5,
        "model": "policy",
        "sampling": sampling,
        "usage": None,
        "finish_reason": "stop",
    }


def test_text_commit_linear_replay_and_resample() -> None:
    trajectory = Trajectory("tr_0000000000000001", capture={"mode": "text"})
    user = {"role": "user", "content": "What is 2+2?"}
    first = commit_text_call(
        trajectory,
        CHAT.read({"model": "policy", "messages": [user]}),
        {"role": "assistant", "content": "4"},
        _call(temperature=0.7),
    )
    assert first is not None and first.id == 1
    assert first.delta_hash == "36627b58f2ac4691776c76d1e8cd8865"
    follow = [user, {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}]
    commit_text_call(
        trajectory,
        CHAT.read({"model": "policy", "messages": follow}),
        {"role": "assistant", "content": "6"},
        _call(),
    )
    assert len(trajectory.graph.paths()) == 1
    # The same reply again under the same sampling key is one node with two calls.
    again = commit_text_call(
        trajectory,
        CHAT.read({"model": "policy", "messages": [user]}),
        {"role": "assistant", "content": "4"},
        _call(temperature=0.7),
    )
    assert again is first and len(first.calls) == 2
    other = commit_text_call(
        trajectory,
        CHAT.read({"model": "policy", "messages": [user]}),
        {"role": "assistant", "content": "four"},
        _call(),
    )
    assert other is not None and len(trajectory.graph.paths()) == 2


def test_text_commit_edited_reply_becomes_client_sibling_and_tools_start_new_root() -> None:
    trajectory = Trajectory("tr_0000000000000002", capture={"mode": "text"})
    user = {"role": "user", "content": "hi"}
    reply = {"role": "assistant", "content": "yo", "reasoning_content": "think"}
    commit_text_call(trajectory, CHAT.read({"messages": [user]}), reply, _call())
    stripped = {"role": "assistant", "content": "yo"}
    commit_text_call(
        trajectory,
        CHAT.read({"messages": [user, stripped, {"role": "user", "content": "x"}]}),
        {"role": "assistant", "content": "z"},
        _call(),
    )
    graph = trajectory.graph
    assert graph[2].author == "client" and graph[2].parent == 0
    tools = [{"type": "function", "function": {"name": "f"}}]
    commit_text_call(
        trajectory,
        CHAT.read({"messages": [user], "tools": tools}),
        {"role": "assistant", "content": "yo"},
        _call(),
    )
    assert len(graph.roots) == 2
    assert list(trajectory.tools.values()) == [tools]
    assert graph[graph.roots[1]].children and graph[-1].calls[0]["tools"] in trajectory.tools


def test_text_commit_skips_sealed_trajectory() -> None:
    trajectory = Trajectory("tr_0000000000000003", capture={"mode": "text"})
    trajectory.seal("finished")
    node = commit_text_call(
        trajectory,
        CHAT.read({"messages": [{"role": "user", "content": "x"}]}),
        {"role": "assistant", "content": "y"},
        _call(),
    )
    assert node is None and len(trajectory.graph) == 0
