"""The notebook API: load any jaxmoral-readable T5 and score or generate text in three lines.

  from jaxmoral import api
  model = api.Model.from_pretrained("path/to/dir")       # any model directory or Hub id
  model.generate(["a question"], greedy=True).texts      # [["an answer"]]
  model.score(["a question"], ["an answer"])             # log-likelihoods, (batch,)

Inputs and targets are strings (EOS appended, as T5 trains) or token ids (a 2-D array or a
list of lists; trailing 0s are padding), run through `inference.InferenceModel`.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from jaxmoral import inference
from jaxmoral import model_dirs
from jaxmoral.models.config import T5Config


class Model(inference.InferenceModel):
  """A T5 with its params (and optionally its vocabulary), ready for notebook use; its
  attributes are `inference.InferenceModel`'s."""

  def __init__(self, config: T5Config, params: Any, *, vocabulary: Any = None,
               source: str = "<in memory>", partitioner: Any = None):
    placed = inference.InferenceModel.from_params(config, params, partitioner=partitioner)
    super().__init__(placed.module, placed.params, vocabulary=vocabulary,
                     partitioner=partitioner, source=source)

  @classmethod
  def from_pretrained(cls, path: str | os.PathLike, *, vocabulary: Any = None,
                      dtype: Optional[str] = None, step: Optional[int] = None,
                      config: Optional[T5Config] = None, partitioner: Any = None) -> Model:
    """Loads any model directory or Hub id (`jaxmoral.model_dirs`).

    Args:
      path: A Hugging Face folder (safetensors or pytorch_model.bin) or Hub id, a T5X
        checkpoint, a jaxmoral export, a run (or one step of it), a PPO run (its policy) or a
        Diamante run.
      vocabulary: seqio vocabulary or path to a SentencePiece `.model`; default: the one
        stored with the checkpoint, if any.
      dtype: Activation dtype ("float32", "bfloat16"); default: the stored config's.
      step: Checkpoint step of a training run (default: the latest).
      config: Config for checkpoints that lack one (T5X, an export without config.json).
      partitioner: Place the parameters by its logical-axis rules (default: one device).

    Raises:
      FileNotFoundError: `path` is missing or in no known format (the message lists what was
        looked for).
    """
    loaded = model_dirs.load(path, partitioner=partitioner, step=step, dtype=dtype,
                             config=config, vocabulary=vocabulary)
    return cls(loaded.config, loaded.lm_params, vocabulary=loaded.vocabulary,
               source=os.fspath(path), partitioner=partitioner)

  # Greedy unless a sampling option is set, beam search with `beam_size` (-> GenerateOutput).
  generate = inference.InferenceModel.predict
