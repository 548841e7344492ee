"""The detectors by name (`build_detector`), and the same detectors on a randomly initialised
model of the base's config (`build_untrained_detector`: the null every model-based verdict is
measured against). `jaxmoral npov detect` and `evaluate` (`actions`) build theirs here.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import flax.linen as nn
import jax
import numpy as np

from jaxmoral import model_dirs
from jaxmoral import prompt_tuning
from jaxmoral.models import t5 as t5_lib
from jaxmoral.models.config import T5Config
from jaxmoral.npov.detectors import classifier
from jaxmoral.npov.detectors import rouge
from jaxmoral.npov.detectors import salience

DETECTORS = ("rouge", "salience", "classifier")


def build_detector(name: str, *, base_dir: Optional[str] = None,
                   vocabulary_path: Optional[str] = None, generator_dir: Optional[str] = None,
                   classifier_dirs: Optional[Mapping[str, str]] = None,
                   partitioner: Any = None) -> Any:
  """A detector by name; model-based ones need `base_dir` (and the generator's prompt, the
  classifiers' prompts or fine-tuned model directories: `classifier.load_classifier`).

  Their base (any model directory or Hub id, with its vocabulary or `vocabulary_path`'s) is
  read into `partitioner`'s shardings and runs on its mesh (`model_dirs.load_on_mesh`).
  """
  if name not in DETECTORS:
    raise ValueError(f"unknown detector {name!r}; known: {DETECTORS}")
  if name == "rouge":
    return rouge.RougeDetector()
  if base_dir is None:
    raise ValueError(f"detector {name!r} needs base_dir (the base model's directory)")
  base = model_dirs.load_on_mesh(base_dir, vocabulary=vocabulary_path, partitioner=partitioner)
  if base.vocabulary is None:
    raise ValueError(f"detector {name!r}: {base_dir} has no vocabulary (vocab/spiece.model); "
                     f"give the base model's SentencePiece model (--vocabulary_path)")
  model = t5_lib.T5(base.config)
  if name == "salience":
    prompt = prompt_tuning.load_prompt(generator_dir)[0] if generator_dir else None
    return salience.SalienceDetector(
        model=model, params=base.lm_params,
        tokenizer=salience.SentencePieceTokenizer(base.vocabulary), prompt=prompt,
        config=salience.SalienceConfig(), partitioner=base.partitioner)
  dirs = dict(classifier_dirs or {})
  missing = [e for e in classifier.ERROR_TYPES if e not in dirs]
  if missing:
    raise ValueError(f"classifier detector needs classifier_dirs for {missing}")
  return classifier.ClassifierDetector(
      model=model, vocabulary=base.vocabulary,
      classifiers={e: classifier.load_classifier(dirs[e], base) for e in classifier.ERROR_TYPES},
      partitioner=base.partitioner)


def prompt_length(detector: Any) -> Optional[int]:
  """The soft prompt's length of a built salience or classifier detector (None: no prompt)."""
  prompts = ([getattr(detector, "prompt", None)] +
             [p for _, p in getattr(detector, "classifiers", {}).values()])
  found = [p for p in prompts if p is not None]
  return int(np.shape(found[0])[0]) if found else None


def build_untrained_detector(name: str, *, config: T5Config, vocabulary: Any, seed: int = 0,
                             prompt_length: Optional[int] = None) -> Any:
  """A model-based detector on a randomly initialised, never trained T5 of `config` (its null).

  With `prompt_length`, it carries an untrained soft prompt of that length
  (`prompt_tuning.init_prompt`): the trained pipeline's shapes, so compiled programs are
  shared. Both classifiers are then the same untrained model and prompt.

  Args:
    name: "salience" or "classifier" (a ValueError for any other).
    config, vocabulary, prompt_length: The trained detector's.
  """
  if name not in ("salience", "classifier"):
    raise ValueError(f"build_untrained_detector: {name!r} has no model; known: salience, "
                     "classifier")
  model = t5_lib.T5(config)
  params_key, prompt_key = jax.random.split(jax.random.PRNGKey(seed))
  params = nn.meta.unbox(t5_lib.init_params(model, params_key))
  prompt = None if prompt_length is None else prompt_tuning.init_prompt(
      prompt_tuning.PromptConfig(length=prompt_length,
                                 vocab_sample_size=min(5000, config.vocab_size)),
      rng=prompt_key, embedding_table=params["token_embedder"]["embedding"])
  if name == "salience":
    return salience.SalienceDetector(
        model=model, params=params, tokenizer=salience.SentencePieceTokenizer(vocabulary),
        prompt=prompt, config=salience.SalienceConfig())
  return classifier.ClassifierDetector(
      model=model, vocabulary=vocabulary,
      classifiers={e: (params, prompt) for e in classifier.ERROR_TYPES})
