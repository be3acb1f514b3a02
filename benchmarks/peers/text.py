"""FastAPI peer of ``text_embedding``: POST /embed, body = texts as a BYTES tensor's bytes, answer =
float32 [n, 384] embeddings, raw little-endian. Tokenizer, ONNX file (pooling in the graph), threads
and the length grouping as served.

The batcher tokenizes each request as the served tokenizer does and runs the whole micro-batch as
one call of the same runner the embedded target serves with: rows sorted by their own length and
cut into runs of similar length (``onnx_runner.LengthGrouping``), as a careful engineer does on a
CPU, where padding costs compute (attention quadratically).

With ``PEER_ENCODE_MODEL=<encoder>`` (e.g. bert_base_encoder, for the tutorial table) the peer also
serves POST /encode?batch=B&length=L: body = int64 input_ids then attention_mask [B, L] (the bytes of
Triton's binary tensors), answer = float32 last_hidden_state [B, L, hidden], raw."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from fastapi import HTTPException, Request, Response

from triton_pipelines.pipelines.onnx_runner import LengthGrouping, OnnxBatchRunner
from triton_pipelines.pipelines.text import TextTokenizer

from .batcher import MicroBatcher
from .common import THREADS, body_items, make_app

REPOSITORY = Path(os.environ["PEER_REPOSITORY"])
MAX_BATCH = 64  # text_encoder's max_batch_size

tokenizer = TextTokenizer.served(REPOSITORY / "text_tokenizer")
runner = OnnxBatchRunner(REPOSITORY / "text_encoder" / "1" / "model.onnx", intra_op_threads=THREADS,
                         output_names=["embedding"], length_grouping=LengthGrouping.served(REPOSITORY / "text_encoder"))


def embed(requests: list[list[str]]) -> list[np.ndarray]:
    feeds = []
    for texts in requests:
        tokens = tokenizer.encode(texts)
        feeds.append({"input_ids": tokens.input_ids, "attention_mask": tokens.attention_mask})
    return [out["embedding"] for out in runner.run(feeds)]


batcher = MicroBatcher(embed, max_items=MAX_BATCH, size=len)
batchers = [batcher]

ENCODE_MODEL = os.environ.get("PEER_ENCODE_MODEL")
if ENCODE_MODEL:
    encode_runner = OnnxBatchRunner(REPOSITORY / ENCODE_MODEL / "1" / "model.onnx", intra_op_threads=THREADS,
                                    output_names=["last_hidden_state"])

    def encode(requests: list[dict]) -> list[np.ndarray]:
        return [out["last_hidden_state"] for out in encode_runner.run(requests)]

    encode_batcher = MicroBatcher(encode, max_items=MAX_BATCH, size=lambda r: len(r["input_ids"]))
    batchers.append(encode_batcher)

app = make_app("text_embedding peer", batchers)


@app.post("/embed")
async def embed_endpoint(request: Request) -> Response:
    texts = [item.decode("utf-8", errors="replace") for item in await body_items(request)]
    embeddings = await batcher.submit(texts)
    return Response(embeddings.astype("<f4").tobytes(), media_type="application/octet-stream")


if ENCODE_MODEL:
    @app.post("/encode")
    async def encode_endpoint(request: Request, batch: int, length: int) -> Response:
        body = await request.body()
        if not 0 < batch <= MAX_BATCH or length <= 0 or len(body) != 2 * batch * length * 8:
            raise HTTPException(400, f"expected 2 x {batch} x {length} int64 values")
        ids = np.frombuffer(body, "<i8").reshape(2, batch, length)
        hidden = await encode_batcher.submit({"input_ids": ids[0], "attention_mask": ids[1]})
        return Response(np.ascontiguousarray(hidden, "<f4").tobytes(), media_type="application/octet-stream")
