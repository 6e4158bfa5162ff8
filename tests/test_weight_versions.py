"""Which policy sampled each token: the scripted engine switches weight version inside a
completion (through vLLM's RL routes and mid-stream), and the record, the finish's samples,
every compose mode and the crash journal put exactly those tokens under each version."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from rollout_agents import TOOLS
from server_fixtures import Control, ServerThread

from skycap.client import FinishResult
from skycap.compose import Policy, compose
from skycap.mock.engine import ScriptedEngine
from skycap.record.journal import read_journal
from skycap.rollout import Rollout, RolloutResult
from skycap.server.options import ServerOptions

SWITCH_AT = 5


@pytest.fixture(scope="module")
def engine(qwen3_tokenizer: Any) -> Iterator[ScriptedEngine]:
    with ScriptedEngine(qwen3_tokenizer, experts=None) as scripted:
        yield scripted


@pytest.fixture(scope="module")
def server(
    engine: ScriptedEngine, qwen3_renderer: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerThread]:
    records = tmp_path_factory.mktemp("weight-records")
    options = ServerOptions(engine.url, mode="tokens", renderer=qwen3_renderer, record_dir=records)
    with ServerThread(options) as running:
        yield running


def rl(engine: ScriptedEngine, method: str, route: str, **body: Any) -> dict[str, Any]:
    """One of vLLM's RL routes on the engine, over HTTP as a trainer calls it."""
    reply = httpx.request(method, engine.url + route, json=body or None)
    assert reply.status_code == 200, reply.text
    return reply.json()


def episode(server: ServerThread, engine: ScriptedEngine, *, stream: bool) -> tuple[str, Any]:
    """Three calls: version "3"; "3" then "4" from output token 5 of call 2; then "4"."""
    assert rl(engine, "POST", "/update_weight_version", new_version="3")["new_version"] == "3"
    control = Control(server.url)
    created = control.create()
    client = openai.OpenAI(base_url=created["base_url"], api_key=created["api_key"], max_retries=0)
    messages: list[Any] = [{"role": "user", "content": "find x"}]
    for call in range(3):
        if call == 1:
            engine.weights.switch_at(SWITCH_AT, "4")
        if stream:
            chunks = list(
                client.chat.completions.create(
                    model="p", messages=messages, tools=TOOLS, stream=True
                )
            )
            calls = [
                {"id": d.id, "type": "function", "function": d.function.model_dump()}
                for c in chunks
                for d in (c.choices[0].delta.tool_calls or () if c.choices else ())
                if d.id
            ]
            message = {"role": "assistant", "content": None, "tool_calls": calls or None}
            message = {k: v for k, v in message.items() if v is not None}
        else:
            reply = client.chat.completions.create(model="p", messages=messages, tools=TOOLS)
            message = reply.choices[0].message.model_dump(exclude_none=True)
        messages.append(message)
        for tool_call in message.get("tool_calls") or ():
            messages.append({"role": "tool", "tool_call_id": tool_call["id"], "content": "42"})
    assert rl(engine, "GET", "/weight_info") == {"weight_version": "4"}
    return created["id"], control


def model_calls(document: dict[str, Any]) -> list[dict[str, Any]]:
    return [node["calls"][0] for node in document["nodes"] if node["author"] == "model"]


def expected_spans(document: dict[str, Any]) -> list[list[dict[str, Any]]]:
    counts = [c["usage"]["completion_tokens"] for c in model_calls(document)]
    return [
        [{"version": "3", "start": 0, "end": counts[0]}],
        [
            {"version": "3", "start": 0, "end": SWITCH_AT},
            {"version": "4", "start": SWITCH_AT, "end": counts[1]},
        ],
        [{"version": "4", "start": 0, "end": counts[2]}],
    ]


def versions_by_position(row: Any, length: int) -> list[str | None]:
    out: list[str | None] = [None] * length
    for span in row.weight_versions or ():
        out[span["start"] : span["end"]] = [span["version"]] * (span["end"] - span["start"])
    return out


def recorded(
    server: ServerThread, engine: ScriptedEngine, *, stream: bool
) -> tuple[str, Control, dict[str, Any]]:
    """An episode, its control client and its document, whose calls hold the spans."""
    trajectory_id, control = episode(server, engine, stream=stream)
    document = control.document(trajectory_id).json()
    assert [c["weight_versions"] for c in model_calls(document)] == expected_spans(document)
    return trajectory_id, control, document


def test_versions_reach_the_record_samples_rows_and_journal(
    server: ServerThread, engine: ScriptedEngine
) -> None:
    trajectory_id, control, document = recorded(server, engine, stream=False)
    with control:
        journaled = read_journal(server.options.record_dir, trajectory_id)
        assert [
            n.calls[0]["weight_versions"] for n in journaled.graph if n.is_model
        ] == expected_spans(document)
        provenance = document["provenance"]
        assert journaled.provenance == provenance
        assert provenance["engine"] == {"model": "scripted-policy", "version": "0.33.0"}
        assert provenance["renderer"] == "qwen3" and provenance["skycap"]
        assert provenance["tokenizer"]["digest"].startswith("sha256:")
        assert provenance["chat_template_digest"].startswith("sha256:")
        sent = [r.body["sampling_params"] for r in engine.generated[-3:]]
        for call, params in zip(model_calls(document), sent, strict=True):
            assert params == {**call["sampling"], "logprobs": 0, "stop_token_ids": [151645, 151643]}
        finished = control.finish(trajectory_id, reward=1.0).json()
    (sample,) = finished["samples"]
    # The sample's spans are each call's, moved to where its sampled tokens sit.
    starts = [
        i
        for i in range(1, len(sample["loss_mask"]))
        if sample["loss_mask"][i] and not sample["loss_mask"][i - 1]
    ]
    assert sample["weight_versions"] == [
        {"version": s["version"], "start": s["start"] + at, "end": s["end"] + at}
        for at, spans in zip(starts, expected_spans(document), strict=True)
        for s in spans
    ]
    trained = np.flatnonzero(sample["loss_mask"])
    covered = [p for s in sample["weight_versions"] for p in range(s["start"], s["end"])]
    assert covered == trained.tolist()  # every trained token, and nothing else

    result = RolloutResult(0, 0, Rollout(1.0), FinishResult.from_json(finished), 1, "q")
    path_row = compose([result], "path").rows[0]
    assert path_row.weight_versions == sample["weight_versions"]
    (final_row,) = compose([result], "final").rows
    assert final_row.weight_versions == sample["weight_versions"]
    step_rows = compose([result], "step").rows
    for row, spans, at in zip(step_rows, expected_spans(document), starts, strict=True):
        assert row.weight_versions == [
            {**s, "start": s["start"] + at, "end": s["end"] + at} for s in spans
        ]
    labels = versions_by_position(path_row, len(path_row))
    assert labels[starts[1] + SWITCH_AT - 1] == "3" and labels[starts[1] + SWITCH_AT] == "4"
    batch = compose([result], "path")
    assert batch.metrics["policy_versions"] == 2
    assert batch.metrics["oldest_policy_version"] == 3
    assert batch.metrics["newest_policy_version"] == 4


def test_a_streamed_episode_gives_the_same_spans(
    server: ServerThread, engine: ScriptedEngine
) -> None:
    _, control, _ = recorded(server, engine, stream=True)
    control.close()


def test_a_version_set_while_a_stream_is_held_labels_the_rest_of_it(
    server: ServerThread, engine: ScriptedEngine
) -> None:
    rl(engine, "POST", "/update_weight_version", new_version="7")
    with Control(server.url) as control:
        created = control.create()
        client = openai.OpenAI(
            base_url=created["base_url"], api_key=created["api_key"], max_retries=0
        )
        engine.hold_stream(before_chunk=2)  # two tokens per chunk: 4 tokens sent under "7"
        stream = client.chat.completions.create(
            model="p", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        first = next(iter(stream))
        assert first is not None
        engine.wait_until_held()  # both chunks before the gate generated under "7"
        assert rl(engine, "POST", "/finish_weight_update", weight_version="8")
        engine.resume_stream()
        list(stream)
        document = control.document(created["id"]).json()
    (call,) = model_calls(document)
    n = call["usage"]["completion_tokens"]
    assert call["weight_versions"] == [
        {"version": "7", "start": 0, "end": 2 * engine.stream_chunk},
        {"version": "8", "start": 2 * engine.stream_chunk, "end": n},
    ]


def test_the_engine_reports_its_release_and_a_bad_version_update_is_refused(
    engine: ScriptedEngine, tmp_path: Path
) -> None:
    assert rl(engine, "GET", "/version") == {"version": "0.33.0"}
    refused = httpx.post(engine.url + "/update_weight_version", json={"new_version": 3})
    assert refused.status_code == 422


# -- the staleness policy, on rows whose spans are known -----------------------------------


def rollout(i: int, spans: list[tuple[str, int, int]]) -> RolloutResult:
    """A finished rollout whose one sample trains positions 2..9 under these spans."""
    mask = [0, 0] + [1] * 8
    sample = {
        "leaf": 1,
        "path": [0, 1],
        "messages": [],
        "targets": [1],
        "input_ids": list(range(10)),
        "loss_mask": mask,
        "logprobs": [0.0] * 10,
        "weight_versions": [{"version": v, "start": s, "end": e} for v, s, e in spans],
        "media": [],
    }
    finish = FinishResult.from_json({"id": f"tr_{i}", "status": "finished", "samples": [sample]})
    return RolloutResult(i, 0, Rollout(1.0), finish, 1, f"q{i}")


BATCH = [
    [("1", 2, 10)],
    [("2", 2, 6), ("3", 6, 10)],
    [("3", 2, 10)],
    [("3", 2, 4), ("4", 4, 10)],
    [("4", 2, 10)],
]


def test_rollouts_with_a_token_older_than_the_lag_are_masked_and_counted() -> None:
    results = [rollout(i, spans) for i, spans in enumerate(BATCH)]
    batch = compose(results, policy=Policy(max_policy_lag=1, current_version="4"))
    assert [row.masked for row in batch.rows] == ["stale", "stale", None, None, None]
    assert [row.trained_tokens for row in batch.rows] == [0, 0, 8, 8, 8]
    assert batch.metrics["stale_rollouts"] == 2
    assert batch.metrics["masked/stale"] == 2
    assert batch.metrics["policy_versions"] == 4
    assert (batch.metrics["oldest_policy_version"], batch.metrics["newest_policy_version"]) == (
        1,
        4,
    )
    assert set(batch.trajectory_rewards) == {"q2", "q3", "q4"}

    dropped = compose(results, policy=Policy(max_policy_lag=1, current_version="4", stale="drop"))
    assert [row.trajectory_id for row in dropped.rows] == ["tr_2", "tr_3", "tr_4"]
    assert dropped.metrics["stale_rollouts"] == 2 and dropped.metrics["dropped_rows"] == 2
    kept = compose(results, policy=Policy(max_policy_lag=1, current_version="4", stale="train"))
    assert [row.masked for row in kept.rows] == [None] * 5
    assert kept.metrics["stale_rollouts"] == 2
    # Without a current version the newest in the batch ("4") is the reference.
    assert compose(results, policy=Policy(max_policy_lag=2)).metrics["stale_rollouts"] == 1


def test_lags_line_up_with_the_spans_for_importance_weights() -> None:
    row = compose([rollout(0, BATCH[3])]).rows[0]
    assert row.version_lags("4").tolist() == [-1, -1, 1, 1, 0, 0, 0, 0, 0, 0]
    step = {"v3": 3, "v4": 4}
    named = rollout(0, [("v3", 2, 4), ("v4", 4, 10)])
    policy = Policy(max_policy_lag=0, current_version="v4", version_key=step.__getitem__)
    policy_rows = compose([named], policy=policy).rows
    assert policy_rows[0].masked == "stale"
    assert policy_rows[0].version_lags("v4", step.__getitem__)[2:5].tolist() == [1, 1, 0]


def test_labels_the_key_cannot_read_and_bad_options_are_refused() -> None:
    with pytest.raises(ValueError, match="'v3' cannot be ordered with version_key"):
        compose([rollout(0, [("v3", 2, 10)])], policy=Policy(max_policy_lag=1))
    # vLLM's own label before any update orders with nothing, which is fine without a lag.
    plain = compose([rollout(0, [("default", 2, 10)])]).metrics
    assert plain["policy_versions"] == 1 and "oldest_policy_version" not in plain
    with pytest.raises(ValueError, match="Policy.stale must be one of"):
        Policy(stale="skip")
    with pytest.raises(ValueError, match="max_policy_lag must be None or an integer"):
        Policy(max_policy_lag=-1)


# -- the engine wire ------------------------------------------------------------------------


def choice(spans: Any, n: int = 4) -> dict[str, Any]:
    entries = [{"token_id": 7, "logprob": -0.5, "rank": 1} for _ in range(n)]
    return {
        "token_ids": [7] * n,
        "logprobs": {"content": entries},
        "finish_reason": "stop",
        "weight_versions": spans,
    }


@pytest.mark.parametrize(
    ("spans", "problem"),
    [
        ([{"version": "1", "start": 0, "end": 3}], "cover 3 tokens of a 4-token completion"),
        ([{"version": "1", "start": 1, "end": 4}], "starts at 1, expected 0"),
        ([{"version": 1, "start": 0, "end": 4}], "version must be a string"),
        ([{"version": "1", "start": 0, "end": 0}], "0 <= start < end"),
        ({"version": "1"}, "must be a list of spans"),
    ],
)
def test_spans_that_do_not_fit_the_completion_are_an_engine_error(spans: Any, problem: str) -> None:
    from skycap.tokens.engine import EngineError, VLLMEngine

    with pytest.raises(EngineError, match=problem):
        VLLMEngine().parse({"choices": [choice(spans)]})
    assert VLLMEngine().parse({"choices": [choice(None)]}).weight_versions is None


def test_a_stream_takes_the_finishing_chunk_s_spans_and_a_stop_cut_clips_them() -> None:
    from skycap.tokens.engine import VLLMEngine
    from skycap.tokens.stops import cut_completion

    spans = [{"version": "1", "start": 0, "end": 3}, {"version": "2", "start": 3, "end": 4}]
    reader = VLLMEngine().stream_reader(0)
    first = choice(None, 2) | {"finish_reason": None}
    reader.feed({"choices": [first]})
    reader.feed({"choices": [choice(spans, 2)]})
    output = reader.finish()
    assert output.weight_versions == spans
    cut_completion(output, 3, 10)
    assert output.weight_versions == [{"version": "1", "start": 0, "end": 3}]
    # Aborted after a stop string: spans past the delivered tokens are clipped to them.
    stopped = VLLMEngine().stream_reader(0)
    stopped.feed({"choices": [first]})
    stopped.feed({"choices": [{**choice(spans, 0), "finish_reason": "abort"}]})
    assert stopped.finish(stopped=True).weight_versions == [{"version": "1", "start": 0, "end": 2}]


# -- check --reproduce: its arguments and exit codes ---------------------------------------


def test_reproduce_needs_a_tokenizer_and_says_when_it_cannot_load_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from test_viewer_fixtures import Build, tid

    from skycap.cli.main import main

    build = Build(tid(7))
    build.model(build.client(None, "hi"), "hello")
    build.write(tmp_path)
    assert main(["check", "--reproduce", str(tmp_path)]) == 2
    assert "--reproduce and --tokenizer NAME go together" in capsys.readouterr().err
    missing = str(tmp_path / "no-such-tokenizer")
    assert main(["check", "--reproduce", str(tmp_path), "--tokenizer", missing]) == 2
    assert "cannot load tokenizer" in capsys.readouterr().err
