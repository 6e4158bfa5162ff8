"""The hash recipes reproduce graph.md's pinned vectors and canonical JSON rules."""

from __future__ import annotations

import pytest

from skycap.hashing import (
    canonical_json,
    digest,
    rendered_fields,
    text_match,
    text_model_delta,
    token_client_delta,
    token_digest,
    token_match,
    token_model_delta,
    tools_hash,
)

PINNED = {
    "role": "assistant",
    "content": "hi",
    "refusal": None,
    "provider_specific_fields": {"x": 1},
    "tool_calls": [{"id": "c0", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
}


def test_pinned_vectors() -> None:
    assert text_match(PINNED, "t", "policy") == "f378894da4b0e48303e35fdf42be5375"
    assert token_match(PINNED, "t", "policy") == "2bc94eedd73c39da36f6e5cee703ab40"
    assert token_digest([1, 2, 3]) == "abccad42d03c940bc2b249bf5a4e1e3d"


def test_worked_values() -> None:
    user = text_match({"role": "user", "content": "What is 2+2?"}, "", "policy")
    assert user == "cdc3435ce856e3ef88872e3490a8f747"
    reply = text_match({"role": "assistant", "content": "4"}, "", "policy")
    assert reply == "126a835bc73fadf0775e1e10dc37387e"
    assert text_model_delta(reply, {"temperature": 0.7}) == "36627b58f2ac4691776c76d1e8cd8865"
    tuser = token_match({"role": "user", "content": "qé"}, "", "policy")
    assert tuser == "23d08d556190f3432ceb1d5d72b70ebf"
    assert token_client_delta(tuser, [1, 2, 3]) == "2ea795a294789b103b41d03c6802e7d7"
    tmodel = token_match({"role": "assistant", "content": "🙂ok"}, "", "policy")
    assert tmodel == "e7d32efae04b06ebc9d368bac05ba2b9"
    delta = token_model_delta(tmodel, {"temperature": 1.0}, 1, [4, 5, 6, 7])
    assert delta == "d0374863d2e27a5bc56ed73cc6e8f464"


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (1e16, b"1e+16"),
        (1e-6, b"1e-6"),
        (1.0, b"1.0"),
        (1e-5, b"0.00001"),
        (-0.0, b"-0.0"),
        (2.5e-7, b"2.5e-7"),
        (100.0, b"100.0"),
        (float("nan"), b"null"),
        ("qé", '"qé"'.encode()),
        ("🙂", '"🙂"'.encode()),
        ("a/\u007f\u2028", '"a/\u007f\u2028"'.encode()),
        ("\x01\n", b'"\\u0001\\n"'),
    ],
)
def test_canonical_json_scalars(value: object, text: bytes) -> None:
    assert canonical_json(value) == text


def test_canonical_json_sorts_keys_by_code_point() -> None:
    assert canonical_json({"b": 1, "a": {"é": 1, "z": 2}, "A": 0}) == (
        b'{"A":0,"a":{"z":2,"\xc3\xa9":1},"b":1}'
    )


def test_int_and_float_hash_differently() -> None:
    assert digest({"top_p": 1}) != digest({"top_p": 1.0})


def test_top_level_empties_are_absent_but_nested_and_empty_strings_count() -> None:
    base = {"role": "user", "content": "x"}
    assert text_match({**base, "name": None, "tool_calls": []}, "", "m") == text_match(
        base, "", "m"
    )
    assert text_match({**base, "extra": {"a": []}}, "", "m") != text_match(base, "", "m")
    assert text_match({"role": "user", "content": ""}, "", "m") != text_match(
        {"role": "user"}, "", "m"
    )


def test_rendered_fields_drop_what_templates_never_read() -> None:
    fields = rendered_fields(PINNED)
    assert fields == {
        "role": "assistant",
        "content": "hi",
        "tool_calls": [{"id": "c0", "function": {"name": "f", "arguments": "{}"}}],
    }


def test_tools_hash_only_for_non_empty_lists() -> None:
    assert tools_hash(None) == tools_hash([]) == tools_hash({"a": 1}) == ""
    assert len(tools_hash([{"type": "function"}])) == 32
