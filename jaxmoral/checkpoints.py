"""Orbax checkpoints: the training-run manager, params-only export, restore onto any mesh.

On-disk layouts (orbax-checkpoint 0.12):

Training run (`CheckpointManager`)::

  <directory>/<step>/state/   the whole state pytree (PyTreeCheckpointHandler, OCDBT/Zarr);
                              e.g. a flax TrainState: step, params, opt_state (static fields
                              such as `apply_fn`/`tx` are not saved; they come from `target`)
  <directory>/<step>/extra/   a JSON dict (reward normalisation, data position, ...)

The state is one item so a save is one atomic step; `restore_params_from_run` reads only the
`params` subtree of it (orbax partial restore driven by the saved metadata), so fine-tuning from
another run does not need to know that run's optimizer.

Exported params (`export_params`)::

  <directory>/params/         the unboxed parameter tree (PyTreeCheckpointHandler)
  <directory>/config.json     optional model config dict (e.g. `T5Config.to_dict()`)

Every restore takes the target shardings from the caller, so a checkpoint written from one mesh
restores onto any other (orbax reads each shard's slice from the stored global arrays).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from typing import Any, Mapping, Optional

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

PyTree = Any
STATE_ITEM = "state"
EXTRA_ITEM = "extra"
PARAMS_DIR = "params"
CONFIG_FILE = "config.json"


def _item_handlers() -> dict[str, Any]:
  return {STATE_ITEM: ocp.PyTreeCheckpointHandler(), EXTRA_ITEM: ocp.JsonCheckpointHandler()}


def _to_json(value: Any, where: str) -> Any:
  """JSON-ready copy of `value` (numpy/jax scalars and arrays become numbers and lists)."""
  if isinstance(value, Mapping):
    out = {}
    for key, item in value.items():
      if not isinstance(key, str):
        raise TypeError(f"extra{where}: JSON keys must be str, got {key!r}")
      out[key] = _to_json(item, f"{where}[{key!r}]")
    return out
  if isinstance(value, (list, tuple)):
    return [_to_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
  if value is None or isinstance(value, (bool, int, float, str)):
    return value
  if isinstance(value, (np.ndarray, np.generic, jax.Array)):
    return np.asarray(value).tolist()
  raise TypeError(f"extra{where}: {type(value).__name__} is not JSON-serialisable")


def _restore_args(target: PyTree) -> PyTree:
  return ocp.checkpoint_utils.construct_restore_args(target)


RUN_CHECKPOINTS_SUBDIR = "checkpoints"


def make_run_dir(model_dir: str | os.PathLike) -> str:
  """Creates a run directory (MODEL_DIR) and returns it.

  Raises:
    ValueError: MODEL_DIR is a URL (gs://, s3://): run files (config, vocabulary, gin config,
      TensorBoard events, pictures) are written with local file operations, so a bucket must
      be mounted as a folder that every host sees (gcsfuse's /gcs/BUCKET on a Cloud TPU VM).
  """
  model_dir = os.fspath(model_dir)
  if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", model_dir):
    raise ValueError(f"MODEL_DIR {model_dir!r}: a run directory is a path, not a URL. Mount "
                     f"the bucket (e.g. gcsfuse at /gcs/BUCKET on a Cloud TPU VM) and give the "
                     f"folder, which every host must see.")
  os.makedirs(model_dir, exist_ok=True)
  return model_dir


def run_checkpoints_dir(model_dir: str | os.PathLike) -> str:
  """The CheckpointManager directory of a run directory (MODEL_DIR/checkpoints)."""
  return os.path.join(os.fspath(model_dir), RUN_CHECKPOINTS_SUBDIR)


@gin.configurable(module="checkpoints")
class CheckpointManager:
  """Saves and restores a training state (any pytree) plus a JSON `extra` dict.

  Args:
    directory: Run directory; step checkpoints go in `<directory>/<step>/`.
    save_interval_steps: `save` writes only when `step % save_interval_steps == 0`, on
      `force`, or when the job is being preempted (orbax's preemption signal).
    max_to_keep: Newest checkpoints kept; older ones are deleted (None keeps all).
    async_save: Write in a background thread (`save` returns once arrays are copied off the
      device); call `wait()` (or `close()`) before reading the files or exiting.
  """

  def __init__(self, directory: str | os.PathLike, *, save_interval_steps: int = 1000,
               max_to_keep: Optional[int] = 3, async_save: bool = True):
    if not isinstance(save_interval_steps, int) or save_interval_steps <= 0:
      raise ValueError(f"CheckpointManager: save_interval_steps must be a positive int, got "
                       f"{save_interval_steps!r}")
    if max_to_keep is not None and (not isinstance(max_to_keep, int) or max_to_keep <= 0):
      raise ValueError(f"CheckpointManager: max_to_keep must be a positive int or None, got "
                       f"{max_to_keep!r}")
    self.directory = os.path.abspath(os.fspath(directory))
    # Explicit policy: orbax's default also saves the first step offered, whatever it is.
    policy = ocp.checkpoint_managers.AnySavePolicy([
        ocp.checkpoint_managers.FixedIntervalPolicy(save_interval_steps),
        ocp.checkpoint_managers.PreemptionCheckpointingPolicy(),
    ])
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, enable_async_checkpointing=async_save,
        save_decision_policy=policy)
    self._manager = ocp.CheckpointManager(self.directory, options=options,
                                          item_handlers=_item_handlers())

  def save(self, step: int, state: PyTree, *, extra: Optional[Mapping[str, Any]] = None,
           force: bool = False) -> bool:
    """Saves `state` (and `extra`) at `step` when the interval (or `force`) says so.

    Args:
      step: Training step (the checkpoint's name).
      state: Any pytree of arrays (unboxed), e.g. a flax TrainState.
      extra: JSON-serialisable dict saved alongside (numpy/jax scalars and arrays allowed).
      force: Save even off the interval.

    Returns:
      True if a checkpoint was (or is being, with async) written; False if skipped
      (off-interval, or `step` already saved).
    """
    step = int(step)
    if step in self._manager.all_steps():
      logging.info("checkpoint step %d already in %s; not saving again", step, self.directory)
      return False
    args = ocp.args.Composite(**{
        STATE_ITEM: ocp.args.PyTreeSave(state),
        EXTRA_ITEM: ocp.args.JsonSave(_to_json(dict(extra or {}), "")),
    })
    return bool(self._manager.save(step, args=args, force=force))

  def latest_step(self) -> Optional[int]:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def reached_preemption(self, step: int) -> bool:
    """True when the job was told to stop (e.g. TPU maintenance): save now and exit."""
    return self._manager.reached_preemption(step)

  def restore(self, step: Optional[int] = None, *, target: PyTree) -> tuple[PyTree, dict]:
    """Restores `(state, extra)`.

    Args:
      step: Step to restore (default: the latest).
      target: Pytree with the saved state's structure whose leaves are
        `jax.ShapeDtypeStruct`s with `.sharding` (or real arrays): values are read straight
        into those shardings and dtypes, so another mesh than the saving one works.
        `ShapeDtypeStruct`s without a sharding come back as numpy arrays.

    Returns:
      The state (structure of `target`, static fields from `target`) and the extra dict.
    """
    step = self._resolve_step(step)
    args = ocp.args.Composite(**{
        STATE_ITEM: ocp.args.PyTreeRestore(target, restore_args=_restore_args(target)),
        EXTRA_ITEM: ocp.args.JsonRestore(),
    })
    try:
      restored = self._manager.restore(step, args=args)
    except (ValueError, KeyError, TypeError) as e:
      raise ValueError(f"{self.directory}/{step}: cannot restore into the given target "
                       f"(structure, shapes or dtypes differ from the saved state): {e}") from e
    return restored[STATE_ITEM], dict(restored[EXTRA_ITEM] or {})

  def state_metadata(self, step: Optional[int] = None) -> PyTree:
    """Saved state tree with `ArrayMetadata` leaves (shape, dtype) at `step` (default latest)."""
    step = self._resolve_step(step)
    metadata = self._manager.item_metadata(step)[STATE_ITEM]
    return getattr(metadata, "tree", metadata)

  def _resolve_step(self, step: Optional[int]) -> int:
    steps = self.all_steps()
    if step is None:
      if not steps:
        raise FileNotFoundError(f"{self.directory}: no checkpoints")
      return steps[-1]
    if int(step) not in steps:
      raise FileNotFoundError(f"{self.directory}: no checkpoint for step {step}; have {steps}")
    return int(step)

  def wait(self) -> None:
    """Blocks until pending async saves are on disk."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.close()

  def __enter__(self) -> "CheckpointManager":
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()


def default_sharding() -> Sharding:
  """Where restored params go without explicit shardings: device 0, or replicated multi-host."""
  if jax.process_count() == 1:
    return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return NamedSharding(Mesh(np.asarray(jax.devices()), ("all",)), PartitionSpec())


def _path_str(path: tuple[Any, ...]) -> str:
  return "/".join(str(getattr(p, "key", getattr(p, "name", getattr(p, "idx", p)))) for p in path)


def _cast_dtype(saved: Any, dtype: Optional[Any]) -> Any:
  saved = np.dtype(saved)
  if dtype is None or not jnp.issubdtype(saved, jnp.floating):
    return saved
  return jnp.dtype(dtype)


def _target_from_metadata(metadata_tree: PyTree, shardings: Any, dtype: Optional[Any],
                          where: str) -> PyTree:
  """`ShapeDtypeStruct` target for saved arrays, with shardings matched by key path."""
  if shardings is None or isinstance(shardings, Sharding):
    by_path = None
  else:
    flat = jax.tree_util.tree_leaves_with_path(
        shardings, is_leaf=lambda x: isinstance(x, Sharding))
    by_path = {_path_str(p): s for p, s in flat}

  def one(path: tuple[Any, ...], meta: Any) -> jax.ShapeDtypeStruct:
    if not hasattr(meta, "shape"):
      raise ValueError(f"{where}: saved leaf {_path_str(path)} is not an array ({meta!r})")
    if by_path is None:
      sharding = shardings or default_sharding()
    else:
      key = _path_str(path)
      if key not in by_path:
        raise ValueError(f"{where}: no sharding given for saved parameter {key}")
      sharding = by_path[key]
    return jax.ShapeDtypeStruct(tuple(meta.shape), _cast_dtype(meta.dtype, dtype),
                                sharding=sharding)

  target = jax.tree_util.tree_map_with_path(one, metadata_tree)
  if by_path is not None:
    extra = set(by_path) - {_path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(target)}
    if extra:
      raise ValueError(f"{where}: shardings given for parameters not in the checkpoint: "
                       f"{sorted(extra)[:5]}")
  return target


@gin.configurable(module="checkpoints")
def export_params(params: PyTree, directory: str | os.PathLike, *, dtype: Optional[Any] = None,
                  config: Optional[Mapping[str, Any]] = None, overwrite: bool = False) -> str:
  """Writes a params-only checkpoint (`<directory>/params`) and `<directory>/config.json`.

  Args:
    params: Parameter tree (boxed or not; boxes are removed).
    directory: Export directory.
    dtype: Cast floating-point leaves to this dtype first (e.g. "bfloat16"); None keeps them.
    config: Model config dict (e.g. `T5Config.to_dict()`), written as config.json.
    overwrite: Replace an existing export; otherwise an existing one is an error.

  Returns:
    The absolute export directory.
  """
  directory = os.path.abspath(os.fspath(directory))
  params_dir = os.path.join(directory, PARAMS_DIR)
  if os.path.exists(params_dir) and not overwrite:
    raise FileExistsError(f"{params_dir} exists; export with --overwrite (overwrite=True) to "
                          "replace it")
  params = nn.meta.unbox(params)
  if dtype is not None:
    target = jnp.dtype(dtype)
    params = jax.tree_util.tree_map(
        lambda x: x.astype(target) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
  ocp.PyTreeCheckpointer().save(params_dir, params, force=overwrite)
  if config is not None and jax.process_index() == 0:
    with open(os.path.join(directory, CONFIG_FILE), "w") as f:
      json.dump(_to_json(dict(config), "(config)"), f, indent=2, sort_keys=True)
  return directory


def load_exported(directory: str | os.PathLike, *, shardings: Any = None,
                  dtype: Optional[Any] = None) -> tuple[PyTree, Optional[dict]]:
  """Loads `export_params` output: `(params, config dict or None)`.

  Args:
    directory: Export directory.
    shardings: Tree of `Sharding`s with the params' structure (e.g.
      `partitioner.sharding_for(boxed_params)`), one `Sharding` for all, or None (device 0;
      replicated on multi-host).
    dtype: Cast floating-point params to this dtype while reading; None keeps the saved one.
  """
  directory = os.path.abspath(os.fspath(directory))
  params_dir = os.path.join(directory, PARAMS_DIR)
  if not os.path.isdir(params_dir):
    raise FileNotFoundError(f"{params_dir}: no exported params (expected export_params output)")
  checkpointer = ocp.PyTreeCheckpointer()
  metadata = checkpointer.metadata(params_dir).item_metadata
  target = _target_from_metadata(getattr(metadata, "tree", metadata), shardings, dtype,
                                 params_dir)
  params = checkpointer.restore(
      params_dir, args=ocp.args.PyTreeRestore(target, restore_args=_restore_args(target)))
  config = None
  config_path = os.path.join(directory, CONFIG_FILE)
  if os.path.exists(config_path):
    with open(config_path) as f:
      try:
        config = json.load(f)
      except json.JSONDecodeError as e:
        raise ValueError(f"{config_path}:{e.lineno}: invalid JSON: {e.msg}") from e
  return params, config


def load_params(directory: str | os.PathLike, *, shardings: Any = None,
                dtype: Optional[Any] = None) -> PyTree:
  """The params of an `export_params` directory (see `load_exported` for the arguments)."""
  return load_exported(directory, shardings=shardings, dtype=dtype)[0]


@contextlib.contextmanager
def _without_read_only_notice():
  """Drops Orbax's 'Given directory is read only' warning: opening a run read-only to load
  its parameters is what we asked for, not something to warn a user about."""
  absl_logger = logging.getLogger("absl")

  def notice_filter(record: logging.LogRecord) -> bool:
    return "Given directory is read only" not in record.getMessage()

  absl_logger.addFilter(notice_filter)
  try:
    yield
  finally:
    absl_logger.removeFilter(notice_filter)


def _run_manager(model_dir: str) -> "ocp.CheckpointManager":
  """A read-only Orbax manager of a run's checkpoint directory."""
  if not os.path.isdir(model_dir):
    raise FileNotFoundError(f"{model_dir}: no such run directory")
  options = ocp.CheckpointManagerOptions(read_only=True, create=False, save_interval_steps=0)
  with _without_read_only_notice():
    return ocp.CheckpointManager(model_dir, options=options, item_handlers=_item_handlers())


def _params_subtree(tree: Any, where: str) -> tuple[str, ...]:
  """Where a saved state keeps the model parameters: `params` (a TrainState), or
  `policy/params` (a PPO state: the tuned policy)."""
  if isinstance(tree, Mapping) and PARAMS_DIR in tree:
    return (PARAMS_DIR,)
  if (isinstance(tree, Mapping) and isinstance(tree.get("policy"), Mapping)
      and PARAMS_DIR in tree["policy"]):
    return ("policy", PARAMS_DIR)
  keys = sorted(tree) if isinstance(tree, Mapping) else type(tree).__name__
  raise ValueError(f"{where}: saved state has no 'params' entry (has {keys})")


def _resolve_run_step(manager: Any, model_dir: str, step: Optional[int]) -> int:
  steps = sorted(manager.all_steps())
  if not steps:
    raise FileNotFoundError(f"{model_dir}: no checkpoints")
  step = steps[-1] if step is None else int(step)
  if step not in steps:
    raise FileNotFoundError(f"{model_dir}: no checkpoint for step {step}; have {steps}")
  return step


def run_params_metadata(model_dir: str | os.PathLike, *, step: Optional[int] = None
                        ) -> tuple[int, tuple[tuple[str, ...], PyTree]]:
  """(step, (where the params sit in the state, their metadata tree)) of a run's checkpoint."""
  model_dir = os.path.abspath(os.fspath(model_dir))
  with _run_manager(model_dir) as manager:
    step = _resolve_run_step(manager, model_dir, step)
    metadata = manager.item_metadata(step)[STATE_ITEM]
  tree = getattr(metadata, "tree", metadata)
  subtree = _params_subtree(tree, f"{model_dir}/{step}/{STATE_ITEM}")
  node = tree
  for key in subtree:
    node = node[key]
  return step, (subtree, node)


def restore_params_from_run(model_dir: str | os.PathLike, *, step: Optional[int] = None,
                            shardings: Any = None, dtype: Optional[Any] = None) -> PyTree:
  """Only the model parameters of a training run's checkpoint (optimizer state is not read).

  A `TrainState` keeps them in `params`; a PPO state in `policy/params` (the tuned policy).

  Args:
    model_dir: The run's checkpoint directory (a `CheckpointManager` directory).
    step: Step to read (default: the latest).
    shardings: As in `load_exported`.
    dtype: As in `load_exported`.

  Returns:
    The parameter tree.
  """
  model_dir = os.path.abspath(os.fspath(model_dir))
  with _run_manager(model_dir) as manager:
    step = _resolve_run_step(manager, model_dir, step)
    metadata = manager.item_metadata(step)[STATE_ITEM]
    tree = getattr(metadata, "tree", metadata)
    where = f"{model_dir}/{step}/{STATE_ITEM}"
    subtree = _params_subtree(tree, where)
    node = tree
    for key in subtree:
      node = node[key]
    target: Any = _target_from_metadata(node, shardings, dtype, where)
    for key in reversed(subtree):
      target = {key: target}
    restored = manager.restore(step, args=ocp.args.Composite(**{
        STATE_ITEM: ocp.args.PyTreeRestore(target, restore_args=_restore_args(target),
                                           partial_restore=True)}))
  out = restored[STATE_ITEM]
  for key in subtree:
    out = out[key]
  return out


def exported_metadata(directory: str | os.PathLike) -> PyTree:
  """The saved parameter tree of an `export_params` directory, `ArrayMetadata` leaves."""
  params_dir = os.path.join(os.path.abspath(os.fspath(directory)), PARAMS_DIR)
  if not os.path.isdir(params_dir):
    raise FileNotFoundError(f"{params_dir}: no exported params (expected export_params output)")
  metadata = ocp.PyTreeCheckpointer().metadata(params_dir).item_metadata
  return getattr(metadata, "tree", metadata)


def restore_subtree(item_dir: str | os.PathLike, prefix: tuple[str, ...], target: PyTree
                    ) -> PyTree:
  """The subtree at `prefix` of an Orbax PyTree checkpoint, read into `target`'s shardings
  and dtypes (a tree of `ShapeDtypeStruct`s); nothing else of the checkpoint is read."""
  wrapped: Any = target
  for key in reversed(prefix):
    wrapped = {key: wrapped}
  restored = ocp.PyTreeCheckpointer().restore(
      os.fspath(item_dir), args=ocp.args.PyTreeRestore(
          wrapped, restore_args=_restore_args(wrapped), partial_restore=True))
  for key in prefix:
    restored = restored[key]
  return restored
