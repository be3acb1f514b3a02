"""Whisper's greedy decoding loop.

Greedy decoding (``GreedyDecoder``, token selection in ``GreedyBatch``) is the same loop in Triton
(one BLS call to ``whisper_decoder`` per step) and in process (``WhisperOnnx.decode_windows``): every window starts from
the prompt ``<|startoftranscript|><|lang|><|task|><|notimestamps|>``; each step feeds the new
tokens and the self-attention cache (on the embedded target the decoder keeps that cache between
steps, and the cross K/V: ``GreedyDecoder``'s ``cache_key``), takes the argmax over the text tokens plus
``<|endoftext|>`` with Whisper's standard suppression (every other special token, the non-speech
symbols, and a blank or ``<|endoftext|>`` as the first token: what openai-whisper, faster-whisper
and transformers do by default), and a window leaves the batch at ``<|endoftext|>`` or after
``max_new_tokens``. A window without a language detects it in the same loop: the first call then
feeds ``<|startoftranscript|>`` alone for the whole batch and its logits pick the language token
(openai-whisper's ``detect_language``). A window with timestamps has no ``<|notimestamps|>`` and
is decoded under Whisper's timestamp rules (``timestamps.TimestampRules``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np

from triton_pipelines.errors import UpstreamError
from triton_pipelines.pipelines.onnx_runner import NOT_CACHED
from triton_pipelines.pipelines.speech.timestamps import TimestampRules
from triton_pipelines.pipelines.speech.tokenizer import TIMED_SLOTS, WORDS_SLOT, WhisperTokenizer, detect_from
from triton_pipelines.pipelines.speech.words import AlignedTokens, alignment_sequence


@dataclass
class GreedyBatch:
    """Greedy token selection for a batch of windows; the caller owns the tensors (self-attention
    cache, cross K/V) and runs the decoder.

    ``prompts [N, W]``: each window's prompt, with two sentinels (``tokenizer.prompt_row``): a
    language slot ``detect_from(k)`` (the language is detected, ``language_mask``'s argmax over the
    logits at ``<|startoftranscript|>``, of this window for k = 0, else of the window k rows before:
    its clip's first; written into ``prompts`` in place), and a last slot ``TIMESTAMPS_SLOT`` (a
    prompt one token shorter, no ``<|notimestamps|>``: the window is decoded under ``timestamps``,
    Whisper's timestamp rules). Every row feeds the same number of positions per call: the first
    call feeds the prompts' common prefix (only ``<|startoftranscript|>`` when a language is
    detected), later calls the rest of the prompts together, or one token per row, a prompt token
    for a row whose prompt is longer (its logits are not used) and the chosen one for the others.

    Each step: ``logits [rows, vocab]`` for the rows in ``active`` → ``advance`` appends each
    generating row's argmax (special tokens other than ``<|endoftext|>``, and timestamps for a
    window with timestamps, suppressed) and returns the rows to keep when some window finished
    (``<|endoftext|>`` or ``max_new_tokens``), else ``None``: the caller then gathers those rows of
    its cache and cross K/V. With ``compact=False`` finished windows stay in the batch (their tokens
    are ignored) and ``advance`` always returns ``None``: for a device where gathering rows costs
    more than carrying them. ``begin_mask`` replaces ``mask`` for the first generated token
    (``WhisperTokenizer.suppress_masks``).
    """

    prompts: np.ndarray  # [N, prompt slots] int64 (language detections written in place)
    eot: int
    max_new_tokens: int | np.ndarray  # one bound, or one per window
    mask: np.ndarray  # [vocab] additive
    compact: bool = True
    begin_mask: np.ndarray | None = None
    timestamps: TimestampRules | None = None
    language_mask: np.ndarray | None = None
    tokens: list[list[int]] = field(init=False)
    active: np.ndarray = field(init=False)  # window index of each row
    next_ids: np.ndarray = field(init=False)  # [rows, T] int64: the decoder's next input_ids
    steps: int = field(init=False, default=0)
    fed: int = field(init=False, default=0)  # positions every row has fed

    def __post_init__(self):
        self.prompts = np.asarray(self.prompts)
        count = len(self.prompts)
        self.tokens = [[] for _ in range(count)]
        self.active = np.arange(count)
        self._finished = np.zeros(count, dtype=bool)
        self._bounds = np.broadcast_to(np.asarray(self.max_new_tokens, dtype=np.int64), (count,))
        self._finished[self._bounds <= 0] = True
        width = self.prompts.shape[1] if self.prompts.ndim == 2 else 0
        self._timed = np.isin(self.prompts[:, -1], TIMED_SLOTS) if width else np.zeros(count, bool)
        self._lengths = width - self._timed.astype(np.int64)
        self._detect = width > 1 and bool((self.prompts[:, 1] < 0).any())
        if self._timed.any() and self.timestamps is None:
            raise ValueError("a window with timestamps needs the timestamp rules")
        if self._detect and self.language_mask is None:
            raise ValueError("a window whose language is detected needs the language mask")
        first = 1 if self._detect else int(self._lengths.min(initial=width))
        self.next_ids = np.ascontiguousarray(self.prompts[:, :first], dtype=np.int64)

    @property
    def done(self) -> bool:
        return bool(self._finished.all())

    @property
    def finished(self) -> np.ndarray:
        """Per window: finished (``<|endoftext|>`` or its bound)."""
        return self._finished

    @property
    def timed(self) -> np.ndarray:
        """Per window: decoded with timestamps."""
        return self._timed

    def stop(self, windows) -> None:
        """Finish these windows now (their client has gone): they leave the batch at the next step."""
        self._finished[list(windows)] = True

    def sequence(self, window: int) -> list[int]:
        """The window's prompt (as far as it is known) and the tokens it generated."""
        return [*self.prompts[window, :self._lengths[window]].tolist(), *self.tokens[window]]

    def history(self) -> np.ndarray:
        """Every row's input so far, ``[rows, fed + T]``: its prompt and the tokens it generated
        (the last ones are its ``next_ids``), for a decoder that lost the row's self-attention cache
        and computes it again from the start. A finished row still in the batch (``compact=False``,
        or stopped since the last step) is padded with ``<|endoftext|>`` (its logits are ignored)."""
        width = self.fed + self.next_ids.shape[1]
        ids = []
        for window in self.active:
            known = self.sequence(window)[:width]
            if len(known) != width and not self._finished[window]:
                raise RuntimeError(f"window {window} has {len(known)} positions, {width} expected")
            ids.append([*known, *[self.eot] * (width - len(known))])
        return np.array(ids, dtype=np.int64)

    def _resolve_languages(self, logits: np.ndarray) -> None:
        """After the ``<|startoftranscript|>`` position: each detecting window's language."""
        rows = {int(window): row for row, window in enumerate(self.active)}
        slots = self.prompts[:, 1]
        for window in np.flatnonzero(slots == detect_from(0)):
            if int(window) in rows:
                slots[window] = int(np.argmax(logits[rows[int(window)]] + self.language_mask))
        for window in np.flatnonzero(slots < 0):
            source = int(window) - (-1 - int(slots[window]))
            if source >= 0 and slots[source] >= 0:
                slots[window] = slots[source]
            elif int(window) in rows:  # its clip's first window is not in this batch: its own
                slots[window] = int(np.argmax(logits[rows[int(window)]] + self.language_mask))
        self._detect = False

    def _choose(self, logits: np.ndarray, rows: list[int]) -> np.ndarray:
        """The argmax of the given rows under each one's masks (and timestamp rules)."""
        chosen = np.zeros(len(logits), dtype=np.int64)
        for row in rows:
            window = int(self.active[row])
            first = not self.tokens[window]
            if self._timed[window]:
                masked = logits[row] + (self.timestamps.begin if first else self.timestamps.mask)
                self.timestamps.apply(masked, self.tokens[window])
            else:
                mask = self.begin_mask if first and self.begin_mask is not None else self.mask
                masked = logits[row] + mask
            chosen[row] = int(np.argmax(masked))
        return chosen

    def advance(self, logits: np.ndarray) -> np.ndarray | None:
        self.fed += self.next_ids.shape[1]
        if self._detect and self.fed == 1:
            self._resolve_languages(logits)
        generating = [row for row, window in enumerate(self.active)
                      if not self._finished[window] and self.fed >= self._lengths[window]]
        chosen = self._choose(logits, generating)
        keep = []
        for row, window in enumerate(self.active):
            if self._finished[window]:
                continue
            if self.fed < self._lengths[window]:  # still feeding its prompt
                keep.append(row)
                continue
            token = int(chosen[row])
            if token == self.eot:
                self._finished[window] = True
                continue
            self.tokens[window].append(token)
            if len(self.tokens[window]) >= self._bounds[window]:
                self._finished[window] = True
            else:
                keep.append(row)
        self.steps += 1
        rows = None if not self.compact or len(keep) == len(self.active) else np.asarray(keep, dtype=np.int64)
        if rows is not None:
            self.active = self.active[rows]
        running = [w for w in self.active if not self._finished[w]]
        left = [int(self._lengths[w]) - self.fed for w in running]
        width = min(left) if left and min(left) > 0 else 1
        ids = []
        for window in self.active:
            known = self.sequence(window)[self.fed:self.fed + width]
            ids.append([*known, *[self.eot] * (width - len(known))])
        self.next_ids = np.array(ids, dtype=np.int64).reshape(len(self.active), width)
        return rows


def fill_languages(prompts: np.ndarray, start: int, stop: int) -> None:
    """Before decoding ``prompts[start:stop]``: a window that takes its clip's first window's
    detected language (``detect_from(k)``, k ≥ 1) gets it where that window was decoded earlier."""
    slots = prompts[:, 1]
    for window in range(start, stop):
        source = window - (-1 - int(slots[window])) if slots[window] < detect_from(0) else window
        if source < start and slots[source] >= 0:
            slots[window] = slots[source]


def cross_names(layers: int) -> list[str]:
    return [name for i in range(layers) for name in (f"cross_key_{i}", f"cross_value_{i}")]


# One decoder step: (input_ids [rows, T], past_self_kv, cross K/V by name, request parameters) →
# (logits [rows, vocab], present_self_kv) as numpy. The cross K/V are the caller's tensors
# (numpy in process, Triton tensors in whisper_decode): the loop only hands them on. With an
# ``input_cache_key`` in the parameters the decoder keeps the self-attention K/V: past_self_kv is
# None where the step sends none (the decoder's own), and the step asks only for the logits
# (present_self_kv: None).
DecoderStep = Callable[[np.ndarray, np.ndarray | None, Mapping[str, Any], Mapping[str, str]],
                       tuple[np.ndarray, np.ndarray | None]]
# The alignment call (word timestamps): like a step, but → alignment_weights [rows, heads, T, 1500].
AlignStep = Callable[[np.ndarray, np.ndarray, Mapping[str, Any], Mapping[str, str]], np.ndarray]
# The given rows of cross K/V tensors, as tensors of the same kind.
GatherRows = Callable[[Mapping[str, Any], np.ndarray], Mapping[str, Any]]


def gather_arrays(arrays: Mapping[str, np.ndarray], rows: np.ndarray) -> dict[str, np.ndarray]:
    return {name: np.ascontiguousarray(value[rows]) for name, value in arrays.items()}


class GreedyDecoder:
    """The greedy decoding loop over a KV-cached decoder step, shared by the Triton model
    ``whisper_decode`` (each step a BLS call to ``whisper_decoder``) and the in-process reference
    ``WhisperOnnx`` (each step an ONNX Runtime run): token selection is ``GreedyBatch``.

    ``cache_key``: the decoder keeps the cross K/V and the self-attention K/V of the current group
    under this key (the embedded target: ``onnx_runner.InputCache``, its state pair
    ``past_self_kv=present_self_kv``). The first step sends the cross K/V and a zero-length
    ``past_self_kv`` with the key; later steps send only ``input_ids``, the key and the windows
    still running (request parameters ``input_cache_key`` and ``input_cache_rows``), and ask only
    for the logits. A step that reaches a decoder instance without them (another instance, an
    evicted slot, a restart: ``onnx_runner.NOT_CACHED`` in an ``UpstreamError``) starts the
    running windows again: their cross K/V, a zero-length past and as ``input_ids`` each window's
    prompt and the tokens it generated so far (``GreedyBatch.history``; the decoder returns the
    logits of the last position whatever the input length). Without a key (the gpu target) every
    step sends the cross K/V of the running windows and the self-attention K/V, and gets the
    new self-attention K/V back."""

    def __init__(self, tokenizer: WhisperTokenizer, vocab_size: int, step: DecoderStep,
                 gather: GatherRows = gather_arrays, cache_key: str | None = None, align: AlignStep | None = None):
        self.eot, self.no_timestamps = tokenizer.eot, tokenizer.no_timestamps
        self.align = align
        self.mask, self.begin_mask = tokenizer.suppress_masks(vocab_size)
        self.timestamps = tokenizer.timestamp_rules(vocab_size)
        self.language_mask = tokenizer.language_mask(vocab_size)
        self.step = step
        self.gather = gather
        self.cache_key = cache_key

    def decode(self, prompts: np.ndarray, max_new_tokens: int | np.ndarray, cross: Mapping[str, Any],
               heads: int, head_dim: int, compact: bool = True,
               on_step: Callable[["GreedyBatch"], None] | None = None) -> list[list[int]]:
        """``prompts [N, 4]`` (``GreedyBatch``'s prompt slots: a detected language is written into
        them) and the encoder's cross K/V of those N windows → generated ids per window. ``compact=False``: finished windows stay in the batch (``GreedyBatch``), for cross
        K/V whose rows cannot be gathered here (on a GPU). ``on_step(state)``: after every step
        (``state.tokens`` so far, ``state.finished``), e.g. to stream partial transcripts, and once
        before the first (the encoder may have run for seconds: a client gone meanwhile costs no step)."""
        state = GreedyBatch(prompts, self.eot, max_new_tokens, self.mask, compact=compact, begin_mask=self.begin_mask,
                            timestamps=self.timestamps, language_mask=self.language_mask)

        def empty_past(rows: int) -> np.ndarray:  # [rows, 2 * layers, heads, 0, head_dim]
            return np.zeros((rows, len(cross), heads, 0, head_dim), np.float32)

        past: np.ndarray | None = empty_past(len(prompts))  # first step: zero-length self-attention cache
        sent = cross  # first step: the tensors themselves (a caching decoder stores them)
        if on_step is not None:
            on_step(state)
        while not state.done:
            if self.cache_key is None:
                logits, present = self.step(state.next_ids, past, sent, {})
            else:
                parameters = {"input_cache_key": self.cache_key,
                              "input_cache_rows": ",".join(str(w) for w in state.active)}
                try:
                    logits, _ = self.step(state.next_ids, past, sent, parameters)
                except UpstreamError as error:
                    if NOT_CACHED not in str(error):
                        raise
                    logits, _ = self.step(state.history(), empty_past(len(state.active)),
                                          self.gather(cross, state.active), parameters)
            rows = state.advance(logits)
            if on_step is not None:
                on_step(state)
            if self.cache_key is not None:  # the decoder keeps both K/V: later steps send neither
                past, sent = None, {}
                continue
            past = present if rows is None else present[rows]
            if rows is not None:
                sent = self.gather(sent, rows)
        words = np.flatnonzero(state.prompts[:, -1] == WORDS_SLOT) if state.prompts.ndim == 2 else []
        if len(words) and self.align is not None:
            self.align_words(state, words, cross, empty_past(1)[0], compact)
        return state.tokens

    def align_words(self, state: "GreedyBatch", words: np.ndarray, cross: Mapping[str, Any], empty: np.ndarray,
                    compact: bool) -> None:
        """One decoder call over the final tokens of the windows that want word times
        (``words.alignment_sequence``, padded with ``<|endoftext|>``: causal, so padding changes no
        earlier position) → their tokens become ``AlignedTokens`` with the alignment heads'
        cross-attention. Their cross K/V are sent again (the decoder's cache has let finished
        windows go); on a device (``compact=False``) every row of the group is sent as it is."""
        rows = words if compact else np.arange(len(state.prompts))
        sequences = [alignment_sequence(state.prompts[w], state.tokens[w], self.no_timestamps, self.eot)
                     if w in words else [int(state.prompts[w, 0])] for w in rows]
        width = max(len(sequence) for sequence in sequences)
        ids = np.array([[*sequence, *[self.eot] * (width - len(sequence))] for sequence in sequences], dtype=np.int64)
        sent = cross if len(rows) == len(state.prompts) else self.gather(cross, rows)
        parameters = {} if self.cache_key is None else {"input_cache_key": self.cache_key,
                                                        "input_cache_rows": ",".join(str(w) for w in rows)}
        weights = self.align(ids, np.repeat(empty[None], len(rows), axis=0), sent, parameters)
        for position, window in enumerate(rows):
            if window in words:
                state.tokens[window] = AlignedTokens(state.tokens[window], weights[position, :, :len(sequences[position])])


@dataclass(frozen=True)
class DecoderShape:
    layers: int
    heads: int
    head_dim: int
    vocab_size: int
    n_mels: int

    @classmethod
    def from_sessions(cls, encoder, decoder) -> "DecoderShape":
        """Read the architecture from the ONNX graphs' static dims."""
        inputs = {i.name: i.shape for i in decoder.get_inputs()}
        layers = sum(1 for name in inputs if name.startswith("cross_key_"))
        _, heads, head_dim, _ = inputs["cross_key_0"]
        vocab = decoder.get_outputs()[0].shape[1]
        n_mels = encoder.get_inputs()[0].shape[1]
        return cls(layers, int(heads), int(head_dim), int(vocab), int(n_mels))
