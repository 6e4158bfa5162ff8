"""Record writer and reader against format.md: golden bytes, documents, bad input, atomic writes."""

from __future__ import annotations

import json
import logging
import os
import struct
from pathlib import Path

import numpy as np
import orjson
import pytest
import zstandard

from skycap.graph import CLIENT, MODEL, Graph, Tokens
from skycap.record import writer as writer_module
from skycap.record.reader import (
    RecordError,
    document_path,
    load_trajectory,
    read_document,
    read_sidecar,
    record_ids,
)
from skycap.record.writer import write_record
from skycap.trajectory import Trajectory

TR_ID = "tr_00000000000000aa"
TOKEN_CAPTURE = {
    "mode": "tokens",
    "engine": "vllm",
    "tokenizer": "Qwen/Qwen3-8B",
    "logprobs_mode": "processed_logprobs",
    "sampling_overrides": {},
    "use_raw_content": False,
}
NAN = bytes.fromhex("000000000000f87f")  # the quiet NaN numpy writes, little-endian


def decompress(path: Path) -> bytes:
    data = path.read_bytes()
    assert zstandard.get_frame_parameters(data).content_size >= 0, "content size must be set"
    reader = zstandard.ZstdDecompressor().decompressobj()
    content = reader.decompress(data)
    assert reader.eof and reader.unused_data == b"", f"{path.name} must be exactly one frame"
    return content


def write_document(path: Path, document: object) -> None:
    path.write_bytes(zstandard.ZstdCompressor().compress(orjson.dumps(document)))


def edit_document(record_dir: Path, edit) -> None:
    path = document_path(record_dir, TR_ID)
    document = orjson.loads(decompress(path))
    edit(document)
    write_document(path, document)


def worked_example() -> Trajectory:
    """The two token nodes of format.md §6.2, text included so nothing needs decoding."""
    graph = Graph()
    experts = np.arange(28, dtype=np.uint8).reshape(7, 2, 2)
    graph.add(
        None,
        author=CLIENT,
        message={"role": "user", "content": "qé"},
        match_hash="23d08d556190f3432ceb1d5d72b70ebf",
        delta_hash="2ea795a294789b103b41d03c6802e7d7",
        created_at=1718000001.0,
        tokens=Tokens(
            ids=[1, 2, 3],
            experts=experts[:3],
            text="<s>user\nqé\n".encode(),
            text_offsets=np.array([0, 3, 8], dtype=np.int32),
        ),
    )
    model = graph.add(
        0,
        author=MODEL,
        message={"role": "assistant", "content": "🙂ok"},
        match_hash="e7d32efae04b06ebc9d368bac05ba2b9",
        delta_hash="d0374863d2e27a5bc56ed73cc6e8f464",
        created_at=1718000002.0,
        tokens=Tokens(
            ids=[4, 5, 6, 7],
            sampled_start=1,
            logprobs=[0.0, -0.5, -0.25, -1.0],
            experts=experts[3:],
            mask_ids=[5, 8, 6, 7, 1, 2],
            mask_offsets=[0, 2, 3, 6],
            text="<s>assistant\n🙂ok".encode(),
            text_offsets=np.array([0, 13, 13, 17], dtype=np.int32),
        ),
    )
    model.calls.append(
        {
            "t_start": 1718000001.0,
            "t_end": 1718000002.0,
            "model": "policy",
            "sampling": {"temperature": 1.0, "max_tokens": 64},
            "usage": {"prompt_tokens": 4, "completion_tokens": 3},
            "finish_reason": "stop",
            "tools": None,
            "bridged": None,
        }
    )
    trajectory = Trajectory(TR_ID, capture=TOKEN_CAPTURE, created_at=1718000000.0, graph=graph)
    trajectory.status, trajectory.ended, trajectory.finished_at = "finished", True, 1718000003.0
    return trajectory


def node_fields(index: int) -> dict:
    return {
        "author": CLIENT,
        "message": {"role": "user", "content": str(index)},
        "match_hash": f"{index:032x}",
        "delta_hash": f"{index:032x}",
        "created_at": 1.0,
    }


@pytest.fixture
def record(tmp_path: Path) -> Path:
    write_record(worked_example(), tmp_path)
    return tmp_path


def test_worked_byte_layout_matches_format_md_section_11(tmp_path: Path) -> None:
    files = write_record(worked_example(), tmp_path)

    assert files == [
        f"{TR_ID}.tokens.zst",
        f"{TR_ID}.experts.zst",
        f"{TR_ID}.sampling_mask.zst",
        f"{TR_ID}.json.zst",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(files)
    text = "<s>user\nqé\n<s>assistant\n🙂ok".encode()
    tokens = (
        struct.pack("<7i", 1, 2, 3, 4, 5, 6, 7)
        + bytes(4)
        + NAN * 3
        + struct.pack("<4d", 0.0, -0.5, -0.25, -1.0)
        + struct.pack("<7i", 0, 3, 8, 0, 13, 13, 17)
        + bytes(4)
        + text
    )
    assert len(text) == 31 and len(tokens) == 151
    assert tokens[32:40] == NAN and tokens[88:92] == struct.pack("<i", 0) and tokens[120:] == text
    assert decompress(tmp_path / files[0]) == tokens
    assert decompress(tmp_path / files[1]) == bytes(range(28))
    mask = struct.pack("<6i", 5, 8, 6, 7, 1, 2) + struct.pack("<4q", 0, 2, 3, 6)
    assert len(mask) == 56 and decompress(tmp_path / files[2]) == mask

    document = orjson.loads(decompress(tmp_path / files[3]))
    assert document["sidecars"] == json.loads(
        """{"tokens": {"file": "tr_00000000000000aa.tokens.zst", "arrays": {
           "token_ids": {"dtype": "int32", "shape": [7], "offset": 0},
           "logprobs": {"dtype": "float64", "shape": [7], "offset": 32},
           "text_offsets": {"dtype": "int32", "shape": [7], "offset": 88},
           "text": {"dtype": "uint8", "shape": [31], "offset": 120}}},
         "experts": {"file": "tr_00000000000000aa.experts.zst", "arrays": {
           "routed_experts": {"dtype": "uint8", "shape": [7, 2, 2], "offset": 0}}},
         "sampling_mask": {"file": "tr_00000000000000aa.sampling_mask.zst", "arrays": {
           "ids": {"dtype": "int32", "shape": [6], "offset": 0},
           "offsets": {"dtype": "int64", "shape": [4], "offset": 24}}}}"""
    )
    node_tokens = [node["tokens"] for node in document["nodes"]]
    assert node_tokens[0] == {
        "offset": 0,
        "length": 3,
        "sampled_start": None,
        "has_logprobs": False,
        "text_offset": 0,
        "text_bytes": 12,
        "experts_offset": 0,
        "experts_rows": 3,
        "mask_offset": None,
        "mask_rows": 0,
        "media": [],
    }
    assert node_tokens[1] == {
        "offset": 3,
        "length": 4,
        "sampled_start": 1,
        "has_logprobs": True,
        "text_offset": 12,
        "text_bytes": 19,
        "experts_offset": 3,
        "experts_rows": 4,
        "mask_offset": 0,
        "mask_rows": 3,
        "media": [],
    }
    assert [list(t) for t in node_tokens] == [list(node_tokens[0])] * 2  # format.md §5 key order
    assert list(document["nodes"][0]) == [
        "id",
        "parent",
        "depth",
        "role",
        "author",
        "message",
        "match_hash",
        "delta_hash",
        "created_at",
        "calls",
        "shadowed_by",
        "tokens",
    ]
    assert document["format_version"] == 1 and document["capture"] == TOKEN_CAPTURE


def test_worked_example_loads_back(record: Path) -> None:
    trajectory = load_trajectory(record, TR_ID)

    client, model = trajectory.graph
    assert client.tokens.ids.tolist() == [1, 2, 3] and client.tokens.logprobs is None
    assert client.tokens.text == "<s>user\nqé\n".encode()
    assert client.tokens.mask_offsets is None and client.tokens.sampled_start is None
    assert model.tokens.logprobs.tolist() == [0.0, -0.5, -0.25, -1.0]
    assert model.tokens.mask_row_lists() == [[5, 8], [6], [7, 1, 2]]
    assert model.tokens.text_offsets.tolist() == [0, 13, 13, 17]
    assert model.tokens.experts.tolist() == np.arange(12, 28).reshape(4, 2, 2).tolist()
    assert model.calls[0]["bridged"] is None and model.depth == 1
    assert (trajectory.status, trajectory.ended, trajectory.finished_at) == (
        "finished",
        True,
        1718000003.0,
    )


def test_text_mode_document_matches_format_md_example(tmp_path: Path) -> None:
    graph = Graph()
    graph.add(
        None,
        author=CLIENT,
        message={"role": "user", "content": "What is 2+2?"},
        match_hash="cdc3435ce856e3ef88872e3490a8f747",
        delta_hash="cdc3435ce856e3ef88872e3490a8f747",
        created_at=1718000001.0,
    )
    reply = graph.add(
        0,
        author=MODEL,
        message={"role": "assistant", "content": "4"},
        match_hash="126a835bc73fadf0775e1e10dc37387e",
        delta_hash="36627b58f2ac4691776c76d1e8cd8865",
        created_at=1718000001.5,
    )
    reply.calls.append(
        {
            "t_start": 1718000001.0,
            "t_end": 1718000001.5,
            "model": "policy",
            "sampling": {"temperature": 0.7, "max_tokens": 64},
            "usage": {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13},
            "finish_reason": "stop",
            "tools": None,
            "bridged": None,
        }
    )
    trajectory = Trajectory(
        "tr_3f9a0c2b7d1e4a55",
        capture={"mode": "text"},
        meta={"task": "t1"},
        created_at=1718000000.0,
        graph=graph,
    )
    trajectory.status, trajectory.ended, trajectory.finished_at = "finished", True, 1718000003.2
    trajectory.annotations = {"reward": 1.0}
    trajectory.samples = {"paths": "all", "rows": [{"leaf": 1, "targets": [1]}]}
    trajectory.api_key = "sk-never-on-disk"  # whatever the server keeps, it is not written

    files = write_record(trajectory, tmp_path)

    assert files == ["tr_3f9a0c2b7d1e4a55.json.zst"]
    raw = decompress(tmp_path / files[0])
    assert b"sk-never-on-disk" not in raw
    expected = json.loads(
        """{"format_version": 1, "id": "tr_3f9a0c2b7d1e4a55", "status": "finished",
         "ended": true, "meta": {"task": "t1"}, "capture": {"mode": "text"},
         "annotations": {"reward": 1.0}, "created_at": 1718000000.0,
         "finished_at": 1718000003.2, "tools": {}, "failures": [],
         "retries": {"replayed": 0, "coalesced": 0},
         "samples": {"paths": "all", "rows": [{"leaf": 1, "targets": [1]}]},
         "nodes": [
          {"id": 0, "parent": null, "depth": 0, "role": "user", "author": "client",
           "message": {"role": "user", "content": "What is 2+2?"},
           "match_hash": "cdc3435ce856e3ef88872e3490a8f747",
           "delta_hash": "cdc3435ce856e3ef88872e3490a8f747",
           "created_at": 1718000001.0, "calls": [], "shadowed_by": null, "tokens": null},
          {"id": 1, "parent": 0, "depth": 1, "role": "assistant", "author": "model",
           "message": {"role": "assistant", "content": "4"},
           "match_hash": "126a835bc73fadf0775e1e10dc37387e",
           "delta_hash": "36627b58f2ac4691776c76d1e8cd8865",
           "created_at": 1718000001.5,
           "calls": [{"t_start": 1718000001.0, "t_end": 1718000001.5, "model": "policy",
                      "sampling": {"temperature": 0.7, "max_tokens": 64},
                      "usage": {"prompt_tokens": 12, "completion_tokens": 1,
                                "total_tokens": 13},
                      "finish_reason": "stop", "tools": null, "bridged": null}],
           "shadowed_by": null, "tokens": null}],
         "sidecars": {}}"""
    )
    assert read_document(tmp_path / files[0]) == expected
    loaded = load_trajectory(tmp_path, "tr_3f9a0c2b7d1e4a55")
    assert loaded.document() == trajectory.document()


def test_empty_trajectory_writes_only_a_document(tmp_path: Path) -> None:
    trajectory = Trajectory(TR_ID, capture=TOKEN_CAPTURE, created_at=1.0)

    assert write_record(trajectory, tmp_path) == [f"{TR_ID}.json.zst"]
    document = read_document(tmp_path / f"{TR_ID}.json.zst")
    assert document["nodes"] == [] and document["sidecars"] == {}
    assert document["ended"] is False and document["status"] == "open"


def test_all_empty_masks_write_no_mask_sidecar_but_keep_offsets(tmp_path: Path) -> None:
    trajectory = worked_example()
    for node in trajectory.graph:
        node.tokens.mask_ids, node.tokens.mask_offsets = np.zeros(0, np.int32), np.zeros(1)
    files = write_record(trajectory, tmp_path)

    assert f"{TR_ID}.sampling_mask.zst" not in files
    document = read_document(tmp_path / files[-1])
    assert "sampling_mask" not in document["sidecars"]
    assert [(n["tokens"]["mask_offset"], n["tokens"]["mask_rows"]) for n in document["nodes"]] == [
        (0, 0),
        (0, 0),
    ]
    loaded = load_trajectory(tmp_path, TR_ID)
    assert [n.tokens.mask_row_lists() for n in loaded.graph] == [[], []]


def test_decode_spans_fills_missing_text_with_parent_context(tmp_path: Path) -> None:
    trajectory = worked_example()
    for node in trajectory.graph:
        node.tokens.text = node.tokens.text_offsets = None
    seen = []

    def decode(ids: list[int], context: list[int]) -> tuple[bytes, list[int]]:
        seen.append((ids, context))
        return b"".join(b"<%d>" % i for i in ids), [3 * k for k in range(len(ids))]

    write_record(trajectory, tmp_path, decode_spans=decode)

    assert seen == [([1, 2, 3], []), ([4, 5, 6, 7], [1, 2, 3])]
    loaded = load_trajectory(tmp_path, TR_ID)
    assert [n.tokens.text for n in loaded.graph] == [b"<1><2><3>", b"<4><5><6><7>"]
    assert loaded.graph[1].tokens.text_offsets.tolist() == [0, 3, 6, 9]
    assert trajectory.graph[1].tokens.text == b"<4><5><6><7>"  # kept on the node too


def test_failed_decoding_or_bad_offsets_write_the_node_without_text(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    trajectory = worked_example()
    for node in trajectory.graph:
        node.tokens.text = node.tokens.text_offsets = None

    def decode(ids: list[int], context: list[int]) -> tuple[bytes, list[int]]:
        if ids[0] == 1:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return b"ab", [0, 2, 1, 3]  # decreasing, and the last offset is past the text

    with caplog.at_level(logging.WARNING, logger="skycap.record.writer"):
        write_record(trajectory, tmp_path, decode_spans=decode)

    document = read_document(tmp_path / f"{TR_ID}.json.zst")
    assert [(n["tokens"]["text_offset"], n["tokens"]["text_bytes"]) for n in document["nodes"]] == [
        (None, 0),
        (None, 0),
    ]
    assert document["sidecars"]["tokens"]["arrays"]["text"]["shape"] == [0]
    assert "node 0: text not recorded: decoding failed: UnicodeDecodeError" in caplog.text
    assert "node 1: text not recorded: last text offset 3 is past the text's 2 bytes" in (
        caplog.text
    )
    tokens = read_sidecar(tmp_path, document, "tokens")
    assert tokens["text_offsets"].tolist() == [0] * 7
    assert all(n.tokens.text is None for n in load_trajectory(tmp_path, TR_ID).graph)


def test_experts_cast_to_the_first_arrays_dtype_and_refuse_other_shapes(tmp_path: Path) -> None:
    trajectory = worked_example()
    trajectory.graph[1].tokens.experts = np.full((4, 2, 2), 300, dtype=np.uint16)
    write_record(trajectory, tmp_path)
    loaded = load_trajectory(tmp_path, TR_ID)
    assert loaded.graph[1].tokens.experts.dtype == np.uint8
    assert loaded.graph[1].tokens.experts.tolist() == [[[44] * 2] * 2] * 4  # 300 as uint8

    trajectory.graph[1].tokens.experts = np.zeros((4, 3, 2), dtype=np.uint8)
    with pytest.raises(ValueError, match=r"node 1: routed experts \(layers, k\) = \(3, 2\)"):
        write_record(trajectory, tmp_path / "other")


def test_unsupported_experts_dtype_is_refused(tmp_path: Path) -> None:
    trajectory = worked_example()
    for node in trajectory.graph:
        node.tokens.experts = node.tokens.experts.astype(np.float32)
    with pytest.raises(ValueError, match="dtype float32 cannot be recorded"):
        write_record(trajectory, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_document_rename_failure_leaves_no_document_and_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_replace = os.replace

    def replace(src: os.PathLike, dst: os.PathLike) -> None:
        if str(dst).endswith(".json.zst"):
            raise OSError(28, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(writer_module.os, "replace", replace)
    with pytest.raises(OSError, match="No space left"):
        write_record(worked_example(), tmp_path)

    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [f"{TR_ID}.experts.zst", f"{TR_ID}.sampling_mask.zst", f"{TR_ID}.tokens.zst"]
    assert record_ids(tmp_path) == []


def test_failure_while_streaming_a_sidecar_leaves_no_partial_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from skycap.record import layout

    real_chunks = layout.Payload.chunks

    def chunks(self: layout.Payload):
        yield from list(real_chunks(self))[:1]
        raise MemoryError("simulated")

    monkeypatch.setattr(layout.Payload, "chunks", chunks)
    with pytest.raises(MemoryError):
        write_record(worked_example(), tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_rewrite_replaces_every_file_whole(record: Path) -> None:
    trajectory = load_trajectory(record, TR_ID)
    trajectory.annotations = {"reward": 0.5}
    before = {p.name: decompress(p) for p in record.iterdir()}

    write_record(trajectory, record)

    after = {p.name: decompress(p) for p in record.iterdir()}
    assert before.keys() == after.keys()
    assert all(before[n] == after[n] for n in after if not n.endswith(".json.zst"))
    assert read_document(record / f"{TR_ID}.json.zst")["annotations"] == {"reward": 0.5}


def test_record_ids_lists_top_level_documents_only(record: Path) -> None:
    (record / "index").mkdir()
    (record / "index" / "tr_00000000000000bb.json.zst").write_bytes(b"")
    (record / f".{TR_ID}.json.zst.tmp").write_bytes(b"")
    (record / ".tr_00000000000000cc.json.zst").write_bytes(b"")
    write_record(Trajectory("tr_0000000000000001", capture={"mode": "text"}), record)

    assert record_ids(record) == ["tr_0000000000000001", TR_ID]
    with pytest.raises(RecordError, match="is not a directory"):
        record_ids(record / "missing")


@pytest.mark.parametrize("bad_id", ["../x", "a/b", "..", ".", "", ".hidden", "a\\b"])
def test_document_path_refuses_ids_that_are_not_plain_file_names(record: Path, bad_id: str) -> None:
    with pytest.raises(RecordError, match="is not a plain file name"):
        document_path(record, bad_id)
    with pytest.raises(RecordError):
        load_trajectory(record, bad_id)


def one_line_error(call) -> str:
    with pytest.raises(RecordError) as info:
        call()
    message = str(info.value)
    assert message and "\n" not in message
    return message


def test_truncated_and_foreign_zstd_are_reported(record: Path) -> None:
    path = record / f"{TR_ID}.json.zst"
    data = path.read_bytes()
    path.write_bytes(data[:-5])
    assert "truncated zstd frame at byte 0" in one_line_error(lambda: read_document(path))
    path.write_bytes(data[:2])
    assert "truncated zstd frame at byte 0" in one_line_error(lambda: read_document(path))
    path.write_bytes(b"")
    assert "has 0 zstd frames" in one_line_error(lambda: read_document(path))
    for garbage in (b"{}", b'{"format_version": 1}'):
        path.write_bytes(garbage)
        assert one_line_error(lambda: read_document(path)).endswith("not a zstd frame at byte 0")
    assert "cannot read" in one_line_error(lambda: read_document(record / "nope.json.zst"))


def test_a_payload_of_many_compression_jobs_is_still_one_frame(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    experts = rng.integers(0, 128, size=(50_000, 48, 8), dtype=np.uint8)  # 19.2 MB
    graph = Graph()
    for i, part in enumerate(np.split(experts, 2)):
        tokens = Tokens(ids=np.arange(part.shape[0]), experts=part)
        graph.add(i - 1 if i else None, **node_fields(i), tokens=tokens)
    files = write_record(Trajectory(TR_ID, capture=TOKEN_CAPTURE, graph=graph), tmp_path)

    assert decompress(tmp_path / files[1]) == experts.tobytes()  # one frame, size set
    assert np.array_equal(
        load_trajectory(tmp_path, TR_ID).graph[1].tokens.experts, experts[25_000:]
    )


def test_a_second_frame_is_reported(record: Path) -> None:
    path = record / f"{TR_ID}.json.zst"
    path.write_bytes(path.read_bytes() + zstandard.ZstdCompressor().compress(b" "))
    assert one_line_error(lambda: read_document(path)) == (
        f"{path} has 2 zstd frames (format.md: one)"
    )


def test_skippable_frames_are_ignored(record: Path) -> None:
    path = record / f"{TR_ID}.json.zst"
    skippable = struct.pack("<II", 0x184D2A5A, 3) + b"abc"
    path.write_bytes(skippable + path.read_bytes() + skippable)
    assert read_document(path)["id"] == TR_ID


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"[1, 2]", "the document is a JSON list, not an object"),
        (b'"x"', "the document is a JSON string, not an object"),
        (b'{"a": "\xff"}', "JSONDecodeError: str is not valid UTF-8"),
        (b"{nope", "JSONDecodeError: "),
        (b'{"format_version": 2}', "format_version 2, this skycap reads 1"),
        (b'{"format_version": "1"}', 'format_version "1", this skycap reads 1'),
        (b'{"format_version": 1.0}', "format_version 1.0, this skycap reads 1"),
        (b'{"id": "x"}', "missing format_version"),
        (b'{"format_version": 1, "id": "x", "status": "open", "sidecars": {}}', "missing nodes"),
        (
            b'{"format_version": 1, "id": "x", "status": "open", "nodes": {}, "sidecars": {}}',
            "nodes must be a JSON array, got object",
        ),
        (
            b'{"format_version": 1, "id": "x", "status": "done", "nodes": [], "sidecars": {}}',
            'unknown status "done"',
        ),
    ],
)
def test_bad_documents_are_one_line_errors(tmp_path: Path, content: bytes, expected: str) -> None:
    path = tmp_path / f"{TR_ID}.json.zst"
    path.write_bytes(zstandard.ZstdCompressor().compress(content))
    assert one_line_error(lambda: read_document(path)).startswith(expected)


def test_sidecar_shorter_than_its_manifest_names_the_array(record: Path) -> None:
    path = record / f"{TR_ID}.tokens.zst"
    path.write_bytes(zstandard.ZstdCompressor().compress(decompress(path)[:140]))
    document = read_document(record / f"{TR_ID}.json.zst")

    message = one_line_error(lambda: read_sidecar(record, document, "tokens"))
    assert message == (
        "tokens array text of shape [31] needs payload bytes [120, 151) but the tokens "
        "payload has 140 bytes"
    )
    assert one_line_error(lambda: load_trajectory(record, TR_ID)) == message


def test_unknown_dtype_and_escaping_sidecar_file_are_refused(record: Path) -> None:
    edit_document(
        record,
        lambda d: d["sidecars"]["experts"]["arrays"]["routed_experts"].update(dtype="float16"),
    )
    document = read_document(record / f"{TR_ID}.json.zst")
    assert one_line_error(lambda: read_sidecar(record, document, "experts")).startswith(
        "experts array routed_experts: unknown dtype 'float16'"
    )
    document["sidecars"]["tokens"]["file"] = "../tr_00000000000000aa.tokens.zst"
    assert "is not a plain file name" in one_line_error(
        lambda: read_sidecar(record, document, "tokens")
    )


def test_listed_but_missing_sidecars_read_as_absent(record: Path) -> None:
    (record / f"{TR_ID}.experts.zst").unlink()
    (record / f"{TR_ID}.sampling_mask.zst").unlink()
    document = read_document(record / f"{TR_ID}.json.zst")
    assert read_sidecar(record, document, "experts") is None

    trajectory = load_trajectory(record, TR_ID)
    model = trajectory.graph[1]
    assert model.tokens.experts is None and model.tokens.mask_offsets is None
    assert model.tokens.ids.tolist() == [4, 5, 6, 7]

    (record / f"{TR_ID}.tokens.zst").unlink()
    assert all(n.tokens is None for n in load_trajectory(record, TR_ID).graph)


def test_omitted_sidecars_are_absent_even_when_the_file_is_there(record: Path) -> None:
    edit_document(record, lambda d: d.update(omitted_sidecars=["experts"]))
    document = read_document(record / f"{TR_ID}.json.zst")
    assert read_sidecar(record, document, "experts") is None
    assert read_sidecar(record, document, "tokens") is not None
    assert load_trajectory(record, TR_ID).graph[0].tokens.experts is None


def test_zero_mask_rows_never_open_the_mask_sidecar(record: Path) -> None:
    (record / f"{TR_ID}.sampling_mask.zst").write_bytes(b"not zstd")
    edit_document(record, lambda d: d["nodes"][1]["tokens"].update(mask_rows=0))
    assert load_trajectory(record, TR_ID).graph[1].tokens.mask_row_lists() == []


def test_older_records_without_bridged_or_ended_load(record: Path) -> None:
    def edit(document: dict) -> None:
        del document["nodes"][1]["calls"][0]["bridged"]
        del document["ended"]
        del document["nodes"][0]["tokens"]["media"]

    edit_document(record, edit)
    trajectory = load_trajectory(record, TR_ID)
    assert "bridged" not in trajectory.graph[1].calls[0]
    assert trajectory.ended is True and trajectory.graph[0].tokens.media == []

    write_record(trajectory, record)
    document = read_document(record / f"{TR_ID}.json.zst")
    assert "bridged" not in document["nodes"][1]["calls"][0]


def test_malformed_nodes_are_one_line_errors(record: Path) -> None:
    edit_document(record, lambda d: d["nodes"][1].update(parent=5))
    assert one_line_error(lambda: load_trajectory(record, TR_ID)) == (
        "node 1 has parent 5, not an earlier node"
    )
    edit_document(record, lambda d: d["nodes"][1].update(parent=None, delta_hash="2ea7" * 8))
    edit_document(record, lambda d: d["nodes"][0].update(delta_hash="2ea7" * 8))
    assert one_line_error(lambda: load_trajectory(record, TR_ID)) == (
        "node 1 repeats node 0 (same parent and delta_hash)"
    )
    edit_document(record, lambda d: d["nodes"][1].update(parent=0, tokens={"offset": 5}))
    assert "tokens.length must be a non-negative integer" in one_line_error(
        lambda: load_trajectory(record, TR_ID)
    )
    edit_document(record, lambda d: d["nodes"][1].update(tokens={"offset": 5, "length": 4}))
    assert one_line_error(lambda: load_trajectory(record, TR_ID)) == (
        "node 1: tokens [5, 9) outside the 7-entry sidecar array"
    )
    edit_document(record, lambda d: d.update(id="tr_00000000000000bb"))
    assert "holds trajectory 'tr_00000000000000bb'" in one_line_error(
        lambda: load_trajectory(record, TR_ID)
    )


def test_documents_only_load_without_sidecars(record: Path) -> None:
    for kind in ("tokens", "experts", "sampling_mask"):
        (record / f"{TR_ID}.{kind}.zst").write_bytes(b"garbage")
    trajectory = load_trajectory(record, TR_ID, sidecars=False)
    assert [n.tokens for n in trajectory.graph] == [None, None]
    assert trajectory.graph[1].message == {"role": "assistant", "content": "🙂ok"}
