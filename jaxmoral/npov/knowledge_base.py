"""Pro/con argument knowledge bases: PERSPECTRUM and a plain JSONL format, plus sampling.

A knowledge base is a list of `Topic`s. Each topic has a query and argument *clusters*; the
texts in one cluster are paraphrases of each other (the first is the canonical wording).
`read_perspectrum` reads a claim as the query, its SUPPORT / UNDERMINE clusters as pro / con;
`read_kb_jsonl` reads one topic per line, written by hand::

  {"id": "uniforms", "query": "School uniforms should be mandatory",
   "pro": [["Uniforms reduce bullying", "Uniforms make bullying rarer"], "..."],
   "con": ["Uniforms limit self-expression"], "split": "train"}

Each argument is a string or a list of paraphrases. `id` and `split` are optional.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any, Iterator, Optional, Sequence

import numpy as np

from jaxmoral import fileio
from jaxmoral.data import corpus_sources
from jaxmoral.data import readers
from jaxmoral.npov import task

SPLITS = ("train", "dev", "test")


@dataclasses.dataclass(frozen=True)
class Cluster:
  """Paraphrases of one argument. `texts[0]` is the canonical wording."""
  stance: str
  texts: tuple[str, ...]

  def __post_init__(self):
    if self.stance not in task.SIDES:
      raise ValueError(f"Cluster.stance must be 'pro' or 'con', got {self.stance!r}")
    if not self.texts:
      raise ValueError("Cluster.texts is empty")


@dataclasses.dataclass(frozen=True)
class Topic:
  """One query with all its argument clusters (cluster ids index `clusters`); `split` is
  "train", "dev", "test" or "" (unassigned; see `split_topics`)."""
  id: str
  query: str
  clusters: tuple[Cluster, ...]
  split: str = ""

  def cluster_ids(self, stance: str) -> list[int]:
    return [i for i, c in enumerate(self.clusters) if c.stance == stance]


def _clean(text: str) -> str:
  # Braces delimit fields of the model input (see task.py); PERSPECTRUM has none, but be safe.
  return " ".join(text.replace("{", "(").replace("}", ")").split())


def read_perspectrum(directory: str | os.PathLike) -> list[Topic]:
  """Reads PERSPECTRUM (`perspectrum_with_answers_v1.0.json`, `perspective_pool_v1.0.json`,
  `dataset_split_v1.0.json`) into topics; claims without a pro and a con cluster are kept
  (sampling skips them). A released dataset: keys other than those read pass through."""
  def load(name: str) -> Any:
    path = fileio.join(directory, name)
    if not fileio.isfile(path):
      raise FileNotFoundError(f"PERSPECTRUM file missing: {path}")
    return json.loads(fileio.read_text(path))
  claims = load("perspectrum_with_answers_v1.0.json")
  pool = {p["pId"]: p["text"] for p in load("perspective_pool_v1.0.json")}
  split_of = load("dataset_split_v1.0.json")
  stance_map = {"SUPPORT": "pro", "UNDERMINE": "con"}
  topics = []
  for claim in claims:
    clusters = []
    for i, group in enumerate(claim["perspectives"]):
      stance = stance_map.get(group["stance_label_3"].upper())
      if stance is None:
        continue
      missing = [p for p in group["pids"] if p not in pool]
      if missing:
        raise readers.DataError(fileio.join(directory, "perspectrum_with_answers_v1.0.json"),
                                0, f"claim {claim['cId']} cluster {i}: perspective ids "
                                f"{missing} not in the pool", "pids")
      clusters.append(Cluster(stance, tuple(_clean(pool[p]) for p in group["pids"])))
    topics.append(Topic(str(claim["cId"]), _clean(claim["text"]), tuple(clusters),
                        split_of.get(str(claim["cId"]), "")))
  return topics


# The keys of a topic line; any other is an error ("pros" would read as a topic without pros).
KB_FIELDS = ("id", "query", "pro", "con", "split")


def read_kb_jsonl(path: str | os.PathLike) -> list[Topic]:
  """Reads the plain JSONL knowledge base format (module docstring).

  Raises:
    readers.DataError: naming the file, line and field of a malformed topic, an unknown key
      (`readers.UnknownFieldError`, naming the closest of `KB_FIELDS`), or an empty file.
  """
  path = str(path)
  rows = readers.read_jsonl(path, required=("query",), text=("query",), optional=KB_FIELDS,
                            allow_empty=False)
  topics = []
  for row, line in zip(rows, rows.lines, strict=False):
    clusters = []
    for side in task.SIDES:
      value = row.get(side, [])
      if not isinstance(value, list):
        raise readers.DataError(path, line, "expected a list of arguments", side)
      for j, arg in enumerate(value):
        texts = [arg] if isinstance(arg, str) else arg
        if (not isinstance(texts, list) or not texts
            or not all(isinstance(t, str) and t.strip() for t in texts)):
          raise readers.DataError(path, line, "an argument must be a non-empty string or a "
                                  "non-empty list of non-empty strings", f"{side}[{j}]")
        clusters.append(Cluster(side, tuple(_clean(t) for t in texts)))
    split = row.get("split", "")
    if split not in ("",) + SPLITS:
      raise readers.DataError(path, line, f"unknown split {split!r}; use {SPLITS}", "split")
    topics.append(Topic(str(row.get("id", _clean(row["query"]))), _clean(row["query"]),
                        tuple(clusters), split))
  ids = [t.id for t in topics]
  if len(set(ids)) != len(ids):
    dup = next(i for i in ids if ids.count(i) > 1)
    raise readers.DataError(path, 0, f"duplicate topic id {dup!r}", "id")
  return topics


def split_topics(topics: Sequence[Topic], *, dev_fraction: float = 0.1,
                 test_fraction: float = 0.2) -> list[Topic]:
  """Assigns a split to topics without one, by a stable hash of the topic id.

  Splitting by topic keeps the test queries (and their arguments) unseen in training.
  """
  if not (0 <= dev_fraction and 0 <= test_fraction and dev_fraction + test_fraction < 1):
    raise ValueError(f"split_topics: bad fractions dev={dev_fraction} test={test_fraction}")

  def split_of(topic_id: str) -> str:
    u = int(hashlib.sha256(topic_id.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return "test" if u < test_fraction else "dev" if u < test_fraction + dev_fraction else "train"

  return [t if t.split else dataclasses.replace(t, split=split_of(t.id)) for t in topics]


def sample_examples(topics: Sequence[Topic], *, seed: int, split: Optional[str] = None,
                    examples_per_topic: int = 1, max_per_side: int = 3,
                    same_count_per_side: bool = True) -> list[task.NpovExample]:
  """Error-free examples of the topics of `split` (None: all) with a pro and a con cluster:
  1..`max_per_side` canonical arguments per side, the response their `task.template_response`.

  `same_count_per_side` gives as many arguments on each side (a balanced answer); a synthetic
  error then always unbalances the sides, so a detector can tell every error from every
  error-free example by the counts alone. False draws each side's count on its own.
  """
  if max_per_side < 1:
    raise ValueError(f"sample_examples: max_per_side must be >= 1, got {max_per_side}")
  rng = np.random.default_rng(seed)
  out = []
  for topic in topics:
    if split is not None and topic.split != split:
      continue
    ids = {side: topic.cluster_ids(side) for side in task.SIDES}
    limit = min(len(ids["pro"]), len(ids["con"]), max_per_side)
    if limit == 0:
      continue
    for k in range(examples_per_topic):
      if same_count_per_side:
        counts = dict.fromkeys(task.SIDES, int(rng.integers(1, limit + 1)))
      else:
        counts = {side: int(rng.integers(1, min(len(ids[side]), max_per_side) + 1))
                  for side in task.SIDES}
      chosen = {side: tuple(sorted(rng.choice(ids[side], size=counts[side], replace=False)
                                   .tolist())) for side in task.SIDES}
      texts = {side: tuple(topic.clusters[i].texts[0] for i in chosen[side])
               for side in task.SIDES}
      out.append(task.NpovExample(
          id=f"{topic.id}/{k}", topic=topic.id, query=topic.query, pro=texts["pro"],
          con=texts["con"], pro_clusters=chosen["pro"], con_clusters=chosen["con"],
          response=task.template_response(topic.query, texts["pro"], texts["con"]),
          hallucination=False, coverage=False))
  return out


def attach_clusters(examples: Sequence[task.NpovExample], topics: Sequence[Topic]
                    ) -> list[task.NpovExample]:
  """Links examples to the knowledge base (as synthetic errors need): an example's topic is the
  one whose id or query equals its `topic`/`query`, an argument's cluster the one with its text.

  Raises:
    KeyError: naming the example whose topic or argument is not in the knowledge base.
  """
  by_key = {}
  for t in topics:
    by_key[t.id] = t
    by_key.setdefault(t.query, t)
  out = []
  for e in examples:
    topic = by_key.get(e.topic) or by_key.get(e.query)
    if topic is None:
      raise KeyError(f"attach_clusters: example {e.id!r}: query {e.query!r} is not a topic of "
                     "the knowledge base")
    changes: dict[str, Any] = {"topic": topic.id}
    for side in task.SIDES:
      ids = []
      for text in getattr(e, side):
        match = [i for i, c in enumerate(topic.clusters) if c.stance == side and text in c.texts]
        if not match:
          raise KeyError(f"attach_clusters: example {e.id!r}: {side} argument {text!r} is in "
                         f"no {side} cluster of topic {topic.id!r}")
        ids.append(match[0])
      changes[f"{side}_clusters"] = tuple(ids)
    out.append(e.replace(**changes))
  return out


def perspectrum_texts(data_dir: str | os.PathLike, *,
                      splits: Optional[Sequence[str]] = ("train",)) -> Iterator[str]:
  """PERSPECTRUM claims and the perspectives of their clusters, for claims in `splits`
  (None: all claims)."""
  for topic in read_perspectrum(fileio.join(data_dir, "perspectrum")):
    if splits is not None and topic.split not in splits:
      continue
    yield topic.query
    for cluster in topic.clusters:
      yield from cluster.texts


corpus_sources.register("perspectrum", perspectrum_texts)
