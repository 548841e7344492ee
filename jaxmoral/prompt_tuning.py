"""Soft prompt tuning: P trainable vectors prefixed to the encoder input embeddings.

The prompt takes encoder positions 0..P-1 and is always visible (the encoder mask gains P
ones). Only the prompt is trained, and a prompted tree `{"base": base_params, "prompt": (P,
d_model) float32}` references the base arrays, so any number of prompts share one checkpoint.
`PromptedT5` has T5's `__call__`, so `losses.seq2seq_loss_fn(PromptedT5(...))` trains a prompt.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import typing
from typing import Any, Literal, Optional, Sequence

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np

from jaxmoral import fileio
from jaxmoral import losses
from jaxmoral import optimizers
from jaxmoral import params_export
from jaxmoral import run_layout
from jaxmoral import train as train_lib
from jaxmoral import validation
from jaxmoral.models import param_init
from jaxmoral.models import trainable
from jaxmoral.models.config import T5Config
from jaxmoral.models.t5 import T5

Array = jax.Array
InitMethod = Literal["vocab_sample", "words", "uniform"]
# Trainer mask: the one top-level "prompt" leaf is trained, everything under "base" is frozen.
PROMPT_PATTERN = r"^prompt$"
PROMPT_FILE = "prompt.npy"
META_FILE = "prompt.json"


@gin.configurable
@dataclasses.dataclass(frozen=True, kw_only=True)
class PromptConfig:
  """How a soft prompt is shaped and initialised (paper defaults: P=5, N=5000).

  Attributes:
    length: Number of prompt vectors P.
    init: "vocab_sample" (a sample without replacement of the embeddings of ids [0, N);
      SentencePiece ids are roughly frequency ordered, so these are common tokens), "words"
      (the embeddings of `init_words`, e.g. the class labels; each word's pieces averaged;
      the remaining rows are vocab samples) or "uniform" (U(-uniform_scale, uniform_scale)).
    vocab_sample_size, init_words, uniform_scale: N, the words (at most `length`) and the
      half-width of `init`.
  """
  length: int = 5
  init: InitMethod = "vocab_sample"
  vocab_sample_size: int = 5000
  init_words: tuple[str, ...] = ()
  uniform_scale: float = 0.5

  def __post_init__(self):
    validation.positive_int(self.length, "PromptConfig.length")
    if self.init not in ("vocab_sample", "words", "uniform"):
      raise ValueError(f"PromptConfig.init: unknown {self.init!r}; use vocab_sample, words, "
                       "uniform")
    if self.vocab_sample_size < self.length:
      raise ValueError(f"PromptConfig.vocab_sample_size ({self.vocab_sample_size}) must be >= "
                       f"length ({self.length}): the sample is without replacement")
    if self.init == "words" and not self.init_words:
      raise ValueError("PromptConfig.init_words is empty but init='words'")
    if len(self.init_words) > self.length:
      raise ValueError(f"PromptConfig.init_words has {len(self.init_words)} words for a prompt "
                       f"of length {self.length}")
    if not self.uniform_scale > 0:
      raise ValueError(f"PromptConfig.uniform_scale must be > 0, got {self.uniform_scale}")


def init_prompt(config: PromptConfig, *, rng: Array, embedding_table: Any,
                word_ids: Optional[Sequence[Sequence[int]]] = None) -> np.ndarray:
  """A (P, d_model) float32 prompt from the base's (vocab, d_model) `embedding_table`.

  `word_ids` (init="words" only): the token ids of each of `config.init_words`.
  """
  table = np.asarray(embedding_table, np.float32)
  vocab, width = table.shape
  if config.init == "uniform":
    return np.asarray(jax.random.uniform(rng, (config.length, width), jnp.float32,
                                         -config.uniform_scale, config.uniform_scale))
  n = min(config.vocab_sample_size, vocab)
  if n < config.length:
    raise ValueError(f"init_prompt: vocabulary has {vocab} rows, fewer than the prompt length "
                     f"{config.length}")
  ids = np.asarray(jax.random.choice(rng, n, (config.length,), replace=False))
  prompt = table[ids].copy()
  if config.init == "words":
    if word_ids is None or len(word_ids) != len(config.init_words):
      raise ValueError(f"init_prompt: init='words' needs word_ids for each of "
                       f"{list(config.init_words)}")
    for row, ids_of_word in enumerate(word_ids):
      if not len(ids_of_word) or max(ids_of_word) >= vocab:
        raise ValueError(f"init_prompt: bad ids {list(ids_of_word)} for word "
                         f"{config.init_words[row]!r}")
      prompt[row] = table[np.asarray(ids_of_word)].mean(axis=0)
  return prompt


def prepend_prompt(prompt: Array, embeds: Array, mask: Array) -> tuple[Array, Array]:
  """(B, L, D) embeds and (B, L) mask -> (B, P+L, D) and (B, P+L) with the prompt first."""
  batch = embeds.shape[0]
  rows = jnp.broadcast_to(prompt.astype(embeds.dtype)[None], (batch,) + prompt.shape)
  ones = jnp.ones((batch, prompt.shape[0]), mask.dtype)
  return jnp.concatenate([rows, embeds], axis=1), jnp.concatenate([ones, mask], axis=1)


class PromptedT5(nn.Module):
  """A T5 (submodule "base") with a soft prompt (param "prompt", (P, d_model))."""
  config: T5Config
  prompt_length: int

  def setup(self):
    self.base = T5(self.config)
    # Initialised by `init_prompt` in practice; zeros keep `init` cheap and deterministic.
    self.prompt = param_init.constant_param(self, "prompt", 0.0,
                                            (self.prompt_length, self.config.d_model),
                                            (None, "embed"))

  def __call__(self, encoder_input_tokens: Array, decoder_input_tokens: Array, *,
               encoder_segment_ids: Optional[Array] = None,
               decoder_segment_ids: Optional[Array] = None, deterministic: bool = True,
               return_hidden: bool = False) -> Array | tuple[Array, Array]:
    if encoder_segment_ids is not None or decoder_segment_ids is not None:
      raise ValueError("PromptedT5: packed examples (segment ids) are not supported; the "
                       "prompt would have to be repeated per segment")
    embeds, mask = prepend_prompt(self.prompt, self.base.embed(encoder_input_tokens),
                                  encoder_input_tokens != self.config.pad_token_id)
    return self.base(None, decoder_input_tokens, encoder_embeds=embeds, encoder_mask=mask,
                     deterministic=deterministic, return_hidden=return_hidden)


def prompted_params(base_params: Any, prompt: Any) -> dict[str, Any]:
  """The PromptedT5 tree; references `base_params` (no copy). Checks the prompt's width."""
  width = np.shape(nn.meta.unbox(base_params)["token_embedder"]["embedding"])[-1]
  shape = np.shape(nn.meta.unbox(prompt))
  if len(shape) != 2 or shape[1] != width:
    raise ValueError(f"prompt shape {shape} does not fit a base model with d_model={width}: "
                     f"expected (P, {width})")
  return {"base": base_params, "prompt": prompt}


def prompted_encoder_inputs(model: T5, base_params: Any, prompt: Array,
                            encoder_input_tokens: Array) -> tuple[Array, Array]:
  """(embeds, mask) with the prompt prefixed, for the base model's encode / decoding.sample."""
  mask = encoder_input_tokens != model.config.pad_token_id
  embeds = model.apply({"params": base_params}, encoder_input_tokens, method=T5.embed)
  return prepend_prompt(jnp.asarray(prompt), typing.cast(jax.Array, embeds), mask)


def save_prompt(prompt: Any, directory: str | os.PathLike, *,
                metadata: Optional[dict[str, Any]] = None, orbax: bool = False) -> str:
  """Saves a (P, d_model) prompt alone: `prompt.npy` (float32), `prompt.json` (shape, metadata).

  Args:
    directory: Created if missing; returned.
    metadata: JSON-serialisable extras (e.g. task, base checkpoint, label words).
    orbax: Also export it under `directory/orbax` (`params_export.export_params`), for tools
      that read only Orbax.
  """
  directory = os.fspath(directory)
  fileio.makedirs(directory)
  array = np.asarray(jax.device_get(nn.meta.unbox(prompt)), np.float32)
  if array.ndim != 2:
    raise ValueError(f"save_prompt: prompt must be (P, d_model), got shape {array.shape}")
  buffer = io.BytesIO()
  np.save(buffer, array)
  fileio.write_bytes(fileio.join(directory, PROMPT_FILE), buffer.getvalue())
  meta = {"length": array.shape[0], "d_model": array.shape[1], **(metadata or {})}
  fileio.write_text(fileio.join(directory, META_FILE), json.dumps(meta, indent=2, sort_keys=True))
  if orbax:
    params_export.export_params({"prompt": array}, fileio.join(directory, "orbax"))
  return directory


def prompt_directory(directory: str | os.PathLike) -> Optional[str]:
  """The folder holding a saved prompt (`prompt.npy` or `orbax/`): `directory` itself, or a
  prompt-tuning run's `MODEL_DIR/prompt`; None when neither holds one."""
  directory = os.fspath(directory)
  candidates = (directory, fileio.join(directory, run_layout.PROMPT_DIR))
  return next((c for c in candidates if fileio.exists(fileio.join(c, PROMPT_FILE))
               or fileio.isdir(fileio.join(c, "orbax"))), None)


def load_prompt(directory: str | os.PathLike) -> tuple[np.ndarray, dict[str, Any]]:
  """Loads `save_prompt`'s output, `prompt.npy` or else `orbax/`, from `prompt_directory`:
  (prompt (P, d_model) float32, metadata)."""
  directory = prompt_directory(directory) or os.fspath(directory)
  meta_path = fileio.join(directory, META_FILE)
  meta: dict[str, Any] = (json.loads(fileio.read_text(meta_path))
                          if fileio.exists(meta_path) else {})
  npy = fileio.join(directory, PROMPT_FILE)
  if fileio.exists(npy):
    prompt = np.load(io.BytesIO(fileio.read_bytes(npy)), allow_pickle=False)
  elif fileio.isdir(fileio.join(directory, "orbax")):
    prompt = np.asarray(params_export.load_params(fileio.join(directory, "orbax"))["prompt"])
  else:
    raise FileNotFoundError(f"load_prompt: no {PROMPT_FILE} or orbax/ in {directory}")
  if prompt.ndim != 2 or (meta and tuple(prompt.shape) != (meta["length"], meta["d_model"])):
    raise ValueError(f"load_prompt: {directory} holds a prompt of shape {prompt.shape}, "
                     f"metadata says {(meta.get('length'), meta.get('d_model'))}")
  return prompt.astype(np.float32), meta


# -- training ---------------------------------------------------------------------------------
class SavePromptHook(train_lib.TrainHook):
  """At the end of a run, saves the trained prompt on its own to `model_dir/prompt`."""

  def __init__(self, model_dir: str | os.PathLike, metadata: dict[str, Any]):
    self.directory = fileio.join(model_dir, run_layout.PROMPT_DIR)
    self.metadata = metadata

  def on_end(self, loop: Any, state: Any) -> None:
    del loop
    prompt = np.asarray(jax.device_get(state.params["prompt"]), np.float32)
    if jax.process_index() == 0:
      save_prompt(prompt, self.directory, metadata=self.metadata)


@gin.configurable
@dataclasses.dataclass(frozen=True, kw_only=True)
class PromptTuningModel(trainable.TrainableModel):
  """A soft prompt trained on a frozen base T5 (the paper's defaults in `PromptConfig`).

  Train it with `jaxmoral.runs.train_run` and the base (any model directory) as
  `init_checkpoint`; the prompt is initialised by `init_prompt` (words in the base's
  vocabulary) and, at the end, also saved on its own to `MODEL_DIR/prompt` (`load_prompt`).

  Attributes:
    config, prompt: The base model's T5Config, the prompt's length and initialiser.
    z_loss: T5X's z-loss coefficient.
    metadata: Extra JSON saved with the prompt (e.g. the task, label words).
  """
  config: T5Config
  prompt: PromptConfig = PromptConfig()
  z_loss: float = 1e-4
  metadata: Optional[dict[str, Any]] = None

  def module(self) -> PromptedT5:
    return PromptedT5(self.config, self.prompt.length)

  def loss_fn(self) -> Any:
    return losses.seq2seq_loss_fn(self.module(), z_loss=self.z_loss)

  @property
  def trainable_patterns(self) -> Sequence[str]:
    return (PROMPT_PATTERN,)

  def params_from_checkpoint(self, loaded: Any, rng: Array) -> dict[str, Any]:
    trainable.check_architecture(loaded, self.config)
    base = loaded.lm_params
    if loaded.prompt is not None and tuple(loaded.prompt.shape) == (
        self.prompt.length, self.config.d_model):
      return prompted_params(base, loaded.prompt)  # Continues a prompt-tuning run.
    word_ids = None
    if self.prompt.init == "words":
      if loaded.vocabulary is None:
        raise ValueError(f"PromptTuningModel: init='words' needs the base's vocabulary; "
                         f"{loaded.info.source} has none")
      word_ids = [list(loaded.vocabulary.encode(w)) for w in self.prompt.init_words]
    prompt = init_prompt(self.prompt, rng=rng,
                         embedding_table=jax.device_get(base["token_embedder"]["embedding"]),
                         word_ids=word_ids)
    return prompted_params(base, prompt)

  def settings(self) -> dict[str, Any]:
    return {"kind": "prompt_tuning", "prompt": dataclasses.asdict(self.prompt)}

  def hooks(self, model_dir: str) -> Sequence[Any]:
    return (SavePromptHook(model_dir, {"prompt_config": dataclasses.asdict(self.prompt),
                                       "model_config": self.config.to_dict(),
                                       **(self.metadata or {})}),)


def paper_optimizer(*, train_steps: int, learning_rate: float = 0.1,
                    warmup_steps: int = 500) -> Any:
  """The papers' prompt-tuning optimizer (as gin/optimizers/prompt_tuning.gin binds it):
  Adafactor, `learning_rate` after a linear warm-up (capped below `train_steps` for short
  runs), then linear decay to 0 at `train_steps`."""
  warmup = min(warmup_steps, max(train_steps - 1, 1))
  schedule = optimizers.make_schedule(name="warmup_linear_decay", base_learning_rate=learning_rate,
                                      warmup_steps=warmup, total_steps=max(train_steps, warmup + 1))
  return optimizers.make_optimizer(name="adafactor", learning_rate=schedule,
                                   multiply_by_parameter_scale=False)
