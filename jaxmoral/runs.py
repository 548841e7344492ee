"""Gin-bound entry points of the core commands: `jaxmoral train | eval | infer | export`.

`train_run` is the one training entry point of every supervised method (T5X's `train`): gin
injects the `TrainableModel` and the `DataSpec`, so every method gets `init_checkpoint`,
resume, run files (`jaxmoral.run_dirs`) and per-host data sharding from here.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import json
import logging
import math
import numbers
import sys
import tempfile
import time
from typing import Any, Mapping, Optional, Sequence

import gin
import jax
import numpy as np
import optax
from jax.experimental import multihost_utils

from jaxmoral import aot
from jaxmoral import decoding
from jaxmoral import fileio
from jaxmoral import gin_utils
from jaxmoral import losses
from jaxmoral import model_dirs
from jaxmoral import partitioning
from jaxmoral import run_dirs
from jaxmoral import run_layout
from jaxmoral import token_rows
from jaxmoral import train as train_lib
from jaxmoral import trainer as trainer_lib
from jaxmoral.data import readers
from jaxmoral.data.seq2seq import Seq2SeqData
from jaxmoral.data.source import DataSpec
from jaxmoral.models import t5
from jaxmoral.models import trainable

logger = logging.getLogger(__name__)

# The T5Config fields that decide the parameters' shapes: a resume with another value cannot
# restore the checkpoint (the others, dtype, remat, attention kernels, may change).
_SHAPE_FIELDS = ("vocab_size", "d_model", "d_kv", "d_ff", "num_heads", "num_encoder_layers",
                 "num_decoder_layers", "relative_attention_num_buckets", "feed_forward_proj",
                 "tie_word_embeddings")


def _check_same_model(model_dir: str, config: Any) -> None:
  """Refuses a resume whose model differs from the run's (`model_config.json`) in a field
  that shapes the parameters, naming it, before Orbax meets the mismatch."""
  path = fileio.join(model_dir, run_layout.MODEL_CONFIG_FILE)
  if config is None or not fileio.isfile(path):
    return
  saved = fileio.read_json(path)
  now = config.to_dict()
  differ = [f"{name}={saved[name]!r} there, {now[name]!r} here" for name in _SHAPE_FIELDS
            if name in saved and name in now and saved[name] != now[name]]
  if differ:
    raise ValueError(f"train: {model_dir} holds a run of another model ({path}: "
                     f"{'; '.join(differ)}); resume with the run's config.gin, or give a new "
                     "MODEL_DIR")


def make_trainer(*, model: trainable.TrainableModel, optimizer: optax.GradientTransformation,
                 partitioner: partitioning.PjitPartitioner,
                 num_microbatches: int = 1) -> trainer_lib.Trainer:
  """The `Trainer` of a run: the model's init, loss and trainable filter on the mesh."""
  return trainer_lib.Trainer(
      init_params_fn=model.init_params, loss_fn=model.loss_fn(), optimizer=optimizer,
      partitioner=partitioner, trainable_mask=model.trainable_patterns,
      num_microbatches=num_microbatches,
      # T5X logs the learning rate; an optimizer from `make_optimizer` knows its schedule.
      learning_rate_fn=getattr(optimizer, "learning_rate", None))


def _run_vocabulary(model_dir: str, data: DataSpec, init_info: Optional[model_dirs.ModelInfo]
                    ) -> Any:
  """The run's vocabulary: a resumed run keeps its own; else the data's (falling back to the
  init checkpoint's)."""
  own = model_dirs.load_vocabulary(model_dir)
  if own is not None:
    return own
  fallback = init_info.vocabulary if init_info is not None else None
  return data.vocabulary(run_dirs.vocabulary_build_dir(model_dir), fallback=fallback)


# train_run's counts: (parameter, the gin macro gin/runs/*.gin binds it to, least value).
_RUN_COUNTS = (("train_steps", "TRAIN_STEPS", 1), ("batch_size", "BATCH_SIZE", 1),
               ("checkpoint_every", "CHECKPOINT_EVERY", 1), ("eval_every", "EVAL_EVERY", 0),
               ("eval_steps", "EVAL_STEPS", 0), ("num_microbatches", None, 1),
               ("keep_checkpoints", None, 1), ("log_every", None, 1))


def _is_int(value: object) -> bool:
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_run_arguments(**values: Any) -> None:
  """Raises a ValueError naming the parameter and its macro for a count out of type or range:
  a mistyped flag (--gin.TRAIN_STEPS=abc gives the string 'abc') would otherwise fail deep
  inside the loop, or after the run files and vocabulary were written."""
  for name, macro, least in _RUN_COUNTS:
    if name not in values or (name == "eval_steps" and values[name] is None):
      continue
    value = values[name]
    if not _is_int(value) or value < least:
      kind = "a positive integer" if least else "an integer >= 0"
      where = f" ({macro})" if macro else ""
      raise ValueError(f"train_run: {name}{where} must be {kind}, got {value!r}")
  lengths = values["feature_lengths"]
  if not isinstance(lengths, Mapping) or not all(_is_int(v) and v > 0
                                                 for v in lengths.values()):
    raise ValueError(f"train_run: feature_lengths (TASK_FEATURE_LENGTHS) must map feature "
                     f"names to positive integers, got {lengths!r}")


@gin.configurable
def train_run(*, model_dir: str, model: trainable.TrainableModel, data: DataSpec,
              train_steps: int, batch_size: int, feature_lengths: Mapping[str, int],
              optimizer: optax.GradientTransformation,
              partitioner: Optional[partitioning.PjitPartitioner] = None,
              num_microbatches: int = 1, eval_every: int = 0, eval_steps: Optional[int] = None,
              checkpoint_every: int = 1000, keep_checkpoints: int = 3, log_every: int = 50,
              seed: int = 0, init_checkpoint: Optional[str] = None,
              hooks: Sequence[train_lib.TrainHook] = ()) -> dict[str, float]:
  """Trains `model` on `data` (T5X's `train`): resumes MODEL_DIR if it has checkpoints.

  Args:
    model_dir: Run directory (MODEL_DIR).
    model: What is trained (MODEL): module, loss, trainable filter.
    data: Where batches come from (a `DataSpec`, e.g. `Seq2SeqData`).
    train_steps: Total steps of the run (TRAIN_STEPS).
    batch_size: Global batch size (BATCH_SIZE).
    feature_lengths: `{"inputs": N, "targets": M}` (TASK_FEATURE_LENGTHS).
    optimizer: From a gin/optimizers fragment (OPTIMIZER).
    partitioner: Mesh and rules (PARTITIONER); default: data parallel over all devices.
    num_microbatches: Gradient accumulation steps per global batch.
    eval_every, eval_steps, checkpoint_every, keep_checkpoints, log_every: As `train.train`'s
      (but eval_steps 0: no evaluation at all).
    seed: Parameter init, shuffling and dropout seed.
    init_checkpoint: Fine-tune from this model directory or Hub id (any format of
      `jaxmoral.model_dirs`), read directly into the partitioner's shardings. Ignored on
      resume.
    hooks: Extra `train.TrainHook`s (the model's own come first).

  Raises:
    ValueError: A count is not an integer in range (naming its gin macro), or a resume that
      does not continue the run (another model shape, data, SEED, BATCH_SIZE, or TRAIN_STEPS
      behind it), before anything is written.
    OSError: MODEL_DIR cannot be written (before anything is done).
  """
  _check_run_arguments(train_steps=train_steps, batch_size=batch_size, eval_every=eval_every,
                       feature_lengths=feature_lengths, num_microbatches=num_microbatches,
                       eval_steps=eval_steps, checkpoint_every=checkpoint_every,
                       keep_checkpoints=keep_checkpoints, log_every=log_every)
  partitioner = partitioner or partitioning.PjitPartitioner()
  fileio.check_writable(model_dir, directory=True)
  if fileio.is_url(model_dir):
    run_dirs.make_run_dir(model_dir)  # Bucket, credentials, endpoint: checked first.
    created = not fileio.exists(model_dir)  # (It leaves no object behind.)
  else:
    created = not fileio.exists(model_dir)
    run_dirs.make_run_dir(model_dir)
  training = False
  try:
    # Held from before the run files are written: a second run into this folder is refused
    # before it changes anything (`train.train` takes the same lock again, re-entrantly).
    with run_dirs.RunDirLock(model_dir):
      resuming = bool(run_dirs.saved_steps(model_dir))
      init_info = model_dirs.inspect(init_checkpoint) if init_checkpoint and not resuming else None
      if resuming:  # Its files are checked and read only; written once the resume is accepted.
        run_dirs.verify_run_files(model_dir)
        _check_same_model(model_dir, model.config)
        data = data.resumed(run_dirs.read_settings(model_dir).get("data", {}))
      # Process 0 builds a vocabulary where one is built (a fresh run's demo vocabulary); the
      # others then find it in the run directory.
      if jax.process_index() == 0:
        vocabulary = _run_vocabulary(model_dir, data, init_info)
      if jax.process_count() > 1:
        multihost_utils.sync_global_devices("jaxmoral.runs.train_run: vocabulary ready")
        if jax.process_index() != 0:
          vocabulary = _run_vocabulary(model_dir, data, init_info)
      if vocabulary.vocab_size > model.config.vocab_size:
        raise ValueError(f"vocabulary has {vocabulary.vocab_size} ids (with extra ids) but "
                         f"T5Config.vocab_size is {model.config.vocab_size}")

      def write_run_files(resumed_step: Optional[int]) -> None:  # `train.train`'s on_checked.
        del resumed_step
        if jax.process_index() == 0:
          if gin.config_str():
            gin_utils.write_operative_config(model_dir)
          run_dirs.save_run_files(model_dir, config=model.config, vocabulary=vocabulary,
                                  settings={"model": model.settings(), "data": data.settings(),
                                            "feature_lengths": dict(feature_lengths)})
        if jax.process_count() > 1:
          multihost_utils.sync_global_devices("jaxmoral.runs.train_run: run files written")

      train_source, eval_source = data.sources(vocabulary=vocabulary, batch_size=batch_size,
                                               feature_lengths=feature_lengths, seed=seed)
      if eval_steps == 0:
        eval_source = None
      if jax.process_count() > 1:
        train_source = train_source.shard(jax.process_index(), jax.process_count())
        if eval_source is not None:
          eval_source = eval_source.shard(jax.process_index(), jax.process_count())
      # A streamed split's position is kept at each checkpoint step: a resume replays nothing.
      train_source = train_source.keeping_position(
          fileio.join(model_dir, run_layout.DATA_POSITION_DIR), checkpoint_every)
      trainer = make_trainer(model=model, optimizer=optimizer, partitioner=partitioner,
                             num_microbatches=num_microbatches)

      def init_params() -> Any:
        assert init_checkpoint is not None  # Called only with init_info.
        loaded = model_dirs.load(init_checkpoint, partitioner=partitioner)
        return model.params_from_checkpoint(loaded, jax.random.fold_in(jax.random.PRNGKey(seed), 1))

      examples = train_source.num_examples
      # A packed source's rows each hold several examples.
      features = getattr(train_source, "features", None)
      packed = isinstance(features, Mapping) and "encoder_segment_ids" in features
      logger.info("train_run: %s on %s (%s train %s), batch %d, %d steps -> %s%s",
                  trainable.describe(model), type(data).__name__,
                  "?" if examples is None else examples,
                  "packed rows" if packed else "examples", batch_size, train_steps, model_dir,
                  f", from {init_info.describe()}" if init_info else "")
      training = True
      return train_lib.train(model_dir=model_dir, trainer=trainer, train_source=train_source,
                             train_steps=train_steps, eval_source=eval_source, seed=seed,
                             eval_every=eval_every, eval_steps=eval_steps, log_every=log_every,
                             checkpoint_every=checkpoint_every, keep_checkpoints=keep_checkpoints,
                             init_params=init_params if init_info is not None else None,
                             hooks=[*model.hooks(model_dir), *hooks], on_checked=write_run_files)
  except BaseException:
    # A run that failed before its first step (bad data, a vocabulary that does not fit, an
    # unreadable init_checkpoint) leaves no folder it created behind.
    if created and not training and jax.process_index() == 0:
      with contextlib.suppress(OSError):
        fileio.rmtree(model_dir)
    raise


def compile_run(*, model: trainable.TrainableModel, data: DataSpec,
                optimizer: optax.GradientTransformation, batch_size: int,
                feature_lengths: Mapping[str, int],
                partitioner: Optional[partitioning.PjitPartitioner] = None,
                num_microbatches: int = 1) -> aot.CompileProgram:
  """The step `train_run` trains (arguments as its), as `jaxmoral compile` lowers it for a
  topology, from the data's batch shapes: nothing is read or allocated."""
  _check_run_arguments(batch_size=batch_size, feature_lengths=feature_lengths,
                       num_microbatches=num_microbatches)
  partitioner = partitioner or partitioning.PjitPartitioner()
  trainer = make_trainer(model=model, optimizer=optimizer, partitioner=partitioner,
                         num_microbatches=num_microbatches)
  shapes = data.batch_shapes(batch_size=batch_size, feature_lengths=feature_lengths)
  args = trainer.train_step_args(shapes)
  total, trainable_count = trainer.initializer.num_params()
  encoder_tokens = math.prod(shapes["encoder_input_tokens"][0])
  encoder_tokens += batch_size * getattr(getattr(model, "prompt", None), "length", 0)
  decoder_tokens = math.prod(shapes["decoder_target_tokens"][0])
  config = model.config
  shown = ", ".join(f"{k.split('_')[0]} {'x'.join(map(str, v[0][1:]))}"
                    for k, v in shapes.items() if k in ("encoder_input_tokens",
                                                        "decoder_target_tokens"))
  passes = 3.0 if trainable_count == total else 2.0
  return aot.CompileProgram(
      stages=(aot.Stage("step", trainer.train_step_function, args, persistent=args[0]),),
      partitioner=partitioner,
      description=(f"{type(model).__name__} T5 d_model={config.d_model} layers="
                   f"{config.num_encoder_layers}+{config.num_decoder_layers} "
                   f"({total / 1e6:.1f}M params, dtype {config.dtype}, remat {config.remat}), "
                   f"batch {batch_size} x ({shown})"),
      num_params=total, num_trainable_params=trainable_count,
      tokens_per_step=encoder_tokens + decoder_tokens,
      model_flops_per_step=passes * aot.t5_forward_flops(
          config, encoder_tokens=encoder_tokens, decoder_tokens=decoder_tokens))


def _compile_train_run() -> aot.CompileProgram:
  """`jaxmoral compile`'s default target, "train_run": `compile_run` given what the gin config
  binds `train_run` (MODEL, DATA, OPTIMIZER, BATCH_SIZE, ...), the step that run trains."""
  wanted = inspect.signature(compile_run).parameters
  bound = gin.get_bindings(train_run, resolve_references=False)
  missing = [name for name, p in wanted.items() if p.default is p.empty and name not in bound]
  if missing:
    raise ValueError(f"compile: the gin config binds no runs.train_run.{missing[0]} (the "
                     f"target \"train_run\" compiles the step that run trains)")
  # Copying resolves the references (gin.get_bindings' own way), those compile_run takes only.
  return compile_run(**copy.deepcopy({k: v for k, v in bound.items() if k in wanted}))


aot.register_compile_target("train_run", _compile_train_run)


@gin.configurable
def cache_run(*, data: Seq2SeqData, feature_lengths: Mapping[str, int], seed: int = 0,
              init_checkpoint: Optional[str] = None) -> dict[str, Any]:
  """Writes a config's data into its DATA_CACHE folder, without training (`jaxmoral cache`).

  Run it where seqio and TensorFlow are installed, with the training run's flags
  (TASK_FEATURE_LENGTHS, SEED, the data, INIT_CHECKPOINT for its vocabulary): a run given the
  same DATA_CACHE then reads its batches from there and imports neither.

  Returns:
    The cache's spec (what it holds, and its rows per part).

  Raises:
    ValueError: No DATA_CACHE was given.
  """
  if data.cache_dir is None:
    raise ValueError("cache: give the folder to write as --gin.DATA_CACHE=\"'/path'\" "
                     "(runs.Seq2SeqData.cache_dir)")
  fileio.check_writable(data.cache_dir, directory=True)
  fallback = model_dirs.inspect(init_checkpoint).vocabulary if init_checkpoint else None
  with tempfile.TemporaryDirectory(prefix="jaxmoral-vocab-") as build_dir:
    vocabulary = dataclasses.replace(data, cache_dir=None).vocabulary(build_dir, fallback=fallback)
    spec = data.write_cache(vocabulary=vocabulary, feature_lengths=feature_lengths, seed=seed)
  print(f"cache: {spec['rows']} rows written to {data.cache_dir}; train from it with "
        f"--gin.DATA_CACHE=\"'{data.cache_dir}'\" (no TensorFlow needed)", flush=True)
  return spec


@gin.configurable
def eval_run(*, model_dir: str, data: Seq2SeqData, feature_lengths: Mapping[str, int],
             batch_size: int = 16, step: Optional[int] = None,
             decode_examples: int = 8, max_decode_length: Optional[int] = None,
             partitioner: Optional[partitioning.PjitPartitioner] = None) -> dict[str, Any]:
  """Evaluates a run's checkpoint (loss/accuracy on the eval split, greedy decodes): writes
  MODEL_DIR/eval_<step>.json and prints the metrics and a few decoded examples.

  The loss is the run's own (from settings.json), so it equals what training's evaluation
  reported for the same step and data; a run trained on a pairs file is evaluated on the pairs
  it held out. The parameters are read into `partitioner`'s shardings and every batch is
  sharded over its "data" axis, as in training (gin binds the run's PARTITIONER).

  Raises:
    OSError: The report cannot be written (checked before anything is loaded or computed).
  """
  out_path = fileio.path(model_dir) / f"eval_{step if step is not None else 'latest'}.json"
  fileio.require_reachable(model_dir, "MODEL_DIR")
  if fileio.isdir(model_dir):  # A missing model dir: model_dirs.load says so.
    fileio.check_writable(out_path)
  loaded = model_dirs.load_on_mesh(model_dir, partitioner=partitioner, step=step)
  partitioner = loaded.partitioner
  model, params, vocabulary = t5.T5(loaded.config), loaded.lm_params, loaded.vocabulary
  data = data.resumed(loaded.settings.get("data", {}))  # The pairs the run held out.
  source = data.eval_source(vocabulary=vocabulary, batch_size=batch_size,
                            feature_lengths=feature_lengths)
  if source is None:
    raise ValueError(f"eval: the data has no evaluation split {data.eval_split!r}")
  # A model directory that is not a seq2seq run (an export, a Hugging Face folder) has no
  # settings: plain token NLL, no z-loss.
  saved = loaded.settings.get("model", {})
  loss_fn = losses.seq2seq_loss_fn(
      model, label_smoothing=saved.get("label_smoothing", 0.0), z_loss=saved.get("z_loss", 0.0),
      loss_normalizing_factor=saved.get("loss_normalizing_factor"))
  eval_step = model_dirs.jit_with_params(lambda p, batch: loss_fn(p, batch, None)[1],
                                         loaded.config, partitioner, replicated=(False,))
  results = [jax.device_get(eval_step(params, partitioner.shard_inputs(batch)))
             for batch in source.eval_batches()]
  metrics = trainer_lib.average_metrics(results)

  def text(row: Any) -> str:
    return vocabulary.decode(token_rows.text_ids(row, loaded.config.eos_token_id))

  first = next(source.eval_batches(), None)
  samples = []
  if first is not None and decode_examples:
    inputs = first["encoder_input_tokens"][:decode_examples]
    sampler = decoding.make_sampler(
        model, max_decode_length=max_decode_length or feature_lengths["targets"], greedy=True,
        eos_id=loaded.config.eos_token_id, partitioner=partitioner)
    weights = decoding.prepare_decode_weights(model, params, partitioner=partitioner)
    out = sampler(params, partitioner.shard_inputs(inputs), rng=jax.random.PRNGKey(0),
                  decode_weights=weights)
    samples = [{"input": text(inputs[i]), "target": text(first["decoder_target_tokens"][i]),
                "prediction": text(out.tokens[i, 0])} for i in range(len(inputs))]
  report = {"metrics": metrics, "samples": samples}
  out_path.write_text(json.dumps(report, indent=2))
  print(json.dumps(metrics, indent=2))
  for s in samples:
    print(f"  input: {s['input']}\n  target: {s['target']}\n  prediction: {s['prediction']}\n")
  print(f"wrote {out_path}")
  return report


def _read_infer_inputs(input_file: str, input_field: Optional[str]) -> list[str]:
  """The inputs of `infer_run`: one per line of a text file (a blank line gives ""), or one
  per object of a JSONL file."""
  if input_file.endswith(".jsonl"):
    field = input_field or "input"
    return [r[field] for r in readers.read_jsonl(input_file, required=[field], text=[field])]
  rows = readers.read_lines(input_file)  # Non-blank lines: the blank ones are put back.
  with fileio.open(input_file, "rb") as f:
    texts = [""] * sum(1 for _ in f)
  for row, line in zip(rows, rows.lines, strict=False):
    texts[line - 1] = row["text"]
  return texts


@gin.configurable
def infer_run(*, model_dir: str, input_file: Optional[str], output_file: Optional[str],
              input_field: Optional[str] = None, input_length: int = 128,
              batch_size: int = 16,
              sample_config: Optional[decoding.SampleConfig] = None,
              beam_config: Optional[decoding.BeamSearchConfig] = None,
              step: Optional[int] = None, seed: int = 0,
              partitioner: Optional[partitioning.PjitPartitioner] = None) -> str:
  """Decodes every input of a file with a run's checkpoint; writes JSONL predictions and
  returns their path.

  Args:
    input_file: Plain text (one input a line) or JSONL (`input_field` names the key, default
      "input"); INFER_INPUT.
    output_file: JSONL of {"input", "predictions": [...], "scores": [...]}, one record per
      input, in order (a blank input line gets one without predictions); INFER_OUTPUT.
    input_length: Encoder length: longer inputs are truncated to it (EOS kept; stderr says
      how many were).
    batch_size: Rows per decoding call (the last batch is padded; one compile).
    sample_config, beam_config: Sampling settings (default greedy, 64 tokens), or beam search.
    step, seed: Checkpoint step (default latest), sampling seed.
    partitioner: The mesh the parameters are read onto and decoded on (as in `eval_run`).

  Raises:
    OSError: `output_file` cannot be written (checked before the model is loaded).
  """
  for value, macro in ((input_file, "INFER_INPUT"), (output_file, "INFER_OUTPUT")):
    if not value:
      raise ValueError(f"infer_run: no {macro.lower().replace('infer_', '')} file: give "
                       f"--gin.{macro}=PATH (input: plain text, one input a line, or JSONL; "
                       f"output: JSONL)")
  assert input_file is not None and output_file is not None  # Checked just above.
  if fileio.is_within(output_file, input_file):
    raise ValueError(f"infer_run: INFER_OUTPUT {output_file} is the INFER_INPUT file; writing "
                     "it would replace the inputs: give another output file")
  texts = _read_infer_inputs(input_file, input_field)
  fileio.check_writable(output_file)
  loaded = model_dirs.load_on_mesh(model_dir, partitioner=partitioner, step=step)
  partitioner = loaded.partitioner
  model, params, vocabulary = t5.T5(loaded.config), loaded.lm_params, loaded.vocabulary
  weights = decoding.prepare_decode_weights(model, params, partitioner=partitioner)
  sample_config = sample_config or decoding.SampleConfig(max_decode_length=64, greedy=True)
  if beam_config is not None:
    beam_search = decoding.make_beam_search(model, **dataclasses.asdict(beam_config),
                                            partitioner=partitioner)
  else:
    sampler = decoding.make_sampler(model, **dataclasses.asdict(sample_config),
                                    partitioner=partitioner)
  # (line index, token ids) of the inputs to decode; blank lines have none.
  todo = [(i, list(vocabulary.encode(text))) for i, text in enumerate(texts) if text.strip()]
  long = [len(ids) + 1 for _, ids in todo if len(ids) + 1 > input_length]  # + 1: EOS.
  if long:
    # Said before decoding starts: a long run can be stopped and rerun with more room.
    print(f"infer_run: {len(long)} of {len(todo)} inputs are longer than input_length="
          f"{input_length} tokens (the longest: {max(long)}, EOS included) and are truncated "
          f"to {input_length}; set --gin.runs.infer_run.input_length=N to keep more",
          file=sys.stderr)
  rng = jax.random.PRNGKey(seed)
  start = time.time()

  def record(text: str, predictions: Sequence[str] = (), scores: Sequence[float] = ()) -> str:
    return json.dumps({"input": text, "predictions": list(predictions),
                       "scores": list(scores)}) + "\n"

  with fileio.open(output_file, "w", encoding="utf-8") as out:
    written = 0  # Records written: the next input line to answer.
    for begin in range(0, len(todo), batch_size):
      chunk = todo[begin:begin + batch_size]
      tokens = token_rows.padded([ids[:input_length - 1] + [1] for _, ids in chunk],
                                 input_length, batch_size)
      tokens = partitioner.shard_inputs(tokens)
      if beam_config is not None:
        seqs, scores = map(np.asarray, beam_search(params, tokens, decode_weights=weights))
      else:
        rng, key = jax.random.split(rng)
        result = sampler(params, tokens, rng=key, decode_weights=weights)
        seqs = np.asarray(result.tokens)
        scores = np.asarray((result.logprobs * result.mask).sum(-1))
      for i, (index, _) in enumerate(chunk):
        out.writelines(record(texts[blank]) for blank in range(written, index))
        out.write(record(texts[index], [vocabulary.decode(token_rows.text_ids(
            s, loaded.config.eos_token_id)) for s in seqs[i]], [float(x) for x in scores[i]]))
        written = index + 1
      logger.info("infer_run: %d/%d inputs (%.1f/s)", begin + len(chunk), len(todo),
                  (begin + len(chunk)) / max(time.time() - start, 1e-9))
    out.writelines(record(texts[blank]) for blank in range(written, len(texts)))
  blanks = len(texts) - len(todo)
  print(f"wrote {len(texts)} predictions to {output_file}"
        + (f" ({blanks} blank input lines have none)" if blanks else ""))
  return output_file


def export_run(*, model_dir: str, output_dir: str, step: Optional[int] = None,
               dtype: Optional[str] = None, output_format: str = "jaxmoral",
               overwrite: bool = False,
               partitioner: Optional[partitioning.PjitPartitioner] = None) -> str:
  """`jaxmoral export`: see `model_dirs.export_model` (its output checked writable first)."""
  model_dirs.refuse_output_inside(model_dir, output_dir)
  fileio.require_reachable(model_dir, "--model_dir")
  fileio.require_reachable(output_dir, "--output")
  fileio.check_writable(output_dir, directory=True)
  return model_dirs.export_model(model_dir, output_dir, step=step, dtype=dtype, overwrite=overwrite,
                                 output_format=output_format, partitioner=partitioner)
