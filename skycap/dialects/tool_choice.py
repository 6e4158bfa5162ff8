"""Each dialect's `tool_choice` and parallel-call switch, read into one canonical form.

The canonical spelling is Chat Completions': `"auto"`, `"none"`, `"required"`, a named
function `{"type": "function", "function": {"name": ...}}`, or
`{"type": "allowed_tools", "allowed_tools": {"mode": ..., "tools": [...]}}`; kinds this
mapping does not know (a Responses hosted-tool choice such as `{"type": "web_search"}`)
are kept as sent. Token mode does not enforce a choice: the completion is what the engine
sampled. It records the choice (and `parallel_tool_calls` when the request set it) on the
call, answers a forced named function the way the API does, and for `"none"` leaves the
tools out of the prompt, named in `omitted_tools`, as vLLM's
`--exclude-tools-when-tool-choice-none` does, so the model is not shown tools it may not
call.
"""

from __future__ import annotations

from typing import Any

from skycap.dialects import Request
from skycap.wire import BodyError, all_objects, json_type

MODES = ("auto", "none", "required")
#: Anthropic's `tool_choice.type` and the canonical mode each means (`tool` names one).
ANTHROPIC_MODES = {"auto": "auto", "any": "required", "none": "none"}


def _named(name: Any, where: str) -> dict[str, Any]:
    if not isinstance(name, str) or not name:
        raise BodyError(
            f"`{where}.name` must be a non-empty tool name, got {name!r:.80}", f"{where}.name"
        )
    return {"type": "function", "function": {"name": name}}


def _mode(value: Any, where: str) -> str:
    if value not in MODES:
        raise BodyError(f"`{where}` must be one of {', '.join(MODES)}, got {value!r:.80}", where)
    return value


def _parallel(body: dict[str, Any], key: str) -> bool | None:
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise BodyError(f"`{key}` must be a boolean, got {json_type(value)}", key)
    return value


def chat(body: dict[str, Any]) -> tuple[Any, bool | None]:
    """A Chat Completions request's (tool_choice, parallel_tool_calls): already canonical,
    checked only as far as token mode reads it (a string is a mode, a function has a name)."""
    choice = body.get("tool_choice")
    if isinstance(choice, str):
        _mode(choice, "tool_choice")
    elif isinstance(choice, dict):
        if choice.get("type") == "function":
            function = choice.get("function")
            name = function.get("name") if isinstance(function, dict) else None
            _named(name, "tool_choice.function")
    elif choice is not None:
        raise BodyError(
            f"`tool_choice` must be a string or an object, got {json_type(choice)}", "tool_choice"
        )
    return choice, _parallel(body, "parallel_tool_calls")


def responses(body: dict[str, Any]) -> tuple[Any, bool | None]:
    """A Responses request's (tool_choice, parallel_tool_calls) in canonical form."""
    choice = body.get("tool_choice")
    if isinstance(choice, str):
        canonical: Any = _mode(choice, "tool_choice")
    elif isinstance(choice, dict):
        kind = choice.get("type")
        if kind == "function":
            canonical = _named(choice.get("name"), "tool_choice")
        elif kind == "allowed_tools":
            canonical = _allowed(choice)
        elif isinstance(kind, str) and kind:
            canonical = choice  # a hosted tool, MCP or custom tool: recorded as sent
        else:
            raise BodyError(
                "`tool_choice` must be a mode string or an object with a `type`", "tool_choice"
            )
    elif choice is None:
        canonical = None
    else:
        raise BodyError(
            f"`tool_choice` must be a string or an object, got {json_type(choice)}", "tool_choice"
        )
    return canonical, _parallel(body, "parallel_tool_calls")


def _allowed(choice: dict[str, Any]) -> dict[str, Any]:
    mode = choice.get("mode")
    if mode not in ("auto", "required"):
        raise BodyError(
            f"`tool_choice.mode` must be auto or required, got {mode!r:.80}", "tool_choice.mode"
        )
    tools = choice.get("tools")
    if not isinstance(tools, list) or not all_objects(tools):
        raise BodyError("`tool_choice.tools` must be a list of tool objects", "tool_choice.tools")
    listed = [
        _named(t.get("name"), f"tool_choice.tools[{k}]") if t.get("type") == "function" else t
        for k, t in enumerate(tools)
    ]
    return {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": listed}}


def messages(body: dict[str, Any]) -> tuple[Any, bool | None]:
    """An Anthropic Messages request's (tool_choice, parallel_tool_calls) in canonical form:
    `any` is `required`, `tool` a named function, `disable_parallel_tool_use: true` is
    `parallel_tool_calls: false`."""
    choice = body.get("tool_choice")
    if choice is None:
        return None, None
    if not isinstance(choice, dict):
        raise BodyError(f"`tool_choice` must be an object, got {json_type(choice)}")
    kind = choice.get("type")
    if kind == "tool":
        canonical: Any = _named(choice.get("name"), "tool_choice")
    elif isinstance(kind, str) and kind in ANTHROPIC_MODES:  # a list would not hash
        canonical = ANTHROPIC_MODES[kind]
    else:
        raise BodyError(
            f"`tool_choice.type` must be one of auto, any, tool, none, got {kind!r:.80}"
        )
    disable = choice.get("disable_parallel_tool_use")
    if disable is not None and not isinstance(disable, bool):
        raise BodyError(
            f"`tool_choice.disable_parallel_tool_use` must be a boolean, got {json_type(disable)}"
        )
    return canonical, None if disable is None else not disable


def names_a_function(choice: Any) -> bool:
    """Whether a canonical choice forces one named function."""
    return isinstance(choice, dict) and isinstance(choice.get("function"), dict)


def apply(request: Request, choice: Any, parallel: bool | None) -> Request:
    """Record the canonical choice on `request`, and leave the tools out for `"none"`."""
    if choice is not None:
        request.extras["tool_choice"] = request.recorded["tool_choice"] = choice
    if parallel is not None:
        request.recorded["parallel_tool_calls"] = parallel
    if choice == "none" and request.tools:
        request.extras["token_tools"] = None
        request.extras["omitted_tools"] = [_tool_name(t) for t in request.tools]
    return request


def _tool_name(tool: Any) -> str:
    """A canonical tool's name (a function's), else its kind: what `omitted_tools` lists."""
    if isinstance(tool, dict):
        function = tool.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            return function["name"]
        for key in ("name", "type"):
            if isinstance(tool.get(key), str) and tool[key]:
                return tool[key]
    return "tool"
