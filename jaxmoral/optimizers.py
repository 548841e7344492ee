"""Optimizers and learning-rate schedules (optax), as gin-bindable factories.

`make_optimizer`: T5X's default Adafactor, AdamW or SGD with optional global-norm clipping;
`make_schedule`: the schedules the methods use. Steps count updates from 0 (optax's convention).
"""

from __future__ import annotations

import numbers
from typing import Callable, Optional, TypeGuard, Union

import gin
import jax
import jax.numpy as jnp
import optax

from jaxmoral import adafactor

Schedule = Callable[[jnp.ndarray], jnp.ndarray]
LearningRate = Union[float, Schedule]

SCHEDULES = ("constant", "linear_warmup", "rsqrt", "linear_decay", "warmup_linear_decay",
             "warmup_rsqrt")
OPTIMIZERS = ("adafactor", "adamw", "sgd")

# The gin macros that gin/optimizers/*.gin and configs/ bind these arguments to: errors name
# them, since a bad value mostly comes from a flag such as --gin.TRAIN_STEPS=abc.
GIN_MACROS = {"total_steps": "TRAIN_STEPS", "warmup_steps": "WARMUP_STEPS",
              "base_learning_rate": "LEARNING_RATE",
              "learning_rate": "LEARNING_RATE or PPO_LEARNING_RATE"}


def _macro(field: str) -> str:
  """The gin macro that usually sets `field`, as " (MACRO)" for error messages."""
  return f" ({GIN_MACROS[field]})" if field in GIN_MACROS else ""


def _is_int(value: object) -> TypeGuard[int]:
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value: object) -> TypeGuard[float]:
  # A NumPy or JAX scalar array is a number here too; a string (--gin.NAME=abc) is not.
  if isinstance(value, (bool, str, bytes)):
    return False
  return isinstance(value, numbers.Real) or (getattr(value, "shape", None) == ()
                                             and hasattr(value, "__float__"))


def _check(fn: str, field: str, value: object, *, integer: bool = False,
           strict: bool = False) -> None:
  """TypeError unless `value` is a number (an int if `integer`: not 1e4), ValueError unless it
  is >= 0 (> 0 when `strict`; NaN fails), naming the field and its macro."""
  if integer:
    bound = kind = "a positive int" if strict else "an int >= 0"
  else:
    bound = "> 0" if strict else ">= 0"
    kind = f"a number {bound}"
  if not (_is_int(value) if integer else _is_number(value)):
    raise TypeError(f"{fn}: {field} must be {kind}{_macro(field)}, got {value!r}")
  if not (value > 0 if strict else value >= 0):  # type: ignore[operator]  # A number by now.
    raise ValueError(f"{fn}: {field} must be {bound}{_macro(field)}, got {value!r}")


@gin.configurable
def make_schedule(*, name: str = "constant", base_learning_rate: float,
                  warmup_steps: int = 0, total_steps: Optional[int] = None,
                  end_learning_rate: float = 0.0) -> Schedule:
  """A learning-rate schedule `step -> lr` (jittable, float32).

  Args:
    name: One of
      - "constant": `base`.
      - "linear_warmup": `base * min(1, step / warmup_steps)`.
      - "rsqrt": T5X's `base / sqrt(max(step, warmup_steps))` (constant during warm-up; with
        T5X's base 1.0 and 10k warm-up steps this is 0.01 then decays).
      - "linear_decay": `base -> end_learning_rate` linearly over `total_steps`, then constant.
      - "warmup_linear_decay": 0 -> `base` over `warmup_steps`, then linearly to
        `end_learning_rate` at `total_steps`.
      - "warmup_rsqrt": 0 -> `base` over `warmup_steps`, then `base * sqrt(warmup / step)`.
    base_learning_rate: The peak (or constant) learning rate; for "rsqrt" T5X's factor.

  Raises:
    TypeError: A step count or rate of the wrong type; ValueError: an unknown name, or steps
      or rates out of range or inconsistent (naming the field and its gin macro, e.g.
      total_steps and TRAIN_STEPS).
  """
  if name not in SCHEDULES:
    raise ValueError(f"make_schedule: unknown name {name!r}; known: {list(SCHEDULES)}")
  _check("make_schedule", "base_learning_rate", base_learning_rate)
  _check("make_schedule", "end_learning_rate", end_learning_rate)
  # total_steps first: with TRAIN_STEPS=0 and WARMUP_STEPS=0 the run length is what is wrong.
  if total_steps is not None:
    _check("make_schedule", "total_steps", total_steps, integer=True, strict=True)
  _check("make_schedule", "warmup_steps", warmup_steps, integer=True)
  if name in ("linear_decay", "warmup_linear_decay") and total_steps is None:
    raise ValueError(f"make_schedule: {name!r} needs total_steps{_macro('total_steps')}, the "
                     f"step at which the decay ends")
  if name in ("linear_warmup", "warmup_rsqrt", "warmup_linear_decay") and warmup_steps == 0:
    raise ValueError(f"make_schedule: {name!r} needs warmup_steps > 0"
                     f"{_macro('warmup_steps')}, got 0")
  if (name in ("linear_decay", "warmup_linear_decay") and total_steps is not None
      and total_steps <= warmup_steps):
    raise ValueError(f"make_schedule: {name!r} needs total_steps{_macro('total_steps')} > "
                     f"warmup_steps{_macro('warmup_steps')}, got total_steps={total_steps} and "
                     f"warmup_steps={warmup_steps}")
  base = float(base_learning_rate)
  end = float(end_learning_rate)

  def warmup_factor(step):
    return jnp.minimum(1.0, step / warmup_steps)

  def linear(step, start, length):
    frac = jnp.clip((step - start) / length, 0.0, 1.0)
    return base + (end - base) * frac

  def schedule(step):
    step = jnp.asarray(step, jnp.float32)
    if name == "constant":
      lr = jnp.full_like(step, base)
    elif name == "linear_warmup":
      lr = base * warmup_factor(step)
    elif name == "rsqrt":
      lr = base * jnp.reciprocal(jnp.sqrt(jnp.maximum(step, max(warmup_steps, 1))))
    elif name == "linear_decay":
      lr = linear(step, 0, total_steps)
    elif name == "warmup_linear_decay":
      lr = jnp.where(step < warmup_steps, base * warmup_factor(step),
                     linear(step, warmup_steps, total_steps - warmup_steps))
    else:  # warmup_rsqrt
      lr = jnp.where(step < warmup_steps, base * warmup_factor(step),
                     base * jnp.sqrt(warmup_steps / jnp.maximum(step, 1.0)))
    return lr.astype(jnp.float32)

  return schedule


@gin.configurable
def make_optimizer(*, name: str = "adafactor", learning_rate: LearningRate,
                   weight_decay: float = 0.0, grad_clip_norm: Optional[float] = None,
                   b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                   momentum: Optional[float] = None, decay_rate: float = 0.8,
                   clipping_threshold: Optional[float] = 1.0,
                   multiply_by_parameter_scale: bool = True, factored: bool = True,
                   min_dim_size_to_factor: int = 128,
                   group_same_shapes: Optional[bool] = None) -> Optimizer:
  """An optax optimizer (the trainers apply it to the *trainable* parameters only).

  Args:
    name: "adafactor" (T5X's default: factored second moments, update clipping at 1.0,
      decay rate 0.8, updates scaled by the parameter RMS, no momentum), "adamw" or "sgd".
    weight_decay: Decoupled weight decay (AdamW; Adafactor's `weight_decay_rate`). Applied to
      every trainable leaf; SGD ignores it unless > 0, then adds `weight_decay * param`.
    grad_clip_norm: Clip gradients to this global norm first (None: no clipping).
    b1, b2, eps: AdamW's moment decays and epsilon.
    momentum: Adafactor / SGD momentum (None: none, as in T5X).
    decay_rate, clipping_threshold, multiply_by_parameter_scale, factored,
      min_dim_size_to_factor: Adafactor's (see `adafactor.grouped_adafactor`).
    group_same_shapes: Adafactor through `jaxmoral.adafactor.grouped_adafactor` (optax's
      updates, all leaves of one shape at once: a faster GPU train step, bench/RESULTS.md).
      Its state is one stacked array per shape and statistic, replicated over the mesh, so
      checkpoints of the two layouts do not mix. None (default): grouped unless `momentum`
      is set, whose parameter-sized state would then be replicated; False: `optax.adafactor`.

  Raises:
    TypeError: A number of the wrong type; ValueError: unknown name or bad value (naming
      the field).
  """
  if name not in OPTIMIZERS:
    raise ValueError(f"make_optimizer: unknown name {name!r}; known: {list(OPTIMIZERS)}")
  if not callable(learning_rate):  # A schedule is checked by make_schedule.
    _check("make_optimizer", "learning_rate", learning_rate)
  _check("make_optimizer", "weight_decay", weight_decay)
  if grad_clip_norm is not None:
    _check("make_optimizer", "grad_clip_norm", grad_clip_norm, strict=True)
  if group_same_shapes and name != "adafactor":
    raise ValueError(f"make_optimizer: group_same_shapes applies to adafactor, not {name!r}")
  if group_same_shapes is None:
    group_same_shapes = momentum is None
  if name == "adafactor":
    make = adafactor.grouped_adafactor if group_same_shapes else optax.adafactor
    opt = make(learning_rate=learning_rate, min_dim_size_to_factor=min_dim_size_to_factor,
               decay_rate=decay_rate, multiply_by_parameter_scale=multiply_by_parameter_scale,
               clipping_threshold=clipping_threshold, momentum=momentum, factored=factored,
               weight_decay_rate=weight_decay or None)
  elif name == "adamw":
    opt = optax.adamw(learning_rate=learning_rate, b1=b1, b2=b2, eps=eps,
                      weight_decay=weight_decay)
  else:
    opt = optax.sgd(learning_rate=learning_rate, momentum=momentum)
    if weight_decay:
      opt = optax.chain(optax.add_decayed_weights(weight_decay), opt)
  if grad_clip_norm is not None:
    opt = optax.chain(optax.clip_by_global_norm(grad_clip_norm), opt)
  return Optimizer(opt.init, opt.update, learning_rate)


class Optimizer(optax.GradientTransformation):
  """An optax transformation that also tells its learning rate at a step (for TensorBoard)."""
  # A subclass without __slots__, so an instance can hold its schedule beside (init, update).

  def __new__(cls, init, update, learning_rate: LearningRate):
    self = super().__new__(cls, init, update)
    self._learning_rate = learning_rate
    return self

  def learning_rate(self, step: jnp.ndarray) -> jnp.ndarray:
    rate = self._learning_rate
    return jnp.asarray(rate(step) if callable(rate) else rate, jnp.float32)


def global_norm(tree) -> jnp.ndarray:
  """sqrt(sum of squares) over every leaf of a pytree, float32 (the `grad_norm` metric).

  On a CPU each leaf's sum of squares is a dot product of the flattened leaf with itself:
  XLA:CPU runs that as one vectorised pass, where `optax.tree.norm`'s squared-sum reductions
  are rewritten into slower windowed reductions (about 3 % of a T5 1.1-small train step).
  """
  leaves = jax.tree_util.tree_leaves(tree)
  if jax.default_backend() == "cpu":
    # HIGHEST: traced here for a TPU (ahead-of-time), the dot would otherwise be bfloat16.
    squares = [jnp.vdot(leaf.ravel(), leaf.ravel(), precision=jax.lax.Precision.HIGHEST)
               .astype(jnp.float32) for leaf in leaves]
  else:
    # A GPU runs the dot as a TF32 matrix product (inexact); a float32 reduction is exact.
    # Leaves of one shape are stacked and reduced together: one kernel per shape, not per
    # leaf (the same stack `grouped_adafactor` builds, which XLA may share).
    squares = [jnp.sum(jnp.square(jnp.stack([leaves[i] for i in group]).astype(jnp.float32)))
               for group in adafactor.group_by_shape(leaves)]
  return jnp.sqrt(sum(squares)) if squares else jnp.zeros((), jnp.float32)
