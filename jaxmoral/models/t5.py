"""Flax linen T5 encoder-decoder (T5 1.0 and T5 1.1 / Flan-T5), T5X parameter names and axes.

Parameter tree (T5X names, so T5X checkpoints and rules apply unchanged)::

  token_embedder/embedding                       (vocab, embed)
  encoder/relpos_bias/rel_embedding              (heads, relpos_buckets)
  encoder/layers_{i}/pre_attention_layer_norm/scale
  encoder/layers_{i}/attention/{query,key,value}/kernel   (embed, joined_kv)
  encoder/layers_{i}/attention/out/kernel        (joined_kv, embed)
  encoder/layers_{i}/pre_mlp_layer_norm/scale
  encoder/layers_{i}/mlp/{wi | wi_0, wi_1}/kernel (embed, mlp); mlp/wo/kernel (mlp, embed)
  encoder/encoder_norm/scale
  decoder/relpos_bias/rel_embedding
  decoder/layers_{i}/{pre_self_attention_layer_norm, self_attention,
                      pre_cross_attention_layer_norm, encoder_decoder_attention,
                      pre_mlp_layer_norm, mlp}
  decoder/decoder_norm/scale
  decoder/logits_dense/kernel                    (embed, vocab)   untied variants only
  scalar_head/kernel, scalar_head/bias           only with `with_scalar_head=True`

Every entry point the methods need is a method of `T5`, used through `model.apply(...,
method=...)`: `embed` (token ids -> input embeddings), `encode` (from ids *or* embeddings),
`decode` (teacher forced, or one step at a time against a key/value cache), `init_cache`,
`__call__` (teacher-forced logits) and `score` (the scalar head on decoder states).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Any, Iterator, Optional, Sequence

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxmoral.models import flash_attention
from jaxmoral.models import flash_attention_gpu
from jaxmoral.models import heads
from jaxmoral.models.config import T5Config
from jaxmoral.models.config import cudnn_supports_head_width

Array = jax.Array
NEG_INF = -1e10  # Large negative bias for masked attention (T5X uses the same order).


def _dtype(config: T5Config) -> Any:
  return {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[config.dtype]


def _param(module: nn.Module, name: str, init: Any, shape: tuple[int, ...],
           axes: tuple[Optional[str], ...]) -> Array:
  """A float32 parameter boxed with its T5X logical axis names."""
  return module.param(name, nn.with_logical_partitioning(init, axes), shape, jnp.float32)


# While `init_params` runs: a list (listing the random parameters, in an abstract init), then
# {path: standard normals} (the real init). Flax draws each parameter with its own threefry
# call, and XLA:CPU compiles each call into a loop of its own, which made init the costliest
# compile of a small model.
_NORMAL_DRAWS: contextvars.ContextVar[Any] = contextvars.ContextVar("jaxmoral_t5_normal_draws",
                                                                    default=None)


def _normal_param(module: nn.Module, name: str, stddev: float, shape: tuple[int, ...],
                  axes: tuple[Optional[str], ...]) -> Array:
  """`_param` drawn from N(0, stddev^2): a row of `init_params`' draws where it has one."""
  draws, path = _NORMAL_DRAWS.get(), tuple(module.path) + (name,)

  def init(key: Array, shape: tuple[int, ...], dtype: Any) -> Array:
    if isinstance(draws, list):
      draws.append((path, tuple(shape), tuple(axes)))
    elif draws is not None:
      return (draws[path] * stddev).astype(dtype)
    return nn.initializers.normal(stddev=stddev)(key, shape, dtype)

  return _param(module, name, init, shape, axes)


def _draw_normals(random_parameters: Sequence[Any], rng: Array) -> dict[tuple[str, ...], Array]:
  """One (count, *shape) block of standard normals per distinct (shape, logical axes),
  constrained to those axes so a sharded init stays sharded; each parameter takes its row."""
  groups: dict[tuple[Any, Any], list[tuple[str, ...]]] = {}
  for path, shape, axes in random_parameters:
    groups.setdefault((shape, axes), []).append(path)
  rows = {}
  for index, ((shape, axes), paths) in enumerate(groups.items()):
    block = jax.random.normal(jax.random.fold_in(rng, index), (len(paths),) + shape,
                              jnp.float32)
    block = _constrain(block, (None,) + axes)
    rows.update((path, block[i]) for i, path in enumerate(paths))
  return rows


def _constrain(x: Array, axes: tuple[Optional[str], ...]) -> Array:
  return nn.with_logical_constraint(x, axes)


@functools.lru_cache(maxsize=64)
def relative_position_bucket_table(max_distance_span: int, bidirectional: bool,
                                   num_buckets: int, max_distance: int) -> np.ndarray:
  """Bucket of every relative position in [-span, span], computed once in NumPy.

  Index `relative_position + span`. Same formula as Mesh TensorFlow / HF `T5Attention`:
  exact buckets for small distances, logarithmic ones up to `max_distance`.
  """
  relative_position = np.arange(-max_distance_span, max_distance_span + 1, dtype=np.int64)
  buckets = np.zeros_like(relative_position)
  if bidirectional:
    num_buckets //= 2
    buckets += (relative_position > 0).astype(np.int64) * num_buckets
    distance = np.abs(relative_position)
  else:
    distance = -np.minimum(relative_position, 0)
  max_exact = num_buckets // 2
  is_small = distance < max_exact
  with np.errstate(divide="ignore"):
    scaled = (np.log(np.maximum(distance, 1).astype(np.float32) / np.float32(max_exact))
              / np.float32(np.log(max_distance / max_exact)) * (num_buckets - max_exact))
  if_large = np.minimum(max_exact + scaled.astype(np.int64), num_buckets - 1)
  buckets += np.where(is_small, distance, if_large)
  return buckets.astype(np.int32)


class RMSNorm(nn.Module):
  """T5 layer norm: scale only, no mean subtraction, statistics in float32."""
  epsilon: float
  dtype: Any

  @nn.compact
  def __call__(self, x: Array) -> Array:
    scale = _param(self, "scale", nn.initializers.ones, (x.shape[-1],), ("embed",))
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.epsilon)
    return (x32 * scale).astype(self.dtype)


def _matmul_last_axis(x: Array, kernel: Array, *, split_one_row: bool = True,
                      **dot_kwargs: Any) -> Array:
  """(..., d) @ (d, *f) -> (..., *f), as one product over the flattened leading axes.

  Written as a 3-D einsum, the weight gradient contracts over two axes (batch and length);
  XLA:CPU then transposes the activation gradient before every such product, and a T5 1.1
  MLP's forward + backward ran at about half the speed of this 2-D form.
  A single row goes through `_vector_matmul` unless `split_one_row` is False (a transposed
  `kernel`, whose split would be a copy); float32 rows traced for CPUs through
  `_cpu_rows_matmul` (its weight gradient runs as a plain product there).
  """
  rows = x.reshape(-1, x.shape[-1])
  if rows.shape[0] == 1 and split_one_row:
    out = _vector_matmul(rows, kernel, **dot_kwargs)
  elif (CPU_PLAIN_WEIGHT_GRADIENTS and rows.dtype == kernel.dtype == jnp.float32
        and _tracing_for_cpu()):
    out = _cpu_rows_matmul(rows, kernel, dot_kwargs.get("preferred_element_type"))
  else:
    out = jnp.tensordot(rows, kernel, axes=1, **dot_kwargs)
  return out.reshape(*x.shape[:-1], *kernel.shape[1:])


def _tracing_for_cpu() -> bool:
  """Whether the program being traced runs on CPUs: the platform of the mesh it is traced
  under (a TPU topology compiled ahead of time from a CPU host is not), else the default
  backend."""
  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty:
    return mesh.abstract_device.platform == "cpu"
  return jax.default_backend() == "cpu"


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _cpu_rows_matmul(rows: Array, kernel: Array, preferred_element_type: Any) -> Array:
  """(R, d) @ (d, *f) in float32, whose weight gradient XLA:CPU runs as a plain product.

  Autodiff writes the weight gradient as rows^T @ g, a product contracting both operands'
  first axis; XLA:CPU leaves such products to its own slower dot emitter instead of YNNPACK.
  The backward pass here transposes `rows` into a buffer of its own (the barrier stops XLA
  from folding the transpose back into the product), so YNNPACK gets (d, R) @ (R, f). The
  copy is a small fraction of the product; the values are the same sums. Reverse mode only,
  as any `custom_vjp`: forward-mode differentiation (`jax.jvp`) of a model traced for CPUs
  needs `CPU_PLAIN_WEIGHT_GRADIENTS` off.
  """
  return jnp.tensordot(rows, kernel, axes=1, preferred_element_type=preferred_element_type)


def _cpu_rows_matmul_fwd(rows: Array, kernel: Array, preferred_element_type: Any
                         ) -> tuple[Array, tuple[Array, Array]]:
  return _cpu_rows_matmul(rows, kernel, preferred_element_type), (rows, kernel)


def _cpu_rows_matmul_bwd(preferred_element_type: Any, residuals: tuple[Array, Array],
                         grad: Array) -> tuple[Array, Array]:
  del preferred_element_type  # float32 operands: the gradients are float32 either way
  rows, kernel = residuals
  grad = grad.reshape(grad.shape[0], -1)
  kernel_2d = kernel.reshape(kernel.shape[0], -1)
  d_rows = jax.lax.dot_general(grad, kernel_2d, (((1,), (1,)), ((), ())))
  rows_t = jax.lax.optimization_barrier(rows.T)
  d_kernel = jax.lax.dot_general(rows_t, grad, (((1,), (0,)), ((), ())))
  return d_rows, d_kernel.reshape(kernel.shape)


_cpu_rows_matmul.defvjp(_cpu_rows_matmul_fwd, _cpu_rows_matmul_bwd)


def _vector_matmul(row: Array, kernel: Array, **dot_kwargs: Any) -> Array:
  """(1, d) @ (d, ...) -> (1, ...) as two half-length products, summed.

  A one-row product (a decoding step at batch 1) streams the kernel once and is bound by
  memory latency on XLA:CPU. Splitting the contracted axis in two halves, one batched
  product over them, keeps two streams in flight, which reads the kernel faster. The reshape
  of a row-major
  kernel is free; the two halves are summed in float32.
  """
  d = row.shape[-1]
  if d % 2:
    return jnp.tensordot(row, kernel, axes=1, **dot_kwargs)
  out_dtype = dot_kwargs.pop("preferred_element_type", None) or jnp.result_type(row, kernel)
  halves = jnp.einsum("sd,sd...->s...", row.reshape(2, d // 2),
                      kernel.reshape(2, d // 2, *kernel.shape[1:]),
                      preferred_element_type=jnp.float32, **dot_kwargs)
  return (halves[0] + halves[1]).astype(out_dtype)[None]


class DenseKernel(nn.Module):
  """A bias-free dense layer `x @ kernel` with logical axes on the kernel."""
  features: int
  axes: tuple[Optional[str], Optional[str]]
  init_scale: float
  dtype: Any

  @nn.compact
  def kernel(self, in_features: int) -> Array:
    """The (in_features, features) kernel in the compute dtype (created on first use)."""
    return _normal_param(self, "kernel", self.init_scale, (in_features, self.features),
                         self.axes).astype(self.dtype)

  def __call__(self, x: Array, *, decode_step: bool = False) -> Array:
    kernel = self.kernel(x.shape[-1])
    if decode_step:
      return decode_step_ops().products(self.path, ("kernel",), x, [kernel])[0].astype(
          self.dtype)
    return _matmul_last_axis(x, kernel)


def _matmul_stacked(x: Array, stacked: Array) -> list[Array]:
  """[x @ stacked[:, i] for each i] as one product: (..., d) @ (d, n, f) -> n x (..., f).

  One wide product reads the kernels in a single pass; in decoding, where each token is a
  matrix-vector product bound by memory bandwidth, fusing query/key/value (and the two gated
  MLP inputs) made those products markedly faster on CPU. The kernels are stacked on a new
  middle axis, not concatenated, so a kernel sharded along `f` stays sharded the same way.
  """
  out = _matmul_last_axis(x, stacked)
  return [out[..., i, :] for i in range(stacked.shape[1])]


class DecodeStepOps:
  """How a cached decoding step multiplies by its weights and attends (XLA by default).

  `jaxmoral.decoding` traces every decoder step inside `using_decode_step_ops(ops)` with the
  ops of its backend (stacked kernels prepared once, or a CPU kernel library); the model calls
  them in those steps only, so training and teacher forcing never see them, and the model
  knows nothing of any backend. Keys are the calling module's path and the names of the
  kernels it multiplies by, e.g. (("decoder", "layers_0", "self_attention"), ("query", "key",
  "value")).
  """

  def products(self, path: tuple[str, ...], names: tuple[str, ...], x: Array,
               kernels: Sequence[Array], *, preferred_element_type: Any = None
               ) -> list[Array]:
    """[x @ k for k in kernels] (..., d) -> (..., f_i), as one product when there are several
    (one pass over the weights, which bounds a decoding step)."""
    del path, names
    kwargs = {} if preferred_element_type is None else {
        "preferred_element_type": preferred_element_type}
    if len(kernels) == 1:
      return [_matmul_last_axis(x, kernels[0], **kwargs)]
    return self.stacked_products(x, jnp.stack(list(kernels), axis=1))

  @staticmethod
  def stacked_products(x: Array, stacked: Array) -> list[Array]:
    """[x @ stacked[:, i] for each i] as one product (see `_matmul_stacked`)."""
    return _matmul_stacked(x, stacked)

  def attention(self, path: tuple[str, ...], query: Array, key: Array, value: Array,
                bias: Array) -> Optional[Array]:
    """A step's attention, (G*R, H, D) queries against (R, H, L, D) keys/values and a bias
    broadcastable to (R, H, L); None: the model's own einsum attention."""
    del path, query, key, value, bias
    return None


_DECODE_STEP_OPS: list[DecodeStepOps] = []


def decode_step_ops() -> DecodeStepOps:
  """The ops of the decoding step being traced (XLA's unless a backend installed its own)."""
  return _DECODE_STEP_OPS[-1] if _DECODE_STEP_OPS else DecodeStepOps()


@contextlib.contextmanager
def using_decode_step_ops(ops: DecodeStepOps) -> Iterator[DecodeStepOps]:
  """Decoding steps traced inside use `ops` (a context, like flax's logical-axis rules)."""
  _DECODE_STEP_OPS.append(ops)
  try:
    yield ops
  finally:
    _DECODE_STEP_OPS.pop()


class Embed(nn.Module):
  """Token embedding; `attend` is the tied logits projection of T5 1.0."""
  num_embeddings: int
  features: int
  dtype: Any

  def setup(self):
    self.embedding = _normal_param(self, "embedding", 1.0, (self.num_embeddings, self.features),
                                   ("vocab", "embed"))

  def __call__(self, tokens: Array) -> Array:
    out = jnp.take(self.embedding.astype(self.dtype), tokens, axis=0)
    return _constrain(out, ("batch", "length", "embed"))

  def attend(self, x: Array, *, decode_step: bool = False) -> Array:
    if decode_step:
      return decode_step_ops().products(self.path, ("attend",), x,
                                        [self.embedding.astype(x.dtype).T],
                                        preferred_element_type=jnp.float32)[0]
    return _matmul_last_axis(x, self.embedding.astype(x.dtype).T, split_one_row=False,
                             preferred_element_type=jnp.float32)


class LogitsDense(nn.Module):
  """Untied output projection `decoder/logits_dense/kernel` (embed, vocab); float32 logits."""
  vocab_size: int

  @nn.compact
  def __call__(self, hidden: Array, *, decode_step: bool = False) -> Array:
    d_model = hidden.shape[-1]
    kernel = _normal_param(self, "kernel", d_model ** -0.5, (d_model, self.vocab_size),
                           ("embed", "vocab")).astype(hidden.dtype)
    if decode_step:
      return decode_step_ops().products(self.path, ("kernel",), hidden, [kernel],
                                        preferred_element_type=jnp.float32)[0]
    return _matmul_last_axis(hidden, kernel, preferred_element_type=jnp.float32)


class RelativePositionBias(nn.Module):
  """Learned per-head bias of the bucketed distance between query and key positions."""
  num_buckets: int
  max_distance: int
  num_heads: int
  bidirectional: bool

  @nn.compact
  def __call__(self, query_positions: Array, key_positions: Array, span: int) -> Array:
    """Returns a (1, heads, q, k) float32 bias; `span` bounds |q - k| (static)."""
    table = jnp.asarray(relative_position_bucket_table(
        span, self.bidirectional, self.num_buckets, self.max_distance))
    rel = key_positions[None, :] - query_positions[:, None]
    buckets = table[rel + span]
    embedding = _normal_param(self, "rel_embedding", 1.0, (self.num_heads, self.num_buckets),
                              ("heads", "relpos_buckets"))
    bias = jnp.take(embedding, buckets, axis=1)  # (heads, q, k)
    return bias[None]


# The `jax.nn.dot_product_attention` implementation behind attention_impl="cudnn". Tests set
# "xla" to run the same masks, lengths and biases through JAX's reference on a CPU.
FUSED_ATTENTION_BACKEND = "cudnn"
# Dense layers traced for CPUs take `_cpu_rows_matmul`'s backward (weight gradients as plain
# products); `bench/bench_weight_gradients.py` turns it off to time autodiff's form against it.
CPU_PLAIN_WEIGHT_GRADIENTS = True
# attention_impl="pallas_gpu": hand the Triton kernels T5's position bias as its diagonals
# (`flash_attention_gpu.bias_diagonals`; the bias depends on k - q alone) rather than whole.
GPU_BIAS_AS_DIAGONALS = False


@functools.cache
def _cudnn_attention_available() -> bool:
  """Whether the default backend is a CUDA GPU (where cuDNN's fused attention runs)."""
  try:
    return (jax.default_backend() == "gpu"
            and "cuda" in jax.devices()[0].client.platform_version.lower())
  except Exception:  # pylint: disable=broad-except
    return False


def use_fused_attention(config: T5Config, *, deterministic: bool, query_length: int,
                        key_length: int) -> bool:
  """Whether teacher-forced attention of this call goes through a fused (cuDNN or Pallas) kernel.

  "cudnn", "pallas" and "pallas_gpu" always do (the config has checked dropout and, for
  cuDNN, dtype and head width); "auto" does
  when the backend is a CUDA GPU, activations are 16-bit, no attention dropout is applied,
  heads are a multiple of 8 wide (at most 128) and both lengths are even (cuDNN's bias
  gradient needs that).
  """
  if config.attention_impl in ("cudnn", "pallas", "pallas_gpu"):
    return True
  if config.attention_impl == "einsum":
    return False
  return (config.dtype != "float32" and (deterministic or config.dropout_rate == 0.0)
          and cudnn_supports_head_width(config.d_kv)
          and query_length % 2 == 0 and key_length % 2 == 0
          and _cudnn_attention_available())


@flax.struct.dataclass
class FusedMask:
  """The bias and mask of fused attention, kept apart (einsum attention gets them summed).

  Attributes:
    position_bias: (1, heads, q, k) float32 relative-position bias, or None.
    mask: (batch, 1, q, k) bool, True where a query may attend to a key; None: all may.
    key_lengths: (batch,) int32: keys at positions >= length are masked (right padding).
    query_ids: (batch, q) int32 segment id of each query, 0 for padding; set (with
      `key_ids`, instead of `mask` and `key_lengths`) only for the Pallas kernels, which take
      masks factored: a query attends to the keys with its id.
    key_ids: (batch, k) int32 segment id of each key, 0 for padding.
    causal: Queries attend to keys at their own position or before.
    gpu_kernel: With segment ids, run `flash_attention_gpu` (Triton) instead of
      `flash_attention` (Mosaic, TPUs): attention_impl="pallas_gpu".
  """
  position_bias: Optional[Array] = None
  mask: Optional[Array] = None
  key_lengths: Optional[Array] = None
  query_ids: Optional[Array] = None
  key_ids: Optional[Array] = None
  causal: bool = flax.struct.field(pytree_node=False, default=False)
  gpu_kernel: bool = flax.struct.field(pytree_node=False, default=False)


def fused_attention(query: Array, key: Array, value: Array, masking: FusedMask) -> Array:
  """T5 attention (no 1/sqrt(d) scale) of (batch, length, heads, d_kv) inputs in one kernel.

  A boolean mask is folded into the bias in float32 before the cast to the activation dtype,
  so padded positions get T5's -1e10 (rounded to that dtype), as in the einsum path. With
  segment ids a Pallas kernel runs instead (float32 bias; padded queries output zeros): the
  Triton one for attention_impl="pallas_gpu", else the TPU one.
  """
  if masking.query_ids is not None:
    batch_axes, head_axes = nn.logical_to_mesh_axes(("batch", "heads"))
    if masking.gpu_kernel:
      bias, diagonals = masking.position_bias, None
      if GPU_BIAS_AS_DIAGONALS and bias is not None:
        # T5's position bias (relative positions of 0, 1, ..., see RelativePositionBias)
        # depends on k - q alone, so its diagonals carry all of it.
        bias, diagonals = None, flash_attention_gpu.bias_diagonals(bias)
      return flash_attention_gpu.sharded_flash_attention(
          query, key, value, bias, masking.query_ids, masking.key_ids,
          bias_diagonals=diagonals, causal=masking.causal, batch_axes=batch_axes,
          head_axes=head_axes)
    return flash_attention.sharded_flash_attention(
        query, key, value, masking.position_bias, masking.query_ids, masking.key_ids,
        causal=masking.causal, batch_axes=batch_axes, head_axes=head_axes)
  bias = masking.position_bias
  if masking.mask is not None:
    additive = _mask_to_bias(masking.mask)
    bias = additive if bias is None else bias + additive
  if bias is not None:
    bias = bias.astype(query.dtype)
  return jax.nn.dot_product_attention(
      query, key, value, bias=bias, scale=1.0, is_causal=masking.causal,
      key_value_seq_lengths=masking.key_lengths, implementation=FUSED_ATTENTION_BACKEND)


class MultiHeadAttention(nn.Module):
  """T5 attention: no 1/sqrt(d) scaling (folded into the query init), optional KV cache.

  Self-attention in decode mode keeps `cached_key`/`cached_value` of shape
  (batch, heads, max_decode_length, d_kv) and writes one position per step.
  Cross-attention in decode mode projects the encoder outputs once, in `init_cache`, into the
  same (batch, heads, length, d_kv) layout and reads them back on every step. That cache has
  one row per input: decoding G samples (or beams) of each input runs G * batch query rows,
  in groups of G, against it (`T5.init_cache(rows_per_input=G)`). Heads come
  before positions in the cache because that is the layout the per-step batched dots read:
  a (batch, length, heads, d_kv) cache made XLA:CPU transpose every cache on every step.
  """
  config: T5Config
  deterministic: bool = True

  @nn.compact
  def __call__(self, inputs_q: Array, inputs_kv: Optional[Array], bias: Array, *,
               decode: bool = False, init_cache: bool = False, is_cross: bool = False,
               decode_position: Optional[Array] = None,
               max_decode_length: Optional[int] = None) -> Array:
    cfg = self.config
    dtype = _dtype(cfg)
    heads, d_kv, d_model = cfg.num_heads, cfg.d_kv, cfg.d_model
    joined = heads * d_kv
    dense = functools.partial(DenseKernel, features=joined, axes=("embed", "joined_kv"),
                              dtype=dtype)
    query_proj = dense(init_scale=(d_model * d_kv) ** -0.5, name="query")
    key_proj = dense(init_scale=d_model ** -0.5, name="key")
    value_proj = dense(init_scale=d_model ** -0.5, name="value")
    out_proj = DenseKernel(features=d_model, axes=("joined_kv", "embed"),
                           init_scale=joined ** -0.5, dtype=dtype, name="out")
    batch = inputs_q.shape[0]

    def split(x: Array) -> Array:
      return _constrain(x.reshape(x.shape[:-1] + (heads, d_kv)),
                        ("batch", "length", "heads", "kv"))

    def heads_first(x: Array) -> Array:  # (b, l, h, d) -> (b, h, l, d)
      return _constrain(jnp.swapaxes(x, 1, 2), ("batch", "heads", "length", "kv"))

    # A decoding step projects query, key and value with one product (see _matmul_stacked);
    # in training the split product's backward pass was slower, so it keeps three.
    step = decode and not init_cache  # A cached decoding step: its products are the backend's.
    fused_qkv = step and not is_cross
    if isinstance(bias, FusedMask):
      if decode:
        raise ValueError("MultiHeadAttention: fused attention is for teacher forcing only")
      out = fused_attention(split(query_proj(inputs_q)), split(key_proj(inputs_kv)),
                            split(value_proj(inputs_kv)), bias)
      out = out.reshape(out.shape[0], out.shape[1], joined)
      return _constrain(out_proj(out), ("batch", "length", "embed"))
    if fused_qkv:
      query, own_key, own_value = [p.astype(dtype) for p in decode_step_ops().products(
          self.path, ("query", "key", "value"), inputs_q,
          [proj.kernel(d_model) for proj in (query_proj, key_proj, value_proj)])]
    else:
      query = query_proj(inputs_q, decode_step=step)
    query = heads_first(split(query))
    if decode and is_cross:
      if init_cache:
        projected_k = heads_first(split(key_proj(inputs_kv)))
        projected_v = heads_first(split(value_proj(inputs_kv)))
        self.variable("cache", "cached_key", lambda: projected_k)
        self.variable("cache", "cached_value", lambda: projected_v)
      key = self.get_variable("cache", "cached_key")
      value = self.get_variable("cache", "cached_value")
    elif decode:
      shape = (batch, heads, max_decode_length, d_kv)
      cached_key = self.variable("cache", "cached_key", jnp.zeros, shape, dtype)
      cached_value = self.variable("cache", "cached_value", jnp.zeros, shape, dtype)
      if init_cache:
        return jnp.zeros(inputs_q.shape[:-1] + (d_model,), dtype)
      step_k = heads_first(split(own_key)).astype(dtype)  # fused_qkv holds here.
      step_v = heads_first(split(own_value)).astype(dtype)
      start = (0, 0, decode_position, 0)
      cached_key.value = jax.lax.dynamic_update_slice(cached_key.value, step_k, start)
      cached_value.value = jax.lax.dynamic_update_slice(cached_value.value, step_v, start)
      key, value = cached_key.value, cached_value.value
    else:
      key = heads_first(split(key_proj(inputs_kv)))
      value = heads_first(split(value_proj(inputs_kv)))

    group = batch // key.shape[0]  # Query rows per key row: > 1 for samples of one input.
    if group * key.shape[0] != batch:
      raise ValueError(f"MultiHeadAttention: {batch} query rows do not come in groups over "
                       f"{key.shape[0]} key/value rows")
    step_out = (decode_step_ops().attention(self.path, query[:, :, 0], key, value, bias[:, :, 0])
                if step else None)
    if step_out is not None:  # The backend's attention of the step's one query per row/head.
      out = step_out[:, :, None].astype(dtype)
    elif group > 1:
      # Each group of query rows attends to its input's keys once, rather than to G copies.
      grouped = query.reshape((key.shape[0], group) + query.shape[1:])
      scores = jnp.einsum("bghqd,bhkd->bghqk", grouped, key,
                          preferred_element_type=jnp.float32) + bias[:, None]
      weights = jax.nn.softmax(scores, axis=-1)
      out = jnp.einsum("bghqk,bhkd->bghqd", weights.astype(dtype), value)
      out = out.reshape(query.shape)
    else:
      scores = jnp.einsum("bhqd,bhkd->bhqk", query, key,
                          preferred_element_type=jnp.float32) + bias
      weights = jax.nn.softmax(scores, axis=-1)
      if cfg.dropout_rate > 0 and not self.deterministic:
        keep = jax.random.bernoulli(self.make_rng("dropout"), 1.0 - cfg.dropout_rate,
                                    weights.shape)
        weights = weights * keep / (1.0 - cfg.dropout_rate)
      out = jnp.einsum("bhqk,bhkd->bhqd", weights.astype(dtype), value)
    out = jnp.swapaxes(out, 1, 2).reshape(out.shape[0], out.shape[2], joined)
    return _constrain(out_proj(out, decode_step=step), ("batch", "length", "embed"))


class MlpBlock(nn.Module):
  """ReLU MLP (T5 1.0) or gated MLP (T5 1.1: gelu(x wi_0) * (x wi_1)).

  `decode` (a cached decoding step) computes its products through `decode_step_ops()`, the
  two gated inputs as one product.
  """
  config: T5Config
  deterministic: bool = True
  decode: bool = False

  @nn.compact
  def __call__(self, x: Array) -> Array:
    cfg = self.config
    dtype = _dtype(cfg)
    act = {"relu": jax.nn.relu, "gelu": functools.partial(jax.nn.gelu, approximate=True),
           "silu": jax.nn.silu}[cfg.feed_forward_proj.split("-")[-1]]
    dense = functools.partial(DenseKernel, features=cfg.d_ff, axes=("embed", "mlp"),
                              init_scale=cfg.d_model ** -0.5, dtype=dtype)
    if cfg.is_gated and self.decode:
      gate, linear = [p.astype(dtype) for p in decode_step_ops().products(
          self.path, ("wi_0", "wi_1"), x,
          [dense(name=name).kernel(x.shape[-1]) for name in ("wi_0", "wi_1")])]
      hidden = act(gate) * linear
    elif cfg.is_gated:
      hidden = act(dense(name="wi_0")(x)) * dense(name="wi_1")(x)
    else:
      hidden = act(dense(name="wi")(x, decode_step=self.decode))
    hidden = _constrain(hidden, ("batch", "length", "mlp"))
    hidden = _dropout(self, hidden, cfg.dropout_rate, self.deterministic)
    out = DenseKernel(features=cfg.d_model, axes=("mlp", "embed"), init_scale=cfg.d_ff ** -0.5,
                      dtype=dtype, name="wo")(hidden, decode_step=self.decode)
    return _constrain(out, ("batch", "length", "embed"))


def _dropout(module: nn.Module, x: Array, rate: float, deterministic: bool) -> Array:
  if rate == 0.0 or deterministic:
    return x
  return nn.Dropout(rate=rate, deterministic=False)(x)


class EncoderLayer(nn.Module):
  config: T5Config
  deterministic: bool = True

  @nn.compact
  def __call__(self, x: Array, bias: Array) -> Array:
    cfg = self.config
    norm = functools.partial(RMSNorm, epsilon=cfg.layer_norm_epsilon, dtype=_dtype(cfg))
    h = norm(name="pre_attention_layer_norm")(x)
    h = MultiHeadAttention(cfg, self.deterministic, name="attention")(h, h, bias)
    x = x + _dropout(self, h, cfg.dropout_rate, self.deterministic)
    h = norm(name="pre_mlp_layer_norm")(x)
    h = MlpBlock(cfg, self.deterministic, name="mlp")(h)
    x = x + _dropout(self, h, cfg.dropout_rate, self.deterministic)
    return _constrain(x, ("batch", "length", "embed"))


class DecoderLayer(nn.Module):
  config: T5Config
  deterministic: bool = True
  decode: bool = False
  init_cache: bool = False
  max_decode_length: Optional[int] = None

  @nn.compact
  def __call__(self, x: Array, encoded: Optional[Array], self_bias: Array, cross_bias: Array,
               decode_position: Optional[Array]) -> Array:
    cfg = self.config
    norm = functools.partial(RMSNorm, epsilon=cfg.layer_norm_epsilon, dtype=_dtype(cfg))
    cache_args = dict(decode=self.decode, init_cache=self.init_cache,
                      decode_position=decode_position, max_decode_length=self.max_decode_length)
    h = norm(name="pre_self_attention_layer_norm")(x)
    h = MultiHeadAttention(cfg, self.deterministic, name="self_attention")(
        h, h, self_bias, **cache_args)
    x = x + _dropout(self, h, cfg.dropout_rate, self.deterministic)
    h = norm(name="pre_cross_attention_layer_norm")(x)
    h = MultiHeadAttention(cfg, self.deterministic, name="encoder_decoder_attention")(
        h, encoded, cross_bias, is_cross=True, **cache_args)
    x = x + _dropout(self, h, cfg.dropout_rate, self.deterministic)
    h = norm(name="pre_mlp_layer_norm")(x)
    # Only a cached decoding step's products are the decoding backend's (see DecodeStepOps).
    h = MlpBlock(cfg, self.deterministic, self.decode and not self.init_cache, name="mlp")(h)
    x = x + _dropout(self, h, cfg.dropout_rate, self.deterministic)
    return _constrain(x, ("batch", "length", "embed"))


def _mask_to_bias(mask: Array) -> Array:
  return jnp.where(mask, 0.0, NEG_INF).astype(jnp.float32)


def _attention_mask(query_valid: Array, key_valid: Array,
                    query_segments: Optional[Array] = None,
                    key_segments: Optional[Array] = None) -> Array:
  """(batch, 1, q, k) bool mask: both positions valid and (if packed) in the same segment."""
  mask = query_valid[:, None, :, None].astype(bool) & key_valid[:, None, None, :].astype(bool)
  if query_segments is not None and key_segments is not None:
    mask &= query_segments[:, None, :, None] == key_segments[:, None, None, :]
  return mask


def _fused_mask(config: T5Config, query_valid: Array, key_valid: Array,
                query_segments: Optional[Array], key_segments: Optional[Array], *,
                position_bias: Optional[Array] = None, causal: bool = False) -> FusedMask:
  """Padding (and packing) masks for fused attention: per-position segment ids for the Pallas
  kernels; for cuDNN per-row key lengths when the config promises right padding and the batch
  is unpacked, else the dense boolean mask.

  With lengths, padded query rows attend to the valid keys instead of to nothing; no valid
  position reads a padded one, so every valid output is the same either way.
  """
  if config.attention_impl in ("pallas", "pallas_gpu"):
    def ids(valid: Array, segments: Optional[Array]) -> Array:
      return jnp.where(valid.astype(bool), 1 if segments is None else segments, 0).astype(
          jnp.int32)
    return FusedMask(position_bias=position_bias, causal=causal,
                     query_ids=ids(query_valid, query_segments),
                     key_ids=ids(key_valid, key_segments),
                     gpu_kernel=config.attention_impl == "pallas_gpu")
  if config.right_padded_inputs and query_segments is None and key_segments is None:
    return FusedMask(position_bias=position_bias,
                     key_lengths=jnp.sum(key_valid, axis=-1, dtype=jnp.int32))
  return FusedMask(position_bias=position_bias, mask=_attention_mask(
      query_valid, key_valid, query_segments, key_segments))


class Encoder(nn.Module):
  config: T5Config

  @nn.compact
  def __call__(self, embeds: Array, mask: Array, segment_ids: Optional[Array] = None, *,
               deterministic: bool = True) -> Array:
    cfg = self.config
    length = embeds.shape[1]
    positions = jnp.arange(length)
    relpos = RelativePositionBias(cfg.relative_attention_num_buckets,
                                  cfg.relative_attention_max_distance, cfg.num_heads,
                                  bidirectional=True, name="relpos_bias")
    position_bias = relpos(positions, positions, span=length)
    if use_fused_attention(cfg, deterministic=deterministic, query_length=length,
                           key_length=length):
      bias = _fused_mask(cfg, mask, mask, segment_ids, segment_ids, position_bias=position_bias)
    else:
      bias = position_bias + _mask_to_bias(_attention_mask(mask, mask, segment_ids, segment_ids))
    x = _dropout(self, embeds, cfg.dropout_rate, deterministic)
    x = _constrain(x, ("batch", "length", "embed"))
    layer_cls = nn.remat(EncoderLayer) if cfg.remat else EncoderLayer
    for i in range(cfg.num_encoder_layers):
      x = layer_cls(cfg, deterministic, name=f"layers_{i}")(x, bias)
    x = RMSNorm(cfg.layer_norm_epsilon, _dtype(cfg), name="encoder_norm")(x)
    return _dropout(self, x, cfg.dropout_rate, deterministic)


class Decoder(nn.Module):
  """Decoder stack; returns float32 logits and the final (normed) hidden states."""
  config: T5Config
  shared_embedder: Embed

  @nn.compact
  def __call__(self, embeds: Array, encoded: Optional[Array], encoder_mask: Array,
               segment_ids: Optional[Array] = None,
               encoder_segment_ids: Optional[Array] = None, *, deterministic: bool = True,
               decode: bool = False, init_cache: bool = False,
               max_decode_length: Optional[int] = None) -> tuple[Array, Array]:
    cfg = self.config
    batch, length = embeds.shape[:2]
    relpos = RelativePositionBias(cfg.relative_attention_num_buckets,
                                  cfg.relative_attention_max_distance, cfg.num_heads,
                                  bidirectional=False, name="relpos_bias")
    decode_position = None
    if decode:
      if length != 1:
        raise ValueError(f"decode mode takes one token per step, got length {length}")
      position_var = self.variable("cache", "decode_position", lambda: jnp.zeros((), jnp.int32))
      decode_position = position_var.value
      key_positions = jnp.arange(max_decode_length)
      query_positions = decode_position[None]
      causal = key_positions[None, None, None, :] <= decode_position
      self_bias = relpos(query_positions, key_positions, span=max_decode_length)
      self_bias = self_bias + _mask_to_bias(causal)
      if not init_cache:
        position_var.value = decode_position + 1
    else:
      positions = jnp.arange(length)
      position_bias = relpos(positions, positions, span=length)
      query_valid = (segment_ids > 0) if segment_ids is not None else jnp.ones((batch, length),
                                                                              bool)
      if cfg.attention_impl in ("pallas", "pallas_gpu"):
        self_bias = _fused_mask(cfg, query_valid, query_valid, segment_ids, segment_ids,
                                position_bias=position_bias, causal=True)
      elif use_fused_attention(cfg, deterministic=deterministic, query_length=length,
                               key_length=length):
        self_bias = FusedMask(
            position_bias=position_bias, causal=True,
            mask=None if segment_ids is None else _attention_mask(
                query_valid, query_valid, segment_ids, segment_ids))
      else:
        mask = positions[None, None, :, None] >= positions[None, None, None, :]
        if segment_ids is not None:
          mask = mask & _attention_mask(query_valid, query_valid, segment_ids, segment_ids)
        self_bias = position_bias + _mask_to_bias(mask)
    inputs = encoder_mask.shape[0]
    if not decode and inputs != batch:
      # G = batch / inputs teacher-forced rows per input (rows b * G + i), e.g. candidates
      # scored against one encoding: each group attends to its input's keys/values once.
      if batch % inputs or segment_ids is not None or encoder_segment_ids is not None:
        raise ValueError(f"Decoder: {batch} unpacked rows cannot share {inputs} inputs' "
                         "encodings (rows must come in equal groups per input, unpacked)")
      if not deterministic and cfg.dropout_rate > 0:
        raise ValueError("Decoder: rows sharing an encoding are for deterministic calls "
                         "(grouped cross-attention applies no attention dropout)")
    if decode or inputs != batch:
      # One row per input, as the cross-attention cache or the shared projection has.
      cross_bias = _mask_to_bias(encoder_mask[:, None, None, :].astype(bool))
    elif use_fused_attention(cfg, deterministic=deterministic, query_length=length,
                             key_length=encoder_mask.shape[1]):
      cross_bias = _fused_mask(cfg, query_valid, encoder_mask, segment_ids, encoder_segment_ids)
    else:
      cross_bias = _mask_to_bias(_attention_mask(
          query_valid, encoder_mask, segment_ids, encoder_segment_ids))
    x = _dropout(self, embeds, cfg.dropout_rate, deterministic)
    x = _constrain(x, ("batch", "length", "embed"))
    use_remat = cfg.remat and not decode
    layer_cls = nn.remat(DecoderLayer) if use_remat else DecoderLayer
    for i in range(cfg.num_decoder_layers):
      x = layer_cls(cfg, deterministic, decode, init_cache,
                    max_decode_length, name=f"layers_{i}")(
                        x, encoded, self_bias, cross_bias, decode_position)
    x = RMSNorm(cfg.layer_norm_epsilon, _dtype(cfg), name="decoder_norm")(x)
    hidden = _dropout(self, x, cfg.dropout_rate, deterministic)
    step = decode and not init_cache
    if cfg.tie_word_embeddings:
      # T5 1.0 rescales before the tied projection (Mesh TensorFlow convention).
      logits = self.shared_embedder.attend(hidden * (cfg.d_model ** -0.5), decode_step=step)
    else:
      logits = LogitsDense(cfg.vocab_size, name="logits_dense")(hidden, decode_step=step)
    return _constrain(logits, ("batch", "length", "vocab")), hidden


class T5(nn.Module):
  """The T5 encoder-decoder every jaxmoral model is built from.

  Attributes:
    config: Sizes and variant.
    with_scalar_head: Adds `scalar_head` (a linear map of decoder states to one number).
  """
  config: T5Config
  with_scalar_head: bool = False

  def setup(self):
    cfg = self.config
    self.token_embedder = Embed(cfg.vocab_size, cfg.d_model, _dtype(cfg), name="token_embedder")
    self.encoder = Encoder(cfg, name="encoder")
    self.decoder = Decoder(cfg, self.token_embedder, name="decoder")
    if self.with_scalar_head:
      self.scalar_head = heads.ScalarHead(name="scalar_head")

  def embed(self, tokens: Array) -> Array:
    """Token ids (batch, length) -> input embeddings (batch, length, d_model), activation dtype."""
    return self.token_embedder(tokens)

  # -- encoder ------------------------------------------------------------------------------
  def encode(self, encoder_input_tokens: Optional[Array] = None, *,
             encoder_embeds: Optional[Array] = None, encoder_mask: Optional[Array] = None,
             encoder_segment_ids: Optional[Array] = None, deterministic: bool = True) -> Array:
    """Encodes token ids or, for salience and soft prompts, given input embeddings."""
    if (encoder_input_tokens is None) == (encoder_embeds is None):
      raise ValueError("encode: give exactly one of encoder_input_tokens, encoder_embeds")
    if encoder_embeds is None:
      encoder_embeds = self.embed(encoder_input_tokens)
    if encoder_mask is None:
      if encoder_input_tokens is None:
        raise ValueError("encode: encoder_mask is required with encoder_embeds")
      encoder_mask = encoder_input_tokens != self.config.pad_token_id
    return self.encoder(encoder_embeds.astype(_dtype(self.config)), encoder_mask,
                        encoder_segment_ids, deterministic=deterministic)

  # -- decoder ------------------------------------------------------------------------------
  def decode(self, encoded: Optional[Array], encoder_mask: Array, decoder_input_tokens: Array, *,
             decoder_segment_ids: Optional[Array] = None,
             encoder_segment_ids: Optional[Array] = None, deterministic: bool = True,
             decode: bool = False, max_decode_length: Optional[int] = None,
             init_cache: bool = False) -> tuple[Array, Array]:
    """Decoder logits (float32) and final hidden states.

    Teacher forcing when `decode=False`. With `decode=True` the call takes one token per
    batch row and reads/writes the `cache` collection (make it with `init_cache`).

    In teacher forcing, `encoded`/`encoder_mask` may have fewer rows than
    `decoder_input_tokens`: G rows per input (rows `b * G + i`, deterministic and unpacked),
    which attend to one projection of their input's keys and values instead of G copies.
    """
    return self.decoder(self.embed(decoder_input_tokens), encoded, encoder_mask,
                        decoder_segment_ids, encoder_segment_ids, deterministic=deterministic,
                        decode=decode, init_cache=init_cache,
                        max_decode_length=max_decode_length)

  def init_cache(self, encoded: Array, encoder_mask: Array, max_decode_length: int, *,
                 rows_per_input: int = 1) -> Array:
    """Creates the `cache` collection: empty self-attention caches, projected encoder K/V.

    Call with `mutable=["cache"]`; the returned logits are meaningless. With
    `rows_per_input=G` the decoder runs G rows per input (rows `b * G + i`, samples or beams):
    the self-attention caches get G * batch rows, the encoder keys/values stay one per input,
    and every later step takes G * batch tokens with the same (batch, length) `encoder_mask`.
    """
    if not isinstance(rows_per_input, int) or rows_per_input < 1:
      raise ValueError(f"init_cache: rows_per_input must be a positive int, got "
                       f"{rows_per_input!r}")
    dummy = jnp.zeros((encoded.shape[0] * rows_per_input, 1), jnp.int32)
    return self.decode(encoded, encoder_mask, dummy, decode=True, init_cache=True,
                       max_decode_length=max_decode_length)[0]

  def score(self, hidden: Array) -> Array:
    """Scalar head on decoder states: (batch, length, d_model) -> (batch, length) float32."""
    if not self.with_scalar_head:
      raise ValueError("score: this T5 was built without with_scalar_head=True")
    return self.scalar_head(hidden)

  def __call__(self, encoder_input_tokens: Optional[Array], decoder_input_tokens: Array, *,
               encoder_embeds: Optional[Array] = None, encoder_mask: Optional[Array] = None,
               encoder_segment_ids: Optional[Array] = None,
               decoder_segment_ids: Optional[Array] = None, deterministic: bool = True,
               return_hidden: bool = False) -> Array | tuple[Array, Array]:
    """Teacher-forced logits (batch, target_length, vocab), float32."""
    if encoder_mask is None and encoder_input_tokens is not None:
      encoder_mask = encoder_input_tokens != self.config.pad_token_id
    encoded = self.encode(encoder_input_tokens, encoder_embeds=encoder_embeds,
                          encoder_mask=encoder_mask, encoder_segment_ids=encoder_segment_ids,
                          deterministic=deterministic)
    logits, hidden = self.decode(encoded, encoder_mask, decoder_input_tokens,
                                 decoder_segment_ids=decoder_segment_ids,
                                 encoder_segment_ids=encoder_segment_ids,
                                 deterministic=deterministic)
    if self.with_scalar_head:
      # Touch the head so `init` creates its parameters with the rest.
      _ = self.score(hidden[:, :1])
    return (logits, hidden) if return_hidden else logits


def target_logit_rows(params: Any, config: T5Config, tokens: Array) -> Array:
  """Rows of the output projection for `tokens`, (len(tokens), d_model) float32.

  `hidden[t] . rows[t]` is the logit of `tokens[t]` at decoder position t (the same number
  as `logits[t, tokens[t]]`) without projecting onto the whole vocabulary, so gradients of
  chosen logits (salience) skip the (length, vocab) projection and its transpose.
  """
  if config.tie_word_embeddings:  # T5 1.0: the embedding, behind the d_model ** -0.5 rescale.
    rows = jnp.take(params["token_embedder"]["embedding"], tokens, axis=0)
    return rows.astype(jnp.float32) * (config.d_model ** -0.5)
  kernel = params["decoder"]["logits_dense"]["kernel"]
  return jnp.take(kernel, tokens, axis=1).T.astype(jnp.float32)


def shift_right(targets: Array, start_id: int = 0) -> Array:
  """Decoder inputs for teacher forcing: targets shifted right behind the start id."""
  shifted = jnp.zeros_like(targets).at[:, 1:].set(targets[:, :-1])
  shifted = shifted.at[:, 0].set(start_id)
  return jnp.where(shifted == -100, 0, shifted)


def init_params(model: T5, rng: Array, *, batch_size: int = 1, encoder_length: int = 8,
                decoder_length: int = 8) -> Any:
  """Randomly initialised (boxed, logically partitioned) parameters.

  The normals are drawn a few at a time (`_draw_normals`), not one call per parameter, so the
  values are this function's own: `model.init` alone draws others from the same key.
  """
  lengths = (batch_size, encoder_length, decoder_length)
  random_parameters = _random_parameters(model, lengths,
                                         jax.ShapeDtypeStruct(rng.shape, rng.dtype))
  token = _NORMAL_DRAWS.set(_draw_normals(random_parameters, rng))
  try:
    return _init(model, lengths, rng)
  finally:
    _NORMAL_DRAWS.reset(token)


def _init(model: T5, lengths: tuple[int, int, int], rng: Array) -> Any:
  batch_size, encoder_length, decoder_length = lengths
  enc = jnp.ones((batch_size, encoder_length), jnp.int32)
  dec = jnp.ones((batch_size, decoder_length), jnp.int32)
  return model.init({"params": rng, "dropout": rng}, enc, dec)["params"]


@functools.lru_cache(maxsize=64)
def _random_parameters(model: T5, lengths: tuple[int, int, int],
                       rng: jax.ShapeDtypeStruct) -> tuple[Any, ...]:
  """(path, shape, axes) of each random parameter, in creation order (an abstract init)."""
  listed: list[Any] = []
  token = _NORMAL_DRAWS.set(listed)
  try:
    jax.eval_shape(functools.partial(_init, model, lengths), rng)
  finally:
    _NORMAL_DRAWS.reset(token)
  return tuple(listed)
