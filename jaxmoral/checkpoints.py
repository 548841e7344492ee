"""Orbax checkpoints of a training run: `CheckpointManager` saves and restores onto any mesh.

A step's folders: `jaxmoral.run_layout`. The state is one item, so a save is one atomic step. A
restore reads each shard's slice into the caller's shardings, its manifest checked first.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
from typing import Any, Mapping, Optional, Sequence

import gin
import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from jaxmoral import fileio
from jaxmoral import integrity
from jaxmoral import validation

PyTree = Any
STATE_ITEM = "state"
EXTRA_ITEM = "extra"
logger = logging.getLogger(__name__)
# The last step each checkpoint directory committed in this process (saved and manifested,
# or restored): what a run that cannot reach its storage any more can be resumed from.
committed_steps: dict[str, int] = {}


def verify_step(directory: str | os.PathLike, step: int, *, full: bool = True,
                shared: bool = False) -> bool:
  """`integrity.verify_integrity` of a `CheckpointManager` directory's step, which needs its
  state's tree metadata whatever wrote it (Orbax lists a step without, finding no params)."""
  directory, step = os.fspath(directory), int(step)
  allowed = integrity.unverified_steps(directory)
  return integrity.verify_integrity(
      fileio.join(directory, str(step)), what=f"{directory}: checkpoint step {step}",
      full=full, step=step, required=(f"{STATE_ITEM}/_METADATA",), shared=shared,
      unverified_ok=allowed is None or step in allowed)


def resolve_step(directory: str, steps: Sequence[int], step: Optional[int]) -> int:
  """`step` (None: the newest) of a directory's saved `steps`; else a FileNotFoundError."""
  if step is None:
    if not steps:
      raise FileNotFoundError(f"{directory}: no checkpoints")
    return steps[-1]
  if int(step) not in steps:
    raise FileNotFoundError(f"{directory}: no checkpoint for step {step}; have {steps}")
  return int(step)


def to_json(value: Any, where: str) -> Any:
  """JSON-ready copy of `value` (numpy/jax scalars and arrays become numbers and lists)."""
  if isinstance(value, Mapping):
    for key in value:
      if not isinstance(key, str):
        raise TypeError(f"extra{where}: JSON keys must be str, got {key!r}")
    return {key: to_json(item, f"{where}[{key!r}]") for key, item in value.items()}
  if isinstance(value, (list, tuple)):
    return [to_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
  if value is None or isinstance(value, (bool, int, float, str)):
    return value
  if isinstance(value, (np.ndarray, np.generic, jax.Array)):
    return np.asarray(value).tolist()
  raise TypeError(f"extra{where}: {type(value).__name__} is not JSON-serialisable")


# Where Orbax (TensorStore's OCDBT layout) keeps checkpoints: local or mounted folders and
# gs:// (its S3 driver is not wired into OCDBT checkpoints), though `fileio` also does s3://.
ORBAX_SCHEMES = (None, "gs")


def require_checkpoint_storage(location: str | os.PathLike, what: str) -> None:
  """Raises a one-line ValueError, before any work, when Orbax cannot keep checkpoints at
  `location` (`what` names it: "MODEL_DIR", "export --output", ...)."""
  kind = fileio.scheme(location)
  if kind not in ORBAX_SCHEMES:
    raise ValueError(
        f"{what} {os.fspath(location)}: Orbax {ocp.__version__} keeps checkpoints in local or "
        f"mounted folders and on gs:// only, not on {kind}://; put the run or export there (data "
        f"files, Hugging Face folders and reports may stay on {kind}://)")


def path_str(path: tuple[Any, ...]) -> str:
  return jax.tree_util.keystr(path, simple=True, separator="/")


@gin.configurable(module="checkpoints")
class CheckpointManager:
  """Saves and restores a training state (any pytree) plus a JSON `extra` dict.

  Args:
    directory: Step checkpoints go in `<directory>/<step>/`.
    save_interval_steps: `save` writes only when `step % save_interval_steps == 0`, on
      `force`, or when the job is being preempted (orbax's preemption signal).
    max_to_keep: Newest checkpoints kept (None keeps all).
    async_save: `save` returns once arrays are copied off the device; `wait()` (or `close()`)
      before reading the files or exiting.
  """

  def __init__(self, directory: str | os.PathLike, *, save_interval_steps: int = 1000,
               max_to_keep: Optional[int] = 3, async_save: bool = True):
    validation.positive_int(save_interval_steps, "CheckpointManager: save_interval_steps")
    if max_to_keep is not None:
      validation.positive_int(max_to_keep, "CheckpointManager: max_to_keep (or None)")
    require_checkpoint_storage(directory, "checkpoint directory")
    self.directory = fileio.abspath(directory)
    # Explicit policy: orbax's default also saves the first step offered, whatever it is.
    policy = ocp.checkpoint_managers.AnySavePolicy([
        ocp.checkpoint_managers.FixedIntervalPolicy(save_interval_steps),
        ocp.checkpoint_managers.PreemptionCheckpointingPolicy()])
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, save_decision_policy=policy,
                                           enable_async_checkpointing=async_save)
    self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers={
        STATE_ITEM: ocp.PyTreeCheckpointHandler(), EXTRA_ITEM: ocp.JsonCheckpointHandler()})
    # A save's integrity manifest is written once Orbax has finalised the step: in this thread
    # (sync saves) or in `_manifest_thread` (async saves).
    self._manifest_thread: Optional[threading.Thread] = None
    self._recorded = False
    self._pending_step: Optional[int] = None  # The step an async save may still be writing.

  @contextlib.contextmanager
  def _disk_full_is_one_line(self):
    """A full disk (or file size limit) while saving is an OSError naming the folder and the
    last complete step, whatever Orbax's threads wrapped it in; the partial step goes."""
    try:
      yield
    except Exception as error:  # pylint: disable=broad-except
      code = fileio.disk_full_errno(error)
      if code is None:
        raise
      step = self._pending_step
      # Orbax's other writers of that step may still be running (the error came from one of
      # its threads): they stop first, or they would write into the folder removed below.
      with contextlib.suppress(Exception):
        self._manager.wait_until_finished()
      if jax.process_index() == 0 and step is not None:
        for name in os.listdir(self.directory):  # Orbax's temporary folder of that step.
          if name.startswith(f"{step}.orbax-checkpoint-tmp"):
            shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
      complete = [s for s in self.all_steps() if integrity.is_finalised(self.directory, s)]
      raise OSError(code, os.strerror(code), (
          f"{self.directory} (step {step} was not saved; the last complete checkpoint is "
          f"{complete[-1] if complete else 'none'}; free space and run again to resume)")) from None

  def save(self, step: int, state: PyTree, *, extra: Optional[Mapping[str, Any]] = None,
           force: bool = False) -> bool:
    """Saves `state` (any pytree of unboxed arrays) and `extra` (JSON-ready after `to_json`)
    at `step` when the interval (or `force`) says so; returns whether it was (or, async, is
    being) written: False off-interval or for a step already saved."""
    step = int(step)
    if step in self._manager.all_steps():
      logging.info("checkpoint step %d already in %s; not saving again", step, self.directory)
      return False
    args = ocp.args.Composite(**{STATE_ITEM: ocp.args.PyTreeSave(state),
                                 EXTRA_ITEM: ocp.args.JsonSave(to_json(dict(extra or {}), ""))})
    # The previous save's manifest must be on disk before this save may delete old steps.
    self._join_manifest()
    if jax.process_index() == 0 and not self._recorded:
      # Before the step: a reader must never trust its absence.
      integrity.record_checksummed(self.directory)
      self._recorded = True
    with self._disk_full_is_one_line():
      saved = bool(self._manager.save(step, args=args, force=force))
    if saved:
      self._pending_step = step
      if self._manager.is_saving_in_progress():
        self._manifest_thread = threading.Thread(target=self._manifest_after_finalize, args=(step,),
                                                 daemon=True, name=f"jaxmoral-integrity-{step}")
        self._manifest_thread.start()
      else:
        self._write_manifest(step)
    return saved

  def _manifest_after_finalize(self, step: int) -> None:
    try:
      self._manager.wait_until_finished()
    except BaseException:  # pylint: disable=broad-except  (the caller's wait() re-raises it)
      return
    self._write_manifest(step)

  def _write_manifest(self, step: int) -> None:
    """`_INTEGRITY.json` of a finalised step (process 0; the step folder is shared)."""
    if jax.process_index() != 0:
      return
    step_dir = fileio.join(self.directory, str(step))
    try:
      integrity.write_integrity_manifest(step_dir)
      committed_steps[fileio.abspath(self.directory)] = int(step)
    except OSError as e:  # Without it the step is never loaded (see record_checksummed).
      logger.warning("%s: could not write the integrity manifest of step %d (%s); that step "
                     "will not be loaded", self.directory, step, e)

  def _join_manifest(self) -> None:
    thread, self._manifest_thread = self._manifest_thread, None
    if thread is not None:
      thread.join()

  def latest_step(self) -> Optional[int]:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def reached_preemption(self, step: int) -> bool:
    """True when the job was told to stop (e.g. TPU maintenance): save now and exit."""
    return self._manager.reached_preemption(step)

  def restore(self, step: Optional[int] = None, *, target: PyTree) -> tuple[PyTree, dict]:
    """Restores `(state, extra)` of `step` (default: the latest).

    Args:
      target: Pytree with the saved state's structure (static fields come from it) whose
        leaves are `jax.ShapeDtypeStruct`s with `.sharding` (or real arrays): values are read
        straight into those shardings and dtypes, so another mesh than the saving one works;
        `ShapeDtypeStruct`s without a sharding come back as numpy arrays.

    Raises:
      integrity.CheckpointIntegrityError: The step is damaged or incomplete (checked first).
    """
    step = resolve_step(self.directory, self.all_steps(), step)
    self.verify(step, shared=True)  # Every process restores: each hashes its share.
    args = ocp.args.Composite(**{
        STATE_ITEM: ocp.args.PyTreeRestore(
            target, restore_args=ocp.checkpoint_utils.construct_restore_args(target)),
        EXTRA_ITEM: ocp.args.JsonRestore()})
    try:
      restored = self._manager.restore(step, args=args)
    except (ValueError, KeyError, TypeError) as e:
      # Orbax's own text advises `strict=False` (restoring part of the arrays): never the
      # fix for a run of another model; the first differing entry says what differs.
      raise ValueError(f"{self.directory}/{step}: cannot restore into the given target "
                       f"(structure, shapes or dtypes differ from the saved state: "
                       f"{self._first_difference(step, target) or type(e).__name__})") from None
    committed_steps.setdefault(fileio.abspath(self.directory), int(step))
    return restored[STATE_ITEM], dict(restored[EXTRA_ITEM] or {})

  def _first_difference(self, step: int, target: PyTree) -> Optional[str]:
    """The first entry whose shape differs between the saved state and `target`, or that
    only one of them has."""

    def shapes(tree: PyTree) -> dict[str, tuple[int, ...]]:
      return {path_str(p): tuple(getattr(leaf, "shape", ()) or ())
              for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}

    try:
      flat_saved, flat_target = shapes(self.state_metadata(step)), shapes(target)
    except Exception:  # pylint: disable=broad-except
      return None
    for key in sorted(set(flat_saved) | set(flat_target)):
      if key not in flat_target:
        return f"{key} is saved, not in this run's state"
      if key not in flat_saved:
        return f"{key} is not saved"
      if flat_saved[key] != flat_target[key]:
        return f"{key} is {flat_saved[key]} saved, {flat_target[key]} here"
    return None

  def state_metadata(self, step: Optional[int] = None) -> PyTree:
    """Saved state tree with `ArrayMetadata` leaves (shape, dtype) at `step` (default latest)."""
    step = resolve_step(self.directory, self.all_steps(), step)
    self.verify(step, full=False)  # Sizes only: no array is read here.
    metadata = self._manager.item_metadata(step)[STATE_ITEM]
    return getattr(metadata, "tree", metadata)

  def verify(self, step: int, *, full: bool = True, shared: bool = False) -> bool:
    """`verify_step` once this manager's own manifest writer is done (with `shared`, every
    process must call it)."""
    self._join_manifest()
    return verify_step(self.directory, step, full=full, shared=shared)

  def move_aside(self, step: int) -> str:
    """Renames a (damaged) step to `<step>.damaged` (process 0), so it is no step any more:
    its data is kept for a post-mortem and the run can save that step again. Returns the new
    path."""
    self._join_manifest()
    source = fileio.join(self.directory, str(int(step)))
    target, index = f"{source}.damaged", 1
    while fileio.exists(target):
      index += 1
      target = f"{source}.damaged.{index}"
    if jax.process_count() > 1:  # No process may still be checking the step's files.
      multihost_utils.sync_global_devices(f"jaxmoral_move_aside_{step}_start")
    if jax.process_index() == 0:
      fileio.rename(source, target)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"jaxmoral_move_aside_{step}_done")
    self._manager.reload()
    return target

  def wait(self) -> None:
    """Blocks until pending async saves (and their integrity manifests) are on disk; a full
    disk is one OSError (`_disk_full_is_one_line`)."""
    with self._disk_full_is_one_line():
      self._manager.wait_until_finished()
    self._join_manifest()

  def close(self) -> None:
    try:
      self.wait()
    finally:
      self._manager.close()

  def __enter__(self) -> CheckpointManager:
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()

