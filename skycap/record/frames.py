"""Walking the frames of a zstd file without decompressing them (RFC 8878), for one-frame checks.

A record file must be exactly one zstd frame (format.md §2): common decoders stop
silently after the first. The reader and `skycap validate` both count frames here, and
their problem texts agree (docs/viewer.md "skycap validate", zstd framing).
"""

from __future__ import annotations

from collections.abc import Buffer

import zstandard

ZSTD_MAGIC = 0xFD2FB528
SKIPPABLE_MAGIC = 0x184D2A50  # the low 4 bits are free (0x184D2A50-0x184D2A5F)
_FRAME_CONTENT_SIZE_BYTES = (0, 2, 4, 8)
_DICT_ID_BYTES = (0, 1, 2, 4)
# The most content one byte of a frame can stand for: an RLE block, 4 bytes with its header,
# holds at most one 128 KiB block. A frame claiming more is corrupt, not merely large.
MAX_RATIO = (128 * 1024) // 4


class FrameError(ValueError):
    """A zstd framing fault; the message is the problem text (`truncated zstd frame at byte N`)."""


def zstd_frames(data: Buffer) -> list[tuple[int, int]]:
    """(start, end) of each zstd data frame; skippable frames are passed over (format.md §3)."""
    # Released on every exit, so a caller's mmap can close even after a FrameError.
    with memoryview(data) as view:
        return _walk(view)


def _walk(view: memoryview) -> list[tuple[int, int]]:
    frames = []
    pos = 0
    while pos < len(view):
        if len(view) - pos < 4:
            if _is_magic_prefix(bytes(view[pos:])):
                raise _truncated(pos)
            raise FrameError(f"not a zstd frame at byte {pos}")
        magic = int.from_bytes(view[pos : pos + 4], "little")
        if magic & 0xFFFFFFF0 == SKIPPABLE_MAGIC:
            if len(view) - pos < 8:
                raise _truncated(pos)
            end = pos + 8 + int.from_bytes(view[pos + 4 : pos + 8], "little")
        elif magic == ZSTD_MAGIC:
            end = _frame_end(view, pos)
            frames.append((pos, end))
        else:
            raise FrameError(f"not a zstd frame at byte {pos}")
        if end > len(view):
            raise _truncated(pos)
        pos = end
    return frames


def _is_magic_prefix(tail: bytes) -> bool:
    """Whether a non-empty tail shorter than a magic number starts one (a cut-off frame)."""
    skippable_rest = SKIPPABLE_MAGIC.to_bytes(4, "little")[1:]
    return ZSTD_MAGIC.to_bytes(4, "little").startswith(tail) or (
        tail[0] >> 4 == 5 and skippable_rest.startswith(tail[1:])
    )


def _frame_end(view: memoryview, start: int) -> int:
    """Where the frame at `start` ends, found from its header and block headers."""
    if len(view) - start < 5:
        raise _truncated(start)
    descriptor = view[start + 4]
    single_segment = (descriptor >> 5) & 1
    fcs_bytes = _FRAME_CONTENT_SIZE_BYTES[descriptor >> 6] or single_segment
    cursor = start + 5 + (1 - single_segment) + _DICT_ID_BYTES[descriptor & 3] + fcs_bytes
    while True:
        if cursor + 3 > len(view):
            raise _truncated(start)
        header = int.from_bytes(view[cursor : cursor + 3], "little")
        block_type = (header >> 1) & 3
        if block_type == 3:
            raise FrameError(f"reserved zstd block type at byte {cursor}")
        cursor += 3 + (1 if block_type == 1 else header >> 3)
        if header & 1:
            break
    if (descriptor >> 2) & 1:
        cursor += 4  # content checksum
    if cursor > len(view):
        raise _truncated(start)
    return cursor


def _truncated(start: int) -> FrameError:
    return FrameError(f"truncated zstd frame at byte {start}")


def content_size_problem(frame: Buffer) -> str | None:
    """Why the content size a frame header claims cannot be true, or None.

    A hostile header can claim a terabyte in a few bytes; a decoder that trusts it
    allocates that much before reading a block.
    """
    claimed = zstandard.frame_content_size(frame)
    with memoryview(frame) as view:
        limit = len(view) * MAX_RATIO
    if claimed > limit:
        return f"zstd frame claims {claimed} bytes of content, more than its size allows ({limit})"
    return None
