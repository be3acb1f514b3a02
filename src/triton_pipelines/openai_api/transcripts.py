"""A transcript of ``/v1/audio/transcriptions`` or ``/translations`` in every ``response_format``
(json, text, verbose_json, srt, vtt) from ``Segment``s (one per Whisper window of at most 30 s, cut
in pauses: docs/openai.md), the stream model's segments read back, and the streamed events."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Sequence

from triton_pipelines.openai_api.protocol import RESPONSE_FORMATS, invalid


@dataclass(frozen=True)
class Segment:
    """One Whisper window of a transcript: its time span in the audio and its text and tokens."""
    start: float
    end: float
    text: str
    tokens: tuple[int, ...] = ()


LANGUAGE_NAMES = {"en": "english", "de": "german", "es": "spanish", "fr": "french", "it": "italian",
                  "pt": "portuguese", "nl": "dutch", "ja": "japanese", "zh": "chinese", "ru": "russian"}


def _timestamp(seconds: float, separator: str) -> str:
    millis = int(round(max(0.0, seconds) * 1000))
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    secs, millis = divmod(millis, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{separator}{millis:03d}"


def format_transcript(response_format: str, text: str, segments: Sequence[Segment], task: str,
                      language: str, duration: float) -> tuple[str, str]:
    """(body, content type) of a transcript in ``response_format``."""
    if response_format == "json":
        return json.dumps({"text": text}), "application/json"
    if response_format == "text":
        return text + "\n", "text/plain; charset=utf-8"
    shown = [s for s in segments if s.text]
    if response_format == "verbose_json":
        return json.dumps({
            "task": task, "language": LANGUAGE_NAMES.get(language, language), "duration": round(duration, 3),
            "text": text,
            "segments": [{"id": i, "seek": int(round(s.start * 100)), "start": round(s.start, 3),
                          "end": round(s.end, 3), "text": s.text, "tokens": list(s.tokens), "temperature": 0.0,
                          "avg_logprob": None, "compression_ratio": None, "no_speech_prob": None}
                         for i, s in enumerate(shown)]}), "application/json"
    if response_format == "srt":
        blocks = [f"{i + 1}\n{_timestamp(s.start, ',')} --> {_timestamp(s.end, ',')}\n{s.text}\n"
                  for i, s in enumerate(shown)]
        return "\n".join(blocks), "text/plain; charset=utf-8"
    if response_format == "vtt":
        blocks = [f"{_timestamp(s.start, '.')} --> {_timestamp(s.end, '.')}\n{s.text}\n" for s in shown]
        return "WEBVTT\n\n" + "\n".join(blocks), "text/vtt; charset=utf-8"
    raise invalid(f"'response_format' must be one of {', '.join(RESPONSE_FORMATS)}", "response_format")


def parse_segments(raw: bytes | str) -> list[Segment]:
    """The ``segments`` output of ``speech_recognition_stream`` (JSON list of {start, end, text, tokens})."""
    return [Segment(float(s["start"]), float(s["end"]), str(s["text"]), tuple(int(t) for t in s.get("tokens", ())))
            for s in json.loads(raw)]


def transcript_delta(delta: str) -> dict:
    return {"type": "transcript.text.delta", "delta": delta}


def transcript_done(text: str) -> dict:
    return {"type": "transcript.text.done", "text": text}
