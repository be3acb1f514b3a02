"""FastAPI peer of ``speech_recognition``: POST /transcribe?max_new_tokens=N, body = audio files as a
BYTES tensor's bytes, answer = JSON transcripts and token ids.

Features (decode, resample, log-mel) run on a thread in the request handler; the model thread
batches the 30 s windows of every waiting request (up to 8, whisper_encoder's max batch) through the
same encoder and KV-cached decoder ONNX files with the same greedy loop (``WhisperOnnx``)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from fastapi import HTTPException, Request
from fastapi.responses import JSONResponse

from triton_pipelines.errors import InputError

from ..speech_work import Whisper
from .batcher import MicroBatcher
from .common import THREADS, body_items, make_app

REPOSITORY = Path(os.environ["PEER_REPOSITORY"])
MAX_WINDOWS = 8  # whisper_encoder's max_batch_size
DEFAULT_MAX_NEW_TOKENS = 224

whisper = Whisper(REPOSITORY, THREADS)


def transcribe(requests: list[tuple[list, int]]) -> list[dict]:
    """requests[i] = (per-clip features [windows, n_mels, 3000], max_new_tokens)."""
    clips = [clip for features, _ in requests for clip in features]
    budgets = [n for features, n in requests for _ in features]
    answers = iter(whisper.transcribe(clips, budgets))
    results = []
    for features, _ in requests:
        mine = [next(answers) for _ in features]
        results.append({"transcript": [t for t, _ in mine], "token_ids": [ids for _, ids in mine]})
    return results


batcher = MicroBatcher(transcribe, max_items=MAX_WINDOWS, size=lambda r: sum(len(c) for c in r[0]))
app = make_app("speech_recognition peer", [batcher])


@app.post("/transcribe")
async def transcribe_endpoint(request: Request, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS) -> JSONResponse:
    audio = await body_items(request, limit=MAX_WINDOWS)
    loop = asyncio.get_running_loop()
    try:
        clips = await loop.run_in_executor(None, lambda: [whisper.features(a, i) for i, a in enumerate(audio)])
    except InputError as error:
        raise HTTPException(400, str(error)) from None
    if sum(len(c) for c in clips) > MAX_WINDOWS:
        raise HTTPException(400, f"at most {MAX_WINDOWS} 30 s windows per request")
    return JSONResponse(await batcher.submit((clips, max(1, min(max_new_tokens, DEFAULT_MAX_NEW_TOKENS)))))
