"""The training loop: resume, train steps, progress, TensorBoard, eval, NaN stop, checkpoints.

Data position is the step: `train_source.iterate(step)` is deterministic, so a run resumed
from the checkpoint of step `s` reads batch `s` next and, with the trainer's per-step rng
(`fold_in(base_rng, step)`), reproduces the uninterrupted run exactly. The devices never wait
for the loop (`_run_steps`). Hooks (`TrainHook`) add what a method needs besides stepping (PPO's
reward normalisation and curve, a soft prompt saved at the end) without a second loop.

The run directory's layout: `jaxmoral.run_layout`; its TensorBoard files: `jaxmoral.metric_writers`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import math
import os
import queue
import threading
import time
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import gin
import jax
import numpy as np

from jaxmoral import checkpoints
from jaxmoral import fileio
from jaxmoral import integrity
from jaxmoral import metric_writers
from jaxmoral import partitioning
from jaxmoral import preemption
from jaxmoral import progress
from jaxmoral import run_dirs
from jaxmoral import run_layout
from jaxmoral import software
from jaxmoral import trainer as trainer_lib
from jaxmoral import validation
from jaxmoral.data.source import DataSource

logger = logging.getLogger(__name__)

OnEval = Callable[[int, dict[str, float], trainer_lib.TrainState], Optional[Mapping[str, float]]]


class NonFiniteLossError(FloatingPointError):
  """Training produced a NaN/inf loss or gradient norm; nothing from that step was saved.

  A user's setting more often than a bug (the command line prints it as one line)."""


def evaluate(*, trainer: trainer_lib.Trainer, state: trainer_lib.TrainState, eval_source: Any,
             eval_steps: Optional[int] = None) -> dict[str, float]:
  """Token-weighted means (`trainer.average_metrics`) of `trainer.eval_step`'s metrics.

  Over the first `eval_steps` batches of `eval_source.iterate(0)`, or (None) one pass over
  `eval_source.eval_batches()`.
  """
  if eval_steps is None:
    if not hasattr(eval_source, "eval_batches"):
      raise ValueError("evaluate: eval_steps=None needs an eval_source with eval_batches()")
    batches = eval_source.eval_batches()
  else:
    batches = itertools.islice(eval_source.iterate(0), eval_steps)
  results = [jax.device_get(trainer.eval_step(state, trainer.shard_batch(b))) for b in batches]
  return trainer_lib.average_metrics(results)


class TrainHook:
  """Something a training run does besides stepping (override what you need).

  `train` calls, in order: `on_start` once (it may replace the state: e.g. PPO measures its
  reward normalisation on a fresh run), `after_step` after every step (with the step's float
  metrics, fetched from the devices when the hook first reads them: a hook that does not
  read them lets the loop run ahead; read them within the call), `on_end` once after the
  last save. Hooks run on every process.
  """

  def on_start(self, loop: LoopInfo, state: Any) -> Any:
    del loop
    return state

  def after_step(self, loop: LoopInfo, step: int, state: Any,
                 metrics: Mapping[str, float]) -> None:
    del loop, step, state, metrics

  def on_end(self, loop: LoopInfo, state: Any) -> None:
    del loop, state


@dataclasses.dataclass
class LoopInfo:
  """What hooks may read of the running loop (`fresh`: no checkpoint existed, the state was
  just initialised; `start_step`: the step the run (re)started at)."""
  model_dir: str
  start_step: int
  fresh: bool
  train_steps: int
  writers: metric_writers.MetricWriters


def _progress_line(trainer: Any, done: int, train_steps: int, means: Mapping[str, float],
                   rates: Mapping[str, float]) -> str:
  """`step 10/100 loss 2.31 [trainer's own metrics] tokens/s ... ETA 0:01:02`."""
  parts = [f"step {done}/{train_steps}", f"loss {means.get('loss', float('nan')):.4f}"]
  parts += [f"{name} {means[name]:.4g}" for name in getattr(trainer, "progress_metrics", ())
            if name in means]
  parts += [f"{name.replace('_per_sec', '/s')} {rates[name]:.4g}"
            for name in ("tokens_per_sec", "examples_per_sec", "steps_per_sec") if name in rates]
  eta = ((train_steps - done) / rates["steps_per_sec"] if rates.get("steps_per_sec")
         else float("nan"))
  parts.append(f"ETA {progress.format_seconds(eta)}")
  return " ".join(parts)


@gin.configurable
def train(*, model_dir: str | os.PathLike[str], trainer: Any, train_source: DataSource,
          train_steps: int, eval_source: Any = None, eval_every: int = 0,
          eval_steps: Optional[int] = None, checkpoint_every: int = 1000,
          keep_checkpoints: int = 3, log_every: int = 100, seed: int = 0,
          stop_on_nan: bool = True, async_checkpoint: bool = True,
          on_eval: Optional[OnEval] = None, init_params: Any = None,
          hooks: Sequence[TrainHook] = (),
          on_checked: Optional[Callable[[Optional[int]], None]] = None,
          prefetch_batches: int = 2) -> dict[str, float]:
  """Trains to `train_steps`, resuming from the newest intact checkpoint in `model_dir`.

  The one loop of every method (`trainer.Trainer`'s steps, `rl.ppo_trainer.PPOTrainer`'s
  iterations). A trainer provides `abstract_state()`, `init_state(rng)`,
  `init_state_from_params(params)` and `train_step(state, batch, rng) -> (state, metrics)` (the
  state has a `step` field); optionally `eval_step` (for `eval_source`), `shard_batch` (places
  this process's rows of a batch on the devices) and `progress_metrics` (names shown on the
  progress line). The run holds `model_dir/train.lock`; TensorBoard points a killed run wrote
  past the resumed step are dropped, so every step appears once.

  Args:
    train_source: A `DataSource` (`iterate(start_step)`: this process's rows of batch
      `start_step`, ...); its `num_examples`, `batch_size`, `data_fingerprint` are checkpointed.
    train_steps: Total number of steps of the run (not of this call).
    eval_source: Optional evaluation batches, `eval_steps` per evaluation (see `evaluate`).
    eval_every: Evaluate every this many steps (0: only at the end).
    checkpoint_every: Save every this many steps (and always at the end).
    log_every: Progress line and TensorBoard train scalars every this many steps (window
      averages, fetched from the devices in one transfer).
    seed: Base rng seed (parameter init and the per-step dropout keys).
    stop_on_nan: Raise `NonFiniteLossError` on a NaN/inf loss or gradient norm, naming the
      step it happened at, before anything of that step is saved (found when the step's
      metrics are fetched: at most `log_every` steps late, at once by a hook that reads them).
    on_eval: `on_eval(step, metrics, state) -> extra metrics or None`, called after each
      evaluation (e.g. decoding-based metrics); extras are logged with the eval metrics.
    init_params: Parameters for a fresh run (fine-tuning), or a zero-argument function that
      returns them (called only when there is no checkpoint). None: random init from `seed`.
    on_checked: Called with the resumed step (None: a fresh run) once every check of the
      resume has passed (the checkpoint restored into this model, the same data, seed and
      batch size, `train_steps` not behind it) and before this function writes anything;
      `runs.train_run` writes the run's files there, so a refused resume changes nothing.
    prefetch_batches: Batches read and placed on the devices ahead of the running step.

  Returns:
    `{"step": final step, "train/<metric>": last window means, "eval/<metric>": last eval}`.

  Raises:
    NonFiniteLossError: NaN/inf at some step (the message names it).
    ValueError: A checkpoint of this run was written over other data, seed or batch size
      (the data position would not continue the same run), or bad arguments.
    preemption.Stopped: SIGTERM or SIGINT (one process): the step it came in was saved.
    run_dirs.RunDirLockedError: Another run trains in `model_dir` (a ValueError).
    integrity.CheckpointIntegrityError: Every checkpoint is damaged (a ValueError).
  """
  for name, value in (("train_steps", train_steps), ("checkpoint_every", checkpoint_every),
                      ("log_every", log_every), ("keep_checkpoints", keep_checkpoints),
                      ("prefetch_batches", prefetch_batches)):
    validation.positive_int(value, f"train: {name}")
  validation.non_negative_int(eval_every, "train: eval_every")
  model_dir = run_dirs.make_run_dir(model_dir)
  is_chief = jax.process_index() == 0
  ckpt_dir = run_dirs.checkpoints_dir(model_dir)
  with contextlib.ExitStack() as cleanup:  # Closed in reverse: the lock is released last.
    # Two runs writing one MODEL_DIR would interleave checkpoints and curves: refused here.
    cleanup.enter_context(run_dirs.RunDirLock(model_dir))
    manager = cleanup.enter_context(checkpoints.CheckpointManager(
        ckpt_dir, save_interval_steps=checkpoint_every, max_to_keep=keep_checkpoints,
        async_save=async_checkpoint))
    init_rng, step_rng = jax.random.split(jax.random.PRNGKey(seed))
    # What the data position means: a checkpoint of the same run over other data (another
    # corpus or seed, changed data files: an index-cached source's fingerprint of its rows) or
    # another batch size (the step is the position: T5X's and MaxText's data iterators assume
    # it fixed as well) would not continue that run; refused instead of shifting silently.
    position = {"num_examples": getattr(train_source, "num_examples", None), "seed": seed,
                "batch_size": getattr(train_source, "batch_size", None),
                "data": getattr(train_source, "data_fingerprint", None)}
    # Each host reads its own copy of the data: a stale copy would shift every shard silently.
    partitioning.refuse_differing_processes(
        repr(sorted(position.items())), "train", f"has another data position than process 0 "
        f"(here {position}): every host must read the same data with the same seed")
    latest, state, extra, damaged = _restore_newest_intact(manager, trainer)
    if latest is not None:
      differ = [k for k, v in position.items()
                if v is not None and extra.get(k) is not None and extra[k] != v]
      if differ:
        raise ValueError(
            f"train: {ckpt_dir}/{latest} was written with "
            f"{', '.join(f'{k}={extra[k]!r} (this run: {position[k]!r})' for k in differ)}; "
            "the data would not continue the same run (use the run's settings, or a new "
            "MODEL_DIR); nothing was changed")
      logger.info("train: resuming from %s at step %d", ckpt_dir, latest)
    elif init_params is not None:
      state = trainer.init_state_from_params(init_params() if callable(init_params)
                                             else init_params)
    else:
      state = trainer.init_state(init_rng)
    start = int(jax.device_get(state.step))
    if start > train_steps:
      raise ValueError(f"train: checkpoint in {ckpt_dir} is at step {start}, beyond "
                       f"train_steps={train_steps}; nothing was changed")
    # Every check passed: from here on the run writes.
    if on_checked is not None:
      on_checked(latest)
    _move_aside_damaged(manager, damaged, latest)
    if is_chief:
      # Which code trains from this step on: a checkpoint can be traced to it across resumes.
      software_line = software.describe(software.record_start(model_dir, step=start))
      logger.info("train: %s", software_line)
      # Points a killed run wrote after this step are written again from here on; a run
      # resumed at its last step evaluates that step again.
      eval_from = start - 1 if eval_source is not None and start >= train_steps else start
      for name, after in (("train", start), ("eval", eval_from)):
        metric_writers.purge_events_after(fileio.join(model_dir, name), after)
    writers = metric_writers.MetricWriters(model_dir)
    cleanup.callback(writers.close)
    if is_chief:  # As T5X: what this stretch of the run trains under, in TensorBoard's Text tab.
      writers.text("train", start, "software", software_line)
      config_path = fileio.join(model_dir, run_layout.CONFIG_FILE)
      if fileio.isfile(config_path):  # As an indented markdown code block: shown as written.
        writers.text("train", start, "config", "\n".join(
            "    " + line for line in fileio.read_text(config_path).splitlines()))
    loop = LoopInfo(model_dir=model_dir, start_step=start, fresh=latest is None,
                    train_steps=train_steps, writers=writers)
    for hook in hooks:
      state = hook.on_start(loop, state)
    with preemption.StopRequests() as stop_requests:
      result = _run_steps(
          trainer=trainer, state=state, manager=manager, loop=loop, train_source=train_source,
          eval_source=eval_source, eval_every=eval_every, eval_steps=eval_steps,
          checkpoint_every=checkpoint_every, log_every=log_every, step_rng=step_rng,
          stop_on_nan=stop_on_nan, on_eval=on_eval, hooks=hooks, last_saved=latest,
          extra=position, is_chief=is_chief, prefetch_batches=prefetch_batches)
    if stop_requests.signum is not None:  # Raised to the caller once saved and unlocked.
      raise preemption.Stopped(stop_requests.signum, step=int(result["step"]), where=ckpt_dir)
    return result


def _restore_newest_intact(manager: checkpoints.CheckpointManager, trainer: Any
                           ) -> tuple[Optional[int], Any, dict[str, Any],
                                      list[tuple[int, integrity.CheckpointIntegrityError]]]:
  """`(step, state, extra, damaged)` of the newest intact checkpoint (`(None, None, {}, [])`
  if none); raises CheckpointIntegrityError where all are damaged (the run would start over).

  Damaged or incomplete steps (found before anything of them is read) are skipped;
  `_move_aside_damaged` moves them aside (`<step>.damaged`) once the resume is accepted, so
  the run saves those steps again.
  """
  skipped: list[tuple[int, integrity.CheckpointIntegrityError]] = []
  for step in reversed(manager.all_steps()):
    try:
      state, extra = manager.restore(step, target=trainer.abstract_state())
    except integrity.CheckpointIntegrityError as e:
      skipped.append((step, e))
    else:
      return step, state, extra, skipped
  if skipped:
    raise integrity.CheckpointIntegrityError(
        f"train: no intact checkpoint in {manager.directory} (damaged: "
        f"{', '.join(str(step) for step, _ in skipped)}): {skipped[0][1]}; move the damaged "
        "steps away to start over, or use a new MODEL_DIR", step=skipped[0][0],
        files=skipped[0][1].files)
  return None, None, {}, skipped


def _move_aside_damaged(manager: checkpoints.CheckpointManager,
                        damaged: Sequence[tuple[int, integrity.CheckpointIntegrityError]],
                        resumed: Optional[int]) -> None:
  """Moves the damaged steps `_restore_newest_intact` skipped aside, with a warning each."""
  for step, error in damaged:
    aside = manager.move_aside(step)
    logger.warning("train: skipping damaged checkpoint step %d (%s); moved to %s", step,
                   error, aside)
  if damaged and resumed is not None:
    logger.warning("train: resuming from step %d, the newest intact checkpoint (skipped "
                   "step%s %s)", resumed, "s" if len(damaged) > 1 else "",
                   ", ".join(str(step) for step, _ in damaged))


class _Prefetcher:
  """`source.iterate(start)`'s batches, read and placed on the devices ahead by a thread.

  While step s runs, batches s + 1 ... s + `depth` are read, tokenised, packed and placed
  (`place`: the trainer's `shard_batch`), as flax's `prefetch_to_device` and T5X's input
  pipeline do. Items are `(placed batch, global rows, target tokens from the batch's shape)`.
  An error of the source is raised by the `next` that reaches it.
  """

  _END = object()

  def __init__(self, batches: Iterator[Any], place: Callable[[Any], Any], depth: int):
    self._queue: queue.Queue = queue.Queue(maxsize=depth)
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._produce, args=(batches, place), daemon=True,
                                    name="jaxmoral-prefetch")
    self._thread.start()

  def _put(self, item: Any) -> bool:
    while not self._stop.is_set():
      with contextlib.suppress(queue.Full):
        self._queue.put(item, timeout=0.1)
        return True
    return False

  def _produce(self, batches: Iterator[Any], place: Callable[[Any], Any]) -> None:
    try:
      for batch in batches:
        targets = batch.get("decoder_target_tokens") if isinstance(batch, Mapping) else None
        tokens = 0.0 if targets is None else float(np.size(targets)) * jax.process_count()
        rows = next((int(np.shape(v)[0]) for v in batch.values() if np.shape(v)), 0)
        if not self._put((place(batch), rows * jax.process_count(), tokens)):
          return
      self._put(self._END)
    except BaseException as error:  # pylint: disable=broad-except  (raised in the loop)
      self._put(error)

  def __next__(self) -> tuple[Any, int, float]:
    item = self._queue.get()
    if item is self._END:
      self._queue.put(item)
      raise StopIteration
    if isinstance(item, BaseException):
      raise item
    return item

  def close(self) -> None:
    self._stop.set()
    self._thread.join(timeout=10)


# Steps dispatched but not finished, at most: one running and the next queued, so the devices
# never idle between steps. Without a bound the host dispatches every step its batches allow
# while the first one runs; a preemption notice or a NaN then waits for the whole queue, and
# each queued execution may hold its buffers.
MAX_STEPS_IN_FLIGHT = 2


class _Window:
  """The metrics of the steps since the last log, kept on the devices until fetched.

  `fetch` brings every pending step's metrics to the host in one transfer and checks them in
  step order, so a NaN/inf is reported at the step it happened, however late it is fetched.
  """

  def __init__(self, *, stop_on_nan: bool, describe_last_save: Callable[[], str]):
    self.stop_on_nan, self.describe_last_save = stop_on_nan, describe_last_save
    self.pending: dict[int, Any] = {}
    self.host: dict[int, dict[str, float]] = {}

  def wait_for(self, step: int) -> None:
    """Blocks until step `step` has run (if it is pending), without fetching anything."""
    if step in self.pending:
      jax.block_until_ready(self.pending[step])

  def fetch(self) -> None:
    if not self.pending:
      return
    order = sorted(self.pending)
    fetched = jax.device_get([self.pending[s] for s in order])
    self.pending.clear()
    for step, metrics in zip(order, fetched, strict=True):
      self.host[step] = metrics = {k: float(v) for k, v in metrics.items()}
      if self.stop_on_nan:
        bad = [k for k in ("loss", "grad_norm")
               if k in metrics and not math.isfinite(metrics[k])]
        if bad:
          raise NonFiniteLossError(
              f"train: non-finite {', '.join(f'{k}={metrics[k]}' for k in bad)} at step "
              f"{step} (batch {step - 1}); nothing of this step was saved; last checkpoint: "
              f"{self.describe_last_save()}. Likely causes: a learning rate too high for the "
              "model (LEARNING_RATE; warmup too short), float16/bfloat16 overflow (try "
              "float32), or broken data (empty targets, ids beyond the vocabulary)")

  def metrics_of(self, step: int) -> dict[str, float]:
    if step in self.pending:
      self.fetch()
    return self.host[step]

  def clear(self) -> list[tuple[int, dict[str, float]]]:
    """`(step, host metrics)` of the window in step order (fetching what is pending);
    starts a new window."""
    self.fetch()
    out, self.host = sorted(self.host.items()), {}
    return out


class _StepMetrics(Mapping[str, float]):
  """A step's metrics for `TrainHook.after_step`, fetched from the devices when first read."""

  def __init__(self, window: _Window, step: int):
    self._window, self._step = window, step

  @functools.cached_property
  def _values(self) -> dict[str, float]:
    return self._window.metrics_of(self._step)

  def __getitem__(self, key: str) -> float:
    return self._values[key]

  def __iter__(self) -> Iterator[str]:
    return iter(self._values)

  def __len__(self) -> int:
    return len(self._values)


def _run_steps(*, trainer: Any, state: Any, manager: checkpoints.CheckpointManager,
               loop: LoopInfo, train_source: Any, eval_source: Any, eval_every: int,
               eval_steps: Optional[int], checkpoint_every: int, log_every: int,
               step_rng: jax.Array, stop_on_nan: bool, on_eval: Optional[OnEval],
               hooks: Sequence[TrainHook], last_saved: Optional[int], extra: Mapping[str, Any],
               is_chief: bool, prefetch_batches: int) -> dict[str, float]:
  """The steps of `train` from `loop.start_step`, saving, evaluating and logging.

  The devices never wait for the host: step n + 1 is dispatched while step n runs, its
  metrics stay on the devices, and batches are prepared ahead (`_Prefetcher`). The host waits
  for step n only before it dispatches step n + 2 (`MAX_STEPS_IN_FLIGHT`), and where it needs
  the step's results: a log step (the window's metrics, one transfer), an evaluation or
  checkpoint step (the window is checked for NaN/inf first, so nothing of a non-finite step
  is saved), and a hook that reads its step's metrics.
  """
  writers, train_steps, start = loop.writers, loop.train_steps, loop.start_step
  ckpt_dir = manager.directory
  result: dict[str, float] = {}
  window = _Window(stop_on_nan=stop_on_nan,
                   describe_last_save=lambda: f"{last_saved if last_saved is not None else 'none'}"
                                              f" in {ckpt_dir}")
  # Throughput of the steps since the last log: the time between fetches, less evaluation
  # and checkpoint time; the run's first step (compilation) is kept out.
  window_rows, window_tokens, window_start, paused = 0, {}, 0.0, 0.0  # Tokens by step.
  last_eval_step = None
  preempted = False

  def run_eval(step: int) -> None:
    nonlocal last_eval_step
    window.fetch()
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

  def save(step: int) -> None:
    nonlocal last_saved
    window.fetch()  # Raises before anything of a non-finite step is written.
    manager.save(step, state, extra=extra, force=True)
    last_saved = step

  def off_the_clock(action: Callable[[int], None], step: int) -> None:
    nonlocal paused
    tick = time.perf_counter()
    action(step)
    paused += time.perf_counter() - tick

  place = getattr(trainer, "shard_batch", lambda batch: batch)
  batches = _Prefetcher(train_source.iterate(start) if start < train_steps else iter(()),
                        place, prefetch_batches)
  try:
    for step in range(start, train_steps):
      batch, rows, shape_tokens = next(batches)
      state, metrics = trainer.train_step(state, batch, step_rng)
      del batch
      done = step + 1
      window.pending[done] = metrics
      window.wait_for(done - MAX_STEPS_IN_FLIGHT + 1)
      for hook in hooks:
        hook.after_step(loop, done, state, _StepMetrics(window, done))
      if step == start:
        window.fetch()  # Compilation ends here: the throughput counts from now on.
        window_start, paused = time.perf_counter(), 0.0
      else:
        window_rows += rows
        window_tokens[done] = shape_tokens
      if done % log_every == 0 or done == train_steps:
        fetched = window.clear()
        elapsed = time.perf_counter() - window_start - paused
        means = {k: float(np.mean([m[k] for _, m in fetched if k in m])) for k in fetched[0][1]}
        rates = {}
        if window_tokens and elapsed > 0:
          # The loss fn's `num_tokens` where it reports them, else the target array's size.
          tokens = sum(m["num_tokens"] if "num_tokens" in m else window_tokens[s]
                       for s, m in fetched if s in window_tokens)
          rates = {"steps_per_sec": len(window_tokens) / elapsed,
                   "examples_per_sec": window_rows / elapsed}
          if tokens:
            rates["tokens_per_sec"] = tokens / elapsed
        writers.scalars("train", done, {**means, **rates})
        if is_chief:
          logger.info("%s", _progress_line(trainer, done, train_steps, means, rates))
        result.update({f"train/{k}": v for k, v in means.items()})
        window_rows, window_tokens, window_start, paused = 0, {}, time.perf_counter(), 0.0
      if eval_source is not None and eval_every and done % eval_every == 0:
        off_the_clock(run_eval, done)
      # A signal (one process) or JAX's preemption notice (every process at the same step).
      stop = preemption.requested() and done < train_steps
      if done % checkpoint_every == 0 or done == train_steps:
        off_the_clock(save, done)
      elif stop or manager.reached_preemption(done):
        save(done)
        stop = True
      if stop:
        logger.warning("train: preempted; saved step %d to %s and stopping", done, ckpt_dir)
        preempted = True
        break
  finally:
    batches.close()
  window.fetch()
  final_step = int(jax.device_get(state.step))
  if last_saved != final_step:
    save(final_step)
  if eval_source is not None and last_eval_step != final_step and not preempted:
    run_eval(final_step)
  manager.wait()
  for hook in hooks:
    hook.on_end(loop, state)
  result["step"] = final_step
  return result
