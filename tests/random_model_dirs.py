"""Random tiny T5 models written as export directories, for the tests."""

from __future__ import annotations

import os
from typing import Optional

import flax.linen as nn
import jax

from jaxmoral import model_dirs
from jaxmoral.data import vocab as vocab_lib
from jaxmoral.models import config as config_lib
from jaxmoral.models import t5


def random_model_dir(output_dir: str | os.PathLike, *, seed: int = 0,
                     vocabulary_path: Optional[str] = None,
                     config: Optional[config_lib.T5Config] = None) -> str:
  """Writes a randomly initialised T5 (default tiny) with a vocabulary as an export directory."""
  config = config or config_lib.t5_config(size="tiny")
  if vocabulary_path is None:
    vocabulary_path = vocab_lib.build_demo_vocabulary(
        output_dir=os.path.join(os.fspath(output_dir), "..", "demo_vocab"))
  vocabulary = vocab_lib.get_vocabulary(vocabulary_path)
  params = nn.meta.unbox(t5.init_params(t5.T5(config), jax.random.PRNGKey(seed)))
  return model_dirs.export(output_dir, params=params, config=config, vocabulary=vocabulary,
                          overwrite=True)
