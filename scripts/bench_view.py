"""Benchmark `skycap view`: index and list 10,000 records, open a 200k-token rollout.

Usage: uv run python scripts/bench_view.py [--records 10000] [--tokens 200000] [--keep DIR]

Records are written once with the skycap writer (one token-mode template per shape), then
copied under new ids with varied meta and annotations, so generating 10,000 takes seconds.
With /usr/bin/chromium present it also times the page: opening the rollout until its first
tokens are drawn, and scrolling its token view end to end. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import zstandard

from skycap.graph import Tokens
from skycap.hashing import digest
from skycap.record.writer import write_record
from skycap.trajectory import Trajectory
from skycap.viewer.index import Index
from skycap.viewer.server import make_server

CAPTURE = {
    "mode": "tokens",
    "engine": "vllm",
    "tokenizer": "bench",
    "logprobs_mode": "processed_logprobs",
    "sampling_overrides": {},
    "use_raw_content": False,
}
WORDS = "the model reads a file then calls a tool and checks the result before it answers".split()
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def pieces(ids: list[int]) -> tuple[bytes, list[int]]:
    """Toy decoding: token id k is the word WORDS[k % len] with a leading space."""
    texts = [(" " + WORDS[i % len(WORDS)]).encode() for i in ids]
    offsets = np.concatenate([[0], np.cumsum([len(t) for t in texts])[:-1]]).tolist()
    return b"".join(texts), offsets


def decode_spans(ids: list[int], context: list[int]) -> tuple[bytes, list[int]]:
    return pieces(ids)


def text_of(n: int, rng: np.random.Generator) -> str:
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), n))


def trajectory(id: str, turns: int, tokens_per_turn: int, seed: int) -> Trajectory:
    """A linear token-mode rollout: system, user, then `turns` × (reply, tool result)."""
    rng = np.random.default_rng(seed)
    t = Trajectory(id, capture=CAPTURE, meta={}, created_at=1.75e9)
    t.status, t.ended, t.finished_at = "finished", True, 1.75e9 + 60
    parent = None
    clock = 1.75e9
    for role in ("system", "user"):
        message = {"role": role, "content": text_of(60, rng)}
        ids = rng.integers(0, 5000, tokens_per_turn // 4).tolist()
        parent = t.graph.add(
            parent,
            author="client",
            message=message,
            match_hash=digest(message),
            delta_hash=digest([message, role]),
            created_at=clock,
            tokens=Tokens(ids=ids),
        ).id
    for turn in range(turns):
        message = {"role": "assistant", "content": text_of(80, rng)}
        ids = rng.integers(0, 5000, tokens_per_turn).tolist()
        lp = np.concatenate([np.zeros(3), -rng.exponential(0.5, tokens_per_turn - 3)])
        clock += 2
        node = t.graph.add(
            parent,
            author="model",
            message=message,
            match_hash=digest(message),
            delta_hash=digest([message, turn]),
            created_at=clock,
            tokens=Tokens(ids=ids, sampled_start=3, logprobs=lp),
        )
        node.calls.append(
            {
                "t_start": clock - 1.5,
                "t_end": clock,
                "model": "policy",
                "sampling": {"temperature": 1.0},
                "finish_reason": "tool_calls",
                "usage": {"prompt_tokens": 1000 * turn, "completion_tokens": 500},
                "tools": None,
                "bridged": turn > 0,
            }
        )
        tool = {"role": "tool", "content": text_of(120, rng)}
        parent = t.graph.add(
            node.id,
            author="client",
            message=tool,
            match_hash=digest(tool),
            delta_hash=digest([tool, turn]),
            created_at=clock,
            tokens=Tokens(ids=rng.integers(0, 5000, tokens_per_turn // 2).tolist()),
        ).id
    return t


def copy_record(
    template: Path,
    source_id: str,
    target: Path,
    new_id: str,
    meta: dict[str, Any],
    annotations: dict[str, Any],
) -> None:
    """The template under a new id: sidecars copied, the document rewritten (one frame each)."""
    document = orjson.loads(
        zstandard.ZstdDecompressor().decompress((template / f"{source_id}.json.zst").read_bytes())
    )
    document.update(id=new_id, meta=meta, annotations=annotations)
    for kind, entry in document["sidecars"].items():
        entry["file"] = f"{new_id}.{kind}.zst"
        shutil.copyfile(template / f"{source_id}.{kind}.zst", target / entry["file"])
    compressed = zstandard.ZstdCompressor(level=3).compress(orjson.dumps(document))
    (target / f"{new_id}.json.zst").write_bytes(compressed)


def make_run(root: Path, records: int) -> Path:
    """`records` rollouts of 8 turns in groups of 16 (step × instance), some retried."""
    template = root / "template"
    template.mkdir()
    write_record(trajectory("tr_00000000000000aa", 8, 400, 1), template, decode_spans=decode_spans)
    run = root / "train" / "skycap"
    run.mkdir(parents=True)
    rng = np.random.default_rng(7)
    for n in range(records):
        step, rest = divmod(n, 16 * 16)
        instance, repetition = divmod(rest, 16)
        meta = {
            "task": f"tasks/t{instance}.json",
            "instance_id": f"t{instance}",
            "repetition_id": repetition,
            "step": step,
            "attempt": 0,
        }
        annotations = {"reward": float(rng.integers(0, 2)), "stop_reason": "stop"}
        copy_record(template, "tr_00000000000000aa", run, f"tr_{n:016x}", meta, annotations)
    return run


def timed(fn) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def bench_index(run: Path) -> list[tuple[str, float]]:
    index = Index([run.parent], min_interval=0)
    first, _ = timed(lambda: index.refresh(force=True))
    again, _ = timed(lambda: index.refresh(force=True))
    return [("index 10k documents (first, cold cache)", first), ("rescan, nothing changed", again)]


def bench_server(root: Path, records: int, big_id: str, browser: bool) -> list[tuple[str, float]]:
    server = make_server([root], port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = server.url.rstrip("/")
    rows: list[tuple[str, float]] = []
    with httpx.Client(base_url=base, timeout=60) as http:
        http.get("/api/v1/runs").raise_for_status()
        time.sleep(1.1)  # past the rescan throttle, so the next listing rescans
        for label, path in (
            ("list runs (with a rescan)", "/api/v1/runs"),
            ("groups page (default order)", "/api/v1/runs/train/groups"),
            (
                "groups page, sort=reward, filter flag",
                "/api/v1/runs/train/groups?sort=reward&flag=no-signal",
            ),
            ("rollouts page, sort=tokens", "/api/v1/runs/train/trajectories?sort=tokens"),
        ):
            seconds, response = timed(lambda path=path: http.get(path))
            response.raise_for_status()
            rows.append((label, seconds))
        detail, _ = timed(
            lambda: http.get(f"/api/v1/runs/big/trajectories/{big_id}").raise_for_status()
        )
        path, response = timed(lambda: http.get(f"/api/v1/runs/big/trajectories/{big_id}/paths/0"))
        response.raise_for_status()
        count = response.json()["token_data"]["count"]
        rows += [
            ("200k rollout: detail (document, flags, sidecar check)", detail),
            (
                f"200k rollout: path payload ({count:,} tokens, "
                f"{len(response.content) / 1e6:.1f} MB)",
                path,
            ),
        ]
    if browser:
        rows += bench_browser(server.url, big_id)
    server.shutdown()
    server.server_close()
    return rows


def bench_browser(url: str, big_id: str) -> list[tuple[str, float]]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1500, "height": 900})
        page.goto(f"{url}?run=big")  # warm the module cache; each goto below reloads the page
        page.wait_for_selector("tr.rollout", timeout=60_000)
        listed = []
        for query, row in (("run=train", "tr.group"), ("run=train&view=rollouts", "tr.rollout")):
            start = time.perf_counter()
            page.goto(f"{url}?{query}")
            page.wait_for_selector(row, timeout=60_000)
            listed.append(time.perf_counter() - start)
        start = time.perf_counter()
        page.goto(f"{url}?run=big&open={big_id}")
        page.wait_for_selector(".tv .t", timeout=60_000)
        opened = time.perf_counter() - start
        spans = page.locator(".tv .t").count()
        jumps = page.evaluate("""async () => {
            const tv = document.querySelector('.tv');
            const frame = () => new Promise(
                r => requestAnimationFrame(() => requestAnimationFrame(r)));
            const times = [];
            for (let i = 0; i < 100; i++) {
                const t0 = performance.now();
                tv.scrollTop = ((i * 37) % 100) / 100 * tv.scrollHeight;
                await frame();
                times.push(performance.now() - t0);
            }
            return times;
        }""")
        frames = page.evaluate("""async () => {
            const tv = document.querySelector('.tv');
            tv.scrollTop = 0;
            const intervals = [];
            let last = null;
            await new Promise(done => {
                const tick = (now) => {
                    if (last !== null) intervals.push(now - last);
                    last = now;
                    tv.scrollTop += 60;
                    if (intervals.length < 300) requestAnimationFrame(tick); else done();
                };
                requestAnimationFrame(tick);
            });
            return intervals;
        }""")
        browser.close()
    frames.sort()
    return [
        ("page: load and list the 10k run, groups view", listed[0]),
        ("page: load and list the 10k run, rollouts view", listed[1]),
        (f"page: open 200k rollout until tokens drawn ({spans} spans in the DOM)", opened),
        (
            "page: jump anywhere and draw, median of 100 (includes 2 frames)",
            statistics.median(jumps) / 1000,
        ),
        (
            "page: smooth scroll 60 px/frame, median frame interval",
            statistics.median(frames) / 1000,
        ),
        (
            "page: smooth scroll 60 px/frame, p95 frame interval",
            frames[int(0.95 * len(frames))] / 1000,
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=10_000)
    parser.add_argument("--tokens", type=int, default=200_000)
    parser.add_argument("--keep", type=Path, help="write the records here and keep them")
    args = parser.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="bench_view_"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        made, run = timed(lambda: make_run(root, args.records))
        big_dir = root / "big"
        big_dir.mkdir()
        turns = 100
        per_turn = int(args.tokens / (1.5 * turns + 0.5))  # reply + half-size tool result
        big = trajectory("tr_00000000000000bb", turns, per_turn, 2)
        write_record(big, big_dir, decode_spans=decode_spans)
        print(f"generated {args.records:,} records in {made:.1f} s under {root}")
        rows = bench_index(run)
        rows += bench_server(root, args.records, "tr_00000000000000bb", CHROMIUM.exists())
        width = max(len(label) for label, _ in rows)
        print(f"\n{'measure'.ljust(width)}  seconds")
        for label, seconds in rows:
            print(f"{label.ljust(width)}  {seconds:8.3f}")
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
