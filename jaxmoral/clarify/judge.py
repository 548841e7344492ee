"""The judge: a distribution over judgment classes from one decoder step (Delphi's convention).

A judge is any T5 whose output for `judge: <situation>` starts with a class token. The
distribution over the C classes is the probability of each configured class token at the first
output position, renormalised over the class tokens -- which equals a softmax over just the C
class-token logits. One forward step, no free generation (`inference.class_distribution`,
run by `InferenceModel.label_distribution`).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from jaxmoral.clarify import formats


def class_token_ids(vocabulary: Any, classes: Sequence[str]) -> np.ndarray:
  """The ids of the class strings; each must be exactly one token of the vocabulary."""
  classes = formats.check_classes(classes, field="judge classes")
  ids = []
  for c in classes:
    pieces = list(vocabulary.encode(c))
    if len(pieces) != 1:
      raise ValueError(f"judge class {c!r} is {len(pieces)} tokens {pieces} in this vocabulary; "
                       f"each class must be ONE token: give the judge's class strings with "
                       f"--judge_classes=BAD,OK,GOOD (train-ppo and gin files: "
                       f"reward.RewardConfig.judge_classes)")
    ids.append(pieces[0])
  return np.asarray(ids, np.int32)


def fitting_classes(vocabulary: Any,
                    preferred: Sequence[str] = formats.T5_JUDGE_CLASSES) -> tuple[str, ...]:
  """The judge's class strings when none are given: `preferred` if each is one token of the
  vocabulary, else the demo vocabulary's (`formats.DEMO_JUDGE_CLASSES`) if they are, else
  `preferred` (whose use then fails naming the class and `--judge_classes`)."""
  for classes in (tuple(preferred), formats.DEMO_JUDGE_CLASSES):
    if all(len(list(vocabulary.encode(c))) == 1 for c in classes):
      return classes
  return tuple(preferred)
