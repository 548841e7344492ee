"""The NLI answer filter: drop answers that the situation entails or contradicts.

A pluggable T5 scorer of `nli premise: <situation> hypothesis: <answer>` over the three label
strings (entailment, neutral, contradiction; configurable). Batched and jitted through
`InferenceModel.label_distribution`. An answer is filtered when the most probable label is
entailment or contradiction (Pyatkin et al.: such an answer adds nothing, or denies the
situation).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np

from jaxmoral.clarify import formats
from jaxmoral.clarify import models


@dataclasses.dataclass(frozen=True)
class NLIScorer:
  """A loaded NLI model and its label strings (in entailment, neutral, contradiction order)."""
  model: models.ClarifyModel
  labels: tuple[str, ...] = formats.NLI_LABELS

  def __post_init__(self):
    formats.check_classes(self.labels, field="NLIScorer.labels", names=formats.NLI_LABELS)

  def probabilities(self, premises: Sequence[str], hypotheses: Sequence[str]) -> np.ndarray:
    """(N, 3) label probabilities."""
    if len(premises) != len(hypotheses):
      raise ValueError(f"NLIScorer: {len(premises)} premises but {len(hypotheses)} hypotheses")
    inputs = [formats.nli_input(premise=p, hypothesis=h)
              for p, h in zip(premises, hypotheses, strict=True)]
    return self.model.label_distribution(inputs, self.labels)


def filtered_from_probabilities(probabilities: np.ndarray) -> np.ndarray:
  """(N,) bool: argmax is entailment (0) or contradiction (2)."""
  return np.argmax(np.asarray(probabilities), axis=-1) != 1


def filter_answers(scorer: Optional[NLIScorer], situations: Sequence[str],
                   answers: Sequence[str], *, enabled: bool = True) -> np.ndarray:
  """(N,) bool, True where the answer is filtered out; all False when disabled or no scorer."""
  if not enabled or scorer is None:
    return np.zeros(len(answers), bool)
  return filtered_from_probabilities(scorer.probabilities(situations, answers))
