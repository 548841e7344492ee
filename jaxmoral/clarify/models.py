"""The ClarifyDelphi models: any model directory as an `inference.InferenceModel` on the mesh.

A model is any model directory (`jaxmoral.model_dirs`: a run, an export, a PPO run's tuned
policy, a Hugging Face folder or Hub id, ...), read into the partitioner's shardings when one
is given. Each role runs at fixed (batch_size, input_length) shapes, so every call reuses one
compiled function and `jaxmoral compile` lowers the same one.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Optional

from jaxmoral import inference

# The type of every ClarifyDelphi role (question, answer, fusion, judge, NLI, relevance).
ClarifyModel = inference.InferenceModel


@functools.lru_cache(maxsize=16)
def _load_cached(path: str, step: Optional[int], dtype: Optional[str],
                 partitioner: Any) -> inference.InferenceModel:
  return inference.InferenceModel.load(path, partitioner=partitioner, step=step, dtype=dtype,
                                       require_vocabulary=True)


def load_model(path: str | os.PathLike, *, step: Optional[int] = None, input_length: int = 128,
               batch_size: int = 32, dtype: Optional[str] = None,
               partitioner: Any = None) -> inference.InferenceModel:
  """Loads any model directory (cached per path and partitioner: a directory serving several
  roles, such as a multi-task model, is loaded once). A PPO run gives its tuned policy.

  Raises:
    ValueError: The directory carries no vocabulary (ClarifyDelphi models read text).
  """
  key = os.path.abspath(os.fspath(path)) if os.path.exists(path) else os.fspath(path)
  return _load_cached(key, step, dtype, partitioner).with_shapes(
      input_length=input_length, batch_size=batch_size)
