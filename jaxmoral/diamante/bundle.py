"""A Diamante model ready for inference: the core `InferenceModel` plus the features (lengths,
separator) from its run's settings.json (`diamante.data.DialogueData`'s), else the defaults.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional

from jaxmoral import inference
from jaxmoral import model_dirs
from jaxmoral.diamante import data


class Bundle(inference.InferenceModel):
  """An `InferenceModel` (with the scalar head when the directory has one) and the
  context/response lengths and separator it trained with (`features`)."""

  def __init__(self, *args: Any, features: data.FeatureConfig, **kwargs: Any):
    super().__init__(*args, **kwargs)
    self.features = features


def load(model_dir: str | os.PathLike, *, partitioner: Any = None,
         feature_lengths: Optional[Mapping[str, int]] = None) -> Bundle:
  """Loads any model directory or Hub id (`jaxmoral.model_dirs`: usually a Diamante run or its
  export; a plain T5 samples candidates) for Diamante inference.

  Args:
    model_dir: The directory.
    partitioner: Read the parameters into its shardings; every call of the bundle then runs
      on its mesh. None: one device without a mesh.
    feature_lengths: Override the trained `{"inputs": context, "targets": response}` lengths.

  Raises:
    ValueError: The directory has no vocabulary.
  """
  loaded = model_dirs.load(model_dir, partitioner=partitioner)
  if loaded.vocabulary is None:
    raise ValueError(f"{model_dir}: no vocabulary (vocab/spiece.model); Diamante reads text")
  features = data.feature_config_from_settings(loaded.settings, model_config=loaded.config,
                                               feature_lengths=feature_lengths)
  return Bundle.from_params(loaded.config, loaded.params, partitioner=partitioner,
                            with_scalar_head=loaded.has_scalar_head,
                            vocabulary=loaded.vocabulary, source=os.fspath(model_dir),
                            features=features)
