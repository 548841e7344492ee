"""Soft prompt tuning: P trainable vectors prefixed to the encoder input embeddings.

The prompt rows take encoder positions 0..P-1 and are always visible: the encoder mask (used
by encoder self-attention and decoder cross-attention alike) is extended with P ones. Only the
prompt is trained; a base checkpoint is shared by any number of prompts (generator, classifiers)
without copies, since a prompted parameter tree just references the base arrays::

  params = {"base": base_params, "prompt": prompt}   # prompt: (P, d_model) float32

Entry points:
- `PromptedT5(config, prompt_length)`: linen wrapper whose `__call__` has T5's signature, so
  the core `losses.seq2seq_loss_fn(PromptedT5(...))` trains a prompt unchanged.
- `init_prompt(...)`: the initialisers (sample of the first N vocabulary embeddings, given
  words' embeddings, uniform).
- `prompted_encoder_inputs(...)`: (embeds, mask) with the prompt prefixed, for
  `decoding.sample(base_model, base_params, encoder_embeds=..., encoder_mask=...)`.
- `trainable_mask(params)`: True on the prompt only (the Trainer gives the base no optimizer
  state and no updates).
- `save_prompt` / `load_prompt`: the prompt alone (a small .npy plus JSON; optionally Orbax).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Literal, Optional, Sequence

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np

from jaxmoral import losses
from jaxmoral import optimizers
from jaxmoral import partitioning
from jaxmoral import trainer as trainer_lib
from jaxmoral.models import t5 as t5_lib
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
    vocab_sample_size: N for "vocab_sample".
    init_words: Words for "words" (at most `length`).
    uniform_scale: Half-width for "uniform".
  """
  length: int = 5
  init: InitMethod = "vocab_sample"
  vocab_sample_size: int = 5000
  init_words: tuple[str, ...] = ()
  uniform_scale: float = 0.5

  def __post_init__(self):
    if not isinstance(self.length, int) or self.length <= 0:
      raise ValueError(f"PromptConfig.length must be a positive int, got {self.length!r}")
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
  """A (P, d_model) float32 prompt.

  Args:
    config: Shape and initialiser.
    rng: PRNG key.
    embedding_table: The base model's `token_embedder/embedding` (vocab, d_model).
    word_ids: For init="words": the token ids of each of `config.init_words`.

  Returns:
    The prompt as a NumPy array.
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
  """A T5 (submodule "base") with a soft prompt (param "prompt", (P, d_model)).

  `__call__` matches `T5.__call__` for token inputs, so core losses apply unchanged.
  """
  config: T5Config
  prompt_length: int

  def setup(self):
    self.base = T5(self.config)
    # Initialised by `init_prompt` in practice; zeros keep `init` cheap and deterministic.
    self.prompt = self.param("prompt", nn.with_logical_partitioning(
        nn.initializers.zeros, (None, "embed")), (self.prompt_length, self.config.d_model),
        jnp.float32)

  def encoder_inputs(self, encoder_input_tokens: Array) -> tuple[Array, Array]:
    """Prompted input embeddings and mask for token ids (pad = 0 masked)."""
    mask = encoder_input_tokens != self.config.pad_token_id
    embeds = self.base.embed(encoder_input_tokens)
    return prepend_prompt(self.prompt, embeds, mask)

  def __call__(self, encoder_input_tokens: Array, decoder_input_tokens: Array, *,
               encoder_segment_ids: Optional[Array] = None,
               decoder_segment_ids: Optional[Array] = None, deterministic: bool = True,
               return_hidden: bool = False) -> Array | tuple[Array, Array]:
    if encoder_segment_ids is not None or decoder_segment_ids is not None:
      raise ValueError("PromptedT5: packed examples (segment ids) are not supported; the "
                       "prompt would have to be repeated per segment")
    embeds, mask = self.encoder_inputs(encoder_input_tokens)
    return self.base(None, decoder_input_tokens, encoder_embeds=embeds, encoder_mask=mask,
                     deterministic=deterministic, return_hidden=return_hidden)


def prompted_params(base_params: Any, prompt: Any) -> dict[str, Any]:
  """The PromptedT5 tree; references `base_params` (no copy). Checks the prompt's width."""
  width = np.shape(nn.meta.unbox(base_params)["token_embedder"]["embedding"])[-1]
  if np.ndim(nn.meta.unbox(prompt)) != 2 or np.shape(nn.meta.unbox(prompt))[1] != width:
    raise ValueError(f"prompt shape {np.shape(nn.meta.unbox(prompt))} does not fit a base "
                     f"model with d_model={width}: expected (P, {width})")
  return {"base": base_params, "prompt": prompt}


def trainable_mask(params: Any) -> Any:
  """Pytree of bools (same structure as `params`): True on the prompt only."""
  return {"base": jax.tree_util.tree_map(lambda _: False, params["base"]),
          "prompt": jax.tree_util.tree_map(lambda _: True, params["prompt"])}


def prompted_encoder_inputs(model: T5, base_params: Any, prompt: Array,
                            encoder_input_tokens: Array) -> tuple[Array, Array]:
  """(embeds, mask) with the prompt prefixed, for the base model's encode / decoding.sample."""
  mask = encoder_input_tokens != model.config.pad_token_id
  embeds = model.apply({"params": base_params}, encoder_input_tokens, method=T5.embed)
  return prepend_prompt(jnp.asarray(prompt), embeds, mask)


def save_prompt(prompt: Any, directory: str | os.PathLike, *,
                metadata: Optional[dict[str, Any]] = None, orbax: bool = False) -> str:
  """Saves a prompt on its own: `prompt.npy` (float32) and `prompt.json` (shape + metadata).

  Args:
    prompt: (P, d_model) array.
    directory: Created if missing.
    metadata: JSON-serialisable extras (e.g. task, base checkpoint, label words).
    orbax: Also export it as an Orbax params checkpoint under `directory/orbax`
      (`checkpoints.export_params`), for tools that read only Orbax.

  Returns:
    The directory.
  """
  directory = os.fspath(directory)
  os.makedirs(directory, exist_ok=True)
  array = np.asarray(jax.device_get(nn.meta.unbox(prompt)), np.float32)
  if array.ndim != 2:
    raise ValueError(f"save_prompt: prompt must be (P, d_model), got shape {array.shape}")
  np.save(os.path.join(directory, PROMPT_FILE), array)
  meta = {"length": array.shape[0], "d_model": array.shape[1], **(metadata or {})}
  with open(os.path.join(directory, META_FILE), "w", encoding="utf-8") as f:
    json.dump(meta, f, indent=2, sort_keys=True)
  if orbax:
    from jaxmoral import checkpoints  # pylint: disable=g-import-not-at-top
    checkpoints.export_params({"prompt": array}, os.path.join(directory, "orbax"))
  return directory


def load_prompt(directory: str | os.PathLike) -> tuple[np.ndarray, dict[str, Any]]:
  """Loads `save_prompt`'s output: (prompt (P, d_model) float32, metadata).

  Reads `prompt.npy` when present, else the Orbax export under `directory/orbax`.
  """
  directory = os.fspath(directory)
  meta_path = os.path.join(directory, META_FILE)
  meta: dict[str, Any] = {}
  if os.path.exists(meta_path):
    with open(meta_path, encoding="utf-8") as f:
      meta = json.load(f)
  npy = os.path.join(directory, PROMPT_FILE)
  if os.path.exists(npy):
    prompt = np.load(npy)
  elif os.path.isdir(os.path.join(directory, "orbax")):
    from jaxmoral import checkpoints  # pylint: disable=g-import-not-at-top
    prompt = np.asarray(checkpoints.load_params(os.path.join(directory, "orbax"))["prompt"])
  else:
    raise FileNotFoundError(f"load_prompt: no {PROMPT_FILE} or orbax/ in {directory}")
  if prompt.ndim != 2 or (meta and tuple(prompt.shape) != (meta["length"], meta["d_model"])):
    raise ValueError(f"load_prompt: {directory} holds a prompt of shape {prompt.shape}, "
                     f"metadata says {(meta.get('length'), meta.get('d_model'))}")
  return prompt.astype(np.float32), meta


# -- training -----------------------------------------------------------------------------------
@gin.configurable
def make_prompt_trainer(*, config: T5Config, prompt_length: int,
                        optimizer: Any, partitioner: Optional[Any] = None,
                        num_microbatches: int = 1, z_loss: float = 1e-4,
                        learning_rate_fn: Optional[Any] = None
                        ) -> tuple[trainer_lib.Trainer, PromptedT5]:
  """A core `Trainer` for a prompt over a frozen base: only the prompt has optimizer state.

  The loss is the core `losses.seq2seq_loss_fn` of `PromptedT5`. Start it with
  `trainer.init_state_from_params(prompted_params(base_params, prompt))`.
  """
  model = PromptedT5(config, prompt_length)
  partitioner = partitioner or partitioning.PjitPartitioner(num_partitions=1)
  trainer = trainer_lib.Trainer(
      init_params_fn=lambda rng: t5_lib.init_params(model, rng),
      loss_fn=losses.seq2seq_loss_fn(model, z_loss=z_loss), optimizer=optimizer,
      partitioner=partitioner, trainable_mask=PROMPT_PATTERN,
      num_microbatches=num_microbatches, learning_rate_fn=learning_rate_fn)
  return trainer, model


@gin.configurable
def train_prompt(*, model_dir: str | os.PathLike, config: T5Config, base_params: Any,
                 train_source: Any, train_steps: int,
                 prompt_config: PromptConfig = PromptConfig(),
                 word_ids: Optional[Sequence[Sequence[int]]] = None,
                 learning_rate: float = 0.1, warmup_steps: int = 500,
                 optimizer_name: str = "adafactor", partitioner: Optional[Any] = None,
                 eval_source: Any = None, seed: int = 0, log_every: int = 100,
                 checkpoint_every: int = 1000, metadata: Optional[dict[str, Any]] = None,
                 ) -> np.ndarray:
  """Trains a soft prompt on a frozen base model (paper defaults: lr 0.1, 500 warm-up steps,
  linear decay to 0; batch 16 is the `train_source`'s batch size).

  Runs the core training loop in `model_dir` (resumable) and saves the prompt on its own to
  `model_dir/prompt` (`save_prompt`).

  Args:
    model_dir: Run directory.
    config: Base model config.
    base_params: Base parameters (boxed or not); never updated.
    train_source: Batches of T5X features (`data.pipeline.BatchSource`).
    train_steps: Steps.
    prompt_config: Prompt length and initialiser.
    word_ids: Token ids of `prompt_config.init_words` (init="words").
    learning_rate: Peak learning rate.
    warmup_steps: Linear warm-up steps (capped below `train_steps` for short runs).
    optimizer_name: "adafactor", "adamw" or "sgd" (`optimizers.make_optimizer`).
    partitioner: Mesh (default: data parallel over all devices).
    eval_source: Optional evaluation batches.
    seed: Prompt initialisation and dropout seed.
    log_every: Progress logging interval.
    checkpoint_every: Checkpoint interval of the loop.
    metadata: Extra JSON metadata saved with the prompt.

  Returns:
    The trained prompt (P, d_model).
  """
  from jaxmoral import train as train_lib  # pylint: disable=g-import-not-at-top
  base_params = nn.meta.unbox(base_params)
  warmup = min(warmup_steps, max(train_steps - 1, 1))
  schedule = optimizers.make_schedule(
      name="warmup_linear_decay", base_learning_rate=learning_rate, warmup_steps=warmup,
      total_steps=max(train_steps, warmup + 1))
  optimizer = optimizers.make_optimizer(name=optimizer_name, learning_rate=schedule)
  trainer, _ = make_prompt_trainer(config=config, prompt_length=prompt_config.length,
                                   optimizer=optimizer, partitioner=partitioner,
                                   learning_rate_fn=schedule)
  prompt = init_prompt(prompt_config, rng=jax.random.PRNGKey(seed),
                       embedding_table=base_params["token_embedder"]["embedding"],
                       word_ids=word_ids)
  train_lib.train(model_dir=model_dir, trainer=trainer, train_source=train_source,
                  train_steps=train_steps, eval_source=eval_source, seed=seed,
                  log_every=log_every, checkpoint_every=checkpoint_every,
                  init_params=prompted_params(base_params, prompt))
  # The loop's last checkpoint holds the trained prompt; read only that leaf back.
  from jaxmoral import checkpoints  # pylint: disable=g-import-not-at-top
  params = checkpoints.restore_params_from_run(checkpoints.run_checkpoints_dir(model_dir))
  trained = np.asarray(params["prompt"], np.float32)
  save_prompt(trained, os.path.join(os.fspath(model_dir), "prompt"),
              metadata={"prompt_config": dataclasses.asdict(prompt_config),
                        "model_config": config.to_dict(), **(metadata or {})})
  return trained
