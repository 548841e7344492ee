"""One batch-inference path for every loaded T5: predict, score, label distribution, logits.

T5X's `predict_batch` / `score_batch` on the host. Inputs (strings or token ids) are padded to
few fixed shapes (`token_rows.bucket`, or a fixed `input_length` / `batch_size` that
`jaxmoral compile` lowers) and run through cached jitted functions, so repeated calls never
recompile. `api.Model`, ClarifyDelphi, Diamante and the NPOV classifiers all run through it.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
import typing
from typing import Any, Callable, Optional, Sequence, TypeVar, Union

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxmoral import decoding
from jaxmoral import model_dirs
from jaxmoral import partitioning
from jaxmoral import token_rows
from jaxmoral.models import t5
from jaxmoral.models.config import T5Config

Array = jax.Array
TextOrTokens = Union[Sequence[str], Sequence[Sequence[int]], np.ndarray, jax.Array]
MIN_BUCKET = 8


@dataclasses.dataclass(frozen=True)
class GenerateOutput:
  """What `InferenceModel.predict` returns.

  Attributes:
    tokens: (batch, n, max_decode_length) int32; EOS included, zeros after it. n is
      `num_samples` or `beam_size` (best first).
    scores: (batch, n) float32: the sampled tokens' summed log-probs or the beam score.
    lengths: (batch, n) int32 emitted tokens including EOS.
    texts: Decoded strings (batch lists of n), or None without a vocabulary.
  """
  tokens: np.ndarray
  scores: np.ndarray
  lengths: np.ndarray
  texts: Optional[list[list[str]]]

  @property
  def decoded(self) -> list[list[str]]:
    """`texts`, for callers whose model reads text; ValueError when it has no vocabulary."""
    if self.texts is None:
      raise ValueError("this model has no vocabulary: its outputs are tokens only")
    return self.texts

  def __repr__(self) -> str:
    # The texts and one score per output; the padded token arrays are in `.tokens`.
    batch, n = self.scores.shape
    shown = (self.texts if self.texts is not None
             else [[f"<{int(length)} tokens>" for length in row] for row in self.lengths])
    scores = np.array2string(self.scores, precision=3, separator=", ", threshold=20)
    return (f"GenerateOutput(texts={shown!r}, scores={scores}, "
            f"tokens=<{batch}x{n}x{self.tokens.shape[-1]} int32>)")


def class_distribution(model: t5.T5, params: Any, encoder_input_tokens: Array,
                       class_token_ids: Array) -> Array:
  """(B, C) float32 softmax over the logits of C one-token labels (`class_token_ids`) at the
  first decoder step, for (B, L) 0-padded `encoder_input_tokens` (jittable)."""
  mask = encoder_input_tokens != model.config.pad_token_id
  encoded = model.apply({"params": params}, encoder_input_tokens, encoder_mask=mask,
                        method=t5.T5.encode)
  start = jnp.full((encoder_input_tokens.shape[0], 1), model.config.decoder_start_token_id,
                   jnp.int32)
  logits, _ = model.apply({"params": params}, encoded, mask, start, method=t5.T5.decode)
  class_logits = jnp.take(logits[:, 0].astype(jnp.float32), class_token_ids, axis=-1)
  return jax.nn.softmax(class_logits, axis=-1)


def _teacher_forced_logits(model: t5.T5, params: Any, encoder_input_tokens: Array,
                           decoder_input_tokens: Array) -> Array:
  return typing.cast(Array, model.apply({"params": params}, encoder_input_tokens,
                                        decoder_input_tokens))


@functools.lru_cache(maxsize=64)
def _jitted(fn: Callable[..., Any], model: t5.T5, partitioner: Any, num_inputs: int,
            static: tuple[Any, ...]) -> partitioning.PartitionedFunction:
  def run(params: Any, *inputs: Any) -> Any:
    return fn(model, params, *inputs, *static)
  return model_dirs.jit_with_params(run, model.config, partitioner,
                                    replicated=(False,) * num_inputs,
                                    with_scalar_head=model.with_scalar_head)


@functools.lru_cache(maxsize=64)
def _class_fn(model: t5.T5, partitioner: Any) -> partitioning.PartitionedFunction:
  return partitioning.jit_in_context(functools.partial(class_distribution, model), partitioner)


def _is_empty(items: TextOrTokens) -> bool:  # Arrays and a lone str: `token_rows` judges.
  return not isinstance(items, (str, np.ndarray, jax.Array)) and not list(items)


_Model = TypeVar("_Model", bound="InferenceModel")


class InferenceModel:
  """A T5, its parameters and vocabulary on a mesh, run in bucketed, jitted batches.

  Attributes:
    module: The linen `T5` (with a scalar head when its parameters have one).
    params: Unboxed parameters (on device, or abstract for `jaxmoral compile`).
    vocabulary: seqio vocabulary (given as one or a `.model` path) or None (token ids only).
    partitioner: The mesh of the parameters and of every call (None: one device, no mesh).
    source: Where it was loaded from.
    decode_weights: The decoding backend's kernels for `params` (default: prepared on first
      use, once for the model and its `with_shapes` copies; a scorer never needs them).
    input_length: Fixed encoder length (inputs truncated keeping EOS); None: bucketed.
    batch_size: Fixed rows per compiled call (the last chunk padded); None: bucketed.
  """

  def __init__(self, module: t5.T5, params: Any, *, vocabulary: Any = None,
               partitioner: Any = None, source: str = "<in memory>",
               decode_weights: Optional[decoding.DecodeWeights] = None,
               input_length: Optional[int] = None, batch_size: Optional[int] = None):
    self.module = module
    self.params = params
    self.vocabulary = (model_dirs.vocabulary_from_file(vocabulary)
                       if isinstance(vocabulary, (str, os.PathLike)) else vocabulary)
    self.partitioner = partitioner
    self.source = source
    # Shared by `with_shapes` copies: {"weights": ...}, or {} while still to be prepared.
    self._decode: dict[str, Any] = {} if decode_weights is None else {"weights": decode_weights}
    self.input_length = input_length
    self.batch_size = batch_size
    if self.vocabulary is not None and self.vocabulary.vocab_size > module.config.vocab_size:
      raise ValueError(f"{source}: vocabulary has {self.vocabulary.vocab_size} ids but the "
                       f"model's vocab_size is {module.config.vocab_size}")
    self._check_batch_size()

  def _check_batch_size(self) -> None:
    data = self.partitioner.data_parallel_size if self.partitioner is not None else 1
    if self.batch_size and self.batch_size % data:
      raise ValueError(f"{self.source}: batch_size {self.batch_size} is not divisible by the "
                       f"mesh's data axis ({data})")

  @classmethod
  def from_params(cls: type[_Model], config: T5Config, params: Any, *,
                  with_scalar_head: bool = False, partitioner: Any = None,
                  **kwargs: Any) -> _Model:
    """Places `params` (boxed or not) in the partitioner's shardings (no copy when
    `model_dirs.load` read them there)."""
    module = t5.T5(config, with_scalar_head=with_scalar_head)
    params = nn.meta.unbox(params)
    if partitioner is not None:
      params = jax.device_put(params, model_dirs.param_shardings(
          config, partitioner, with_scalar_head=with_scalar_head))
    elif not all(isinstance(x, jax.Array) for x in jax.tree.leaves(params)):
      params = jax.device_put(params)
    return cls(module, params, partitioner=partitioner, **kwargs)

  @classmethod
  def load(cls: type[_Model], path: str | os.PathLike, *, partitioner: Any = None,
           step: Optional[int] = None,
           dtype: Optional[str] = None, config: Optional[T5Config] = None,
           vocabulary: Any = None, with_scalar_head: bool = False,
           require_vocabulary: bool = False, **kwargs: Any) -> _Model:
    """Loads any model directory or Hub id (`model_dirs.load`) into `partitioner`'s shardings.

    Args:
      path, partitioner, step, dtype, config, vocabulary: As `model_dirs.load` takes them
        (every call runs on the partitioner's mesh).
      with_scalar_head: Keep a stored scalar head (Diamante's preference score); else the
        plain language model.
      require_vocabulary: Refuse a directory without a vocabulary (models that read text).
      **kwargs: `input_length`, `batch_size` (fixed shapes).
    """
    loaded = model_dirs.load(path, partitioner=partitioner, step=step, dtype=dtype,
                             config=config, vocabulary=vocabulary)
    if require_vocabulary and loaded.vocabulary is None:
      raise ValueError(f"{os.fspath(path)}: no vocabulary (vocab/spiece.model or "
                       "spiece.model); this model reads and writes text")
    head = with_scalar_head and loaded.has_scalar_head
    return cls.from_params(loaded.config, loaded.params if head else loaded.lm_params,
                           with_scalar_head=head, partitioner=partitioner,
                           vocabulary=loaded.vocabulary, source=os.fspath(path), **kwargs)

  def with_shapes(self: _Model, *, input_length: Optional[int] = None,
                  batch_size: Optional[int] = None) -> _Model:
    """The same model (parameters shared) with other fixed shapes (None keeps the current)."""
    out = copy.copy(self)
    out.input_length = input_length or self.input_length
    out.batch_size = batch_size or self.batch_size
    out._check_batch_size()
    return out

  def __repr__(self) -> str:
    c = self.config
    return (f"{type(self).__name__}({self.source}: d_model={c.d_model}, "
            f"layers={c.num_encoder_layers}+{c.num_decoder_layers}, vocab={c.vocab_size}, "
            f"{c.feed_forward_proj}, vocabulary={'yes' if self.vocabulary is not None else 'no'})")

  @property
  def decode_weights(self) -> Optional[decoding.DecodeWeights]:
    if "weights" not in self._decode:
      self._decode["weights"] = decoding.prepare_decode_weights(
          self.module, self.params, partitioner=self.partitioner)
    return self._decode["weights"]

  @property
  def config(self) -> T5Config:
    return self.module.config

  def place(self, *arrays: Any) -> Any:
    """Host arrays on the model's mesh (rows over "data" where they divide it): one array for
    one argument, a tuple for several; as they are without a partitioner."""
    if self.partitioner is not None:
      arrays = self.partitioner.shard_inputs(arrays)
    return arrays[0] if len(arrays) == 1 else arrays

  def _require_vocabulary(self) -> Any:
    if self.vocabulary is None:
      raise ValueError(f"{self.source}: no vocabulary; pass vocabulary= (a seqio vocabulary or "
                       "a spiece.model path) or give token ids")
    return self.vocabulary

  def encode_text(self, texts: Sequence[str], *, add_eos: bool = True) -> list[list[int]]:
    """Token ids of each text (EOS appended unless `add_eos=False`)."""
    if isinstance(texts, str):
      raise TypeError("encode_text takes a list of strings, got one str")
    vocabulary = self._require_vocabulary()
    eos = [self.config.eos_token_id] if add_eos else []
    return [list(vocabulary.encode(text)) + eos for text in texts]

  def decode_text(self, tokens: Sequence[Sequence[int]] | np.ndarray) -> list[str]:
    """Texts of token rows, each up to its first EOS (`token_rows.text_ids`)."""
    vocabulary = self._require_vocabulary()
    return [vocabulary.decode(token_rows.text_ids(row, self.config.eos_token_id,
                                                  self.config.pad_token_id))
            for row in np.asarray(tokens).reshape(-1, np.shape(tokens)[-1]).tolist()]

  def token_rows(self, items: TextOrTokens, what: str = "inputs") -> list[list[int]]:
    """Rows of ids (padding stripped) from texts or token ids."""
    if isinstance(items, str):
      raise TypeError(f"{what}: give a list of strings, got one str")
    if isinstance(items, (np.ndarray, jax.Array)):
      array = np.asarray(items)
      if array.ndim != 2 or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{what}: token arrays must be 2-D integer, got {array.dtype} "
                         f"{array.shape}")
      items = array.tolist()
    items = list(items)
    if not items:
      raise ValueError(f"{what}: empty batch")
    if all(isinstance(x, str) for x in items):
      return self.encode_text(items)
    rows = []
    for i, row in enumerate(items):
      if isinstance(row, str):
        raise TypeError(f"{what}[{i}]: mixed strings and token ids")
      row = [int(t) for t in row]
      while row and row[-1] == self.config.pad_token_id:
        row.pop()
      if any(not 0 <= t < self.config.vocab_size for t in row):
        raise ValueError(f"{what}[{i}]: token ids outside [0, {self.config.vocab_size})")
      rows.append(row)
    return rows

  def encode(self, inputs: TextOrTokens) -> np.ndarray:
    """(N, length) int32 encoder rows: EOS-terminated, 0-padded to the fixed `input_length`
    (longer rows truncated keeping their last token, the EOS) or else to its bucket."""
    rows = self.token_rows(inputs, "inputs")
    if self.input_length:
      rows = [r if len(r) <= self.input_length else r[:self.input_length - 1] + r[-1:]
              for r in rows]
    length = self.input_length or token_rows.bucket(max(map(len, rows)), MIN_BUCKET)
    return token_rows.padded(rows, length)

  def batches(self, inputs: TextOrTokens, targets: Optional[TextOrTokens] = None, *,
              batch_size: int = 32):
    """Yields (n, encoder, targets, target_lengths) numpy batches of fixed bucketed shapes
    (the last two None without `targets`): `n` rows are real, padding rows read one EOS (a
    valid, empty input: no NaN from a fully masked row)."""
    encoder = self.encode(inputs)
    dec_rows = self.token_rows(targets, "targets") if targets is not None else None
    if dec_rows is not None and len(dec_rows) != len(encoder):
      raise ValueError(f"inputs has {len(encoder)} rows but targets has {len(dec_rows)}")
    dec_len = token_rows.bucket(max(map(len, dec_rows)), MIN_BUCKET) if dec_rows else 0
    step = self.batch_size or batch_size
    for start in range(0, len(encoder), step):
      chunk = encoder[start:start + step]
      n, rows = len(chunk), self.batch_size or token_rows.bucket(len(chunk), MIN_BUCKET)
      enc = np.zeros((rows, encoder.shape[1]), np.int32)
      enc[:, 0] = self.config.eos_token_id
      enc[:n] = chunk
      if dec_rows is None:
        yield n, enc, None, None
        continue
      dec_chunk = dec_rows[start:start + step]
      lengths = np.zeros(rows, np.int32)
      lengths[:n] = [len(r) for r in dec_chunk]
      yield n, enc, token_rows.padded(dec_chunk, dec_len, rows), lengths

  # The jitted functions the calls below run (what `jaxmoral compile` lowers).
  def jitted(self, fn: Callable[..., Any], num_inputs: int,
             static: tuple[Any, ...] = ()) -> partitioning.PartitionedFunction:
    """`fn(module, params, *inputs, *static)` as `g(params, *inputs)` on the model's mesh
    (parameters in their shardings, outputs replicated), cached per (fn, module, mesh)."""
    return _jitted(fn, self.module, self.partitioner, num_inputs, tuple(static))

  def run(self, fn: Callable[..., Any], *inputs: Any, static: tuple[Any, ...] = ()) -> Any:
    """`jitted(fn)` on host arrays placed on the mesh, fetched back to the host."""
    placed = inputs if self.partitioner is None else self.partitioner.shard_inputs(inputs)
    return jax.device_get(self.jitted(fn, len(inputs), static)(self.params, *placed))

  def sampler(self, *, max_decode_length: int, num_samples: int = 1, greedy: bool = True,
              temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
              no_repeat_ngram_size: int = 0) -> Any:
    """The jitted `decoding` sampler `predict` calls (on the model's mesh)."""
    return decoding.make_sampler(self.module, max_decode_length=max_decode_length,
                                 num_samples=num_samples, temperature=temperature, top_k=top_k,
                                 top_p=top_p, greedy=greedy,
                                 no_repeat_ngram_size=no_repeat_ngram_size,
                                 eos_id=self.config.eos_token_id, partitioner=self.partitioner)

  def class_scorer(self) -> partitioning.PartitionedFunction:
    """The jitted `fn(params, tokens, class_ids) -> (B, C)` of one-token labels."""
    return _class_fn(self.module, self.partitioner)

  def label_ids(self, labels: Sequence[str]) -> list[list[int]]:
    return self.encode_text(labels, add_eos=False)

  def label_scorer(self, labels: Sequence[str]) -> Any:
    """The jitted function `label_distribution` runs for these labels: the one-step class
    scorer when every label is one token, else the teacher-forced sequence scorer."""
    if all(len(i) == 1 for i in self.label_ids(labels)):
      return self.class_scorer()
    return decoding.make_scorer(self.module, self.partitioner)

  def logits(self, inputs: TextOrTokens, targets: TextOrTokens, *,
             batch_size: int = 32) -> np.ndarray:
    """Teacher-forced (batch, longest target, vocab) float32 logits: position t predicts
    `targets[:, t]`; positions past a row's length are padding."""
    fn = self.jitted(_teacher_forced_logits, 2)
    outputs, longest = [], 0
    for n, enc, dec, lengths in self.batches(inputs, targets, batch_size=batch_size):
      decoder_inputs = np.asarray(t5.shift_right(dec, self.config.decoder_start_token_id))
      outputs.append(np.asarray(fn(self.params, *self.place(enc, decoder_inputs)))[:n])
      longest = max(longest, int(lengths.max()))
    return np.concatenate(outputs)[:, :longest]

  def score(self, inputs: TextOrTokens, targets: TextOrTokens, *,
            batch_size: int = 32) -> np.ndarray:
    """log p(target | input) of each pair, (batch,) float32 (EOS included for text targets)."""
    scorer = decoding.make_scorer(self.module, self.partitioner)
    scores = []
    for n, enc, dec, lengths in self.batches(inputs, targets, batch_size=batch_size):
      enc, dec, lengths = self.place(enc, dec, lengths)
      scores.append(np.asarray(scorer(self.params, enc, None, None, dec, lengths))[:n])
    return np.concatenate(scores)

  def predict(self, inputs: TextOrTokens, *, max_decode_length: int = 64,
              num_samples: int = 1, temperature: float = 1.0, top_k: int = 0,
              top_p: float = 1.0, greedy: Optional[bool] = None, beam_size: int = 0,
              length_penalty: float = 0.6, no_repeat_ngram_size: int = 0, seed: int = 0,
              rng: Optional[Array] = None, batch_size: int = 32) -> GenerateOutput:
    """Greedy, sampled or beam-searched continuations with `jaxmoral.decoding`.

    Greedy by default, as `jaxmoral infer`, T5X's predict and Hugging Face's `generate`.

    Args:
      inputs: Strings or token ids (an empty list gives empty outputs).
      max_decode_length, num_samples, temperature, top_k, top_p, no_repeat_ngram_size: See
        `decoding.SampleConfig`.
      greedy: Argmax decoding (None: unless `num_samples`, `temperature`, `top_k` or `top_p`
        is away from its default).
      beam_size: > 0 switches to beam search with this many beams and `length_penalty`.
      rng: Sampling key (batch i uses fold_in(rng, i)); default PRNGKey(seed).
      batch_size: Inputs per decoding call (unless the model's `batch_size` is fixed).
    """
    if greedy is None:
      greedy = (num_samples == 1 and temperature == 1.0 and top_k == 0 and top_p == 1.0)
    n_out = beam_size or num_samples
    if _is_empty(inputs):
      return GenerateOutput(tokens=np.zeros((0, n_out, max_decode_length), np.int32),
                            scores=np.zeros((0, n_out), np.float32),
                            lengths=np.zeros((0, n_out), np.int32),
                            texts=[] if self.vocabulary is not None else None)
    base = jax.random.PRNGKey(seed) if rng is None else rng
    if beam_size:
      beam_search = decoding.make_beam_search(
          self.module, beam_size=beam_size, max_decode_length=max_decode_length,
          length_penalty=length_penalty, eos_id=self.config.eos_token_id,
          partitioner=self.partitioner)
    else:
      sampler = self.sampler(max_decode_length=max_decode_length, num_samples=num_samples,
                             temperature=temperature, top_k=top_k, top_p=top_p, greedy=greedy,
                             no_repeat_ngram_size=no_repeat_ngram_size)
    parts = []  # (tokens, scores, lengths) of each batch's real rows.
    for index, (n, enc, _, _) in enumerate(self.batches(inputs, batch_size=batch_size)):
      enc = self.place(enc)
      if beam_size:
        seqs, beam_scores = beam_search(self.params, enc, decode_weights=self.decode_weights)
        seqs = np.asarray(seqs)[:n]
        parts.append((seqs, np.asarray(beam_scores)[:n],
                      token_rows.emitted_lengths(seqs, self.config.eos_token_id)))
      else:
        out = sampler(self.params, enc, None, None, jax.random.fold_in(base, index),
                      self.decode_weights)
        parts.append((np.asarray(out.tokens)[:n],
                      np.asarray(jnp.sum(out.logprobs * out.mask, axis=-1))[:n],
                      np.asarray(out.lengths)[:n]))
    tokens, scores, lengths = (np.concatenate(part) for part in zip(*parts, strict=True))
    texts = ([self.decode_text(row) for row in tokens] if self.vocabulary is not None
             else None)
    return GenerateOutput(tokens=tokens, scores=scores, lengths=lengths, texts=texts)

  def label_distribution(self, inputs: TextOrTokens, labels: Sequence[str], *,
                         require_single_token: bool = False) -> np.ndarray:
    """(N, C) probabilities of the label strings as the output, normalised over the labels.

    One-token labels: `class_distribution` (one decoder step). Longer labels: the
    teacher-forced likelihood of each whole label (with EOS), softmax over the labels. With
    `require_single_token` a multi-token label raises (a judge's contract).
    """
    ids = self.label_ids(labels)
    single = all(len(i) == 1 for i in ids)
    if require_single_token and not single:
      bad = [f"{label!r} -> {i}" for label, i in zip(labels, ids, strict=True) if len(i) != 1]
      raise ValueError(f"class strings must each be ONE token of {self.source} vocabulary; "
                       f"got {', '.join(bad)}")
    if _is_empty(inputs):
      return np.zeros((0, len(labels)), np.float32)
    out, scorer = [], self.label_scorer(labels)
    if single:
      class_ids = jnp.asarray([i[0] for i in ids], jnp.int32)
      for n, enc, _, _ in self.batches(inputs):
        out.append(np.asarray(scorer(self.params, self.place(enc), class_ids))[:n])
      return np.concatenate(out).astype(np.float32)
    eos = self.config.eos_token_id
    label_targets = token_rows.padded([label + [eos] for label in ids], max(map(len, ids)) + 1)
    for n, enc, _, _ in self.batches(inputs):
      targets = np.ascontiguousarray(np.broadcast_to(label_targets,
                                                     (len(enc),) + label_targets.shape))
      enc, targets = self.place(enc, targets)
      scores = np.asarray(scorer(self.params, enc, None, None, targets, None))[:n]
      out.append(np.asarray(jax.nn.softmax(jnp.asarray(scores), axis=-1)))
    return np.concatenate(out).astype(np.float32)


