"""`skycap validate`: every record rule with its problem text, the output and exit codes."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
import zstandard
from test_viewer_fixtures import ABSENT, Build, tid

from skycap.cli.main import main
from skycap.viewer.validate import (
    check_directory,
    document_problems,
    parse_document,
    sidecar_problems,
)

COMPRESS = zstandard.ZstdCompressor().compress


def token_record(record_dir: Path, n: int = 1, content: str = "hello") -> dict[str, Any]:
    build = Build(tid(n))
    user = build.client(None, content)
    build.model(user, "a reply", mask=True)
    build.write(record_dir)
    data = (record_dir / f"{tid(n)}.json.zst").read_bytes()
    return orjson.loads(zstandard.ZstdDecompressor().decompress(data))


@pytest.fixture(scope="module")
def doc(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return token_record(tmp_path_factory.mktemp("validate"))


def problems_after(doc: dict[str, Any], change) -> list[str]:
    changed = copy.deepcopy(doc)
    change(changed)
    return document_problems(changed)


def test_a_record_written_by_skycap_has_no_problems(doc):
    assert document_problems(doc) == []
    spans = [{"version": "1", "start": 0, "end": 1}, {"version": "2", "start": 1, "end": 3}]
    assert problems_after(doc, _set("nodes.1.calls.0.weight_versions", spans)) == []


def _set(path: str, value: Any):
    """A change that sets a dotted path (`nodes.1.tokens.offset`); ABSENT deletes the key."""

    def change(doc: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        target: Any = doc
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        if value is ABSENT:
            del target[last]
        elif isinstance(target, list):
            target[int(last)] = value
        else:
            target[last] = value

    return change


@pytest.mark.parametrize(
    "path, value, problem",
    [
        ("id", ABSENT, "missing id"),
        ("sidecars", ABSENT, "missing sidecars"),
        ("status", "running", 'unknown status "running"'),
        ("nodes.1.id", 5, "nodes[1].id is 5"),
        ("nodes.1.parent", 7, "node 1 has parent 7, not an earlier node"),
        ("nodes.1.depth", 4, "node 1: depth 4, expected 1"),
        ("nodes.1.author", "robot", 'node 1: author "robot"'),
        ("nodes.1.calls", [], "node 1: model node without calls"),
        (
            "nodes.1.shadowed_by",
            0,
            "node 1: shadowed_by 0 is not a sibling with the same match hash",
        ),
        ("nodes.1.calls.0.tools", "abc", 'node 1: call tools "abc" not in document tools'),
        (
            "nodes.1.calls.0.weight_versions",
            [{"version": "1", "start": 0, "end": 2}],
            "node 1: call weight_versions cover 2 tokens of a 3-token completion",
        ),
        (
            "nodes.1.calls.0.weight_versions",
            [{"version": "1", "start": 0, "end": 1}, {"version": "2", "start": 2, "end": 3}],
            "node 1: call weight_versions[1] starts at 2, expected 1: spans must be "
            "contiguous and in order",
        ),
        ("nodes.1.tokens.offset", 3, "node 1: tokens offset 3, expected 5 (node order)"),
        ("nodes.1.tokens.text_offset", 1, "node 1: text_offset 1, expected 33 (node order)"),
        ("nodes.0.tokens.sampled_start", 0, "node 0: client node with sampled_start"),
        ("nodes.1.tokens.sampled_start", 99, "node 1: sampled_start 99 of 6"),
        ("nodes.1.tokens.mask_rows", 2, "node 1: 2 mask rows for 3 sampled tokens"),
        ("nodes.1.tokens.experts_offset", 0, "node 1: 0 expert rows for 6 tokens"),
        (
            "sidecars.tokens.arrays.token_ids.shape",
            [10],
            "tokens sidecar has 10 tokens, nodes cover 11",
        ),
        (
            "sidecars.tokens.arrays.text.shape",
            [3],
            "tokens sidecar has 3 text bytes, nodes cover 72",
        ),
        ("sidecars.tokens.arrays.text.offset", 170, "tokens.text offset 170 not a multiple of 8"),
        (
            "sidecars.sampling_mask",
            ABSENT,
            "node 1 slices into sampling_mask, which is not in the sidecars manifest",
        ),
        ("sidecars.audio", {"file": "x", "arrays": {}}, 'unknown sidecar kind "audio"'),
        (
            "sidecars.sampling_mask.arrays.offsets.shape",
            [9],
            "sampling_mask offsets has 9 entries for 3 rows",
        ),
    ],
)
def test_each_document_rule_names_its_problem(doc, path, value, problem):
    assert problem in problems_after(doc, _set(path, value))


def test_client_calls_text_mode_bridged_and_null_tokens(doc):
    call = doc["nodes"][1]["calls"][0]
    found = problems_after(doc, lambda d: d["nodes"][0]["calls"].append(call))
    assert "node 0: client node with calls" in found
    found = problems_after(doc, _set("nodes.0.tokens", None))
    assert "node 0: token mode but tokens is null" in found

    def text_mode(d: dict[str, Any]) -> None:
        d["capture"] = {"mode": "text"}
        d["nodes"][1]["calls"][0]["bridged"] = True

    assert "node 1: bridged true in text mode" in problems_after(doc, text_mode)


def test_sizes_in_the_test_record_are_what_the_rules_above_assume(doc):
    nodes = [n["tokens"] for n in doc["nodes"]]
    assert [(t["offset"], t["length"], t["sampled_start"]) for t in nodes] == [
        (0, 5, None),
        (5, 6, 3),
    ]
    assert nodes[1]["text_offset"] == 33 and sum(t["text_bytes"] for t in nodes) == 72


def json_bytes(doc: dict[str, Any]) -> bytes:
    return orjson.dumps(doc)


def test_reading_rules_r1_to_r4_and_frames(doc):
    good = COMPRESS(json_bytes(doc))
    assert parse_document(good, "x.json.zst") == (doc, [])
    assert parse_document(good[:-5], "x")[1] == ["truncated zstd frame at byte 0"]
    assert parse_document(b"hello world", "x")[1] == ["not a zstd frame at byte 0"]
    assert parse_document(b"", "x")[1] == ["not a zstd frame at byte 0"]
    assert parse_document(good + b"junk", "x")[1] == [f"not a zstd frame at byte {len(good)}"]
    reserved = bytes.fromhex("28b52ffd") + b"\x20\x05" + b"\x07\x00\x00"
    assert parse_document(reserved, "x")[1] == ["reserved zstd block type at byte 6"]
    skippable = bytes.fromhex("502a4d18") + (4).to_bytes(4, "little") + b"abcd"
    assert parse_document(skippable + good + skippable, "x") == (doc, [])
    data = json_bytes(doc)
    two = COMPRESS(data[:10]) + COMPRESS(data[10:])
    assert parse_document(two, "x.json.zst") == (
        doc,
        ["x.json.zst has 2 zstd frames (format.md: one)"],
    )
    assert parse_document(COMPRESS(b"[1]"), "x")[1] == ["document is not a JSON object"]
    assert parse_document(COMPRESS(b"\xff{}"), "x")[1] == ["document is not a JSON object"]
    for version, shown in (("1", '"1"'), (2, "2"), (ABSENT, "absent")):
        changed = copy.deepcopy(doc)
        _set("format_version", version)(changed)
        assert parse_document(COMPRESS(json_bytes(changed)), "x")[1] == [
            f"unsupported format_version {shown} (this reader knows 1)"
        ]
    changed = copy.deepcopy(doc)
    changed["nodes"] = {}
    assert parse_document(COMPRESS(json_bytes(changed)), "x")[1] == ["document has no nodes array"]


def tamper_tokens(record_dir: Path, doc: dict[str, Any], change) -> None:
    path = record_dir / doc["sidecars"]["tokens"]["file"]
    payload = bytearray(zstandard.ZstdDecompressor().decompress(path.read_bytes()))
    arrays = {
        name: np.frombuffer(
            payload, dtype=spec["dtype"], count=spec["shape"][0], offset=spec["offset"]
        )
        for name, spec in doc["sidecars"]["tokens"]["arrays"].items()
    }
    change(
        {name: array.copy() for name, array in arrays.items()},
        payload,
        doc["sidecars"]["tokens"]["arrays"],
    )
    path.write_bytes(COMPRESS(bytes(payload)))


def _write_array(payload: bytearray, spec: dict[str, Any], array: np.ndarray) -> None:
    data = array.astype(spec["dtype"]).tobytes()
    payload[spec["offset"] : spec["offset"] + len(data)] = data


def test_sidecar_rule_14_and_frames(tmp_path: Path):
    doc = token_record(tmp_path, content="hé")
    assert sidecar_problems(tmp_path, doc) == ([], [])

    reply = doc["nodes"][1]["tokens"]["offset"]

    def scaffold_logprob(arrays, payload, specs):
        arrays["logprobs"][reply] = -0.5
        _write_array(payload, specs["logprobs"], arrays["logprobs"])

    tamper_tokens(tmp_path, doc, scaffold_logprob)
    assert sidecar_problems(tmp_path, doc)[0] == [
        "node 1: scaffold token 0 logprob -0.5, expected 0 or NaN"
    ]

    doc = token_record(tmp_path, n=2, content="hé")
    node_text = "<|im_start|>user\nhé<|im_end|>\n".encode()
    split = node_text.index("é".encode())

    def cut_character(arrays, payload, specs):
        k = int(np.flatnonzero(arrays["text_offsets"][:reply] == split)[0])
        arrays["text_offsets"][k] = split + 1
        _write_array(payload, specs["text_offsets"], arrays["text_offsets"])
        cut_character.k = k - 1

    tamper_tokens(tmp_path, doc, cut_character)
    assert sidecar_problems(tmp_path, doc)[0] == [
        f"node 0 token {cut_character.k} span is not whole UTF-8 characters"
    ]

    doc = token_record(tmp_path, n=3)
    doc["sidecars"]["tokens"]["arrays"]["text"]["dtype"] = "float16"
    assert sidecar_problems(tmp_path, doc)[0] == ['array text: unknown dtype "float16"']
    doc["sidecars"]["tokens"]["arrays"]["text"]["dtype"] = "uint8"
    doc["sidecars"]["tokens"]["arrays"]["token_ids"]["shape"] = [8]
    assert sidecar_problems(tmp_path, doc)[0] == [
        "node 1 tokens [5, 11) outside the 8-token sidecar"
    ]

    doc = token_record(tmp_path, n=4)
    mask = tmp_path / doc["sidecars"]["sampling_mask"]["file"]
    mask.write_bytes(mask.read_bytes() * 2)
    (tmp_path / doc["sidecars"]["tokens"]["file"]).unlink()
    assert sidecar_problems(tmp_path, doc) == (
        [f"{mask.name} has 2 zstd frames (format.md: one)"],
        ["tokens"],
    )


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    try:
        code = main(["validate", *args])
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_output_and_exit_codes(tmp_path: Path, capsys):
    clean, dirty = tmp_path / "clean", tmp_path / "dirty"
    token_record(clean)
    assert run_cli(capsys, str(clean)) == (0, f"{clean}: 1 documents, 0 with problems\n", "")
    code, out, _ = run_cli(capsys, str(clean), "--documents-only")
    assert (code, out) == (0, f"{clean}: 1 documents, 0 with problems (documents only)\n")

    bad = token_record(dirty, n=1)
    bad.update(status="running", id=None)
    del bad["nodes"][1]["calls"]
    bad["nodes"][1]["depth"] = 9
    bad["nodes"][0]["author"] = "robot"
    bad["nodes"][1]["shadowed_by"] = 0
    bad["nodes"][1]["tokens"]["offset"] = 1
    (dirty / f"{tid(1)}.json.zst").write_bytes(COMPRESS(json_bytes(bad)))
    token_record(dirty, n=2)
    (dirty / f"{tid(2)}.tokens.zst").unlink()
    (dirty / f"{tid(3)}.json.zst").write_bytes(b"garbage!")
    code, out, _ = run_cli(capsys, str(dirty), str(clean))
    assert code == 1
    assert out.splitlines() == [
        f'{tid(1)}: unknown status "running"; node 0: author "robot"; node 1: depth 9, expected 1; '
        "node 1: model node without calls; node 1: shadowed_by 0 is not a sibling with the same "
        "match hash (+2)",  # the sidecar check adds: node 1 tokens outside the sidecar
        f"{tid(3)}: not a zstd frame at byte 0",
        f"{dirty}: 3 documents, 2 with problems",
        f"{dirty}: listed sidecar files not here, read as absent: tokens 1",
        f"{clean}: 1 documents, 0 with problems",
    ]
    code, out, _ = run_cli(capsys, str(dirty), "--limit", "1")
    assert code == 1 and len([line for line in out.splitlines() if line.startswith("tr_")]) == 1


@pytest.mark.parametrize(
    "args, message",
    [
        ((), "the following arguments are required"),
        (("/no/such/dir",), "/no/such/dir is not a directory"),
        ((".", "--limit", "-1"), "--limit -1 is negative"),
        ((".", "--bogus"), "unrecognized arguments"),
    ],
)
def test_cli_usage_errors_exit_2(capsys, args, message):
    code, _, err = run_cli(capsys, *args)
    assert code == 2 and message in err


def test_check_directory_counts_documents_and_limits_lines(tmp_path: Path):
    for n in range(3):
        (tmp_path / f"{tid(n)}.json.zst").write_bytes(b"x")
    report = check_directory(tmp_path, limit=2)
    assert (report.documents, report.bad, len(report.lines)) == (3, 3, 2)


def test_a_folder_of_runs_is_validated_run_by_run_and_an_empty_one_is_an_error(
    tmp_path: Path, capsys
):
    runs = tmp_path / "runs"
    token_record(runs / "step-1", n=1)
    token_record(runs / "step-2", n=2)
    token_record(runs / "step-2", n=3)
    code, out, _ = run_cli(capsys, str(runs))
    assert (code, out.splitlines()) == (
        0,
        [
            f"{runs / 'step-1'}: 1 documents, 0 with problems",
            f"{runs / 'step-2'}: 2 documents, 0 with problems",
        ],
    )
    (tmp_path / "empty").mkdir()
    code, out, err = run_cli(capsys, str(tmp_path / "empty"))
    assert (code, out) == (2, "") and "no records in" in err and "no *.json.zst" in err
