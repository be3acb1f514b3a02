"""FastAPI peer of ``speech_recognition``: POST /transcribe?max_new_tokens=N, body = audio files as a
BYTES tensor's bytes, answer = JSON transcripts and token ids.

Features (decode, resample, log-mel) run on a thread in the request handler; the model thread
batches the 30 s windows of every waiting request (up to 8, whisper_encoder's max batch) through the
same encoder and KV-cached decoder ONNX files with the same greedy loop (``WhisperOnnx``)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np
from fastapi import HTTPException, Request
from fastapi.responses import JSONResponse

from triton_pipelines.errors import InputError
from triton_pipelines.speech import WhisperOnnx, WhisperTokenizer, audio_to_features, join_transcript, load_mel_filters

from .batcher import MicroBatcher
from .common import THREADS, body_items, make_app

REPOSITORY = Path(os.environ["PEER_REPOSITORY"])
MAX_WINDOWS = 8  # whisper_encoder's max_batch_size
DEFAULT_MAX_NEW_TOKENS = 224

whisper = WhisperOnnx(REPOSITORY / "whisper_encoder" / "1" / "model.onnx",
                      REPOSITORY / "whisper_decoder" / "1" / "model.onnx", intra_op_threads=THREADS)
filters = load_mel_filters(REPOSITORY / "audio_features" / "1" / "mel_filters.npz", whisper.shape.n_mels)
tokenizer = WhisperTokenizer.for_vocab_size(REPOSITORY / "whisper_decode" / "1" / "multilingual.tiktoken",
                                            whisper.shape.vocab_size)


def transcribe(requests: list[tuple[list[np.ndarray], int]]) -> list[dict]:
    """requests[i] = (per-clip features [windows, n_mels, 3000], max_new_tokens)."""
    features = [w for clips, _ in requests for clip in clips for w in clip]
    budgets = np.array([n for clips, n in requests for clip in clips for _ in clip], dtype=np.int64)
    prompts = np.array([tokenizer.prompt()] * len(features))
    tokens = whisper.decode_windows(np.stack(features), prompts, tokenizer.eot, budgets)
    answers, position = [], 0
    for clips, _ in requests:
        transcripts, ids = [], []
        for clip in clips:
            windows = tokens[position:position + len(clip)]
            position += len(clip)
            transcripts.append(join_transcript(tokenizer, windows))
            ids.append([t for w in windows for t in w])
        answers.append({"transcript": transcripts, "token_ids": ids})
    return answers


batcher = MicroBatcher(transcribe, max_items=MAX_WINDOWS, size=lambda r: sum(len(c) for c in r[0]))
app = make_app("speech_recognition peer", [batcher])


@app.post("/transcribe")
async def transcribe_endpoint(request: Request, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS) -> JSONResponse:
    audio = await body_items(request, limit=MAX_WINDOWS)
    loop = asyncio.get_running_loop()
    try:
        clips = await loop.run_in_executor(None, lambda: [audio_to_features(a, filters, i) for i, a in enumerate(audio)])
    except InputError as error:
        raise HTTPException(400, str(error)) from None
    if sum(len(c) for c in clips) > MAX_WINDOWS:
        raise HTTPException(400, f"at most {MAX_WINDOWS} 30 s windows per request")
    return JSONResponse(await batcher.submit((clips, max(1, min(max_new_tokens, DEFAULT_MAX_NEW_TOKENS)))))
