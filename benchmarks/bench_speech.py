"""speech_recognition through Triton (perf_analyzer, gRPC, WAV payloads) next to the same work
in process: features + the same two ONNX files in ONNX Runtime + the same greedy loop, batched.

The time split comes from Triton's own per-model statistics (compute_infer of audio_features,
whisper_encoder, whisper_decoder and whisper_decode over the measured runs); "BLS overhead" is
whisper_decode's time not spent inside the encoder or decoder: request/response tensors through
shared memory, the BLS round trips, argmax and row gathering."""

from __future__ import annotations

import base64
import io
import json
import statistics
import struct
import time
from pathlib import Path

import numpy as np
import soundfile

from triton_pipelines.client import TritonClient
from triton_pipelines.speech import (SAMPLE_RATE, WhisperOnnx, WhisperTokenizer, audio_to_features,
                                     load_mel_filters)

from .perf import BENCH_DIR, markdown_table, perf_analyzer

ROOT = Path(__file__).resolve().parents[1]
CONCURRENCY = (1, 2, 4, 8)
PAIRS = 3
THREADS = 2  # the embedded compute models' intra_op_threads; the in-process baseline uses the same
CLIP_SECONDS = 10.0
# Random weights rarely emit <|endoftext|>: every request decodes exactly this many tokens, about
# the token rate of real speech (~3 tokens per second of audio).
MAX_NEW_TOKENS = 32
SPEECH_MODELS = ("audio_features", "whisper_encoder", "whisper_decoder", "whisper_decode")


def clip() -> bytes:
    """~10 s of 16 kHz 16-bit speech-like audio from the test WAVs (espeak-ng), repeated."""
    parts = [soundfile.read(ROOT / "tests" / "data" / name, dtype="float32")[0]
             for name in ("speech_hello.wav", "speech_good_morning.wav")]
    gap = np.zeros(SAMPLE_RATE // 4, np.float32)
    audio = np.concatenate([np.concatenate([p, gap]) for p in parts] * 3)[:int(CLIP_SECONDS * SAMPLE_RATE)]
    buffer = io.BytesIO()
    soundfile.write(buffer, audio, SAMPLE_RATE, subtype="PCM_16", format="WAV")
    return buffer.getvalue()


def input_data(wav: bytes) -> Path:
    path = BENCH_DIR / "speech_inputs.json"
    BENCH_DIR.mkdir(exist_ok=True)
    path.write_text(json.dumps({"data": [{
        # b64 is the tensor's raw buffer: for BYTES, each element is a 4-byte length + its bytes
        "audio": {"b64": base64.b64encode(struct.pack("<I", len(wav)) + wav).decode()},
        "max_new_tokens": {"content": [MAX_NEW_TOKENS], "shape": [1]},
    }]}))
    return path


def in_process(repository: Path, wav: bytes, batch_size: int, seconds: float = 8.0) -> dict:
    """Batches of ``batch_size`` clips, one after another: audio s per wall s and the split."""
    whisper = WhisperOnnx(repository / "whisper_encoder" / "1" / "model.onnx",
                          repository / "whisper_decoder" / "1" / "model.onnx", intra_op_threads=THREADS)
    filters = load_mel_filters(repository / "audio_features" / "1" / "mel_filters.npz", whisper.shape.n_mels)
    tokenizer = WhisperTokenizer.for_vocab_size(repository / "whisper_decode" / "1" / "multilingual.tiktoken",
                                                whisper.shape.vocab_size)
    split = {"features": 0.0, "encoder": 0.0, "decode loop": 0.0}
    done, latencies, started = 0, [], time.perf_counter()
    while time.perf_counter() - started < seconds or done == 0:
        t0 = time.perf_counter()
        features = np.concatenate([audio_to_features(wav, filters) for _ in range(batch_size)])
        t1 = time.perf_counter()
        prompts = np.array([tokenizer.prompt()] * len(features))
        cross = whisper.encode(features)
        t2 = time.perf_counter()
        whisper.decode_encoded(cross, prompts, tokenizer, MAX_NEW_TOKENS)
        t3 = time.perf_counter()
        split["features"] += t1 - t0
        split["encoder"] += t2 - t1
        split["decode loop"] += t3 - t2
        latencies.append(t3 - t0)
        done += batch_size
    wall = time.perf_counter() - started
    return {"audio_per_s": done * CLIP_SECONDS / wall, "p50_s": float(np.median(latencies)),
            "split": {k: v / done for k, v in split.items()}}


def model_times(client: TritonClient) -> dict[str, tuple[int, float]]:
    """model → (inferences, cumulative compute_infer seconds per execution). ``batch_stats`` counts
    each execution once; ``inference_stats`` would charge a batched execution to every request."""
    times = {}
    for model in SPEECH_MODELS:
        stats = client.statistics(model)["model_stats"][0]
        seconds = sum(int(b["compute_infer"]["ns"]) for b in stats.get("batch_stats", [])) / 1e9
        times[model] = (int(stats["inference_count"]), seconds)
    return times


def run(server) -> str:
    repository = Path(server.options.model_repository)
    wav = clip()
    data = input_data(wav)
    client = TritonClient("http", server.http_url)
    client.infer("speech_recognition", {"audio": np.array([[wav]], dtype=np.object_),
                                        "max_new_tokens": np.array([[MAX_NEW_TOKENS]], np.int32)})  # warm-up
    before = model_times(client)
    # A request takes seconds on 2 shared cores: count requests, not milliseconds, per window.
    rows = [perf_analyzer("speech_recognition", server.grpc_url, c, input_data=data,
                          extra=["--measurement-mode", "count_windows",
                                 "--measurement-request-count", str(2 * c + 2)])
            for c in CONCURRENCY]
    after = model_times(client)
    client.close()
    baseline = {b: in_process(repository, wav, b) for b in (1, 2, 4, 8)}
    best_batch = max(baseline, key=lambda b: baseline[b]["audio_per_s"])
    peak = max(rows, key=lambda r: r.throughput)
    # The shared machine drifts between tables: the target is judged on back-to-back pairs
    # (in-process at its best batch, then Triton at its best concurrency), median of PAIRS.
    pairs = [(in_process(repository, wav, best_batch)["audio_per_s"],
              perf_analyzer("speech_recognition", server.grpc_url, peak.concurrency, input_data=data,
                            extra=["--measurement-mode", "count_windows", "--measurement-request-count",
                                   str(2 * peak.concurrency + 2)]).throughput * CLIP_SECONDS)
             for _ in range(PAIRS)]
    ratio = statistics.median(served / local for local, served in pairs)
    # Latency of one clip alone: in-process batch 1 p50, then Triton concurrency 1 p50.
    latency_pairs = [(in_process(repository, wav, 1)["p50_s"] * 1000,
                      perf_analyzer("speech_recognition", server.grpc_url, 1, input_data=data,
                                    extra=["--measurement-mode", "count_windows",
                                           "--measurement-request-count", "4"]).p50_ms)
                     for _ in range(PAIRS)]
    added_ms = statistics.median(served - local for local, served in latency_pairs)

    clips = after["audio_features"][0] - before["audio_features"][0]
    per_clip = {m: (after[m][1] - before[m][1]) / max(clips, 1) for m in SPEECH_MODELS}
    bls = per_clip["whisper_decode"] - per_clip["whisper_encoder"] - per_clip["whisper_decoder"]
    best = baseline[best_batch]
    ms = lambda s: s * 1000  # noqa: E731

    lines = [
        "## speech_recognition (Whisper, BLS greedy decode) — Triton vs in-process",
        "",
        f"Payload: one {CLIP_SECONDS:.0f} s 16 kHz 16-bit WAV (espeak-ng speech from tests/data), "
        f"max_new_tokens={MAX_NEW_TOKENS} (random weights never stop early: every request decodes "
        f"{MAX_NEW_TOKENS} tokens); perf_analyzer over gRPC. In-process: the same features code, ONNX "
        f"files and greedy loop in ONNX Runtime with {THREADS} threads, batches of 1–8 clips. "
        "RTF = latency / audio duration (lower is better).",
        "",
        markdown_table(["concurrency", "requests/s", "audio s per s", "p50 ms", "p99 ms", "RTF (p50)"],
                       [[r.concurrency, r.throughput, r.throughput * CLIP_SECONDS, r.p50_ms, r.p99_ms,
                         r.p50_ms / 1000 / CLIP_SECONDS] for r in rows]),
        "",
        markdown_table(["in-process batch", "audio s per s", "p50 s per batch", "RTF (p50)"],
                       [[b, v["audio_per_s"], v["p50_s"], v["p50_s"] / CLIP_SECONDS] for b, v in baseline.items()]),
        "",
        f"Back-to-back pairs (in-process batch {best_batch}, then Triton at concurrency {peak.concurrency}):",
        "",
        markdown_table(["pair", "in-process audio s per s", "Triton audio s per s", "ratio"],
                       [[i + 1, local, served, f"{served / local:.0%}"] for i, (local, served) in enumerate(pairs)]),
        "",
        f"**Ratio at saturation (median of {PAIRS} pairs): {ratio:.0%}** (target ≥ 90%).",
        "",
        "One clip alone, back-to-back pairs (in-process batch 1 p50, then Triton concurrency 1 p50):",
        "",
        markdown_table(["pair", "in-process p50 ms", "Triton p50 ms", "added ms"],
                       [[i + 1, local, served, served - local] for i, (local, served) in enumerate(latency_pairs)]),
        "",
        f"**Added p50 latency per clip (median of {PAIRS} pairs): {added_ms:+.0f} ms** "
        f"({added_ms / 1000 / CLIP_SECONDS:+.3f} RTF).",
        "",
        "### Where the time goes (ms per 10 s clip)",
        "",
        markdown_table(["stage", "Triton (all runs above)", f"in-process (batch {best_batch})"], [
            ["features (audio_features)", ms(per_clip["audio_features"]), ms(best["split"]["features"])],
            ["encoder (whisper_encoder)", ms(per_clip["whisper_encoder"]), ms(best["split"]["encoder"])],
            ["decoder steps (whisper_decoder)", ms(per_clip["whisper_decoder"]), ms(best["split"]["decode loop"])],
            ["BLS overhead (whisper_decode minus the two above)", ms(bls), "—"],
        ]),
        "",
        "Triton times are each model's compute_infer from the statistics API divided by the clips "
        "served, so batched executions are shared between their clips; the in-process decode loop "
        "includes its own argmax and cache bookkeeping.",
    ]
    return "\n".join(lines)
