"""The ClarifyDelphi models on the run's mesh, run in fixed-shape, jitted batches.

A model is any model directory (`jaxmoral.model_dirs`: a run, an export, a PPO run's tuned
policy, a Hugging Face folder or Hub id, ...). With a partitioner, its parameters are created
in the partitioner's shardings (FSDP / model parallel by the same logical-axis rules as the
PPO policy) and every call runs under that mesh. Texts are encoded on the host with the
model's own vocabulary (the models may differ), padded to fixed (batch, length) shapes so every
call reuses one compiled function, and decoded back to text. Generation is
`jaxmoral.decoding`'s sampler (its decode weights prepared once per model); label scoring is
`judge.class_distribution` (one-token labels) or `decoding.make_scorer` (multi-token labels).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import typing
from typing import Any, Literal, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxmoral import decoding
from jaxmoral import model_dirs
from jaxmoral import partitioning
from jaxmoral import token_rows
from jaxmoral.clarify import judge as judge_lib
from jaxmoral.models import t5


@dataclasses.dataclass(frozen=True, eq=False)
class ClarifyModel:
  """A loaded T5 with its vocabulary, fixed batch shapes and (optionally) its mesh.

  Attributes:
    model: The linen module.
    params: Parameters (unboxed, on device; sharded by `partitioner` when given).
    vocabulary: A `vocab.SentencePieceVocabulary` (encode/decode, eos_id).
    path: Where it was loaded from ("" for in-memory models).
    input_length: Encoder length (inputs truncated, EOS kept).
    batch_size: Rows per compiled call (the last chunk is zero-padded).
    partitioner: The mesh and rules the parameters and calls use (None: one device).
    decode_weights: The decoding backend's kernels for `params` (prepared once).
  """
  model: t5.T5
  params: Any
  vocabulary: Any
  path: str = ""
  input_length: int = 128
  batch_size: int = 32
  partitioner: Any = None
  decode_weights: Optional[decoding.DecodeWeights] = None

  def __post_init__(self):
    if self.partitioner is not None and self.batch_size % self.partitioner.data_parallel_size:
      raise ValueError(f"{self.path or 'ClarifyModel'}: batch_size {self.batch_size} is not "
                       f"divisible by the mesh's data axis ({self.partitioner.data_parallel_size})")

  def encode(self, texts: Sequence[str]) -> np.ndarray:
    """(N, input_length) int32, EOS-terminated, 0-padded."""
    return encode_texts(self.vocabulary, texts, self.input_length)

  def decode(self, rows: Any, lengths: Any = None) -> list[str]:
    """Texts of token rows (up to EOS / `lengths`)."""
    rows = np.asarray(rows)
    out = []
    for i, row in enumerate(rows):
      ids = row[:int(lengths[i])] if lengths is not None else row
      out.append(self.vocabulary.decode(token_rows.text_ids(ids, self.model.config.eos_token_id)))
    return out

  def place(self, tokens: np.ndarray) -> Any:
    """A batch of token rows on the mesh (rows over "data"), or as is without one."""
    if self.partitioner is None:
      return tokens
    return self.partitioner.shard_inputs(tokens)

  def context(self):
    return self.partitioner.context() if self.partitioner is not None else contextlib.nullcontext()


def encode_texts(vocabulary: Any, texts: Sequence[str], length: int) -> np.ndarray:
  """Host tokenisation: ids + EOS, truncated keeping EOS, 0-padded to `length`."""
  eos = int(getattr(vocabulary, "eos_id", 1))
  tokens = np.zeros((len(texts), length), np.int32)
  for i, text in enumerate(texts):
    ids = list(vocabulary.encode(text))[:length - 1] + [eos]
    tokens[i, :len(ids)] = ids
  return tokens


@functools.lru_cache(maxsize=16)
def _load_cached(path: str, step: Optional[int], dtype: Optional[str],
                 partitioner: Any) -> tuple[t5.T5, Any, Any, Optional[decoding.DecodeWeights]]:
  loaded = model_dirs.load(path, partitioner=partitioner, step=step, dtype=dtype)
  if loaded.vocabulary is None:
    raise ValueError(f"{path}: no vocabulary (vocab/spiece.model or spiece.model); "
                     "ClarifyDelphi models read and write text")
  model = t5.T5(loaded.config)
  params = loaded.lm_params
  return model, params, loaded.vocabulary, model_dirs.decode_weights(model, params, partitioner)


def load_model(path: str | os.PathLike, *, step: Optional[int] = None, input_length: int = 128,
               batch_size: int = 32, dtype: Optional[str] = None,
               partitioner: Any = None) -> ClarifyModel:
  """Loads any model directory (cached per path and partitioner: a directory serving several
  roles, such as a multi-task model, is loaded once). A PPO run gives its tuned policy.

  Raises:
    ValueError: The directory carries no vocabulary (ClarifyDelphi models read text).
  """
  key = os.path.abspath(os.fspath(path)) if os.path.exists(path) else os.fspath(path)
  model, params, vocabulary, weights = _load_cached(key, step, dtype, partitioner)
  return ClarifyModel(model=model, params=params, vocabulary=vocabulary, path=os.fspath(path),
                      input_length=input_length, batch_size=batch_size,
                      partitioner=partitioner, decode_weights=weights)


def with_shapes(cm: ClarifyModel, *, input_length: Optional[int] = None,
                batch_size: Optional[int] = None) -> ClarifyModel:
  return dataclasses.replace(cm, input_length=input_length or cm.input_length,
                             batch_size=batch_size or cm.batch_size)


def _chunks(cm: ClarifyModel, tokens: np.ndarray):
  """Fixed-size (batch_size) chunks of token rows, the last one zero-padded."""
  n = len(tokens)
  for start in range(0, n, cm.batch_size):
    chunk = tokens[start:start + cm.batch_size]
    count = len(chunk)
    if count < cm.batch_size:
      pad = np.zeros((cm.batch_size - count, tokens.shape[1]), tokens.dtype)
      pad[:, 0] = cm.model.config.eos_token_id  # a valid (empty) input, no NaN from masking
      chunk = np.concatenate([chunk, pad])
    yield chunk, count


@typing.overload
def generate(cm: ClarifyModel, inputs: Sequence[str], *, max_decode_length: int = 32,
             num_samples: int = 1, greedy: bool = True, temperature: float = 1.0,
             top_p: float = 1.0, top_k: int = 0, rng: Optional[jax.Array] = None,
             return_logprobs: Literal[False] = False) -> list[list[str]]: ...


@typing.overload
def generate(cm: ClarifyModel, inputs: Sequence[str], *, max_decode_length: int = 32,
             num_samples: int = 1, greedy: bool = True, temperature: float = 1.0,
             top_p: float = 1.0, top_k: int = 0, rng: Optional[jax.Array] = None,
             return_logprobs: Literal[True]) -> tuple[list[list[str]], np.ndarray]: ...


def generate(cm: ClarifyModel, inputs: Sequence[str], *, max_decode_length: int = 32,
             num_samples: int = 1, greedy: bool = True, temperature: float = 1.0,
             top_p: float = 1.0, top_k: int = 0, rng: Optional[jax.Array] = None,
             return_logprobs: bool = False) -> list[list[str]] | tuple[list[list[str]], np.ndarray]:
  """Decodes `num_samples` outputs per input (greedy or sampled) in fixed-shape batches.

  Returns:
    texts[i][k]; with `return_logprobs` also (N, num_samples) sequence log-probs under the
    sampling distribution.
  """
  if not inputs:
    return ([], np.zeros((0, num_samples))) if return_logprobs else []
  if rng is None:
    rng = jax.random.PRNGKey(0)
  fn = sampler(cm, max_decode_length=max_decode_length, num_samples=num_samples,
               temperature=temperature, top_k=top_k, top_p=top_p, greedy=greedy)
  texts, scores = [], []
  for k, (chunk, count) in enumerate(_chunks(cm, cm.encode(inputs))):
    out = fn(cm.params, cm.place(chunk), None, None, jax.random.fold_in(rng, k),
             cm.decode_weights)
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    logprobs = np.asarray((out.logprobs * out.mask).sum(-1))
    for i in range(count):
      texts.append(cm.decode(tokens[i], lengths[i]))
      scores.append(logprobs[i])
  return (texts, np.asarray(scores)) if return_logprobs else texts


def sampler(cm: ClarifyModel, *, max_decode_length: int, num_samples: int = 1,
            greedy: bool = True, temperature: float = 1.0, top_p: float = 1.0,
            top_k: int = 0) -> Any:
  """The jitted sampler `generate` calls (on `cm`'s mesh): `jaxmoral compile` lowers it."""
  return decoding.make_sampler(cm.model, max_decode_length=max_decode_length,
                               num_samples=num_samples, temperature=temperature, top_k=top_k,
                               top_p=top_p, greedy=greedy, eos_id=cm.model.config.eos_token_id,
                               partitioner=cm.partitioner)


@functools.lru_cache(maxsize=64)
def _class_fn(model: t5.T5, partitioner: Any) -> partitioning.PartitionedFunction:
  return partitioning.jit_in_context(functools.partial(judge_lib.class_distribution, model),
                                     partitioner)


def class_scorer(cm: ClarifyModel) -> Any:
  """The jitted `fn(params, tokens, class_ids) -> (B, C)` of one-token labels (on `cm`'s
  mesh): `jaxmoral compile` lowers it."""
  return _class_fn(cm.model, cm.partitioner)


def label_scorer(cm: ClarifyModel, labels: Sequence[str]) -> Any:
  """The jitted function `label_distribution` runs for these labels: the one-step class
  scorer when every label is one token, else the teacher-forced sequence scorer."""
  if all(len(i) == 1 for i in label_ids(cm, labels)):
    return class_scorer(cm)
  return decoding.make_scorer(cm.model, cm.partitioner)


def label_ids(cm: ClarifyModel, labels: Sequence[str]) -> list[list[int]]:
  return [list(cm.vocabulary.encode(label)) for label in labels]


def label_distribution(cm: ClarifyModel, inputs: Sequence[str], labels: Sequence[str],
                       *, require_single_token: bool = False) -> np.ndarray:
  """(N, C) probabilities of the label strings as the output, normalised over the labels.

  One-token labels: `judge.class_distribution` (one decoder step). Longer labels: the
  teacher-forced likelihood of each whole label (with EOS), softmax over the labels. With
  `require_single_token` a multi-token label raises (the judge's contract).
  """
  ids = label_ids(cm, labels)
  single = all(len(i) == 1 for i in ids)
  if require_single_token and not single:
    bad = [f"{label!r} -> {i}" for label, i in zip(labels, ids, strict=True) if len(i) != 1]
    raise ValueError(f"class strings must each be ONE token of {cm.path or 'the'} vocabulary; "
                     f"got {', '.join(bad)}")
  if not inputs:
    return np.zeros((0, len(labels)), np.float32)
  out = []
  if single:
    class_ids = jnp.asarray([i[0] for i in ids], jnp.int32)
    fn = class_scorer(cm)
    for chunk, count in _chunks(cm, cm.encode(inputs)):
      out.append(np.asarray(fn(cm.params, cm.place(chunk), class_ids))[:count])
    return np.concatenate(out).astype(np.float32)
  eos = cm.model.config.eos_token_id
  length = max(len(i) for i in ids) + 1
  label_targets = np.zeros((len(ids), length), np.int32)
  for c, label in enumerate(ids):
    label_targets[c, :len(label) + 1] = label + [eos]
  scorer = decoding.make_scorer(cm.model, cm.partitioner)
  for chunk, count in _chunks(cm, cm.encode(inputs)):
    targets = np.broadcast_to(label_targets, (len(chunk),) + label_targets.shape)
    scores = np.asarray(scorer(cm.params, cm.place(chunk), None, None,
                               cm.place(np.ascontiguousarray(targets)), None))[:count]
    out.append(np.asarray(jax.nn.softmax(jnp.asarray(scores), axis=-1)))
  return np.concatenate(out).astype(np.float32)
