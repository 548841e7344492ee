"""ROUGE-1 detector: unigram overlap of response and arguments (no model needed).

Tokens are `text.content_stems` (stopwords removed, stemmed); counts are clipped as in ROUGE-1.
- hallucination = 1 - precision of the response against all given arguments;
- coverage = 1 - min over the two perspectives of the recall of that side's arguments;
- word level: a response word scores 1 if its stem occurs in no argument (else 0); an argument
  word scores 1 if its stem occurs nowhere in the response.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Sequence

import gin

from jaxmoral.npov import task
from jaxmoral.npov import text as text_lib
from jaxmoral.npov.detectors import base


def rouge1_precision_recall(prediction: Sequence[str], reference: Sequence[str]
                            ) -> tuple[float, float]:
  """Clipped unigram precision and recall of token sequences (0 for an empty side)."""
  overlap = sum((collections.Counter(prediction) & collections.Counter(reference)).values())
  return (overlap / len(prediction) if prediction else 0.0,
          overlap / len(reference) if reference else 0.0)


@gin.configurable
@dataclasses.dataclass(frozen=True, kw_only=True)
class RougeDetector:
  """ROUGE-1 hallucination / coverage detector.

  Attributes:
    include_query: Also count the query as reference for hallucination (the paper uses the
      arguments only; the response introduction restates the query).
  """
  include_query: bool = False

  def detect(self, example: task.NpovExample) -> base.Detection:
    """Scores one example (its `response` against its arguments)."""
    response_tokens = text_lib.content_stems(example.response)
    reference = [example.query] if self.include_query else []
    reference_tokens = [t for s in reference + list(example.arguments)
                        for t in text_lib.content_stems(s)]
    precision, _ = rouge1_precision_recall(response_tokens, reference_tokens)
    by_side = ([t for s in getattr(example, side) for t in text_lib.content_stems(s)]
               for side in task.SIDES)
    recalls = [rouge1_precision_recall(response_tokens, side_tokens)[1]
               for side_tokens in by_side if side_tokens]
    coverage = 1.0 - min(recalls) if recalls else 0.0
    reference_set, response_set = set(reference_tokens), set(response_tokens)
    response_words = tuple(
        base.WordScore("response", 0, w.text, w.start, w.end, float(w.stem not in reference_set))
        for w in text_lib.words(example.response) if not w.is_stopword)
    argument_words = tuple(
        base.WordScore(side, i, w.text, w.start, w.end, float(w.stem not in response_set))
        for side in task.SIDES for i, arg in enumerate(getattr(example, side))
        for w in text_lib.words(arg) if not w.is_stopword)
    return base.Detection(1.0 - precision, coverage, response_words, argument_words)

  def detect_batch(self, examples: Sequence[task.NpovExample]) -> list[base.Detection]:
    return [self.detect(e) for e in examples]
