"""Benchmark: write and read back a 1,000-node, 1M-token record with routed experts,
then the record mirror: finish -> copied against S3 (moto on loopback), finish latency with
the mirror on and off, and the full-size record's copy (`--mirror-only` skips the first part)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import numpy as np
import zstandard

from skycap.graph import CLIENT, MODEL, Graph, Tokens
from skycap.record.reader import load_trajectory
from skycap.record.writer import LEVEL, write_record
from skycap.trajectory import Trajectory

NODES = 1_000
TOKENS = 1_000_000
LAYERS, TOP_K, EXPERTS = 48, 8, 128
SCAFFOLD = 3
BYTES_PER_TOKEN = 4
REPEATS = 3
TR_ID = "tr_00000000000000be"
CAPTURE = {
    "mode": "tokens",
    "engine": "vllm",
    "tokenizer": "Qwen/Qwen3-30B-A3B",
    "logprobs_mode": "processed_logprobs",
    "sampling_overrides": {},
    "use_raw_content": False,
}


def build_trajectory() -> tuple[Trajectory, int]:
    """A linear conversation of alternating client and model nodes; returns it and its raw
    array bytes (what the sidecars hold before compression)."""
    rng = np.random.default_rng(7)
    per_node = TOKENS // NODES
    experts = rng.integers(0, EXPERTS, size=(TOKENS, LAYERS, TOP_K), dtype=np.uint8)
    ids = rng.integers(0, 151_000, size=TOKENS, dtype=np.int32)
    offsets = np.arange(per_node, dtype=np.int32) * BYTES_PER_TOKEN
    graph = Graph()
    for i in range(NODES):
        model = i % 2 == 1
        span = slice(i * per_node, (i + 1) * per_node)
        logprobs = None
        if model:
            logprobs = np.concatenate([np.zeros(SCAFFOLD), -rng.random(per_node - SCAFFOLD)])
        node = graph.add(
            i - 1 if i else None,
            author=MODEL if model else CLIENT,
            message={"role": "assistant" if model else "user", "content": f"message {i}"},
            match_hash=f"{i:032x}",
            delta_hash=f"{i:032x}",
            created_at=1.7e9 + i,
            tokens=Tokens(
                ids=ids[span],
                sampled_start=SCAFFOLD if model else None,
                logprobs=logprobs,
                experts=experts[span],
                text=b"tok " * per_node,
                text_offsets=offsets,
            ),
        )
        if model:
            node.calls.append({"t_start": 1.7e9 + i, "t_end": 1.7e9 + i, "model": "policy"})
    trajectory = Trajectory(TR_ID, capture=CAPTURE, created_at=1.7e9, graph=graph)
    trajectory.status, trajectory.ended = "finished", True
    raw = experts.nbytes + ids.nbytes + TOKENS * 8 + TOKENS * 4 + TOKENS * BYTES_PER_TOKEN
    return trajectory, raw


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_added(action: Callable[[], object]) -> tuple[int, int]:
    """(tracemalloc peak, peak RSS) added while `action` runs, over what was held before."""
    gc.collect()
    base_rss = rss_bytes()
    peak_rss = base_rss
    done = threading.Event()

    def sample() -> None:
        nonlocal peak_rss
        while not done.is_set():
            peak_rss = max(peak_rss, rss_bytes())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    tracemalloc.start()
    sampler.start()
    try:
        result = action()
    finally:
        done.set()
        sampler.join()
        traced_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    del result
    return traced_peak, max(peak_rss, rss_bytes()) - base_rss


def timed(action: Callable[[], object]) -> tuple[float, float]:
    """(wall, CPU) seconds of one run; CPU counts every thread of the process."""
    gc.collect()
    wall, cpu = time.perf_counter(), time.process_time()
    action()
    return time.perf_counter() - wall, time.process_time() - cpu


def best_of(actions: dict[str, Callable[[], object]]) -> dict[str, tuple[float, float]]:
    """Each action's best wall and CPU time over REPEATS rounds, run interleaved so that
    load from other processes on the machine falls on all of them alike."""
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in actions}
    for _ in range(REPEATS):
        for name, action in actions.items():
            runs[name].append(timed(action))
    return {
        name: (min(w for w, _ in times), min(c for _, c in times)) for name, times in runs.items()
    }


def sidecar_payloads(record_dir: Path, files: list[str]) -> list[bytes]:
    return [
        zstandard.ZstdDecompressor().decompress((record_dir / name).read_bytes())
        for name in files[:-1]
    ]


def main() -> None:
    trajectory, raw = build_trajectory()
    with tempfile.TemporaryDirectory(prefix="bench_record_") as tmp:
        record_dir = Path(tmp)
        write_traced, write_rss = peak_added(lambda: write_record(trajectory, record_dir))
        files = write_record(trajectory, record_dir)
        payloads = sidecar_payloads(record_dir, files)
        payload_bytes = sum(map(len, payloads))
        compressor = zstandard.ZstdCompressor(level=LEVEL)
        times = best_of(
            {
                "write": lambda: write_record(trajectory, record_dir),
                "plain": lambda: [compressor.compress(p) for p in payloads],
                "read": lambda: load_trajectory(record_dir, TR_ID),
            }
        )
        payloads.clear()
        read_traced, read_rss = peak_added(lambda: load_trajectory(record_dir, TR_ID))
        on_disk = sum((record_dir / name).stat().st_size for name in files)

    mb = 1e6
    rows = [
        ("trajectory", f"{NODES} nodes, {TOKENS:,} tokens, experts [{TOKENS}, {LAYERS}, {TOP_K}]"),
        ("raw array bytes", f"{raw / mb:.1f} MB (sidecar payloads {payload_bytes / mb:.1f} MB)"),
        ("on disk", f"{on_disk / mb:.1f} MB in {len(files)} files"),
        *(
            (label, f"{w:.3f} s wall ({payload_bytes / mb / w:.0f} MB/s), {c:.3f} s CPU")
            for label, (w, c) in (
                ("write", times["write"]),
                ("plain zstd -3", times["plain"]),
                ("read (load)", times["read"]),
            )
        ),
        (
            "write / plain",
            f"{times['write'][0] / times['plain'][0]:.2f}x wall, "
            f"{times['write'][1] / times['plain'][1]:.2f}x CPU  (target <= 1.5x)",
        ),
        (
            "write peak added",
            f"traced {write_traced / mb:.1f} MB = {write_traced / raw:.3f}x raw, "
            f"RSS {write_rss / mb:.1f} MB = {write_rss / raw:.3f}x raw  (target <= 2x)",
        ),
        (
            "read peak added",
            f"traced {read_traced / mb:.1f} MB = {read_traced / raw:.2f}x raw, "
            f"RSS {read_rss / mb:.1f} MB = {read_rss / raw:.2f}x raw",
        ),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


# -- the record mirror ---------------------------------------------------------------------

MIRROR_TRAJECTORIES = 50
MIRROR_ROUNDS = 8
SUBMITS = 500
# Where the finish benchmark writes records (`--record-root DIR`; default the temp dir):
# on a busy disk each finish's fsyncs dominate and also flush the mirror's link/unlink.
RECORD_ROOT = next(
    (sys.argv[i + 1] for i, arg in enumerate(sys.argv[:-1]) if arg == "--record-root"), None
)


def start_s3() -> tuple[subprocess.Popen[bytes], dict[str, object], str]:
    """moto's S3 in its own process on a free loopback port (so its request handling does
    not share this process's GIL with the server measured); (process, options, URL)."""
    import socket

    import boto3

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                process.kill()
                raise RuntimeError("moto did not start within 60 s") from None
            time.sleep(0.05)
    endpoint = f"http://127.0.0.1:{port}"
    boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="bench",
        aws_secret_access_key="bench",
        region_name="us-east-1",
    ).create_bucket(Bucket="bench")
    options = {
        "endpoint_url": endpoint,
        "key": "bench",
        "secret": "bench",
        "client_kwargs": {"region_name": "us-east-1"},
    }
    return process, options, "s3://bench"


def big_record_copy(trajectory: Trajectory) -> float:
    """Seconds from submit to copied for the 1M-token record (343 MB in 3 files) to a
    file:// mirror on the same disk: the mirror's own overhead at full size. (moto keeps
    objects in Python memory and is no throughput target at this size.)"""
    from skycap.record.mirror import MirrorConfig, RecordMirror

    with (
        tempfile.TemporaryDirectory(prefix="bench_mirror_") as tmp,
        tempfile.TemporaryDirectory(prefix="bench_mirror_target_") as target,
    ):
        mirror = RecordMirror(Path(target).as_uri(), MirrorConfig())
        files = write_record(trajectory, Path(tmp))
        started = time.perf_counter()
        mirror.submit(Path(tmp), TR_ID, files)
        assert mirror.wait_idle(600), "the big record was not copied within 10 minutes"
        elapsed = time.perf_counter() - started
        assert mirror.health()["mirrored"] == 1, mirror.health()
        mirror.close()
    return elapsed


def submit_cost() -> list[float]:
    """Milliseconds a finish's write thread spends handing a record to the mirror (pinning
    its files and queueing), the only mirror work on the finish path."""
    from skycap.record.mirror import MirrorConfig, RecordMirror

    mirror = RecordMirror("memory://bench-submit/run", MirrorConfig(workers=1))
    costs = []
    with tempfile.TemporaryDirectory(prefix="bench_submit_") as tmp:
        record_dir = Path(tmp)
        for n in range(SUBMITS):
            name = f"tr_{n:016x}.json.zst"
            (record_dir / name).write_bytes(b"\0" * 2048)
            started = time.perf_counter()
            mirror.submit(record_dir, name[: -len(".json.zst")], [name])
            costs.append((time.perf_counter() - started) * 1000)
            assert mirror.wait_idle(10)
    mirror.close()
    return costs


def finish_latencies(mirror: dict[str, object] | None) -> tuple[list[float], list[float]]:
    """(finish ms, finish -> copied ms) over MIRROR_TRAJECTORIES one-call text trajectories."""
    import httpx

    from skycap import CaptureService
    from skycap.mock.upstream import ScriptedUpstream

    finish_ms, copied_ms = [], []
    with (
        ScriptedUpstream() as upstream,
        tempfile.TemporaryDirectory(prefix="bench_finish_", dir=RECORD_ROOT) as tmp,
    ):
        service = CaptureService(upstream.base_url, record_dir=tmp, **(mirror or {}))
        url = service.start()
        try:
            token = service.control_token
            headers = {"Authorization": f"Bearer {token}"} if token else None
            with httpx.Client(base_url=url, timeout=60, headers=headers) as http:
                for _ in range(MIRROR_TRAJECTORIES):
                    created = http.post("/trajectories", json={}).json()
                    httpx.post(
                        f"{created['base_url']}/chat/completions",
                        json={"model": "p", "messages": [{"role": "user", "content": "hi"}]},
                        headers={"Authorization": f"Bearer {created['api_key']}"},
                    ).raise_for_status()
                    started = time.perf_counter()
                    answer = http.post(f"/trajectories/{created['id']}/finish", json={}).json()
                    finished = time.perf_counter()
                    finish_ms.append((finished - started) * 1000)
                    if mirror is None:
                        continue
                    # Waited for in-process: polling GET .../record would add requests to
                    # the connection the next finish uses, and so to what is measured.
                    assert service.server.store.records.mirror.wait_idle(60), "a copy took > 60 s"
                    copied_ms.append((time.perf_counter() - finished) * 1000)
                    record = http.get(f"/trajectories/{created['id']}/record").json()
                    assert record["mirror_state"] == "copied", (answer, record)
        finally:
            service.stop()
    return finish_ms, copied_ms


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def mirror_main(trajectory: Trajectory) -> None:
    server, options, url = start_s3()
    try:
        big = big_record_copy(trajectory)
        submits = submit_cost()
        off: list[float] = []
        on: list[float] = []
        copied: list[float] = []
        for n in range(MIRROR_ROUNDS):  # interleaved, so machine load falls on both alike
            off += finish_latencies(None)[0]
            config = {"storage_options": options}
            finish, copy = finish_latencies(
                {"record_mirror": f"{url}/round-{n}", "record_mirror_config": config}
            )
            on += finish
            copied += copy
    finally:
        server.terminate()
        server.wait(10)
    rows = [
        ("mirror: big record", f"submit -> copied {big:.2f} s for 342.6 MB in 3 files (file://)"),
        *(
            (
                f"finish, mirror {label}",
                f"p50 {percentile(v, 50):.2f} ms, p95 {percentile(v, 95):.2f} ms "
                f"({len(v)} one-call text trajectories)",
            )
            for label, v in (("off", off), ("on", on))
        ),
        (
            "mirror submit",
            f"p50 {percentile(submits, 50):.3f} ms, p95 {percentile(submits, 95):.3f} ms "
            "(the finish path's share of the mirror)",
        ),
        (
            "finish -> copied",
            f"p50 {percentile(copied, 50):.1f} ms, p95 {percentile(copied, 95):.1f} ms "
            "(one-call text record)",
        ),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


if __name__ == "__main__":
    if "--mirror-only" not in sys.argv[1:]:
        main()
    mirror_main(build_trajectory()[0])
