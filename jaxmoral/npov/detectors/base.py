"""What every NPOV detector returns: example scores plus word-level scores."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import scipy.stats

# The two error types, in the order every table and plot reports them.
ERRORS = ("hallucination", "coverage")


@dataclasses.dataclass(frozen=True)
class WordScore:
  """A score for one content word (stopwords are never scored): `field` is "response"
  (hallucination scores) or "pro" / "con" (coverage scores of argument words), `index` the
  argument's within its side (0 for the response), [start, end) the characters in that
  field's text; a higher `score` is more suspect."""
  field: str
  index: int
  text: str
  start: int
  end: int
  score: float

  def to_json(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Detection:
  """Detector output for one example, higher scores meaning "more likely an error": the
  example-level scores, and those of every response / input-argument content word."""
  hallucination: float
  coverage: float
  response_words: tuple[WordScore, ...] = ()
  argument_words: tuple[WordScore, ...] = ()

  def to_json(self) -> dict[str, Any]:
    return {"hallucination": float(self.hallucination), "coverage": float(self.coverage),
            "response_words": [w.to_json() for w in self.response_words],
            "argument_words": [w.to_json() for w in self.argument_words]}


def gmean(values: Any, floor: float = 1e-12) -> float:
  """Geometric mean with a floor (a zero would otherwise make every example tie at 0)."""
  values = np.asarray(values, np.float64)
  if values.size == 0:
    return 1.0  # Nothing to explain counts as fully explained.
  return float(scipy.stats.gmean(np.maximum(values, floor)))
