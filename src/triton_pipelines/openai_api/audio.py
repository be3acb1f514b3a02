"""``POST /v1/audio/transcriptions`` and ``/v1/audio/translations``: the audio goes to
``speech_recognition_stream`` (decoupled, gRPC ModelStreamInfer); its partial transcripts become the
SSE ``transcript.text.delta`` events; without ``stream`` only its final response is asked for."""

from __future__ import annotations

import asyncio

from triton_pipelines.limits import REQUEST_TIMEOUT_S
from triton_pipelines.openai_api import protocol as proto
from triton_pipelines.openai_api import transcripts
from triton_pipelines.openai_api.metrics import Metrics
from triton_pipelines.openai_api.multipart import read_multipart
from triton_pipelines.openai_api.replies import reply
from triton_pipelines.openai_api.triton_grpc import Triton, bool_input, bytes_input, triton_error

STREAM_MODEL = "speech_recognition_stream"
SPEECH_TIMEOUT_S = REQUEST_TIMEOUT_S


class ServingAudio:
    def __init__(self, triton: Triton, catalog: proto.ModelCatalog, language_codes, metrics: Metrics):
        self.triton, self.catalog, self.metrics = triton, catalog, metrics
        self.language_codes = tuple(language_codes)

    async def transcriptions(self, request):
        return await self.audio(request, "transcribe")

    async def translations(self, request):
        return await self.audio(request, "translate")

    async def audio(self, request, task: str):
        fields, filename, data = await read_multipart(request)
        request["model"] = fields.get("model")
        parsed = proto.parse_transcription(fields, filename, None if data is None else len(data), task, self.catalog,
                                           self.language_codes)
        granularities = transcripts.parse_granularities(fields, parsed.response_format)
        grpcclient = self.triton.grpcclient
        inputs = [bytes_input(grpcclient, "audio", [data])]
        if parsed.language:
            inputs.append(bytes_input(grpcclient, "language", [parsed.language.encode()]))
        inputs.append(bytes_input(grpcclient, "task", [task.encode()]))
        if parsed.timestamps:
            mode = b"word" if "word" in granularities else b"segment"
            inputs.append(bytes_input(grpcclient, "timestamps", [mode]))
        if parsed.vad_filter is not None:
            inputs.append(bool_input(grpcclient, "vad_filter", parsed.vad_filter))
        call, done = self.triton.stream(STREAM_MODEL, inputs, {"partials": parsed.stream}, SPEECH_TIMEOUT_S)
        endpoint = request.path
        try:
            if parsed.stream:
                return await self.audio_events(request, call, endpoint, parsed)
            text, segments, language, duration = await self.final_response(call)
            body, content_type = transcripts.format_transcript(parsed.response_format, text, segments, task,
                                                               language or parsed.language or "en", duration,
                                                               granularities)
            return reply(body, content_type=content_type)
        finally:
            done.set()
            call.cancel()  # a no-op after the final response; stops the decode when the client left

    async def final_response(self, call) -> tuple[str, list[transcripts.Segment], str, float]:
        """The final response's transcript, segments, language (given or detected) and duration."""
        async for result, error in call:
            if error is not None:
                raise triton_error(error, "audio")
            if bool(result.as_numpy("is_final").reshape(-1)[0]):
                text = result.as_numpy("transcript").reshape(-1)[0].decode("utf-8", "replace")
                language = result.as_numpy("detected_language").reshape(-1)[0].decode("utf-8", "replace")
                duration = float(result.as_numpy("duration").reshape(-1)[0])
                return text, transcripts.parse_segments(result.as_numpy("segments").reshape(-1)[0]), language, duration
        raise proto.unavailable("audio: the speech model ended the stream without a transcript")

    async def audio_events(self, request, call, endpoint: str, parsed: proto.TranscriptionRequest):
        from aiohttp import web

        # The first response decides between an HTTP error and a stream.
        iterator = call.__aiter__()
        try:
            first = await iterator.__anext__()
        except StopAsyncIteration:
            raise proto.unavailable("audio: the speech model ended the stream without a transcript") from None
        if first[1] is not None:
            raise triton_error(first[1], "audio")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               "X-Accel-Buffering": "no"})
        await response.prepare(request)
        self.metrics.streamed(endpoint, parsed.model)
        pending = [first]
        try:
            while True:
                result, error = pending.pop() if pending else await iterator.__anext__()
                if error is not None:
                    failure = triton_error(error, "audio")
                    await response.write(proto.sse(failure.body()))
                    break
                final = bool(result.as_numpy("is_final").reshape(-1)[0])
                delta = result.as_numpy("delta").reshape(-1)[0].decode("utf-8", "replace")
                if delta:
                    await response.write(proto.sse(transcripts.transcript_delta(delta)))
                if final:
                    text = result.as_numpy("transcript").reshape(-1)[0].decode("utf-8", "replace")
                    await response.write(proto.sse(transcripts.transcript_done(text)))
                    break
        except (ConnectionResetError, asyncio.CancelledError):
            self.metrics.streamed(endpoint, parsed.model, disconnected=True)
            raise
        except StopAsyncIteration:
            await response.write(proto.sse(proto.unavailable("audio: the stream ended early").body()))
        await response.write_eof()
        return response
