"""Diamante data: dialogue turns with model candidates, per-epoch quadruples, batch features.

The released Diamante format is JSON lines, one dialogue a line::

  {"conversation": [{"utterance": "hi", "response_candidates": []},
                    {"utterance": "hello!", "response_candidates": ["hey", "good day"]}, ...]}

Utterance `i` (i >= 1) is the human response r_H to the context made of utterances `0..i-1`;
its `response_candidates` are model responses r_M to the same context. A plain dialogue corpus
is the same file without candidates (see `candidates.py`, which fills them in).

A training example is a quadruple (c, r_H, r_M, r_R), r_R a random response (a human response
of another turn): `QuadrupleSource` re-draws r_M and r_R every epoch, deterministically in
(seed, epoch), so a resumed run sees the same batches.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
from typing import AbstractSet, Any, Callable, Iterable, Mapping, Optional, Sequence

import gin
import numpy as np

from jaxmoral import token_rows
from jaxmoral import validation
from jaxmoral.data import pipeline
from jaxmoral.data import readers
from jaxmoral.data import source
from jaxmoral.data import vocab as vocab_lib

DEFAULT_SEPARATOR = " [SEP] "
# Index of the three responses along a quadruple batch's response axis.
HUMAN, MODEL, RANDOM = 0, 1, 2
# The keys of a dialogue object and of one of its utterances: anything else is an error (a
# misspelt "response_candidates" would otherwise train without candidates).
DIALOGUE_FIELDS = ("conversation",)
UTTERANCE_FIELDS = ("utterance", "response_candidates")


@dataclasses.dataclass(frozen=True)
class Turn:
  """One response position of a dialogue: the earlier utterances (oldest first), the human
  response r_H, model responses to the same context (may be none), and the dialogue's index
  in its file (random responses come from other dialogues)."""
  context: tuple[str, ...]
  response: str
  candidates: tuple[str, ...] = ()
  dialogue: int = 0


def normalize(text: str) -> str:
  """Lower case, single spaces: the equality used to reject r_M == r_H."""
  return " ".join(text.lower().split())


def char_f1(a: str, b: str) -> float:
  """F1 of the character multisets of two texts (spaces ignored); 1.0 for two empty texts."""
  ca = collections.Counter(a.replace(" ", ""))
  cb = collections.Counter(b.replace(" ", ""))
  if not ca and not cb:
    return 1.0
  overlap = sum((ca & cb).values())
  if overlap == 0:
    return 0.0
  precision, recall = overlap / sum(ca.values()), overlap / sum(cb.values())
  return 2 * precision * recall / (precision + recall)


def _check_str(value: Any, path: str, line: int, field: str) -> str:
  if not isinstance(value, str):
    raise readers.DataError(path, line, f"expected a string, got {type(value).__name__}", field)
  return value


def parse_dialogue(obj: dict[str, Any], *, path: str = "<memory>", line: int = 0,
                   dialogue: int = 0) -> list[Turn]:
  """One `Turn` (of dialogue index `dialogue`) per utterance after the first of a
  Diamante-format dialogue object (`response_candidates` may be absent: a plain corpus).

  Raises:
    readers.DataError: naming `path:line` and the bad field; `readers.UnknownFieldError` for a key
      outside `DIALOGUE_FIELDS` / `UTTERANCE_FIELDS` (naming the closest known one).
  """
  # As `readers.read_jsonl` orders them: a likely typo, a missing key, another unknown key.
  unknown = readers.unknown_field(obj, DIALOGUE_FIELDS, path, line)
  if unknown is not None and unknown.suggestion:
    raise unknown
  conversation = obj.get("conversation")
  if not isinstance(conversation, list) or not conversation:
    raise readers.DataError(path, line, "expected a non-empty list", "conversation")
  if unknown is not None:
    raise unknown
  utterances, candidates = [], []
  for i, entry in enumerate(conversation):
    field = f"conversation[{i}]"
    if not isinstance(entry, dict):
      raise readers.DataError(path, line, f"expected an object, got {type(entry).__name__}", field)
    unknown = readers.unknown_field(entry, UTTERANCE_FIELDS, path, line, prefix=f"{field}.")
    if unknown is not None and unknown.suggestion:  # A typo ("response_candidate").
      raise unknown
    if "utterance" not in entry:
      raise readers.DataError(path, line, "missing required field", f"{field}.utterance")
    if unknown is not None:
      raise unknown
    text = _check_str(entry["utterance"], path, line, f"{field}.utterance")
    if not text.strip():
      raise readers.DataError(path, line, "empty value", f"{field}.utterance")
    cands = entry.get("response_candidates")
    if not isinstance(cands, (list, type(None))):
      raise readers.DataError(path, line, f"expected a list, got {type(cands).__name__}",
                              f"{field}.response_candidates")
    cands = [_check_str(c, path, line, f"{field}.response_candidates[{j}]").strip()
             for j, c in enumerate(cands or [])]
    utterances.append(text.strip())
    candidates.append(tuple(c for c in cands if c))
  return [Turn(tuple(utterances[:i]), utterances[i], candidates[i], dialogue)
          for i in range(1, len(utterances))]


def read_dialogues(path: str | os.PathLike[str]) -> list[Turn]:
  """All turns of a Diamante-format JSONL file (errors name `path:line` and the field; an
  unknown key, and an empty file, are errors too)."""
  path = str(path)
  rows = readers.read_jsonl(path, required=DIALOGUE_FIELDS, optional=(), allow_empty=False)
  turns = [turn for index, (obj, line) in enumerate(zip(rows, rows.lines, strict=False))
           for turn in parse_dialogue(obj, path=path, line=line, dialogue=index)]
  if not turns:
    raise readers.DataError(path, 0, "no dialogue with at least two utterances")
  return turns


def write_dialogues(path: str | os.PathLike[str],
                    dialogues: Iterable[tuple[Sequence[str], Sequence[Sequence[str]]]]) -> int:
  """Writes (utterances, candidates per utterance) pairs as Diamante JSONL (what
  `read_dialogues` reads); returns the count."""
  rows = [{"conversation": [{"utterance": u, "response_candidates": list(c)}
                            for u, c in zip(utterances, candidates, strict=True)]}
          for utterances, candidates in dialogues]
  readers.write_jsonl(path, rows)
  return len(rows)


def by_dialogue(turns: Sequence[Turn]) -> dict[int, list[Turn]]:
  """The turns of each dialogue, in dialogue index order, each list by context length."""
  out: dict[int, list[Turn]] = {}
  for t in sorted(turns, key=lambda t: (t.dialogue, len(t.context))):
    out.setdefault(t.dialogue, []).append(t)
  return out


def write_turns(path: str | os.PathLike[str], turns: Sequence[Turn]) -> int:
  """Writes turns back as Diamante JSONL, one dialogue a line (e.g. a split of a corpus);
  returns the number of dialogues."""
  records = []
  for dialogue, ordered in by_dialogue(turns).items():
    if [len(t.context) for t in ordered] != list(range(1, len(ordered) + 1)):
      raise ValueError(f"write_turns: dialogue {dialogue} lacks some of its turns")
    records.append(([*ordered[-1].context, ordered[-1].response],
                    [()] + [t.candidates for t in ordered]))
  return write_dialogues(path, records)


# -- tokenisation ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class FeatureConfig:
  """How turns become token arrays: contexts (utterances joined by `separator`, EOS) are
  truncated from the left to `context_length`; a response keeps at most `response_length - 2`
  tokens plus EOS, so the position after EOS (where the score is read) still fits."""
  context_length: int = 128
  response_length: int = 32
  separator: str = DEFAULT_SEPARATOR
  eos_id: int = 1

  def __post_init__(self):
    if self.context_length < 2:
      raise ValueError(f"FeatureConfig.context_length must be >= 2, got {self.context_length}")
    if self.response_length < 3:
      raise ValueError(f"FeatureConfig.response_length must be >= 3, got {self.response_length}")


def encode_context(vocab: vocab_lib.Vocabulary, context: Sequence[str],
                   config: FeatureConfig) -> np.ndarray:
  """(context_length,) int32: the joined context, left-truncated, EOS, zero padded."""
  ids = list(vocab.encode(config.separator.join(context)))[-(config.context_length - 1):]
  return token_rows.padded([ids + [config.eos_id]], config.context_length)[0]


def encode_response(vocab: vocab_lib.Vocabulary, text: str, config: FeatureConfig) -> np.ndarray:
  """(response_length,) int32 targets: tokens (right-truncated), EOS, zero padded."""
  ids = list(vocab.encode(text))[:config.response_length - 2]
  return token_rows.padded([ids + [config.eos_id]], config.response_length)[0]


def response_features(targets: np.ndarray) -> dict[str, np.ndarray]:
  """Decoder features of (..., T) targets: inputs (shifted right, start 0) and loss weights."""
  targets = np.asarray(targets, np.int32)
  return {"decoder_input_tokens": pipeline.autoregressive_inputs(targets),
          "decoder_target_tokens": targets,
          "decoder_loss_weights": (targets > 0).astype(np.int32)}


# -- quadruples -----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Quadruple:
  """(c, r_H, r_M, r_R) for one turn."""
  turn: int
  context: tuple[str, ...]
  human: str
  model: str
  random: str


def trainable_turns(turns: Sequence[Turn]) -> list[int]:
  """Indices of turns that have at least one candidate different from the human response."""
  return [i for i, t in enumerate(turns)
          if any(normalize(c) != normalize(t.response) for c in t.candidates)]


def random_responses(turns: Sequence[Turn], turn: Turn, count: int, rng: np.random.Generator,
                     *, tries: int, excluded: AbstractSet[Any],
                     key: Callable[[str], Iterable[Any]]) -> list[str]:
  """Up to `count` human responses, none with a `key` in `excluded`, of turns drawn from
  dialogues other than `turn`'s (`tries` draws at most)."""
  out: list[str] = []
  for _ in range(tries):
    if len(out) == count:
      break
    other = turns[int(rng.integers(len(turns)))]
    if other.dialogue != turn.dialogue and excluded.isdisjoint(key(other.response)):
      out.append(other.response)
  return out


def draw_quadruples(turns: Sequence[Turn], indices: Sequence[int], rng: np.random.Generator, *,
                    prefer_dissimilar: bool = False, pool_size: int = 5) -> list[Quadruple]:
  """One quadruple per turn index, with fresh r_M and r_R.

  r_M is drawn from the turn's candidates minus those equal (after `normalize`) to r_H.
  r_R is the human response of a turn from another dialogue, re-drawn while it equals r_H or
  r_M. With `prefer_dissimilar`, each is the least character-F1-similar to r_H among
  `pool_size` random draws (the reference implementation's choice of hard-to-confuse
  negatives, still varying from epoch to epoch).

  Raises:
    ValueError: a turn has no usable candidate, or no other dialogue offers a random response.
  """
  validation.positive_int(pool_size, "draw_quadruples: pool_size")
  draws = pool_size if prefer_dissimilar else 1
  out = []
  for i in indices:
    turn = turns[i]
    human = normalize(turn.response)
    usable = [c for c in turn.candidates if normalize(c) != human]
    if not usable:
      raise ValueError(f"draw_quadruples: turn {i} has no candidate different from its human "
                       "response (filter with trainable_turns)")
    least_similar = functools.partial(min, key=lambda c: char_f1(c, turn.response))
    drawn = rng.choice(len(usable), size=min(draws, len(usable)), replace=False)
    model = least_similar([usable[k] for k in drawn])
    randoms = random_responses(turns, turn, draws, rng, tries=100 * draws,
                               excluded={human, normalize(model)}, key=lambda r: {normalize(r)})
    if not randoms:
      raise ValueError(f"draw_quadruples: no random response for turn {i} (only one dialogue?)")
    out.append(Quadruple(i, turn.context, turn.response, model, least_similar(randoms)))
  return out


def quadruple_features(vocab: vocab_lib.Vocabulary, quadruples: Sequence[Quadruple],
                       config: FeatureConfig) -> dict[str, np.ndarray]:
  """Batch features: encoder (B, Lc); decoder inputs/targets/weights (B, 3, T) in order H, M, R."""
  encoder = np.stack([encode_context(vocab, q.context, config) for q in quadruples])
  targets = np.stack([np.stack([encode_response(vocab, r, config)
                                for r in (q.human, q.model, q.random)]) for q in quadruples])
  return {"encoder_input_tokens": encoder, **response_features(targets)}


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class QuadrupleSource(source.DataSource):
  """Deterministic quadruple batches: `batch(step)` depends only on (seed, step).

  An epoch is one pass over the trainable turns in a seeded order, r_M and r_R drawn afresh
  (`draw_quadruples`, random responses from all `turns`). Batches run over epoch boundaries,
  `eval_batches`' last too: padding would change the preference loss, a mean over every row.
  """
  turns: Sequence[Turn]
  vocab: Any
  batch_size: int
  features: FeatureConfig = FeatureConfig()
  seed: int = 0
  prefer_dissimilar: bool = False
  pool_size: int = 5
  shard_index: int = 0
  shard_count: int = 1
  # Set in __post_init__: the trainable turns, and the last epochs' orders.
  _indices: list[int] = dataclasses.field(init=False, repr=False)
  _epochs: dict[int, list[Quadruple]] = dataclasses.field(init=False, repr=False)

  def __post_init__(self):
    self.check_shard()
    indices = trainable_turns(self.turns)
    if not indices:
      raise ValueError("QuadrupleSource.turns: no turn has a model candidate different from "
                       "its human response (generate candidates first: diamante/candidates.py)")
    object.__setattr__(self, "_indices", indices)
    object.__setattr__(self, "_epochs", {})

  @property
  def num_examples(self) -> int:
    return len(self._indices)

  def epoch(self, epoch: int) -> list[Quadruple]:
    """The quadruples of one epoch, in training order (the last two epochs are cached)."""
    cache = self._epochs
    if epoch not in cache:
      rng = np.random.default_rng([self.seed, epoch])
      order = [self._indices[k] for k in rng.permutation(len(self._indices))]
      cache[epoch] = draw_quadruples(self.turns, order, rng,
                                     prefer_dissimilar=self.prefer_dissimilar,
                                     pool_size=self.pool_size)
      for old in [e for e in cache if e < epoch - 1]:
        del cache[old]
    return cache[epoch]

  def batch(self, step: int) -> dict[str, np.ndarray]:
    """This shard's quadruples of global batch `step`, as features."""
    n = self.num_examples
    quadruples = [self.epoch(int(p) // n)[int(p) % n] for p in self.shard_positions(step)]
    return quadruple_features(self.vocab, quadruples, self.features)


# -- the run's data -------------------------------------------------------------------------
def pair_features(turns: Sequence[Turn], vocab: vocab_lib.Vocabulary,
                  features: FeatureConfig) -> dict[str, np.ndarray]:
  """Seq2seq features (context -> human response) with Diamante's left-truncated contexts."""
  encoder = np.stack([encode_context(vocab, t.context, features) for t in turns])
  targets = np.stack([encode_response(vocab, t.response, features) for t in turns])
  return {"encoder_input_tokens": encoder, **response_features(targets)}


@gin.configurable(module="diamante")
@dataclasses.dataclass(frozen=True, kw_only=True)
class DialogueData(source.DataSpec):
  """Dialogue turns for `jaxmoral.runs.train_run` (DATA): Diamante quadruples, or (context,
  human response) pairs for the generator that samples candidates (`pairs=True`).

  The run's TASK_FEATURE_LENGTHS give the context ("inputs") and response ("targets") lengths;
  they and the separator are saved in the run's settings.json for inference.

  Attributes:
    train_path: Diamante-format JSONL (with response candidates unless `pairs`).
    eval_path: Held-out JSONL (optional).
    vocab_path: SentencePiece model; None: the init checkpoint's, else one of `vocab_size`
      pieces (+ 100 extra ids) trained on the training dialogues in MODEL_DIR/vocab.
    separator: Joins context utterances.
    prefer_dissimilar, pool_size: As `draw_quadruples`'.
  """
  train_path: str
  eval_path: Optional[str] = None
  vocab_path: Optional[str] = None
  vocab_size: int = 400
  separator: str = DEFAULT_SEPARATOR
  prefer_dissimilar: bool = False
  pool_size: int = 5
  pairs: bool = False
  FILE_FIELDS = ("train_path", "eval_path", "vocab_path")

  def __post_init__(self):
    validation.positive_int(self.vocab_size, "DialogueData.vocab_size")

  def vocabulary(self, vocab_dir: str, *, fallback: Any = None) -> Any:
    self.check_files()
    if self.vocab_path is not None:
      return vocab_lib.get_vocabulary(self.vocab_path)
    if fallback is not None:
      return fallback
    prefix = os.path.join(vocab_dir, "spm")
    if not os.path.isfile(prefix + ".model"):  # Trained on every distinct utterance and candidate.
      texts = dict.fromkeys(x for t in read_dialogues(self.train_path)
                            for x in (*t.context, t.response, *t.candidates))
      vocab_lib.train_sentencepiece(list(texts), output_prefix=prefix, vocab_size=self.vocab_size,
                                    hard_vocab_limit=False)
    return vocab_lib.get_vocabulary(prefix + ".model")

  def sources(self, *, vocabulary: Any, batch_size: int, feature_lengths: Mapping[str, int],
              seed: int) -> tuple[source.DataSource, Optional[source.DataSource]]:
    self.check_files()
    features = FeatureConfig(context_length=int(feature_lengths["inputs"]),
                             response_length=int(feature_lengths["targets"]),
                             separator=self.separator)
    train = read_dialogues(self.train_path)
    held_out = read_dialogues(self.eval_path) if self.eval_path else None
    if self.pairs:
      make = lambda turns, s: pipeline.BatchSource(  # noqa: E731
          features=pair_features(turns, vocabulary, features), batch_size=batch_size, seed=s)
    else:
      make = lambda turns, s: QuadrupleSource(  # noqa: E731
          turns=turns, vocab=vocabulary, batch_size=batch_size, features=features, seed=s,
          prefer_dissimilar=self.prefer_dissimilar, pool_size=self.pool_size)
    return make(train, seed), (make(held_out, seed + 1) if held_out else None)

  def batch_shapes(self, *, batch_size: int, feature_lengths: Mapping[str, int]
                   ) -> dict[str, tuple[tuple[int, ...], Any]]:
    """Global batch shapes (for `jaxmoral compile`)."""
    context, response = int(feature_lengths["inputs"]), int(feature_lengths["targets"])
    decoder = (batch_size, response) if self.pairs else (batch_size, 3, response)
    return {"encoder_input_tokens": ((batch_size, context), np.int32),
            **{k: (decoder, np.int32) for k in ("decoder_input_tokens", "decoder_target_tokens",
                                                 "decoder_loss_weights")}}

  def settings(self) -> dict[str, Any]:
    return {"kind": "dialogue_pairs" if self.pairs else "dialogue_quadruples",
            "separator": self.separator}


def feature_config_from_settings(settings: Mapping[str, Any], *, model_config: Any
                                 ) -> FeatureConfig:
  """The `FeatureConfig` a run trained with (settings.json), for inference."""
  lengths = settings.get("feature_lengths", {})
  kwargs = {name: int(lengths[key]) for key, name in (
      ("inputs", "context_length"), ("targets", "response_length")) if key in lengths}
  return FeatureConfig(eos_id=model_config.eos_token_id, **kwargs,
                       separator=settings.get("data", {}).get("separator", DEFAULT_SEPARATOR))
