"""Host-side conventions for rows of token ids, the same for every method's inference.

A decoded row (`decoding.DecodeOutput.tokens`, beam search's tokens) holds the emitted tokens,
its first EOS included, then padding; its text is decoded from `text_ids`. Batches and lengths
are padded to `bucket` sizes: few distinct shapes, so `jax.jit` keeps few executables.
"""

from __future__ import annotations

import itertools
from typing import Any, Optional, Sequence

import numpy as np


def text_ids(row: Any, eos_id: int, pad_id: int = 0) -> list[int]:
  """The ids a row's text is decoded from: those before its first EOS, the pad id dropped
  (not taken as the end: a model may emit it before EOS, an ordinary vocabulary entry that
  SentencePiece decodes to nothing)."""
  tokens = itertools.takewhile(lambda t: t != eos_id, np.asarray(row).reshape(-1).tolist())
  return [int(t) for t in tokens if t != pad_id]


def padded(rows: Sequence[Sequence[int]], length: int, batch: Optional[int] = None) -> np.ndarray:
  """(batch or len(rows), length) int32: each row's ids from the left, zeros after (and in the
  rows beyond `rows`)."""
  out = np.zeros((len(rows) if batch is None else batch, length), np.int32)
  for i, row in enumerate(rows):
    out[i, :len(row)] = row
  return out


def emitted_lengths(rows: np.ndarray, eos_id: int) -> np.ndarray:
  """int32 tokens per row of (..., length) `rows` up to and including the first EOS (the full
  length without one): `DecodeOutput.lengths` of rows that come without it (beam search)."""
  rows = np.asarray(rows)
  is_eos = rows == eos_id
  first = np.argmax(is_eos, axis=-1)
  return np.where(is_eos.any(axis=-1), first + 1, rows.shape[-1]).astype(np.int32)


def bucket(n: int, minimum: int) -> int:
  """The padded size of `n` rows or positions: the smallest `minimum * 2**k` >= n (a multiple
  of `minimum`, e.g. a chunk length that must divide it)."""
  if minimum < 1:
    raise ValueError(f"bucket: minimum must be >= 1, got {minimum}")
  size = minimum
  while size < n:
    size *= 2
  return size
