"""Compiled, sharded train and eval steps built from a loss function.

A `Trainer` builds parameters and optimizer state with their shardings and compiles
`train_step` (one update, state donated) and `eval_step`. Only the parameters of the trainable
mask get gradients and optimizer state (frozen ones are closed over and pass through bit for
bit), and microbatches give the one-batch update exactly for a loss declared as terms
(`losses.TermsLoss`; see `microbatch_gradients`).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax._src import config as jax_config
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from jaxmoral import losses
from jaxmoral import optimizers
from jaxmoral import partitioning
from jaxmoral import validation

PyTree = Any
Params = Mapping[str, Any]
EvalFn = Callable[[Params, Mapping[str, jax.Array]], dict[str, jax.Array]]
MaskSpec = Union[None, str, Sequence[str], Callable[[str, Any], bool], PyTree]


def _path_str(path: Any) -> str:
  return jax.tree_util.keystr(path, simple=True, separator="/")


def param_paths(params: Params) -> list[str]:
  """'/'-joined paths of every leaf, e.g. 'encoder/layers_0/mlp/wo/kernel'."""
  return [_path_str(path) for path, _ in jax.tree_util.tree_leaves_with_path(params)]


def _check_nested_dict(params: Any, where: str = "params") -> None:
  if not isinstance(params, Mapping):
    raise TypeError(f"{where}: expected a nested dict of arrays, got {type(params).__name__}")
  for key, value in params.items():
    if isinstance(value, Mapping):
      _check_nested_dict(value, f"{where}/{key}")


def trainable_mask_from_patterns(params: Params, patterns: Sequence[str]) -> PyTree:
  """A bool tree: True where the '/'-joined path matches any of the regexes (`re.search`),
  e.g. `["^prompt/"]` or `["decoder/layers_1/", "logits_dense"]`.

  Raises:
    ValueError: A pattern is not a valid regex or matches no parameter (likely a typo).
  """
  if isinstance(patterns, str):
    patterns = [patterns]
  compiled = []
  for pattern in patterns:
    try:
      compiled.append(re.compile(pattern))
    except re.error as e:
      raise ValueError(f"trainable_mask_from_patterns: bad regex {pattern!r}: {e}") from e
  params = nn.meta.unbox(params)
  paths = param_paths(params)
  for pattern, regex in zip(patterns, compiled, strict=True):
    if not any(regex.search(p) for p in paths):
      raise ValueError(f"trainable_mask_from_patterns: pattern {pattern!r} matches no "
                       f"parameter; paths look like {paths[:3]}")
  return jax.tree_util.tree_map_with_path(
      lambda path, _: any(r.search(_path_str(path)) for r in compiled), params)


def resolve_trainable_mask(params: Params, mask: MaskSpec) -> PyTree:
  """A bool tree shaped as `params` (boxed or not, real or abstract) from a `mask`: None
  (everything trainable), regexes (`trainable_mask_from_patterns`), a callable
  `(path, leaf) -> bool`, or a bool tree.

  Raises:
    ValueError: The mask leaves nothing trainable or has the wrong structure.
  """
  params = nn.meta.unbox(params)
  if mask is None:
    out = jax.tree_util.tree_map(lambda _: True, params)
  elif isinstance(mask, str) or (isinstance(mask, (list, tuple))
                                 and all(isinstance(m, str) for m in mask)):
    out = trainable_mask_from_patterns(params, mask)
  elif callable(mask):
    out = jax.tree_util.tree_map_with_path(
        lambda path, leaf: bool(mask(_path_str(path), leaf)), params)
  else:
    want = jax.tree_util.tree_structure(params)
    got = jax.tree_util.tree_structure(mask)
    if want != got:  # type: ignore[operator]  # jax's stubs lack PyTreeDef.__ne__.
      raise ValueError(f"trainable_mask: bool tree structure {got} differs from params {want}")
    out = jax.tree_util.tree_map(bool, mask)
  if not any(jax.tree_util.tree_leaves(out)):
    raise ValueError("trainable_mask: no parameter is trainable")
  return out


_DROP = object()


def _prune(tree: Any, keep: Any) -> Any:
  """The sub-dict of `tree` whose mask leaves are True; empty dicts dropped."""
  if not isinstance(tree, Mapping):
    return tree if keep else _DROP
  pruned = ((key, _prune(value, keep[key])) for key, value in tree.items())
  return {k: v for k, v in pruned if v is not _DROP and not (isinstance(v, dict) and not v)}


def split_params(params: Params, mask: PyTree) -> tuple[dict, dict]:
  """(trainable, frozen): two pruned nested dicts that together hold every leaf once."""
  _check_nested_dict(params)
  inverse = jax.tree_util.tree_map(lambda m: not m, mask)
  return _prune(params, mask), _prune(params, inverse)


def merge_params(trainable: Params, frozen: Params) -> dict:
  """Inverse of `split_params`."""
  out = dict(frozen)
  for key, value in trainable.items():
    if key in out and not (isinstance(value, Mapping) and isinstance(out[key], Mapping)):
      raise ValueError(f"merge_params: leaf {key!r} is both trainable and frozen")
    out[key] = merge_params(value, out[key]) if key in out else value
  return out


def _threefry_as_one_gpu_kernel() -> Any:
  """A context lowering threefry to JAX's single CUDA kernel (GPU only; same random bits):
  XLA:GPU compiles the default, unrolled threefry slowly (the initialiser of T5 1.1-large took
  minutes on an H100, seconds with this)."""
  return jax_config.threefry_gpu_kernel_lowering(True)


@flax.struct.dataclass
class TrainState:
  """Everything a training run checkpoints (the data position is `step`, updates applied).

  Attributes:
    step: Number of updates applied (int32 scalar).
    params: The full parameter tree (unboxed arrays), trainable and frozen.
    opt_state: Optimizer state of the trainable parameters only.
  """
  step: jax.Array
  params: PyTree
  opt_state: PyTree


_COUNT, _LOSS_WEIGHT = "count/", "loss_weight/"


def _average_terms(metrics: Sequence[Mapping[str, Any]]) -> dict[str, float]:
  """Eval batches' term values and counts -> the terms of all of them; loss recombined."""
  stacked = {k: np.stack([np.asarray(m[k], np.float64) for m in metrics]) for k in metrics[0]}
  out = {}
  for name, values in stacked.items():
    if name.startswith((_COUNT, _LOSS_WEIGHT)) or (name == "loss"
                                                   and _LOSS_WEIGHT + name not in stacked):
      continue  # Bookkeeping, or the weighted sum (recombined below) rather than a term.
    counts = stacked.get(_COUNT + name)
    if counts is None:  # a "sum" term
      out[name] = float(np.sum(values))
    else:
      total = float(np.sum(counts))
      out[name] = float(np.sum(values * counts)) / total if total else 0.0
  out["loss"] = sum(float(weights[0]) * out[name[len(_LOSS_WEIGHT):]]
                    for name, weights in stacked.items() if name.startswith(_LOSS_WEIGHT))
  return out


def average_metrics(metrics: Sequence[Mapping[str, Any]]) -> dict[str, float]:
  """Combines per-batch (eval) metrics.

  From `Trainer.eval_step` (no `eval_fn`): each term as `train_step` combines microbatches,
  the loss recombined from them. Other metric dicts: counts (`num_*`) summed, the rest
  averaged, weighted by `num_tokens` when reported (padded batches count by their real tokens).
  """
  if not metrics:
    return {}
  if any(k.startswith(_LOSS_WEIGHT) for k in metrics[0]):
    return _average_terms(metrics)
  stacked = {k: jnp.asarray(np.stack([np.asarray(m[k], np.float32) for m in metrics]))
             for k in metrics[0]}
  weights = stacked.get("num_tokens", jnp.ones((len(metrics),), jnp.float32))
  total = jnp.sum(weights)
  return {name: float(jnp.sum(values, axis=0) if name.startswith("num_")
                      else jnp.sum(values * weights.reshape((-1,) + (1,) * (values.ndim - 1)),
                                   axis=0) / jnp.where(total > 0, total, 1.0))
          for name, values in stacked.items()}


def as_terms_loss(loss_fn: Union[losses.LossFn, losses.TermsLoss]) -> losses.TermsLoss:
  """`loss_fn` as a `losses.TermsLoss` (a plain loss fn through `losses.terms_of_plain_loss`)."""
  if isinstance(loss_fn, losses.TermsLoss):
    return loss_fn

  def terms_fn(params: Params, batch: Any, rng: Optional[jax.Array]) -> dict[str, losses.Term]:
    loss, metrics = loss_fn(params, batch, rng)
    rows = jax.tree_util.tree_leaves(batch)[0].shape[0]
    return losses.terms_of_plain_loss(loss, metrics, rows)

  return losses.TermsLoss(terms_fn, weights={"loss": 1.0},
                          name=getattr(loss_fn, "__name__", "loss_fn"))


def microbatch_gradients(terms_fn: losses.TermsFn, weights: Mapping[str, float], params: PyTree,
                         batch: PyTree, rng: Optional[jax.Array], *, num_microbatches: int,
                         mesh: Optional[jax.sharding.Mesh] = None,
                         grad_shardings: Optional[PyTree] = None
                         ) -> tuple[PyTree, dict[str, losses.Term]]:
  """Exact (gradients like `params`, the whole batch's terms) of a terms-declared loss, in
  microbatches.

  With m > 1 `num_microbatches` (rows i, i + m, i + 2m, ... form microbatch i, so each draws
  equally from every data shard), the whole batch's counts are taken first (`terms_fn` on the
  whole batch, of which XLA keeps only the counts), then a `lax.scan` sums the gradients of
  `losses.weighted_loss(microbatch terms, weights, counts=whole batch's)`: the gradient of the
  whole batch's `weighted_loss(terms, weights)`.

  Args:
    terms_fn: `(params, batch, rng) -> {name: losses.Term}`; counts must not depend on params.
    weights: `{term name: loss coefficient}`.
    batch: A pytree whose leaves share a leading batch dim, divisible by `num_microbatches`.
    rng: The step's key (microbatch i uses `fold_in(rng, i)` when m > 1), or None.
    mesh, grad_shardings: If given, microbatch rows are sharded over its data axis, and
      gradients and their accumulator keep these shardings.
  """
  def constrain(grads):
    return (grads if grad_shardings is None
            else jax.lax.with_sharding_constraint(grads, grad_shardings))

  def grads_of(p, mb, key, counts):
    def loss_of(q):
      terms = terms_fn(q, mb, key)
      return losses.weighted_loss(terms, weights, counts), terms
    (_, terms), grads = jax.value_and_grad(loss_of, has_aux=True)(p)
    return constrain(grads), jax.lax.stop_gradient(terms)

  m = num_microbatches
  if m == 1:
    return grads_of(params, batch, rng, None)

  def split(x):
    x = x.reshape((x.shape[0] // m, m) + x.shape[1:])
    x = jnp.swapaxes(x, 0, 1)
    if mesh is None:
      return x
    spec = PartitionSpec(None, partitioning.DATA_AXIS, *([None] * (x.ndim - 2)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

  counts = {name: jax.lax.stop_gradient(term.count)
            for name, term in terms_fn(params, batch, rng).items()}
  micro = jax.tree_util.tree_map(split, batch)

  def body(grad_sum, xs):
    index, mb = xs
    key = None if rng is None else jax.random.fold_in(rng, index)
    grads, terms = grads_of(params, mb, key, counts)
    return constrain(jax.tree_util.tree_map(jnp.add, grad_sum, grads)), terms

  zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
  grads, stacked = jax.lax.scan(body, constrain(zeros), (jnp.arange(m), micro))
  return grads, losses.combine_terms(stacked)


class TrainStateInitializer:
  """Parameters and optimizer state of one model on a mesh: shardings, creation, restore.

  T5X's `TrainStateInitializer`: the supervised `Trainer` owns one, PPO one per model.

  Attributes:
    trainable_mask: Bool tree over the parameters (True: trained).
    params_shardings: `NamedSharding` tree of the parameters.
    state_shardings: `TrainState` of `NamedSharding`s.
  """

  def __init__(self, *, init_params_fn: Callable[[jax.Array], PyTree],
               optimizer: optax.GradientTransformation,
               partitioner: partitioning.PjitPartitioner, trainable_mask: MaskSpec = None):
    """Builds the shardings; nothing is allocated until a state is made.

    Args:
      init_params_fn: `rng -> params`, boxed with logical axes (e.g.
        `functools.partial(t5.init_params, model)`); plain arrays are replicated.
      optimizer: Optax transformation; it only ever sees the trainable parameters.
      trainable_mask: Any mask `resolve_trainable_mask` takes (None: all).
    """
    self.partitioner = partitioner
    self.optimizer = optimizer
    # An abstract key: a concrete one made inside the mesh context would be placed on the
    # mesh's devices, which cannot run anything when they are AOT compile-only TPU devices.
    with partitioner.context():
      boxed = jax.eval_shape(init_params_fn, jax.ShapeDtypeStruct((2,), jnp.uint32))
    abstract_params = nn.meta.unbox(boxed)
    _check_nested_dict(abstract_params)
    self.trainable_mask = resolve_trainable_mask(abstract_params, trainable_mask)
    self.params_shardings = partitioner.sharding_for(boxed)
    abstract_trainable, _ = split_params(abstract_params, self.trainable_mask)
    abstract_opt = jax.eval_shape(optimizer.init, abstract_trainable)
    self.replicated = partitioner.replicated
    self.state_shardings = TrainState(step=self.replicated,  # type: ignore[arg-type]
                                      params=self.params_shardings,
                                      opt_state=partitioner.sharding_like(abstract_opt, boxed))
    self._abstract = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32),  # type: ignore[arg-type]
                                params=abstract_params, opt_state=abstract_opt)
    self._init_jit = partitioner.partition(
        lambda r: self.state_from_params(nn.meta.unbox(init_params_fn(r))),
        in_shardings=(self.replicated,), out_shardings=self.state_shardings)
    self._from_params_jit = partitioner.partition(
        self.state_from_params, in_shardings=(self.params_shardings,),
        out_shardings=self.state_shardings)
    self._init_params_jit = partitioner.partition(
        lambda r: nn.meta.unbox(init_params_fn(r)), in_shardings=(self.replicated,),
        out_shardings=self.params_shardings)

  def init_params(self, rng: jax.Array) -> PyTree:
    """Fresh parameters only (no optimizer state), created on device with their shardings."""
    with _threefry_as_one_gpu_kernel():
      return self._init_params_jit(rng)

  def state_from_params(self, params: PyTree) -> TrainState:
    """A step-0 state around `params` (traceable; optimizer state of the trainable ones)."""
    trainable, _ = split_params(params, self.trainable_mask)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=self.optimizer.init(trainable))

  def init_state(self, rng: jax.Array) -> TrainState:
    """Fresh parameters and optimizer state, created on device with their shardings."""
    with _threefry_as_one_gpu_kernel():
      return self._init_jit(rng)

  def init_state_from_params(self, params: PyTree) -> TrainState:
    """A step-0 state around given (e.g. imported) parameters: a boxed or unboxed tree with
    exactly the model's paths and shapes, host or device arrays (sharded ones are not moved).

    Raises:
      ValueError: A path is missing/unexpected or a shape differs (naming it).
    """
    params = nn.meta.unbox(params)
    want, got = ({_path_str(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)}
                 for tree in (self._abstract.params, params))
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    if missing or extra:
      raise ValueError(f"init_state_from_params: missing params {missing[:5]}, unexpected "
                       f"params {extra[:5]}")
    for path, spec in want.items():
      if tuple(np.shape(got[path])) != tuple(spec.shape):
        raise ValueError(f"init_state_from_params: {path} has shape {np.shape(got[path])}, "
                         f"model expects {spec.shape}")

    def cast(x: Any, spec: jax.ShapeDtypeStruct) -> Any:
      if isinstance(x, jax.Array):
        return x if x.dtype == spec.dtype else x.astype(spec.dtype)
      return np.asarray(x, spec.dtype)  # On the host: device_put sends each device its slice.
    params = jax.tree_util.tree_map(cast, params, self._abstract.params)
    return self._from_params_jit(jax.device_put(params, self.params_shardings))

  def abstract_state(self) -> TrainState:
    """`TrainState` of `ShapeDtypeStruct`s carrying their shardings (restore / AOT compile)."""
    return jax.tree_util.tree_map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        self._abstract, self.state_shardings)

  def num_params(self) -> tuple[int, int]:
    """(all parameters, trainable ones)."""
    sizes = [int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(self._abstract.params)]
    mask = jax.tree_util.tree_leaves(self.trainable_mask)
    return sum(sizes), sum(size for size, m in zip(sizes, mask, strict=True) if m)


class Trainer:
  """Sharded, compiled train/eval steps for one loss function.

  Attributes:
    initializer: The `TrainStateInitializer` (shardings, state creation).
    num_microbatches: Gradient accumulation steps per `train_step`.
    partitioner, trainable_mask, params_shardings, state_shardings: The initializer's.
  """

  def __init__(self, *, init_params_fn: Callable[[jax.Array], PyTree], loss_fn: losses.LossFn,
               optimizer: optax.GradientTransformation,
               partitioner: partitioning.PjitPartitioner, trainable_mask: MaskSpec = None,
               num_microbatches: int = 1, eval_fn: Optional[EvalFn] = None,
               learning_rate_fn: Optional[Callable[[jax.Array], jax.Array]] = None):
    """Builds shardings and the compiled steps (compilation happens on first use).

    Args:
      init_params_fn, optimizer, partitioner, trainable_mask: As `TrainStateInitializer` takes
        them; batches are sharded over "data".
      loss_fn: A `losses.TermsLoss`, or a plain `loss_fn(params, batch, rng) -> (scalar
        loss, dict of scalar metrics)` (`as_terms_loss`); `rng` None means deterministic.
      num_microbatches: Microbatches per global batch, gradients accumulated: the one-batch
        update and metrics (`microbatch_gradients`) with less activation memory.
      eval_fn: `eval_fn(params, batch) -> metrics` for `eval_step`; default: `loss_fn`.
      learning_rate_fn: If given, `metrics["learning_rate"] = learning_rate_fn(step)`.
    """
    validation.positive_int(num_microbatches, "Trainer.num_microbatches")
    self.partitioner = partitioner
    self.num_microbatches = num_microbatches
    self.initializer = TrainStateInitializer(init_params_fn=init_params_fn, optimizer=optimizer,
                                             partitioner=partitioner,
                                             trainable_mask=trainable_mask)
    self._terms_loss = as_terms_loss(loss_fn)
    self._eval_fn = eval_fn
    self._learning_rate_fn = learning_rate_fn
    self.trainable_mask = self.initializer.trainable_mask
    self.params_shardings = self.initializer.params_shardings
    self.state_shardings = self.initializer.state_shardings
    self._trainable_shardings, _ = split_params(self.params_shardings, self.trainable_mask)
    self._replicated = self.initializer.replicated
    self._train_jit = partitioner.partition(
        self._train_fn, in_shardings=(self.state_shardings, None, self._replicated),
        out_shardings=(self.state_shardings, self._replicated), donate_argnums=(0,))
    self._eval_jit = partitioner.partition(
        self._eval_step_fn, in_shardings=(self.state_shardings, None),
        out_shardings=self._replicated)

  def init_state(self, rng: jax.Array) -> TrainState:
    """Fresh parameters and optimizer state, created on device with their shardings."""
    return self.initializer.init_state(rng)

  def init_state_from_params(self, params: PyTree) -> TrainState:
    """A step-0 state around given parameters (`TrainStateInitializer`'s)."""
    return self.initializer.init_state_from_params(params)

  def abstract_state(self) -> TrainState:
    """`TrainState` of `ShapeDtypeStruct`s carrying their shardings (restore / AOT compile)."""
    return self.initializer.abstract_state()

  def _check_batch(self, batch: Mapping[str, Any], *, processes: int = 1) -> None:
    """Clear errors for batches the step cannot take (`processes`: local -> global rows)."""
    if not isinstance(batch, Mapping) or not batch:
      raise ValueError(f"Trainer: a batch must be a non-empty dict of arrays, got "
                       f"{type(batch).__name__}")
    sizes = {k: (v.shape[0] if len(v.shape) else None) for k, v in batch.items()}
    local_size = next(iter(sizes.values()))
    if len(set(sizes.values())) != 1 or local_size is None:
      raise ValueError(f"Trainer: batch features need one common leading batch dim, got {sizes}")
    size = local_size * processes
    data = self.partitioner.mesh.shape[partitioning.DATA_AXIS]
    if size % self.num_microbatches:
      raise ValueError(f"Trainer: global batch size {size} is not divisible by "
                       f"num_microbatches={self.num_microbatches}")
    if size % data:
      raise ValueError(f"Trainer: global batch size {size} is not divisible by the 'data' "
                       f"mesh axis ({data})")

  def shard_batch(self, batch: Mapping[str, Any]) -> dict[str, jax.Array]:
    """Global sharded arrays from this process's rows (one process: the whole batch)."""
    local = {k: np.asarray(v) for k, v in batch.items()}
    self._check_batch(local, processes=jax.process_count())
    return self.partitioner.host_local_to_global(local)

  def _global_batch(self, batch: Mapping[str, Any], check: bool = True) -> dict[str, Any]:
    """Device arrays as they are (checked when `check`), else `shard_batch` of host rows."""
    if not all(isinstance(v, jax.Array) for v in batch.values()):
      return self.shard_batch(batch)
    if check:
      self._check_batch(batch)
    return dict(batch)

  def _train_fn(self, state: TrainState, batch, rng):
    trainable, frozen = split_params(state.params, self.trainable_mask)
    # Gradients keep the parameters' shardings (FSDP included), also inside the microbatch
    # loop, where propagation alone may leave them sharded over the model axis only.
    grads, terms = microbatch_gradients(
        lambda t, b, r: self._terms_loss.terms(merge_params(t, frozen), b, r),
        self._terms_loss.weights, trainable, batch, jax.random.fold_in(rng, state.step),
        num_microbatches=self.num_microbatches, mesh=self.partitioner.mesh,
        grad_shardings=self._trainable_shardings)
    _, metrics = self._terms_loss.loss_and_metrics(terms)
    metrics = {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}
    updates, opt_state = self.initializer.optimizer.update(grads, state.opt_state, trainable)
    trainable = optax.apply_updates(trainable, updates)
    metrics["grad_norm"] = optimizers.global_norm(grads)
    if self._learning_rate_fn is not None:
      metrics["learning_rate"] = jnp.asarray(self._learning_rate_fn(state.step), jnp.float32)
    new_state = dataclasses.replace(state, step=state.step + 1,
                                    params=merge_params(trainable, frozen), opt_state=opt_state)
    return new_state, metrics

  def train_step(self, state: TrainState, batch: Mapping[str, Any],
                 rng: jax.Array) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer update; `state` is donated (do not reuse it).

    Args:
      batch: Global batch (numpy arrays are sharded over "data" here; multi-host callers
        pass `shard_batch(...)` output).
      rng: The run's *base* key; the step's key is `fold_in(rng, state.step)`, so a resumed
        run reproduces dropout exactly.

    Returns:
      (new state, metrics: the loss's + `loss`, `grad_norm`, maybe `learning_rate`).
    """
    return self._train_jit(state, self._global_batch(batch), rng)

  def _eval_step_fn(self, state: TrainState, batch):
    metrics: dict[str, Any]
    if self._eval_fn is not None:
      metrics = dict(self._eval_fn(state.params, batch))
    else:
      terms = self._terms_loss.terms(state.params, batch, None)
      _, metrics = self._terms_loss.loss_and_metrics(terms)
      metrics.update({_COUNT + k: t.count for k, t in terms.items() if t.weighting != "sum"})
      weights: dict[str, Any] = {_LOSS_WEIGHT + k: w for k, w in self._terms_loss.weights.items()}
      metrics.update(weights)
    return {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}

  def eval_step(self, state: TrainState, batch: Mapping[str, Any]) -> dict[str, jax.Array]:
    """Metrics of one batch without dropout (the state is not donated); without an `eval_fn`
    also `count/<term>` and `loss_weight/<term>`, which `average_metrics` combines and drops."""
    return self._eval_jit(state, self._global_batch(batch, check=False))

  @property
  def train_step_function(self) -> Any:
    """The jitted, sharded function `train_step` runs (`jaxmoral compile` lowers it)."""
    return self._train_jit

  def train_step_args(self, batch_shapes: Mapping[str, Any]) -> tuple[Any, Any, Any]:
    """Abstract (state, batch, rng) of `train_step_function`, with their shardings.

    Args:
      batch_shapes: `{feature: ShapeDtypeStruct | (shape, dtype) | shape}` of the global
        batch (a bare shape means int32).
    """
    batch = {}
    for name, spec in batch_shapes.items():
      if isinstance(spec, jax.ShapeDtypeStruct):
        shape, dtype = spec.shape, spec.dtype
      elif (isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[0], (tuple, list))):
        shape, dtype = tuple(spec[0]), spec[1]
      else:
        shape, dtype = tuple(spec), jnp.int32
      batch[name] = jax.ShapeDtypeStruct(shape, dtype,
                                         sharding=self.partitioner.data_sharding(len(shape)))
    self._check_batch(batch)
    rng = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=self._replicated)
    return self.abstract_state(), batch, rng

  def lower_train_step(self, batch_shapes: Mapping[str, Any]) -> Any:
    """Lowers `train_step` from abstract inputs only (no arrays allocated); a
    `jax.stages.Lowered` (`.compile().cost_analysis()` for FLOPs)."""
    return self._train_jit.lower(*self.train_step_args(batch_shapes))
