"""`DiamanteModel`: the joint generator–evaluator as the model `runs.train_run` trains."""

from __future__ import annotations

import dataclasses
from typing import Any

import flax
import gin
import jax
import jax.numpy as jnp

from jaxmoral.diamante.loss import diamante_loss_fn
from jaxmoral.models import heads
from jaxmoral.models import trainable
from jaxmoral.models.config import T5Config
from jaxmoral.models.t5 import T5

Array = jax.Array


@gin.configurable(module="diamante")
@dataclasses.dataclass(frozen=True, kw_only=True)
class DiamanteModel(trainable.TrainableModel):
  """The joint generator–evaluator that `jaxmoral.runs.train_run` trains (MODEL).

  Attributes:
    config: The T5Config (MODEL_CONFIG); the model gets a scalar head on top.
    pe_weight, z_loss: As `diamante_loss_fn`'s (pe_weight 0: the NLL-only ablation).
  """
  config: T5Config
  pe_weight: float = 1.0
  z_loss: float = 0.0

  def __post_init__(self):
    if not self.pe_weight >= 0:
      raise ValueError(f"DiamanteModel.pe_weight must be >= 0, got {self.pe_weight!r}")

  def module(self) -> T5:
    return T5(self.config, with_scalar_head=True)

  def loss_fn(self) -> Any:
    return diamante_loss_fn(self.module(), pe_weight=self.pe_weight, z_loss=self.z_loss)

  def params_from_checkpoint(self, loaded: Any, rng: Array) -> Any:
    """A pretrained dialogue model's T5, and its scalar head if it has one, else a fresh one
    (the trainer then places it in the run's shardings)."""
    trainable.check_architecture(loaded, self.config)
    params = dict(loaded.params)
    if "scalar_head" not in params:
      hidden = jnp.zeros((1, 1, self.config.d_model), jnp.float32)
      params["scalar_head"] = flax.linen.meta.unbox(
          heads.ScalarHead().init({"params": rng}, hidden)["params"])
    return params

  def settings(self) -> dict[str, Any]:
    return {"kind": "diamante", "pe_weight": self.pe_weight}
