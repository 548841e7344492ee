"""Training entry points: the joint Diamante model, and a plain generator for candidates.

Both plug a loss into the core `Trainer` and `train.train` loop (resume, TensorBoard, NaN
stop), then export a self-contained bundle to `<model_dir>/export` (see `bundle.py`).

- `train_diamante`: NLL(r_H) + L_PE on quadruples (pe_weight=0: the NLL-only ablation).
- `train_generator`: the core `seq2seq_loss_fn` on (context, human response) pairs, the model
  that samples candidates for a corpus without them (`candidates.generate_candidates`).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any, Optional, Sequence

import gin
import jax
import numpy as np
import optax

from jaxmoral import checkpoints, gin_utils, losses, optimizers, partitioning
from jaxmoral import train as train_loop
from jaxmoral import trainer as trainer_lib
from jaxmoral.data import pipeline
from jaxmoral.data import vocab as vocab_lib
from jaxmoral.diamante import bundle as bundle_lib
from jaxmoral.diamante import data
from jaxmoral.diamante.loss import diamante_loss_fn
from jaxmoral.models import t5
from jaxmoral.models.config import T5Config, t5_config

logger = logging.getLogger(__name__)
EXTRA_IDS = vocab_lib.T5_EXTRA_IDS


def corpus_texts(turns: Sequence[data.Turn]) -> list[str]:
  """Every distinct utterance and candidate (the vocabulary's training text)."""
  seen: dict[str, None] = {}
  for t in turns:
    for text in (*t.context, t.response, *t.candidates):
      seen.setdefault(text, None)
  return list(seen)


def build_vocabulary(turns: Sequence[data.Turn], *, model_dir: str, vocab_path: Optional[str],
                     vocab_size: int) -> str:
  """`vocab_path`, or a SentencePiece model trained on the turns in `<model_dir>/vocab/`."""
  if vocab_path is not None:
    if not os.path.isfile(vocab_path):
      raise FileNotFoundError(f"vocab_path: {vocab_path} does not exist")
    return vocab_path
  prefix = os.path.join(model_dir, "vocab", "spm")
  if os.path.isfile(prefix + ".model"):  # a resumed run keeps its vocabulary
    return prefix + ".model"
  return vocab_lib.train_sentencepiece(corpus_texts(turns), output_prefix=prefix,
                                       vocab_size=vocab_size, hard_vocab_limit=False)


def fit_model_config(*, size: str, vocab: Any, overrides: Optional[dict[str, Any]] = None,
                 config: Optional[T5Config] = None) -> T5Config:
  """`config` or the named size, its vocabulary grown (to a multiple of 128) if too small."""
  if config is None:
    config = t5_config(size=size, **(overrides or {}))
  elif overrides:
    config = config.replace(**overrides)
  needed = int(vocab.vocab_size)
  if needed > config.vocab_size:
    config = config.replace(vocab_size=-(-needed // 128) * 128)
  return config


def _run(*, model_dir: str, model: t5.T5, loss_fn: Any, train_source: Any,
         eval_source: Any, train_steps: int, learning_rate: float,
         optimizer: str | optax.GradientTransformation,
         partitioner: Optional[partitioning.PjitPartitioner], seed: int, eval_every: int,
         eval_steps: int, log_every: int, checkpoint_every: int
         ) -> tuple[dict[str, float], Any]:
  """Core trainer + loop; returns (final metrics, final params on host)."""
  partitioner = partitioner or partitioning.PjitPartitioner()
  if isinstance(optimizer, str):
    optimizer = optimizers.make_optimizer(name=optimizer, learning_rate=learning_rate)
  trainer = trainer_lib.Trainer(init_params_fn=functools.partial(t5.init_params, model),
                                loss_fn=loss_fn, optimizer=optimizer, partitioner=partitioner,
                                learning_rate_fn=getattr(optimizer, "learning_rate", None))
  data_size = partitioner.mesh.shape[partitioning.DATA_AXIS]
  batch = train_source.batch_size
  if batch % data_size:
    raise ValueError(f"batch_size {batch} must be divisible by the data-parallel size "
                     f"{data_size} (devices / num_partitions)")
  if jax.process_count() > 1:
    train_source = train_source.shard(jax.process_index(), jax.process_count())
  result = train_loop.train(
      model_dir=model_dir, trainer=trainer, train_source=train_source, train_steps=train_steps,
      eval_source=eval_source, eval_every=eval_every,
      eval_steps=eval_steps if eval_source is not None else None,
      checkpoint_every=checkpoint_every, log_every=log_every, seed=seed)
  params = checkpoints.restore_params_from_run(checkpoints.run_checkpoints_dir(model_dir))
  return result, params


def _check_common(train_steps: int, batch_size: int, learning_rate: float) -> None:
  if not isinstance(train_steps, int) or train_steps < 1:
    raise ValueError(f"train_steps must be a positive int, got {train_steps!r}")
  if not isinstance(batch_size, int) or batch_size < 1:
    raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
  if not learning_rate > 0:
    raise ValueError(f"learning_rate must be > 0, got {learning_rate!r}")


def _prepare(caller: str, *, model_dir: str, train_path: Optional[str],
             train_turns: Optional[Sequence[data.Turn]], vocab_path: Optional[str],
             vocab_size: int, model_size: str, model_overrides: Optional[dict[str, Any]],
             model_config: Optional[T5Config], context_length: int, response_length: int,
             separator: str, train_steps: int, batch_size: int, learning_rate: float
             ) -> tuple[list[data.Turn], str, Any, T5Config, data.FeatureConfig]:
  """What both trainers start from: checked arguments, turns, vocabulary, config, features."""
  _check_common(train_steps, batch_size, learning_rate)
  if (train_path is None) == (train_turns is None):
    raise ValueError(f"{caller}: give exactly one of train_path, train_turns")
  turns = list(train_turns) if train_turns is not None else data.read_dialogues(train_path)
  checkpoints.make_run_dir(model_dir)
  if jax.process_index() == 0 and gin.config_str():
    gin_utils.write_operative_config(model_dir)
  vocab_path = build_vocabulary(turns, model_dir=model_dir, vocab_path=vocab_path,
                                vocab_size=vocab_size)
  vocab = vocab_lib.get_vocabulary(vocab_path)
  config = fit_model_config(size=model_size, vocab=vocab, overrides=model_overrides,
                            config=model_config)
  features = data.FeatureConfig(context_length=context_length, response_length=response_length,
                                separator=separator, eos_id=config.eos_token_id)
  return turns, vocab_path, vocab, config, features


@gin.configurable
def train_diamante(*, model_dir: str, train_path: Optional[str] = None,
                   train_turns: Optional[Sequence[data.Turn]] = None,
                   eval_path: Optional[str] = None,
                   eval_turns: Optional[Sequence[data.Turn]] = None,
                   vocab_path: Optional[str] = None, vocab_size: int = 400,
                   model_size: str = "tiny", model_overrides: Optional[dict[str, Any]] = None,
                   model_config: Optional[T5Config] = None, context_length: int = 128,
                   response_length: int = 32,
                   separator: str = data.DEFAULT_SEPARATOR, pe_weight: float = 1.0,
                   prefer_dissimilar: bool = False, pool_size: int = 5, batch_size: int = 16,
                   train_steps: int = 1000, learning_rate: float = 1e-3,
                   optimizer: str | optax.GradientTransformation = "adamw",
                   partitioner: Optional[partitioning.PjitPartitioner] = None, seed: int = 0,
                   eval_every: int = 0, eval_steps: int = 4, log_every: int = 50,
                   checkpoint_every: int = 1000) -> dict[str, Any]:
  """Trains generation and evaluation jointly (Diamante) and exports the bundle.

  Args:
    model_dir: Run directory (checkpoints/, train/, eval/ TensorBoard, vocab/, export/).
    train_path: Diamante-format JSONL with response candidates (or give `train_turns`).
    train_turns: Already-read turns instead of `train_path`.
    eval_path: Optional held-out JSONL; its quadruples are evaluated during training.
    eval_turns: Already-read held-out turns instead of `eval_path`.
    vocab_path: SentencePiece model; None trains one on the training text.
    vocab_size: Pieces of that trained vocabulary (plus 100 T5 extra ids).
    model_size: `jaxmoral.models.config.SIZES` entry.
    model_overrides: `T5Config` field overrides (vocab_size grows to fit the vocabulary).
    model_config: A full `T5Config` instead of `model_size` (gin: `%MODEL_CONFIG`).
    context_length: Encoder length (contexts truncated from the left).
    response_length: Decoder length.
    separator: Joins context utterances.
    pe_weight: Weight of the PE loss; 0 = NLL-only ablation.
    prefer_dissimilar: Draw r_M and r_R least character-F1-similar to r_H (per epoch pool).
    pool_size: Pool for `prefer_dissimilar`.
    batch_size: Global batch of quadruples (3x responses per step).
    train_steps: Total steps.
    learning_rate: Constant learning rate (used when `optimizer` is a name).
    optimizer: A `make_optimizer` name ("adamw", "adafactor", "sgd") or an optax
      transformation (gin: `%OPTIMIZER`).
    partitioner: Mesh and rules (gin: `%PARTITIONER`); None: data parallel on all devices.
    seed: Initialisation, data order and quadruple draws.
    eval_every: Evaluate held-out quadruples every this many steps (0: at the end only).
    eval_steps: Held-out batches per evaluation.
    log_every: Progress/TensorBoard interval.
    checkpoint_every: Checkpoint interval.

  Returns:
    `train.train`'s metrics plus `"export_dir"`.
  """
  train_turns, vocab_path, vocab, config, features = _prepare(
      "train_diamante", model_dir=model_dir, train_path=train_path, train_turns=train_turns,
      vocab_path=vocab_path, vocab_size=vocab_size, model_size=model_size,
      model_overrides=model_overrides, model_config=model_config,
      context_length=context_length, response_length=response_length, separator=separator,
      train_steps=train_steps, batch_size=batch_size, learning_rate=learning_rate)
  if eval_path is not None:
    eval_turns = data.read_dialogues(eval_path)
  model = t5.T5(config, with_scalar_head=True)
  source = data.QuadrupleSource(turns=train_turns, vocab=vocab, batch_size=batch_size,
                                features=features, seed=seed,
                                prefer_dissimilar=prefer_dissimilar, pool_size=pool_size)
  eval_source = None
  if eval_turns:
    eval_source = data.QuadrupleSource(turns=list(eval_turns), vocab=vocab,
                                       batch_size=batch_size, features=features, seed=seed + 1)
  logger.info("train_diamante: %d trainable turns, vocab %d, model %s, pe_weight %g",
              source.num_examples, vocab.vocab_size, model_size, pe_weight)
  result, params = _run(
      model_dir=model_dir, model=model, loss_fn=diamante_loss_fn(model, pe_weight=pe_weight),
      train_source=source, eval_source=eval_source, train_steps=train_steps,
      learning_rate=learning_rate, optimizer=optimizer, partitioner=partitioner,
      seed=seed, eval_every=eval_every, eval_steps=eval_steps, log_every=log_every,
      checkpoint_every=checkpoint_every)
  result["export_dir"] = bundle_lib.save(os.path.join(model_dir, "export"), params=params,
                                         config=config, vocab_path=vocab_path,
                                         features=features, with_scalar_head=True)
  return result


def pair_features(turns: Sequence[data.Turn], vocab: Any,
                  features: data.FeatureConfig) -> dict[str, np.ndarray]:
  """Seq2seq features (context -> human response) with Diamante's left-truncated contexts."""
  encoder = np.stack([data.encode_context(vocab, t.context, features) for t in turns])
  targets = np.stack([data.encode_response(vocab, t.response, features) for t in turns])
  return {"encoder_input_tokens": encoder, **data.response_features(targets)}


@gin.configurable
def train_generator(*, model_dir: str, train_path: Optional[str] = None,
                    train_turns: Optional[Sequence[data.Turn]] = None,
                    vocab_path: Optional[str] = None, vocab_size: int = 400,
                    model_size: str = "tiny", model_overrides: Optional[dict[str, Any]] = None,
                    model_config: Optional[T5Config] = None, context_length: int = 128,
                    response_length: int = 32,
                    separator: str = data.DEFAULT_SEPARATOR, batch_size: int = 16,
                    train_steps: int = 1000, learning_rate: float = 1e-3,
                    optimizer: str | optax.GradientTransformation = "adamw",
                    partitioner: Optional[partitioning.PjitPartitioner] = None, seed: int = 0,
                    log_every: int = 50, checkpoint_every: int = 1000) -> dict[str, Any]:
  """Trains a plain response generator (NLL on human responses; candidates not needed).

  Arguments as in `train_diamante`. The export has no scalar head; it is meant for
  `candidates.generate_candidates`.
  """
  train_turns, vocab_path, vocab, config, features = _prepare(
      "train_generator", model_dir=model_dir, train_path=train_path, train_turns=train_turns,
      vocab_path=vocab_path, vocab_size=vocab_size, model_size=model_size,
      model_overrides=model_overrides, model_config=model_config,
      context_length=context_length, response_length=response_length, separator=separator,
      train_steps=train_steps, batch_size=batch_size, learning_rate=learning_rate)
  model = t5.T5(config)
  source = pipeline.BatchSource(features=pair_features(train_turns, vocab, features),
                                batch_size=batch_size, seed=seed)
  result, params = _run(
      model_dir=model_dir, model=model, loss_fn=losses.seq2seq_loss_fn(model, z_loss=0.0),
      train_source=source, eval_source=None, train_steps=train_steps,
      learning_rate=learning_rate, optimizer=optimizer, partitioner=partitioner,
      seed=seed, eval_every=0, eval_steps=0, log_every=log_every,
      checkpoint_every=checkpoint_every)
  result["export_dir"] = bundle_lib.save(os.path.join(model_dir, "export"), params=params,
                                         config=config, vocab_path=vocab_path,
                                         features=features, with_scalar_head=False)
  return result
