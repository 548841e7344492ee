"""The training loop: resume, train steps, progress, TensorBoard, eval, NaN stop, checkpoints.

Data position is the step: `train_source.batch(step)` is deterministic, so a run resumed from
the checkpoint of step `s` reads batch `s` next and, with the trainer's per-step rng
(`fold_in(base_rng, step)`), reproduces the uninterrupted run exactly.

Layout of `model_dir`::

  checkpoints/<step>/   Orbax checkpoints of the `TrainState`
  train/                TensorBoard events (train metrics, tokens/s, steps/s)
  eval/                 TensorBoard events (eval metrics)
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import struct
import time
from typing import Any, Callable, Mapping, Optional

import gin
import jax
import numpy as np

from jaxmoral import checkpoints
from jaxmoral import trainer as trainer_lib

logger = logging.getLogger(__name__)

OnEval = Callable[[int, dict[str, float], trainer_lib.TrainState], Optional[Mapping[str, float]]]


class NonFiniteLossError(FloatingPointError):
  """Training produced a NaN/inf loss or gradient norm; nothing from that step was saved."""


class MetricWriters:
  """TensorBoard event files in train/ and eval/, on process 0 only (shared by every loop).

  A point is in its file when `scalars` or `text` returns: the event is written and flushed
  in the caller's thread. (tensorboardX's `SummaryWriter` hands events to a background
  thread, and its `flush` does not wait for them, so a run killed after a checkpoint lost the
  points of that step for good: the resumed run starts after them.)
  """

  def __init__(self, model_dir: str):
    self._writers = {}
    if jax.process_index() == 0:
      # pylint: disable=g-import-not-at-top  (optional, heavy)
      from tensorboardX.event_file_writer import EventsWriter
      from tensorboardX.record_writer import directory_check
      for name in ("train", "eval"):
        directory = os.path.join(model_dir, name)
        directory_check(directory)  # Local folders and gs:// / s3:// alike.
        # pid and object id in the name: two writers started in the same second (a run and
        # its quick resume, or two loops of one process) must not share a file.
        self._writers[name] = EventsWriter(os.path.join(directory, "events"),
                                           filename_suffix=f".{os.getpid()}.{id(self)}")

  def _write(self, name: str, step: int, summary: Any) -> None:
    writer = self._writers.get(name)
    if writer is not None:
      from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top
      writer.write_event(event_pb2.Event(wall_time=time.time(), step=int(step), summary=summary))
      writer.flush()

  def scalars(self, name: str, step: int, values: Mapping[str, float]) -> None:
    from tensorboardX.proto import summary_pb2  # pylint: disable=g-import-not-at-top
    self._write(name, step, summary_pb2.Summary(value=[
        summary_pb2.Summary.Value(tag=key, simple_value=float(value))
        for key, value in values.items()]))

  def text(self, name: str, step: int, tag: str, text: str) -> None:
    """Text (e.g. a markdown table of sample outputs) under `name`."""
    from tensorboardX import summary  # pylint: disable=g-import-not-at-top
    self._write(name, step, summary.text(tag, text))

  def close(self) -> None:
    for writer in self._writers.values():
      writer.close()


def read_scalars(directory: str) -> dict[str, dict[int, float]]:
  """`{tag: {step: value}}` of the scalars in a directory's TensorBoard event files.

  For a notebook or a test, without TensorBoard: the TFRecord framing (length, its CRC,
  data, its CRC) is read directly. Files are read in name order; a later point of a step wins
  (a resumed run writes again the steps after its checkpoint).
  """
  from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top
  out: dict[str, dict[int, float]] = {}
  for name in sorted(os.listdir(directory)):
    if "tfevents" not in name:
      continue
    with open(os.path.join(directory, name), "rb") as f:
      data = f.read()
    pos = 0
    while pos + 12 <= len(data):
      (length,) = struct.unpack("<Q", data[pos:pos + 8])
      record = data[pos + 12:pos + 12 + length]
      pos += 12 + length + 4
      event = event_pb2.Event.FromString(record)
      for value in event.summary.value:
        if value.HasField("simple_value"):
          out.setdefault(value.tag, {})[event.step] = value.simple_value
  return out


def _tokens_in(batch: Mapping[str, Any], metrics: Mapping[str, Any]) -> float:
  """Target tokens of a step: the loss fn's `num_tokens`, else the target array's size."""
  if "num_tokens" in metrics:
    return float(metrics["num_tokens"])
  targets = batch.get("decoder_target_tokens")
  return float(np.size(targets)) * jax.process_count() if targets is not None else 0.0


def format_seconds(seconds: float) -> str:
  if not math.isfinite(seconds):
    return "?"
  return str(datetime.timedelta(seconds=int(seconds)))


def evaluate(*, trainer: trainer_lib.Trainer, state: trainer_lib.TrainState, eval_source: Any,
             eval_steps: Optional[int] = None) -> dict[str, float]:
  """Metrics over `eval_steps` batches (`eval_source.batch(i)`), or one full pass.

  Args:
    trainer: Provides `eval_step`.
    state: The state to evaluate.
    eval_source: A `BatchSource` (or anything with `batch(i)` / `eval_batches()`).
    eval_steps: Number of batches; None: one pass over `eval_source.eval_batches()`.

  Returns:
    Token-weighted means (see `trainer.average_metrics`).
  """
  if eval_steps is None:
    if not hasattr(eval_source, "eval_batches"):
      raise ValueError("evaluate: eval_steps=None needs an eval_source with eval_batches()")
    batches = eval_source.eval_batches()
  else:
    batches = (eval_source.batch(i) for i in range(eval_steps))
  results = [jax.device_get(trainer.eval_step(state, trainer.shard_batch(b))) for b in batches]
  return trainer_lib.average_metrics(results)


@gin.configurable
def train(*, model_dir: str | os.PathLike[str], trainer: trainer_lib.Trainer, train_source: Any,
          train_steps: int, eval_source: Any = None, eval_every: int = 0,
          eval_steps: Optional[int] = None, checkpoint_every: int = 1000,
          keep_checkpoints: int = 3, log_every: int = 100, seed: int = 0,
          stop_on_nan: bool = True, async_checkpoint: bool = True,
          on_eval: Optional[OnEval] = None, init_params: Any = None) -> dict[str, float]:
  """Trains to `train_steps`, resuming from `model_dir/checkpoints` when it has a checkpoint.

  Args:
    model_dir: Run directory (checkpoints/, train/, eval/ inside).
    trainer: The compiled steps (`jaxmoral.trainer.Trainer`).
    train_source: `batch(step) -> dict of numpy arrays` (this process's rows of the global
      batch), deterministic in `step`.
    train_steps: Total number of steps of the run (not of this call).
    eval_source: Optional evaluation batches (see `evaluate`).
    eval_every: Evaluate every this many steps (0: only at the end).
    eval_steps: Batches per evaluation (None: one pass over `eval_source.eval_batches()`).
    checkpoint_every: Save every this many steps (and always at the end).
    keep_checkpoints: Keep this many most recent checkpoints.
    log_every: Progress line and TensorBoard train scalars every this many steps (window
      averages).
    seed: Base rng seed (parameter init and the per-step dropout keys).
    stop_on_nan: Raise `NonFiniteLossError` on a NaN/inf loss or gradient norm, before
      anything of that step is saved.
    async_checkpoint: Write checkpoints in the background.
    on_eval: `on_eval(step, metrics, state) -> extra metrics or None`, called after each
      evaluation (e.g. decoding-based metrics); extras are logged with the eval metrics.
    init_params: Parameters for a fresh run (fine-tuning from imported/exported params);
      ignored when resuming. None: random init from `seed`.

  Returns:
    `{"step": final step, "train/<metric>": last window means, "eval/<metric>": last eval}`.

  Raises:
    NonFiniteLossError: NaN/inf at some step (the message names it).
  """
  for name, value in (("train_steps", train_steps), ("checkpoint_every", checkpoint_every),
                      ("log_every", log_every), ("keep_checkpoints", keep_checkpoints)):
    if not isinstance(value, int) or value <= 0:
      raise ValueError(f"train: {name} must be a positive int, got {value!r}")
  if not isinstance(eval_every, int) or eval_every < 0:
    raise ValueError(f"train: eval_every must be an int >= 0, got {eval_every!r}")
  model_dir = checkpoints.make_run_dir(model_dir)
  is_chief = jax.process_index() == 0
  ckpt_dir = checkpoints.run_checkpoints_dir(model_dir)
  manager = checkpoints.CheckpointManager(ckpt_dir, save_interval_steps=checkpoint_every,
                                          max_to_keep=keep_checkpoints,
                                          async_save=async_checkpoint)
  init_rng, step_rng = jax.random.split(jax.random.PRNGKey(seed))
  latest = manager.latest_step()
  if latest is not None:
    state, _ = manager.restore(latest, target=trainer.abstract_state())
    logger.info("train: resuming from %s at step %d", ckpt_dir, latest)
  elif init_params is not None:
    state = trainer.init_state_from_params(init_params)
  else:
    state = trainer.init_state(init_rng)
  start = int(jax.device_get(state.step))
  if start > train_steps:
    raise ValueError(f"train: checkpoint in {ckpt_dir} is at step {start}, beyond "
                     f"train_steps={train_steps}")

  writers = MetricWriters(model_dir)
  result: dict[str, float] = {}
  window: list[dict[str, float]] = []
  window_tokens, window_time, window_steps = 0.0, 0.0, 0
  last_saved = latest
  last_eval_step = None
  preempted = False

  def run_eval(step: int) -> None:
    nonlocal last_eval_step
    metrics = evaluate(trainer=trainer, state=state, eval_source=eval_source,
                       eval_steps=eval_steps)
    if on_eval is not None:
      metrics.update(on_eval(step, dict(metrics), state) or {})
    writers.scalars("eval", step, metrics)
    if is_chief:
      logger.info("eval step %d: %s", step,
                  " ".join(f"{k} {v:.4g}" for k, v in sorted(metrics.items())))
    result.update({f"eval/{k}": float(v) for k, v in metrics.items()})
    last_eval_step = step

  try:
    for step in range(start, train_steps):
      tick = time.perf_counter()
      batch = train_source.batch(step)
      state, metrics = trainer.train_step(state, trainer.shard_batch(batch), step_rng)
      metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
      elapsed = time.perf_counter() - tick
      done = step + 1
      if stop_on_nan:
        bad = [k for k in ("loss", "grad_norm") if k in metrics and not math.isfinite(metrics[k])]
        if bad:
          raise NonFiniteLossError(
              f"train: non-finite {', '.join(f'{k}={metrics[k]}' for k in bad)} at step {done} "
              f"(batch {step}); nothing of this step was saved; last checkpoint: "
              f"{last_saved if last_saved is not None else 'none'} in {ckpt_dir}")
      window.append(metrics)
      if step > start:  # the run's first step includes compilation: keep it out of throughput
        window_tokens += _tokens_in(batch, metrics)
        window_time += elapsed
        window_steps += 1
      if done % log_every == 0 or done == train_steps:
        means = {k: float(np.mean([m[k] for m in window])) for k in window[0]}
        rates = {}
        if window_steps:
          rates = {"steps_per_sec": window_steps / window_time,
                   "tokens_per_sec": window_tokens / window_time}
        writers.scalars("train", done, {**means, **rates})
        if is_chief:
          eta = (train_steps - done) / rates["steps_per_sec"] if rates else float("nan")
          logger.info("step %d/%d loss %.4f tokens/s %.4g steps/s %.3g ETA %s", done,
                      train_steps, means["loss"], rates.get("tokens_per_sec", float("nan")),
                      rates.get("steps_per_sec", float("nan")), format_seconds(eta))
        result.update({f"train/{k}": v for k, v in means.items()})
        window, window_tokens, window_time, window_steps = [], 0.0, 0.0, 0
      if eval_source is not None and eval_every and done % eval_every == 0:
        run_eval(done)
      if done % checkpoint_every == 0 or done == train_steps:
        manager.save(done, state, force=True)
        last_saved = done
      elif manager.reached_preemption(done):
        manager.save(done, state, force=True)
        logger.warning("train: preempted; saved step %d to %s and stopping", done, ckpt_dir)
        last_saved = done
        preempted = True
        break
    final_step = int(jax.device_get(state.step))
    if last_saved != final_step:
      manager.save(final_step, state, force=True)
    if eval_source is not None and last_eval_step != final_step and not preempted:
      run_eval(final_step)
  finally:
    manager.wait()
    manager.close()
    writers.close()
  result["step"] = final_step
  return result
