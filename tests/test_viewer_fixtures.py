"""Records for the viewer tests: skycap trajectories built in memory, written by the skycap writer.

A toy byte-level vocabulary stands in for a tokenizer: words are tokens, non-ASCII words
split every two bytes (so a character can straddle tokens, as with byte-level BPE), and
`decode_spans` gives each multi-byte character to the token that completes it.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import zstandard

from skycap.graph import Tokens
from skycap.hashing import digest
from skycap.record.writer import write_record
from skycap.trajectory import Trajectory
from skycap.viewer.validate import check_directory

TOKEN_CAPTURE = {
    "mode": "tokens",
    "engine": "vllm",
    "tokenizer": "toy",
    "logprobs_mode": "processed_logprobs",
    "sampling_overrides": {},
    "use_raw_content": False,
}
PIECES: list[bytes] = []
VOCAB: dict[bytes, int] = {}
ABSENT = object()
T0 = 1_750_000_000.0


def token(piece: bytes) -> int:
    if piece not in VOCAB:
        VOCAB[piece] = len(PIECES)
        PIECES.append(piece)
    return VOCAB[piece]


def encode(text: str) -> list[int]:
    ids = []
    for word in re.findall(r"\s*\S+|\s+", text):
        data = word.encode()
        step = 2 if len(data) != len(word) else len(data)
        ids += [token(data[i : i + step]) for i in range(0, len(data), step)]
    return ids


def decode_spans(ids: list[int], context: list[int]) -> tuple[bytes, list[int]]:
    """The ids' text; each token starts at the character boundary at or before its bytes."""
    data = b"".join(PIECES[i] for i in ids)
    offsets, cursor = [], 0
    for i in ids:
        start = cursor
        while 0 < start < len(data) and data[start] & 0xC0 == 0x80:
            start -= 1
        offsets.append(start)
        cursor += len(PIECES[i])
    return data, offsets


SCAFFOLD = [token(b"<|im_start|>"), token(b"assistant"), token(b"\n")]
IM_END = token(b"<|im_end|>")


class Build:
    """One trajectory under construction: add client and model nodes, then `write`."""

    def __init__(
        self,
        id: str,
        *,
        mode: str = "tokens",
        meta: dict[str, Any] | None = None,
        annotations: dict[str, Any] | None = None,
        status: str = "finished",
        created_at: float = T0,
    ) -> None:
        capture = dict(TOKEN_CAPTURE) if mode == "tokens" else {"mode": "text"}
        self.t = Trajectory(id, capture=capture, meta=meta or {}, created_at=created_at)
        self.t.annotations = annotations or {}
        self.t.status = status
        self.t.ended = status != "open"
        self.t.finished_at = None if status == "open" else created_at + 10
        self.clock = created_at
        self.rng = np.random.default_rng(len(id))

    @property
    def tokens_mode(self) -> bool:
        return self.t.mode == "tokens"

    def client(
        self, parent: int | None, content: str, role: str = "user", *, match: str | None = None
    ) -> int:
        message = {"role": role, "content": content}
        tokens = None
        if self.tokens_mode:
            ids = [token(b"<|im_start|>"), *encode(f"{role}\n{content}"), IM_END, token(b"\n")]
            tokens = Tokens(ids=ids)
        match = match or digest(message)
        delta = digest([match, "client", tokens.ids.tolist() if tokens else None])
        self.clock += 1
        node = self.t.graph.add(
            parent,
            author="client",
            message=message,
            match_hash=match,
            delta_hash=delta,
            created_at=self.clock,
            tokens=tokens,
        )
        return node.id

    def model(
        self,
        parent: int,
        content: str,
        *,
        finish: str = "stop",
        bridged: Any = None,
        logprobs: bool = True,
        mask: bool = False,
        sampling: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> int:
        message = {"role": "assistant", "content": content}
        sampling = sampling or {"temperature": 1.0, "max_tokens": 512}
        tokens = None
        if self.tokens_mode:
            sampled = [*encode(content), IM_END]
            lp = None
            if logprobs:
                lp = np.concatenate([np.zeros(3), -self.rng.exponential(0.6, len(sampled))])
            rows = [[i, i + 1] for i in sampled] if mask else None
            mask_ids, mask_offsets = (None, None)
            if rows is not None:
                mask_ids = np.array([i for r in rows for i in r], dtype=np.int32)
                mask_offsets = np.arange(0, 2 * len(rows) + 1, 2, dtype=np.int64)
            tokens = Tokens(
                ids=[*SCAFFOLD, *sampled],
                sampled_start=3,
                logprobs=lp,
                mask_ids=mask_ids,
                mask_offsets=mask_offsets,
            )
        match = digest(message)
        delta = digest([match, "model", tokens.ids.tolist() if tokens else None, sampling])
        self.clock += 2
        node = self.t.graph.add(
            parent,
            author="model",
            message=message,
            match_hash=match,
            delta_hash=delta,
            created_at=self.clock,
            tokens=tokens,
        )
        completion = len(encode(content)) + 1
        call = {
            "t_start": self.clock - 1.5,
            "t_end": self.clock,
            "model": "policy",
            "sampling": sampling,
            "usage": {"prompt_tokens": 20 * (node.depth + 1), "completion_tokens": completion},
            "finish_reason": finish,
            "tools": self.t.register_tools(tools) if tools else None,
        }
        if bridged is not ABSENT:
            call["bridged"] = bridged if self.tokens_mode else None
        node.calls.append(call)
        return node.id

    def chat(self, turns: int, *, start: int | None = None, text: str = "step") -> int:
        """`turns` model replies, each after a tool message; returns the last node."""
        node = self.client(start, f"Solve the task carefully: {text}.") if start is None else start
        for turn in range(turns):
            node = self.model(
                node,
                f"Thinking about {text} part {turn}: use the tool.",
                bridged=None if turn == 0 else True,
            )
            node = self.client(node, f"tool output {turn} for {text}", role="tool")
        return self.model(node, f"The answer to {text} is 42.", bridged=True)

    def write(self, record_dir: Path) -> str:
        record_dir.mkdir(parents=True, exist_ok=True)
        write_record(self.t, record_dir, decode_spans=decode_spans if self.tokens_mode else None)
        return self.t.id


def tid(n: int) -> str:
    return f"tr_{n:016x}"


def rewrite_document(path: Path, change) -> None:
    """Tamper with a written document (malformed records no skycap writer makes)."""
    document = orjson.loads(zstandard.ZstdDecompressor().decompress(path.read_bytes()))
    change(document)
    path.write_bytes(zstandard.ZstdCompressor().compress(orjson.dumps(document)))


# --- the GRPO run: groups of 4 repetitions per instance and step ---------------------------

GRPO = {
    # (step, instance): [(repetition, attempt, reward, stop_reason, forked)]
    (1, "a"): [
        (0, 0, 1, "stop", True),
        (1, 0, 0, "stop", False),
        (2, 0, 1, "stop", False),
        (3, 0, 1, "stop", False),
    ],
    (1, "b"): [(r, 0, 0, "stop", False) for r in range(4)],
    (1, "c"): [
        (0, 0, 1, "stop", False),
        (1, 0, 0, "agent_timeout", False),
        (2, 0, 1, "stop", False),
        (3, 0, 0, "stop", False),
    ],
    (1, "d"): [(r, 0, r % 2, "stop", False) for r in range(3)],
    (2, "a"): [
        (0, 0, 0, "error", False),
        (0, 1, 1, "stop", False),
        (1, 0, 0, "stop", False),
        (2, 0, 1, "stop", False),
        (3, 0, 0.5, "stop", False),
    ],
}


def grpo_id(step: int, instance: str, repetition: int, attempt: int) -> str:
    return tid(0xA000 + step * 0x100 + (ord(instance) - 96) * 0x10 + repetition * 2 + attempt)


def write_grpo(record_dir: Path) -> None:
    for (step, instance), rows in GRPO.items():
        for repetition, attempt, reward, stop, forked in rows:
            build = Build(
                grpo_id(step, instance, repetition, attempt),
                meta={
                    "task": f"tasks/{instance}.json",
                    "instance_id": instance,
                    "repetition_id": repetition,
                    "step": step,
                    "attempt": attempt,
                },
                annotations={"reward": reward, "stop_reason": stop},
                created_at=T0 + step * 1000 + repetition * 10 + attempt,
            )
            leaf = build.chat(2, text=f"{instance}{repetition}")
            if forked:
                root = build.t.graph.path_to(leaf)[0]
                build.model(root, "A second try 🙂 différent.", bridged=None)
            build.write(record_dir)


# --- the mixed run: one trajectory per flag ----------------------------------------------

MIXED: dict[str, str] = {}


def _mixed(name: str, n: int) -> str:
    MIXED[name] = tid(0xB000 + n)
    return MIXED[name]


def write_mixed(record_dir: Path) -> None:
    b = Build(_mixed("text_linear", 1), mode="text", annotations={"reward": 0.25})
    b.chat(1)
    b.write(record_dir)

    b = Build(_mixed("text_forked", 2), mode="text", annotations={"reward": 0.75})
    root = b.client(None, "Write a haiku.")
    b.model(root, "An old silent pond", finish="length")
    b.model(root, "A frog jumps in", sampling={"temperature": 0.2})
    b.write(record_dir)

    b = Build(_mixed("failed", 3), status="failed")
    b.chat(1)
    b.t.failures.append(
        {"t": T0 + 50, "status": None, "error": "token attribution: mismatch", "input_leaf": None}
    )
    b.write(record_dir)

    b = Build(_mixed("abandoned", 4), status="abandoned")
    b.chat(1)
    b.write(record_dir)

    b = Build(_mixed("open", 5), status="open")
    b.chat(0)
    b.write(record_dir)

    b = Build(_mixed("empty", 6))
    b.write(record_dir)

    b = Build(_mixed("unbridged", 7))
    user = b.client(None, "hello")
    first = b.model(user, "hi")
    tool = b.client(first, "tool says hi", role="tool")
    b.model(tool, "done", bridged=False)
    b.write(record_dir)

    # A resample renders in full, as expected: the flag says why instead of warning.
    b = Build(_mixed("unbridged_resample", 17))
    user = b.client(None, "hello")
    b.model(user, "hi")
    b.model(user, "hello again", bridged=False, sampling={"temperature": 0.3})
    b.write(record_dir)

    # A re-tokenized copy of model node 1 (same match hash, client-authored), continued by a
    # call written before `bridged` existed: unbridged-inferred and bridged-unknown.
    b = Build(_mixed("inferred", 8))
    user = b.client(None, "hello")
    reply = b.model(user, "hi there", bridged=ABSENT)
    copy = b.client(user, "hi there", role="assistant", match=b.t.graph[reply].match_hash)
    tool = b.client(copy, "more", role="user")
    b.model(tool, "ok", bridged=ABSENT)
    b.write(record_dir)

    b = Build(_mixed("replayed", 9))
    user = b.client(None, "hello")
    written = b.client(user, "I wrote this reply myself", role="assistant")
    nxt = b.client(written, "go on")
    b.model(nxt, "going on")
    b.write(record_dir)

    b = Build(_mixed("no_logprobs", 10))
    user = b.client(None, "hello")
    b.model(user, "no logprobs here", logprobs=False)
    b.write(record_dir)

    # Two tool results after the same reply: the second path trains nothing.
    b = Build(_mixed("no_train", 11))
    user = b.client(None, "hello")
    reply = b.model(user, "calling the tool")
    b.client(reply, "result one", role="tool")
    b.client(reply, "result two", role="tool")
    b.write(record_dir)

    # `final` trained only the last path: the dead-end reply is trained in no path.
    b = Build(_mixed("final_rule", 12))
    user = b.client(None, "hello")
    dead = b.model(user, "first reply")
    last = b.model(user, "second reply", sampling={"temperature": 0.5})
    b.t.samples = {"paths": "final", "rows": [{"leaf": last, "targets": [last]}]}
    assert dead < last
    b.write(record_dir)

    b = Build(_mixed("masked_tokens", 13))
    user = b.client(None, "hello with a mask")
    b.model(user, "sampled under a mask", mask=True)
    b.write(record_dir)

    b = Build(_mixed("malformed", 14))
    user = b.client(None, "hello")
    b.model(user, "sampled under a mask", mask=True)
    b.write(record_dir)
    rewrite_document(
        record_dir / f"{MIXED['malformed']}.json.zst",
        lambda doc: doc["sidecars"].pop("sampling_mask"),
    )

    # A broken rule that trained one reply on two rows: train-once violated.
    b = Build(_mixed("train_twice", 15))
    user = b.client(None, "hello")
    reply = b.model(user, "trained twice")
    first = b.client(reply, "one", role="tool")
    second = b.client(reply, "two", role="tool")
    b.t.samples = {
        "paths": "custom",
        "rows": [{"leaf": first, "targets": [reply]}, {"leaf": second, "targets": [reply]}],
    }
    b.write(record_dir)

    # Nodes slice into tokens but the manifest lists none: drawn as text, `tokens-unlisted`.
    b = Build(_mixed("unlisted", 16))
    b.model(b.client(None, "hello"), "no manifest")
    b.write(record_dir)
    rewrite_document(
        record_dir / f"{MIXED['unlisted']}.json.zst", lambda doc: doc["sidecars"].clear()
    )


def write_missing_copy(source: Path, target: Path) -> None:
    """A mirror copy that left the tokens sidecars out (docs/format.md "Mirror copies")."""
    shutil.copytree(source, target)
    for path in target.glob("*.tokens.zst"):
        path.unlink()


def make_runs(root: Path) -> dict[str, Path]:
    runs = {"grpo": root / "grpo", "mixed": root / "mixed" / "skycap", "mirror": root / "mirror"}
    write_grpo(runs["grpo"])
    write_mixed(runs["mixed"])
    write_missing_copy(runs["grpo"], runs["mirror"])
    return runs


def test_records_made_by_skycap_validate_as_expected(tmp_path: Path) -> None:
    runs = make_runs(tmp_path)
    grpo = check_directory(runs["grpo"], sidecars=True)
    assert (grpo.documents, grpo.bad, grpo.missing) == (sum(map(len, GRPO.values())), 0, {})
    mirror = check_directory(runs["mirror"], sidecars=True)
    assert mirror.missing == {"tokens": grpo.documents} and mirror.bad == 0
    mixed = check_directory(runs["mixed"], sidecars=True)
    assert mixed.lines == [
        f"{MIXED['malformed']}: node 1 slices into sampling_mask, which is not in the sidecars "
        "manifest",
        f"{MIXED['unlisted']}: node 0 slices into tokens, which is not in the sidecars manifest; "
        "node 1 slices into tokens, which is not in the sidecars manifest",
    ]
