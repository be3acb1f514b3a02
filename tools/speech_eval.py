"""Speech made at run time, and word error rate: what the speech quality tests and the benchmark
measure transcripts with.

Clips are spoken by Debian's ``espeak-ng`` (a robotic but deterministic voice: no recordings to
ship, no download). ``CORPUS`` holds the sentences (English, German, Spanish: the non-English
languages where Whisper base understands espeak-ng best) with an English translation of each
non-English one. ``word_errors`` aligns a hypothesis with its reference (Levenshtein over
normalized words) and counts substitutions, deletions and insertions.
"""

from __future__ import annotations

import io
import re
import shutil
import subprocess
import unicodedata
from dataclasses import dataclass
from typing import Sequence

import numpy as np

ESPEAK_VOICES = {"en": "en-us", "de": "de", "es": "es"}
# Words per minute and the extra gap between words (10 ms units): a clear, slightly slow voice.
ESPEAK_RATE = 140
ESPEAK_WORD_GAP = 3
# Silence between the sentences of a long clip.
SENTENCE_GAP_SECONDS = 0.6


@dataclass(frozen=True)
class Sentence:
    language: str
    text: str
    english: str = ""  # the translation, for non-English sentences


CORPUS: tuple[Sentence, ...] = (
    Sentence("en", "Please send the report to my office before noon."),
    Sentence("en", "The weather is nice today, so we will walk to the park."),
    Sentence("en", "I would like to book a table for two people tonight."),
    Sentence("en", "My computer does not start after the last update."),
    Sentence("en", "Can you tell me where the nearest train station is?"),
    Sentence("en", "She bought fresh bread and a bottle of milk at the market."),
    Sentence("en", "How do I reset my password?"),
    Sentence("en", "I was charged twice for the same order this month."),
    Sentence("en", "The children are playing in the garden after school."),
    Sentence("en", "We need more time to finish the project."),
    Sentence("en", "Turn left at the next corner and drive straight ahead."),
    Sentence("en", "Thank you very much for your help yesterday."),
    Sentence("de", "Ich möchte gerne einen Kaffee mit Milch bestellen.", "I would like to order a coffee with milk."),
    Sentence("de", "Das Wetter ist heute sehr schön.", "The weather is very nice today."),
    Sentence("de", "Wo ist der nächste Bahnhof?", "Where is the nearest train station?"),
    Sentence("de", "Meine Mutter kocht jeden Sonntag eine Suppe.", "My mother cooks a soup every Sunday."),
    Sentence("de", "Können Sie mir bitte helfen?", "Can you help me, please?"),
    Sentence("de", "Wir fahren morgen mit dem Auto nach Hamburg.", "Tomorrow we are driving to Hamburg by car."),
    Sentence("es", "Me gustaría reservar una mesa para esta noche.", "I would like to book a table for tonight."),
    Sentence("es", "El tren sale de la estación por la mañana.", "The train leaves the station in the morning."),
    Sentence("es", "Mañana vamos a visitar a nuestros amigos en Madrid.", "Tomorrow we are going to visit our friends in Madrid."),
    Sentence("es", "¿Dónde está el hospital más cercano?", "Where is the nearest hospital?"),
    Sentence("es", "Mi hermana trabaja en una escuela pequeña.", "My sister works in a small school."),
    Sentence("es", "Hace mucho calor en el verano.", "It is very hot in the summer."),
)


def espeak_available() -> bool:
    return shutil.which("espeak-ng") is not None


def speak(text: str, language: str = "en") -> bytes:
    """``text`` spoken by espeak-ng in ``language``'s voice → WAV bytes (22.05 kHz, 16-bit mono)."""
    if not espeak_available():
        raise RuntimeError("espeak-ng is not installed: `make test` installs it (apt-get install espeak-ng)")
    command = ["espeak-ng", "-v", ESPEAK_VOICES[language], "-s", str(ESPEAK_RATE), "-g", str(ESPEAK_WORD_GAP),
               "--stdout", text]
    return subprocess.run(command, capture_output=True, check=True).stdout


def wav_samples(data: bytes) -> tuple[np.ndarray, int]:
    import soundfile

    samples, rate = soundfile.read(io.BytesIO(data), dtype="float32")
    return samples, rate


def join_clips(clips: Sequence[bytes], gap_seconds: float | Sequence[float] = SENTENCE_GAP_SECONDS) -> tuple[bytes, list[float]]:
    """WAV clips of one rate → one WAV with ``gap_seconds`` of silence between them (a sequence:
    its gaps in turn, cycled), and the start time (s) of each clip in it."""
    import soundfile

    parts, starts, position, rate = [], [], 0, None
    for clip in clips:
        samples, clip_rate = wav_samples(clip)
        if rate is not None and clip_rate != rate:
            raise ValueError("join_clips needs clips of one sample rate")
        rate = clip_rate
        if parts:
            seconds = gap_seconds if isinstance(gap_seconds, (int, float)) else gap_seconds[(len(starts) - 1) % len(gap_seconds)]
            gap = np.zeros(int(seconds * rate), np.float32)
            parts.append(gap)
            position += len(gap)
        starts.append(position / rate)
        parts.append(samples)
        position += len(samples)
    buffer = io.BytesIO()
    soundfile.write(buffer, np.concatenate(parts), rate, subtype="PCM_16", format="WAV")
    return buffer.getvalue(), starts


def normalize_words(text: str) -> list[str]:
    """Lower case, accents kept, punctuation dropped (apostrophes inside words kept), hyphens
    split: the words that WER counts."""
    text = unicodedata.normalize("NFC", text.lower()).replace("-", " ")
    text = re.sub(r"[^\w\s']", " ", text)
    return [word.strip("'") for word in text.split() if word.strip("'")]


@dataclass(frozen=True)
class WordErrors:
    reference: tuple[str, ...]
    hypothesis: tuple[str, ...]
    # (op, reference index, hypothesis index) for each word of the alignment; op is "=", "sub",
    # "del" (reference word missing) or "ins" (extra word; reference index: the next reference word)
    alignment: tuple[tuple[str, int, int], ...]

    def count(self, op: str) -> int:
        return sum(1 for item in self.alignment if item[0] == op)

    @property
    def errors(self) -> int:
        return self.count("sub") + self.count("del") + self.count("ins")

    @property
    def wer(self) -> float:
        return self.errors / max(1, len(self.reference))


def word_errors(reference: str, hypothesis: str) -> WordErrors:
    """Minimum-edit alignment of the normalized words (ties prefer substitution)."""
    ref, hyp = normalize_words(reference), normalize_words(hypothesis)
    rows, cols = len(ref) + 1, len(hyp) + 1
    cost = np.zeros((rows, cols), dtype=np.int64)
    cost[:, 0], cost[0, :] = np.arange(rows), np.arange(cols)
    for i in range(1, rows):
        for j in range(1, cols):
            cost[i, j] = min(cost[i - 1, j - 1] + (ref[i - 1] != hyp[j - 1]), cost[i - 1, j] + 1, cost[i, j - 1] + 1)
    alignment, i, j = [], len(ref), len(hyp)
    while i or j:
        if i and j and cost[i, j] == cost[i - 1, j - 1] + (ref[i - 1] != hyp[j - 1]):
            alignment.append(("=" if ref[i - 1] == hyp[j - 1] else "sub", i - 1, j - 1))
            i, j = i - 1, j - 1
        elif i and cost[i, j] == cost[i - 1, j] + 1:
            alignment.append(("del", i - 1, j))
            i -= 1
        else:
            alignment.append(("ins", i, j - 1))
            j -= 1
    return WordErrors(tuple(ref), tuple(hyp), tuple(reversed(alignment)))


def corpus_wer(pairs: Sequence[tuple[str, str]]) -> float:
    """Overall WER of (reference, hypothesis) pairs: all errors over all reference words."""
    results = [word_errors(reference, hypothesis) for reference, hypothesis in pairs]
    return sum(r.errors for r in results) / max(1, sum(len(r.reference) for r in results))


class FasterWhisperGreedy:
    """faster-whisper (CTranslate2) on the same weights, decoding greedily with its own defaults'
    suppression (``suppress_blank=True``, ``suppress_tokens=[-1]``) and no timestamps: the
    parity reference (``tokens``: on given features) and the benchmark's competitor
    (``transcribe``: its whole pipeline, features included)."""

    def __init__(self, model_dir, compute_type: str = "float32", cpu_threads: int = 0, num_workers: int = 1):
        from faster_whisper import WhisperModel

        self.model = WhisperModel(str(model_dir), device="cpu", compute_type=compute_type, cpu_threads=cpu_threads,
                                  num_workers=num_workers, local_files_only=True)

    def tokens(self, features: np.ndarray, languages: Sequence[str], task: str = "transcribe",
               max_new_tokens: int = 224, timestamps: bool = False) -> list[list[int]]:
        """``features [N, n_mels, 3000]`` (one window each) → the generated ids per window (with
        ``timestamps``: its timestamp tokens too, under CTranslate2's timestamp rules)."""
        import ctranslate2
        from faster_whisper.tokenizer import Tokenizer
        from faster_whisper.transcribe import get_suppressed_tokens

        prompts, suppress = [], set()
        for language in languages:  # the suppressed tokens do not depend on the language
            tokenizer = Tokenizer(self.model.hf_tokenizer, True, task=task, language=language)
            prompts.append(self.model.get_prompt(tokenizer, [], without_timestamps=not timestamps))
            suppress.update(get_suppressed_tokens(tokenizer, [-1]))
        results = self.model.model.generate(
            ctranslate2.StorageView.from_array(np.ascontiguousarray(features, dtype=np.float32)), prompts,
            beam_size=1, max_length=len(prompts[0]) + max_new_tokens, suppress_blank=True,
            suppress_tokens=sorted(suppress))
        eot = self.model.hf_tokenizer.token_to_id("<|endoftext|>")
        return [[t for t in result.sequences_ids[0] if t != eot] for result in results]

    def languages(self, features: np.ndarray) -> list[str]:
        """``features [N, n_mels, 3000]`` → each window's most probable language code
        (CTranslate2's ``detect_language``: the language tokens' probabilities after
        ``<|startoftranscript|>``)."""
        import ctranslate2

        results = self.model.model.detect_language(
            ctranslate2.StorageView.from_array(np.ascontiguousarray(features, dtype=np.float32)))
        return [result[0][0][2:-2] for result in results]

    def transcribe(self, audio: np.ndarray, language: str = "en", **options) -> str:
        """16 kHz mono samples → text, greedy, no timestamps, no conditioning on earlier windows."""
        settings = dict(language=language, beam_size=1, temperature=0.0, without_timestamps=True,
                        condition_on_previous_text=False, vad_filter=False)
        settings.update(options)
        segments, _ = self.model.transcribe(audio, **settings)
        return " ".join(segment.text.strip() for segment in segments).strip()
