"""Synthetic hallucination and coverage errors made from error-free examples.

The response is never changed; only the input is:
- hallucination: one given argument is removed, so the response states an argument the
  input no longer has;
- coverage error: one unused argument of the same topic is added, so the response misses it;
- paraphrased variants replace every input argument by another text of its cluster, so
  word overlap with the (unchanged) response drops and detectors cannot rely on it alone.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from jaxmoral.npov import knowledge_base as kb_lib
from jaxmoral.npov import task


def _given_slots(example: task.NpovExample) -> list[tuple[str, int]]:
  """(side, index) of every given argument, pro first."""
  return [(side, i) for side in task.SIDES for i in range(len(getattr(example, side)))]


def _unused_clusters(example: task.NpovExample, topic: kb_lib.Topic) -> list[int]:
  """Ids of the topic's clusters that the example does not use, in order."""
  used = set(example.clusters("pro")) | set(example.clusters("con"))
  return [i for i in range(len(topic.clusters)) if i not in used]


def make_hallucination(example: task.NpovExample, rng: np.random.Generator
                       ) -> Optional[task.NpovExample]:
  """Removes one given argument (uniformly chosen); None if the example has none."""
  slots = _given_slots(example)
  if not slots:
    return None
  side, i = slots[int(rng.integers(len(slots)))]
  texts, clusters = list(getattr(example, side)), list(example.clusters(side))
  removed = texts.pop(i)
  clusters.pop(i)
  return example.replace(
      id=f"{example.id}/hallucination", hallucination=True, coverage=False,
      removed_argument=removed, **{side: tuple(texts), f"{side}_clusters": tuple(clusters)})


def make_coverage(example: task.NpovExample, topic: kb_lib.Topic, rng: np.random.Generator
                  ) -> Optional[task.NpovExample]:
  """Adds one unused argument of the same topic on its own side, at a random position; None
  when the topic has no unused argument."""
  unused = _unused_clusters(example, topic)
  if not unused:
    return None
  cluster_id = unused[int(rng.integers(len(unused)))]
  cluster = topic.clusters[cluster_id]
  side = cluster.stance
  texts, clusters = list(getattr(example, side)), list(example.clusters(side))
  position = int(rng.integers(len(texts) + 1))
  texts.insert(position, cluster.texts[0])
  clusters.insert(position, cluster_id)
  return example.replace(
      id=f"{example.id}/coverage", hallucination=False, coverage=True,
      added_argument=cluster.texts[0], **{side: tuple(texts), f"{side}_clusters": tuple(clusters)})


def make_substitution(example: task.NpovExample, topic: kb_lib.Topic, rng: np.random.Generator
                      ) -> Optional[task.NpovExample]:
  """Replaces one given argument (uniformly chosen) by an unused one of the same side.

  Both errors at once, with as many arguments per side as the response has points: a
  detector that only counts them cannot tell this from the error-free example. None when the
  example has no argument, or its side no unused argument.
  """
  slots = _given_slots(example)
  if not slots:
    return None
  side, i = slots[int(rng.integers(len(slots)))]
  unused = [c for c in _unused_clusters(example, topic) if topic.clusters[c].stance == side]
  if not unused:
    return None
  cluster_id = unused[int(rng.integers(len(unused)))]
  texts, clusters = list(getattr(example, side)), list(example.clusters(side))
  removed = texts[i]
  texts[i], clusters[i] = topic.clusters[cluster_id].texts[0], cluster_id
  return example.replace(
      id=f"{example.id}/substitution", hallucination=True, coverage=True,
      removed_argument=removed, added_argument=texts[i],
      **{side: tuple(texts), f"{side}_clusters": tuple(clusters)})


def paraphrase(example: task.NpovExample, topic: kb_lib.Topic, rng: np.random.Generator
               ) -> task.NpovExample:
  """Replaces each input argument by another member of its cluster (kept if it has none)."""
  changes = {}
  added = example.added_argument
  for side in task.SIDES:
    texts = []
    for text, cluster_id in zip(getattr(example, side), example.clusters(side), strict=True):
      others = [] if cluster_id < 0 else [t for t in topic.clusters[cluster_id].texts if t != text]
      new = others[int(rng.integers(len(others)))] if others else text
      if text == example.added_argument:
        added = new
      texts.append(new)
    changes[side] = tuple(texts)
  return example.replace(id=f"{example.id}/paraphrased", paraphrased=True,
                         added_argument=added, **changes)


# The paper's two test slices, in the order its Table 1 reports them.
SLICES = ("unparaphrased", "paraphrased")


def make_test_slices(examples: Sequence[task.NpovExample], topics: Sequence[kb_lib.Topic], *,
                     seed: int) -> dict[str, list[task.NpovExample]]:
  """The paper's synthetic test slices from error-free examples: {"unparaphrased": [...],
  "paraphrased": [...]}, each with, per source example, the error-free example and its
  hallucination and coverage variants (when they can be made)."""
  by_id = {t.id: t for t in topics}
  rng = np.random.default_rng(seed)
  slices: dict[str, list[task.NpovExample]] = {name: [] for name in SLICES}
  for example in examples:
    if example.topic not in by_id:
      raise KeyError(f"make_test_slices: example {example.id!r} has topic {example.topic!r} "
                     "not in the knowledge base")
    topic = by_id[example.topic]
    variants = [example.replace(hallucination=False, coverage=False),
                make_hallucination(example, rng), make_coverage(example, topic, rng)]
    variants = [v for v in variants if v is not None]
    slices["unparaphrased"].extend(variants)
    slices["paraphrased"].extend(paraphrase(v, topic, rng) for v in variants)
  return slices


def training_examples(examples: Sequence[task.NpovExample], topics: Sequence[kb_lib.Topic], *,
                      seed: int) -> list[task.NpovExample]:
  """What a classifier learns from: both slices of `make_test_slices`, unparaphrased first."""
  slices = make_test_slices(examples, topics, seed=seed)
  return [e for name in SLICES for e in slices[name]]
