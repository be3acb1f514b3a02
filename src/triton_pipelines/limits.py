"""Every limit and default that crosses a process or a file, written once (Ray Serve's
``constants.py`` pattern). Whatever must restate one of these (``data/routes.yaml``, a built
``config.pbtxt`` parameter, nginx's rendered configuration) is tied to it by
tests/unit/base/test_limits.py. Standard library only: every layer imports it."""

from __future__ import annotations

# Where internal listeners bind: tritonserver's own ports, the screen, the /v1 frontend.
LOOPBACK = "127.0.0.1"

# ---------------------------------------------------------------------------------- the public front
# The JSON part of an HTTP request: Triton 2.51 crashes at ~4 MiB of flat JSON and at a nesting
# depth of ~104,000 (~208 KB). 128 KiB can nest at most 65,536 deep; anything larger goes binary.
DEFAULT_MAX_JSON_BYTES = 128 * 1024
# A whole request, binary tensors included: the largest legal input, a 64 MiB audio file.
MAX_AUDIO_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_BODY_BYTES = MAX_AUDIO_BYTES
# Inference requests in flight through both public ports together (every replica behind them):
# the back-pressure of the whole server. The models have no queue policy (a Triton 2.51 policy
# stalls its batcher, build/repo_builder/compute.py), so this bounds every queue behind the front.
DEFAULT_MAX_INFLIGHT = 256
# Request bytes in flight beside that count (`serve --max-inflight-bytes`): the native ports' screens
# together, and the /v1 frontend on its own, each hold at most this much of requests' bodies between
# their arrival and their answer (a request's bytes cost ~5x across the screen, tritonserver, a stub
# and /dev/shm: one 60 MiB request grew the server by 293 MB). One client's share is half
# (CLIENT_SHARE_DIVISOR). A part never drops below the largest legal body (DEFAULT_MAX_BODY_BYTES or
# --max-body-bytes), so any legal request fits once the others are done.
DEFAULT_MAX_INFLIGHT_BYTES = 512 * 1024 * 1024

# ------------------------------------------------------------------------------------- deadlines
# The slowest legal request (300 s of audio at saturation): nginx's upstream timeout, the screen's,
# the /v1 frontend's for speech, our client's network timeout, the speech route's deadline.
REQUEST_TIMEOUT_S = 300.0
# Longer audio is refused before its samples are decoded (docs/speech.md).
MAX_AUDIO_SECONDS = 300.0
# The gRPC header (forwarded by tritonserver as a request parameter, a string) in which the screen
# hands a client's deadline, in ns since the epoch, to the models: Triton 2.51 cancels an
# ensemble's step only when it schedules that step after the cancellation, never a running one, so
# a running ``whisper_decode`` learns that its client has gone only from this (an ensemble passes
# its parameters on to every step). Reserved: a client cannot send it.
CLIENT_DEADLINE_PARAMETER = "x-client-deadline-ns"


def client_deadline_value(remaining_s: float, now_ns: int) -> str:
    """``CLIENT_DEADLINE_PARAMETER``'s value: the deadline ``remaining_s`` from ``now_ns``, in ns
    since the epoch (the screen's for a gRPC call, the router's for its BLS calls)."""
    return str(now_ns + max(0, int(remaining_s * 1e9)))


# The header (forwarded by tritonserver as a request parameter, HTTP and gRPC) in which the screen
# gives every inference request its id on the cancel board (``cancel_board.py``): marked there
# when the client leaves before its answer. Reserved: a client cannot send it.
CLIENT_CANCEL_PARAMETER = "x-client-cancel-id"
# A self-hosted route's deadline when data/routes.yaml names none (`limits.triton_deadline_s`).
SELF_HOSTED_DEADLINE_S = 60.0

# ------------------------------------------------------------------------------------------- text
# One string of a text input (the tokenizer's `max_text_bytes` parameter, /v1/embeddings' input).
MAX_TEXT_BYTES = 64 * 1024
# Texts per batch: text_embedding's max_batch_size, /v1/embeddings' chunk, the router's rows.
TEXT_MAX_BATCH = 64

# ------------------------------------------------------------------------------- gRPC places (screen)
# One client's share of DEFAULT_MAX_INFLIGHT (its address) when none is given: half of the limit.
CLIENT_SHARE_DIVISOR = 2
# A ModelStreamInfer stream that sends no request message within this time of its start is closed by
# the screen (DEADLINE_EXCEEDED): an idle stream holds none of the in-flight places, but it holds a
# stream of nginx's and of the screen's.
STREAM_FIRST_MESSAGE_S = 10.0


def client_share(max_inflight: int, per_client: int | None) -> int:
    """One client's share of ``max_inflight``: ``per_client`` (0: no share), by default half of it."""
    return max(1, max_inflight // CLIENT_SHARE_DIVISOR) if per_client is None else per_client


def replica_part(total: int, replicas: int, index: int) -> int:
    """Replica ``index``'s part of a limit split over ``replicas`` request screens (the parts add up
    to ``total``; at least 1 each). 0 stays 0 (no limit)."""
    if total == 0:
        return 0
    return max(1, total // replicas + (1 if index < total % replicas else 0))


# -------------------------------------------------------------------------------- response cache
# Triton's local response cache (--cache-config local,size=N) in host memory, shared by every cached
# model of one tritonserver (each replica has its own): `serve --response-cache-bytes`, else
# $TRITON_RESPONSE_CACHE_BYTES, else this; 0 turns it off. The memory planner adds it to the host plan.
RESPONSE_CACHE_ENV = "TRITON_RESPONSE_CACHE_BYTES"
DEFAULT_RESPONSE_CACHE_BYTES = 256 * 1024 * 1024
# Smaller local caches may fail to initialise (Triton's docs: below ~1 KiB); below this one the
# launcher refuses the size with a one-line error instead.
MIN_RESPONSE_CACHE_BYTES = 1024 * 1024
