"""Small files that are cheap to send and (without the budgets) costly to decode: built here, in
milliseconds, for the unit tests (tests/unit/pipelines/test_input_budgets.py) and the server tests
(tests/server/test_hostile_decode.py)."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np


def progressive_jpeg(size: int = 256, scans: int = 100_000, quality: int = 90) -> bytes:
    """A real progressive grayscale JPEG of ``size``² followed by ``scans`` empty AC scans (SOS
    segments without entropy-coded data): libjpeg walks every block of the image once per scan."""
    from PIL import Image

    gradient = np.add.outer(np.arange(size), np.arange(size)) % 256
    buffer = io.BytesIO()
    Image.fromarray(gradient.astype(np.uint8)).save(buffer, "JPEG", progressive=True, quality=quality)
    data = buffer.getvalue()
    assert data.endswith(b"\xff\xd9")
    empty_scan = b"\xff\xda\x00\x08\x01\x01\x00\x01\x3f\x00"  # component 1, Ss 1, Se 63, Ah/Al 0
    return data[:-2] + empty_scan * scans + b"\xff\xd9"


def jpeg_with_segments(segments: int, size: int = 64) -> bytes:
    """A small baseline JPEG with ``segments`` empty COM segments before its frame header."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("L", (size, size), 128).save(buffer, "JPEG")
    data = buffer.getvalue()
    return data[:2] + b"\xff\xfe\x00\x02" * segments + data[2:]


def bmp_rle8_early_row_ends(width: int = 7071, height: int = 7071, rle4: bool = False) -> bytes:
    """An RLE8 (or RLE4) BMP whose every row holds one pixel and then ends (``01 07 00 00``): 4 bytes
    per row; Pillow's pure-Python RLE decoder pads the rest of each row one byte at a time."""
    pixels = b"\x01\x07\x00\x00" * height + b"\x00\x01"
    colors = 16 if rle4 else 256
    palette = b"".join(bytes((i, i, i, 0)) for i in range(colors))
    header_size = 14 + 40 + len(palette)
    info = struct.pack("<IiiHHIIiiII", 40, width, height, 1, 4 if rle4 else 8, 2 if rle4 else 1, len(pixels),
                       2835, 2835, colors, 0)
    file_header = b"BM" + struct.pack("<IHHI", header_size + len(pixels), 0, 0, header_size)
    return file_header + info + palette + pixels


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_many_chunks(chunks: int, size: int = 16, idat: bool = True) -> bytes:
    """A valid ``size``² grayscale PNG whose zlib stream is split into ``chunks`` IDAT chunks of one
    byte (``idat=False``: one IDAT, then ``chunks`` empty private ancillary chunks after it)."""
    raw = b"".join(b"\x00" + bytes(size) for _ in range(size))
    stream = zlib.compress(raw)
    head = b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", struct.pack(">IIBBBBB", size, size, 8, 0, 0, 0, 0))
    if idat:
        stream += bytes(max(0, chunks - len(stream)))  # trailing bytes after the zlib stream
        body = b"".join(_png_chunk(b"IDAT", stream[i:i + 1]) for i in range(len(stream)))
    else:
        body = _png_chunk(b"IDAT", stream) + _png_chunk(b"prIv", b"") * chunks
    return head + body + _png_chunk(b"IEND", b"")


def gif_many_extensions(blocks: int, size: int = 16) -> bytes:
    """A ``size``² GIF whose first frame comes after ``blocks`` one-byte comment sub-blocks."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("P", (size, size), 0).save(buffer, "GIF")
    data = buffer.getvalue()
    start = data.index(b"\x2c")  # the first image descriptor (after header, screen and palette)
    comment = b"\x21\xfe" + b"\x01x" * blocks + b"\x00"
    return data[:start] + comment + data[start:]


def exif_bomb_png(entries: int = 4000, data_bytes: int = 40_000, size: int = 16) -> bytes:
    """A PNG whose eXIf chunk holds an IFD of ``entries`` tags that all point at the same
    ``data_bytes`` of data: Pillow's EXIF reader copies the data once per tag."""
    ifd = struct.pack("<H", entries)
    data_offset = 8 + 2 + 12 * entries + 4
    for tag in range(entries):
        ifd += struct.pack("<HHII", 0x8000 + tag, 7, data_bytes, data_offset)  # UNDEFINED
    tiff = b"II*\x00" + struct.pack("<I", 8) + ifd + b"\x00\x00\x00\x00" + bytes(data_bytes)
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("L", (size, size), 100).save(buffer, "PNG")
    data = buffer.getvalue()
    iend = data.rindex(b"IEND") - 4
    return data[:iend] + _png_chunk(b"eXIf", tiff) + data[iend:]


def wav(rate: int, frames: int, channels: int = 1, subtype: str = "PCM_16", value: float = 0.1) -> bytes:
    """A WAV of a 1/8-rate square wave (or silence with ``value=0``)."""
    import soundfile

    signal = np.where((np.arange(frames) // 4) % 2, value, -value).astype(np.float32)
    buffer = io.BytesIO()
    soundfile.write(buffer, np.repeat(signal[:, None], channels, axis=1), rate, subtype=subtype, format="WAV")
    return buffer.getvalue()


def compressed_silence(seconds: float, rate: int = 16000, format: str = "FLAC") -> bytes:
    """``seconds`` of digital silence as FLAC, OGG (Vorbis) or OPUS (OGG/Opus, 48 kHz): tens of KB."""
    import soundfile

    buffer = io.BytesIO()
    subtype = "OPUS" if format == "OPUS" else None
    rate = 48000 if subtype else rate
    block = np.zeros(rate, dtype=np.float32)
    # one second at a time: libsndfile 1.2.2 crashes writing minutes of Vorbis in one call
    with soundfile.SoundFile(buffer, "w", rate, 1, format="OGG" if subtype else format, subtype=subtype) as handle:
        for _ in range(int(seconds)):
            handle.write(block)
    return buffer.getvalue()
