"""Text pairs -> T5X encoder-decoder features, and deterministic, resumable batching.

`encode_pairs` produces exactly what `seqio.EncDecFeatureConverter` produces for a task with
`tokenize` + `append_eos_after_trim` (tests check this), without a tf.data pipeline:

  encoder_input_tokens   inputs + EOS, truncated so that EOS survives, 0-padded
  decoder_target_tokens  targets + EOS, likewise
  decoder_input_tokens   targets shifted right behind the start id 0 (per segment when packed)
  decoder_loss_weights   1 on real target tokens (EOS included), 0 on padding
  encoder/decoder_segment_ids, _positions   only with `pack=True`
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Iterator, Mapping, Optional, Sequence

import numpy as np

from jaxmoral import token_rows
from jaxmoral.data import source

Features = dict[str, np.ndarray]


def check_lengths(feature_lengths: Mapping[str, int], where: str = "feature_lengths") -> None:
  """Raises a ValueError naming `where` unless the lengths have "inputs" and "targets"."""
  for key in ("inputs", "targets"):
    if key not in feature_lengths:
      raise ValueError(f"{where} lacks {key!r}: {dict(feature_lengths)}")


def _tokenize(texts: Sequence[str], vocabulary: Any, length: int, add_eos: bool,
              eos_id: int, name: str) -> list[list[int]]:
  if length <= (1 if add_eos else 0):
    raise ValueError(f"feature_lengths[{name!r}] must be > {int(add_eos)}, got {length}")
  out = []
  for text in texts:
    if not isinstance(text, str):
      raise TypeError(f"{name}: expected str, got {type(text).__name__}: {text!r}")
    ids = [int(i) for i in vocabulary.encode(text)]
    out.append(ids[:length - 1] + [eos_id] if add_eos else ids[:length])  # EOS is always kept.
  return out


def autoregressive_inputs(targets: np.ndarray, segment_ids: Optional[np.ndarray] = None,
                          start_id: int = 0) -> np.ndarray:
  """(..., T) targets shifted right by one; the first token of every segment is `start_id`."""
  inputs = np.zeros_like(targets)
  inputs[..., 1:] = targets[..., :-1]
  inputs[..., 0] = start_id
  if segment_ids is not None:
    first = np.ones_like(segment_ids, dtype=bool)
    first[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    inputs = np.where(first, start_id, inputs)
  return inputs


def _pack(inputs: list[list[int]], targets: list[list[int]],
          lengths: Mapping[str, int]) -> Features:
  """Greedy first-fit packing: each example goes into the first row where both parts fit."""
  bins: list[list[int]] = []  # Example indices per packed row.
  used: list[tuple[int, int]] = []
  for i, (x, y) in enumerate(zip(inputs, targets, strict=True)):
    for b, (ux, uy) in enumerate(used):
      if ux + len(x) <= lengths["inputs"] and uy + len(y) <= lengths["targets"]:
        bins[b].append(i)
        used[b] = (ux + len(x), uy + len(y))
        break
    else:
      bins.append([i])
      used.append((len(x), len(y)))
  features: Features = {}
  for key, tokens_name, seqs, length in (
      ("encoder", "encoder_input_tokens", inputs, lengths["inputs"]),
      ("decoder", "decoder_target_tokens", targets, lengths["targets"])):
    features[tokens_name] = token_rows.padded(
        [[t for i in row for t in seqs[i]] for row in bins], length)
    features[f"{key}_segment_ids"] = token_rows.padded(
        [[s for s, i in enumerate(row, start=1) for _ in seqs[i]] for row in bins], length)
    features[f"{key}_positions"] = token_rows.padded(
        [[p for i in row for p in range(len(seqs[i]))] for row in bins], length)
  features["decoder_input_tokens"] = autoregressive_inputs(
      features["decoder_target_tokens"], features["decoder_segment_ids"])
  features["decoder_loss_weights"] = (features["decoder_segment_ids"] > 0).astype(np.int32)
  return features


def encode_pairs(inputs: Sequence[str], targets: Sequence[str], *, vocabulary: Any,
                 feature_lengths: Mapping[str, int], add_eos: bool = True,
                 pack: bool = False) -> Features:
  """Tokenises (input, target) text pairs into T5X encoder-decoder features.

  Args:
    inputs, targets: Encoder and decoder texts, one target per input.
    vocabulary: Anything with `encode(str) -> ids` and `eos_id` (a seqio vocabulary).
    feature_lengths: `{"inputs": N, "targets": M}`.
    add_eos: Append EOS (kept under truncation) to both sides, as T5 does.
    pack: Pack several examples per row (greedy first-fit) and add `*_segment_ids` (1-based,
      0 = padding) and `*_positions`.

  Returns:
    The int32 features of the module docstring, (B, N) for the encoder's and (B, M) for the
    decoder's; B is the number of pairs, or of packed rows.
  """
  if len(inputs) != len(targets):
    raise ValueError(f"encode_pairs: {len(inputs)} inputs but {len(targets)} targets")
  check_lengths(feature_lengths)
  eos_id = int(getattr(vocabulary, "eos_id", 1))
  x = _tokenize(inputs, vocabulary, feature_lengths["inputs"], add_eos, eos_id, "inputs")
  y = _tokenize(targets, vocabulary, feature_lengths["targets"], add_eos, eos_id, "targets")
  if pack:
    return _pack(x, y, feature_lengths)
  targets_arr = token_rows.padded(y, feature_lengths["targets"])
  return {
      "encoder_input_tokens": token_rows.padded(x, feature_lengths["inputs"]),
      "decoder_target_tokens": targets_arr,
      "decoder_input_tokens": autoregressive_inputs(targets_arr),
      "decoder_loss_weights": token_rows.padded([[1] * len(t) for t in y],
                                                feature_lengths["targets"]),
  }


def pad_batch(batch: Mapping[str, np.ndarray], rows: int) -> Features:
  """`batch` zero-padded to `rows` rows (an evaluation's last batch): the padding rows have
  `decoder_loss_weights` 0 and add nothing to weighted sums."""
  return {k: np.pad(v, [(0, rows - len(v))] + [(0, 0)] * (v.ndim - 1)) for k, v in batch.items()}


@functools.lru_cache(maxsize=16)
def _permutation(seed: int, epoch: int, n: int) -> np.ndarray:
  perm = np.random.default_rng([seed, epoch]).permutation(n)
  perm.flags.writeable = False
  return perm


def stream_indices(positions: np.ndarray, n: int, *, seed: int, shuffle: bool = True
                   ) -> np.ndarray:
  """Example indices at stream `positions` over `n` examples: epoch after epoch, each a
  permutation seeded by (seed, epoch) (in order without `shuffle`)."""
  epochs, offsets = np.divmod(positions, n)
  if not shuffle:
    return offsets
  out = np.empty_like(offsets)
  for epoch in np.unique(epochs):
    sel = epochs == epoch
    out[sel] = _permutation(seed, int(epoch), n)[offsets[sel]]
  return out


@dataclasses.dataclass(frozen=True, eq=False)
class BatchSource(source.DataSource):
  """Deterministic batches over in-memory feature arrays, wrapping across epochs.

  Batch `step` is the `stream_indices` of its `shard_positions`, so it depends on (seed, step)
  only; a batch may span two epochs.

  Attributes (besides `source.DataSource`'s batch_size, shard_index, shard_count):
    features: Equal-length arrays `{name: (n, ...)}`.
    shuffle: False serves examples in order (epoch after epoch).
    data_fingerprint: A hash of the rows when they come from an index cache (checkpoints
      record it, so a resume over other rows is refused); None otherwise.
  """

  features: Mapping[str, np.ndarray]
  batch_size: int
  seed: int = 0
  shuffle: bool = True
  shard_index: int = 0
  shard_count: int = 1
  data_fingerprint: Optional[str] = None

  def __post_init__(self):
    if not self.features:
      raise ValueError("BatchSource.features is empty")
    sizes = {k: len(v) for k, v in self.features.items()}
    if len(set(sizes.values())) != 1:
      raise ValueError(f"BatchSource.features: arrays differ in length: {sizes}")
    if next(iter(sizes.values())) == 0:
      raise ValueError("BatchSource.features: no examples")
    self.check_shard()
    object.__setattr__(self, "features", {k: np.asarray(v) for k, v in self.features.items()})

  @property
  def num_examples(self) -> int:
    return len(next(iter(self.features.values())))

  def batch(self, step: int) -> Features:
    """This shard's rows of global batch `step`: `{name: (per_shard_batch_size, ...)}`."""
    idx = stream_indices(self.shard_positions(step), self.num_examples, seed=self.seed,
                         shuffle=self.shuffle)
    return {k: v[idx] for k, v in self.features.items()}

  def eval_batches(self) -> Iterator[Features]:
    """One in-order pass over this shard's examples, the last batch zero-padded (`pad_batch`)."""
    for step in range(self.steps_per_epoch):
      positions = self.shard_positions(step)
      idx = positions[positions < self.num_examples]
      yield pad_batch({k: v[idx] for k, v in self.features.items()}, self.per_shard_batch_size)
