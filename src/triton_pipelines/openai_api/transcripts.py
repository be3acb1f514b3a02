"""A transcript of ``/v1/audio/transcriptions`` or ``/translations`` in every ``response_format``
(json, text, verbose_json, srt, vtt) from ``Segment``s (for the formats with times, one per pair of
Whisper's timestamp tokens: docs/openai.md), the stream model's segments read back, and the
streamed events."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Mapping, Sequence

from triton_pipelines.openai_api.protocol import RESPONSE_FORMATS, invalid
from triton_pipelines.pipelines.speech.config import LANGUAGE_NAMES


@dataclass(frozen=True)
class Segment:
    """A stretch of a transcript: its time span in the audio and its text and tokens."""
    start: float
    end: float
    text: str
    tokens: tuple[int, ...] = ()
    words: tuple[dict, ...] = ()  # [{word, start, end}] where word times were asked for


TIMESTAMP_GRANULARITIES = ("segment", "word")


def parse_granularities(fields: Mapping[str, str], response_format: str) -> tuple[str, ...]:
    """``timestamp_granularities[]`` (one part per value, a line each from the multipart reader) as
    OpenAI's API takes it: only with ``verbose_json``; ``segment`` by default."""
    raw = fields.get("timestamp_granularities[]", fields.get("timestamp_granularities"))
    if raw is None:
        return ("segment",)
    values = tuple(dict.fromkeys(v.strip() for line in raw.splitlines() for v in line.split(",") if v.strip()))
    field = "timestamp_granularities[]"
    for value in values:
        if value not in TIMESTAMP_GRANULARITIES:
            raise invalid(f"'{field}' values must be {' or '.join(TIMESTAMP_GRANULARITIES)}, not {value!r}", field)
    if values and response_format != "verbose_json":
        raise invalid(f"'{field}' needs response_format verbose_json, not {response_format}", field)
    return values or ("segment",)


def _timestamp(seconds: float, separator: str) -> str:
    millis = int(round(max(0.0, seconds) * 1000))
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    secs, millis = divmod(millis, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{separator}{millis:03d}"


def format_transcript(response_format: str, text: str, segments: Sequence[Segment], task: str,
                      language: str, duration: float, granularities: Sequence[str] = ("segment",)) -> tuple[str, str]:
    """(body, content type) of a transcript in ``response_format``; verbose_json's ``language`` is
    the language's English name (OpenAI's ``english``), its ``segments`` there with ``segment`` in
    ``granularities``, its ``words`` ([{word, start, end}], the segments' words) with ``word``."""
    if response_format == "json":
        return json.dumps({"text": text}), "application/json"
    if response_format == "text":
        return text + "\n", "text/plain; charset=utf-8"
    shown = [s for s in segments if s.text]
    if response_format == "verbose_json":
        body = {"task": task, "language": LANGUAGE_NAMES.get(language, language), "duration": round(duration, 3),
                "text": text}
        if "segment" in granularities:
            body["segments"] = [{"id": i, "seek": int(round(s.start * 100)), "start": round(s.start, 3),
                                 "end": round(s.end, 3), "text": s.text, "tokens": list(s.tokens), "temperature": 0.0,
                                 "avg_logprob": None, "compression_ratio": None, "no_speech_prob": None}
                                for i, s in enumerate(shown)]
        if "word" in granularities:
            body["words"] = [{"word": w["word"].strip(), "start": w["start"], "end": w["end"]}
                             for s in shown for w in s.words if w["word"].strip()]
        return json.dumps(body), "application/json"
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
    return [Segment(float(s["start"]), float(s["end"]), str(s["text"]), tuple(int(t) for t in s.get("tokens", ())),
                    tuple({"word": str(w["word"]), "start": float(w["start"]), "end": float(w["end"])}
                          for w in s.get("words", ())))
            for s in json.loads(raw)]


def transcript_delta(delta: str) -> dict:
    return {"type": "transcript.text.delta", "delta": delta}


def transcript_done(text: str) -> dict:
    return {"type": "transcript.text.done", "text": text}
