"""A local OpenAI-compatible chat-completions server on 127.0.0.1 for the router's gateway tests.

Real HTTP (``http.server``), no network beyond loopback. It records every request (path, headers,
JSON body) and answers from a script: each queued ``Reply`` is used once, in order; with the queue
empty it answers ``default``. A reply can be slow (``delay_s``), fail (``status``), be garbage
(``raw``), stream slowly (``chunk_delay_s``), or report the given usage.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Reply:
    status: int = 200
    delay_s: float = 0.0
    content: str | None = None  # default: "echo:<model>:<last user text>"
    prompt_tokens: int | None = 11
    completion_tokens: int | None = 7
    raw: bytes | None = None  # sent as-is (with status), e.g. b"not json"
    headers: dict | None = None  # extra response headers, e.g. {"Retry-After": "1"}
    error_code: str | None = None  # a failure's error.code, e.g. "context_length_exceeded"
    error_message: str | None = None  # a failure's error.message
    chunk_delay_s: float = 0.0  # streamed: the wait before each chunk after the first (a slow stream)


def context_length_error() -> Reply:
    """What OpenAI answers when the prompt does not fit the model's window."""
    return Reply(status=400, error_code="context_length_exceeded",
                 error_message="This model's maximum context length is 128000 tokens. However, your messages "
                               "resulted in 200000 tokens.")


@dataclass
class Recorded:
    path: str
    headers: dict[str, str]
    body: dict


class FakeGateway:
    def __init__(self):
        self.requests: list[Recorded] = []
        self.queue: list[Reply] = []
        self.default = Reply()
        self.rules: list[tuple[str, Reply]] = []  # (text in the messages, its reply): before the queue
        self.by_model: dict[str, Reply] = {}  # requests for this model get this reply (first of all)
        self.lock = threading.Lock()
        self.wake = threading.Event()
        gateway = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                try:
                    body = json.loads(raw)
                except ValueError:
                    body = {"_raw": raw.decode("utf-8", "replace")}
                with gateway.lock:
                    gateway.requests.append(Recorded(self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                    text = json.dumps(body.get("messages", ""))
                    ruled = [reply for marker, reply in gateway.rules if marker in text]
                    if body.get("model") in gateway.by_model:
                        ruled.insert(0, gateway.by_model[body.get("model")])
                    reply = ruled[0] if ruled else gateway.queue.pop(0) if gateway.queue else gateway.default
                if reply.delay_s:
                    gateway.wake.wait(reply.delay_s)  # a slow or hung gateway; reset() ends the wait
                if reply.raw is not None:
                    payload, content_type = reply.raw, "application/json"
                elif reply.status != 200:
                    payload = json.dumps({"error": {
                        "message": reply.error_message or f"fake failure {reply.status}",
                        "type": "invalid_request_error" if reply.status < 500 else "server_error",
                        "code": reply.error_code}}).encode()
                    content_type = "application/json"
                elif body.get("stream"):
                    payload, content_type = gateway.stream_body(body, reply), "text/event-stream"
                else:
                    payload, content_type = json.dumps(gateway.completion(body, reply)).encode(), "application/json"
                try:
                    self.send_response(reply.status)
                    self.send_header("Content-Type", content_type)
                    self.send_header("Content-Length", str(len(payload)))
                    for name, value in (reply.headers or {}).items():
                        self.send_header(name, value)
                    self.end_headers()
                    if reply.chunk_delay_s and content_type == "text/event-stream":
                        events = payload.split(b"\n\n")[:-1]
                        for index, event in enumerate(events):
                            if index:
                                time.sleep(reply.chunk_delay_s)
                            self.wfile.write(event + b"\n\n")
                            self.wfile.flush()
                    else:
                        self.wfile.write(payload)
                except (BrokenPipeError, ConnectionResetError):  # the client timed out and left
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @staticmethod
    def completion(body: dict, reply: Reply) -> dict:
        messages = body.get("messages") or [{}]
        last = messages[-1].get("content")
        text = last if isinstance(last, str) else json.dumps(last)
        usage = None
        if reply.prompt_tokens is not None and reply.completion_tokens is not None:
            usage = {"prompt_tokens": reply.prompt_tokens, "completion_tokens": reply.completion_tokens,
                     "total_tokens": reply.prompt_tokens + reply.completion_tokens}
        return {
            "id": "chatcmpl-fake", "object": "chat.completion", "created": int(time.time()),
            "model": body.get("model"),
            "choices": [{"index": 0, "finish_reason": "stop", "message": {
                "role": "assistant",
                "content": reply.content if reply.content is not None else f"echo:{body.get('model')}:{text}"}}],
            "usage": usage,
        }

    @staticmethod
    def stream_body(body: dict, reply: Reply) -> bytes:
        """``stream: true``: the completion as OpenAI's chunks (server-sent events): a role chunk, one
        chunk per word, the finish chunk, the usage chunk when ``stream_options.include_usage``, [DONE]."""
        whole = FakeGateway.completion(body, reply)
        text = whole["choices"][0]["message"]["content"]
        base = {"id": whole["id"], "object": "chat.completion.chunk", "created": whole["created"],
                "model": whole["model"]}
        chunks = [{**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                        "finish_reason": None}]}]
        words = text.split(" ")
        chunks += [{**base, "choices": [{"index": 0, "delta": {"content": (" " if i else "") + word},
                                         "finish_reason": None}]} for i, word in enumerate(words)]
        chunks.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
        if (body.get("stream_options") or {}).get("include_usage") and whole["usage"] is not None:
            chunks.append({**base, "choices": [], "usage": whole["usage"]})
        return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def script(self, *replies: Reply) -> None:
        with self.lock:
            self.queue = list(replies)

    def when(self, marker: str, reply: Reply) -> None:
        """Requests whose messages contain ``marker`` get ``reply`` (every time)."""
        with self.lock:
            self.rules.append((marker, reply))

    def for_model(self, model: str, reply: Reply | None) -> None:
        """Requests for ``model`` get ``reply`` every time (None: back to normal)."""
        with self.lock:
            if reply is None:
                self.by_model.pop(model, None)
            else:
                self.by_model[model] = reply

    def reset(self) -> None:
        with self.lock:
            self.queue, self.requests, self.default, self.rules = [], [], Reply(), []
            self.by_model = {}
            self.wake.set()  # replies still waiting (a hung gateway) end now
            self.wake = threading.Event()

    def start(self) -> "FakeGateway":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
