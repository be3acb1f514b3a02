"""speech_recognition (real Whisper base) through Triton next to faster-whisper on the same
weights, the same clips and the same cores.

Clips: the speech corpus of the quality tests (``tools.speech_eval.CORPUS``: 24 sentences
in English, German and Spanish spoken by espeak-ng, 2–5 s each), each sent with its language.
Every system decodes greedily without timestamps and reports audio seconds per wall second, RTF
(latency / clip duration) at concurrency 1 and at saturation, and WER on the same clips.

- ours: the ``speech_recognition`` ensemble over gRPC, one clip per request; concurrency 1 sends
  the clips one after another, saturation keeps ``SATURATION`` requests in flight.
  Ours, faster-whisper float32 and int8 are measured in turn ``ROUNDS`` times, so that the load of
  the shared machine drifts across them alike; the report gives the ratios round by round.
- ours int8 (in process): the same ONNX graphs after ONNX Runtime dynamic int8 quantization, in
  the same greedy loop in process, to see whether an int8 variant would close the gap to
  faster-whisper int8.
- faster-whisper float32 / int8: ``WhisperModel.transcribe`` (its own features and loop),
  ``beam_size=1``, ``temperature=0``, no VAD, no conditioning on previous text; concurrency 1 is
  one model with 2 threads; saturation is ``num_workers=2`` with 1 thread each and 2 clips in
  flight (its way to serve parallel requests).
- faster-whisper batched: ``BatchedInferencePipeline`` (batch 8) on each language's clips joined
  into one file (its VAD cuts them back into segments): the batched pipeline batches the segments
  of one file, not separate requests.
"""

from __future__ import annotations

import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from triton_pipelines.client import TritonClient, text_tensor
from triton_pipelines.pipelines.speech.audio import decode_audio
from triton_pipelines.pipelines.speech.config import SAMPLE_RATE
from triton_pipelines.pipelines.speech.features import audio_to_features, load_mel_filters
from triton_pipelines.pipelines.speech.jobs import join_transcript
from triton_pipelines.pipelines.speech.reference import WhisperOnnx
from triton_pipelines.pipelines.speech.tokenizer import WhisperTokenizer
from tools.speech_eval import CORPUS, FasterWhisperGreedy, corpus_wer, join_clips, speak

from .perf import BENCH_DIR, markdown_table

ROOT = Path(__file__).resolve().parents[1]
SATURATION = 8  # requests in flight for our pipeline (whisper_decode batches up to 8)
THREADS = 2


def load_average() -> str:
    return " / ".join(f"{value:.2f}" for value in os.getloadavg())


class Clips:
    def __init__(self):
        self.wavs = [speak(s.text, s.language) for s in CORPUS]
        self.audio = [decode_audio(wav) for wav in self.wavs]  # 16 kHz mono, what everyone decodes
        self.seconds = [len(a) / SAMPLE_RATE for a in self.audio]
        self.languages = [s.language for s in CORPUS]
        self.references = [s.text for s in CORPUS]

    @property
    def total_seconds(self) -> float:
        return sum(self.seconds)


def measure(clips: Clips, transcribe, concurrency: int) -> dict:
    """``transcribe(index) → text`` over every clip with ``concurrency`` in flight."""
    latencies = [0.0] * len(clips.wavs)
    texts = [""] * len(clips.wavs)

    def one(index: int) -> None:
        started = time.perf_counter()
        texts[index] = transcribe(index)
        latencies[index] = time.perf_counter() - started

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(len(clips.wavs))))
    wall = time.perf_counter() - started
    rtf = [latency / seconds for latency, seconds in zip(latencies, clips.seconds)]
    return {"audio_per_s": clips.total_seconds / wall, "rtf_p50": statistics.median(rtf),
            "wer": corpus_wer(list(zip(clips.references, texts))), "texts": texts}


class Ours:
    """The ``speech_recognition`` ensemble over gRPC, one clip per request (a client per thread)."""

    def __init__(self, server, clips: Clips, model: str = "speech_recognition"):
        import threading

        self.server, self.clips, self.model = server, clips, model
        self.local = threading.local()
        self.clients: list[TritonClient] = []
        self.transcribe(0)  # warm-up

    def transcribe(self, index: int) -> str:
        client = getattr(self.local, "client", None)
        if client is None:
            client = self.local.client = TritonClient("grpc", self.server.grpc_url)
            self.clients.append(client)
        out = client.infer(self.model, {"audio": text_tensor([self.clips.wavs[index]]),
                                        "language": text_tensor([self.clips.languages[index]])})
        return out["transcript"][0, 0].decode()

    def run(self, concurrency: int) -> dict:
        return measure(self.clips, self.transcribe, SATURATION if concurrency > 1 else 1)

    def close(self):
        for client in self.clients:
            client.close()


class FasterWhisper:
    """faster-whisper's ``transcribe`` on the clips' 16 kHz samples: one model with 2 threads for
    concurrency 1; ``num_workers=2`` with 1 thread each and 2 clips in flight at saturation."""

    def __init__(self, model_dir: Path, clips: Clips, compute_type: str):
        self.clips = clips
        self.single = FasterWhisperGreedy(model_dir, compute_type, cpu_threads=THREADS)
        self.parallel = FasterWhisperGreedy(model_dir, compute_type, cpu_threads=1, num_workers=2)
        for model in (self.single, self.parallel):
            model.transcribe(clips.audio[0], clips.languages[0])  # warm-up

    def run(self, concurrency: int) -> dict:
        model = self.single if concurrency == 1 else self.parallel
        return measure(self.clips, lambda i: model.transcribe(self.clips.audio[i], self.clips.languages[i]),
                       1 if concurrency == 1 else 2)

    def close(self):
        pass


def quantized(source: Path) -> Path:
    """ONNX Runtime dynamic int8 quantization (per-tensor int8 weights; per-channel measured worse:
    it made German loop) of one of our graphs, cached under .bench/."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    folder = BENCH_DIR / "whisper-int8"
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / (source.parent.parent.name + ".onnx")
    if not target.exists() or target.stat().st_mtime < source.stat().st_mtime:
        quantize_dynamic(str(source), str(target), weight_type=QuantType.QInt8)
    return target


def ours_in_process(repository: Path, clips: Clips, int8: tuple[str, ...] = ()) -> dict:
    """Our graphs (those named in ``int8`` quantized) in our greedy loop, in process, one clip at a
    time and in batches of 8."""
    graphs = {name: repository / name / "1" / "model.onnx" for name in ("whisper_encoder", "whisper_decoder")}
    graphs.update({name: quantized(graphs[name]) for name in int8})
    whisper = WhisperOnnx(graphs["whisper_encoder"], graphs["whisper_decoder"], intra_op_threads=THREADS)
    filters = load_mel_filters(repository / "audio_features" / "1" / "mel_filters.npz", whisper.shape.n_mels)
    tokenizer = WhisperTokenizer(repository / "whisper_decode" / "1" / "multilingual.tiktoken")

    def run(indices: list[int]) -> list[str]:
        features = np.concatenate([audio_to_features(clips.wavs[i], filters) for i in indices])
        prompts = np.array([tokenizer.prompt(clips.languages[i]) for i in indices])
        return [join_transcript(tokenizer, [tokens]) for tokens in whisper.decode_windows(features, prompts, tokenizer, 224)]

    run([0])  # warm-up
    result = {"c1": measure(clips, lambda i: run([i])[0], 1)}
    texts, started = [], time.perf_counter()
    for start in range(0, len(clips.wavs), 8):
        texts += run(list(range(start, min(start + 8, len(clips.wavs)))))
    wall = time.perf_counter() - started
    result["sat"] = {"audio_per_s": clips.total_seconds / wall, "rtf_p50": float("nan"),
                     "wer": corpus_wer(list(zip(clips.references, texts))), "texts": texts}
    return result


def faster_whisper_batched(model_dir: Path, clips: Clips, compute_type: str) -> dict:
    from faster_whisper import BatchedInferencePipeline, WhisperModel

    model = WhisperModel(str(model_dir), device="cpu", compute_type=compute_type, cpu_threads=THREADS,
                         local_files_only=True)
    pipeline = BatchedInferencePipeline(model)
    pairs, wall = [], 0.0
    for language in sorted(set(clips.languages)):
        indices = [i for i, lang in enumerate(clips.languages) if lang == language]
        joined, _ = join_clips([clips.wavs[i] for i in indices])
        audio = decode_audio(joined)
        if language == clips.languages[0] and not pairs:
            list(pipeline.transcribe(audio[:SAMPLE_RATE * 5], language=language, batch_size=8)[0])  # warm-up
        started = time.perf_counter()
        segments, _ = pipeline.transcribe(audio, language=language, batch_size=8, beam_size=1, temperature=0.0,
                                          without_timestamps=True, condition_on_previous_text=False)
        text = " ".join(segment.text.strip() for segment in segments)
        wall += time.perf_counter() - started
        pairs.append((" ".join(clips.references[i] for i in indices), text))
    return {"sat": {"audio_per_s": clips.total_seconds / wall, "rtf_p50": float("nan"),
                    "wer": corpus_wer(pairs), "texts": []}}


ROUNDS = 2


def run(server) -> str:
    from repo_builder.ct2_whisper import write_ctranslate2_dir

    repository = Path(server.options.model_repository)
    clips = Clips()
    model_dir = write_ctranslate2_dir(BENCH_DIR / "faster-whisper-base")
    load_before = load_average()
    # The three systems of the target, measured in turn ROUNDS times (c=1, then saturation), so
    # that the load of this shared machine drifts across all of them alike.
    main = {"ours: Triton speech_recognition": Ours(server, clips),
            "faster-whisper float32": FasterWhisper(model_dir, clips, "float32"),
            "faster-whisper int8": FasterWhisper(model_dir, clips, "int8")}
    rounds = {name: [] for name in main}
    for _ in range(ROUNDS):
        for name, system in main.items():
            rounds[name].append({"c1": system.run(1), "sat": system.run(SATURATION)})
    for system in main.values():
        system.close()
    del main
    results = {name: {key: mean_result([r[key] for r in runs]) for key in ("c1", "sat")}
               for name, runs in rounds.items()}
    results["faster-whisper float32 batched (batch 8)"] = faster_whisper_batched(model_dir, clips, "float32")
    results["faster-whisper int8 batched (batch 8)"] = faster_whisper_batched(model_dir, clips, "int8")
    results["ours in process, float32 ONNX"] = ours_in_process(repository, clips)
    results["ours in process, int8 encoder + decoder (ORT dynamic)"] = ours_in_process(
        repository, clips, ("whisper_encoder", "whisper_decoder"))
    results["ours in process, int8 encoder only"] = ours_in_process(repository, clips, ("whisper_encoder",))
    load_after = load_average()

    def cell(result: dict | None, key: str):
        return "—" if result is None or result.get(key) != result.get(key) else result[key]

    rows = []
    for name, result in results.items():
        c1, sat = result.get("c1"), result.get("sat")
        rows.append([name, cell(c1, "audio_per_s"), cell(c1, "rtf_p50"), cell(sat, "audio_per_s"),
                     cell(sat, "rtf_p50"), f"{(c1 or sat)['wer']:.1%}"])
    ours_name, fw32_name, fw8_name = "ours: Triton speech_recognition", "faster-whisper float32", "faster-whisper int8"
    ratio = lambda a, b, key: [x[key]["audio_per_s"] / y[key]["audio_per_s"]  # noqa: E731
                               for x, y in zip(rounds[a], rounds[b])]
    per_round = lambda values: " / ".join(f"{v:.0%}" for v in values)  # noqa: E731
    sat32, sat8, c1_32 = ratio(ours_name, fw32_name, "sat"), ratio(ours_name, fw8_name, "sat"), ratio(ours_name, fw32_name, "c1")
    wer_ours, wer_fw32 = results[ours_name]["c1"]["wer"], results[fw32_name]["c1"]["wer"]
    int8 = results["ours in process, int8 encoder + decoder (ORT dynamic)"]
    int8_encoder = results["ours in process, int8 encoder only"]
    fp32_local = results["ours in process, float32 ONNX"]
    names = {"en": "English", "de": "German", "es": "Spanish"}
    counts = ", ".join(f"{names[lang]} {clips.languages.count(lang)}" for lang in dict.fromkeys(clips.languages))
    lines = [
        "## speech_recognition (Whisper base, real weights) vs faster-whisper",
        "",
        f"Clips: the {len(clips.wavs)} sentences of the speech quality tests ({counts}; espeak-ng, "
        f"{min(clips.seconds):.1f}–{max(clips.seconds):.1f} s, {clips.total_seconds:.0f} s in all), each with its "
        "language; the same Whisper base weights (faster-whisper 1.2.1 reads the packages' model.bin, we serve "
        "the ONNX converted from it); greedy, no timestamps, no VAD, no conditioning on earlier text, 2 CPU "
        "threads per system. \"audio s/s\": audio seconds transcribed per wall second (higher is better); "
        f"RTF: median latency / clip duration. Saturation: {SATURATION} requests in flight for Triton, 2 workers "
        "× 1 thread with 2 clips in flight for faster-whisper, batches of 8 for the in-process loop, one "
        "joined file per language for the batched pipeline (its VAD cuts it into segments of several "
        f"sentences, which is why its WER is not comparable: more context per window). The first three rows "
        f"are the mean of {ROUNDS} rounds measured in turn (c=1 then saturation, system after system); the others once.",
        "",
        markdown_table(["system", "c=1 audio s/s", "c=1 RTF", "saturation audio s/s", "saturation RTF", "WER"], rows),
        "",
        f"**Ours / faster-whisper float32 at saturation: {per_round(sat32)}** (round by round; target ≥ 100%); "
        f"at concurrency 1: {per_round(c1_32)}.",
        f"**WER: ours {wer_ours:.1%}, faster-whisper float32 {wer_fw32:.1%}** ({(wer_ours - wer_fw32) * 100:+.1f} points; "
        "target within 1 point). The tokens are identical on the same features (parity test); the difference is "
        "the features: faster-whisper pads the log-mel of a short clip with 0.0, we pad the audio (as Whisper "
        "was trained), see docs/speech.md.",
        f"Distance to faster-whisper int8 at saturation: ours reaches {per_round(sat8)} of its throughput. "
        "Our graphs after ONNX Runtime dynamic int8 quantization, in process, batches of 8: both graphs "
        f"{int8['sat']['audio_per_s'] / fp32_local['sat']['audio_per_s']:.2f}× the float32 graphs' throughput at "
        f"WER {int8['c1']['wer']:.1%}, the encoder alone {int8_encoder['sat']['audio_per_s'] / fp32_local['sat']['audio_per_s']:.2f}× "
        f"at WER {int8_encoder['c1']['wer']:.1%}, against {fp32_local['c1']['wer']:.1%} in float32.",
        "",
        f"Load average (1/5/15 min) before: {load_before}; after: {load_after} (2 cores). This machine is shared: "
        "other engineers' builds and tests ran during the measurement, so absolute numbers are low and noisy; "
        "compare systems within one round.",
    ]
    return "\n".join(lines)


def mean_result(results: list[dict]) -> dict:
    return {"audio_per_s": statistics.mean(r["audio_per_s"] for r in results),
            "rtf_p50": statistics.mean(r["rtf_p50"] for r in results),
            "wer": results[0]["wer"], "texts": results[0]["texts"]}
