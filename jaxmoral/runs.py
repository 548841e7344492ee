"""Gin-bound entry points of the core commands: `jaxmoral train | eval | infer | export`.

A run directory (MODEL_DIR) is self-describing, so `eval`, `infer`, `export` and the Python API
(`jaxmoral.models.api.Model.from_pretrained(MODEL_DIR)`) need nothing but its path::

  MODEL_DIR/config.gin            the operative gin config of the training run
  MODEL_DIR/model_config.json     the T5Config
  MODEL_DIR/vocab/spiece.model    the SentencePiece model (+ vocab/extra_ids.txt)
  MODEL_DIR/checkpoints/<step>/   Orbax checkpoints (TrainState + JSON extras)
  MODEL_DIR/train, MODEL_DIR/eval TensorBoard event files
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import pathlib
import shutil
import time
from typing import Any, Mapping, Optional, Sequence

import gin
import jax
from jax.experimental import multihost_utils
import numpy as np
import optax
import seqio

from jaxmoral import checkpoints
from jaxmoral import decoding
from jaxmoral import gin_utils
from jaxmoral import losses
from jaxmoral import partitioning
from jaxmoral import train as train_lib
from jaxmoral import trainer as trainer_lib
from jaxmoral.data import readers
from jaxmoral.data import tasks
from jaxmoral.data import vocab as vocab_lib
from jaxmoral.models import config as config_lib
from jaxmoral.models import t5

logger = logging.getLogger(__name__)

MODEL_CONFIG_FILE = "model_config.json"
VOCAB_DIR = "vocab"


@gin.configurable
@dataclasses.dataclass(frozen=True, kw_only=True)
class Seq2SeqData:
  """Where (input, target) text pairs come from, and their vocabulary.

  Attributes:
    mixture_or_task_name: A registered seqio Task or Mixture (T5X's MIXTURE_OR_TASK_NAME).
      Names starting with "jaxmoral_demo" are the bundled demo tasks, registered on demand.
      Your own tasks: `import my_tasks` at the top of the gin file, as in T5X.
    train_file: Instead of a task: a TSV/CSV/JSONL file of pairs (a bad row fails with its line).
    eval_file: Evaluation pairs for `train_file` (default: every 10th pair is held out).
    input_field: Column / key of the inputs in the files.
    target_field: Column / key of the targets in the files.
    vocabulary_path: A SentencePiece model (e.g. T5's spiece.model); None builds the demo
      vocabulary from the bundled corpus (deterministic, a few seconds).
    extra_ids: Sentinel ids after the pieces (T5: 100).
    train_split: Split used for training.
    eval_split: Split used for evaluation.
  """
  mixture_or_task_name: Optional[str] = None
  train_file: Optional[str] = None
  eval_file: Optional[str] = None
  input_field: str = "inputs"
  target_field: str = "targets"
  vocabulary_path: Optional[str] = None
  extra_ids: int = vocab_lib.T5_EXTRA_IDS
  train_split: str = "train"
  eval_split: str = "validation"

  def __post_init__(self):
    if (self.mixture_or_task_name is None) == (self.train_file is None):
      raise ValueError("Seq2SeqData: give exactly one of mixture_or_task_name, train_file")
    if self.eval_file is not None and self.train_file is None:
      raise ValueError("Seq2SeqData.eval_file needs train_file")
    for name in ("train_file", "eval_file", "vocabulary_path"):
      value = getattr(self, name)
      if value is not None and not pathlib.Path(value).is_file():
        raise ValueError(f"Seq2SeqData.{name}: no such file {value!r}")

  def vocabulary(self, workdir: str | os.PathLike[str]) -> seqio.SentencePieceVocabulary:
    """The vocabulary; the demo one is built into `workdir` the first time."""
    path = self.vocabulary_path
    if path is None:
      path = vocab_lib.build_demo_vocabulary(output_dir=workdir)
    return vocab_lib.get_vocabulary(path, extra_ids=self.extra_ids)

  def task_name(self, vocabulary: seqio.Vocabulary) -> str:
    """Registers what is needed (demo tasks, file tasks) and returns the task/mixture name."""
    if self.train_file is not None:
      files = {self.train_split: self.train_file}
      if self.eval_file is not None:
        files[self.eval_split] = self.eval_file
        tasks.register_text_pair_task("jaxmoral_files", vocabulary=vocabulary, file=files,
                                      input_field=self.input_field,
                                      target_field=self.target_field)
      else:
        pairs = tasks.read_pairs(self.train_file, input_field=self.input_field,
                                 target_field=self.target_field)
        split = tasks.split_pairs(pairs)
        tasks.register_text_pair_task(
            "jaxmoral_files", vocabulary=vocabulary,
            examples={self.train_split: split["train"], self.eval_split: split["validation"]})
      return "jaxmoral_files"
    name = self.mixture_or_task_name
    if name.startswith("jaxmoral_demo"):
      tasks.register_demo_tasks(vocabulary=vocabulary)
    try:
      seqio.get_mixture_or_task(name)
    except ValueError as error:
      raise ValueError(f"Seq2SeqData.mixture_or_task_name: {name!r} is not registered; "
                       f"import the module that registers it in your gin file") from error
    return name


def save_run_files(model_dir: str | os.PathLike[str], *, model_config: config_lib.T5Config,
                   vocabulary: seqio.SentencePieceVocabulary) -> None:
  """Writes the config and vocabulary next to the checkpoints (see module docstring)."""
  model_dir = pathlib.Path(model_dir)
  (model_dir / VOCAB_DIR).mkdir(parents=True, exist_ok=True)
  (model_dir / MODEL_CONFIG_FILE).write_text(model_config.to_json())
  target = model_dir / VOCAB_DIR / "spiece.model"
  if pathlib.Path(vocabulary.sentencepiece_model_file).resolve() != target.resolve():
    shutil.copyfile(vocabulary.sentencepiece_model_file, target)
  (model_dir / VOCAB_DIR / "extra_ids.txt").write_text(str(vocabulary.extra_ids))


def load_run_files(model_dir: str | os.PathLike[str]
                   ) -> tuple[config_lib.T5Config, seqio.SentencePieceVocabulary]:
  """The T5Config and vocabulary that `train_run` stored in MODEL_DIR."""
  model_dir = pathlib.Path(model_dir)
  config_path = model_dir / MODEL_CONFIG_FILE
  if not config_path.is_file():
    raise FileNotFoundError(f"{config_path} not found: is {model_dir} a jaxmoral run directory?")
  config = config_lib.T5Config.from_dict(json.loads(config_path.read_text()))
  extra_path = model_dir / VOCAB_DIR / "extra_ids.txt"
  extra_ids = int(extra_path.read_text()) if extra_path.is_file() else vocab_lib.T5_EXTRA_IDS
  vocabulary = vocab_lib.get_vocabulary(model_dir / VOCAB_DIR / "spiece.model",
                                        extra_ids=extra_ids)
  return config, vocabulary


def _check_vocab_fits(config: config_lib.T5Config, vocabulary: seqio.Vocabulary) -> None:
  if vocabulary.vocab_size > config.vocab_size:
    raise ValueError(f"vocabulary has {vocabulary.vocab_size} ids (with extra ids) but "
                     f"T5Config.vocab_size is {config.vocab_size}")


def build_trainer(*, model: t5.T5, optimizer: optax.GradientTransformation,
                  partitioner: partitioning.PjitPartitioner, num_microbatches: int = 1,
                  trainable_patterns: Optional[Sequence[str]] = None,
                  label_smoothing: float = 0.0, z_loss: float = 1e-4,
                  loss_normalizing_factor: Optional[float] = None) -> trainer_lib.Trainer:
  """The supervised seq2seq Trainer for `model` (loss: token NLL + z-loss)."""
  return trainer_lib.Trainer(
      init_params_fn=functools.partial(t5.init_params, model),
      loss_fn=losses.seq2seq_loss_fn(model, label_smoothing=label_smoothing, z_loss=z_loss,
                                     loss_normalizing_factor=loss_normalizing_factor),
      optimizer=optimizer, partitioner=partitioner,
      trainable_mask=list(trainable_patterns) if trainable_patterns else None,
      num_microbatches=num_microbatches,
      # T5X logs the learning rate; an optimizer from `make_optimizer` knows its schedule.
      learning_rate_fn=getattr(optimizer, "learning_rate", None))


@gin.configurable
def train_run(*, model_dir: str, model_config: config_lib.T5Config, data: Seq2SeqData,
              train_steps: int, batch_size: int, feature_lengths: Mapping[str, int],
              optimizer: optax.GradientTransformation,
              partitioner: Optional[partitioning.PjitPartitioner] = None,
              num_microbatches: int = 1, eval_every: int = 0, eval_steps: Optional[int] = None,
              checkpoint_every: int = 1000, keep_checkpoints: int = 3, log_every: int = 50,
              seed: int = 0, init_checkpoint: Optional[str] = None,
              trainable_patterns: Optional[Sequence[str]] = None, label_smoothing: float = 0.0,
              z_loss: float = 1e-4, loss_normalizing_factor: Optional[float] = None,
              pack: bool = False) -> dict[str, float]:
  """Supervised seq2seq training (T5X's `train`): resumes MODEL_DIR if it has checkpoints.

  Args:
    model_dir: Run directory (MODEL_DIR).
    model_config: The T5Config (MODEL_CONFIG from a gin/models fragment).
    data: Pairs and vocabulary.
    train_steps: Total steps of the run (TRAIN_STEPS).
    batch_size: Global batch size (BATCH_SIZE).
    feature_lengths: `{"inputs": N, "targets": M}` (TASK_FEATURE_LENGTHS).
    optimizer: From a gin/optimizers fragment (OPTIMIZER).
    partitioner: Mesh and rules (PARTITIONER); default: data parallel over all devices.
    num_microbatches: Gradient accumulation steps per global batch.
    eval_every: Evaluate every N steps (0: only at the end).
    eval_steps: Evaluation batches (None: the whole eval split).
    checkpoint_every: Save every N steps (and at the end).
    keep_checkpoints: Checkpoints kept.
    log_every: Progress line / TensorBoard every N steps.
    seed: Parameter init, shuffling and dropout seed.
    init_checkpoint: Fine-tune from these params: a jaxmoral export, a run directory (its
      latest step), one step of a run (`RUN/checkpoints/STEP`), or a Hugging Face T5 folder
      (config.json + model.safetensors).
    trainable_patterns: Regexes of trained parameter paths (others frozen, no optimizer state).
    label_smoothing: Label smoothing of the token loss.
    z_loss: T5X's auxiliary z-loss coefficient.
    loss_normalizing_factor: None: the loss is the mean over target tokens; a number: the
      summed loss divided by it (T5X's LOSS_NORMALIZING_FACTOR); microbatches follow either.
    pack: Pack several examples per row.

  Returns:
    Final metrics.
  """
  partitioner = partitioner or partitioning.PjitPartitioner()
  checkpoints.make_run_dir(model_dir)
  # Process 0 writes the shared run files (and builds the demo vocabulary); the others wait.
  if jax.process_index() == 0:
    vocabulary = data.vocabulary(os.path.join(model_dir, VOCAB_DIR))
    _check_vocab_fits(model_config, vocabulary)
    save_run_files(model_dir, model_config=model_config, vocabulary=vocabulary)
    if gin.config_str():
      gin_utils.write_operative_config(model_dir)
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices("jaxmoral.runs.train_run: run files written")
    if jax.process_index() != 0:
      vocabulary = load_run_files(model_dir)[1]
  task_name = data.task_name(vocabulary)
  train_source = tasks.task_to_source(task_name, data.train_split,
                                      feature_lengths=feature_lengths, batch_size=batch_size,
                                      seed=seed, pack=pack)
  if jax.process_count() > 1:
    train_source = train_source.shard(jax.process_index(), jax.process_count())
  eval_source = None
  try:
    eval_source = tasks.task_to_source(task_name, data.eval_split,
                                       feature_lengths=feature_lengths, batch_size=batch_size,
                                       seed=seed, shuffle=False)
  except ValueError as error:
    logger.warning("train_run: no evaluation data (%s)", error)
  if eval_source is not None and jax.process_count() > 1:
    eval_source = eval_source.shard(jax.process_index(), jax.process_count())
  model = t5.T5(model_config)
  trainer = build_trainer(model=model, optimizer=optimizer, partitioner=partitioner,
                          num_microbatches=num_microbatches,
                          trainable_patterns=trainable_patterns,
                          label_smoothing=label_smoothing, z_loss=z_loss,
                          loss_normalizing_factor=loss_normalizing_factor)
  init_params = load_any_params(init_checkpoint, model_config) if init_checkpoint else None
  logger.info("train_run: %s, %.1fM params, %d train examples, batch %d, %d steps -> %s",
              task_name, model_config.num_params() / 1e6, train_source.num_examples,
              batch_size, train_steps, model_dir)
  return train_lib.train(model_dir=model_dir, trainer=trainer, train_source=train_source,
                         train_steps=train_steps, eval_source=eval_source,
                         eval_every=eval_every, eval_steps=eval_steps,
                         checkpoint_every=checkpoint_every, keep_checkpoints=keep_checkpoints,
                         log_every=log_every, seed=seed, init_params=init_params)


def load_any_params(path: str, model_config: config_lib.T5Config) -> Any:
  """Params from a jaxmoral export, a run directory (its latest step), one step of a run
  (`RUN/checkpoints/STEP`, as T5X's `checkpoint_STEP` folders are named), or a Hugging Face
  T5 folder."""
  folder = pathlib.Path(path)
  if folder.parent.name == checkpoints.RUN_CHECKPOINTS_SUBDIR and folder.name.isdigit():
    return checkpoints.restore_params_from_run(folder.parent, step=int(folder.name))
  if (folder / "model.safetensors").is_file() or (folder / "model.safetensors.index.json").is_file():
    from jaxmoral.models import hf_import
    hf_config, params = hf_import.load_hf_t5(folder)
    if hf_config.architecture() != model_config.architecture():
      raise ValueError(f"init_checkpoint {path}: its config {hf_config} differs from "
                       f"the run's MODEL_CONFIG {model_config}")
    return params
  if (folder / checkpoints.RUN_CHECKPOINTS_SUBDIR).is_dir():
    return restore_run_params(folder)
  if not (folder / checkpoints.PARAMS_DIR).is_dir():
    raise FileNotFoundError(
        f"init_checkpoint {path}: not a jaxmoral export (no {checkpoints.PARAMS_DIR}/), run "
        f"directory (no {checkpoints.RUN_CHECKPOINTS_SUBDIR}/), run step "
        f"(RUN/{checkpoints.RUN_CHECKPOINTS_SUBDIR}/STEP) or Hugging Face T5 folder "
        f"(no model.safetensors)")
  return checkpoints.load_params(folder)


def restore_run_params(model_dir: str | os.PathLike[str], *, step: Optional[int] = None) -> Any:
  """Only the params of a run's latest (or given) checkpoint."""
  return checkpoints.restore_params_from_run(
      checkpoints.run_checkpoints_dir(model_dir), step=step)


@gin.configurable
def eval_run(*, model_dir: str, data: Seq2SeqData, feature_lengths: Mapping[str, int],
             batch_size: int = 16, step: Optional[int] = None,
             decode_examples: int = 8, max_decode_length: Optional[int] = None) -> dict[str, Any]:
  """Evaluates a run's checkpoint: loss/accuracy on the eval split and greedy decodes.

  Writes MODEL_DIR/eval_<step>.json and prints the metrics and a few decoded examples.
  """
  config, vocabulary = load_run_files(model_dir)
  model = t5.T5(config)
  params = restore_run_params(model_dir, step=step)
  task_name = data.task_name(vocabulary)
  source = tasks.task_to_source(task_name, data.eval_split, feature_lengths=feature_lengths,
                                batch_size=batch_size, shuffle=False)
  loss_fn = jax.jit(losses.seq2seq_loss_fn(model, z_loss=0.0))
  results = [jax.device_get(loss_fn(params, batch, None)[1]) for batch in source.eval_batches()]
  metrics = trainer_lib.average_metrics(results)
  first = source.batch(0) if source.num_examples else None
  samples = []
  if first is not None and decode_examples:
    inputs = first["encoder_input_tokens"][:decode_examples]
    out = decoding.sample(model, params, encoder_input_tokens=inputs, rng=jax.random.PRNGKey(0),
                          max_decode_length=max_decode_length or feature_lengths["targets"],
                          greedy=True)
    for i in range(len(inputs)):
      samples.append({
          "input": vocabulary.decode(_strip(inputs[i])),
          "target": vocabulary.decode(_strip(first["decoder_target_tokens"][i])),
          "prediction": vocabulary.decode(_strip(np.asarray(out.tokens[i, 0])))})
  report = {"metrics": metrics, "samples": samples}
  out_path = pathlib.Path(model_dir) / f"eval_{step if step is not None else 'latest'}.json"
  out_path.write_text(json.dumps(report, indent=2))
  print(json.dumps(metrics, indent=2))
  for s in samples:
    print(f"  input: {s['input']}\n  target: {s['target']}\n  prediction: {s['prediction']}\n")
  print(f"wrote {out_path}")
  return report


def _strip(tokens: np.ndarray, eos_id: int = 1) -> list[int]:
  """Token ids up to (not including) EOS / padding."""
  out = []
  for t in np.asarray(tokens).tolist():
    if t in (0, eos_id):
      break
    out.append(int(t))
  return out


@gin.configurable
def infer_run(*, model_dir: str, input_file: Optional[str], output_file: Optional[str],
              input_field: Optional[str] = None, input_length: int = 128,
              batch_size: int = 16,
              sample_config: Optional[decoding.SampleConfig] = None,
              beam_config: Optional[decoding.BeamSearchConfig] = None,
              step: Optional[int] = None, seed: int = 0) -> str:
  """Decodes every input of a file with a run's checkpoint; writes JSONL predictions.

  Args:
    model_dir: Run directory.
    input_file: Plain text (one input a line) or JSONL (`input_field` names the key); the
      CLI's INFER_INPUT.
    output_file: JSONL of {"input", "predictions": [...], "scores": [...]}; INFER_OUTPUT.
    input_field: JSONL key of the input text.
    input_length: Encoder length (inputs are truncated, EOS kept).
    batch_size: Rows per decoding call (the last batch is padded; one compile).
    sample_config: Sampling settings (default greedy, 64 tokens).
    beam_config: Use beam search instead of sampling.
    step: Checkpoint step (default latest).
    seed: Sampling seed.

  Returns:
    The output path.
  """
  for value, macro in ((input_file, "INFER_INPUT"), (output_file, "INFER_OUTPUT")):
    if not value:
      raise ValueError(f"infer_run: no {macro.lower().replace('infer_', '')} file: give "
                       f"--gin.{macro}=PATH (input: plain text, one input a line, or JSONL; "
                       f"output: JSONL)")
  if input_file.endswith(".jsonl"):
    field = input_field or "input"
    texts = [r[field] for r in readers.read_jsonl(input_file, required=[field], text=[field])]
  else:
    texts = [r["text"] for r in readers.read_lines(input_file)]
  config, vocabulary = load_run_files(model_dir)
  model = t5.T5(config)
  params = restore_run_params(model_dir, step=step)
  sample_config = sample_config or decoding.SampleConfig(max_decode_length=64, greedy=True)
  rng = jax.random.PRNGKey(seed)
  start = time.time()
  with open(output_file, "w", encoding="utf-8") as out:
    for begin in range(0, len(texts), batch_size):
      chunk = texts[begin:begin + batch_size]
      tokens = np.zeros((batch_size, input_length), np.int32)
      for i, text in enumerate(chunk):
        ids = list(vocabulary.encode(text))[:input_length - 1] + [1]
        tokens[i, :len(ids)] = ids
      if beam_config is not None:
        seqs, scores = decoding.beam_search(model, params, encoder_input_tokens=tokens,
                                            **dataclasses.asdict(beam_config))
        seqs, scores = np.asarray(seqs), np.asarray(scores)
      else:
        rng, key = jax.random.split(rng)
        result = decoding.sample(model, params, encoder_input_tokens=tokens, rng=key,
                                 **dataclasses.asdict(sample_config))
        seqs = np.asarray(result.tokens)
        scores = np.asarray((result.logprobs * result.mask).sum(-1))
      for i, text in enumerate(chunk):
        out.write(json.dumps({
            "input": text,
            "predictions": [vocabulary.decode(_strip(s)) for s in seqs[i]],
            "scores": [float(x) for x in scores[i]]}) + "\n")
      logger.info("infer_run: %d/%d inputs (%.1f/s)", begin + len(chunk), len(texts),
                  (begin + len(chunk)) / max(time.time() - start, 1e-9))
  print(f"wrote {len(texts)} predictions to {output_file}")
  return output_file


def export_run(*, model_dir: str, output_dir: str, step: Optional[int] = None,
               dtype: Optional[str] = None) -> str:
  """`jaxmoral export`: params-only Orbax checkpoint (+ config.json, vocab) of a run."""
  config, vocabulary = load_run_files(model_dir)
  params = restore_run_params(model_dir, step=step)
  checkpoints.export_params(params, output_dir, dtype=dtype, config=config.to_dict())
  vocab_dir = pathlib.Path(output_dir) / VOCAB_DIR
  vocab_dir.mkdir(parents=True, exist_ok=True)
  shutil.copyfile(vocabulary.sentencepiece_model_file, vocab_dir / "spiece.model")
  (vocab_dir / "extra_ids.txt").write_text(str(vocabulary.extra_ids))
  print(f"exported {model_dir} -> {output_dir}" + (f" ({dtype})" if dtype else ""))
  return output_dir
