"""Responses tools read into canonical form, and the function tools token mode renders for them.

A Responses request declares tools at the top level and, as Codex does at its defaults, in
`additional_tools` input items; they are read in that order into one list. `function`
tools become Chat Completions tools; `custom` tools (freeform input with a `format`) take
Chat Completions' custom-tool shape; a `namespace` tool keeps its members, which the model
calls by their qualified names (`namespace.member`). Other kinds (`web_search`, …) stay as
sent. Token mode renders every function and custom tool, a namespace's members by their
qualified names and a custom tool as a function whose single string argument `input` is
its freeform input (docs/tokens.md "Responses tools"); what it cannot render is named in
`omitted`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from skycap.wire import BodyError, all_objects

#: Joins a namespace and a member into the name the model calls.
SEPARATOR = "."
#: The single argument of a custom tool as token mode renders it.
CUSTOM_ARGUMENT = "input"


class RequestError(BodyError):
    """A Responses request skycap refuses (a 400): the message, and `param` the field."""


@dataclass(slots=True)
class Tools:
    """A request's tools: `canonical` (recorded and hashed), `rendered` (token mode's
    function tools), `omitted` (names of what token mode leaves out), `custom` (qualified
    names of custom tools) and `members` (qualified name to (namespace, member))."""

    canonical: list[dict[str, Any]] = field(default_factory=list)
    rendered: list[dict[str, Any]] = field(default_factory=list)
    omitted: list[str] = field(default_factory=list)
    custom: set[str] = field(default_factory=set)
    members: dict[str, tuple[str, str]] = field(default_factory=dict)

    @property
    def plain(self) -> bool:
        """Whether token mode renders exactly the canonical tools (all plain functions)."""
        return self.canonical == self.rendered


def qualified(namespace: str | None, name: str) -> str:
    """The name the model calls: a namespace member's is `namespace.member`."""
    return f"{namespace}{SEPARATOR}{name}" if namespace else name


def read_tools(tools: Any, where: str, into: Tools) -> None:
    """Add a `tools` list found at `where` (a JSON path) to `into` (a 400 on bad shapes)."""
    if not isinstance(tools, list) or not all_objects(tools):
        raise RequestError(f"`{where}` must be a list of objects", where)
    for index, tool in enumerate(tools):
        into.canonical.append(_tool(tool, where, index, None, into))


def _tool(
    tool: dict[str, Any], within: str, index: int, namespace: str | None, into: Tools
) -> dict[str, Any]:
    """The tool at `within[index]` in canonical form, added to `into`."""
    kind = tool.get("type")
    if kind == "function" and namespace is None and type(name := tool.get("name")) is str and name:
        # The usual tool, in a few steps: what the rules below make of it.
        body = dict(tool)
        del body["type"]
        function = {"type": "function", "function": body}
        into.rendered.append(function)
        return function
    where = f"{within}[{index}]"
    if not isinstance(kind, str):
        raise RequestError(f"{where} has no string `type`", f"{where}.type")
    if kind not in ("function", "custom", "namespace"):
        name = tool.get("name")
        into.omitted.append(qualified(namespace, name) if isinstance(name, str) and name else kind)
        return tool
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise RequestError(f"{where} is a {kind} tool without a `name`", f"{where}.name")
    body = {k: v for k, v in tool.items() if k != "type"}
    if kind == "namespace":
        if namespace is not None:
            raise RequestError(f"{where} is a namespace inside a namespace", f"{where}.type")
        members = tool.get("tools")
        if not isinstance(members, list) or not all_objects(members):
            raise RequestError(f"`{where}.tools` must be a list of objects", f"{where}.tools")
        body["tools"] = [
            _tool(member, f"{where}.tools", i, name, into) for i, member in enumerate(members)
        ]
        return {"type": "namespace", **body}
    called = qualified(namespace, name)
    if namespace is not None:
        into.members[called] = (namespace, name)
    if kind == "function":
        function = {"type": "function", "function": body}
        into.rendered.append(
            function
            if namespace is None
            else {"type": "function", "function": body | {"name": called}}
        )
        return function
    into.custom.add(called)
    into.rendered.append(_custom_function(called, tool))
    return {"type": "custom", "custom": body}


def _custom_function(name: str, tool: dict[str, Any]) -> dict[str, Any]:
    """A custom tool as the function token mode renders: one string argument, described
    by the tool's input format."""
    function: dict[str, Any] = {"name": name}
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    argument = {"type": "string", "description": format_description(tool.get("format"))}
    function["parameters"] = {
        "type": "object",
        "properties": {CUSTOM_ARGUMENT: argument},
        "required": [CUSTOM_ARGUMENT],
        "additionalProperties": False,
    }
    return {"type": "function", "function": function}


def format_description(value: Any) -> str:
    """What a custom tool's `format` asks of its input, in words the model reads."""
    kind = value.get("type") if isinstance(value, dict) else None
    if value is None or kind == "text":
        return "The tool's whole input, as free text."
    if kind == "grammar" and isinstance(value.get("definition"), str):
        syntax = value.get("syntax") if isinstance(value.get("syntax"), str) else "grammar"
        return (
            f"The tool's whole input, as free text matching this {syntax} grammar:\n"
            + value["definition"]
        )
    return "The tool's whole input, as free text in this format: " + orjson.dumps(value).decode()


def custom_arguments(text: str) -> str:
    """A custom tool call's input as the canonical call's `arguments` (compact JSON, as
    token mode's parser writes an object)."""
    return orjson.dumps({CUSTOM_ARGUMENT: text}).decode()


def custom_input(arguments: Any) -> str:
    """The freeform input a canonical custom call carries: its `input` argument, or the
    arguments as they are when a model wrote something else."""
    if isinstance(arguments, str):
        try:
            parsed = orjson.loads(arguments)
        except orjson.JSONDecodeError:
            return arguments
        if isinstance(parsed, dict) and isinstance(parsed.get(CUSTOM_ARGUMENT), str):
            return parsed[CUSTOM_ARGUMENT]
        return arguments
    return "" if arguments is None else orjson.dumps(arguments).decode()
