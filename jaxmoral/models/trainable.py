"""What a run trains, as one object gin injects (T5X's `models.EncoderDecoderModel`).

A `TrainableModel` ties together the linen module, its random initialisation, the loss in the
trainer's contract (`loss_fn(params, batch, rng) -> (loss, metrics)`), the trainable filter,
and how a fine-tuning run starts from a checkpoint of another shape (a plain T5 for a model
with a scalar head, a base model for a soft prompt). `jaxmoral.runs.train_run` takes one:

  MODEL = @trainable.Seq2SeqModel()           # supervised seq2seq (this module)
  MODEL = @diamante.DiamanteModel()           # NLL + preference estimation
  MODEL = @prompt_tuning.PromptTuningModel()   # a soft prompt on a frozen base
"""

from __future__ import annotations

import abc
import dataclasses
import typing
from typing import Any, Mapping, Optional, Sequence

import flax.linen as nn
import gin
import jax

from jaxmoral import losses
from jaxmoral.models import t5
from jaxmoral.models.config import T5Config

PyTree = Any


class TrainableModel(abc.ABC):
  """The module, loss and trainable filter of a run (see the module docstring).

  Subclasses are frozen dataclasses with a `config: T5Config` field.
  """
  config: T5Config

  @abc.abstractmethod
  def module(self) -> nn.Module:
    """The linen module whose `apply` the loss calls."""

  @abc.abstractmethod
  def loss_fn(self) -> Any:
    """The loss in the trainer's contract (a `losses.TermsLoss` combines microbatches exactly)."""

  def init_params(self, rng: jax.Array) -> PyTree:
    """Randomly initialised, logically partitioned (boxed) parameters."""
    # A T5, or a module with a T5's inputs (`init_params` only calls `init` on it).
    return t5.init_params(typing.cast(t5.T5, self.module()), rng)

  @property
  def trainable_patterns(self) -> Optional[Sequence[str]]:
    """Regexes of the trained parameter paths (None: all)."""
    return None

  def params_from_checkpoint(self, loaded: Any, rng: jax.Array) -> PyTree:
    """The starting parameters of a fine-tuning run from a loaded `model_dirs.LoadedModel`.

    The checkpoint's T5 as is; subclasses add what it lacks (a scalar head, a soft prompt).

    Raises:
      ValueError: The checkpoint's architecture differs from `config`.
    """
    del rng
    check_architecture(loaded, self.config)
    return loaded.lm_params

  def settings(self) -> dict[str, Any]:
    """What inference needs to know beyond the T5Config (saved as settings.json["model"])."""
    return {"kind": type(self).__name__}

  def hooks(self, model_dir: str) -> Sequence[Any]:
    """`jaxmoral.train.TrainHook`s the run needs (e.g. saving a soft prompt at the end)."""
    del model_dir
    return ()


def check_architecture(loaded: Any, config: T5Config) -> None:
  """Raises ValueError when a loaded checkpoint's weights do not fit `config`."""
  ours, theirs = config.architecture(), loaded.config.architecture()
  if theirs != ours:
    differing = {k: (v, ours[k]) for k, v in theirs.items() if ours[k] != v}
    raise ValueError(f"init_checkpoint {loaded.info.source}: its architecture differs from the "
                     f"run's MODEL_CONFIG in {differing} (checkpoint, run)")


@gin.configurable(module="trainable")
@dataclasses.dataclass(frozen=True, kw_only=True)
class Seq2SeqModel(TrainableModel):
  """A T5 trained on token NLL (+ T5X's z-loss): the core `jaxmoral train`.

  Attributes:
    config: The T5Config (MODEL_CONFIG).
    z_loss: T5X's auxiliary z-loss coefficient.
    loss_normalizing_factor: None: the loss is the mean over target tokens; a number: the
      summed loss divided by it (T5X's LOSS_NORMALIZING_FACTOR); microbatches follow either.
    trainable: Regexes of trained parameter paths (others frozen, no optimizer state).
  """
  config: T5Config
  label_smoothing: float = 0.0
  z_loss: float = 1e-4
  loss_normalizing_factor: Optional[float] = None
  trainable: Optional[tuple[str, ...]] = None

  def __post_init__(self):
    if not isinstance(self.config, T5Config):
      raise ValueError(f"Seq2SeqModel.config must be a T5Config, got {type(self.config).__name__}")
    if self.trainable is not None:
      object.__setattr__(self, "trainable", tuple([self.trainable] if isinstance(
          self.trainable, str) else self.trainable))

  def module(self) -> nn.Module:
    return t5.T5(self.config)

  def loss_fn(self) -> Any:
    return losses.seq2seq_loss_fn(self.module(), label_smoothing=self.label_smoothing,
                                  z_loss=self.z_loss,
                                  loss_normalizing_factor=self.loss_normalizing_factor)

  @property
  def trainable_patterns(self) -> Optional[Sequence[str]]:
    return self.trainable

  def settings(self) -> dict[str, Any]:
    # The loss's settings: `jaxmoral eval` computes the loss training evaluated.
    return {"kind": "seq2seq", "label_smoothing": self.label_smoothing, "z_loss": self.z_loss,
            "loss_normalizing_factor": self.loss_normalizing_factor}


def describe(model: TrainableModel) -> Mapping[str, Any]:
  """A one-line-able summary for logs."""
  c = model.config
  return {"kind": type(model).__name__, "d_model": c.d_model,
          "layers": f"{c.num_encoder_layers}+{c.num_decoder_layers}",
          "params_m": round(c.num_params() / 1e6, 2)}
