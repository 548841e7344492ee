"""A Diamante model ready for inference: the network, its parameters, vocabulary and features.

Any model directory loads (`jaxmoral.model_dirs`: a Diamante run, an export of one, a plain
T5 to sample candidates with, ...). The feature lengths and context separator come from the
run's settings.json (what `diamante.data.DialogueData` trained with), else the defaults.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Optional

from jaxmoral import decoding
from jaxmoral import model_dirs
from jaxmoral.diamante import data
from jaxmoral.models.config import T5Config
from jaxmoral.models.t5 import T5


@dataclasses.dataclass(frozen=True)
class Bundle:
  """Everything inference needs.

  Attributes:
    model: `T5(config, with_scalar_head=...)`.
    params: Unboxed parameters.
    vocab: seqio vocabulary (`encode` / `decode`).
    features: Context/response lengths and separator used in training.
    decode_weights: The decoding backend's kernels for `params` (prepared once), or None.
    partitioner: The mesh `params` are sharded over and every call runs on (None: one
      device, no partitioner).
  """
  model: T5
  params: Any
  vocab: Any
  features: data.FeatureConfig
  decode_weights: Optional[decoding.DecodeWeights] = None
  partitioner: Any = None

  @property
  def config(self) -> T5Config:
    return self.model.config

  def place(self, batch: Any) -> Any:
    """Host arrays on the bundle's mesh (rows over "data" where they divide it); as they
    are without a partitioner."""
    return batch if self.partitioner is None else self.partitioner.shard_inputs(batch)


def load(model_dir: str | os.PathLike, *, partitioner: Any = None,
         feature_lengths: Optional[Mapping[str, int]] = None) -> Bundle:
  """Loads a model directory for Diamante inference.

  Args:
    model_dir: Any model directory or Hub id (usually a Diamante run).
    partitioner: Read the parameters into its shardings; every call of the bundle then runs
      on its mesh (`partitioning.inference_partitioner` gives the commands' default); None:
      one device without a mesh.
    feature_lengths: Override the trained `{"inputs": context, "targets": response}` lengths.

  Raises:
    ValueError: The directory has no vocabulary.
  """
  loaded = model_dirs.load(model_dir, partitioner=partitioner)
  if loaded.vocabulary is None:
    raise ValueError(f"{model_dir}: no vocabulary (vocab/spiece.model); Diamante reads text")
  model = T5(loaded.config, with_scalar_head=loaded.has_scalar_head)
  features = data.feature_config_from_settings(loaded.settings, model_config=loaded.config,
                                               feature_lengths=feature_lengths)
  return Bundle(model=model, params=loaded.params, vocab=loaded.vocabulary, features=features,
                decode_weights=model_dirs.decode_weights(model, loaded.params, partitioner),
                partitioner=partitioner)
