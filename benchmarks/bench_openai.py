"""What the OpenAI-compatible frontend costs, and how early a streamed transcript starts (issue 23).

- ``/v1/embeddings`` against the native ``text_embedding`` endpoint, both through the public HTTP
  port (nginx), one short text per request, the same closed-loop load generator, back-to-back pairs:
  added p50 at concurrency 1 (target ≤ 1 ms), throughput ratio at 16 (target ≥ 0.95×).
- Speech on an 11 s clip at concurrency 1: the streamed ``/v1/audio/transcriptions`` (SSE from
  ``speech_recognition_stream``), time to the first ``transcript.text.delta`` and to
  ``transcript.text.done``, against the non-streaming ``speech_recognition`` pipeline over gRPC
  (targets: first partial within 25% of the full transcript's time; total ≤ 1.05×).
"""

from __future__ import annotations

import io
import json
import statistics
import time
import urllib.request
from pathlib import Path

import numpy as np

from .loadgen import Target, json_request, measure, triton_check, triton_request
from .perf import markdown_table
from .settings import current

ROOT = Path(__file__).resolve().parents[1]
TEXT = "How do I reset my password?"


def embeddings_check(status: int, body: bytes) -> None:
    if status != 200 or len(json.loads(body)["data"]) != 1:
        raise RuntimeError(f"/v1/embeddings answered {status}: {body[:300]!r}")


def clip_11s() -> bytes:
    """The two test sentences twice, with pauses (11.4 s, one window, ~40 tokens). (The first sentence
    repeated makes Whisper stop after its first words: a short decode that would hide the streaming.)"""
    import soundfile

    hello, rate = soundfile.read(str(ROOT / "tests" / "data" / "speech_hello.wav"), dtype="float32")
    morning, _ = soundfile.read(str(ROOT / "tests" / "data" / "speech_good_morning.wav"), dtype="float32")
    pause = np.zeros(int(rate * 0.5), np.float32)
    buffer = io.BytesIO()
    soundfile.write(buffer, np.concatenate([hello, pause, morning, pause, hello, pause, morning]), rate, format="WAV")
    return buffer.getvalue()


def multipart(fields: dict[str, str], audio: bytes) -> tuple[bytes, str]:
    boundary = "benchboundary"
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
             for k, v in fields.items()]
    parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
                 f"Content-Type: audio/wav\r\n\r\n".encode() + audio + b"\r\n")
    return b"".join(parts) + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def streamed(url: str, audio: bytes) -> tuple[float, float]:
    """(seconds to the first delta, seconds to done) of one streamed transcription."""
    body, content_type = multipart({"model": "speech_recognition", "stream": "true"}, audio)
    started = time.perf_counter()
    first = None
    request = urllib.request.Request(url, data=body, headers={"Content-Type": content_type}, method="POST")
    with urllib.request.urlopen(request, timeout=600) as response:
        for line in response:
            if line.startswith(b"data: "):
                event = json.loads(line[6:])
                if event["type"] == "transcript.text.delta" and first is None:
                    first = time.perf_counter() - started
                if event["type"] == "transcript.text.done":
                    return first if first is not None else float("nan"), time.perf_counter() - started
    raise RuntimeError("the stream ended without transcript.text.done")


def run(server) -> str:
    settings = current()
    native = Target("native text_embedding", f"http://{server.http_url}/v2/models/text_embedding/infer",
                    [triton_request([("text", "BYTES", np.array([[TEXT.encode()]], dtype=object))], ["embedding"])],
                    triton_check)
    v1 = Target("/v1/embeddings", f"http://{server.http_url}/v1/embeddings",
                [json_request({"model": "text_embedding", "input": TEXT, "encoding_format": "float"})],
                embeddings_check)
    rows, summary = [], {}
    for concurrency in (1, 16):
        pairs = []
        for _ in range(settings.pairs):
            direct = measure(native, concurrency, settings.seconds, min_requests=settings.min_requests)
            through = measure(v1, concurrency, settings.seconds, min_requests=settings.min_requests)
            pairs.append((direct, through))
        added = statistics.median(t.p50 - d.p50 for d, t in pairs)
        ratio = statistics.median(t.throughput / d.throughput for d, t in pairs)
        summary[concurrency] = (added, ratio)
        rows.append([concurrency, f"{statistics.median(d.p50 for d, _ in pairs):.2f}",
                     f"{statistics.median(t.p50 for _, t in pairs):.2f}", f"{added:+.2f} ms",
                     f"{statistics.median(d.throughput for d, _ in pairs):.0f}",
                     f"{statistics.median(t.throughput for _, t in pairs):.0f}", f"{ratio:.2f}x"])
    text_table = markdown_table(["concurrency", "p50 native (ms)", "p50 /v1 (ms)", "added p50", "native texts/s",
                                 "/v1 texts/s", "/v1 / native"], rows)

    from triton_pipelines.client import TritonClient, text_tensor

    audio = clip_11s()
    client = TritonClient("grpc", server.grpc_url)
    rounds = max(3, settings.pairs * 2)
    firsts, totals, natives = [], [], []
    try:
        client.infer("speech_recognition", {"audio": text_tensor([audio])})  # warm
        streamed(f"http://{server.http_url}/v1/audio/transcriptions", audio)
        for _ in range(rounds):
            started = time.perf_counter()
            client.infer("speech_recognition", {"audio": text_tensor([audio])})
            natives.append(time.perf_counter() - started)
            first, total = streamed(f"http://{server.http_url}/v1/audio/transcriptions", audio)
            firsts.append(first)
            totals.append(total)
    finally:
        client.close()
    native_s, first_s, total_s = (statistics.median(v) for v in (natives, firsts, totals))
    added_1, _ = summary[1]
    _, ratio_16 = summary[16]
    verdict = lambda ok: "met" if ok else "missed"  # noqa: E731
    return (f"## The OpenAI-compatible frontend (`/v1`)\n\n"
            f"`/v1/embeddings` against the native `text_embedding` endpoint, both through the public port, "
            f"one short text per request, {settings.pairs} back-to-back pair(s) per row (median): added p50 at "
            f"concurrency 1 {added_1:+.2f} ms (target ≤ 1 ms: {verdict(added_1 <= 1.0)}), throughput at 16 "
            f"{ratio_16:.2f}x native (target ≥ 0.95x: {verdict(ratio_16 >= 0.95)}).\n\n{text_table}\n\n"
            f"Speech, a {len(audio) / 32000:.0f} s clip at concurrency 1, median of {rounds} rounds: the streamed "
            f"`/v1/audio/transcriptions` sent its first delta after {first_s:.2f} s and `transcript.text.done` "
            f"after {total_s:.2f} s; the non-streaming `speech_recognition` over gRPC took {native_s:.2f} s. "
            f"First partial at {first_s / native_s:.0%} of the full transcript's time (target ≤ 25%: "
            f"{verdict(first_s <= 0.25 * native_s)}); total {total_s / native_s:.2f}x (target ≤ 1.05x: "
            f"{verdict(total_s <= 1.05 * native_s)}). On a CPU the encoder's pass over the padded 30 s window "
            f"comes before the first token and is most of the time.\n")
