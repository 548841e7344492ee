"""The notebook API: load any jaxmoral-readable T5 and score or generate text in three lines.

  from jaxmoral import api
  model = api.Model.from_pretrained("path/to/dir")       # any model directory or Hub id
  model.generate(["a question"], greedy=True).texts      # [["an answer"]]
  model.score(["a question"], ["an answer"])             # log-likelihoods, (batch,)

`from_pretrained` reads every format `jaxmoral.model_dirs` knows: a Hugging Face folder
(safetensors or pytorch_model.bin) or Hub id, a T5X checkpoint, a jaxmoral export, a run (or
one step of it), a PPO run (its policy) or a Diamante run.

Inputs and targets are strings (needs a vocabulary; EOS appended, as T5 trains) or token ids
(a 2-D array or a list of lists, used as given; trailing 0s are padding). Every call pads the
batch to a bucket (lengths and row counts to powers of two, at least 8) so that a notebook
session compiles a handful of shapes, not one per call; compiled functions are kept per model.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional, Sequence, Union

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxmoral import decoding
from jaxmoral import model_dirs
from jaxmoral import token_rows
from jaxmoral.models import t5
from jaxmoral.models.config import T5Config

Params = Any
TextOrTokens = Union[Sequence[str], Sequence[Sequence[int]], np.ndarray, jax.Array]
MIN_BUCKET = 8


@dataclasses.dataclass(frozen=True)
class GenerateOutput:
  """What `Model.generate` returns.

  Attributes:
    tokens: (batch, n, max_decode_length) int32; EOS included, zeros after it. n is
      `num_samples` (sampling) or `beam_size` (beam search, best first).
    scores: (batch, n) float32: the sum of token log-probs under the sampled distribution
      (sampling) or the length-penalised beam score (beam search).
    lengths: (batch, n) int32 emitted tokens including EOS.
    texts: Decoded strings (batch lists of n), or None without a vocabulary.
  """
  tokens: np.ndarray
  scores: np.ndarray
  lengths: np.ndarray
  texts: Optional[list[list[str]]]

  def __repr__(self) -> str:
    # The texts and one score per output; the padded token arrays are in `.tokens`.
    batch, n = self.scores.shape
    shown = ([[t for t in row] for row in self.texts] if self.texts is not None
             else [[f"<{int(length)} tokens>" for length in row] for row in self.lengths])
    scores = np.array2string(self.scores, precision=3, separator=", ", threshold=20)
    return (f"GenerateOutput(texts={shown!r}, scores={scores}, "
            f"tokens=<{batch}x{n}x{self.tokens.shape[-1]} int32>)")


def _load_vocabulary(vocabulary: Any) -> Any:
  """A seqio vocabulary from an object, a `.model` path (extra ids read beside it) or None."""
  if vocabulary is None or not isinstance(vocabulary, (str, os.PathLike)):
    return vocabulary
  return model_dirs.vocabulary_from_file(vocabulary)


class Model:
  """A T5 with its params (and optionally its vocabulary), ready for notebook use.

  Attributes:
    config: The T5Config.
    params: Unboxed parameter tree on device.
    module: The `T5` linen module.
    vocabulary: seqio vocabulary or None (then only token ids are accepted/returned).
    source: Where it was loaded from.
    partitioner: The mesh the parameters are sharded over and every call runs on (None: one
      device).
  """

  def __init__(self, config: T5Config, params: Params, *, vocabulary: Any = None,
               source: str = "<in memory>", partitioner: Any = None):
    self.config = config
    self.module = t5.T5(config)
    self.partitioner = partitioner
    params = nn.meta.unbox(params)
    if partitioner is not None:
      # No copy when `model_dirs.load` read them into these shardings.
      self.params = jax.device_put(params, model_dirs.param_shardings(config, partitioner))
    elif all(isinstance(x, jax.Array) for x in jax.tree.leaves(params)):
      self.params = params
    else:
      self.params = jax.device_put(params)
    self.vocabulary = _load_vocabulary(vocabulary)
    self.source = source
    if self.vocabulary is not None and self.vocabulary.vocab_size > config.vocab_size:
      raise ValueError(f"{source}: vocabulary has {self.vocabulary.vocab_size} ids but the "
                       f"model's vocab_size is {config.vocab_size}")
    module = self.module
    # One jitted function each; jax keeps one executable per (bucketed) shape.
    logits = lambda p, enc, dec: module.apply({"params": p}, enc, dec)  # noqa: E731
    self._logits_fn = model_dirs.jit_with_params(logits, config, partitioner,
                                                 replicated=(False, False))
    # The decoding backend's kernels, prepared once for these parameters (on one device).
    self.decode_weights = model_dirs.decode_weights(self.module, self.params, partitioner)

  def __repr__(self) -> str:
    return (f"Model({self.source}: d_model={self.config.d_model}, "
            f"layers={self.config.num_encoder_layers}+{self.config.num_decoder_layers}, "
            f"vocab={self.config.vocab_size}, {self.config.feed_forward_proj}, "
            f"vocabulary={'yes' if self.vocabulary is not None else 'no'})")

  # -- loading ------------------------------------------------------------------------------
  @classmethod
  def from_pretrained(cls, path: str | os.PathLike, *, vocabulary: Any = None,
                      dtype: Optional[str] = None, step: Optional[int] = None,
                      config: Optional[T5Config] = None, partitioner: Any = None) -> Model:
    """Loads any model directory or Hub id (`jaxmoral.model_dirs`).

    Args:
      path: A Hugging Face folder (safetensors or pytorch_model.bin) or Hub id, a T5X
        checkpoint, a jaxmoral export, a run (or one step of it), a PPO or Diamante run.
      vocabulary: seqio vocabulary or path to a SentencePiece `.model`; default: the one
        stored with the checkpoint, if any.
      dtype: Activation dtype ("float32", "bfloat16"); default: the stored config's.
      step: Checkpoint step of a training run (default: the latest).
      config: Config for checkpoints that lack one (T5X, an export without config.json).
      partitioner: Place the parameters by its logical-axis rules (default: one device).

    Raises:
      FileNotFoundError: `path` is missing or in no known format (the message lists what was
        looked for).
    """
    loaded = model_dirs.load(path, partitioner=partitioner, step=step, dtype=dtype,
                             config=config, vocabulary=vocabulary)
    return cls(loaded.config, loaded.lm_params, vocabulary=loaded.vocabulary,
               source=os.fspath(path), partitioner=partitioner)

  # -- text <-> ids -------------------------------------------------------------------------
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
    texts = []
    for row in np.asarray(tokens).reshape(-1, np.shape(tokens)[-1]).tolist():
      texts.append(vocabulary.decode(token_rows.text_ids(
          row, self.config.eos_token_id, self.config.pad_token_id)))
    return texts

  def _ids(self, items: TextOrTokens, what: str) -> list[list[int]]:
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

  def _place(self, *arrays: Optional[np.ndarray]) -> tuple[Any, ...]:
    """Host arrays on the model's mesh (rows over "data" where they divide it)."""
    return arrays if self.partitioner is None else self.partitioner.shard_inputs(arrays)

  @staticmethod
  def _pad(rows: list[list[int]], batch: int, length: int) -> np.ndarray:
    out = np.zeros((batch, length), np.int32)
    for i, row in enumerate(rows):
      out[i, :len(row)] = row
    return out

  def _batches(self, inputs: TextOrTokens, targets: Optional[TextOrTokens], batch_size: int):
    """Yields (start, n, enc, dec_targets, target_lengths) bucketed numpy batches."""
    enc_rows = self._ids(inputs, "inputs")
    dec_rows = self._ids(targets, "targets") if targets is not None else None
    if dec_rows is not None and len(dec_rows) != len(enc_rows):
      raise ValueError(f"inputs has {len(enc_rows)} rows but targets has {len(dec_rows)}")
    enc_len = token_rows.bucket(max(len(r) for r in enc_rows), MIN_BUCKET)
    dec_len = (token_rows.bucket(max(len(r) for r in dec_rows), MIN_BUCKET) if dec_rows
               else 0)
    for start in range(0, len(enc_rows), batch_size):
      chunk = enc_rows[start:start + batch_size]
      rows = token_rows.bucket(len(chunk), MIN_BUCKET)
      enc = self._pad(chunk, rows, enc_len)
      if dec_rows is None:
        yield start, len(chunk), enc, None, None
        continue
      dec_chunk = dec_rows[start:start + batch_size]
      lengths = np.zeros(rows, np.int32)
      lengths[:len(dec_chunk)] = [len(r) for r in dec_chunk]
      yield start, len(chunk), enc, self._pad(dec_chunk, rows, dec_len), lengths

  # -- model calls --------------------------------------------------------------------------
  def logits(self, inputs: TextOrTokens, targets: TextOrTokens, *,
             batch_size: int = 32) -> np.ndarray:
    """Teacher-forced logits: (batch, longest target, vocab) float32.

    Position t holds the logits that predict `targets[:, t]` (decoder inputs are the targets
    shifted right behind the start id); positions past a row's length are padding.
    """
    outputs, longest = [], 0
    for _, n, enc, dec, lengths in self._batches(inputs, targets, batch_size):
      decoder_inputs = np.asarray(t5.shift_right(dec, self.config.decoder_start_token_id))
      outputs.append(np.asarray(self._logits_fn(self.params,
                                                *self._place(enc, decoder_inputs)))[:n])
      longest = max(longest, int(lengths.max()))
    return np.concatenate(outputs)[:, :longest]

  def score(self, inputs: TextOrTokens, targets: TextOrTokens, *,
            batch_size: int = 32) -> np.ndarray:
    """log p(target | input) of each pair, (batch,) float32 (EOS included for text targets)."""
    scores = []
    scorer = decoding.make_scorer(self.module, self.partitioner)
    for _, n, enc, dec, lengths in self._batches(inputs, targets, batch_size):
      enc, dec, lengths = self._place(enc, dec, lengths)
      scores.append(np.asarray(scorer(self.params, enc, None, None, dec, lengths))[:n])
    return np.concatenate(scores)

  def generate(self, inputs: TextOrTokens, *, max_decode_length: int = 64,
               num_samples: int = 1, temperature: float = 1.0, top_k: int = 0,
               top_p: float = 1.0, greedy: Optional[bool] = None, beam_size: int = 0,
               length_penalty: float = 0.6, no_repeat_ngram_size: int = 0, seed: int = 0,
               batch_size: int = 32) -> GenerateOutput:
    """Greedy, sampled or beam-searched continuations with `jaxmoral.decoding`.

    Greedy by default, as `jaxmoral infer`, T5X's predict and Hugging Face's `generate`:
    it samples when asked to (`greedy=False`, or any of `temperature`, `top_k`, `top_p`,
    `num_samples` set away from its default).

    Args:
      inputs: Strings or token ids.
      max_decode_length: Tokens generated at most (EOS included).
      num_samples: Samples per input (sampling).
      temperature, top_k, top_p, no_repeat_ngram_size: See `decoding.SampleConfig`.
      greedy: Argmax decoding (None: unless a sampling option above is set).
      beam_size: > 0 switches to beam search with this many beams (sampling options unused).
      length_penalty: Beam search brevity penalty alpha.
      seed: Sampling seed (batch i uses fold_in(PRNGKey(seed), i)).
      batch_size: Inputs per decoding call.

    Returns:
      `GenerateOutput` (texts when a vocabulary is present).
    """
    if greedy is None:
      greedy = (num_samples == 1 and temperature == 1.0 and top_k == 0 and top_p == 1.0)
    tokens, scores, lengths = [], [], []
    base = jax.random.PRNGKey(seed)
    if beam_size:
      beam_search = decoding.make_beam_search(
          self.module, beam_size=beam_size, max_decode_length=max_decode_length,
          length_penalty=length_penalty, eos_id=self.config.eos_token_id,
          partitioner=self.partitioner)
    else:
      sampler = decoding.make_sampler(
          self.module, max_decode_length=max_decode_length, num_samples=num_samples,
          temperature=temperature, top_k=top_k, top_p=top_p, greedy=greedy,
          no_repeat_ngram_size=no_repeat_ngram_size, eos_id=self.config.eos_token_id,
          partitioner=self.partitioner)
    for index, (_, n, enc, _, _) in enumerate(self._batches(inputs, None, batch_size)):
      (enc,) = self._place(enc)
      if beam_size:
        seqs, beam_scores = beam_search(self.params, enc, decode_weights=self.decode_weights)
        seqs = np.asarray(seqs)[:n]
        tokens.append(seqs)
        scores.append(np.asarray(beam_scores)[:n])
        lengths.append(token_rows.emitted_lengths(seqs, self.config.eos_token_id))
      else:
        out = sampler(self.params, enc, rng=jax.random.fold_in(base, index),
                      decode_weights=self.decode_weights)
        tokens.append(np.asarray(out.tokens)[:n])
        scores.append(np.asarray(jnp.sum(out.logprobs * out.mask, axis=-1))[:n])
        lengths.append(np.asarray(out.lengths)[:n])
    tokens_all = np.concatenate(tokens)
    texts = None
    if self.vocabulary is not None:
      texts = [self.decode_text(row) for row in tokens_all]
    return GenerateOutput(tokens=tokens_all, scores=np.concatenate(scores),
                          lengths=np.concatenate(lengths), texts=texts)


def from_pretrained(path: str | os.PathLike, **kwargs: Any) -> Model:
  """`Model.from_pretrained` as a function."""
  return Model.from_pretrained(path, **kwargs)
