"""Salience detector: input x gradient attributions of the generator, mapped to words.

For every response token t (teacher forced) and input token i, the raw salience is
`<d logit_t(y_t) / d e_i, e_i>` (method "grad_x_input"), or the gradient's L2 norm (method
"grad_norm", the paper's alternative). Then:

1. square (grad_x_input only) and normalise each output column to sum to one over the input;
2. merge subword tokens into words (`text.words`) by max; drop stopwords and the format's
   markup, keeping the words of the query and arguments (rows) and of the response (columns);
3. contribution of an input word = aggregate of its row, attribution of a response word =
   aggregate of its column; aggregates: "max" (paper), "sum", "neg_entropy" (exp(-entropy) of
   the renormalised row / column: 1 when concentrated, 1/n when flat; positive so the
   geometric mean stays defined);
4. hallucination = 1 - gmean(attributions); coverage = 1 - min over perspectives of
   gmean(contributions of that side's argument words). Word scores are 1 - value.

Speed: one forward pass per example. The encoder and the decoder's chosen logits (no
vocabulary projection) each run once under `jax.vjp`; the two VJPs are then vmapped over
`chunk_size` one-hot cotangents at a time (batched matmuls; the chunk bounds memory), in a
device loop over chunks: one compiled program per power-of-two-bucketed (input, output) shape,
chunks holding only padding not run. This relies on the XLA:CPU workaround in
`jaxmoral.backends.xla_flags`: without it this program returned wrong gradients.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import typing
from typing import Any, Literal, Optional, Sequence

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np

from jaxmoral import model_dirs
from jaxmoral import progress
from jaxmoral import prompt_tuning
from jaxmoral import token_rows
from jaxmoral import validation
from jaxmoral.models.config import T5Config
from jaxmoral.models.t5 import T5
from jaxmoral.models.t5 import shift_right
from jaxmoral.models.t5 import target_logit_rows
from jaxmoral.npov import task
from jaxmoral.npov import text as text_lib
from jaxmoral.npov.detectors import base

Array = jax.Array
Method = Literal["grad_x_input", "grad_norm"]
Aggregation = Literal["max", "sum", "neg_entropy"]
METHODS, AGGREGATIONS = typing.get_args(Method), typing.get_args(Aggregation)


@functools.lru_cache(maxsize=32)
def _salience_fn(config: T5Config, method: str, chunk_size: int, with_prompt: bool,
                 partitioner: Any = None) -> Any:
  """Jitted (padded output, padded input) salience of one example; see the module doc.

  With a partitioner: compiled for its mesh, the parameters in its shardings (the two VJPs
  run model parallel), the example and the salience matrix replicated.
  """
  model = T5(config)

  def run(params: Any, encoder_tokens: Array, targets: Array, num_chunks: Array,
          prompt: Any) -> Array:  # `prompt`: given whenever the detector is prompt-tuned.
    mask = encoder_tokens != config.pad_token_id
    embeds = typing.cast(Array, model.apply({"params": params}, encoder_tokens, method=T5.embed))
    full_mask = prompt_tuning.prepend_prompt(prompt, embeds, mask)[1] if with_prompt else mask

    def encode(e: Array) -> Array:
      if with_prompt:
        e = prompt_tuning.prepend_prompt(prompt, e, mask)[0]
      return typing.cast(Array, model.apply({"params": params}, None, encoder_embeds=e,
                                            encoder_mask=full_mask, method=T5.encode))

    encoded, encoder_vjp = jax.vjp(encode, embeds)
    decoder_inputs = shift_right(targets, config.decoder_start_token_id)
    rows = target_logit_rows(params, config, targets[0])

    def target_logits(h: Array) -> Array:
      _, hidden = typing.cast(tuple[Array, Array], model.apply(
          {"params": params}, h, full_mask, decoder_inputs, method=T5.decode))
      return jnp.sum(hidden[0].astype(jnp.float32) * rows, axis=-1)

    _, decoder_vjp = jax.vjp(target_logits, encoded)
    length = targets.shape[1]
    inputs = embeds[0].astype(jnp.float32)

    def chunk(index: Array, out: Array) -> Array:
      start = index * chunk_size
      cotangents = jax.nn.one_hot(start + jnp.arange(chunk_size), length, dtype=jnp.float32)
      to_encoded = jax.vmap(lambda c: decoder_vjp(c)[0])(cotangents)
      grads = jax.vmap(lambda c: encoder_vjp(c)[0][0])(to_encoded).astype(jnp.float32)
      values = (jnp.sum(grads * inputs[None], axis=-1) if method == "grad_x_input"
                else jnp.sqrt(jnp.sum(jnp.square(grads), axis=-1)))
      return jax.lax.dynamic_update_slice(out, values, (start, 0))

    out = jnp.zeros((length, encoder_tokens.shape[1]), jnp.float32)
    return jax.lax.fori_loop(0, num_chunks, chunk, out)

  return model_dirs.jit_with_params(run, config, partitioner,
                                    replicated=(True, True, True, with_prompt))


def token_salience(model: T5, params: Any, *, input_ids: Sequence[int],
                   target_ids: Sequence[int], prompt: Optional[Any] = None,
                   method: Method = "grad_x_input", chunk_size: int = 16,
                   input_bucket: int = 64, partitioner: Any = None) -> np.ndarray:
  """Raw token salience, float32 (len(input_ids), len(target_ids)), of one example.

  Args:
    model, params: The generator (`T5`; only its config is used) and its base parameters.
    input_ids: Encoder token ids (no padding).
    target_ids: The response token ids the decoder is teacher forced with (EOS included if
      wanted); entry [i, t] attributes the logit of `target_ids[t]`.
    prompt: Optional soft prompt (P, d_model) of a prompt-tuned generator.
    chunk_size: Output positions per batched backward pass (bounds memory: the encoder's
      backward pass holds about chunk_size x heads x input_length^2 attention values).
    input_bucket: Inputs are padded to this times a power of two (fewer compilations);
      outputs likewise to `chunk_size` times a power of two.
    partitioner: Run on its mesh, `params` in its shardings (`model_dirs.load` with it).
  """
  if method not in METHODS:
    raise ValueError(f"token_salience: unknown method {method!r}")
  validation.positive_int(chunk_size, "token_salience: chunk_size")
  n_in, n_out = len(input_ids), len(target_ids)
  if n_in == 0 or n_out == 0:
    return np.zeros((n_in, n_out), np.float32)
  if 0 in list(input_ids):
    raise ValueError("token_salience: input_ids contain the pad id 0")
  encoder = np.zeros((1, token_rows.bucket(n_in, input_bucket)), np.int32)
  encoder[0, :n_in] = input_ids
  targets = np.zeros((1, token_rows.bucket(n_out, chunk_size)), np.int32)
  targets[0, :n_out] = target_ids
  fn = _salience_fn(model.config, method, chunk_size, prompt is not None, partitioner)
  prompt = None if prompt is None else np.asarray(prompt)
  num_chunks = np.int32(-(-n_out // chunk_size))
  inputs = (encoder, targets, num_chunks, prompt)
  if partitioner is not None:
    inputs = partitioner.shard_inputs(inputs)  # Batch 1: replicated.
  return np.asarray(fn(params, *inputs))[:n_out, :n_in].T


@dataclasses.dataclass(frozen=True)
class Tokenized:
  """Token ids of a text and each token's [start, end) character span in it."""
  ids: tuple[int, ...]
  spans: tuple[tuple[int, int], ...]


class SentencePieceTokenizer:
  """Token ids with character offsets, from a SentencePiece model (T5 vocabularies)."""

  def __init__(self, vocabulary: Any):
    """`vocabulary`: a `vocab.SentencePieceVocabulary` (or seqio's), or a model file's path."""
    import sentencepiece as spm  # pylint: disable=g-import-not-at-top
    path = getattr(vocabulary, "sentencepiece_model_file", vocabulary)
    self._sp = spm.SentencePieceProcessor(model_file=str(path))

  def __call__(self, text: str) -> Tokenized:
    proto = self._sp.encode(text, return_type="proto")
    # SentencePiece's offsets count UTF-8 bytes; words are found by character offsets, so
    # "café", a curly quote or a dash would otherwise shift every later word's tokens.
    char_of_byte = np.repeat(np.arange(len(text)),
                             [len(c.encode("utf-8")) for c in text]).tolist() + [len(text)]
    spans = tuple((char_of_byte[p.begin],
                   char_of_byte[p.end - 1] + 1 if p.end > p.begin else char_of_byte[p.end])
                  for p in proto.pieces)
    return Tokenized(tuple(p.id for p in proto.pieces), spans)


def _token_groups(spans: Sequence[tuple[int, int]], word_spans: Sequence[tuple[int, int]]
                  ) -> list[list[int]]:
  """For each word, the tokens overlapping it (a word spans one or more subword tokens)."""
  return [[t for t, (b, e) in enumerate(spans) if b < end and start < e]
          for start, end in word_spans]


def _truncated(tokens: Tokenized, limit: int, what: str, example_id: str
               ) -> tuple[list[int], list[tuple[int, int]]]:
  """The ids and spans of `tokens`, cut (with a warning) to leave room for EOS in `limit`."""
  if len(tokens.ids) + 1 > limit:
    logging.warning("salience: example %s %s truncated to %d tokens", example_id, what, limit)
  return list(tokens.ids[:limit - 1]), list(tokens.spans[:limit - 1])


@dataclasses.dataclass(frozen=True)
class WordMap:
  """Salience between content words of the input (rows: (field, argument index, word), the
  offsets within that field's text) and of the response (columns): `matrix` after
  normalisation and max merging, `token_matrix` the raw (input tokens, output tokens) one."""
  input_words: tuple[tuple[str, int, text_lib.Word], ...]
  response_words: tuple[text_lib.Word, ...]
  matrix: np.ndarray
  token_matrix: np.ndarray


def _aggregate(matrix: np.ndarray, axis: int, how: str) -> np.ndarray:
  if matrix.shape[axis] == 0:
    return np.zeros(matrix.shape[1 - axis])
  if how == "max":
    return matrix.max(axis=axis)
  if how == "sum":
    return matrix.sum(axis=axis)
  total = matrix.sum(axis=axis, keepdims=True)
  p = matrix / np.where(total > 0, total, 1.0)
  entropy = -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), axis=axis)
  return np.exp(-entropy)


@gin.configurable
@dataclasses.dataclass(frozen=True, kw_only=True)
class SalienceConfig:
  """Salience detector options: `method`, `aggregation` (module docstring), `chunk_size` and
  `input_bucket` (`token_salience`); longer inputs and responses than `max_input_tokens` /
  `max_target_tokens` are truncated (with a warning)."""
  method: Method = "grad_x_input"
  aggregation: Aggregation = "max"
  chunk_size: int = 16
  input_bucket: int = 64
  max_input_tokens: int = 1024
  max_target_tokens: int = 512

  def __post_init__(self):
    for name, choices in (("method", METHODS), ("aggregation", AGGREGATIONS)):
      if getattr(self, name) not in choices:
        raise ValueError(f"SalienceConfig.{name}: unknown {getattr(self, name)!r}")
    for name in ("chunk_size", "input_bucket", "max_input_tokens", "max_target_tokens"):
      validation.positive_int(getattr(self, name), f"SalienceConfig.{name}")


class SalienceDetector:
  """Salience detector over a (possibly prompt-tuned) generator."""

  def __init__(self, *, model: T5, params: Any, tokenizer: Any,
               prompt: Optional[Any] = None, config: SalienceConfig = SalienceConfig(),
               partitioner: Any = None):
    """
    Args:
      model, params: The generator network and its base parameters.
      tokenizer: Callable text -> `Tokenized` (e.g. `SentencePieceTokenizer(vocab)`).
      prompt: The generator's soft prompt, if prompt-tuned.
      partitioner: The mesh the VJPs run on; `params` are placed in its shardings.
    """
    self.model, self.tokenizer = model, tokenizer
    self.params = nn.meta.unbox(params)
    if partitioner is not None:
      self.params = jax.device_put(self.params,
                                   model_dirs.param_shardings(model.config, partitioner))
    self.prompt, self.config, self.partitioner = prompt, config, partitioner

  def word_map(self, example: task.NpovExample) -> WordMap:
    """Token salience of `example.response` given its input, merged into content words."""
    cfg = self.config
    text, spans = task.format_input_with_spans(example)
    input_ids, input_spans = _truncated(self.tokenizer(text), cfg.max_input_tokens, "input",
                                        example.id)
    target_ids, target_spans = _truncated(self.tokenizer(example.response),
                                          cfg.max_target_tokens, "response", example.id)
    eos = self.model.config.eos_token_id
    raw = token_salience(self.model, self.params, input_ids=input_ids + [eos],
                         target_ids=target_ids + [eos], prompt=self.prompt,
                         method=cfg.method, chunk_size=cfg.chunk_size,
                         input_bucket=cfg.input_bucket, partitioner=self.partitioner)
    values = np.square(raw) if cfg.method == "grad_x_input" else np.abs(raw)
    column_sums = values.sum(axis=0, keepdims=True)
    values = values / np.where(column_sums > 0, column_sums, 1.0)

    # Rows: content words inside the query / argument values (markup words are not input).
    words = [(span, w) for span in spans
             for w in text_lib.words(text[span.start:span.end]) if not w.is_stopword]
    rows = [(span.field, span.index, w) for span, w in words]
    row_spans = [(span.start + w.start, span.start + w.end) for span, w in words]
    columns = [w for w in text_lib.words(example.response) if not w.is_stopword]
    row_groups = _token_groups(input_spans, row_spans)
    column_groups = _token_groups(target_spans, [(w.start, w.end) for w in columns])
    keep_rows = [i for i, g in enumerate(row_groups) if g]  # dropped by truncation otherwise
    keep_columns = [j for j, g in enumerate(column_groups) if g]
    merged_rows = np.stack([values[row_groups[i]].max(axis=0) for i in keep_rows]) if (
        keep_rows) else np.zeros((0, values.shape[1]))
    matrix = np.stack([merged_rows[:, column_groups[j]].max(axis=1) for j in keep_columns],
                      axis=1) if keep_columns else np.zeros((len(keep_rows), 0))
    return WordMap(tuple(rows[i] for i in keep_rows), tuple(columns[j] for j in keep_columns),
                   matrix, raw)

  def detect_from_map(self, word_map: WordMap) -> base.Detection:
    """Example and word scores from a `WordMap`."""
    how = self.config.aggregation
    attribution = _aggregate(word_map.matrix, 0, how)   # per response word
    contribution = _aggregate(word_map.matrix, 1, how)  # per input word
    hallucination = 1.0 - base.gmean(attribution)
    by_side = ([c for (field, _, _), c in zip(word_map.input_words, contribution, strict=False)
                if field == side] for side in task.SIDES)
    side_means = [base.gmean(values) for values in by_side if values]
    coverage = 1.0 - min(side_means) if side_means else 0.0
    response_words = tuple(base.WordScore("response", 0, w.text, w.start, w.end, 1.0 - float(a))
                           for w, a in zip(word_map.response_words, attribution, strict=False))
    argument_words = tuple(base.WordScore(field, index, w.text, w.start, w.end, 1.0 - float(c))
                           for (field, index, w), c in zip(word_map.input_words, contribution,
                                                           strict=False)
                           if field in task.SIDES)
    return base.Detection(hallucination, coverage, response_words, argument_words)

  def detect_batch(self, examples: Sequence[task.NpovExample]) -> list[base.Detection]:
    shown = progress.ProgressLog("salience examples", len(examples))
    out = []
    for e in examples:
      out.append(self.detect_from_map(self.word_map(e)))
      shown.update(len(out))
    return out
