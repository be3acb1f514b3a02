"""FastAPI peer of ``image_classification``: POST /classify, body = encoded images as a BYTES
tensor's bytes, answer = JSON top-5 (labels, scores, class ids) per image.

Decoding and preprocessing run on a 2-thread pool in the request handler (the served
image_preprocess's decode_threads), concurrently with the model thread, which batches the pixels
of whatever requests are waiting into one ONNX Runtime call: a pipeline, as Triton's ensemble is."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np
from fastapi import HTTPException, Request
from fastapi.responses import JSONResponse

from triton_pipelines.errors import InputError
from triton_pipelines.pipelines.onnx_runner import OnnxBatchRunner
from triton_pipelines.pipelines.vision import Classifier, ImagePreprocessor, PreprocessConfig, load_labels

from .batcher import MicroBatcher
from .common import THREADS, body_items, make_app

REPOSITORY = Path(os.environ["PEER_REPOSITORY"])
MAX_BATCH = 32  # resnet50's max_batch_size
TOP_K = 5

preprocessor = ImagePreprocessor(PreprocessConfig(), threads=THREADS)
runner = OnnxBatchRunner(REPOSITORY / "resnet50" / "1" / "model.onnx", intra_op_threads=THREADS,
                         output_names=["logits"])
classifier = Classifier(load_labels(REPOSITORY / "classification_postprocess" / "1" / "labels.txt"))


def classify(requests: list[np.ndarray]) -> list[dict]:
    pixels = requests[0] if len(requests) == 1 else np.concatenate(requests)
    (out,) = runner.run([{"pixel_values": pixels}])
    labels, scores, class_ids = classifier.classify(out["logits"], TOP_K)
    offsets = np.cumsum([0] + [len(r) for r in requests])
    return [{"labels": [[x.decode() for x in row] for row in labels[a:b]], "scores": scores[a:b].tolist(),
             "class_ids": class_ids[a:b].tolist()} for a, b in zip(offsets[:-1], offsets[1:])]


batcher = MicroBatcher(classify, max_items=MAX_BATCH, size=len)
app = make_app("image_classification peer", [batcher])


@app.post("/classify")
async def classify_endpoint(request: Request) -> JSONResponse:
    images = await body_items(request, limit=MAX_BATCH)
    loop = asyncio.get_running_loop()
    result = await loop.run_in_executor(None, preprocessor.run, [np.array(images, dtype=object)])
    (pixels,) = result.outputs
    if isinstance(pixels, InputError):
        raise HTTPException(400, str(pixels))
    return JSONResponse(await batcher.submit(pixels))
