"""Batch execution of an ONNX model for the embedded target's compute models.

The embedded ``tritonserver`` build has no ONNX Runtime backend, so each compute model runs as a
Python-backend model with the same name, tensors and batching as the native one. Triton hands the
Python backend the dynamic batch as a list of requests; this class runs them as one ONNX Runtime
call per group of equal trailing shapes, or, with ragged batching, per run of rows of similar
length (``LengthGrouping``), then splits the outputs back per request. Only the outputs the
requests asked for are computed and sent. A BLS caller may leave inputs and state in the model
between its calls (``InputCache``: the Whisper decoder's cross K/V and self-attention K/V).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from triton_pipelines.errors import InputError


# The runner's ``execution_providers`` names → ONNX Runtime providers (with their options). cuda and
# tensorrt need onnxruntime-gpu (requirements-gpu.txt) instead of the CPU build.
PROVIDERS = {
    "cpu": ("CPUExecutionProvider", {}),
    "cuda": ("CUDAExecutionProvider", {}),
    "tensorrt": ("TensorrtExecutionProvider", {"trt_fp16_enable": True, "trt_engine_cache_enable": True}),
}


def engine_cache_dir(model_name: str) -> Path:
    """Where the TensorRT provider keeps its engines: $TRITON_ENGINE_CACHE/<model>, by default
    under ~/.cache (the model repository may be read-only)."""
    import os

    root = Path(os.environ.get("TRITON_ENGINE_CACHE") or Path.home() / ".cache" / "triton-pipelines" / "ort-trt")
    return root / model_name


def providers_for(names: Sequence[str], available: Sequence[str], cache_dir: Path | None = None) -> list:
    """ONNX Runtime providers for ``names`` (in preference order), or ValueError naming what is
    missing: a GPU provider that this onnxruntime lacks is an error, not a silent CPU fallback."""
    unknown = [n for n in names if n not in PROVIDERS]
    if unknown or not names:
        raise ValueError(f"execution providers {list(names)}: choose among {list(PROVIDERS)}")
    chosen = []
    for name in names:
        provider, options = PROVIDERS[name]
        if provider not in available:
            raise ValueError(f"execution provider {name!r} ({provider}) is not in this onnxruntime "
                             f"(it has {list(available)}): install onnxruntime-gpu (requirements-gpu.txt)")
        if name == "tensorrt" and cache_dir is not None:
            options = dict(options, trt_engine_cache_path=str(cache_dir))
        chosen.append((provider, options))
    return chosen


def onnx_session(model_path: Path | str, intra_op_threads: int = 0, execution_providers: Sequence[str] = ("cpu",),
                 engine_cache_dir: Path | None = None, spin_wait: bool = True):
    """An ONNX Runtime session as every model here runs one: ``intra_op_threads`` threads inside an
    operator (0: ONNX Runtime's default), one between operators, the providers in preference order.

    ``spin_wait=False``: ONNX Runtime's intra-op threads block as soon as a run's parallel work is
    done instead of spinning for more (``session.intra_op.allow_spinning``). Spinning saves a
    wake-up inside one run; in a server where other processes (Triton's stubs) need the same cores
    right after the run, the spinning thread takes their CPU."""
    import onnxruntime as ort

    if any(name != "cpu" for name in execution_providers) and hasattr(ort, "preload_dlls"):
        ort.preload_dlls()  # the CUDA/cuDNN libraries of the nvidia-* wheels
    options = ort.SessionOptions()
    options.intra_op_num_threads = intra_op_threads
    options.inter_op_num_threads = 1
    # No memory pattern: ONNX Runtime plans one arena block per input shape it has seen and keeps
    # each, so a model served at many batch sizes and lengths grows with every new shape. Measured on
    # whisper_encoder (batch 1, 8, 2, 8): 2975 MB resident with it, 1649 MB without (the peak of one
    # run), at no measurable cost per run (the arena still serves the allocations).
    options.enable_mem_pattern = False
    if not spin_wait:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    providers = providers_for(execution_providers, ort.get_available_providers(), engine_cache_dir)
    return ort.InferenceSession(str(model_path), options, providers=providers)


class OnnxBatchRunner:
    def __init__(self, model_path: Path | str, intra_op_threads: int = 0,
                 output_names: Sequence[str] | None = None, length_grouping: LengthGrouping | None = None,
                 execution_providers: Sequence[str] = ("cpu",), engine_cache_dir: Path | None = None,
                 spin_wait: bool = True, rows_per_run: int = 0):
        """The session's options: ``onnx_session``. ``length_grouping``: how requests of different
        sequence lengths run together (ragged batching), see ``LengthGrouping``; None: only
        requests of equal shapes share a run, as on the native backend. ``rows_per_run`` (0: no
        limit): at most this many rows in one ONNX Runtime call. 1 makes a row's outputs a
        function of that row alone in a graph whose result depends on its batch (dynamic
        quantization scales activations over the whole input tensor: ``--whisper-int8``)."""
        if rows_per_run < 0 or (rows_per_run and length_grouping is not None):
            raise ValueError(f"rows_per_run must be 0 (no limit) or more, and 0 with length grouping, "
                             f"not {rows_per_run}")
        self.session = onnx_session(model_path, intra_op_threads, execution_providers, engine_cache_dir, spin_wait)
        self.rows_per_run = rows_per_run
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = list(output_names or [o.name for o in self.session.get_outputs()])
        self.length_grouping = length_grouping
        # Outputs with the inputs' sequence axis (axis 1, by its symbolic name in the graph): cut
        # back to each request's own width after a length-grouped run.
        sequence_axis = self.session.get_inputs()[0].shape[1] if len(self.session.get_inputs()[0].shape) > 1 else None
        self.sequence_outputs = {o.name for o in self.session.get_outputs()
                                 if sequence_axis is not None and len(o.shape) > 1 and o.shape[1] == sequence_axis}

    def run(self, requests: Sequence[Mapping[str, np.ndarray]], output_names: Sequence[str] | None = None
            ) -> list[dict[str, np.ndarray]]:
        """``requests[i]`` maps input name → array with a leading batch axis; returns the same
        structure for outputs (``output_names``, default all), in request order."""
        names = list(output_names or self.output_names)
        if self.length_grouping is not None:
            return self._run_length_grouped(requests, names)
        results: list[dict[str, np.ndarray] | None] = [None] * len(requests)
        groups: dict[tuple, list[int]] = {}
        for index, request in enumerate(requests):
            signature = tuple(request[name].shape[1:] for name in self.input_names)
            groups.setdefault(signature, []).append(index)
        for indices in groups.values():
            sizes = [requests[i][self.input_names[0]].shape[0] for i in indices]
            if len(indices) == 1:
                feeds = dict(requests[indices[0]])
            else:
                feeds = {name: np.concatenate([requests[i][name] for i in indices]) for name in self.input_names}
            outputs = run_rows(self.session, names, {n: feeds[n] for n in self.input_names}, self.rows_per_run)
            offsets = np.cumsum([0] + sizes)
            for position, index in enumerate(indices):
                start, stop = offsets[position], offsets[position + 1]
                results[index] = {name: out[start:stop] for name, out in zip(names, outputs)}
        return results  # type: ignore[return-value]

    def _run_length_grouped(self, requests: Sequence[Mapping[str, np.ndarray]], names: list[str]
                            ) -> list[dict[str, np.ndarray]]:
        """Every row of every request, sorted by its own length and cut into runs
        (``LengthGrouping.runs``); each run is its rows cut or zero-padded to the run's longest.
        Outputs go back to each request's rows; sequence outputs at the request's width, zero past
        each row's own length."""
        grouping = self.length_grouping
        first = self.input_names[0]
        widths = [request[first].shape[1] for request in requests]
        counts = [request[first].shape[0] for request in requests]
        offsets = np.cumsum([0] + counts)
        # Every input once as one [rows, widest, ...] array (zero past each request's width): a run
        # is then one gather of its rows, cut to its longest.
        widest = max(widths)
        stacked = {}
        for name in self.input_names:
            if len(requests) == 1:
                stacked[name] = requests[0][name]
                continue
            value = requests[0][name]
            stacked[name] = np.zeros((offsets[-1], widest) + value.shape[2:], value.dtype)
            for request, start, width in zip(requests, offsets, widths):
                stacked[name][start:start + len(request[name]), :width] = request[name]
        if grouping.length_input in stacked:
            lengths = grouping.row_lengths(stacked, widest)
        else:
            lengths = np.repeat(np.asarray(widths, dtype=np.int64), counts)
        gathered: dict[str, np.ndarray] = {}
        for run in grouping.runs(lengths):
            longest = int(lengths[run].max())
            outputs = self.session.run(names, {name: stacked[name][run, :longest] for name in self.input_names})
            for name, out in zip(names, outputs):
                if name not in gathered:
                    shape = (len(lengths),) + ((widest,) + out.shape[2:] if name in self.sequence_outputs
                                               else out.shape[1:])
                    gathered[name] = np.zeros(shape, out.dtype)
                if name in self.sequence_outputs:  # the rows' own positions; their padding stays 0
                    own = np.arange(longest)[None, :] < lengths[run][:, None]
                    out = np.where(own.reshape(own.shape + (1,) * (out.ndim - 2)), out, 0)
                    gathered[name][run, :longest] = out
                else:
                    gathered[name][run] = out
        return [{name: (np.ascontiguousarray(value[offsets[i]:offsets[i + 1], :widths[i]])
                        if name in self.sequence_outputs else value[offsets[i]:offsets[i + 1]])
                 for name, value in gathered.items()}
                for i in range(len(requests))]


@dataclass(frozen=True)
class LengthGrouping:
    """Ragged batching on the embedded target (config: ``allow_ragged_batch`` on the inputs): the
    dynamic batcher hands over requests of any sequence length, and the runner groups their rows
    by their own length, as text-embeddings-inference does with ``max_batch_tokens``.

    A row's length is where its ``length_input`` (the attention mask) ends, or the request's width
    without one. Rows sorted by length are cut into runs: a row joins the current run while it is
    at most ``max_ratio`` times the run's shortest row (or both are at most ``short_tokens``: there
    a run's cost is per call, not per token) and the run's padded tokens stay within
    ``max_batch_tokens``. So no row runs at more than ``max_ratio`` times its own length (short
    rows excepted), and a run's work is bounded whatever the batch."""
    length_input: str | None = None
    max_batch_tokens: int = 4096
    max_ratio: float = 1.3
    short_tokens: int = 16

    def row_lengths(self, request: Mapping[str, np.ndarray], width: int) -> np.ndarray:
        count = next(iter(request.values())).shape[0]
        if self.length_input is None or self.length_input not in request:
            return np.full(count, width, dtype=np.int64)
        mask = request[self.length_input].reshape(count, -1) != 0
        # one past the last non-zero position (a row of zeros still runs, at length 1)
        last = np.where(mask.any(axis=1), mask.shape[1] - np.argmax(mask[:, ::-1], axis=1), 1)
        return last.astype(np.int64)

    def runs(self, lengths: np.ndarray) -> list[np.ndarray]:
        """Row indices per run, each run's rows ascending by length."""
        order = np.argsort(lengths, kind="stable")
        runs, current, shortest = [], [], 0
        for row in order:
            length = int(lengths[row])
            fits_ratio = length <= self.max_ratio * shortest or length <= self.short_tokens
            if current and fits_ratio and (len(current) + 1) * length <= self.max_batch_tokens:
                current.append(row)
                continue
            if current:
                runs.append(np.array(current))
            current, shortest = [row], length
        if current:
            runs.append(np.array(current))
        return runs

    @classmethod
    def served(cls, model_dir: Path) -> "LengthGrouping | None":
        """The grouping a built model folder serves with (None: it batches equal shapes only)."""
        import re

        from triton_pipelines.repository.contract import built_config_parameters

        if not re.search(r"allow_ragged_batch:\s*true", (Path(model_dir) / "config.pbtxt").read_text()):
            return None
        return cls.from_parameters(built_config_parameters(model_dir))

    @classmethod
    def from_parameters(cls, parameters: Mapping[str, str]) -> "LengthGrouping":
        return cls(length_input=parameters.get("length_input") or None,
                   max_batch_tokens=int(parameters.get("max_batch_tokens", cls.max_batch_tokens)))


# In the error for a key this model instance does not hold (another instance, or evicted): a
# caller that sees it sends the inputs again.
NOT_CACHED = "is not cached here"


class InputCache:
    """Inputs a caller sends once and then names by key, and state a model keeps between a caller's
    calls, for the embedded target's compute models.

    On the embedded target every BLS call copies its input tensors from the caller's stub into the
    callee's stub (both Python-backend processes), and its output tensors back. For the Whisper
    decoder that is the cross-attention K/V (37 MB per window for base) on every greedy step, for
    tensors that do not change between steps, and the self-attention K/V that grow by one position
    per step (``past_self_kv`` in, ``present_self_kv`` out: up to 11 MB per window for base).

    Cached inputs (``names``): the first call carries them with a key; later calls carry only the
    key, plus the rows still running (the caller's row numbers, a subset of the stored ones,
    ascending).

    State pairs (``states``: input → output, e.g. ``past_self_kv`` → ``present_self_kv``): a keyed
    call that omits the state input gets the key's stored state, cut to its rows as the cached
    inputs are; a keyed call that sends it (a first step: zero length) uses what it sends. Either
    way, after the run the model stores the run's output as the key's next state, with the run's
    rows (``store_state``: ORT's output array itself, no copy). A key is one caller's slot, used by
    one call at a time (a greedy loop): the state a call takes out is the one its previous call
    left.

    The cache belongs to one model instance: with several, a call may reach one that does not hold
    the key (or its state), and the caller sends the inputs again (``NOT_CACHED``).

    A key names a caller's slot, not one call: storing under a key replaces what was there, so a
    caller that decodes one batch at a time holds at most one entry. At most ``max_entries`` keys
    are kept (least recently used first out). What one key holds at most: its rows' cached inputs
    and one state of those rows (for the Whisper decoder: rows × (37 MB of cross K/V + 448
    positions × 24 KB of self K/V = 11 MB) for base; whisper_decode sends a group of at most 4
    rows on the embedded target, the decoder takes up to its max batch, 64). A key's next batch is
    copied into the buffers its previous one used when they have room (``_refill``)."""

    def __init__(self, names: Sequence[str], max_entries: int = 8, states: Mapping[str, str] | None = None):
        self.names = tuple(names)
        self.states = dict(states or {})
        self.max_entries = max_entries
        self._entries: dict[str, _CacheEntry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def resolve(self, key: str, given: Mapping[str, np.ndarray], rows: Sequence[int] | None = None
                ) -> dict[str, np.ndarray]:
        """The cached inputs and state for this call. With ``given`` (all cached names present):
        store them under ``key`` (``rows``: the caller's numbers for their rows, default 0..n-1) and
        return them. Without: the stored arrays for ``key``, cut to ``rows``. The state inputs
        likewise: given ones are used, else the key's stored state is taken out, cut to ``rows``.
        Raises InputError for a partial set, an unknown key or a key without stored state (message
        contains ``NOT_CACHED``) or rows that were not stored."""
        wanted = None if rows is None else np.asarray(rows, dtype=np.int64)
        if wanted is not None and (wanted.size == 0 or np.any(np.diff(wanted) <= 0)):
            raise InputError(f"input cache key {key!r}: rows {wanted.tolist()} are not ascending and non-empty")
        result: dict[str, np.ndarray] = {}
        present = [name for name in self.names if name in given]
        if present:
            if len(present) != len(self.names):
                missing = sorted(set(self.names) - set(present))
                raise InputError(f"input cache key {key!r}: send all cached inputs or none; missing {missing}")
            count = len(given[self.names[0]])
            if wanted is not None and len(wanted) != count:
                raise InputError(f"input cache key {key!r}: {len(wanted)} rows named for {count} rows sent")
            previous = self._entries.pop(key, None) or _CacheEntry(np.arange(0), {}, {})
            previous.arrays, previous.state = {}, None  # a buffer too small is freed before its successor
            buffers = {name: _refill(previous.buffers.pop(name, None), given[name]) for name in self.names}
            entry = _CacheEntry(np.arange(count) if wanted is None else wanted,
                                {name: buffer[:count] for name, buffer in buffers.items()}, buffers)
            self._store(key, entry)
            result.update(entry.arrays)
        elif self.names:
            if key not in self._entries:
                raise InputError(f"input cache key {key!r} {NOT_CACHED}: send {list(self.names)} with it first")
            entry = self._entries.pop(key)
            self._entries[key] = entry  # most recently used last
            if not (wanted is None or (len(wanted) == len(entry.rows) and np.array_equal(wanted, entry.rows))):
                positions = _positions(key, entry.rows, wanted, "cached rows")
                # Finished rows leave for good: the running ones move up within the key's buffers
                # (once per change of rows), which stay contiguous for ONNX Runtime.
                entry.arrays = {name: _compact(entry.buffers[name], positions) for name in entry.arrays}
                entry.rows = wanted
            result.update(entry.arrays)
        else:  # a model with state only
            entry = self._entries.pop(key, None) or _CacheEntry(np.arange(0), {}, {})
            self._store(key, entry)
        if self.states:
            result.update(self._take_state(key, entry, given, wanted, bool(present)))
        return result

    def _take_state(self, key: str, entry: "_CacheEntry", given: Mapping[str, np.ndarray],
                    wanted: np.ndarray | None, fresh: bool) -> dict[str, np.ndarray]:
        sent = [name for name in self.states if name in given]
        if sent:
            if len(sent) != len(self.states):
                missing = sorted(set(self.states) - set(sent))
                raise InputError(f"input cache key {key!r}: send all state inputs or none; missing {missing}")
            count = len(given[sent[0]])
            if wanted is not None and len(wanted) != count:
                raise InputError(f"input cache key {key!r}: {len(wanted)} rows named for {count} state rows sent")
            entry.state, entry.state_rows = None, None  # replaced by this run's output
            entry.pending = np.arange(count) if wanted is None else wanted
            return {name: given[name] for name in self.states}
        if fresh:
            raise InputError(f"input cache key {key!r}: send {list(self.states)} with the cached inputs")
        if entry.state is None:
            raise InputError(f"input cache key {key!r}: its state {NOT_CACHED}: send {list(self.states)} with it")
        state, stored = entry.state, entry.state_rows
        # Taken out: until this call's run stores its output, the key has no state (a failed run
        # leaves none, and the caller's next call starts again).
        entry.state, entry.state_rows = None, None
        if wanted is None or (len(wanted) == len(stored) and np.array_equal(wanted, stored)):
            entry.pending = stored
            return state
        positions = _positions(key, stored, wanted, "rows of its state")
        entry.pending = wanted
        return {name: np.ascontiguousarray(value[positions]) for name, value in state.items()}

    def store_state(self, key: str, outputs: Mapping[str, np.ndarray]) -> None:
        """After a keyed run: its state outputs (``outputs`` by output name) become the key's state,
        with the rows that run had. Nothing when the key has left the cache meanwhile."""
        entry = self._entries.get(key)
        if not self.states or entry is None or entry.pending is None:
            return
        entry.state = {name: outputs[output] for name, output in self.states.items()}
        entry.state_rows, entry.pending = entry.pending, None

    def _store(self, key: str, entry: "_CacheEntry") -> None:
        self._entries.pop(key, None)
        self._entries[key] = entry
        while len(self._entries) > self.max_entries:
            del self._entries[next(iter(self._entries))]


@dataclass
class _CacheEntry:
    """One key of an ``InputCache``: the cached inputs of its rows (``arrays``: the leading rows of
    ``buffers``, which the key's next batch refills in place), its state (None: none stored, or
    taken by the call now running) with the state's rows, and the rows of the call now running."""
    rows: np.ndarray
    arrays: dict[str, np.ndarray]
    buffers: dict[str, np.ndarray]
    state: dict[str, np.ndarray] | None = None
    state_rows: np.ndarray | None = None
    pending: np.ndarray | None = None


def run_rows(session, names: list[str], feeds: dict[str, np.ndarray], rows_per_run: int = 0
             ) -> list[np.ndarray]:
    """One ONNX Runtime call, or one per ``rows_per_run`` rows of ``feeds`` (0: no limit), the
    outputs joined in row order (``OnnxBatchRunner``'s ``rows_per_run``)."""
    rows = len(next(iter(feeds.values())))
    if not rows_per_run or rows <= rows_per_run:
        return session.run(names, feeds)
    parts = [session.run(names, {n: value[start:start + rows_per_run] for n, value in feeds.items()})
             for start in range(0, rows, rows_per_run)]
    return [np.concatenate([part[i] for part in parts]) for i in range(len(names))]


def _refill(buffer: np.ndarray | None, given: np.ndarray) -> np.ndarray:
    """``given`` copied into the leading rows of ``buffer`` when it has room (same row shape and
    dtype), else into a new buffer of its size. Why: a fresh allocation of this size (the Whisper
    decoder's cross K/V, 37 MB per window) is new pages the kernel must fault in and zero, which on
    a VM whose freed memory goes back to the host costs ~1 s per 150 MB (docs/speech.md); refilling
    the key's previous buffer touches memory that is already there."""
    if (buffer is None or buffer.dtype != given.dtype or buffer.shape[1:] != given.shape[1:]
            or len(buffer) < len(given)):
        del buffer  # the last reference: freed before the new one is allocated
        return np.array(given, copy=True, order="C")
    np.copyto(buffer[:len(given)], given)
    return buffer


def _compact(buffer: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Rows ``positions`` (ascending) of ``buffer`` moved to its leading rows, in place → those
    rows. Each row moves to a lower or equal index, below every row still to move."""
    for target, source in enumerate(positions.tolist()):
        if target != source:
            buffer[target] = buffer[source]
    return buffer[:len(positions)]


def _positions(key: str, stored: np.ndarray, wanted: np.ndarray, what: str) -> np.ndarray:
    if not np.isin(wanted, stored).all():
        raise InputError(f"input cache key {key!r}: rows {wanted.tolist()} are not a subset of "
                         f"the {what} {stored.tolist()}")
    return np.searchsorted(stored, wanted)


def parse_state_pairs(text: str) -> dict[str, str]:
    """``"past_self_kv=present_self_kv"`` (config parameter ``state_inputs``, comma-separated pairs)
    → ``{"past_self_kv": "present_self_kv"}``."""
    pairs = {}
    for item in (part.strip() for part in text.split(",")):
        if item:
            name, _, output = item.partition("=")
            if not name.strip() or not output.strip():
                raise ValueError(f"state_inputs: {item!r} is not input=output")
            pairs[name.strip()] = output.strip()
    return pairs


def parse_rows(text: str) -> list[int]:
    """``"0,2,5"`` (a request parameter) → ``[0, 2, 5]``."""
    try:
        return [int(value) for value in text.split(",") if value.strip()]
    except ValueError:
        raise InputError(f"input cache rows must be comma-separated integers, got {text!r}") from None


class EmbeddedComputeModel:
    """A compute model as the embedded target serves it (the builder's ``onnx_runtime_runner``
    template is a thin adapter over this): the ONNX file in ONNX Runtime, with the name, tensors
    and batching of the native ``onnxruntime_onnx`` model.

    Config parameter ``cached_inputs`` (comma-separated, optional): inputs a BLS caller may send once
    with the request parameter ``input_cache_key`` and then omit, naming the key (and, with
    ``input_cache_rows``, the rows still wanted); ``state_inputs`` (comma-separated
    ``input=output`` pairs, optional): inputs a keyed caller may omit to be fed the output of its
    previous keyed call (the runner computes and keeps that output whether or not the request asks
    for it); ``input_cache_entries`` (default 8) bounds the keys kept. See ``InputCache``."""

    def __init__(self, name: str, runner: OnnxBatchRunner, input_names: Sequence[str],
                 cache: InputCache | None = None):
        self.name = name
        self.runner = runner
        self.input_names = list(input_names)
        self.cache = cache
        # Outputs a keyed run always computes: the next state of its caller's key.
        self.state_outputs = set(cache.states.values()) if cache is not None else set()

    @classmethod
    def from_config(cls, name: str, config: Mapping, parameters: Mapping[str, str], version_dir: Path
                    ) -> "EmbeddedComputeModel":
        """From the model's config (as JSON), its parameters and its version folder."""
        runner = OnnxBatchRunner(
            version_dir / parameters.get("onnx_file", "model.onnx"),
            intra_op_threads=int(parameters.get("intra_op_threads", "0")),
            output_names=[o["name"] for o in config["output"]],
            length_grouping=(LengthGrouping.from_parameters(parameters)
                             if any(i.get("allow_ragged_batch", False) for i in config["input"]) else None),
            execution_providers=parameters.get("execution_providers", "cpu").split(","),
            engine_cache_dir=engine_cache_dir(name),
            spin_wait=parameters.get("intra_op_spin_wait", "true") == "true",
            rows_per_run=int(parameters.get("rows_per_run", "0")),
        )
        cached = [input_name for input_name in parameters.get("cached_inputs", "").split(",") if input_name]
        states = parse_state_pairs(parameters.get("state_inputs", ""))
        cache = (InputCache(cached, int(parameters.get("input_cache_entries", "8")), states)
                 if cached or states else None)
        return cls(name, runner, [i["name"] for i in config["input"]], cache)

    def feeds(self, given: Mapping[str, np.ndarray], parameters: Mapping) -> tuple[dict[str, np.ndarray], str | None]:
        """One request's inputs (``given``: those it carries) and request parameters → (input name →
        array, its input cache key or None). InputError for missing inputs or a bad cache use."""
        feeds = dict(given)
        key = parameters.get("input_cache_key")
        if key is None or self.cache is None:
            missing = [name for name in self.input_names if name not in feeds]
            if missing:
                raise InputError(f"{self.name}: missing inputs {missing}"
                                 + (" (or an input_cache_key naming them)" if self.cache is not None else ""))
            return feeds, None
        rows = parameters.get("input_cache_rows")
        feeds.update(self.cache.resolve(str(key), feeds, None if rows is None else parse_rows(str(rows))))
        return feeds, str(key)

    def run(self, requests: Sequence[tuple[Mapping[str, np.ndarray], str | None]],
            wanted: Sequence[Sequence[str] | None] | None = None) -> list[dict[str, np.ndarray] | Exception]:
        """``feeds`` results of one execute → per request its outputs, or the error that fails it.
        ``wanted[i]``: the outputs request i asked for (Triton's ``requested_output_names``; None or
        empty: all); a run computes the union of its requests' and answers each with its own.
        Requests without a cache key run as one batch; one with a key runs alone (its cached tensors
        are its caller's own: copying them into a batch would cost what the cache saves), computes
        the cache's state outputs too and leaves them as the key's next state (``InputCache.store_state``).
        An ONNX Runtime failure fails the requests of that run only (a keyed one then has no state
        stored: its caller's next call is answered ``NOT_CACHED``)."""
        asked = [list(names) if names else list(self.runner.output_names)
                 for names in (wanted or [None] * len(requests))]
        plain = [index for index, (_, key) in enumerate(requests) if key is None]
        keyed = [[index] for index, (_, key) in enumerate(requests) if key is not None]
        results: list = [None] * len(requests)
        for group in ([plain] if plain else []) + keyed:
            key = requests[group[0]][1]
            names = [name for name in self.runner.output_names
                     if any(name in asked[index] for index in group) or (key is not None and name in self.state_outputs)]
            try:
                outputs = self.runner.run([requests[index][0] for index in group], names)
            except Exception as error:  # fails these requests, not the server
                outputs = [RuntimeError(f"{self.name}: ONNX Runtime failed: {error}")] * len(group)
            else:
                if key is not None and self.state_outputs:
                    self.cache.store_state(key, outputs[0])
            for index, output in zip(group, outputs):
                results[index] = output if isinstance(output, Exception) else {
                    name: array for name, array in output.items() if name in asked[index]}
        return results
