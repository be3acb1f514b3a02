"""Work budgets for image decoding: cheap checks, run on the encoded bytes before Pillow parses them,
that bound the CPU and memory an image may cost by what it actually carries.

A pixel limit is not a work limit. Each class below is cheap to send and, unchecked, costs far more
than decoding a photo of the pixel limit (~0.3 s for 50 MP); numbers measured with Pillow 11.3 on
the 2-core development machine (docs/vision.md, "Work budgets"):

- **JPEG scans.** libjpeg walks every block of a progressive image once per scan (SOS segment):
  100,000 empty 10-byte scans on a 1448² image took 16.9 s. Real encoders emit ≤ ~12 scans
  (libjpeg's default progression 10); at most ``max_jpeg_scans`` (64) are accepted.
- **JPEG segments.** Pillow parses each marker segment before the first scan in Python: 500,000
  empty COM segments (2 MB) took 1 s. At most ``max_jpeg_segments`` (1024) in all.
- **PNG chunks.** Pillow reads each chunk in Python (~5–10 µs): 200,000 one-byte IDAT chunks took 1 s,
  200,000 empty ancillary chunks 2 s. libpng writes 8 KiB IDATs (2,048 for 16 MiB): at most
  ``max_png_chunks`` (16384).
- **GIF blocks.** Pillow reads the extension sub-blocks before the first frame in Python (~10 µs
  each): 500,000 one-byte comment sub-blocks (1 MB) took 5.2 s. At most ``max_gif_blocks`` (16384)
  before the first image (its pixel data is read by the C decoder and not counted).
- **BMP RLE.** Pillow decodes RLE4/RLE8 in pure Python, per pixel: a 15 KB RLE8 of 7071² took
  7.75 s. RLE bitmaps are accepted up to ``max_rle_bmp_pixels`` (1 MP); uncompressed BMP is C.
- **EXIF / MPF directories.** Pillow's TIFF directory reader copies each tag's data separately: a
  directory of thousands of tags all pointing at the same bytes is a memory bomb (a 64 KiB JPEG
  APP1 segment can claim ~350 MB). A directory whose tags claim more bytes than it holds is refused.
  (We read the EXIF orientation ourselves, so a PNG's or WebP's EXIF is never handed to Pillow's
  reader; a JPEG's is, at open: its checks run here.)
"""

from __future__ import annotations

import re
import struct

import numpy as np

from triton_pipelines.errors import InputError

MAX_JPEG_SCANS = 64
MAX_JPEG_SEGMENTS = 1024
MAX_PNG_CHUNKS = 16384
MAX_GIF_BLOCKS = 16384
MAX_RLE_BMP_PIXELS = 1_000_000

# The next marker after a scan's entropy-coded data: 0xFF followed by neither a stuffed 0x00 nor a
# restart marker (0xD0-0xD7); fill bytes (0xFF 0xFF) are skipped. Searched in C, not byte by byte.
_JPEG_NEXT_MARKER = re.compile(rb"\xff+[^\x00\xd0-\xd7\xff]")
_JPEG_STANDALONE = {0x01, *range(0xD0, 0xD8)}  # TEM and RSTn carry no length

# TIFF field types → bytes per value (Pillow's ImageFileDirectory_v2 dispatch).
_TIFF_UNIT = np.zeros(65536, dtype=np.int64)
for _type, _unit in {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 1, 7: 1, 8: 2, 9: 4, 10: 8, 11: 4, 12: 8,
                     13: 4, 16: 8, 17: 8, 18: 8}.items():
    _TIFF_UNIT[_type] = _unit


def check_jpeg(data: bytes, name: str, max_scans: int = MAX_JPEG_SCANS,
               max_segments: int = MAX_JPEG_SEGMENTS) -> None:
    """Count the marker segments and scans of a JPEG up to its EOI, refusing past the limits; check
    the TIFF directories (EXIF in APP1, MPF in APP2) that Pillow reads at open."""
    position, scans, segments, size = 2, 0, 0, len(data)
    while position + 4 <= size:
        if data[position] != 0xFF:  # not at a marker: corrupt; Pillow/libjpeg will say so
            return
        marker = data[position + 1]
        if marker == 0xFF:  # fill byte
            position += 1
            continue
        if marker == 0xD9:  # EOI: what follows (an MPO's other images, trailing bytes) is not decoded
            return
        if marker in _JPEG_STANDALONE or marker == 0xD8:
            position += 2
            continue
        segments += 1
        if segments > max_segments:
            raise InputError(f"input '{name}' is a JPEG with more than {max_segments} marker segments; "
                             f"the limit is {max_segments} (decoding work protection)")
        length = (data[position + 2] << 8) | data[position + 3]
        body = data[position + 4:position + 2 + length]
        if marker == 0xE1 and body.startswith(b"Exif\x00\x00"):
            check_tiff_directory(body[6:], name, "EXIF")
        elif marker == 0xE2 and body.startswith(b"MPF\x00"):
            check_tiff_directory(body[4:], name, "MPF")
        position += 2 + length
        if marker == 0xDA:
            scans += 1
            if scans > max_scans:
                raise InputError(f"input '{name}' is a progressive JPEG with more than {max_scans} scans; "
                                 f"the limit is {max_scans} (real encoders write about 10; decoding work "
                                 "grows with every scan)")
            found = _JPEG_NEXT_MARKER.search(data, position)
            if found is None:
                return
            position = found.end() - 2


def check_tiff_directory(tiff: bytes, name: str, what: str) -> None:
    """A TIFF-structured block (EXIF, MPF): its first directory's tags may not claim more data bytes
    than the block holds (Pillow reads each tag's data separately, so overlapping tags multiply)."""
    if len(tiff) < 8 or tiff[:2] not in (b"II", b"MM"):
        return  # not TIFF: Pillow ignores or rejects it
    order = "<" if tiff[:2] == b"II" else ">"
    (offset,) = struct.unpack_from(order + "I", tiff, 4)
    if offset + 2 > len(tiff):
        return
    (count,) = struct.unpack_from(order + "H", tiff, offset)
    count = min(count, (len(tiff) - offset - 2) // 12)
    entries = np.frombuffer(tiff, dtype=np.dtype([("tag", order + "u2"), ("type", order + "u2"),
                                                  ("count", order + "u4"), ("value", order + "u4")]),
                            count=count, offset=offset + 2)
    sizes = _TIFF_UNIT[entries["type"]] * entries["count"].astype(np.int64)
    # a tag claiming more than the block is merely truncated (Pillow skips it): count what it can read
    claimed = int(np.minimum(sizes[sizes > 4], len(tiff)).sum())
    if claimed > len(tiff):
        raise InputError(f"input '{name}' has an {what} directory of {count} tags claiming {claimed} bytes of data "
                         f"in {len(tiff)} bytes (overlapping tags: a memory bomb)")


def exif_orientation(exif: bytes | None) -> int:
    """The EXIF Orientation (tag 0x0112) of IFD0, read without Pillow's reader; 1 when absent."""
    if not exif:
        return 1
    tiff = exif[6:] if exif.startswith(b"Exif\x00\x00") else exif
    if len(tiff) < 8 or tiff[:2] not in (b"II", b"MM"):
        return 1
    order = "<" if tiff[:2] == b"II" else ">"
    (offset,) = struct.unpack_from(order + "I", tiff, 4)
    if offset + 2 > len(tiff):
        return 1
    (count,) = struct.unpack_from(order + "H", tiff, offset)
    count = min(count, (len(tiff) - offset - 2) // 12)
    entries = np.frombuffer(tiff, dtype=np.dtype([("tag", order + "u2"), ("type", order + "u2"),
                                                  ("count", order + "u4"), ("value", "V4")]),
                            count=count, offset=offset + 2)
    found = np.flatnonzero((entries["tag"] == 0x0112) & (entries["type"] == 3))
    if not len(found):
        return 1
    value = struct.unpack(order + "H", bytes(entries["value"][found[0]])[:2])[0]
    return value if 1 <= value <= 8 else 1


def check_png(data: bytes, name: str, max_chunks: int = MAX_PNG_CHUNKS) -> None:
    """Count a PNG's chunks (each read by Pillow in Python) up to IEND, refusing past the limit."""
    position, chunks, size = 8, 0, len(data)
    while position + 8 <= size:
        chunks += 1
        if chunks > max_chunks:
            raise InputError(f"input '{name}' is a PNG with more than {max_chunks} chunks; the limit is {max_chunks} "
                             "(decoding work protection)")
        length = int.from_bytes(data[position:position + 4], "big")
        if data[position + 4:position + 8] == b"IEND":
            return
        position += 12 + length


def check_gif(data: bytes, name: str, max_blocks: int = MAX_GIF_BLOCKS) -> None:
    """Count the blocks and sub-blocks before a GIF's first image (Pillow reads them in Python)."""
    size = len(data)
    if size < 13:
        return
    flags = data[10]
    position = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)
    blocks = 0
    while position < size and data[position] == 0x21:  # extension: label, then sub-blocks up to a 0
        position += 2
        while position < size:
            blocks += 1
            if blocks > max_blocks:
                raise InputError(f"input '{name}' is a GIF with more than {max_blocks} extension blocks before its "
                                 f"first image; the limit is {max_blocks} (decoding work protection)")
            length = data[position]
            position += 1 + length
            if length == 0:
                break


def check_encoded(data: bytes, name: str, config) -> None:
    """The checks that must run before ``Image.open`` (which parses these structures itself)."""
    if data.startswith(b"\xff\xd8"):
        check_jpeg(data, name, config.max_jpeg_scans, config.max_jpeg_segments)
    elif data.startswith(b"\x89PNG\r\n\x1a\n"):
        check_png(data, name, config.max_png_chunks)
    elif data.startswith(b"GIF8"):
        check_gif(data, name, config.max_gif_blocks)


def check_opened(image, name: str, config) -> None:
    """The checks on an opened (header-only) image, before its pixels are decoded."""
    if image.format == "BMP" and image.info.get("compression") in (1, 2):
        width, height = image.size
        if width * height > config.max_rle_bmp_pixels:
            kind = "RLE8" if image.info["compression"] == 1 else "RLE4"
            raise InputError(
                f"input '{name}' is a {kind} BMP of {width}x{height} = {width * height} pixels; RLE bitmaps are "
                f"decoded by a pure-Python decoder and limited to {config.max_rle_bmp_pixels} pixels "
                "(send it uncompressed, or as PNG)")
