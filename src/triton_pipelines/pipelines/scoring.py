"""Logits → probabilities and the best classes, for every classifier here: the intent classifier
(text) and the image classifier (vision)."""

from __future__ import annotations

import numpy as np


def softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax in float64, returned as float32."""
    values = np.asarray(logits, dtype=np.float64)
    values = values - values.max(axis=-1, keepdims=True)
    np.exp(values, out=values)
    values /= values.sum(axis=-1, keepdims=True)
    return values.astype(np.float32)


def top_k(probabilities: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices (int64) and values of the k largest per row, descending; ties by lower class id."""
    order = np.argsort(-probabilities, axis=-1, kind="stable")[..., :k].astype(np.int64, copy=False)
    return order, np.take_along_axis(probabilities, order, axis=-1)
