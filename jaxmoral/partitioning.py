"""Device mesh, logical-axis rules, shardings and multi-host setup (T5X conventions).

Every array in jaxmoral is described by *logical* axis names (`vocab`, `embed`, `mlp`, `heads`,
... for parameters; `batch`, `length`, ... for activations). Rules map each logical name to a
*mesh* axis (`"data"` or `"model"`) or to `None` (replicated). `PjitPartitioner` owns the mesh
and the rules and turns logical descriptions into `NamedSharding`s; the model applies its
activation constraints itself inside `partitioner.context()` (or `partitioner.partition`).

Typical use::

  partitioner = PjitPartitioner(num_partitions=2)
  abstract = jax.eval_shape(init_params_fn, rng)          # boxed (LogicallyPartitioned)
  param_shardings = partitioner.sharding_for(abstract)     # unboxed tree of NamedSharding
  opt_shardings = partitioner.sharding_like(jax.eval_shape(tx.init, params), abstract)
  step = partitioner.partition(step_fn, in_shardings=..., out_shardings=...)
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import math
import os
from typing import Any, Callable, Iterator, Optional, Sequence

import flax.linen as nn
import gin
import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from jaxmoral import software
from jaxmoral import validation

PyTree = Any
LogicalRules = Sequence[tuple[str, Optional[str | tuple[str, ...]]]]

DATA_AXIS = "data"
MODEL_AXIS = "model"

# Logical names that are never sharded (small, or sharded via another axis of the same array).
_REPLICATED_AXES = ("relpos_buckets", "abspos_buckets", "length", "layers", "stack",
                    "mlp_activations")


@gin.configurable(module="partitioning")
def standard_logical_axis_rules(
    *, activation_partitioning_dims: int = 1, parameter_partitioning_dims: int = 1,
    additional_rules: Optional[LogicalRules] = None) -> list[tuple[str, Any]]:
  """T5X's standard logical -> mesh axis rules.

  Rules are tried in order; a rule applies to a dimension only if the dimension is still
  unassigned *and* its mesh axis is not yet used by another dimension of the same array
  (flax's resolution). That is what keeps activations `('batch', 'length', 'embed')`
  sharded over `data` only when parameters' `embed` also maps to `data` (2-D / FSDP).

  parameter_partitioning_dims=2 (FSDP-style): additionally `embed -> data`, so parameters
    (and their optimizer state) are sharded over both axes, e.g. a query kernel
    (embed, joined_kv) -> P('data', 'model').
  activation_partitioning_dims=2: additionally `embed -> model` (before `embed -> data`),
    so activations (batch, length, embed) -> P('data', None, 'model'). For parameters
    `vocab`/`mlp`/`joined_kv` claim `model` first, so `embed` then falls through to `data`
    (when parameter_partitioning_dims=2) or stays replicated.

  Args:
    additional_rules: Extra `(logical_name, mesh_axis_or_None)` pairs, tried before the
      standard rules: `[("vocab", None)]` replicates the embedding, `[("prompt", None)]` names
      a new axis.
  """
  for name, value in (("activation_partitioning_dims", activation_partitioning_dims),
                      ("parameter_partitioning_dims", parameter_partitioning_dims)):
    if value not in (1, 2):
      raise ValueError(f"standard_logical_axis_rules: {name} must be 1 or 2, got {value!r}")
  rules: list[tuple[str, Any]] = [("batch", DATA_AXIS), ("vocab", MODEL_AXIS), ("mlp", MODEL_AXIS),
                                  ("heads", MODEL_AXIS), ("joined_kv", MODEL_AXIS), ("kv", None)]
  if activation_partitioning_dims == 2:
    rules.append(("embed", MODEL_AXIS))
  if parameter_partitioning_dims == 2:
    rules.append(("embed", DATA_AXIS))
  rules.append(("embed", None))
  rules.extend((name, None) for name in _REPLICATED_AXES)
  for i, rule in enumerate(additional_rules or ()):
    if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)):
      raise ValueError(f"standard_logical_axis_rules: additional_rules[{i}] must be a "
                       f"(logical_name, mesh_axis) pair, got {rule!r}")
  return [(r[0], r[1]) for r in additional_rules or ()] + rules


_DEFAULT_DEVICES: list[Optional[list[Any]]] = [None]


@contextlib.contextmanager
def default_devices(devices: Sequence[Any]) -> Iterator[None]:
  """Meshes made inside without explicit devices use `devices` instead of `jax.devices()`.

  How `jaxmoral compile` puts the run's own partitioner, however gin binds it, on a topology's
  compile-only devices; also a way to run a config on some local devices. Not thread-safe.
  """
  saved = _DEFAULT_DEVICES[0]
  _DEFAULT_DEVICES[0] = list(devices)
  try:
    yield
  finally:
    _DEFAULT_DEVICES[0] = saved


@gin.configurable(module="partitioning")
def get_mesh(*, num_partitions: int = 1, model_parallel_submesh: Optional[Sequence[int]] = None,
             devices: Optional[Sequence[Any]] = None, num_slices: int = 1) -> Mesh:
  """A 2-D `Mesh` with axes `("data", "model")`.

  Args:
    num_partitions: Size of the `model` axis (model parallelism). The `data` axis takes the
      remaining devices.
    model_parallel_submesh: T5X-style physical submesh (e.g. `(2, 2, 1, 1)` on TPU) whose
      product is the `model` axis size; overrides `num_partitions` (they must agree when both
      are given). `mesh_utils.create_device_mesh` keeps the model axis on neighbouring chips.
    devices: Devices to use (default `jax.devices()`, or those of `default_devices`).
    num_slices: Number of multi-slice (DCN-connected) slices. The `data` axis spans slices
      and the `model` axis stays within a slice (model parallelism needs the fast links).
  """
  devices = list(_DEFAULT_DEVICES[0] or jax.devices() if devices is None else devices)
  if model_parallel_submesh is not None:
    submesh = tuple(int(x) for x in model_parallel_submesh)
    if not submesh or any(x <= 0 for x in submesh):
      raise ValueError(f"get_mesh: model_parallel_submesh must be positive ints, got {submesh}")
    if num_partitions not in (1, math.prod(submesh)):
      raise ValueError(f"get_mesh: num_partitions={num_partitions} disagrees with "
                       f"model_parallel_submesh={submesh} (product {math.prod(submesh)})")
    num_partitions = math.prod(submesh)
  validation.positive_int(num_partitions, "get_mesh: num_partitions")
  validation.positive_int(num_slices, "get_mesh: num_slices")
  if len(devices) % (num_partitions * num_slices):
    raise ValueError(f"get_mesh: {len(devices)} devices cannot be split into num_slices="
                     f"{num_slices} x num_partitions={num_partitions}")
  data_per_slice = len(devices) // num_slices // num_partitions
  mesh_devices = None
  if num_slices > 1 and all(getattr(d, "slice_index", None) is not None for d in devices):
    mesh_devices = mesh_utils.create_hybrid_device_mesh(
        (data_per_slice, num_partitions), (num_slices, 1), devices)
  elif num_slices == 1 and devices[0].platform != "cpu":
    shape = (data_per_slice, num_partitions)
    try:
      mesh_devices = mesh_utils.create_device_mesh(shape, devices)
    except (ValueError, NotImplementedError, AssertionError):
      # A model axis smaller than a physical axis (4 on an 8x8 slice) needs that axis split;
      # the model axis still lands on neighbouring chips.
      try:
        mesh_devices = mesh_utils.create_device_mesh(shape, devices,
                                                     allow_split_physical_axes=True)
      except (ValueError, NotImplementedError, AssertionError) as e:
        logging.warning("get_mesh: create_device_mesh failed (%s); using device order", e)
  if mesh_devices is None:
    # CPU (or no slice information): keep each slice contiguous so `model` stays inside one.
    order = sorted(devices, key=lambda d: (getattr(d, "slice_index", 0) or 0,
                                           d.process_index, d.id))
    mesh_devices = np.asarray(order, dtype=object).reshape(
        num_slices * data_per_slice, num_partitions)
  return Mesh(mesh_devices, (DATA_AXIS, MODEL_AXIS))


def _is_spec_leaf(x: Any) -> bool:
  return isinstance(x, (PartitionSpec, nn.LogicallyPartitioned)) or x is None


def _normalized_path(path: Sequence[Any]) -> tuple[str, ...]:
  """A key path as strings: dict keys, attribute names and sequence indices alike."""
  return tuple(str(getattr(p, "key", getattr(p, "name", getattr(p, "idx", p)))) for p in path)


def logical_specs_like(tree: PyTree, boxed_params: PyTree) -> PyTree:
  """Logical PartitionSpecs for a tree that mirrors the parameters (e.g. optimizer state).

  Each array leaf of `tree` whose key path ends with a parameter's key path (optax states
  nest copies of the parameter tree: adam `mu`/`nu`, adafactor `v_row`/`v_col`/`v`, masked
  states with `MaskedNode` holes) gets that parameter's logical spec when the shapes are
  equal, and is replicated otherwise (factored statistics, placeholders, counters).

  Args:
    tree: Any pytree of arrays or `jax.ShapeDtypeStruct` (e.g. `jax.eval_shape(tx.init, p)`).
    boxed_params: The boxed (`nn.LogicallyPartitioned`) parameter tree, real or abstract.
  """
  # The longest suffix of a leaf path that names a parameter wins (tried first below).
  by_path: dict[tuple[str, ...], tuple[PartitionSpec, tuple[int, ...]]] = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(
      boxed_params, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned)):
    if isinstance(leaf, nn.LogicallyPartitioned):
      by_path[_normalized_path(path)] = (leaf.get_partition_spec(), tuple(leaf.value.shape))
    elif hasattr(leaf, "shape"):
      by_path[_normalized_path(path)] = (PartitionSpec(), tuple(leaf.shape))

  def spec_of(path: Sequence[Any], leaf: Any) -> PartitionSpec:
    key = _normalized_path(path)
    shape = tuple(getattr(leaf, "shape", ()))
    hit = next((by_path[key[i:]] for i in range(len(key)) if key[i:] in by_path), None)
    return hit[0] if hit is not None and hit[1] == shape else PartitionSpec()

  return jax.tree_util.tree_map_with_path(spec_of, tree)


def _fit_spec(spec: PartitionSpec, shape: Optional[Sequence[int]], mesh: Mesh) -> PartitionSpec:
  """Drops mesh axes that do not divide the dimension they shard (replicates that dim)."""
  if shape is None:
    return spec
  fitted = []
  for dim, axes in zip(shape, list(spec) + [None] * (len(shape) - len(spec)), strict=False):
    names = (axes,) if isinstance(axes, str) else tuple(axes or ())
    fitted.append(axes if dim % math.prod(mesh.shape[n] for n in names) == 0 else None)
  return PartitionSpec(*fitted)


def _batch_spec(ndim: int) -> PartitionSpec:
  return PartitionSpec(DATA_AXIS, *([None] * (ndim - 1)))


def global_batch_from_process_local(batch: PyTree, *, mesh: Mesh) -> PyTree:
  """Global `jax.Array`s, batch dim sharded over `data`, from this process's rows.

  Each process passes the rows it read; on one process this is a plain sharded `device_put`.
  The global arrays' leading dim is the local batch x the process count.
  """
  def one(x: Any) -> jax.Array:
    x = np.asarray(x)
    if x.ndim == 0:
      raise ValueError("global_batch_from_process_local: got a scalar leaf; batch leaves need "
                       "a leading batch dimension")
    return jax.make_array_from_process_local_data(NamedSharding(mesh, _batch_spec(x.ndim)), x)
  return jax.tree_util.tree_map(one, batch)


@gin.configurable(module="partitioning")
class PjitPartitioner:
  """Mesh + logical-axis rules; builds shardings and compiles sharded functions.

  Attributes:
    mesh: `Mesh` with axes ("data", "model").
    rules: The logical -> mesh axis rules in effect.
  """

  def __init__(self, *, num_partitions: int = 1,
               model_parallel_submesh: Optional[Sequence[int]] = None,
               logical_axis_rules: Optional[LogicalRules] = None, num_slices: int = 1,
               devices: Optional[Sequence[Any]] = None):
    self.mesh = get_mesh(num_partitions=num_partitions,
                         model_parallel_submesh=model_parallel_submesh, devices=devices,
                         num_slices=num_slices)
    self.rules = list(standard_logical_axis_rules() if logical_axis_rules is None
                      else [tuple(r) for r in logical_axis_rules])

  def __repr__(self) -> str:
    return f"PjitPartitioner(mesh={dict(self.mesh.shape)})"

  @property
  def num_partitions(self) -> int:
    return self.mesh.shape[MODEL_AXIS]

  @property
  def data_parallel_size(self) -> int:
    return self.mesh.shape[DATA_AXIS]

  @contextlib.contextmanager
  def context(self) -> Iterator[PjitPartitioner]:
    """Mesh and axis rules active: the model's logical constraints apply inside."""
    with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
      yield self

  def logical_to_mesh(self, tree: PyTree, *, shapes: Optional[PyTree] = None) -> PyTree:
    """Mesh `PartitionSpec`s for a tree of boxed params or logical `PartitionSpec`s.

    Mesh axes that do not divide the dimension they would shard are dropped (that dimension
    is replicated), e.g. 6 attention heads on a 4-way `model` axis.

    Args:
      tree: Boxed params (`nn.LogicallyPartitioned`), logical `PartitionSpec`s, or plain
        arrays / `ShapeDtypeStruct`s (replicated).
      shapes: Optional tree with `tree`'s structure whose leaves have `.shape`; gives
        `PartitionSpec` leaves the shape check that boxed leaves get from their value.
    """
    def one(leaf: Any, shape: Optional[Sequence[int]] = None) -> Any:
      if leaf is None:
        return None
      if isinstance(leaf, nn.LogicallyPartitioned):
        names, shape = leaf.names, getattr(leaf.value, "shape", shape)
      elif isinstance(leaf, PartitionSpec):
        names = tuple(leaf)
      elif hasattr(leaf, "shape"):
        return PartitionSpec()
      else:
        raise TypeError(f"logical_to_mesh: unsupported leaf {type(leaf).__name__}; expected a "
                        "boxed param, a PartitionSpec or an array")
      spec = nn.logical_to_mesh_axes(names, self.rules)
      assert spec is not None  # flax gives None only for names=None.
      return _fit_spec(spec, shape, self.mesh)
    if shapes is None:
      return jax.tree_util.tree_map(one, tree, is_leaf=_is_spec_leaf)
    shape_tree = jax.tree_util.tree_map(lambda x: tuple(x.shape), shapes)
    return jax.tree_util.tree_map(one, tree, shape_tree, is_leaf=_is_spec_leaf)

  def sharding_for(self, tree: PyTree, *, shapes: Optional[PyTree] = None) -> PyTree:
    """`NamedSharding`s (one per array: the *unboxed* structure) for `logical_to_mesh`'s trees."""
    specs = self.logical_to_mesh(tree, shapes=shapes)
    return jax.tree_util.tree_map(lambda s: NamedSharding(self.mesh, s), specs,
                                  is_leaf=lambda x: isinstance(x, PartitionSpec))

  def sharding_like(self, tree: PyTree, boxed_params: PyTree) -> PyTree:
    """Shardings for a tree mirroring the params, e.g. `jax.eval_shape(tx.init, params)`: a
    leaf gets its parameter's sharding when the shapes agree, else replicated."""
    return self.sharding_for(logical_specs_like(tree, boxed_params), shapes=tree)

  def data_sharding(self, ndim: int = 2) -> NamedSharding:
    """Batch sharding: leading dim over `data`, the other `ndim - 1` dims replicated."""
    if ndim < 1:
      raise ValueError(f"data_sharding: ndim must be >= 1, got {ndim}")
    return NamedSharding(self.mesh, _batch_spec(ndim))

  @property
  def replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, PartitionSpec())

  def host_local_to_global(self, batch: PyTree) -> PyTree:
    """See `global_batch_from_process_local` (this partitioner's mesh)."""
    return global_batch_from_process_local(batch, mesh=self.mesh)

  def shard_inputs(self, batch: PyTree) -> PyTree:
    """Global `jax.Array`s from a batch every process holds whole (inference inputs).

    Rows are sharded over `data` where their count divides that axis (as a training batch is,
    `host_local_to_global`); a batch that does not divide it (one chat context, a salience
    example, the last short batch of a file) is replicated, so any batch runs on any mesh.
    Scalars are replicated. Each device receives only its own slice.
    """
    def one(x: Any) -> jax.Array:
      x = np.asarray(x)
      spec = _batch_spec(x.ndim) if x.ndim else PartitionSpec()
      sharding = NamedSharding(self.mesh, _fit_spec(spec, x.shape, self.mesh))
      return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
    return jax.tree_util.tree_map(one, batch)

  def partition(self, fn: Callable[..., Any], *, in_shardings: Any, out_shardings: Any,
                donate_argnums: int | Sequence[int] = (),
                static_argnums: int | Sequence[int] = ()) -> PartitionedFunction:
    """`jax.jit` with shardings, as a `PartitionedFunction` (model constraints apply)."""
    jitted = jax.jit(fn, in_shardings=in_shardings, out_shardings=out_shardings,
                     donate_argnums=donate_argnums, static_argnums=static_argnums)
    return PartitionedFunction(jitted, self)


@functools.cache
def _default_inference_partitioner(one_device: bool) -> PjitPartitioner:
  return PjitPartitioner(devices=jax.local_devices()[:1] if one_device else None)


def inference_partitioner(partitioner: Optional[PjitPartitioner] = None) -> PjitPartitioner:
  """The mesh a command that loads a model runs on (eval, infer, export, the methods' models).

  The given partitioner (the run's PARTITIONER, as gin binds it); else one device in a
  one-process job (a model that fits one device runs fastest there, with the decoding
  backend's prepared kernels), or data parallelism over every device of a multi-process job
  (every process takes part in each call). The default is made once per process, so the
  compiled functions cached per partitioner are reused.
  """
  return partitioner or _default_inference_partitioner(jax.process_count() == 1)


class PartitionedFunction:
  """A jitted function that traces, runs and lowers inside its partitioner's `context()`, so
  that the model's sharding constraints apply (without a partitioner: the plain jitted one)."""

  def __init__(self, jitted: Any, partitioner: Optional[PjitPartitioner] = None):
    self._jitted, self._partitioner = jitted, partitioner

  def _context(self) -> Any:
    return self._partitioner.context() if self._partitioner else contextlib.nullcontext()

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    with self._context():
      return self._jitted(*args, **kwargs)

  def lower(self, *args: Any, **kwargs: Any) -> Any:
    with self._context():
      return self._jitted.lower(*args, **kwargs)

  def _cache_size(self) -> int:
    """Executables compiled so far (tests check that repeated calls do not recompile)."""
    return self._jitted._cache_size()  # pylint: disable=protected-access


def jit_in_context(fn: Callable[..., Any],
                   partitioner: Optional[PjitPartitioner] = None) -> PartitionedFunction:
  """`jax.jit(fn)` (shardings follow its inputs as placed), traced and run in `partitioner`'s
  context when one is given."""
  return PartitionedFunction(jax.jit(fn), partitioner)


def _env_int(name: str) -> Optional[int]:
  value = os.environ.get(name)
  if value in (None, ""):
    return None
  try:
    return int(value)
  except ValueError as e:
    raise ValueError(f"initialize_distributed: environment variable {name}={value!r} is not an "
                     "integer") from e


def initialize_distributed(*, coordinator_address: Optional[str] = None,
                           num_processes: Optional[int] = None,
                           process_id: Optional[int] = None) -> bool:
  """Connects the processes of a multi-host job (`jax.distributed.initialize`).

  Values come from the arguments (the CLI's --coordinator_address, --num_processes,
  --process_id), else from JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID. With
  none of them set, a SLURM job with more than one task (SLURM_NTASKS) or a multi-worker Cloud
  TPU (TPU_WORKER_HOSTNAMES) uses JAX's cluster auto-detection.
  One process (or nothing configured) is a no-op returning False. Call before other JAX calls.
  """
  coordinator_address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS") or None
  num_processes = num_processes if num_processes is not None else _env_int("JAX_NUM_PROCESSES")
  process_id = process_id if process_id is not None else _env_int("JAX_PROCESS_ID")
  explicit: dict[str, Any] = {"coordinator_address": coordinator_address,
                              "num_processes": num_processes, "process_id": process_id}
  if any(v is not None for v in explicit.values()):
    if num_processes == 1:
      return False
    missing = [n for n, v in explicit.items() if v is None]
    if missing:
      raise ValueError(f"initialize_distributed: also need {missing} (arguments or "
                       "JAX_COORDINATOR_ADDRESS/JAX_NUM_PROCESSES/JAX_PROCESS_ID)")
    assert process_id is not None and num_processes is not None
    if not 0 <= process_id < num_processes:
      raise ValueError(f"initialize_distributed: process_id={process_id} not in "
                       f"[0, num_processes={num_processes})")
  else:
    slurm_tasks = _env_int("SLURM_NTASKS") if "SLURM_JOB_ID" in os.environ else None
    tpu_hosts = [h for h in os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]
    if (slurm_tasks or 1) <= 1 and len(tpu_hosts) <= 1:
      return False
    explicit = {}  # JAX's cluster auto-detection (SLURM / Cloud TPU).
  jax.distributed.initialize(**explicit)
  # Other software would run other programs (see `check_same_config_on_every_process`).
  refuse_differing_processes(
      software.fingerprint(), "initialize_distributed",
      f"runs other software than process 0 (jaxmoral's sources or "
      f"{', '.join(software.LIBRARIES)}): install the same commit and versions on every host")
  return True


def processes_that_differ(text: str) -> list[int]:
  """The indices of the processes whose `text` differs from process 0's (every process calls
  this with its own; a collective). Empty for one process or when the job was not connected
  by `initialize_distributed`, which it does not start."""
  if not jax.distributed.is_initialized() or jax.process_count() == 1:
    return []
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  digest = np.frombuffer(hashlib.sha256(text.encode()).digest()[:16], dtype=np.int32)
  everywhere = np.asarray(multihost_utils.process_allgather(digest)).reshape(-1, digest.size)
  return [i for i in range(1, len(everywhere)) if not np.array_equal(everywhere[i], everywhere[0])]


def refuse_differing_processes(text: str, where: str, what: str) -> None:
  """Raises `ValueError("{where}: process 1, ... of N {what}")` naming the processes whose
  `text` differs from process 0's (`processes_that_differ`; a collective)."""
  differing = processes_that_differ(text)
  if differing:
    raise ValueError(f"{where}: process {', '.join(map(str, differing))} of "
                     f"{jax.process_count()} {what}")


def check_same_config_on_every_process() -> None:
  """Refuses a multi-process job whose processes parsed different gin configurations.

  Their programs would differ (a learning rate, a step count), and collectives between
  different programs hang or compute nonsense without an error. Compared before relative
  paths are resolved, which may legitimately differ from host to host. A no-op for one process.
  """
  if jax.distributed.is_initialized():
    refuse_differing_processes(
        gin.config_str(), "gin", "parsed another configuration than process 0 (gin files, "
        "bindings or flags): every process of a job must be started with the same ones")
