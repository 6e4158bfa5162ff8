"""Text-mode overhead benchmark: direct, a minimal aiohttp relay, a no-op addon, and skycap, in
one run.

    uv run python scripts/bench_text.py [--requests 1500] [--concurrency 1,16,64]
        [--api chat,messages,responses] [--upstream asyncio,threaded] [--stream no,yes]
        [--reply-events 0]

The relay is the baseline a capture server is held to: an aiohttp server that parses the
request body, sends it upstream with one pooled aiohttp client, parses a whole reply, or
passes an event stream on chunk by chunk and parses each event's JSON as it passes (what a
capture server must read of a stream, as of a whole reply), and answers; nothing is
recorded. Streams are also sent through the pass-through, the same relay reading nothing
of a stream: the floor of relaying one, below any capture. `--upstream
threaded` (Chat Completions only) replaces the asyncio mock upstream with a
thread-per-connection `http.server` one. The no-op is the server skycap runs (the same
runner, listener and event loop) with an addon that only re-targets each call to the
upstream and streams event streams through: the transport's own cost, without capture.

The mock upstream, the relays, the no-op proxy and skycap each run in their own process; the load
generator (a raw keep-alive httpx.AsyncClient, one connection per concurrent worker)
sends the same body, whole replies and streamed (`--stream`), to each target, in
interleaved rounds (so load from elsewhere on the machine hits every target alike). Server
CPU comes from /proc/<pid>/stat (utime + stime) around each measurement. Printed per cell:
throughput, p50/p99 latency and server CPU per call; then the p50 each server adds over
direct and its CPU per call, with skycap's ratios to the relay (the target: at most 1,
docs/performance.md "Against a minimal aiohttp relay"). Each API (`--api`) has its own
mock upstream and servers, and its own rows. The upstream's reply is a short echo (a
stream of 2 content events) unless `--reply-events` asks for a reply of that many (vLLM
streams an event a token, so an agent's turn is hundreds). For a change to capture, judge by
bench_instructions.py, whose counts do not move between runs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson

from skycap.control_token import ENV as CONTROL_TOKEN_ENV
from skycap.control_token import new_control_token

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
MESSAGES = [
    {"role": "system", "content": "You are a careful coding agent. " * 8},
    {"role": "user", "content": "Find the bug in the parser and fix it. " * 4},
    {"role": "assistant", "content": "I will read the parser first.", "tool_calls": None},
    {"role": "user", "content": "Go ahead."},
]
TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}]
ANTHROPIC_MESSAGES = [m for m in MESSAGES if m["role"] != "system"]
ANTHROPIC_TOOLS = [{"name": "read_file", "input_schema": {"type": "object"}}]
#: The same conversation as a Responses request, as Codex sends one (developer first).
RESPONSES_INPUT = [
    {"type": "message", "role": role, "content": [{"type": part, "text": message["content"]}]}
    for message, role, part in zip(
        MESSAGES,
        ("developer", "user", "assistant", "user"),
        ("input_text", "input_text", "output_text", "input_text"),
        strict=True,
    )
]
RESPONSES_TOOLS = [{"type": "function", "name": "read_file", "parameters": {"type": "object"}}]


# -- the processes under test ----------------------------------------------------------------


def long_reply(events: int) -> str:
    """Text a mock upstream streams in about `events` content events (skycap.mock.replies
    PIECE_CHARS a piece), as words."""
    from skycap.mock.replies import PIECE_CHARS

    return ("tokens " * (events * PIECE_CHARS // 7 + 1))[: events * PIECE_CHARS]


def role_threaded_upstream(reply_events: int) -> None:
    """A thread-per-connection Chat Completions upstream (`http.server`), keep-alive."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from skycap.mock.chat_wire import completion_body, stream_events
    from skycap.mock.replies import Reply

    reply = Reply(content=long_reply(reply_events) if reply_events else "echo: Go ahead.")
    whole = completion_body(reply, model="policy", reply_id="chatcmpl-1", request_size=100)
    events = stream_events(
        reply, model="policy", reply_id="chatcmpl-1", request_size=100, include_usage=False
    )

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # head and body are separate writes

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            if orjson.loads(body).get("stream"):
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                for event in events:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                self.wfile.write(b"0\r\n\r\n")
            else:
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(whole)))
                self.end_headers()
                self.wfile.write(whole)

        def log_message(self, *args: object) -> None:
            return None

    class Server(ThreadingHTTPServer):
        request_queue_size = 256  # 64 workers connect at once
        daemon_threads = True

    server = Server(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print(f"http://127.0.0.1:{server.server_address[1]}/v1", flush=True)
    sys.stdin.read()
    server.shutdown()


def role_relay(upstream_url: str, reads_events: bool) -> None:
    """The minimal aiohttp capture relay, or with `reads_events` false the pass-through
    (see the module docstring)."""
    from aiohttp import ClientSession, TCPConnector, web

    upstream = upstream_url.removesuffix("/v1")
    hop = {"host", "content-length", "transfer-encoding", "connection"}

    async def relay(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        parsed = orjson.loads(body)  # what a capture server reads of the request
        session: ClientSession = request.app["session"]
        headers = {k: v for k, v in request.headers.items() if k.lower() not in hop}
        async with session.post(upstream + request.path, data=body, headers=headers) as reply:
            if parsed.get("stream") and reply.content_type == "text/event-stream":
                response = web.StreamResponse(status=reply.status)
                response.content_type = "text/event-stream"
                await response.prepare(request)
                unfinished = b""  # an event's start, its end not yet come
                async for chunk in reply.content.iter_any():
                    await response.write(chunk)
                    if reads_events:
                        *events, unfinished = (unfinished + chunk).split(b"\n\n")
                        for event in events:
                            for line in event.splitlines():
                                if line.startswith(b"data: {"):
                                    orjson.loads(line[6:])  # what a capture server reads
                await response.write_eof()
                return response
            data = await reply.read()
            orjson.loads(data)  # what a capture server reads of the reply
            return web.Response(status=reply.status, body=data, content_type=reply.content_type)

    async def serve_relay() -> None:
        app = web.Application()
        app["session"] = ClientSession(connector=TCPConnector(limit=0))
        app.router.add_post("/{tail:.*}", relay)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        print(f"http://127.0.0.1:{runner.addresses[0][1]}", flush=True)
        stop = asyncio.Event()
        asyncio.get_running_loop().add_reader(sys.stdin.fileno(), stop.set)
        await stop.wait()
        await app["session"].close()
        await runner.cleanup()

    asyncio.run(serve_relay())


def role_upstream(api: str, reply_events: int) -> None:
    from skycap.mock.anthropic import ScriptedAnthropicUpstream
    from skycap.mock.replies import Reply
    from skycap.mock.responses import ScriptedResponsesUpstream
    from skycap.mock.upstream import ScriptedUpstream

    kinds = {"messages": ScriptedAnthropicUpstream, "responses": ScriptedResponsesUpstream}
    reply = Reply(content=long_reply(reply_events))
    upstream = kinds.get(api, ScriptedUpstream)(script=(lambda _: reply) if reply_events else None)
    print(upstream.start(), flush=True)
    sys.stdin.read()
    upstream.stop()


class Retarget:
    """The no-op proxy: send every request to the mock upstream, relay event streams as
    they arrive (a proxy that buffered them would not be a fair baseline for streaming)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port

    def request(self, flow) -> None:
        data = flow.request.data
        data.scheme, data.host, data.port = b"http", self.host, self.port

    def responseheaders(self, flow) -> None:
        if flow.response.headers.get("content-type", "").startswith("text/event-stream"):
            flow.response.stream = True


def role_proxy(kind: str, upstream_url: str, loop_name: str) -> None:
    from skycap.server.options import ServerOptions
    from skycap.server.runner import new_event_loop, serve, settle_garbage_collector

    # The parent made the control token and passes it down in the environment.
    options = ServerOptions(upstream_url, control_token=os.environ[CONTROL_TOKEN_ENV])
    addons = None
    if kind == "noop":
        _, host, port = options.upstream_origin
        addons = [Retarget(host, port)]

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_reader(sys.stdin.fileno(), stop.set)

        def ready(url: str) -> None:
            settle_garbage_collector()  # as `skycap serve` does, for both proxies alike
            print(url, flush=True)

        await serve(options, ready=ready, stop_event=stop, addons=addons)

    factory = asyncio.new_event_loop if loop_name == "asyncio" else new_event_loop
    asyncio.run(main(), loop_factory=factory)


class Child:
    """A role in a subprocess; its first stdout line is its URL; closing stdin stops it."""

    def __init__(self, *args: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--role", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        self.url = self.process.stdout.readline().strip()
        if not self.url.startswith("http"):
            raise RuntimeError(f"{args[0]} did not start")

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime

    def stop(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=30)


# -- the load generator ------------------------------------------------------------------------


@dataclass
class Cell:
    api: str
    target: str
    stream: bool
    concurrency: int
    requests: int
    seconds: float
    latencies: list[float]
    cpu: float | None

    @property
    def p50(self) -> float:
        return statistics.median(self.latencies) * 1000

    @property
    def p99(self) -> float:
        return statistics.quantiles(self.latencies, n=100)[98] * 1000

    @property
    def rate(self) -> float:
        return self.requests / self.seconds

    @property
    def cpu_ms(self) -> float | None:
        return None if self.cpu is None else self.cpu / self.requests * 1000


async def drive(
    clients: list[httpx.AsyncClient], urls: list[str], body: bytes, stream: bool, total: int
) -> tuple[float, list[float]]:
    """One worker per client (one keep-alive connection each), `total` requests in all.

    A client per worker, not one pooled client: httpx's pool costs grow with its size and
    would make the load generator, not the proxy, the bottleneck at 64.
    """
    latencies: list[float] = []
    remaining = [total]

    async def worker(client: httpx.AsyncClient, url: str) -> None:
        while remaining[0] > 0:
            remaining[0] -= 1
            start = time.perf_counter()
            if stream:
                async with client.stream("POST", url, content=body) as response:
                    await response.aread()
            else:
                response = await client.post(url, content=body)
            latencies.append(time.perf_counter() - start)
            if response.status_code != 200:
                raise RuntimeError(f"{url} answered {response.status_code}: {response.text}")

    began = time.perf_counter()
    await asyncio.gather(*(worker(c, u) for c, u in zip(clients, urls, strict=True)))
    return time.perf_counter() - began, latencies


PATHS = {"chat": "chat/completions", "messages": "messages", "responses": "responses"}


def call_urls(api: str, target: str, base: str, workers: int) -> list[str]:
    if target != "skycap":
        return [f"{base}/v1/{PATHS[api]}"] * workers
    urls = []
    for _ in range(workers):
        created = httpx.post(
            f"{base}/trajectories",
            json={"meta": {"bench": True}},
            headers={"authorization": f"Bearer {os.environ[CONTROL_TOKEN_ENV]}"},
        ).json()
        urls.append(f"{created['base_url']}/{PATHS[api]}")
    return urls


def call_headers(api: str) -> dict[str, str]:
    """What the load generator's harness sends with each call of `api`."""
    headers = {"content-type": "application/json", "authorization": "Bearer sk-bench"}
    if api == "messages":
        headers |= {"x-api-key": "sk-bench", "anthropic-version": "2023-06-01"}
    return headers


def request_body(api: str, stream: bool) -> bytes:
    if api == "messages":
        body = {
            "model": "policy",
            "max_tokens": 256,
            "system": MESSAGES[0]["content"],
            "messages": ANTHROPIC_MESSAGES,
            "tools": ANTHROPIC_TOOLS,
            "stream": stream,
        }
    elif api == "responses":
        body = {
            "model": "policy",
            "input": RESPONSES_INPUT,
            "tools": RESPONSES_TOOLS,
            "store": False,
            "stream": stream,
        }
    else:
        body = {"model": "policy", "messages": MESSAGES, "tools": TOOLS, "stream": stream}
    return orjson.dumps(body)


def measure(
    api: str,
    upstream: str,
    targets: dict[str, tuple[str, Child | None]],
    stream: bool,
    concurrency: int,
    total: int,
    rounds: int,
) -> list[Cell]:
    """Every target in turn, `rounds` times, so load that comes and goes hits them alike."""
    body = request_body(api, stream)
    headers = call_headers(api)
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)

    async def run() -> list[Cell]:
        setups = {}
        for name, (base, proxy) in targets.items():
            urls = call_urls(api, name, base, concurrency)
            clients = [httpx.AsyncClient(limits=limits, timeout=60, headers=headers) for _ in urls]
            await drive(clients, urls, body, stream, max(100, total // 5))  # warm-up
            cell = Cell(f"{api}/{upstream}", name, stream, concurrency, 0, 0.0, [], 0.0)
            setups[name] = (urls, clients, proxy, cell)
        for _ in range(rounds):
            for urls, clients, proxy, cell in setups.values():
                before = proxy.cpu_seconds() if proxy else 0.0
                seconds, latencies = await drive(clients, urls, body, stream, total // rounds)
                if proxy is None:
                    cell.cpu = None
                else:
                    cell.cpu += proxy.cpu_seconds() - before
                cell.seconds += seconds
                cell.requests += len(latencies)
                cell.latencies += latencies
        for _, clients, _, _ in setups.values():
            for client in clients:
                await client.aclose()
        return [cell for _, _, _, cell in setups.values()]

    return asyncio.run(run())


def report(cells: list[Cell]) -> None:
    print(
        f"{'api/upstream':<17}{'stream':<7}{'conc':>5}  {'target':<7}{'req/s':>8}{'p50 ms':>9}"
        f"{'p99 ms':>9}{'cpu ms/call':>13}"
    )
    for c in cells:
        cpu = "-" if c.cpu_ms is None else f"{c.cpu_ms:.3f}"
        print(
            f"{c.api:<17}{str(c.stream):<7}{c.concurrency:>5}  {c.target:<7}{c.rate:>8.0f}"
            f"{c.p50:>9.3f}{c.p99:>9.3f}{cpu:>13}"
        )
    print()
    print(
        "added p50 over direct (ms) and server CPU per call (ms): relay, pass-through (streams "
        "only), no-op addon, skycap; skycap's ratios to the relay, and its CPU's to the "
        "pass-through"
    )
    print(
        f"{'api/upstream':<17}{'stream':<7}{'conc':>5}{'+p50 relay':>11}{'pass':>7}{'noop':>7}"
        f"{'skycap':>8}{'cpu relay':>10}{'pass':>7}{'noop':>7}{'skycap':>8}"
        f"{'/relay p50, cpu':>17}{'/pass cpu':>10}"
    )
    index = {(c.api, c.target, c.stream, c.concurrency): c for c in cells}
    for c in cells:
        if c.target != "skycap":
            continue
        key = (c.api, c.stream, c.concurrency)
        direct, relay, noop = (index[(key[0], t, *key[1:])] for t in ("direct", "relay", "noop"))
        passing = index.get((key[0], "pass", *key[1:]))
        added = [t.p50 - direct.p50 for t in (relay, noop, c)]
        cpu = [t.cpu_ms or 0.0 for t in (relay, noop, c)]
        if passing is None:
            pass_p50 = pass_cpu = pass_ratio = "-"
        else:
            pass_ms = passing.cpu_ms or 0.0
            pass_p50, pass_cpu = f"{passing.p50 - direct.p50:.3f}", f"{pass_ms:.3f}"
            pass_ratio = f"{cpu[2] / pass_ms:.2f}"
        print(
            f"{c.api:<17}{str(c.stream):<7}{c.concurrency:>5}{added[0]:>11.3f}{pass_p50:>7}"
            f"{added[1]:>7.3f}{added[2]:>8.3f}{cpu[0]:>10.3f}{pass_cpu:>7}{cpu[1]:>7.3f}"
            f"{cpu[2]:>8.3f}{added[2] / added[0]:>9.2f}, {cpu[2] / cpu[0]:.2f}{pass_ratio:>10}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1500, help="requests per cell")
    parser.add_argument("--concurrency", default="1,16,64", help="comma-separated")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per cell")
    parser.add_argument(
        "--api",
        default="chat,messages,responses",
        help="comma-separated: chat, messages, responses",
    )
    parser.add_argument(
        "--upstream",
        default="asyncio",
        help="comma-separated: asyncio (the mock servers), threaded (Chat Completions only)",
    )
    parser.add_argument(
        "--stream", default="no,yes", help="comma-separated: no (whole replies), yes (streams)"
    )
    parser.add_argument(
        "--loop",
        default="server",
        choices=("server", "asyncio"),
        help="the no-op proxy's and skycap's event loop: the one `skycap serve` runs "
        "(uvloop where installed; default) or asyncio's own",
    )
    parser.add_argument(
        "--reply-events",
        type=int,
        default=0,
        help="the upstream's reply: text streamed in about this many content events (vLLM "
        "streams one a token); 0 (default): a short echo, 2 content events",
    )
    parser.add_argument("--role", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        if args.role[0] == "upstream":
            role_upstream(args.role[1], int(args.role[2]))
        elif args.role[0] == "threaded":
            role_threaded_upstream(int(args.role[1]))
        elif args.role[0] in ("relay", "pass"):
            role_relay(args.role[1], reads_events=args.role[0] == "relay")
        else:
            role_proxy(args.role[0], args.role[1], args.role[2])
        return
    levels = [int(c) for c in args.concurrency.split(",")]
    choices = {"no": False, "yes": True}
    if not set(args.stream.split(",")) <= choices.keys():
        parser.error(f"--stream takes no and/or yes, got {args.stream!r}")
    streams = [choices[s] for s in args.stream.split(",")]
    os.environ[CONTROL_TOKEN_ENV] = new_control_token()  # the children inherit it
    cells = []
    for kind in args.upstream.split(","):
        for api in args.api.split(","):
            if api not in PATHS:
                parser.error(f"--api takes chat, messages and/or responses, got {api!r}")
            if kind not in ("asyncio", "threaded") or (kind == "threaded" and api != "chat"):
                parser.error(f"--upstream {kind} does not serve --api {api}")
            events = str(args.reply_events)
            if kind == "threaded":
                upstream = Child("threaded", events)
            else:
                upstream = Child("upstream", api, events)
            relay = Child("relay", upstream.url)
            passing = Child("pass", upstream.url)
            noop = Child("noop", upstream.url, args.loop)
            skycap = Child("skycap", upstream.url, args.loop)
            targets = {
                "direct": (upstream.url.removesuffix("/v1"), None),
                "relay": (relay.url, relay),
                "pass": (passing.url, passing),
                "noop": (noop.url, noop),
                "skycap": (skycap.url, skycap),
            }
            try:
                for stream in streams:
                    # A whole reply is read the same by the relay and the pass-through.
                    measured = {k: v for k, v in targets.items() if stream or k != "pass"}
                    for concurrency in levels:
                        cells += measure(
                            api, kind, measured, stream, concurrency, args.requests, args.rounds
                        )
            finally:
                for child in (relay, passing, noop, skycap, upstream):
                    child.stop()
    report(cells)


if __name__ == "__main__":
    main()
