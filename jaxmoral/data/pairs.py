"""(input, target) text pairs: read them from data files, hold out a deterministic part.

Plain Python (no TensorFlow): a run that reads its rows from an index cache still knows how
its pairs file was split.
"""

from __future__ import annotations

import os
import zlib
from typing import Sequence

from jaxmoral.data import readers

Pairs = Sequence[tuple[str, str]]


def read_pairs(path: str | os.PathLike, *, input_field: str, target_field: str,
               on_error: readers.OnError = "raise") -> list[tuple[str, str]]:
  """(input, target) pairs from a .tsv, .csv or .jsonl file with those columns / keys."""
  suffix = os.path.splitext(str(path))[1].lower()
  fields = [input_field, target_field]
  if suffix == ".tsv":
    rows = readers.read_tsv(path, columns=fields, on_error=on_error)
  elif suffix == ".csv":
    rows = readers.read_csv(path, columns=fields, on_error=on_error)
  elif suffix == ".jsonl":
    rows = readers.read_jsonl(path, required=fields, text=fields, on_error=on_error)
  else:
    raise ValueError(f"{path}: unknown data file type {suffix!r} (want .tsv, .csv or .jsonl)")
  return [(r[input_field], r[target_field]) for r in rows]


# How `split_pairs` picks the held-out pairs. "hash": by the pair's text, so the file's order
# cannot skew the held-out set (alternating labels would put one at every 10th position) and a
# pair keeps its side when pairs are added. "position": every n-th pair (older runs, the demo).
HELDOUT_RULES = ("hash", "position")


def pair_hash(pair: tuple[str, str]) -> int:
  """A stable hash of a pair's text (the same on every machine and Python run)."""
  return zlib.crc32("\t".join(pair).encode("utf-8"))


def split_pairs(pairs: Pairs, *, validation_every: int = 10, rule: str = "hash"
                ) -> dict[str, list[tuple[str, str]]]:
  """A deterministic train/validation split holding out one pair in `validation_every`.

  Args:
    rule: One of HELDOUT_RULES. "hash" holds out the pairs whose `pair_hash` is 0 modulo
      `validation_every` (at least one of two or more pairs: that of smallest remainder);
      "position" every `validation_every`-th pair from the first.

  Returns:
    {"train": [...], "validation": [...]}, each in the pairs' order.
  """
  if validation_every < 2:
    raise ValueError(f"validation_every must be >= 2, got {validation_every}")
  if rule not in HELDOUT_RULES:
    raise ValueError(f"split_pairs: rule must be one of {HELDOUT_RULES}, got {rule!r}")
  if rule == "position":
    held = [not i % validation_every for i in range(len(pairs))]
  else:
    remainders = [pair_hash(p) % validation_every for p in pairs]
    held = [r == 0 for r in remainders]
    if len(pairs) >= 2 and not any(held):
      held[remainders.index(min(remainders))] = True
  return {"train": [p for p, h in zip(pairs, held, strict=True) if not h],
          "validation": [p for p, h in zip(pairs, held, strict=True) if h]}
