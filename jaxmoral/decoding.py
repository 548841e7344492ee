"""The one sampler, beam search and scorer every method uses (KV-cached T5 decoding).

Each encodes once, builds the cache with `T5.init_cache` and runs a `jax.lax.while_loop` of
`T5.decode(decode=True)` steps: static shapes, so it compiles once per input shape and nests in
other jitted code. A `DecodeBackend` does a step's hardware-specific work over kernels prepared
once per set of parameters (`prepare_decode_weights`). Flattened (batch * n) rows are
batch-major: row `b * n + i` is sample / beam `i` of input `b`. Reference: docs/core_api.md.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any, Callable, Mapping, Optional, Sequence

import flax
import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np

from jaxmoral import losses
from jaxmoral import partitioning
from jaxmoral import validation
from jaxmoral.backends import cpu_kernels
from jaxmoral.models.ops import DecodeStepOps
from jaxmoral.models.ops import stacked_matmul
from jaxmoral.models.t5 import T5
from jaxmoral.models.t5 import shift_right

Array = jax.Array
Params = Any
# Beam-search scores of impossible hypotheses; finite so that sums never produce NaN.
_NEG = -1.0e9


@flax.struct.dataclass
class DecodeOutput:
  """What `sample` returns.

  Attributes:
    tokens: (batch, num_samples, max_decode_length) int32; EOS included, zeros after it.
    logprobs: Each emitted token's float32 log-prob under the distribution sampled from
      (after blocking, temperature, top-k, top-p); 0 after EOS.
    lengths: (batch, num_samples) int32 emitted tokens including EOS (all without one). The
      mask (not `tokens != 0`: the pad id 0 is an ordinary vocabulary entry a model may emit).
    raw_logprobs: Like `logprobs` under the unmodified model distribution, if asked for.
  """
  tokens: Array
  logprobs: Array
  lengths: Array
  raw_logprobs: Optional[Array] = None

  @property
  def mask(self) -> Array:
    """(batch, num_samples, max_decode_length) float32: 1 on emitted tokens (incl. EOS)."""
    positions = jnp.arange(self.tokens.shape[-1])
    return (positions < self.lengths[..., None]).astype(jnp.float32)


@gin.configurable(module="decoding")
@dataclasses.dataclass(frozen=True, kw_only=True)
class SampleConfig:
  """Static settings of `sample` (hashable: one compiled sampler per config and shape).

  Attributes:
    max_decode_length: Tokens generated at most (EOS included); the cache length.
    num_samples: Continuations per input.
    temperature: Logits are divided by it (> 0).
    top_k: Keep the k most likely tokens (0 = off).
    top_p: Keep the smallest most-likely set with mass >= top_p (1.0 = off; `nucleus_mask`).
    greedy: Take the argmax of the processed distribution instead of sampling.
    no_repeat_ngram_size: Ban tokens completing an n-gram already in that row (0 = off).
    min_length: EOS is banned before this many tokens (0 = off; benchmarks force equal work).
    return_raw_logprobs: Also return log-probs under the unmodified model distribution.
  """
  max_decode_length: int
  num_samples: int = 1
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  greedy: bool = False
  no_repeat_ngram_size: int = 0
  min_length: int = 0
  eos_id: int = 1
  return_raw_logprobs: bool = False

  def __post_init__(self):
    validation.positive_int(self.max_decode_length, "SampleConfig.max_decode_length")
    validation.positive_int(self.num_samples, "SampleConfig.num_samples")
    if not isinstance(self.temperature, (int, float)) or not self.temperature > 0:
      raise ValueError(f"SampleConfig.temperature must be > 0 (use greedy=True for argmax), "
                       f"got {self.temperature!r}")
    validation.non_negative_int(self.top_k, "SampleConfig.top_k")
    if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"SampleConfig.top_p must be in (0, 1], got {self.top_p!r}")
    validation.non_negative_int(self.no_repeat_ngram_size, "SampleConfig.no_repeat_ngram_size")
    if not isinstance(self.min_length, int) or not 0 <= self.min_length <= self.max_decode_length:
      raise ValueError(f"SampleConfig.min_length must be an int in [0, max_decode_length="
                       f"{self.max_decode_length}], got {self.min_length!r}")
    validation.non_negative_int(self.eos_id, "SampleConfig.eos_id")


@gin.configurable(module="decoding")
@dataclasses.dataclass(frozen=True, kw_only=True)
class BeamSearchConfig:
  """Static settings of `beam_search`.

  Attributes:
    beam_size: Hypotheses kept per input (and returned).
    max_decode_length: Tokens generated at most (EOS included).
    length_penalty: alpha of `brevity_penalty` (0 = raw log-likelihood).
  """
  beam_size: int
  max_decode_length: int
  length_penalty: float = 0.6
  eos_id: int = 1

  def __post_init__(self):
    validation.positive_int(self.beam_size, "BeamSearchConfig.beam_size")
    validation.positive_int(self.max_decode_length, "BeamSearchConfig.max_decode_length")
    if not isinstance(self.length_penalty, (int, float)):
      raise ValueError(f"BeamSearchConfig.length_penalty must be a number, "
                       f"got {self.length_penalty!r}")
    validation.non_negative_int(self.eos_id, "BeamSearchConfig.eos_id")


# -- shared pieces ---------------------------------------------------------------------------
def _encode(model: T5, params: Params, encoder_input_tokens: Optional[Array],
            encoder_embeds: Optional[Array], encoder_mask: Optional[Array]
            ) -> tuple[Array, Array]:
  """Encoded states and the (bool) encoder mask, from ids or from embeddings (`T5.encode`
  checks that exactly one is given, and a mask with embeddings)."""
  if encoder_mask is None and encoder_input_tokens is not None:
    encoder_mask = encoder_input_tokens != model.config.pad_token_id
  mask = None if encoder_mask is None else encoder_mask.astype(bool)
  encoded = model.apply({"params": params}, encoder_input_tokens, encoder_embeds=encoder_embeds,
                        encoder_mask=mask, method=T5.encode)
  assert mask is not None  # `T5.encode` raised otherwise.
  return typing.cast(jax.Array, encoded), mask


def _init_cache(model: T5, params: Params, encoded: Array, encoder_mask: Array,
                max_decode_length: int, rows_per_input: int) -> Any:
  _, variables = model.apply({"params": params}, encoded, encoder_mask, max_decode_length,
                             rows_per_input=rows_per_input, method=T5.init_cache,
                             mutable=["cache"])
  return variables["cache"]


def _decode_step(model: T5, params: Params, cache: Any, tokens: Array, encoder_mask: Array,
                 max_decode_length: int, step_ops: DecodeStepOps) -> tuple[Array, Any]:
  """One cached decoder step: (rows,) input ids -> (rows, vocab) float32 logits, new cache."""
  (logits, _), variables = model.apply(
      {"params": params, "cache": cache}, None, encoder_mask, tokens[:, None], decode=True,
      max_decode_length=max_decode_length, step_ops=step_ops, method=T5.decode,
      mutable=["cache"])
  return logits[:, 0, :].astype(jnp.float32), variables["cache"]


# -- backends --------------------------------------------------------------------------------
def kernel_key(path: Sequence[str], names: Sequence[str]) -> str:
  """The name of a prepared kernel: the calling module's path and the kernels it multiplies
  by, e.g. 'decoder/layers_0/self_attention:query,key,value' (see `DecodeStepOps`)."""
  return "/".join(path) + ":" + ",".join(names)


def decoder_step_kernels(params: Mapping[str, Any]) -> dict[str, list[Array]]:
  """Every product of a T5 decoding step: {kernel_key: [kernels, in stacking order]}."""
  decoder = params["decoder"]
  out: dict[str, list[Array]] = {}
  for name, layer in decoder.items():
    if not name.startswith("layers_"):
      continue
    wi = ("wi_0", "wi_1") if "wi_0" in layer["mlp"] else ("wi",)
    for module, projs in (("self_attention", ("query", "key", "value")),
                          ("self_attention", ("out",)), ("encoder_decoder_attention", ("query",)),
                          ("encoder_decoder_attention", ("out",)), ("mlp", wi), ("mlp", ("wo",))):
      # Several kernels: one stacked product of the module; one kernel: its own product.
      path, names = ((module,), projs) if len(projs) > 1 else ((module, projs[0]), ("kernel",))
      out[kernel_key(("decoder", name) + path, names)] = [layer[module][p]["kernel"] for p in projs]
  if "logits_dense" in decoder:
    out[kernel_key(("decoder", "logits_dense"), ("kernel",))] = [decoder["logits_dense"]["kernel"]]
  else:
    out[kernel_key(("token_embedder",), ("attend",))] = [params["token_embedder"]["embedding"].T]
  return out


class DecodeBackend:
  """How cached decoding steps multiply and attend: XLA's ops over stacked kernels.

  Subclasses override `name`, `applies`, `prepare` and `step_ops` and call `register_backend`.
  `automatic`: whether "auto" may pick it (a property where it beats XLA only on some machines).
  """
  name = "xla"
  automatic = True

  def applies(self, model: T5, params: Params) -> bool:
    """Whether this backend can decode `model` with these (concrete) parameters."""
    del model, params
    return True

  def prepare(self, model: T5, params: Params) -> dict[str, Array]:
    """Kernels built once per set of parameters (traceable): here the stacked ones."""
    del model
    return {key: jnp.stack(kernels, axis=1)
            for key, kernels in decoder_step_kernels(params).items() if len(kernels) > 1}

  def step_ops(self, kernels: Mapping[str, Array]) -> DecodeStepOps:
    """The ops the traced steps call, reading `prepare`'s kernels."""
    return _PreparedKernelOps(kernels)


class _PreparedKernelOps(DecodeStepOps):
  """A step's products by a backend's prepared kernels (keyed by `kernel_key`): XLA's over the
  stacks unless a subclass overrides `prepared_products`; other products as `DecodeStepOps`."""

  def __init__(self, kernels: Mapping[str, Array]):
    self._kernels = kernels

  def products(self, path, names, x, kernels, *, preferred_element_type=None):
    prepared = self._kernels.get(kernel_key(path, names))
    if prepared is None:
      return super().products(path, names, x, kernels,
                              preferred_element_type=preferred_element_type)
    return self.prepared_products(x, prepared, [int(k.shape[-1]) for k in kernels])

  def prepared_products(self, x: Array, prepared: Array, widths: Sequence[int]) -> list[Array]:
    """[x @ k for each kernel k (of output width `widths[i]`)] through `prepared`."""
    del widths
    return stacked_matmul(x, prepared.astype(x.dtype))


@flax.struct.dataclass
class DecodeWeights:
  """A backend's (`DecodeBackend` name) prepared {kernel_key: kernel} for one set of params."""
  backend: str = flax.struct.field(pytree_node=False)
  kernels: dict[str, Array]


class PackedKernelBackend(DecodeBackend):
  """"cpu_packed": float32 decoding on one CPU device through `backends.cpu_kernels`: every
  product by a kernel packed into column panels (`packed_matmul`), a step's attention in one
  `decode_attention` call. "auto" picks it only where `cpu_kernels.has_avx512()`; elsewhere it
  is chosen by name (`decoding.prepare_decode_weights.backend = 'cpu_packed'`;
  `bench/bench_generate.py --backend cpu_packed --also_xla_dot` measures both)."""
  name = "cpu_packed"

  @property
  def automatic(self) -> bool:  # type: ignore[override]
    return cpu_kernels.has_avx512()

  def applies(self, model: T5, params: Params) -> bool:
    """Float32 models whose parameters are concrete arrays on one CPU device, where the
    kernels build (`cpu_kernels.available()`; `JAXMORAL_CPU_KERNELS=0` turns them off)."""
    return (model.config.dtype == "float32" and cpu_kernels.enabled()
            and all(isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
                    and [d.platform for d in x.devices()] == ["cpu"]
                    for x in jax.tree.leaves(nn.unbox(params)))
            and cpu_kernels.available())

  def prepare(self, model: T5, params: Params) -> dict[str, Array]:
    del model
    return {key: cpu_kernels.pack_columns(kernels[0] if len(kernels) == 1
                                          else jnp.stack(kernels, axis=1))
            for key, kernels in decoder_step_kernels(params).items()}

  def step_ops(self, kernels: Mapping[str, Array]) -> DecodeStepOps:
    return _PackedKernelOps(kernels)


class _PackedKernelOps(_PreparedKernelOps):
  """A decoding step through `packed_matmul` and `decode_attention` (float32)."""

  def prepared_products(self, x, prepared, widths):
    out = cpu_kernels.packed_matmul(x, prepared, sum(widths))
    return jnp.split(out, np.cumsum(widths)[:-1].tolist(), axis=-1)

  def attention(self, path, query, key, value, bias):
    del path
    return cpu_kernels.decode_attention(query, key, value, bias)


# Later registrations are tried first by "auto".
_BACKENDS: dict[str, DecodeBackend] = {"xla": DecodeBackend(),
                                       "cpu_packed": PackedKernelBackend()}


def register_backend(backend: DecodeBackend) -> None:
  """Makes a backend available by its `name` (later registrations are tried first)."""
  _BACKENDS[backend.name] = backend


def get_backend(name: str) -> DecodeBackend:
  if name not in _BACKENDS:
    raise ValueError(f"decoding: unknown backend {name!r}; registered: {sorted(_BACKENDS)}")
  return _BACKENDS[name]


def choose_backend(model: T5, params: Params, backend: str = "auto") -> str:
  """`backend` if it applies to `params` (else a ValueError), or for "auto" the most recently
  registered automatic backend that applies, else xla."""
  if backend != "auto":
    if not get_backend(backend).applies(model, params):
      raise ValueError(f"decoding: backend {backend!r} does not apply to this model and its "
                       "parameters (see its `applies`); use 'auto' or 'xla'")
    return backend
  return next((name for name, b in reversed(list(_BACKENDS.items()))
               if name != "xla" and b.automatic and b.applies(model, params)), "xla")


def _prepare_impl(model: T5, name: str, params: Params) -> dict[str, Array]:
  return get_backend(name).prepare(model, nn.unbox(params))


@gin.configurable(module="decoding", allowlist=["backend"])
def prepare_decode_weights(model: T5, params: Params, *, backend: str = "auto",
                           partitioner: Any = None) -> Optional[DecodeWeights]:
  """Builds a backend's kernels for `params` (concrete, any sharding) once, for every call.

  Args:
    backend: A registered backend name, or "auto" (see `choose_backend`); gin binds it.
    partitioner: Build under its mesh and rules (sharded parameters).

  Returns:
    The kernels, or None for a model sharded over more than one device with "auto" or "xla":
    each call then stacks XLA's kernels in its trace rather than keep a second weight copy.

  Raises:
    ValueError: An unknown backend, or a named one-device backend on a larger mesh (a
      backend gin names is used or refused, never accepted and ignored).
  """
  if partitioner is not None and partitioner.mesh.size > 1:
    if backend in ("auto", "xla"):
      return None
    get_backend(backend)  # An unknown name is the same error as on one device.
    raise ValueError(f"decoding backend {backend!r} prepares weights on one device; this model "
                     f"is sharded over {partitioner.mesh.size} devices (use 'auto' or 'xla')")
  name = choose_backend(model, params, backend)
  kernels = _jitted(_prepare_impl, model, name, partitioner)(params)
  return DecodeWeights(backend=name, kernels=kernels)


def _step_ops(model: T5, params: Params, decode_weights: Optional[DecodeWeights]
              ) -> DecodeStepOps:
  """Inside a trace: `decode_weights`' step ops, else XLA's over stacks built in the trace
  (hoisted out of the loop)."""
  if decode_weights is None:
    decode_weights = DecodeWeights(backend="xla", kernels=DecodeBackend().prepare(model, params))
  return get_backend(decode_weights.backend).step_ops(decode_weights.kernels)


def first_max_index(x: Array) -> Array:
  """`jnp.argmax(x, axis=-1)` (first index of the maximum) for rows without NaN.

  Written as a max, then the smallest index holding it: two reductions XLA:CPU vectorises,
  where its argmax over a 32k vocabulary is a scalar loop (a visible share of a batch-1
  decoding step). A row containing NaN gives an arbitrary in-range index.
  """
  size = x.shape[-1]
  positions = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
  is_max = x == jnp.max(x, axis=-1, keepdims=True)
  return jnp.minimum(jnp.min(jnp.where(is_max, positions, size), axis=-1), size - 1)


def nucleus_mask(probs: Array, top_p: float) -> Array:
  """Which tokens top-p keeps, (rows, vocab) bool: the smallest most-likely set with mass >=
  `top_p` (in (0, 1); `sample_logits` skips the mask at 1) of the (rows, vocab) non-negative
  float32 `probs` (each row sums to ~1).

  The set a sort would give (keep a token while the mass sorted before it is < `top_p`, ties
  in index order, the most likely always kept), found without one: `jax.lax.top_k` over a
  vocabulary is a full sort, an order of magnitude slower on a CPU (bench/bench_top_p.py).
  The cut-off is the largest t with mass(probs >= t) >= top_p, found by bisection on the
  float32 bits (non-negative floats order as their bit patterns); only where several tokens
  share it, a second bisection over their indices keeps the first ones the mass needs.
  """
  rows, vocab = probs.shape
  probs = probs.astype(jnp.float32)
  bits = jax.lax.bitcast_convert_type(probs, jnp.int32)

  def bisect_cutoff(_, bounds):
    lo, hi = bounds  # mass(probs >= lo) >= top_p; mass(probs >= hi) < top_p.
    mid = lo + (hi - lo) // 2
    mass = jnp.sum(jnp.where(bits >= mid[:, None], probs, 0.0), axis=-1)
    ok = mass >= top_p
    return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

  # 31 halvings take any positive float32 range [0, 2**31) down to one value. Unrolled: in a
  # rolled loop XLA:CPU runs each masked sum as a select, copies and a separate reduction.
  cutoff, _ = jax.lax.fori_loop(
      0, 31, bisect_cutoff,
      (jnp.zeros((rows,), jnp.int32), jnp.max(bits, axis=-1) + 1), unroll=True)
  above = bits > cutoff[:, None]
  tied = bits == cutoff[:, None]

  def keep_first_ties() -> Array:
    """Index limit per row: the first ties (by index) needed to reach `top_p`."""
    mass_above = jnp.sum(jnp.where(above, probs, 0.0), axis=-1)
    cutoff_prob = jax.lax.bitcast_convert_type(cutoff, jnp.float32)
    positions = jax.lax.broadcasted_iota(jnp.int32, probs.shape, 1)

    def bisect_limit(_, bounds):
      lo, hi = bounds  # Ties below index lo are too few; below hi, enough (vocab + 1: none).
      mid = lo + (hi - lo) // 2
      count = jnp.sum((tied & (positions < mid[:, None])).astype(jnp.int32), axis=-1)
      ok = mass_above + count.astype(jnp.float32) * cutoff_prob >= top_p
      return jnp.where(ok, lo, mid), jnp.where(ok, mid, hi)

    _, limit = jax.lax.fori_loop(
        0, vocab.bit_length(), bisect_limit,  # Halves the vocab + 1 candidate limits.
        (jnp.zeros((rows,), jnp.int32), jnp.full((rows,), vocab + 1, jnp.int32)),
        unroll=True)
    return tied & (positions < limit[:, None])

  several_tied = jnp.any(jnp.sum(tied.astype(jnp.int32), axis=-1) > 1)
  return above | jax.lax.cond(several_tied, keep_first_ties, lambda: tied)


def sample_logits(rng: Array, logits: Array, *, temperature: float = 1.0, top_k: int = 0,
                  top_p: float = 1.0, greedy: bool = False) -> tuple[Array, Array]:
  """Draws one token per row from processed logits; the per-step core of `sample`: (tokens
  (rows,) int32, their float32 log-probs under the processed distribution).

  Banned tokens should already be -inf in the (rows, vocab) `logits`. Temperature comes first,
  then top-k (exactly k kept), then top-p (on the sorted top-k survivors, or `nucleus_mask`
  over the vocabulary); `rng` is unused when greedy; see `SampleConfig` for the settings.
  """
  vocab = logits.shape[-1]
  scaled = logits.astype(jnp.float32)
  if temperature != 1.0:
    scaled = scaled / temperature
  candidates, candidate_ids = scaled, None
  if top_k > 0:
    # Sorted survivors: top-p below needs the order anyway, and k is small.
    candidates, candidate_ids = jax.lax.top_k(scaled, min(top_k, vocab))
    if top_p < 1.0:
      probs = jax.nn.softmax(candidates, axis=-1)
      mass_before = jnp.cumsum(probs, axis=-1) - probs
      # Keep a token while the mass of the more likely ones is < p; the first always stays.
      keep = (mass_before < top_p) | (jnp.arange(candidates.shape[-1]) == 0)
      candidates = jnp.where(keep, candidates, -jnp.inf)
  elif top_p < 1.0:
    keep = nucleus_mask(jax.nn.softmax(scaled, axis=-1), top_p)
    candidates = jnp.where(keep, scaled, -jnp.inf)
  logprobs = jax.nn.log_softmax(candidates, axis=-1)
  # Unless greedy, Gumbel-max: exactly as `jax.random.categorical` draws, vectorised argmax.
  choice = first_max_index(candidates if greedy
                           else candidates + jax.random.gumbel(rng, candidates.shape))
  chosen_logprob = jnp.take_along_axis(logprobs, choice[:, None], axis=-1)[:, 0]
  if candidate_ids is not None:
    choice = jnp.take_along_axis(candidate_ids, choice[:, None], axis=-1)[:, 0]
  return choice.astype(jnp.int32), chosen_logprob


def ngram_ban_mask(generated: Array, step: Array, *, ngram_size: int, vocab_size: int) -> Array:
  """(rows, vocab) bool: tokens that would complete an n-gram already in `generated[:, :step]`.

  `step` (tokens generated so far) may be traced; n = 1 bans every token generated before.
  """
  rows, length = generated.shape
  n = ngram_size
  if n > length:
    return jnp.zeros((rows, vocab_size), bool)
  starts = length - n + 1  # Candidate n-gram start positions j: tokens j .. j+n-1.
  j = jnp.arange(starts)
  # An n-gram at j is complete iff its last token j+n-1 < step.
  valid = (j[None, :] + n - 1 < step)
  if n > 1:
    # The n-1 most recent tokens, generated[step-n+1 : step] (clamped; unused when step < n-1).
    prefix = jax.lax.dynamic_slice_in_dim(generated, jnp.maximum(step - n + 1, 0), n - 1, axis=1)
    windows = jnp.stack([generated[:, m:m + starts] for m in range(n - 1)], axis=-1)
    valid &= jnp.all(windows == prefix[:, None, :], axis=-1) & (step >= n - 1)
  next_tokens = generated[:, n - 1:n - 1 + starts]
  row_ids = jnp.broadcast_to(jnp.arange(rows)[:, None], next_tokens.shape)
  hits = jnp.zeros((rows, vocab_size), jnp.int32).at[row_ids, next_tokens].add(
      valid.astype(jnp.int32))
  return hits > 0


# -- sampling --------------------------------------------------------------------------------
# Incremented on every trace of the decoders (tests check that repeated calls do not retrace).
_TRACE_COUNT = {"sample": 0, "beam_search": 0}


def _sample_impl(model: T5, config: SampleConfig, params: Params,
                 encoder_input_tokens: Optional[Array] = None,
                 encoder_embeds: Optional[Array] = None, encoder_mask: Optional[Array] = None,
                 rng: Optional[Array] = None,
                 decode_weights: Optional[DecodeWeights] = None) -> DecodeOutput:
  _TRACE_COUNT["sample"] += 1
  params = nn.unbox(params)
  step_ops = _step_ops(model, params, decode_weights)
  if rng is None:
    if not config.greedy:
      raise ValueError("sample: rng is required unless greedy=True")
    rng = jax.random.PRNGKey(0)
  encoded, mask = _encode(model, params, encoder_input_tokens, encoder_embeds, encoder_mask)
  batch, n, length = encoded.shape[0], config.num_samples, config.max_decode_length
  rows, vocab = batch * n, model.config.vocab_size
  # The first step reads the start id, as teacher forcing does; finished rows are padded.
  start, pad = model.config.decoder_start_token_id, model.config.pad_token_id
  # The n samples of an input share its cross-attention keys/values (one cache row each).
  cache = _init_cache(model, params, encoded, mask, length, rows_per_input=n)
  del encoded  # The cross-attention keys/values now live in the cache.

  def body(state):
    step, inputs, cache, tokens, logprobs, raw, lengths, finished = state
    logits, cache = _decode_step(model, params, cache, inputs, mask, length, step_ops)
    processed = logits
    if config.no_repeat_ngram_size > 0:
      banned = ngram_ban_mask(tokens, step, ngram_size=config.no_repeat_ngram_size,
                              vocab_size=vocab)
      processed = jnp.where(banned, -jnp.inf, processed)
    if config.min_length > 0:
      too_early = (jnp.arange(vocab) == config.eos_id) & (step < config.min_length)
      processed = jnp.where(too_early[None, :], -jnp.inf, processed)
    token, logprob = sample_logits(jax.random.fold_in(rng, step), processed,
                                   temperature=config.temperature, top_k=config.top_k,
                                   top_p=config.top_p, greedy=config.greedy)
    token = jnp.where(finished, pad, token)
    tokens = tokens.at[:, step].set(token)
    logprobs = logprobs.at[:, step].set(jnp.where(finished, 0.0, logprob))
    if raw is not None:
      raw_logprob = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), token[:, None],
                                        axis=-1)[:, 0]
      raw = raw.at[:, step].set(jnp.where(finished, 0.0, raw_logprob))
    lengths = jnp.where(finished, lengths, step + 1)
    finished = finished | (token == config.eos_id)
    return step + 1, token, cache, tokens, logprobs, raw, lengths, finished

  def cond(state):
    step, finished = state[0], state[-1]
    return (step < length) & ~jnp.all(finished)

  zeros_f = jnp.zeros((rows, length), jnp.float32)
  init = (jnp.zeros((), jnp.int32), jnp.full((rows,), start, jnp.int32), cache,
          jnp.full((rows, length), pad, jnp.int32), zeros_f,
          zeros_f if config.return_raw_logprobs else None,
          jnp.zeros((rows,), jnp.int32), jnp.zeros((rows,), bool))
  _, _, _, tokens, logprobs, raw, lengths, _ = jax.lax.while_loop(cond, body, init)
  shape = (batch, n, length)
  return DecodeOutput(tokens=tokens.reshape(shape), logprobs=logprobs.reshape(shape),
                      lengths=lengths.reshape(batch, n),
                      raw_logprobs=None if raw is None else raw.reshape(shape))


@functools.lru_cache(maxsize=128)
def _jitted(impl: Callable[..., Any], model: T5, config: Any,
            partitioner: Any) -> partitioning.PartitionedFunction:
  """`impl(model, config, ...)` jitted, one function per (model, config, partitioner); `config`
  is a decoder's settings or a backend's name (`prepare_decode_weights`)."""
  return partitioning.jit_in_context(functools.partial(impl, model, config), partitioner)


def make_sampler(model: T5, *, max_decode_length: int, num_samples: int = 1,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                 greedy: bool = False, no_repeat_ngram_size: int = 0, min_length: int = 0,
                 eos_id: int = 1, return_raw_logprobs: bool = False, partitioner: Any = None
                 ) -> Callable[..., DecodeOutput]:
  """A jitted sampler `fn(params, encoder_input_tokens=None, encoder_embeds=None,
  encoder_mask=None, rng=None, decode_weights=None) -> DecodeOutput` for fixed settings: the
  same function for the same (model, settings, partitioner), one executable per input shape."""
  config = SampleConfig(max_decode_length=max_decode_length, num_samples=num_samples,
                        temperature=float(temperature), top_k=top_k, top_p=float(top_p),
                        greedy=greedy, no_repeat_ngram_size=no_repeat_ngram_size,
                        min_length=min_length, eos_id=eos_id,
                        return_raw_logprobs=return_raw_logprobs)
  return _jitted(_sample_impl, model, config, partitioner)


@gin.configurable(denylist=["model", "params", "encoder_input_tokens", "encoder_embeds",
                            "encoder_mask", "rng"])
def sample(model: T5, params: Params, *, encoder_input_tokens: Optional[Array] = None,
           encoder_embeds: Optional[Array] = None, encoder_mask: Optional[Array] = None,
           rng: Optional[Array] = None, max_decode_length: int, num_samples: int = 1,
           temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, greedy: bool = False,
           no_repeat_ngram_size: int = 0, min_length: int = 0, eos_id: int = 1,
           return_raw_logprobs: bool = False,
           decode_weights: Optional[DecodeWeights] = None) -> DecodeOutput:
  """Samples `num_samples` continuations per input with a KV cache (eagerly or traced).

  Args:
    model, params: The T5 and its 'params' tree (boxed ones are unboxed).
    encoder_input_tokens: (batch, length) ids; or give `encoder_embeds` + `encoder_mask`.
    encoder_embeds: (batch, length, d_model) input embeddings (e.g. soft prompt prepended).
    encoder_mask: (batch, length) validity; default `encoder_input_tokens != pad`.
    rng: PRNG key (may be None when greedy).
    max_decode_length, num_samples, temperature, top_k, top_p, greedy, no_repeat_ngram_size,
      min_length, eos_id, return_raw_logprobs: See `SampleConfig`.
    decode_weights: `prepare_decode_weights`' kernels for `params`; None stacks XLA's
      kernels inside the call.
  """
  fn = make_sampler(model, max_decode_length=max_decode_length, num_samples=num_samples,
                    temperature=temperature, top_k=top_k, top_p=top_p, greedy=greedy,
                    no_repeat_ngram_size=no_repeat_ngram_size, min_length=min_length,
                    eos_id=eos_id, return_raw_logprobs=return_raw_logprobs)
  return fn(params, encoder_input_tokens, encoder_embeds, encoder_mask, rng, decode_weights)


# -- beam search -----------------------------------------------------------------------------
def brevity_penalty(length: Array | int, alpha: float) -> Array:
  """T5X / GNMT length normalisation ((5 + length) / 6) ** alpha."""
  return ((5.0 + jnp.asarray(length, jnp.float32)) / 6.0) ** alpha


def _reorder_cache(cache: Any, rows: Array, num_rows: int) -> Any:
  """Gathers the self-attention cache rows of the surviving beams.

  Cross-attention keys/values have one row per input, shared by its beams, and beams never
  move across inputs, so those are left alone; the scalar decode position is shared.
  """
  def gather(path, x):
    names = [getattr(p, "key", "") for p in path]
    if x.ndim == 0 or x.shape[0] != num_rows or "encoder_decoder_attention" in names:
      return x
    return jnp.take(x, rows, axis=0)
  return jax.tree_util.tree_map_with_path(gather, cache)


def _beam_search_impl(model: T5, config: BeamSearchConfig, params: Params,
                      encoder_input_tokens: Optional[Array] = None,
                      encoder_embeds: Optional[Array] = None,
                      encoder_mask: Optional[Array] = None,
                      decode_weights: Optional[DecodeWeights] = None) -> tuple[Array, Array]:
  _TRACE_COUNT["beam_search"] += 1
  params = nn.unbox(params)
  step_ops = _step_ops(model, params, decode_weights)
  encoded, mask = _encode(model, params, encoder_input_tokens, encoder_embeds, encoder_mask)
  batch, k, length = encoded.shape[0], config.beam_size, config.max_decode_length
  vocab, eos, alpha = model.config.vocab_size, config.eos_id, config.length_penalty
  num_rows = batch * k
  cache = _init_cache(model, params, encoded, mask, length, rows_per_input=k)
  del encoded
  num_candidates = min(2 * k, k * vocab)  # 2k: enough that k survive even if k end in EOS.

  def body(state):
    (step, inputs, cache, live_seqs, live_lp, done_seqs, done_scores, done_flags) = state
    logits, cache = _decode_step(model, params, cache, inputs, mask, length, step_ops)
    token_lp = jax.nn.log_softmax(logits, axis=-1).reshape(batch, k, vocab)
    totals = (live_lp[:, :, None] + token_lp).reshape(batch, k * vocab)
    cand_lp, cand_index = jax.lax.top_k(totals, num_candidates)
    cand_beam, cand_token = cand_index // vocab, (cand_index % vocab).astype(jnp.int32)
    cand_seqs = jnp.take_along_axis(live_seqs, cand_beam[:, :, None], axis=1)
    cand_seqs = cand_seqs.at[:, :, step].set(cand_token)
    is_eos = cand_token == eos
    # Ends at EOS among the k best (as in HF), or at the length limit (scored at full length).
    in_beam = jnp.arange(num_candidates)[None, :] < k
    ends = (is_eos & in_beam) | (step == length - 1)
    ends &= cand_lp > _NEG / 2  # Not an extension of a placeholder beam.
    new_scores = jnp.where(ends, cand_lp / brevity_penalty(step + 1, alpha), _NEG)
    all_scores = jnp.concatenate([done_scores, new_scores], axis=1)
    all_seqs = jnp.concatenate([done_seqs, cand_seqs], axis=1)
    all_flags = jnp.concatenate([done_flags, ends], axis=1)
    done_scores, top = jax.lax.top_k(all_scores, k)
    done_seqs = jnp.take_along_axis(all_seqs, top[:, :, None], axis=1)
    done_flags = jnp.take_along_axis(all_flags, top, axis=1)
    live_lp, top = jax.lax.top_k(jnp.where(is_eos, _NEG, cand_lp), k)
    live_seqs = jnp.take_along_axis(cand_seqs, top[:, :, None], axis=1)
    parent = jnp.take_along_axis(cand_beam, top, axis=1)
    inputs = jnp.take_along_axis(cand_token, top, axis=1).reshape(num_rows)
    rows = (jnp.arange(batch)[:, None] * k + parent).reshape(num_rows)
    cache = _reorder_cache(cache, rows, num_rows)
    return (step + 1, inputs, cache, live_seqs, live_lp, done_seqs, done_scores, done_flags)

  def cond(state):
    step, live_lp, done_scores, done_flags = state[0], state[4], state[6], state[7]
    # Log-probs only fall, so a live beam's best possible final score is its current log-prob
    # over the largest penalty still reachable (penalty is monotone in length).
    best_penalty = jnp.maximum(brevity_penalty(step + 1, alpha), brevity_penalty(length, alpha))
    best_live = live_lp[:, 0] / best_penalty
    worst_done = jnp.where(done_flags, done_scores, _NEG).min(axis=1)
    settled = jnp.all(done_flags, axis=1) & (worst_done >= best_live)
    return (step < length) & ~jnp.all(settled)

  live_lp = jnp.full((batch, k), _NEG, jnp.float32).at[:, 0].set(0.0)  # k copies of one start.
  seqs = jnp.full((batch, k, length), model.config.pad_token_id, jnp.int32)
  start = jnp.full((num_rows,), model.config.decoder_start_token_id, jnp.int32)
  init = (jnp.zeros((), jnp.int32), start, cache, seqs, live_lp,
          seqs, jnp.full((batch, k), _NEG, jnp.float32), jnp.zeros((batch, k), bool))
  final = jax.lax.while_loop(cond, body, init)
  return final[5], final[6]


def make_beam_search(model: T5, *, beam_size: int, max_decode_length: int,
                     length_penalty: float = 0.6, eos_id: int = 1,
                     partitioner: Any = None) -> Callable[..., Any]:
  """A cached jitted `fn(params, encoder_input_tokens=None, encoder_embeds=None,
  encoder_mask=None, decode_weights=None) -> (tokens, scores)`; see `BeamSearchConfig`."""
  config = BeamSearchConfig(beam_size=beam_size, max_decode_length=max_decode_length,
                            length_penalty=float(length_penalty), eos_id=eos_id)
  return _jitted(_beam_search_impl, model, config, partitioner)


@gin.configurable(denylist=["model", "params", "encoder_input_tokens", "encoder_embeds",
                            "encoder_mask"])
def beam_search(model: T5, params: Params, *, encoder_input_tokens: Optional[Array] = None,
                encoder_embeds: Optional[Array] = None, encoder_mask: Optional[Array] = None,
                beam_size: int, max_decode_length: int, length_penalty: float = 0.6,
                eos_id: int = 1,
                decode_weights: Optional[DecodeWeights] = None) -> tuple[Array, Array]:
  """Beam search with a KV cache and the T5X brevity penalty.

  A hypothesis's score is its token log-probs' sum / `brevity_penalty(len)`, EOS counted;
  at `max_decode_length` a hypothesis ends. Each step expands the live beams to their 2k best
  extensions; an EOS one is finished only if among the k best (so beam_size=1 is greedy), the
  k best others stay live. It stops once no live beam can beat the k-th finished.

  Args:
    model, params, encoder_input_tokens, encoder_embeds, encoder_mask, decode_weights: As in
      `sample`.
    beam_size, max_decode_length, length_penalty, eos_id: See `BeamSearchConfig`.

  Returns:
    (tokens (batch, beam_size, max_decode_length) int32 with zeros after EOS,
     scores (batch, beam_size) float32), best first.
  """
  fn = make_beam_search(model, beam_size=beam_size, max_decode_length=max_decode_length,
                        length_penalty=length_penalty, eos_id=eos_id)
  return fn(params, encoder_input_tokens, encoder_embeds, encoder_mask, decode_weights)


# -- scoring ---------------------------------------------------------------------------------
def _score_impl(model: T5, params: Params, encoder_input_tokens: Optional[Array],
                encoder_embeds: Optional[Array], encoder_mask: Optional[Array], targets: Array,
                lengths: Optional[Array]) -> Array:
  params = nn.unbox(params)
  encoded, mask = _encode(model, params, encoder_input_tokens, encoder_embeds, encoder_mask)
  candidates = targets.shape[1] if targets.ndim == 3 else None
  if candidates is not None:
    # Every candidate of an input decodes against the one encoding of that input, whose
    # cross-attention keys/values are projected once (rows b * C + i share input b).
    targets = targets.reshape(-1, targets.shape[-1])
    lengths = None if lengths is None else lengths.reshape(-1)
  logits, _ = model.apply({"params": params}, encoded, mask,
                          shift_right(targets, model.config.decoder_start_token_id),
                          method=T5.decode)
  if lengths is None:
    weights = targets != model.config.pad_token_id
  else:
    weights = jnp.arange(targets.shape[1])[None, :] < lengths[:, None]
  scores = losses.sequence_logprob(logits, targets, weights)
  return scores if candidates is None else scores.reshape(-1, candidates)


@functools.lru_cache(maxsize=16)
def make_scorer(model: T5, partitioner: Any = None) -> Callable[..., Array]:
  """The jitted `fn(params, encoder_input_tokens, encoder_embeds, encoder_mask, targets,
  lengths)` behind `score_sequences` (under `partitioner`'s mesh and rules when given)."""
  return partitioning.jit_in_context(functools.partial(_score_impl, model), partitioner)


def score_sequences(model: T5, params: Params, *, encoder_input_tokens: Optional[Array] = None,
                    encoder_embeds: Optional[Array] = None, encoder_mask: Optional[Array] = None,
                    targets: Array, lengths: Optional[Array] = None) -> Array:
  """Teacher-forced log-likelihood of each target sequence (jitted).

  Sums log p(target_t | target_<t, input) over the first `lengths[b]` positions when given
  (e.g. `DecodeOutput.lengths`), else over the non-pad ones (T5X convention).

  Args:
    model, params, encoder_input_tokens, encoder_embeds, encoder_mask: As in `sample`.
    targets: (batch, length) int32, one target per input; or (batch, candidates, length),
      several per input (e.g. class label strings), scored against one encoding of the input.
    lengths: Target lengths, shaped as `targets` without its last axis (None: non-pad).

  Returns:
    (batch,) or (batch, candidates) float32 log-likelihoods.
  """
  shape = np.shape(targets)
  if len(shape) not in (2, 3):
    raise ValueError(f"score_sequences: targets must be (batch, length) or (batch, "
                     f"candidates, length), got shape {shape}")
  if lengths is not None and np.shape(lengths) != shape[:-1]:
    raise ValueError(f"score_sequences: lengths shape {np.shape(lengths)} does not match "
                     f"targets shape {shape} without its last axis")
  return make_scorer(model)(params, encoder_input_tokens, encoder_embeds, encoder_mask,
                               targets, lengths)
