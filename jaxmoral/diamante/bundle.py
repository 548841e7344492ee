"""A Diamante model ready for inference: the core `InferenceModel` plus the features (lengths,
separator) from its run's settings.json (`diamante.data.DialogueData`'s), else the defaults.
"""

from __future__ import annotations

import os
from typing import Any

from jaxmoral import inference
from jaxmoral import model_dirs
from jaxmoral.diamante import data


class Bundle(inference.InferenceModel):
  """An `InferenceModel` (with the scalar head when the directory has one) and its `features`."""

  def __init__(self, *args: Any, features: data.FeatureConfig, **kwargs: Any):
    super().__init__(*args, **kwargs)
    self.features = features


def load(model_dir: str | os.PathLike, *, partitioner: Any = None) -> Bundle:
  """Loads any model directory or Hub id (`jaxmoral.model_dirs`: usually a Diamante run or its
  export; a plain T5 samples candidates) for Diamante inference.

  Args:
    partitioner: The mesh every call of the bundle runs on, the parameters in its shardings
      (None: one device, no mesh).

  Raises:
    ValueError: The directory has no vocabulary.
  """
  loaded = model_dirs.load(model_dir, partitioner=partitioner)
  if loaded.vocabulary is None:
    raise ValueError(f"{model_dir}: no vocabulary (vocab/spiece.model); Diamante reads text")
  features = data.feature_config_from_settings(loaded.settings, model_config=loaded.config)
  return Bundle.from_params(loaded.config, loaded.params, partitioner=partitioner,
                            with_scalar_head=loaded.has_scalar_head,
                            vocabulary=loaded.vocabulary, source=os.fspath(model_dir),
                            features=features)
