"""``POST /v1/embeddings``: at most the pipeline's max batch (64) strings per ``text_embedding``
request, over Triton's HTTP port when it is given (``triton_http.py``), else its gRPC port."""

from __future__ import annotations

import asyncio

import numpy as np

from triton_pipelines.limits import TEXT_MAX_BATCH
from triton_pipelines.openai_api import protocol as proto
from triton_pipelines.openai_api.replies import json_body
from triton_pipelines.openai_api.triton_grpc import Triton, bytes_request, triton_error
from triton_pipelines.openai_api.triton_http import TritonHttp

# /v1/embeddings inputs of at most this many bytes (together) are token-counted on the event loop (~50 µs
# for a sentence, ~0.2 ms at this size on the 2-core machine); longer ones in the thread pool, so that
# one large request does not hold up the others (a hop costs ~0.12 ms of CPU).
INLINE_TOKENS_BYTES = 512
TRITON_TIMEOUT_S = 60.0


class ServingEmbeddings:
    def __init__(self, triton: Triton, catalog: proto.ModelCatalog, token_counter,
                 triton_timeout_s: float = TRITON_TIMEOUT_S, triton_http: TritonHttp | None = None):
        self.triton, self.catalog = triton, catalog
        self.triton_http = triton_http  # /v1/embeddings over HTTP when the replicas' HTTP ports are given
        self.count_tokens = token_counter
        self.timeout_s = triton_timeout_s

    async def embeddings(self, request):
        from aiohttp import web

        body = await json_body(request, proto.MAX_EMBEDDINGS_BODY_BYTES)
        request["model"] = body.get("model")
        parsed = proto.parse_embeddings(body, self.catalog)
        encoded = [text.encode("utf-8") for text in parsed.texts]
        calls = [asyncio.ensure_future(self.embed(parsed.model, encoded[a:b]))
                 for a, b in proto.batches(len(encoded), TEXT_MAX_BATCH)]
        try:
            if sum(len(text) for text in encoded) <= INLINE_TOKENS_BYTES:
                # Short texts: counted here while Triton computes (the calls go out at this first
                # turn); a thread-pool hop would cost more CPU than the count.
                await asyncio.sleep(0)
                tokens = self.count_tokens(parsed.texts)
            else:
                tokens = await asyncio.get_running_loop().run_in_executor(None, self.count_tokens, parsed.texts)
            responses = await asyncio.gather(*calls)
        except self.triton.grpcclient.InferenceServerException as error:
            raise triton_error(error, "text_embedding") from None
        finally:
            for call in calls:  # those still running when another failed or the client left
                call.cancel()
        embeddings = np.concatenate(responses)
        return web.Response(body=proto.embeddings_body(parsed.model, embeddings, parsed.encoding_format, tokens),
                            content_type="application/json", charset="utf-8")

    def embed(self, model: str, texts: list[bytes]):
        """One ``text_embedding`` request → an awaitable of its ``[n, 384]`` embeddings. (gRPC: the
        call starts here, before the awaitable is awaited.)"""
        if self.triton_http is not None:
            return self.triton_http.infer_bytes(model, "text", texts, "embedding", self.timeout_s)
        return self.triton.infer(bytes_request(self.triton.pb, model, "text", texts, "embedding"), self.timeout_s,
                                 fp32="embedding")
