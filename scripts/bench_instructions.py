"""Text-mode capture in instructions per call: the aiohttp relay (and, for streams, its
pass-through), the no-op addon and skycap under valgrind, in one run, with the roles and
load of bench_text.py.

    uv run python scripts/bench_instructions.py [--api chat,messages,responses]
        [--stream no,yes] [--calls 300] [--reply-events 0] [--events]

CPU time per call on a shared 2-core machine moves by 10% between runs of the same code
(bench_text.py); the instructions a server executes per call mostly move by under 2%
(now and then more: run twice before believing a change of a few percent), so this is the
benchmark to judge a change to capture by. Each server runs under callgrind
with collection off, takes a warm-up, then `--calls` calls one at a time with collection
on. What is counted is user space only: the kernel's share of a call (the system calls,
about the same for the three servers) is not, so the ratios here are larger than the CPU
time ratios of bench_text.py. Needs valgrind (Debian's `valgrind` package).

`--events` counts instead what each dialect's stream assembler executes per streamed
event of a reply of about 200 events, as the mock upstreams stream one (the part of
capture that grows with the reply: a benchmark call's stream has 5-10 events): the
difference between reading 200 such replies and none.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
import bench_text  # noqa: E402 - the roles and load live there

from skycap.control_token import ENV as CONTROL_TOKEN_ENV  # noqa: E402
from skycap.control_token import new_control_token  # noqa: E402

ROLES = ("relay", "pass", "noop", "skycap")
WARM_UP = 50
EVENTS = 200


def valgrind(tool: str, out: str, *args: str) -> list[str]:
    # A fixed hash seed: dict and set layouts, and so the instructions, repeat run to run.
    return [
        "env",
        "PYTHONHASHSEED=0",
        "valgrind",
        f"--tool={tool}",
        f"--{tool}-out-file={out}",
        *args,
    ]


def server_instructions(
    role: str, api: str, stream: bool, calls: int, workdir: str, reply_events: int
) -> float:
    """Instructions per call of one server role, collection on only for the measured calls."""
    upstream = bench_text.Child("upstream", api, str(reply_events))
    out = f"{workdir}/{role}.%p"
    args = [upstream.url] if role in ("relay", "pass") else [upstream.url, "server"]
    command = valgrind("callgrind", out, "--instr-atstart=no")
    command += [sys.executable, bench_text.__file__, "--role", role, *args]
    process = subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        assert process.stdout is not None
        url = process.stdout.readline().strip()
        if not url.startswith("http"):
            raise RuntimeError(f"{role} did not start under valgrind")
        urls = bench_text.call_urls(api, role, url, 1)
        body = bench_text.request_body(api, stream)
        headers = bench_text.call_headers(api)

        async def drive() -> None:
            async with httpx.AsyncClient(timeout=600, headers=headers) as client:
                await bench_text.drive([client], urls, body, stream, WARM_UP)
                control("-i", "on")
                await bench_text.drive([client], urls, body, stream, calls)
                control("-d")
                control("-i", "off")

        def control(*flags: str) -> None:
            subprocess.run(["callgrind_control", *flags, str(process.pid)], capture_output=True)

        asyncio.run(drive())
    finally:
        assert process.stdin is not None
        process.stdin.close()
        process.wait(timeout=600)
        upstream.stop()
    dump = Path(f"{workdir}/{role}.{process.pid}.1")  # the -d dump: the measured calls only
    for line in dump.read_text().splitlines():
        if line.startswith("summary:"):
            return int(line.split()[1]) / calls
    raise RuntimeError(f"no summary in {dump}")


def event_instructions(api: str, workdir: str) -> float:
    """Instructions per streamed event: reading `EVENTS` replies, less reading none (the
    interpreter's start), over the events read."""
    counts, events = [], 0
    for replies in (0, EVENTS):
        out = f"{workdir}/events.{api}.{replies}"
        command = valgrind("cachegrind", out, "--cache-sim=no")
        command += [sys.executable, __file__, "--role", "events", api, str(replies)]
        done = subprocess.run(command, check=True, capture_output=True, text=True)
        events = int(done.stdout.split()[-1])
        summary = next(s for s in Path(out).read_text().splitlines() if s.startswith("summary:"))
        counts.append(int(summary.split()[1]))
    return (counts[1] - counts[0]) / (EVENTS * events)


def role_events(api: str, replies: int) -> None:
    """Read `replies` streamed replies of about `EVENTS` events with `api`'s assembler;
    print how many events one has."""
    from skycap.dialects import chat, messages, responses
    from skycap.mock.anthropic import ScriptedAnthropicUpstream
    from skycap.mock.chat_wire import stream_events as chat_events
    from skycap.mock.replies import PIECE_CHARS, Reply
    from skycap.mock.responses import response_object
    from skycap.mock.responses import stream_events as responses_events

    reply = Reply(content="w" * (PIECE_CHARS * EVENTS))
    dialects = {"chat": chat.DIALECT, "messages": messages.DIALECT, "responses": responses.DIALECT}
    if api == "responses":
        response = response_object(reply, {}, response_id="resp_1", number=0, request_size=9)
        events = responses_events(response)
    elif api == "messages":
        events = ScriptedAnthropicUpstream()._reply_events(
            reply, model="policy", reply_id="msg_1", request_size=9, body={}
        )
    else:
        events = chat_events(
            reply, model="policy", reply_id="chatcmpl-1", request_size=9, include_usage=False
        )
    for _ in range(replies):
        assembler = dialects[api].assembler()
        for event in events:
            assembler.feed(event)
        assembler.result()
    print(len(events))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--api", default="chat,messages,responses", help="comma-separated")
    parser.add_argument("--stream", default="no,yes", help="comma-separated: no, yes")
    parser.add_argument("--calls", type=int, default=300, help="measured calls per server")
    parser.add_argument("--events", action="store_true", help="instructions per streamed event")
    parser.add_argument(
        "--reply-events", type=int, default=0, help="as bench_text.py's (0: a short reply)"
    )
    parser.add_argument("--role", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        role_events(args.role[1], int(args.role[2]))
        return
    if shutil.which("valgrind") is None:
        parser.error("valgrind is not installed (Debian: apt install valgrind)")
    apis = args.api.split(",")
    with tempfile.TemporaryDirectory() as workdir:
        if args.events:
            print(f"{'api':<11}{'instructions per streamed event':>33}")
            for api in apis:
                print(f"{api:<11}{event_instructions(api, workdir):>33,.0f}")
            return
        os.environ[CONTROL_TOKEN_ENV] = new_control_token()  # the servers inherit it
        print(
            f"{'api':<11}{'stream':<8}"
            + "".join(f"{r:>10}" for r in ROLES)
            + f"{'skycap/relay':>14}{'skycap/pass':>13}"
        )
        for api in apis:
            for stream in args.stream.split(","):
                # A whole reply is read the same by the relay and the pass-through.
                roles = [r for r in ROLES if stream == "yes" or r != "pass"]
                counts = {
                    r: server_instructions(
                        r, api, stream == "yes", args.calls, workdir, args.reply_events
                    )
                    for r in roles
                }
                row = "".join(
                    f"{counts[r] / 1000:>9.0f}k" if r in counts else f"{'-':>10}" for r in ROLES
                )
                passing = f"{counts['skycap'] / counts['pass']:.2f}" if "pass" in counts else "-"
                print(
                    f"{api:<11}{stream:<8}{row}{counts['skycap'] / counts['relay']:>14.2f}"
                    f"{passing:>13}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
