"""Loading the ClarifyDelphi models and running them in fixed-shape, jitted batches.

A model is a run directory of `jaxmoral.runs.train_run` (model_config.json, vocab/,
checkpoints/) or a `jaxmoral export` directory (config.json, params/, vocab/). Texts are
encoded on the host with the model's own vocabulary (the models may differ), padded to fixed
(batch, length) shapes so every call reuses one compiled function, and decoded back to text.
Generation is `jaxmoral.decoding.sample`; label scoring is `judge.class_distribution` (one-token
labels) or `decoding.score_sequences` (multi-token labels).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxmoral import checkpoints, decoding, runs
from jaxmoral.clarify import judge as judge_lib
from jaxmoral.data import vocab as vocab_lib
from jaxmoral.models import config as config_lib
from jaxmoral.models import t5

# Where a PPO run exports its tuned question generator (MODEL_DIR/policy).
POLICY_DIR = "policy"


@dataclasses.dataclass(frozen=True, eq=False)
class ClarifyModel:
  """A loaded T5 with its vocabulary and fixed batch shapes.

  Attributes:
    model: The linen module.
    params: Parameters (unboxed, on device).
    vocabulary: seqio SentencePieceVocabulary (encode/decode, eos_id).
    path: Where it was loaded from ("" for in-memory models).
    input_length: Encoder length (inputs truncated, EOS kept).
    batch_size: Rows per compiled call (the last chunk is zero-padded).
  """
  model: t5.T5
  params: Any
  vocabulary: Any
  path: str = ""
  input_length: int = 128
  batch_size: int = 32

  def encode(self, texts: Sequence[str]) -> np.ndarray:
    """(N, input_length) int32, EOS-terminated, 0-padded."""
    return encode_texts(self.vocabulary, texts, self.input_length)

  def decode(self, rows: Any, lengths: Any = None) -> list[str]:
    """Texts of token rows (up to EOS / `lengths`)."""
    rows = np.asarray(rows)
    out = []
    for i, row in enumerate(rows):
      ids = row[:int(lengths[i])] if lengths is not None else row
      out.append(self.vocabulary.decode(strip_ids(ids, self.model.config.eos_token_id)))
    return out


def encode_texts(vocabulary: Any, texts: Sequence[str], length: int) -> np.ndarray:
  """Host tokenisation: ids + EOS, truncated keeping EOS, 0-padded to `length`."""
  eos = int(getattr(vocabulary, "eos_id", 1))
  tokens = np.zeros((len(texts), length), np.int32)
  for i, text in enumerate(texts):
    ids = list(vocabulary.encode(text))[:length - 1] + [eos]
    tokens[i, :len(ids)] = ids
  return tokens


def strip_ids(ids: Any, eos_id: int = 1) -> list[int]:
  """Ids before the first EOS (padding zeros removed)."""
  out = []
  for t in np.asarray(ids).tolist():
    if t == eos_id:
      break
    if t:
      out.append(int(t))
  return out


def _read_vocab(folder: pathlib.Path) -> Any:
  extra = folder / runs.VOCAB_DIR / "extra_ids.txt"
  extra_ids = int(extra.read_text()) if extra.is_file() else vocab_lib.T5_EXTRA_IDS
  spm = folder / runs.VOCAB_DIR / "spiece.model"
  if not spm.is_file():
    raise FileNotFoundError(f"{spm} not found: {folder} has no vocabulary")
  return vocab_lib.get_vocabulary(spm, extra_ids=extra_ids)


@functools.lru_cache(maxsize=16)
def _load_cached(path: str, step: Optional[int], dtype: Optional[str]
                 ) -> tuple[config_lib.T5Config, Any, Any]:
  folder = pathlib.Path(path)
  if (folder / POLICY_DIR / checkpoints.PARAMS_DIR).is_dir() and step is None:
    folder = folder / POLICY_DIR  # A PPO run: its tuned question generator.
  if (folder / runs.MODEL_CONFIG_FILE).is_file() and (folder / "checkpoints").is_dir():
    config, vocabulary = runs.load_run_files(folder)
    params = runs.restore_run_params(folder, step=step)
  elif (folder / checkpoints.PARAMS_DIR).is_dir():
    params, config_dict = checkpoints.load_exported(folder)
    if config_dict is None:
      raise FileNotFoundError(f"{folder}: exported params without config.json")
    config = config_lib.T5Config.from_dict(config_dict)
    vocabulary = _read_vocab(folder)
  else:
    raise FileNotFoundError(f"{folder}: neither a jaxmoral run directory (model_config.json + "
                            f"checkpoints/) nor an export (params/ + config.json)")
  if dtype is not None:
    config = config.replace(dtype=dtype)
  return config, params, vocabulary


def load_model(path: str | os.PathLike, *, step: Optional[int] = None, input_length: int = 128,
               batch_size: int = 32, dtype: Optional[str] = None) -> ClarifyModel:
  """Loads a run or export directory (cached per path: one load per process). A PPO run
  directory gives its tuned policy (`MODEL_DIR/policy`)."""
  config, params, vocabulary = _load_cached(os.path.abspath(os.fspath(path)), step, dtype)
  return ClarifyModel(model=t5.T5(config), params=params, vocabulary=vocabulary,
                      path=os.fspath(path), input_length=input_length, batch_size=batch_size)


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
  fn = decoding.make_sampler(cm.model, max_decode_length=max_decode_length,
                             num_samples=num_samples, temperature=temperature, top_k=top_k,
                             top_p=top_p, greedy=greedy, eos_id=cm.model.config.eos_token_id)
  texts, scores = [], []
  for k, (chunk, count) in enumerate(_chunks(cm, cm.encode(inputs))):
    out = fn(cm.params, chunk, None, None, jax.random.fold_in(rng, k))
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    logprobs = np.asarray((out.logprobs * out.mask).sum(-1))
    for i in range(count):
      texts.append(cm.decode(tokens[i], lengths[i]))
      scores.append(logprobs[i])
  return (texts, np.asarray(scores)) if return_logprobs else texts


@functools.lru_cache(maxsize=64)
def _class_fn(model: t5.T5):
  return jax.jit(functools.partial(judge_lib.class_distribution, model))


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
    bad = [f"{label!r} -> {i}" for label, i in zip(labels, ids) if len(i) != 1]
    raise ValueError(f"class strings must each be ONE token of {cm.path or 'the'} vocabulary; "
                     f"got {', '.join(bad)}")
  if not inputs:
    return np.zeros((0, len(labels)), np.float32)
  out = []
  if single:
    class_ids = jnp.asarray([i[0] for i in ids], jnp.int32)
    fn = _class_fn(cm.model)
    for chunk, count in _chunks(cm, cm.encode(inputs)):
      out.append(np.asarray(fn(cm.params, chunk, class_ids))[:count])
    return np.concatenate(out).astype(np.float32)
  eos = cm.model.config.eos_token_id
  length = max(len(i) for i in ids) + 1
  label_targets = np.zeros((len(ids), length), np.int32)
  for c, label in enumerate(ids):
    label_targets[c, :len(label) + 1] = label + [eos]
  for chunk, count in _chunks(cm, cm.encode(inputs)):
    targets = np.broadcast_to(label_targets, (len(chunk),) + label_targets.shape)
    scores = np.asarray(decoding.score_sequences(
        cm.model, cm.params, encoder_input_tokens=chunk, targets=targets))[:count]
    out.append(np.asarray(jax.nn.softmax(jnp.asarray(scores), axis=-1)))
  return np.concatenate(out).astype(np.float32)


def export_policy(params: Any, *, output_dir: str | os.PathLike, config: config_lib.T5Config,
                  vocabulary: Any) -> str:
  """Writes params + config + vocab as an export directory `load_model` reads."""
  import shutil
  checkpoints.export_params(params, output_dir, config=config.to_dict(), overwrite=True)
  vocab_dir = pathlib.Path(output_dir) / runs.VOCAB_DIR
  vocab_dir.mkdir(parents=True, exist_ok=True)
  shutil.copyfile(vocabulary.sentencepiece_model_file, vocab_dir / "spiece.model")
  (vocab_dir / "extra_ids.txt").write_text(str(vocabulary.extra_ids))
  return os.fspath(output_dir)
