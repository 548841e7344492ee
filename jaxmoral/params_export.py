"""Params-only exports (layout: `jaxmoral.run_layout`), and a run checkpoint's parameters.

A run's parameters are read as a partial restore of its state: nothing of its optimizer.
Every load reads into the caller's shardings, its manifest checked before any array is read.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Callable, Mapping, Optional, Sequence

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec
from jax.sharding import Sharding

from jaxmoral import checkpoints
from jaxmoral import fileio
from jaxmoral import integrity
from jaxmoral import run_layout

PyTree = Any
logger = logging.getLogger(__name__)


def default_sharding() -> Sharding:
  """Where restored params go without explicit shardings: device 0, or replicated multi-host."""
  if jax.process_count() == 1:
    return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return NamedSharding(Mesh(np.asarray(jax.devices()), ("all",)), PartitionSpec())


def _saved_tree(item_dir: str) -> PyTree:
  """The saved tree of an Orbax PyTree checkpoint, `ArrayMetadata` leaves."""
  with fileio.reading_orbax_item():
    metadata = ocp.PyTreeCheckpointer().metadata(item_dir).item_metadata
  return getattr(metadata, "tree", metadata)


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
    flat = jax.tree_util.tree_leaves_with_path(shardings, is_leaf=lambda x: isinstance(x, Sharding))
    by_path = {checkpoints.path_str(p): s for p, s in flat}

  def one(path: tuple[Any, ...], meta: Any) -> jax.ShapeDtypeStruct:
    key = checkpoints.path_str(path)
    if not hasattr(meta, "shape"):
      raise ValueError(f"{where}: saved leaf {key} is not an array ({meta!r})")
    if by_path is not None and key not in by_path:
      raise ValueError(f"{where}: no sharding given for saved parameter {key}")
    sharding = by_path[key] if by_path is not None else shardings or default_sharding()
    return jax.ShapeDtypeStruct(tuple(meta.shape), _cast_dtype(meta.dtype, dtype),
                                sharding=sharding)

  target = jax.tree_util.tree_map_with_path(one, metadata_tree)
  if by_path is not None:
    extra = set(by_path) - {checkpoints.path_str(p)
                            for p, _ in jax.tree_util.tree_leaves_with_path(target)}
    if extra:
      raise ValueError(f"{where}: shardings given for parameters not in the checkpoint: "
                       f"{sorted(extra)[:5]}")
  return target


@gin.configurable(module="checkpoints")
def export_params(params: PyTree, directory: str | os.PathLike, *, dtype: Optional[Any] = None,
                  config: Optional[Mapping[str, Any]] = None, overwrite: bool = False,
                  write_extra: Optional[Callable[[str], Sequence[str]]] = None) -> str:
  """Writes a params-only checkpoint (`<directory>/params`) and `<directory>/config.json`;
  returns the absolute export directory.

  Args:
    params: Parameter tree (boxed or not), its floating-point leaves cast to `dtype` first.
    dtype: e.g. "bfloat16"; None keeps the params' dtypes.
    config: Model config dict (e.g. `T5Config.to_dict()`), written as config.json.
    overwrite: Replace an existing export; otherwise an existing one is an error.
    write_extra: Called (process 0) with the directory once the parameters are saved; writes
      further files and returns their names, which the integrity manifest covers too.
  """
  checkpoints.require_checkpoint_storage(directory, "export directory")
  directory = fileio.abspath(directory)
  params_dir = fileio.join(directory, run_layout.EXPORT_PARAMS_DIR)
  if fileio.exists(params_dir) and not overwrite:
    raise FileExistsError(f"{params_dir} exists; export with --overwrite (overwrite=True) to "
                          "replace it")
  params = nn.meta.unbox(params)
  if dtype is not None:
    params = jax.tree_util.tree_map(lambda x: x.astype(_cast_dtype(x.dtype, dtype)), params)
  manifest = fileio.join(directory, integrity.INTEGRITY_FILE)
  if jax.process_index() == 0 and fileio.exists(manifest):
    fileio.remove(manifest)  # The old export's: it would describe files about to be replaced.
  ocp.PyTreeCheckpointer().save(params_dir, params, force=overwrite)
  if jax.process_index() == 0:
    config_path = fileio.join(directory, run_layout.EXPORT_CONFIG_FILE)
    if config is not None:
      with fileio.open(config_path, "w") as f:
        json.dump(checkpoints.to_json(dict(config), "(config)"), f, indent=2, sort_keys=True)
    covered = [run_layout.EXPORT_PARAMS_DIR]
    covered += [run_layout.EXPORT_CONFIG_FILE] if fileio.isfile(config_path) else []
    if write_extra is not None:
      covered += list(write_extra(directory))
    integrity.write_integrity_manifest(directory, covered)
  return directory


def verify_export(directory: str | os.PathLike, *, full: bool | Sequence[str] = True,
                  shared: bool = False) -> bool:
  """`integrity.verify_integrity` of an `export_params` directory."""
  directory = fileio.abspath(directory)
  return integrity.verify_integrity(
      directory, what=f"{directory}: the export", full=full, shared=shared,
      required=(f"{run_layout.EXPORT_PARAMS_DIR}/_METADATA",))


def _exported_params_dir(directory: str | os.PathLike) -> str:
  """`<directory>/params` of an export, refused in one line where there is none."""
  checkpoints.require_checkpoint_storage(directory, "export directory")
  params_dir = fileio.join(fileio.abspath(directory), run_layout.EXPORT_PARAMS_DIR)
  if not fileio.isdir(params_dir):
    raise FileNotFoundError(f"{params_dir}: no exported params (expected export_params output)")
  return params_dir


def load_exported(directory: str | os.PathLike, *, shardings: Any = None,
                  dtype: Optional[Any] = None) -> tuple[PyTree, Optional[dict]]:
  """Loads `export_params` output: `(params, config dict or None)`.

  Args:
    shardings: Tree of `Sharding`s with the params' structure (e.g. `partitioner.sharding_for`
      of them), one `Sharding` for all, or None (`default_sharding`).
    dtype: Cast floating-point params to this dtype while reading; None keeps the saved one.

  Raises:
    integrity.CheckpointIntegrityError: The export is damaged or incomplete (checked first).
  """
  params_dir = _exported_params_dir(directory)
  directory = fileio.abspath(directory)
  verify_export(directory, shared=True)  # Every process loads: each hashes its share.
  params = restore_subtree(params_dir, (), _target_from_metadata(
      _saved_tree(params_dir), shardings, dtype, params_dir))
  config_path = fileio.join(directory, run_layout.EXPORT_CONFIG_FILE)
  return params, fileio.read_json(config_path) if fileio.exists(config_path) else None


def load_params(directory: str | os.PathLike, *, shardings: Any = None,
                dtype: Optional[Any] = None) -> PyTree:
  """The params of an `export_params` directory (see `load_exported` for the arguments)."""
  return load_exported(directory, shardings=shardings, dtype=dtype)[0]


def _params_subtree(tree: Any, where: str) -> tuple[str, ...]:
  """Where a saved state keeps the model parameters (see `restore_params_from_run`)."""
  if isinstance(tree, Mapping) and "params" in tree:
    return ("params",)
  if (isinstance(tree, Mapping) and isinstance(tree.get("policy"), Mapping)
      and "params" in tree["policy"]):
    return ("policy", "params")
  keys = sorted(tree) if isinstance(tree, Mapping) else type(tree).__name__
  raise ValueError(f"{where}: saved state has no 'params' entry (has {keys})")


_warned_skipped: set[tuple[str, int]] = set()


def _warn_skipped_unfinalised(model_dir: str, skipped: Sequence[int], used: int) -> None:
  """Says which newer steps a reader passes over, as a resume does: quietly only while a run
  holds the lock (it is still writing them)."""
  if not skipped or (model_dir, skipped[-1]) in _warned_skipped:
    return
  run_folder = model_dir.rstrip("/").rsplit("/", 1)[0]  # An absolute path, or a URL.
  if fileio.basename(model_dir) == run_layout.CHECKPOINTS_DIR and fileio.exists(
      fileio.join(run_folder, run_layout.LOCK_FILE)):
    return
  _warned_skipped.add((model_dir, skipped[-1]))
  listed = ", ".join(str(s) for s in skipped)
  logger.warning("%s: checkpoint step%s %s %s no %s and no run holds the lock (killed while "
                 "saving?): reading step %d, the newest complete one", model_dir,
                 "s" if len(skipped) > 1 else "", listed, "have" if len(skipped) > 1 else "has",
                 integrity.INTEGRITY_FILE, used)


def _resolve_run_step(model_dir: str, step: Optional[int]) -> int:
  checkpoints.require_checkpoint_storage(model_dir, "run directory")
  if not fileio.isdir(model_dir):
    raise FileNotFoundError(f"{model_dir}: no such run directory")
  steps = integrity.step_folders(model_dir)
  if not steps:
    raise FileNotFoundError(f"{model_dir}: no checkpoints")
  if step is None:  # Not a step a running `train` is still finalising (no manifest yet).
    finalised = [s for s in steps if integrity.is_finalised(model_dir, s)]
    if not finalised:
      return steps[-1]  # verify says why.
    _warn_skipped_unfinalised(model_dir, [s for s in steps if s > finalised[-1]], finalised[-1])
    return finalised[-1]
  return checkpoints.resolve_step(model_dir, steps, step)


def run_params_metadata(model_dir: str | os.PathLike, *, step: Optional[int] = None,
                        full: bool = False) -> tuple[int, tuple[tuple[str, ...], PyTree]]:
  """(step, (where the params sit in the state, their metadata tree)) of a run's checkpoint,
  checked first: sizes, or with `full` digests too (every process hashes its share)."""
  model_dir = fileio.abspath(model_dir)
  step = _resolve_run_step(model_dir, step)
  checkpoints.verify_step(model_dir, step, full=full, shared=full)
  item_dir = fileio.join(model_dir, str(step), checkpoints.STATE_ITEM)
  tree = _saved_tree(item_dir)
  subtree = _params_subtree(tree, item_dir)
  for key in subtree:
    tree = tree[key]
  return step, (subtree, tree)


def restore_params_from_run(model_dir: str | os.PathLike, *, step: Optional[int] = None,
                            shardings: Any = None, dtype: Optional[Any] = None) -> PyTree:
  """Only the model parameters of a training run's checkpoint (optimizer state is not read):
  a `TrainState`'s `params`, a PPO state's `policy/params`.

  Args:
    model_dir: The run's checkpoint directory (a `CheckpointManager` directory).
    step: Step to read (default: the newest complete one).
    shardings, dtype: As in `load_exported`.

  Raises:
    integrity.CheckpointIntegrityError: The step is damaged or incomplete (checked first).
  """
  model_dir = fileio.abspath(model_dir)
  step, (subtree, tree) = run_params_metadata(model_dir, step=step, full=True)
  item_dir = fileio.join(model_dir, str(step), checkpoints.STATE_ITEM)
  return restore_subtree(item_dir, subtree, _target_from_metadata(tree, shardings, dtype, item_dir))


def exported_metadata(directory: str | os.PathLike) -> PyTree:
  """The saved parameter tree of an `export_params` directory, `ArrayMetadata` leaves."""
  params_dir = _exported_params_dir(directory)
  # Sizes of everything; digests of the small files read next (config, vocabulary, settings).
  verify_export(directory, full=[name for name in fileio.listdir(directory)
                                 if name != run_layout.EXPORT_PARAMS_DIR])
  return _saved_tree(params_dir)


def restore_subtree(item_dir: str | os.PathLike, prefix: tuple[str, ...], target: PyTree
                    ) -> PyTree:
  """The subtree at `prefix` of an Orbax PyTree checkpoint, read into `target`'s shardings
  and dtypes (a tree of `ShapeDtypeStruct`s); nothing else of the checkpoint is read."""
  wrapped: Any = target
  for key in reversed(prefix):
    wrapped = {key: wrapped}
  with fileio.reading_orbax_item():
    restored = ocp.PyTreeCheckpointer().restore(
        os.fspath(item_dir), args=ocp.args.PyTreeRestore(
            wrapped, restore_args=ocp.checkpoint_utils.construct_restore_args(wrapped),
            partial_restore=True))
  for key in prefix:
    restored = restored[key]
  return restored
