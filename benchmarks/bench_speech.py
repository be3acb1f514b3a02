"""speech_recognition (real Whisper base) through Triton next to faster-whisper on the same
weights, the same clips and the same cores.

Two jobs, each with its WER:

1. **Mixed-length clips** (``Clips``): the sentences of the speech corpus (``tools.speech_eval``:
   English, German, Spanish, spoken by espeak-ng) joined in runs of 1 to 5 (0.6 s apart), 3–25 s
   each, each sent with its language. Ours (the ``speech_recognition`` ensemble over gRPC, one
   clip per request: concurrency 1, and ``SATURATION`` requests in flight), faster-whisper float32
   and int8 (``WhisperModel.transcribe``: one model with 2 threads for concurrency 1,
   ``num_workers=2`` × 1 thread with 2 clips in flight at saturation) are measured in turn
   ``ROUNDS`` times (after one untimed pass of each at saturation: the first requests of new
   batch shapes cost more), so that the load of the shared machine drifts across them alike; the
   report gives the ratios round by round.
2. **One long file** (``LongFile``): the English sentences three times over, pauses of 0.6 s and
   2.5 s in turn (about 3 minutes). Ours: one request with ``vad_filter`` true (VAD packs the speech
   into full windows, decoded together), the same with the default VAD mode (``windows``: the
   windows cut in pauses that hold speech) and with ``vad_filter`` false (no VAD);
   faster-whisper's ``BatchedInferencePipeline`` (batch 8, its VAD packing the same way), int8 and
   float32.

Plus our graphs in process (the same greedy loop, batches of 8 clips): float32, and the encoder
quantized as the builder's ``--whisper-int8`` quantizes it (``repo_builder.export.whisper``).
Every system decodes greedily without timestamps, without conditioning on earlier text; ours and
ours with its default VAD mode and the batched pipeline with its VAD, faster-whisper's ``transcribe``
without (its default).
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
from triton_pipelines.pipelines.speech.config import DEFAULT_VAD_MODE, SAMPLE_RATE
from triton_pipelines.pipelines.speech.features import audio_to_features, load_mel_filters, vad_arguments
from triton_pipelines.pipelines.speech.jobs import group_windows, join_transcript
from triton_pipelines.pipelines.speech.reference import WhisperOnnx
from triton_pipelines.pipelines.speech.tokenizer import WhisperTokenizer
from triton_pipelines.pipelines.speech.vad import VAD_MODEL_FILE, SileroVad
from tools.speech_eval import CORPUS, FasterWhisperGreedy, corpus_wer, join_clips, speak

from .perf import BENCH_DIR, markdown_table

ROOT = Path(__file__).resolve().parents[1]
SATURATION = 8  # requests in flight for our pipeline (whisper_decode batches up to 8)
THREADS = 2
ROUNDS = 2
# Each language's sentences joined in runs of these many: clips of 3–25 s.
RUNS = {"en": (1, 2, 3, 5, 1), "de": (1, 2, 3), "es": (1, 2, 3)}
LONG_FILE_REPEATS = 3
LONG_FILE_GAPS = (0.6, 2.5)
BATCHED_SIZE = 8


def load_average() -> str:
    return " / ".join(f"{value:.2f}" for value in os.getloadavg())


class Clips:
    """The mixed-length clips: WAV bytes, 16 kHz samples, durations, languages, reference texts."""

    def __init__(self):
        self.wavs, self.languages, self.references = [], [], []
        for language, runs in RUNS.items():
            sentences = [s.text for s in CORPUS if s.language == language]
            at = 0
            for count in runs:
                group, at = sentences[at:at + count], at + count
                self.wavs.append(join_clips([speak(text, language) for text in group])[0])
                self.languages.append(language)
                self.references.append(" ".join(group))
        self.audio = [decode_audio(wav) for wav in self.wavs]  # 16 kHz mono, what everyone decodes
        self.seconds = [len(a) / SAMPLE_RATE for a in self.audio]

    @property
    def total_seconds(self) -> float:
        return sum(self.seconds)


class LongFile:
    """One English file of a few minutes, with its reference text."""

    def __init__(self):
        sentences = [s.text for s in CORPUS if s.language == "en"] * LONG_FILE_REPEATS
        self.wav = join_clips([speak(text) for text in sentences], gap_seconds=LONG_FILE_GAPS)[0]
        self.audio = decode_audio(self.wav)
        self.seconds = len(self.audio) / SAMPLE_RATE
        self.reference = " ".join(sentences)


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

    def client(self) -> TritonClient:
        client = getattr(self.local, "client", None)
        if client is None:
            client = self.local.client = TritonClient("grpc", self.server.grpc_url)
            self.clients.append(client)
        return client

    def infer(self, wav: bytes, language: str, vad_filter: bool | None = None) -> str:
        inputs = {"audio": text_tensor([wav]), "language": text_tensor([language])}
        if vad_filter is not None:
            inputs["vad_filter"] = np.array([[vad_filter]])
        return self.client().infer(self.model, inputs)["transcript"][0, 0].decode()

    def transcribe(self, index: int) -> str:
        return self.infer(self.clips.wavs[index], self.clips.languages[index])

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


def ours_in_process(repository: Path, clips: Clips, encoder: Path | None = None, rows_per_run: int = 0) -> dict:
    """Our graphs (``encoder`` instead of the served one) in our greedy loop, in process, with
    the served VAD windowing, one clip at a time and in batches of 8 clips; ``rows_per_run``: the
    encoder's windows per call (1 for the int8 encoder, as the embedded target runs it)."""
    encoder = encoder or repository / "whisper_encoder" / "1" / "model.onnx"
    whisper = WhisperOnnx(encoder, repository / "whisper_decoder" / "1" / "model.onnx", intra_op_threads=THREADS,
                          encoder_rows_per_run=rows_per_run)
    filters = load_mel_filters(repository / "audio_features" / "1" / "mel_filters.npz", whisper.shape.n_mels)
    tokenizer = WhisperTokenizer(repository / "whisper_decode" / "1" / "multilingual.tiktoken")
    vad = SileroVad(repository / "audio_features" / "1" / VAD_MODEL_FILE)

    def run(indices: list[int]) -> list[str]:
        features = [audio_to_features(clips.wavs[i], filters, **vad_arguments(DEFAULT_VAD_MODE, vad)) for i in indices]
        prompts = np.array([tokenizer.prompt(clips.languages[i]) for i, f in zip(indices, features) for _ in f])
        tokens = whisper.decode_windows(np.concatenate(features), prompts, tokenizer, 224)
        return [join_transcript(tokenizer, item) for item in group_windows(tokens, [len(f) for f in features])]

    run([0])  # warm-up
    result = {"c1": measure(clips, lambda i: run([i])[0], 1)}
    texts, started = [], time.perf_counter()
    for start in range(0, len(clips.wavs), 8):
        texts += run(list(range(start, min(start + 8, len(clips.wavs)))))
    wall = time.perf_counter() - started
    result["sat"] = {"audio_per_s": clips.total_seconds / wall, "rtf_p50": float("nan"),
                     "wer": corpus_wer(list(zip(clips.references, texts))), "texts": texts}
    return result


def served_int8(repository: Path) -> bool:
    """Whether the repository was built with ``--whisper-int8`` (its provenance says so)."""
    from repo_builder.export.whisper import ENCODER_INT8_NOTE

    return ENCODER_INT8_NOTE in (repository / "whisper_encoder" / "config.pbtxt").read_text()


def encoders(repository: Path) -> tuple[Path, Path]:
    """The float32 and the int8 encoder (as ``--whisper-int8`` quantizes it): the served one, the
    other made under .bench/ (quantized from the served float32, or exported from the packaged
    weights when the served one is int8)."""
    from repo_builder.export.whisper import WhisperSource, export_encoder, quantize_encoder

    served = repository / "whisper_encoder" / "1" / "model.onnx"
    other = BENCH_DIR / ("whisper-float32" if served_int8(repository) else "whisper-int8") / "whisper_encoder.onnx"
    other.parent.mkdir(parents=True, exist_ok=True)
    if not other.exists() or other.stat().st_mtime < served.stat().st_mtime:
        if served_int8(repository):
            export_encoder(WhisperSource("pretrained"), other)
        else:
            quantize_encoder(served, other)
    return (other, served) if served_int8(repository) else (served, other)


def long_file_ours(ours: Ours, long: LongFile, vad_filter: bool | None) -> dict:
    ours.infer(long.wav, "en", vad_filter)  # warm-up (and the same windows twice)
    started = time.perf_counter()
    text = ours.infer(long.wav, "en", vad_filter)
    wall = time.perf_counter() - started
    return {"audio_per_s": long.seconds / wall, "wer": corpus_wer([(long.reference, text)])}


def long_file_batched(model_dir: Path, long: LongFile, compute_type: str) -> dict:
    from faster_whisper import BatchedInferencePipeline, WhisperModel

    model = WhisperModel(str(model_dir), device="cpu", compute_type=compute_type, cpu_threads=THREADS,
                         local_files_only=True)
    pipeline = BatchedInferencePipeline(model)
    options = dict(language="en", batch_size=BATCHED_SIZE, beam_size=1, temperature=0.0, without_timestamps=True,
                   condition_on_previous_text=False)
    list(pipeline.transcribe(long.audio[:SAMPLE_RATE * 30], **options)[0])  # warm-up
    started = time.perf_counter()
    text = " ".join(segment.text.strip() for segment in pipeline.transcribe(long.audio, **options)[0])
    wall = time.perf_counter() - started
    return {"audio_per_s": long.seconds / wall, "wer": corpus_wer([(long.reference, text)])}


MAIN = ("ours: Triton speech_recognition", "faster-whisper float32", "faster-whisper int8")
PACKED = "ours, vad_filter true (speech packed)"


def measure_all(server, repository: Path, model_dir: Path, clips: Clips, long: LongFile) -> dict:
    """Every measurement of the report, in the order the docstring gives."""
    systems = {MAIN[0]: Ours(server, clips), MAIN[1]: FasterWhisper(model_dir, clips, "float32"),
               MAIN[2]: FasterWhisper(model_dir, clips, "int8")}
    rounds = {name: [] for name in systems}
    for system in systems.values():  # every system once at saturation, untimed: batch shapes seen
        system.run(SATURATION)
    for _ in range(ROUNDS):
        for name, system in systems.items():
            rounds[name].append({"c1": system.run(1), "sat": system.run(SATURATION)})
    long_results = {PACKED: long_file_ours(systems[MAIN[0]], long, True),
                    f"ours, default (VAD mode {DEFAULT_VAD_MODE})": long_file_ours(systems[MAIN[0]], long, None),
                    "ours, vad_filter false": long_file_ours(systems[MAIN[0]], long, False)}
    for system in systems.values():
        system.close()
    del systems
    for compute_type in ("int8", "float32"):
        long_results[f"faster-whisper {compute_type} batched (batch {BATCHED_SIZE})"] = long_file_batched(
            model_dir, long, compute_type)
    float32, int8 = encoders(repository)
    in_process = {"ours in process, float32 ONNX": ours_in_process(repository, clips, float32),
                  "ours in process, int8 encoder (--whisper-int8)": ours_in_process(repository, clips, int8, 1)}
    return {"rounds": rounds, "long": long_results, "in_process": in_process}


def mean_result(results: list[dict]) -> dict:
    return {"audio_per_s": statistics.mean(r["audio_per_s"] for r in results),
            "rtf_p50": statistics.mean(r["rtf_p50"] for r in results),
            "wer": results[0]["wer"], "texts": results[0]["texts"]}


def cell(result: dict | None, key: str):
    return "—" if result is None or result.get(key) != result.get(key) else result[key]


def report(measured: dict, clips: Clips, long: LongFile, repository: Path, loads: tuple[str, str]) -> str:
    rounds, long_results = measured["rounds"], measured["long"]
    results = {name: {key: mean_result([r[key] for r in runs]) for key in ("c1", "sat")} for name, runs in rounds.items()}
    results.update(measured["in_process"])
    rows = [[name, cell(r["c1"], "audio_per_s"), cell(r["c1"], "rtf_p50"), cell(r["sat"], "audio_per_s"),
             cell(r["sat"], "rtf_p50"), f"{r['c1']['wer']:.1%}"] for name, r in results.items()]
    long_rows = [[name, r["audio_per_s"], f"{r['wer']:.1%}"] for name, r in long_results.items()]
    ratio = lambda a, b, key: [x[key]["audio_per_s"] / y[key]["audio_per_s"]  # noqa: E731
                               for x, y in zip(rounds[a], rounds[b])]
    per_round = lambda values: " / ".join(f"{v:.0%}" for v in values)  # noqa: E731
    wer = {name: results[name]["c1"]["wer"] for name in MAIN}
    ours_long, batched = long_results[PACKED], long_results[f"faster-whisper int8 batched (batch {BATCHED_SIZE})"]
    built_int8 = served_int8(repository)
    fp32, int8 = measured["in_process"].values()
    return "\n".join([
        "## speech_recognition (Whisper base, real weights) vs faster-whisper",
        "",
        f"Mixed-length clips: the {len(CORPUS)} corpus sentences (espeak-ng; English, German, Spanish) joined in "
        f"runs of 1–5, {len(clips.wavs)} clips of {min(clips.seconds):.1f}–{max(clips.seconds):.1f} s "
        f"({clips.total_seconds:.0f} s in all), each with its language; the same Whisper base weights "
        "(faster-whisper 1.2.1 reads the packages' model.bin, we serve the ONNX converted from it"
        f"{', encoder int8 (--whisper-int8)' if built_int8 else ''}); greedy, no timestamps, no conditioning "
        "on earlier text, 2 CPU threads per system; ours with its default VAD mode, faster-whisper's transcribe "
        "without (its default). \"audio s/s\": audio seconds transcribed per wall second; RTF: median "
        f"latency / clip duration. Saturation: {SATURATION} requests in flight for ours, 2 workers × 1 thread "
        "with 2 clips in flight for faster-whisper, batches of 8 clips in process. The first three rows are "
        f"the mean of {ROUNDS} rounds measured in turn; the others once.",
        "",
        markdown_table(["system", "c=1 audio s/s", "c=1 RTF", "saturation audio s/s", "saturation RTF", "WER"], rows),
        "",
        f"**Ours / faster-whisper int8 at saturation: {per_round(ratio(MAIN[0], MAIN[2], 'sat'))}** (round by "
        f"round; target ≥ 100%); ours / float32: {per_round(ratio(MAIN[0], MAIN[1], 'sat'))}; at concurrency 1: "
        f"{per_round(ratio(MAIN[0], MAIN[2], 'c1'))} of int8, {per_round(ratio(MAIN[0], MAIN[1], 'c1'))} of float32.",
        f"**WER: ours {wer[MAIN[0]]:.1%}, faster-whisper float32 {wer[MAIN[1]]:.1%}, int8 {wer[MAIN[2]]:.1%}** "
        f"({(wer[MAIN[0]] - wer[MAIN[1]]) * 100:+.1f} points against float32; target within 1 point).",
        f"In process, batches of 8: the int8 encoder runs {int8['sat']['audio_per_s'] / fp32['sat']['audio_per_s']:.2f}× "
        f"the float32 graphs' throughput at WER {int8['c1']['wer']:.1%} (float32 {fp32['c1']['wer']:.1%}).",
        "",
        f"One long file: the English sentences {LONG_FILE_REPEATS} times over, pauses of "
        f"{' and '.join(f'{g:g}' for g in LONG_FILE_GAPS)} s in turn ({long.seconds:.0f} s), one request for ours "
        "(after one warm-up request of the same file), one transcribe call for the batched pipeline:",
        "",
        markdown_table(["system", "audio s/s", "WER"], long_rows),
        "",
        f"**Ours / BatchedInferencePipeline int8 (batch {BATCHED_SIZE}): {ours_long['audio_per_s'] / batched['audio_per_s']:.0%}** "
        f"(target ≥ 80%); WER {ours_long['wer']:.1%} against {batched['wer']:.1%} "
        f"({(ours_long['wer'] - batched['wer']) * 100:+.1f} points; target within 2).",
        "",
        f"Load average (1/5/15 min) before: {loads[0]}; after: {loads[1]} (2 cores). This machine is shared: "
        "other engineers' builds and tests ran during the measurement, so absolute numbers are low and noisy; "
        "compare systems within one round.",
    ])


def run(server) -> str:
    from repo_builder.ct2_whisper import write_ctranslate2_dir

    repository = Path(server.options.model_repository)
    clips, long = Clips(), LongFile()
    model_dir = write_ctranslate2_dir(BENCH_DIR / "faster-whisper-base")
    before = load_average()
    measured = measure_all(server, repository, model_dir, clips, long)
    return report(measured, clips, long, repository, (before, load_average()))
