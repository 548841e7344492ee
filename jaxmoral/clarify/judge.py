"""The judge: a distribution over judgment classes from one decoder step (Delphi's convention).

A judge is any T5 whose output for `judge: <situation>` starts with a class token. The
distribution over the C classes is the probability of each configured class token at the first
output position, renormalised over the class tokens -- which equals a softmax over just the C
class-token logits. One forward step, no free generation.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxmoral.clarify import formats
from jaxmoral.models.t5 import T5

Array = jax.Array


def class_distribution(model: T5, params: Any, encoder_input_tokens: Array,
                       class_token_ids: Array) -> Array:
  """(B, C) class probabilities from the first decoder step (jittable).

  Args:
    model: The judge T5.
    params: Its parameters.
    encoder_input_tokens: (B, L) int32 judge inputs (0-padded).
    class_token_ids: (C,) int32 vocabulary ids of the class tokens.

  Returns:
    (B, C) float32, rows sum to 1: softmax over the class-token logits.
  """
  mask = encoder_input_tokens != model.config.pad_token_id
  encoded = model.apply({"params": params}, encoder_input_tokens, encoder_mask=mask,
                        method=T5.encode)
  start = jnp.full((encoder_input_tokens.shape[0], 1), model.config.decoder_start_token_id,
                   jnp.int32)
  logits, _ = model.apply({"params": params}, encoded, mask, start, method=T5.decode)
  class_logits = jnp.take(logits[:, 0].astype(jnp.float32), class_token_ids, axis=-1)
  return jax.nn.softmax(class_logits, axis=-1)


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


def judgments(distributions: Any, classes: Sequence[str] = formats.JUDGMENTS) -> list[str]:
  """Argmax class names of (N, C) distributions."""
  return [classes[int(i)] for i in np.argmax(np.asarray(distributions), axis=-1)]
