"""Losses shared by every method: token cross entropy (T5X, with z-loss), pairwise and RL pieces.

Pure float32 `jnp` code (jittable, shardable). Cross entropy never builds a one-hot: the target
log-probability is gathered, and label smoothing uses the log-softmax's row sum,
`sum(logits) - vocab * logsumexp(logits)`. A loss declared as terms (`Term`, `TermsLoss`:
ratios `total / count` of parameter-independent counts) combines exactly across microbatches.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Optional

import flax
import gin
import jax
import jax.numpy as jnp

Array = jax.Array
LossFn = Callable[[Any, Mapping[str, Array], Optional[Array]], tuple[Array, dict[str, Array]]]


@jax.custom_vjp
def _gather_last(values: Array, index: Array) -> Array:
  """values[..., index[...]]: (..., V), (...) int -> (...)."""
  return jnp.take_along_axis(values, index[..., None].astype(jnp.int32), axis=-1)[..., 0]


def _gather_last_fwd(values: Array, index: Array) -> tuple[Array, tuple[Array, Array]]:
  # A zero-size array carries the vocabulary size and dtype into the backward pass.
  like = jnp.zeros((0, values.shape[-1]), values.dtype)
  return _gather_last(values, index), (index, like)


def _gather_last_bwd(residuals: tuple[Array, Array], g: Array) -> tuple[Array, None]:
  # The gradient as `g * one_hot(index)`, an elementwise expression that XLA fuses into the
  # softmax gradient beside it. Autodiff's default (a scatter-add into zeros) writes and
  # rereads the whole (B, T, V) gradient once more.
  index, like = residuals
  ids = jax.lax.broadcasted_iota(jnp.int32, (*index.shape, like.shape[-1]), index.ndim)
  hit = ids == index[..., None].astype(jnp.int32)
  return jnp.where(hit, g[..., None], 0).astype(like.dtype), None


_gather_last.defvjp(_gather_last_fwd, _gather_last_bwd)


def _log_softmax_parts(logits: Array, targets: Array) -> tuple[Array, Array, Array]:
  """float32 logits, their logsumexp (B, T) and the target logit (B, T)."""
  logits = logits.astype(jnp.float32)
  log_z = jax.nn.logsumexp(logits, axis=-1)
  return logits, log_z, _gather_last(logits, targets)


def token_logprobs(logits: Array, targets: Array) -> Array:
  """log p(targets[b, t]) under softmax(logits[b, t]): (B, T, V), (B, T) -> (B, T) float32."""
  _, log_z, target_logit = _log_softmax_parts(logits, targets)
  return target_logit - log_z


def cross_entropy_with_logits(logits: Array, targets: Array, *, label_smoothing: float = 0.0,
                              z_loss: float = 0.0) -> tuple[Array, Array]:
  """Per-token T5X cross entropy (smoothed targets) plus z-loss, without a one-hot: `(loss,
  z_loss_term)`, both (...) float32, where `loss` already includes `z_loss_term`.

  With smoothing `s`, the soft target puts `1 - s` on the target and `s / (V - 1)` on every
  other id; the loss is shifted by that distribution's entropy so a perfect model scores 0
  (as in T5X). The z-loss `z_loss * logsumexp(logits)**2` keeps the softmax normaliser near 1.

  Args:
    logits: (..., V) logits, any float dtype.
    targets: (...) int target ids.
    label_smoothing, z_loss: s, in [0, 1), and the z-loss coefficient (>= 0).
  """
  _check_smoothing(label_smoothing, z_loss)
  logits, log_z, target_logit = _log_softmax_parts(logits, targets)
  target_logp = target_logit - log_z
  if label_smoothing > 0.0:
    vocab = logits.shape[-1]
    confidence = 1.0 - label_smoothing
    low = label_smoothing / (vocab - 1)
    sum_logp = jnp.sum(logits, axis=-1) - vocab * log_z
    loss = -(confidence - low) * target_logp - low * sum_logp
    # Entropy of the soft target: the minimum reachable loss, subtracted as T5X does.
    loss = loss + (confidence * math.log(confidence) + (vocab - 1) * low * math.log(low + 1e-20))
  else:
    loss = -target_logp
  z_term = z_loss * jnp.square(log_z)
  return loss + z_term, z_term


def _check_smoothing(label_smoothing: float, z_loss: float, where: str = "") -> None:
  if not 0.0 <= label_smoothing < 1.0:
    raise ValueError(f"{where}label_smoothing must be in [0, 1), got {label_smoothing}")
  if z_loss < 0.0:
    raise ValueError(f"{where}z_loss must be >= 0, got {z_loss}")


def token_nll(logits: Array, targets: Array, weights: Optional[Array], *,
              label_smoothing: float = 0.0, z_loss: float = 0.0) -> tuple[Array, Array, Array]:
  """(loss_sum, weight_sum, z_loss_sum): `cross_entropy_with_logits` summed over tokens.

  `weights` are (B, T) loss weights (0 on padding; None weighs every token 1); `loss_sum`
  includes `z_loss_sum`; all float32 scalars.
  """
  loss, z_term = cross_entropy_with_logits(logits, targets, label_smoothing=label_smoothing,
                                           z_loss=z_loss)
  weights = jnp.ones(targets.shape, jnp.float32) if weights is None else weights.astype(jnp.float32)
  return jnp.sum(loss * weights), jnp.sum(weights), jnp.sum(z_term * weights)


def sequence_logprob(logits: Array, targets: Array, weights: Optional[Array]) -> Array:
  """Sum over time of weighted target log-probs: (B, T, V), (B, T), (B, T) -> (B,) float32."""
  logp = token_logprobs(logits, targets)
  if weights is not None:
    logp = logp * weights.astype(jnp.float32)
  return jnp.sum(logp, axis=-1)


def _safe_divide(num: Array, den: Array) -> Array:
  """num / den, and 0 where den == 0 (with finite gradients there)."""
  safe = jnp.where(den == 0, 1.0, den)
  return jnp.where(den == 0, 0.0, num / safe)


# -- losses declared as terms -------------------------------------------------------------------
WEIGHTINGS = ("tokens", "examples", "sum")


@flax.struct.dataclass
class Term:
  """One quantity of a batch, `total / count`, and how it combines across microbatches.

  Attributes:
    total: float32 scalar, the sum over the batch's tokens or examples (e.g. the summed NLL).
    count: float32 scalar, what `total` is divided by: the batch's weighted tokens or
      examples; 1 for "sum". A count of the batch, independent of the parameters, so the
      trainer takes it as a constant of the gradient.
    weighting: "tokens", "examples" (per-token / per-example means: microbatches combine as
      sum(totals) / sum(counts)) or "sum" (e.g. a fixed-normaliser loss or `num_tokens`:
      sum(totals)).
  """
  total: jax.Array
  count: jax.Array
  weighting: str = flax.struct.field(pytree_node=False, default="tokens")

  @classmethod
  def tokens(cls, total: Array, count: Array) -> Term:
    """A per-token mean."""
    return cls(_f32(total), _f32(count), "tokens")

  @classmethod
  def examples(cls, total: Array, count: Array | int) -> Term:
    """A per-example mean."""
    return cls(_f32(total), _f32(count), "examples")

  @classmethod
  def sum(cls, total: Array) -> Term:
    """A sum that microbatches add up (a fixed-normaliser loss, a count)."""
    return cls(_f32(total), jnp.ones((), jnp.float32), "sum")

  @property
  def value(self) -> Array:
    """The term's value on its batch: total / count (0 for a zero count), or total."""
    return self.total if self.weighting == "sum" else _safe_divide(self.total, self.count)


def _f32(x: Any) -> Array:
  return jnp.asarray(x, jnp.float32)


TermsFn = Callable[[Any, Any, Optional[Array]], Mapping[str, Term]]


def combine_terms(stacked: Mapping[str, Term]) -> dict[str, Term]:
  """Terms with a leading microbatch dim -> the whole batch's terms (totals and counts added;
  a "sum" term keeps count 1)."""
  return {name: Term(jnp.sum(term.total, axis=0),
                     jnp.ones((), jnp.float32) if term.weighting == "sum"
                     else jnp.sum(term.count, axis=0), term.weighting)
          for name, term in stacked.items()}


def weighted_loss(terms: Mapping[str, Term], weights: Mapping[str, float],
                  counts: Optional[Mapping[str, Array]] = None) -> Array:
  """sum_j weights[j] * terms[j].total / count_j, the loss of a `TermsLoss`.

  `counts`: the whole batch's count per term (None: each term's own), for a microbatch's share
  of the batch's loss (`trainer.microbatch_gradients`).
  """
  loss = jnp.zeros((), jnp.float32)
  for name, weight in weights.items():
    term = terms[name]
    count = jax.lax.stop_gradient(term.count if counts is None else counts[name])
    loss = loss + weight * Term(term.total, count, term.weighting).value
  return loss


class TermsLoss:
  """A loss declared as terms: `terms(params, batch, rng) -> {name: Term}` and fixed weights.

  The loss is `sum_j weights[j] * value_j`; every term is also a metric. Called, it gives the
  plain contract `(loss, metrics)` (each term's value and `loss`, the weighted sum, which a
  loss of one term may also name its term), so it works wherever a loss fn does.
  """

  def __init__(self, terms_fn: TermsFn, *, weights: Mapping[str, float], name: str = "loss"):
    """`terms_fn` must return every name in `weights` (non-empty; a weight 0 keeps a term as a
    metric only); `name` is shown in errors."""
    if not weights:
      raise ValueError(f"{name}: a TermsLoss needs at least one weighted term")
    self._terms_fn = terms_fn
    self.weights = {k: float(v) for k, v in weights.items()}
    self.name = name

  def terms(self, params: Any, batch: Mapping[str, Array],
            rng: Optional[Array]) -> dict[str, Term]:
    """The batch's terms (every metric included)."""
    terms = dict(self._terms_fn(params, batch, rng))
    missing = sorted(set(self.weights) - set(terms))
    if missing:
      raise ValueError(f"{self.name}: terms {sorted(terms)} lack weighted term(s) {missing}")
    for key, term in terms.items():
      if not isinstance(term, Term) or term.weighting not in WEIGHTINGS:
        raise TypeError(f"{self.name}: term {key!r} must be a losses.Term with weighting in "
                        f"{WEIGHTINGS}, got {term!r}")
    return terms

  def __call__(self, params: Any, batch: Mapping[str, Array],
               rng: Optional[Array]) -> tuple[Array, dict[str, Array]]:
    return self.loss_and_metrics(self.terms(params, batch, rng))

  def loss_and_metrics(self, terms: Mapping[str, Term]) -> tuple[Array, dict[str, Array]]:
    """(loss, metrics) of a batch's (or combined microbatches') terms."""
    loss = weighted_loss(terms, self.weights)
    return loss, {**{k: t.value for k, t in terms.items()}, "loss": loss}


def terms_of_plain_loss(loss: Array, metrics: Mapping[str, Array], rows: int) -> dict[str, Term]:
  """A plain `(loss, metrics)` loss fn's output as terms (the compatibility mapping).

  With a `num_tokens` metric the loss and every metric are per-token means; without one,
  per-example means over the `rows` of the batch. `num_*` metrics are counts ("sum"). Exact
  for a loss that is a per-token (or per-example) mean and nothing else; declare a
  `TermsLoss` for anything with several kinds of terms.
  """
  if "num_tokens" in metrics:
    count, weighting = _f32(metrics["num_tokens"]), "tokens"
  else:
    count, weighting = jnp.asarray(rows, jnp.float32), "examples"
  count = jax.lax.stop_gradient(count)
  return {name: Term.sum(value) if name.startswith("num_")
          else Term(_f32(value) * count, count, weighting)
          for name, value in {**metrics, "loss": loss}.items()}


_REQUIRED_FEATURES = ("encoder_input_tokens", "decoder_input_tokens", "decoder_target_tokens")


@gin.configurable
def seq2seq_loss_fn(model: Any, *, label_smoothing: float = 0.0, z_loss: float = 1e-4,
                    loss_normalizing_factor: Optional[float] = None) -> TermsLoss:
  """The supervised teacher-forced loss of a T5 on T5X batch features.

  Args:
    model: A `jaxmoral.models.t5.T5`.
    label_smoothing, z_loss: As `cross_entropy_with_logits` takes them (T5X's z-loss 1e-4).
    loss_normalizing_factor: None divides the summed loss by the number of weighted target
      tokens in the batch (per-token mean); a positive number divides it by that constant
      instead (T5X's fixed factor, which keeps microbatches and hosts consistent).

  Returns:
    A `TermsLoss` over batches of `encoder_input_tokens`, `decoder_input_tokens`,
    `decoder_target_tokens`, optional `decoder_loss_weights` (default: targets != 0) and
    optional `encoder_segment_ids` / `decoder_segment_ids` (packed examples); `rng` None runs
    without dropout. Its terms: `loss` (per token, or a sum for a fixed normaliser), the
    per-token `nll` (unsmoothed), `z_loss` and `accuracy` (target logit is the largest), and
    `num_tokens` (the weight sum).
  """
  _check_smoothing(label_smoothing, z_loss, "seq2seq_loss_fn: ")
  if loss_normalizing_factor is not None and not loss_normalizing_factor > 0:
    raise ValueError("seq2seq_loss_fn: loss_normalizing_factor must be None or > 0, got "
                     f"{loss_normalizing_factor}")

  def terms_fn(params: Any, batch: Mapping[str, Array], rng: Optional[Array]) -> dict[str, Term]:
    missing = [name for name in _REQUIRED_FEATURES if name not in batch]
    if missing:
      raise KeyError(f"seq2seq_loss_fn: batch lacks feature(s) {missing}; has {sorted(batch)}")
    targets = batch["decoder_target_tokens"]
    weights = batch.get("decoder_loss_weights")
    weights = (targets > 0 if weights is None else weights).astype(jnp.float32)
    logits = model.apply({"params": params}, batch["encoder_input_tokens"],
                         batch["decoder_input_tokens"], deterministic=rng is None,
                         rngs=None if rng is None else {"dropout": rng},
                         encoder_segment_ids=batch.get("encoder_segment_ids"),
                         decoder_segment_ids=batch.get("decoder_segment_ids"))
    loss_sum, weight_sum, z_sum = token_nll(logits, targets, weights,
                                            label_smoothing=label_smoothing, z_loss=z_loss)
    loss = (Term.tokens(loss_sum, weight_sum) if loss_normalizing_factor is None
            else Term.sum(loss_sum / loss_normalizing_factor))
    nll_sum = -jnp.sum(token_logprobs(logits, targets) * weights)
    # "The target logit is the largest" rather than argmax == target: a max is a vectorised
    # reduction, an argmax over the vocabulary is not (they differ only on exact ties).
    logits32 = jax.lax.stop_gradient(logits.astype(jnp.float32))
    correct = (_gather_last(logits32, targets) >= jnp.max(logits32, axis=-1)).astype(jnp.float32)
    return {
        "loss": loss,
        "nll": Term.tokens(nll_sum, weight_sum),
        "z_loss": Term.tokens(z_sum, weight_sum),
        "accuracy": Term.tokens(jnp.sum(correct * weights), weight_sum),
        "num_tokens": Term.sum(weight_sum),
    }

  return TermsLoss(terms_fn, weights={"loss": 1.0}, name="seq2seq_loss_fn")


def pairwise_logistic(better: Array, worse: Array) -> Array:
  """-log sigmoid(better - worse), elementwise, computed stably as softplus(worse - better)."""
  return jax.nn.softplus(worse.astype(jnp.float32) - better.astype(jnp.float32))


def entropy_from_logits(logits: Array) -> Array:
  """Entropy of softmax(logits) over the last axis, float32: (B, T, V) -> (B, T)."""
  logits = logits.astype(jnp.float32)
  log_z = jax.nn.logsumexp(logits, axis=-1)
  probs = jnp.exp(logits - log_z[..., None])
  return log_z - jnp.sum(probs * logits, axis=-1)


def kl_from_logprobs(logp: Array, logq: Array) -> Array:
  """Per-token KL(p || q) estimator on tokens sampled from p: log p - log q (PPO's penalty)."""
  return logp.astype(jnp.float32) - logq.astype(jnp.float32)


def masked_mean(values: Array, mask: Array, axis: Optional[int | tuple[int, ...]] = None) -> Array:
  """Mean of `values` where `mask` (0/1 or weights) is set; 0 where the mask is empty."""
  mask = mask.astype(jnp.float32)
  return _safe_divide(jnp.sum(values * mask, axis=axis), jnp.sum(mask, axis=axis))


def masked_var(values: Array, mask: Array) -> Array:
  """Population variance of `values` over the masked entries (all axes)."""
  mean = masked_mean(values, mask)
  return masked_mean(jnp.square(values - mean), mask)


def masked_whiten(values: Array, mask: Array, shift_mean: bool = True,
                  eps: float = 1e-8) -> Array:
  """(values - mean) / std over the masked entries; entries outside the mask become 0.

  `mask` is 0/1 of `values`' shape; `shift_mean=False` adds the mean back (scale only), as
  PPO does for rewards; `eps` is added to the variance. Returns float32.
  """
  values = values.astype(jnp.float32)
  mean = masked_mean(values, mask)
  whitened = (values - mean) * jax.lax.rsqrt(masked_var(values, mask) + eps)
  if not shift_mean:
    whitened = whitened + mean
  return jnp.where(mask > 0, whitened, 0.0)
