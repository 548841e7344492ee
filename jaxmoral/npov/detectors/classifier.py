"""YES/NO classifiers, one per error type: "yes" (no error) or "no" for (query, arguments,
response). Score = P("no") of a softmax over the two label tokens' first-step logits.

The paper's classifiers are soft prompts over one frozen base model (`tuning="prompt"`); the
ablation `tuning="full"` fine-tunes every weight of a copy of the base instead (for bases too
small to be steered by a prompt).
"""

from __future__ import annotations

import os
import typing
from typing import Any, Literal, Optional, Sequence

import gin
import jax
import jax.numpy as jnp
import numpy as np

from jaxmoral import inference
from jaxmoral import model_dirs
from jaxmoral import progress
from jaxmoral import prompt_tuning
from jaxmoral import runs
from jaxmoral.data import readers
from jaxmoral.models import trainable
from jaxmoral.models.t5 import T5
from jaxmoral.npov import task
from jaxmoral.npov.detectors import base

ErrorType = Literal["hallucination", "coverage"]
ERROR_TYPES = base.ERRORS
Tuning = Literal["prompt", "full"]
TUNINGS = ("prompt", "full")
LABELS = ("yes", "no")  # "yes" = the response is fine, "no" = it has the error


def label_token_ids(vocabulary: Any) -> tuple[int, int]:
  """First token ids of "yes" and "no" (the tokens whose logits are compared)."""
  ids = tuple(int(vocabulary.encode(word)[0]) for word in LABELS)
  if ids[0] == ids[1]:
    raise ValueError(f"label_token_ids: 'yes' and 'no' start with the same token {ids[0]}")
  return ids  # type: ignore[return-value]


def training_pairs(examples: Sequence[task.NpovExample], *, error: ErrorType
                   ) -> tuple[list[str], list[str]]:
  """(inputs, targets) for one classifier: error-free examples ("yes") and every example with
  the error ("no"), also with the other error too (a substitution); examples with only the
  other error are neither, and skipped."""
  if error not in ERROR_TYPES:
    raise ValueError(f"training_pairs: error must be one of {ERROR_TYPES}, got {error!r}")
  other = "coverage" if error == "hallucination" else "hallucination"
  kept = [e for e in examples
          if getattr(e, error) is not None and (getattr(e, error) or not getattr(e, other))]
  return ([task.format_classifier_input(e) for e in kept],
          [LABELS[int(getattr(e, error))] for e in kept])


@gin.configurable
def train_classifier(*, model_dir: str | os.PathLike, base_dir: str,
                     examples: Sequence[task.NpovExample], error: ErrorType, train_steps: int,
                     optimizer: Any, batch_size: int = 16, max_input_length: int = 512,
                     tuning: Tuning = "prompt",
                     prompt_config: Optional[prompt_tuning.PromptConfig] = None,
                     partitioner: Any = None, seed: int = 0, **run_kwargs: Any) -> str:
  """Trains one classifier from the base through the core run; returns the run dir.

  `tuning`: see the module docstring; a prompt starts from the embeddings of the label words
  padded with vocabulary samples (and is also saved alone in `model_dir/prompt`). The training
  pairs are written to `model_dir/data/train.jsonl`; `run_kwargs` go to `runs.train_run`.
  """
  if tuning not in TUNINGS:
    raise ValueError(f"train_classifier: tuning must be one of {TUNINGS}, got {tuning!r}")
  inputs, targets = training_pairs(examples, error=error)
  if not inputs or len(set(targets)) < 2:
    raise ValueError(f"train_classifier({error}): need examples of both labels, got "
                     f"{len(inputs)} pairs with labels {sorted(set(targets))}")
  base = model_dirs.inspect(base_dir)
  pairs = os.path.join(os.fspath(model_dir), "data", "train.jsonl")
  # Shuffled (training shuffles anyway): a run resumed from before `Seq2SeqData.heldout=
  # "hash"` holds out every 10th pair, all clean in `training_pairs`' alternating order.
  order = np.random.default_rng(seed).permutation(len(inputs))
  readers.write_jsonl(pairs, [{"inputs": inputs[i], "targets": targets[i]} for i in order])
  if tuning == "full":
    model: Any = trainable.Seq2SeqModel(config=base.config)
  else:
    model = prompt_tuning.PromptTuningModel(
        config=base.config, prompt=prompt_config or prompt_tuning.PromptConfig(
            init="words", init_words=LABELS, vocab_sample_size=min(5000, base.config.vocab_size)),
        metadata={"task": f"npov_{error}_classifier", "labels": list(LABELS)})
  runs.train_run(model_dir=os.fspath(model_dir), model=model,
                 data=runs.Seq2SeqData(train_file=pairs), train_steps=train_steps,
                 batch_size=batch_size, feature_lengths={"inputs": max_input_length, "targets": 4},
                 optimizer=optimizer, partitioner=partitioner, seed=seed,
                 init_checkpoint=base_dir, **run_kwargs)
  return os.fspath(model_dir)


def load_classifier(directory: str | os.PathLike, base: Any) -> tuple[Any, Optional[np.ndarray]]:
  """(params, prompt): the base's parameters and the prompt, or a fine-tuned classifier's
  parameters (read into the shardings of the base's partitioner) and None.

  Args:
    directory: A prompt (folder or the prompt-tuning run that saved it), or a fine-tuned
      model directory of any `model_dirs` format (`tuning="full"`).
    base: The base model (`model_dirs.LoadedModel`).

  Raises:
    ValueError: A fine-tuned classifier's architecture differs from the base's (both are read
      with the base's vocabulary and label tokens).
  """
  base_params = base.lm_params
  directory = os.fspath(directory)
  if prompt_tuning.prompt_directory(directory):
    return base_params, prompt_tuning.load_prompt(directory)[0]
  info = model_dirs.inspect(directory)  # Checked before its weights are read.
  if info.config.architecture() != base.config.architecture():
    raise ValueError(f"classifier {directory}: its architecture differs from the base's "
                     f"({info.config.architecture()} vs {base.config.architecture()})")
  tuned = model_dirs.load(directory, partitioner=base.partitioner)
  if tuned.prompt is not None:  # A prompt-tuning run that never saved its prompt alone.
    return base_params, np.asarray(tuned.prompt, np.float32)
  return tuned.lm_params, None


def _first_step_logits(model: T5, params: Any, prompt: Optional[jax.Array],
                       tokens: jax.Array) -> jax.Array:
  """(batch, vocab) logits of the first decoder step, the soft prompt (if any) prepended."""
  decoder = jnp.full((tokens.shape[0], 1), model.config.decoder_start_token_id, jnp.int32)
  if prompt is None:  # A fine-tuned classifier (None is an empty pytree: its own trace).
    return typing.cast(jax.Array, model.apply({"params": params}, tokens, decoder))[:, 0]
  embeds, mask = prompt_tuning.prompted_encoder_inputs(model, params, prompt, tokens)
  return typing.cast(jax.Array, model.apply({"params": params}, None, decoder,
                                            encoder_embeds=embeds, encoder_mask=mask))[:, 0]


class ClassifierDetector:
  """Both classifiers (prompted or fine-tuned, see `load_classifier`); no word-level scores.

  `classifiers` holds `{error: (InferenceModel, prompt or None)}`: each runs the core
  batch-inference path (bucketed shapes, on the partitioner's mesh).
  """

  def __init__(self, *, model: T5, vocabulary: Any,
               classifiers: dict[str, tuple[Any, Optional[Any]]], batch_size: int = 16,
               max_input_length: int = 512, partitioner: Any = None):
    """
    Args:
      model: The T5 every classifier shares the architecture of.
      vocabulary: The base's vocabulary (inputs and label tokens).
      classifiers: `{error: (params, prompt or None)}` (`load_classifier`).
      batch_size: Rows per compiled call (the last batch is padded).
      max_input_length: Longer inputs are truncated (EOS kept).
      partitioner: The mesh the classifiers run on (rows over its "data" axis).
    """
    missing = [e for e in ERROR_TYPES if e not in classifiers]
    if missing:
      raise ValueError(f"ClassifierDetector needs a classifier for {missing}")
    self.model, self.vocabulary = model, vocabulary

    def place(params: Any, prompt: Optional[Any]) -> tuple[Any, Optional[jax.Array]]:
      # Token rows in, the detector's own encoding: the models need no vocabulary.
      loaded = inference.InferenceModel.from_params(model.config, params, partitioner=partitioner,
                                                    batch_size=batch_size)
      if prompt is not None:
        prompt = (jnp.asarray(prompt) if partitioner is None
                  else jax.device_put(np.asarray(prompt), partitioner.replicated))
      return loaded, prompt

    self.classifiers = {e: place(params, prompt) for e, (params, prompt) in classifiers.items()}
    self.batch_size, self.max_input_length = batch_size, max_input_length
    self.label_ids = np.asarray(label_token_ids(vocabulary))

  def error_probabilities(self, examples: Sequence[task.NpovExample], error: ErrorType
                          ) -> np.ndarray:
    """P("no") under the `error` classifier, per example."""
    if not examples:
      return np.zeros((0,))
    classifier, prompt = self.classifiers[error]
    fn = classifier.jitted(_first_step_logits, 2)
    eos = self.model.config.eos_token_id
    rows = [list(self.vocabulary.encode(task.format_classifier_input(e)))[
        :self.max_input_length - 1] + [eos] for e in examples]
    shown = progress.ProgressLog(f"{error} classifier examples", len(examples))
    out = []
    for n, tokens, _, _ in classifier.batches(rows):
      logits = np.asarray(fn(classifier.params, prompt, classifier.place(tokens)))
      out.append(jax.nn.softmax(logits[:n][:, self.label_ids], axis=-1)[:, 1])
      shown.update(sum(map(len, out)))
    return np.concatenate(out)

  def detect_batch(self, examples: Sequence[task.NpovExample]) -> list[base.Detection]:
    h = self.error_probabilities(examples, "hallucination")
    c = self.error_probabilities(examples, "coverage")
    return [base.Detection(float(a), float(b)) for a, b in zip(h, c, strict=True)]
