"""Record integrity: checksums any zstd decoder verifies, every bit flip caught, hostile frames."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zstandard
from test_record import TR_ID, worked_example

from skycap.record.reader import RecordError, load_trajectory, read_document
from skycap.record.writer import write_record

FILES = (
    f"{TR_ID}.tokens.zst",
    f"{TR_ID}.experts.zst",
    f"{TR_ID}.sampling_mask.zst",
    f"{TR_ID}.json.zst",
)


@pytest.fixture
def record(tmp_path: Path) -> Path:
    write_record(worked_example(), tmp_path)
    return tmp_path


def test_every_file_carries_a_checksum_that_v1_readers_decode(record: Path) -> None:
    for name in FILES:
        data = (record / name).read_bytes()
        params = zstandard.get_frame_parameters(data)
        assert params.has_checksum and params.content_size > 0, name
        one_shot = zstandard.ZstdDecompressor().decompress(data)
        with zstandard.ZstdDecompressor().stream_reader(data) as reader:
            streamed = reader.read()
        assert one_shot == streamed and len(one_shot) == params.content_size
        if shutil.which("zstd"):
            cli = subprocess.run(["zstd", "-dc", str(record / name)], capture_output=True)
            assert cli.returncode == 0 and cli.stdout == one_shot, cli.stderr


def _snapshot(trajectory) -> list:
    """Everything a node holds, as plain values, to compare two loads."""
    out = []
    for node in trajectory.graph:
        tokens = node.tokens
        arrays = None
        if tokens is not None:
            arrays = [
                None if a is None else np.asarray(a).tobytes()
                for a in (
                    tokens.ids,
                    tokens.logprobs,
                    tokens.experts,
                    tokens.mask_ids,
                    tokens.mask_offsets,
                    tokens.text_offsets,
                )
            ] + [tokens.text, tokens.sampled_start]
        out.append((node.parent, node.message, node.calls, node.delta_hash, arrays))
    return out


@pytest.mark.parametrize("name", FILES)
def test_every_single_bit_flip_is_caught_or_harmless(record: Path, name: str) -> None:
    """Each flip either makes the record an error or changes nothing that is read."""
    expected = _snapshot(load_trajectory(record, TR_ID))
    path = record / name
    original = path.read_bytes()
    caught = harmless = 0
    for bit in range(len(original) * 8):
        flipped = bytearray(original)
        flipped[bit // 8] ^= 1 << (bit % 8)
        path.write_bytes(flipped)
        try:
            loaded = _snapshot(load_trajectory(record, TR_ID))
        except RecordError:
            caught += 1
            continue
        assert loaded == expected, f"{name}: bit {bit} changed what was read, undetected"
        harmless += 1
    path.write_bytes(original)
    assert caught > 0.9 * len(original) * 8, (caught, harmless)


def _hostile_frame(content_size: int) -> bytes:
    """A 16-byte zstd frame claiming `content_size` bytes: one empty raw block, no checksum."""
    descriptor = 0b1110_0000  # 8-byte content size, single segment, no checksum, no dict
    last_empty_raw_block = (1).to_bytes(3, "little")
    return (
        (0xFD2FB528).to_bytes(4, "little")
        + bytes([descriptor])
        + content_size.to_bytes(8, "little")
        + last_empty_raw_block
    )


def test_a_frame_claiming_a_terabyte_is_a_record_error(record: Path) -> None:
    for name in (f"{TR_ID}.tokens.zst", f"{TR_ID}.json.zst"):
        original = (record / name).read_bytes()
        (record / name).write_bytes(_hostile_frame(2**40))
        with pytest.raises(RecordError, match=r"claims 1099511627776 bytes"):
            load_trajectory(record, TR_ID)
        (record / name).write_bytes(original)


def test_cli_readers_name_a_hostile_file_and_read_the_rest(record: Path) -> None:
    other = "tr_00000000000000bb"
    (record / f"{other}.json.zst").write_bytes(_hostile_frame(2**40))
    assert read_document(record / f"{TR_ID}.json.zst")["id"] == TR_ID
    for command in ("check", "summary", "validate"):
        result = subprocess.run(
            [sys.executable, "-m", "skycap.cli.main", command, str(record)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        output = result.stdout + result.stderr
        assert "Traceback" not in output and "MemoryError" not in output, (command, output)
        assert other in output, (command, output)
        # summary reports unreadable records in its table and still exits 0.
        assert result.returncode == {"check": 2, "summary": 0, "validate": 1}[command], output
