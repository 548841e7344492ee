"""Host-side conventions for rows of token ids.

Where a decoded row ends, which ids its text is decoded from, and the padded sizes rows are
batched at. Every method's inference code uses these, so a row means the same everywhere:

- A decoded row (`decoding.DecodeOutput.tokens`, beam search's tokens) holds the emitted
  tokens, its first EOS included, then padding. `emitted_lengths` counts them.
- Its text comes from `text_ids`: the ids before the first EOS with the pad id dropped.
- Batches and lengths are padded to `bucket` sizes: few distinct shapes, so `jax.jit` keeps
  few executables.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def text_ids(row: Any, eos_id: int, pad_id: int = 0) -> list[int]:
  """The ids a row's text is decoded from: those before its first EOS, the pad id dropped.

  The pad id is dropped rather than taken as the row's end: a model may emit it before EOS
  (it is an ordinary vocabulary entry) and SentencePiece decodes it to nothing, so the text
  is that of the whole emitted row. In data rows padding only follows EOS, where either
  rule gives the same ids.

  Args:
    row: One row of token ids (a sequence or 1-D array).
    eos_id: The end-of-sequence id.
    pad_id: The padding id.
  """
  out = []
  for token in np.asarray(row).reshape(-1).tolist():
    if token == eos_id:
      break
    if token != pad_id:
      out.append(int(token))
  return out


def emitted_lengths(rows: np.ndarray, eos_id: int) -> np.ndarray:
  """Emitted tokens per row: up to and including the first EOS, the full row without one.

  `decoding.DecodeOutput.lengths` of rows that only come with their tokens (beam search).

  Args:
    rows: (..., length) token ids.
    eos_id: The end-of-sequence id.

  Returns:
    int32 array shaped as `rows` without its last axis.
  """
  rows = np.asarray(rows)
  is_eos = rows == eos_id
  first = np.argmax(is_eos, axis=-1)
  return np.where(is_eos.any(axis=-1), first + 1, rows.shape[-1]).astype(np.int32)


def bucket(n: int, minimum: int) -> int:
  """The padded size of `n` rows or positions: the smallest `minimum * 2**k` >= n.

  Args:
    n: The size to pad.
    minimum: The smallest size (also the step a multiple of which every size is, e.g. a
      chunk length that must divide it).

  Raises:
    ValueError: `minimum` < 1.
  """
  if minimum < 1:
    raise ValueError(f"bucket: minimum must be >= 1, got {minimum}")
  size = minimum
  while size < n:
    size *= 2
  return size
