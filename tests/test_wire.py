"""Tests for strict body parsing, the chat checks and error bodies (wire, dialects.chat)."""

from __future__ import annotations

import orjson
import pytest

from skycap.dialects.chat import (
    MESSAGES_MESSAGE,
    N_MESSAGE,
    SAMPLING_KEYS,
    check_chat_request,
    openai_error,
    recorded_sampling,
)
from skycap.wire import BodyError, control_error, parse_json_body


def _refusal(raw: bytes, **kwargs: bool) -> str:
    with pytest.raises(BodyError) as caught:
        parse_json_body(raw, **kwargs)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_parses_json_and_keeps_values_exact() -> None:
    raw = '{"a": [1, 1.0, 1e16, "é🙂", null], "b": {"c": true}}'.encode()
    assert parse_json_body(raw) == {"a": [1, 1.0, 1e16, "é🙂", None], "b": {"c": True}}
    assert type(parse_json_body(b"[1.0]")[0]) is float


def test_empty_body_is_none_only_when_allowed() -> None:
    assert parse_json_body(b"", allow_empty=True) is None
    assert parse_json_body(b" \n", allow_empty=True) is None
    assert _refusal(b"") == "request body is not JSON: the body is empty; send a JSON object"


def test_not_json_carries_the_parser_detail() -> None:
    message = _refusal(b'{"a" 1}')
    assert message.startswith("request body is not JSON: unexpected character")
    assert "line 1 column 6 (char 5)" in message


def test_not_utf8_names_the_byte() -> None:
    message = _refusal(b'{"a": "\xff"}')
    assert message.startswith("request body is not JSON: it is not valid UTF-8")
    assert "0xff at offset 7" in message


@pytest.mark.parametrize("escape", [rb"\ud800", rb"\udc00", rb"\ud800x"])
def test_lone_surrogate_is_named(escape: bytes) -> None:
    """Orjson refuses lone surrogates; the message must say that is the problem."""
    message = _refusal(b'{"a": "' + escape + b'"}')
    assert message.startswith("request body is not JSON: a string holds a lone UTF-16 surrogate")


def test_surrogate_pair_is_fine() -> None:
    assert parse_json_body(rb'{"a": "\ud83d\ude42"}') == {"a": "🙂"}


@pytest.mark.parametrize(
    "literal", ["18446744073709551616", "-9223372036854775809", "1" + "0" * 400]
)
def test_integer_beyond_64_bits_is_named(literal: str) -> None:
    """Orjson would silently turn these into floats (or fail on infinity)."""
    message = _refusal(b'{"a": [1, ' + literal.encode() + b"]}")
    assert "is beyond 64 bits" in message
    assert message.startswith("request body is not JSON: integer " + literal[:20])


def test_64_bit_boundaries_and_look_alikes_are_accepted() -> None:
    raw = b'{"u": 18446744073709551615, "i": -9223372036854775808, "f": 12345678901234567890.5,'
    raw += b' "s": "123456789012345678901234567890", "e": 1e30}'
    body = parse_json_body(raw)
    assert body["u"] == 2**64 - 1 and type(body["u"]) is int
    assert body["i"] == -(2**63)
    assert body["s"] == "123456789012345678901234567890"
    assert body["e"] == 1e30


def test_float_overflow_keeps_the_parser_detail() -> None:
    assert _refusal(b'{"a": 1e400}').startswith("request body is not JSON: number is infinity")


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ([], "request body must be a JSON object, got an array"),
        ("x", "request body must be a JSON object, got a string"),
        (None, "request body must be a JSON object, got null"),
        ({}, MESSAGES_MESSAGE),
        ({"messages": "hi"}, MESSAGES_MESSAGE),
        ({"messages": [{"role": "user"}, "hi"]}, MESSAGES_MESSAGE),
        ({"messages": None, "n": 2}, MESSAGES_MESSAGE),
        ({"messages": [], "n": 2}, N_MESSAGE),
        ({"messages": [], "n": None}, N_MESSAGE),
        ({"messages": [], "n": True}, N_MESSAGE),
        ({"messages": [], "n": 1.0}, N_MESSAGE),
        ({"messages": [], "n": 0}, N_MESSAGE),
    ],
)
def test_step4_refusals_in_order(body: object, message: str) -> None:
    with pytest.raises(BodyError) as caught:
        check_chat_request(body)
    assert str(caught.value) == message


def test_step4_messages_are_the_spec_texts() -> None:
    assert MESSAGES_MESSAGE == "`messages` must be a list of objects"
    assert N_MESSAGE == "`n` > 1 is not supported: one call produces one sample"


def test_step4_accepts_a_chat_body() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "n": 1}
    assert check_chat_request(body) is body
    assert check_chat_request({"messages": []}) == {"messages": []}


def test_openai_error_shapes() -> None:
    assert orjson.loads(openai_error(410, "trajectory is finished", "trajectory_closed")) == {
        "error": {
            "message": "trajectory is finished",
            "type": "invalid_request_error",
            "param": None,
            "code": "trajectory_closed",
        }
    }
    server_side = orjson.loads(openai_error(502, "upstream unavailable: refused"))["error"]
    assert server_side["type"] == "api_error" and server_side["code"] is None


def test_control_error_shapes() -> None:
    assert orjson.loads(control_error("unknown trajectory")) == {"error": "unknown trajectory"}
    assert orjson.loads(control_error("rule failed", "path_rule_failed")) == {
        "error": "rule failed",
        "code": "path_rule_failed",
    }


def test_recorded_sampling_keeps_present_non_null_keys_as_sent() -> None:
    assert len(SAMPLING_KEYS) == 12 and "max_completion_tokens" in SAMPLING_KEYS
    body = {
        "model": "m",
        "temperature": 1,
        "top_p": 1.0,
        "seed": None,
        "stop": ["\n"],
        "max_completion_tokens": 9,
        "n": 1,
        "logprobs": True,
    }
    sampling = recorded_sampling(body)
    assert sampling == {"temperature": 1, "top_p": 1.0, "stop": ["\n"], "max_completion_tokens": 9}
    assert type(sampling["temperature"]) is int and type(sampling["top_p"]) is float
