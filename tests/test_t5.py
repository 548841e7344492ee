"""models/t5.py against the independent reference: transformers' PyTorch T5 on the same weights.

Random tiny T5 1.0 (ReLU, tied + rescaled head) and T5 1.1 (gated-gelu, untied) models are
built in PyTorch, converted with `hf_import.params_from_hf`, and compared on logits, encoder
states and relative-position buckets; the rest checks jaxmoral's own paths against each other
(cache decoding vs teacher forcing, embeddings vs ids, packing vs separate rows, dropout, bf16).
"""

from __future__ import annotations

import dataclasses
import functools

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import hf_logits  # noqa: E402
from jaxmoral import losses, trainer as trainer_lib  # noqa: E402
from jaxmoral.backends import cpu_kernels, cpu_products  # noqa: E402
from jaxmoral.models import hf_import  # noqa: E402
from jaxmoral.models import ops as ops_lib  # noqa: E402
from jaxmoral.models import t5  # noqa: E402
from jaxmoral.models.config import T5Config, t5_config  # noqa: E402

VOCAB = 160
VARIANTS = {
    "t5_1_0": dict(feed_forward_proj="relu", tie_word_embeddings=True),
    "t5_1_1": dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False),
}


@functools.lru_cache(maxsize=None)
def hf_model(variant: str):
  """(torch model, jaxmoral config, params) for a random tiny model of `variant`."""
  torch.manual_seed(0)
  hf_config = transformers.T5Config(
      vocab_size=VOCAB, d_model=48, d_kv=12, d_ff=96, num_layers=2, num_decoder_layers=2,
      num_heads=4, dropout_rate=0.0, **VARIANTS[variant])
  model = transformers.T5ForConditionalGeneration(hf_config).eval()
  with torch.no_grad():
    # HF's init sets every layer norm to 1; perturb all weights (relatively, keeping HF's
    # realistic scales) so a mixed-up or transposed tensor cannot hide.
    for p in model.parameters():
      p.mul_(1.0 + 0.3 * torch.randn_like(p))
    if not VARIANTS[variant]["tie_word_embeddings"]:
      # transformers 5 ties lm_head to shared on construction; T5 1.1 has its own head.
      model.lm_head.weight = torch.nn.Parameter(torch.randn(VOCAB, 48) * 48 ** -0.5)
  tensors = {k: v.detach().numpy() for k, v in model.state_dict().items()}
  config, params = hf_import.params_from_hf(tensors, model.config.to_dict())
  return model, config, params


@functools.lru_cache(maxsize=None)
def jitted(config: T5Config, method: str = "__call__", **static):
  """One compiled `T5(config).apply` per (config, method, static kwargs): fewer compiles."""
  model = t5.T5(config)
  return jax.jit(functools.partial(model.apply, method=getattr(t5.T5, method), **static))


@functools.lru_cache(maxsize=None)
def jitted_init_cache(config: T5Config, max_decode_length: int):
  """One compiled cache initialisation per (config, length): op by op, every op of the
  encoder-decoder cache would compile on its own."""
  model = t5.T5(config)

  @jax.jit
  def init_cache(params, encoded, mask):
    _, variables = model.apply({"params": params}, encoded, mask, max_decode_length,
                               method=t5.T5.init_cache, mutable=["cache"])
    return variables["cache"]
  return init_cache


def forward(config: T5Config, variables, enc, dec, **kwargs):
  """Teacher-forced logits of `config`. Every test takes them from one compiled forward per
  config and shapes, the one that also returns the hidden states (which
  test_target_logit_rows_give_the_chosen_logits reads): one compile instead of two."""
  return jitted(config, "__call__", return_hidden=True)(variables, enc, dec, **kwargs)[0]


def random_batch(seed: int, batch: int = 3, enc_len: int = 11, dec_len: int = 7):
  """Encoder ids with right padding of varying length, decoder inputs starting with 0."""
  rng = np.random.RandomState(seed)
  enc = rng.randint(2, VOCAB, (batch, enc_len)).astype(np.int32)
  for row, length in enumerate(rng.randint(3, enc_len + 1, batch)):
    enc[row, length:] = 0
  enc[0, -1] = 5  # At least one full row.
  dec = rng.randint(2, VOCAB, (batch, dec_len)).astype(np.int32)
  dec[:, 0] = 0
  return enc, dec


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_transformers(variant):
  model, config, params = hf_model(variant)
  assert config.tie_word_embeddings == (variant == "t5_1_0")
  enc, dec = random_batch(1)
  ours = np.asarray(forward(config, {"params": params}, enc, dec))
  ref = hf_logits(model, enc, dec)
  assert ours.dtype == np.float32 and ours.shape == ref.shape
  np.testing.assert_allclose(ours, ref, atol=1e-4 * max(1.0, np.abs(ref).max()), rtol=1e-4)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_encoder_outputs_match_transformers(variant):
  model, config, params = hf_model(variant)
  enc, _ = random_batch(2)
  ours = jitted(config, "encode")({"params": params}, enc)
  with torch.no_grad():
    ref = model.encoder(input_ids=torch.tensor(enc, dtype=torch.long),
                        attention_mask=torch.tensor(enc != 0)).last_hidden_state.numpy()
  valid = enc != 0
  np.testing.assert_allclose(np.asarray(ours)[valid], ref[valid], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets,max_distance", [(32, 128), (16, 40), (64, 256)])
def test_relative_position_buckets_match_transformers(bidirectional, num_buckets, max_distance):
  span = 300
  table = t5.relative_position_bucket_table(span, bidirectional, num_buckets, max_distance)
  relative = torch.arange(-span, span + 1)
  ref = transformers.models.t5.modeling_t5.T5Attention._relative_position_bucket(
      relative, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance)
  np.testing.assert_array_equal(table, ref.numpy())
  assert table.max() == num_buckets - 1  # 300 tokens reach the last (log-spaced) bucket.


def test_long_sequence_logits_match_transformers():
  """300 encoder / 200 decoder tokens: every bucket, both directions, inside the model."""
  model, config, params = hf_model("t5_1_1")
  enc, dec = random_batch(3, batch=1, enc_len=300, dec_len=200)
  enc[0] = np.random.RandomState(3).randint(2, VOCAB, 300)
  ours = np.asarray(forward(config, {"params": params}, enc, dec))
  ref = hf_logits(model, enc, dec)
  np.testing.assert_allclose(ours, ref, atol=1e-4 * max(1.0, np.abs(ref).max()), rtol=1e-4)


def test_bfloat16_activations_close_to_float32():
  _, config, params = hf_model("t5_1_1")
  enc, dec = random_batch(1)  # The batch of test_logits_match_transformers: reuses its compile.
  f32 = np.asarray(forward(config, {"params": params}, enc, dec))
  bf16 = forward(config.replace(dtype="bfloat16"), {"params": params}, enc, dec)
  assert bf16.dtype == jnp.float32  # Logits stay float32 whatever the activation dtype.
  bf16 = np.asarray(bf16)
  assert np.abs(bf16 - f32).max() > 1e-4  # The dtype really changed the computation.
  assert np.abs(bf16 - f32).max() < 0.05 * np.abs(f32).max()
  assert np.corrcoef(bf16.ravel(), f32.ravel())[0, 1] > 0.999


def test_dropout_differs_and_is_reproducible():
  _, config, params = hf_model("t5_1_1")
  dropped = config.replace(dropout_rate=0.2)
  enc, dec = random_batch(1)  # The batch of test_logits_match_transformers: reuses its compile.
  train = jitted(dropped, deterministic=False)
  first = train({"params": params}, enc, dec, rngs={"dropout": jax.random.PRNGKey(1)})
  again = train({"params": params}, enc, dec, rngs={"dropout": jax.random.PRNGKey(1)})
  other = train({"params": params}, enc, dec, rngs={"dropout": jax.random.PRNGKey(2)})
  clean = forward(config, {"params": params}, enc, dec)
  np.testing.assert_array_equal(first, again)
  assert np.abs(first - clean).max() > 1e-2
  assert np.abs(first - other).max() > 1e-2


@functools.lru_cache(maxsize=None)
def decode_backend(packed: bool):
  """One backend object per kind, so that the compiled steps below are shared by the tests."""
  from jaxmoral import decoding  # pylint: disable=g-import-not-at-top
  if packed:
    return decoding.PackedKernelBackend()
  return decoding.DecodeBackend()


@functools.lru_cache(maxsize=None)
def jitted_step(config: T5Config, max_decode_length: int, packed=None):
  """One compiled cached-decoding step per (config, cache length, backend): None is the plain
  step (no backend: XLA's ops), False XLA over stacked kernels, True the packed CPU kernels.
  Parameters, mask and prepared kernels are arguments, so the kv-cache test and the
  prepared-kernel cases share their programs."""
  model = t5.T5(config)

  def step(params, mask, cache, token, prepared):
    ops = None if packed is None else decode_backend(packed).step_ops(prepared)
    (logits, _), new = model.apply({"params": params, "cache": cache}, None, mask, token,
                                   decode=True, max_decode_length=max_decode_length,
                                   step_ops=ops, method=t5.T5.decode, mutable=["cache"])
    return new["cache"], logits[:, 0]
  return jax.jit(step)


@functools.lru_cache(maxsize=None)
def prepared_kernels(variant: str, packed: bool):
  """The backend's kernels for `variant`'s weights, prepared in one compiled program."""
  _, config, params = hf_model(variant)
  model = t5.T5(config)
  return jax.jit(lambda p: decode_backend(packed).prepare(model, p))(params)


def decode_by_steps(config, params, encoded, mask, dec, max_len, packed=None, prepared=None):
  """(batch, len, vocab) logits of one cached step per decoder input token."""
  cache = jitted_init_cache(config, max_len)(params, encoded, mask)
  step = jitted_step(config, max_len, packed)
  stepped = []
  for i in range(dec.shape[1]):
    cache, logits = step(params, mask, cache, dec[:, i:i + 1], prepared)
    stepped.append(logits)
  return np.stack(stepped, axis=1)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_kv_cache_decoding_equals_teacher_forcing(variant):
  _, config, params = hf_model(variant)
  enc, dec = random_batch(6)  # The shapes of the tests above: reuses their compiles.
  mask = enc != 0
  forced = forward(config, {"params": params}, enc, dec)
  encoded = jitted(config, "encode")({"params": params}, enc)
  max_len = dec.shape[1] + 3  # Cache longer than the decoded prefix, as in sampling.
  stepped = decode_by_steps(config, params, encoded, mask, dec, max_len)
  np.testing.assert_allclose(stepped, forced, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("packed", [False, True], ids=["stacked", "packed"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_decoding_with_prepared_decode_kernels(variant, batch, packed):
  """A backend's step ops (XLA over stacked kernels; batch 1 takes the split one-row
  products; or the CPU kernels: `packed_matmul` for every product of a step,
  `decode_attention` for its attention) give the plain step's logits. The model itself
  knows no backend: the ops are an argument of each traced step."""
  if packed and not cpu_kernels.available():
    pytest.skip("no packed CPU kernel here (no C++ compiler)")
  _, config, params = hf_model(variant)
  enc, dec = random_batch(7)  # Batch 3: the shapes of the tests above.
  forced = forward(config, {"params": params}, enc, dec)
  encoded = jitted(config, "encode")({"params": params}, enc)
  # Batch 1 is one padded row of the batch of 3 (rows are independent in teacher forcing and
  # the encoder): its teacher-forced logits and encoding need no programs of their own.
  row = int(np.argmin((enc != 0).sum(1)))
  rows = slice(0, 3) if batch == 3 else slice(row, row + 1)
  enc, dec, forced, encoded = enc[rows], dec[rows], forced[rows], encoded[rows]
  assert (enc == 0).any()
  mask = enc != 0
  kernels = prepared_kernels(variant, packed)
  per_layer = 6 if packed else (2 if config.is_gated else 1)  # Packed: every step product.
  assert len(kernels) == config.num_decoder_layers * per_layer + (1 if packed else 0)
  # Batch 3 decodes into a cache longer than the prefix (the kv-cache test's programs),
  # batch 1 into one exactly as long.
  max_len = dec.shape[1] + (3 if batch == 3 else 0)
  cache = jitted_init_cache(config, max_len)(params, encoded, mask)
  for backend, prepared in ((None, None), (packed, kernels)):
    hlo = jitted_step(config, max_len, backend).lower(
        params, mask, cache, dec[:, :1], prepared).as_text()
    for target in (cpu_kernels.MATMUL_TARGET, cpu_kernels.ATTENTION_TARGET):
      assert (target in hlo) == (backend is True), target
  plain = decode_by_steps(config, params, encoded, mask, dec, max_len)
  with_kernels = decode_by_steps(config, params, encoded, mask, dec, max_len, packed, kernels)
  np.testing.assert_allclose(plain, forced, atol=1e-4, rtol=1e-4)
  np.testing.assert_allclose(with_kernels, plain, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel_shape", [(64, 40), (64, 3, 24), (33, 16)])
def test_vector_matmul_matches_numpy(kernel_shape):
  rng = np.random.default_rng(0)
  row = rng.standard_normal((1, kernel_shape[0])).astype(np.float32)
  kernel = rng.standard_normal(kernel_shape).astype(np.float32)
  got = np.asarray(jax.jit(ops_lib.vector_matmul)(row, kernel))
  want = np.tensordot(row.astype(np.float64), kernel.astype(np.float64), axes=1)
  assert got.shape == want.shape
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel_shape,preferred", [((5, 7), None), ((5, 3, 4), jnp.float32)])
def test_cpu_rows_matmul_gradients_match_numpy(kernel_shape, preferred):
  """The CPU product's own backward pass: d_rows = g k^T, d_kernel = rows^T g (float64 NumPy)."""
  rng = np.random.default_rng(0)
  rows = rng.standard_normal((6, 5)).astype(np.float32)
  kernel = rng.standard_normal(kernel_shape).astype(np.float32)
  cot = rng.standard_normal((6, *kernel_shape[1:])).astype(np.float32)
  # Compiled: op by op, every op of the product and its backward would compile on its own.
  out, (d_rows, d_kernel) = jax.jit(lambda r, k, g: (lambda o, vjp: (o, vjp(g)))(
      *jax.vjp(lambda r, k: cpu_products.cpu_rows_matmul(r, k, preferred), r, k)))(
          rows, kernel, jnp.asarray(cot))
  r64, k64, g64 = (a.astype(np.float64).reshape(a.shape[0], -1) for a in (rows, kernel, cot))
  np.testing.assert_allclose(np.asarray(out).reshape(6, -1), r64 @ k64, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(d_rows), g64 @ k64.T, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(d_kernel).reshape(5, -1), r64.T @ g64, rtol=1e-5,
                             atol=1e-5)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_loss_gradients_match_transformers_backward(variant):
  """Every parameter's gradient of the teacher-forced loss against PyTorch's backward pass
  on the same weights (on CPU, where the dense layers take `cpu_rows_matmul`'s backward).

  The same compiled program shows that on CPU no product of the backward contracts both
  operands' first axis (a weight gradient as rows^T @ g, which XLA:CPU runs outside
  YNNPACK, bench/RESULTS.md)."""
  model, config, params = hf_model(variant)
  enc, _ = random_batch(4)
  targets = np.random.RandomState(5).randint(2, VOCAB, (3, 7)).astype(np.int32)
  batch = {"encoder_input_tokens": enc, "decoder_target_tokens": targets,
           "decoder_input_tokens": np.asarray(t5.shift_right(jnp.asarray(targets))),
           "decoder_loss_weights": np.ones_like(targets)}
  assert cpu_products.tracing_for_cpu()
  loss_fn = losses.seq2seq_loss_fn(t5.T5(config), z_loss=0.0)
  compiled = jax.jit(jax.value_and_grad(lambda p: loss_fn(p, batch, None)[0])).lower(
      params).compile()
  dots = [line for line in compiled.as_text().splitlines() if " dot(" in line]
  assert dots
  first_axis_both = [line for line in dots if "lhs_contracting_dims={0}" in line
                     and "rhs_contracting_dims={0}" in line and "batch_dims" not in line]
  assert not first_axis_both, first_axis_both[0]
  loss, grads = compiled(params)
  model.zero_grad(set_to_none=True)
  out = model(input_ids=torch.tensor(enc, dtype=torch.long),
              attention_mask=torch.tensor(enc != 0),
              decoder_input_ids=torch.tensor(batch["decoder_input_tokens"], dtype=torch.long),
              labels=torch.tensor(targets, dtype=torch.long))
  out.loss.backward()
  # The import is linear (copies, transposes, reshapes), so it maps gradients as it maps
  # weights; tied names share one gradient, as they share one weight.
  torch_grads = {name: p.grad.numpy().copy()
                 for name, p in model.named_parameters(remove_duplicate=False)}
  model.zero_grad(set_to_none=True)
  _, want = hf_import.params_from_hf(torch_grads, model.config.to_dict())
  np.testing.assert_allclose(float(loss), out.loss.item(), rtol=1e-5)
  got = flax.traverse_util.flatten_dict(jax.device_get(grads))
  want = flax.traverse_util.flatten_dict(want)
  assert sorted(got) == sorted(want)
  for path in got:
    scale = float(np.abs(want[path]).max())
    np.testing.assert_allclose(got[path], want[path], rtol=1e-4, atol=1e-5 * scale,
                               err_msg="/".join(path))


def test_encode_from_embeddings_equals_from_tokens():
  _, config, params = hf_model("t5_1_1")
  enc, dec = random_batch(1)
  variables = {"params": params}
  embeds = jitted(config, "embed")(variables, enc)
  np.testing.assert_array_equal(embeds, params["token_embedder"]["embedding"][enc])
  encode = jitted(config, "encode")
  from_embeds = encode(variables, encoder_embeds=embeds, encoder_mask=enc != 0)
  np.testing.assert_allclose(from_embeds, encode(variables, enc), atol=1e-5)
  logits = forward(config, variables, None, dec, encoder_embeds=embeds, encoder_mask=enc != 0)
  np.testing.assert_allclose(logits, forward(config, variables, enc, dec), atol=1e-4, rtol=1e-5)
  with pytest.raises(ValueError, match="encoder_mask is required"):
    t5.T5(config).apply(variables, encoder_embeds=embeds, method=t5.T5.encode)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_target_logit_rows_give_the_chosen_logits(variant):
  """hidden . target_logit_rows == PyTorch's logit of each chosen token (tied and untied)."""
  model, config, params = hf_model(variant)
  enc, dec = random_batch(4)
  targets = np.random.RandomState(5).randint(0, VOCAB, dec.shape).astype(np.int32)
  _, hidden = jitted(config, "__call__", return_hidden=True)({"params": params}, enc, dec)
  for row in range(dec.shape[0]):
    rows = t5.target_logit_rows(params, config, jnp.asarray(targets[row]))
    got = np.sum(np.asarray(hidden[row]) * np.asarray(rows), axis=-1)
    want = hf_logits(model, enc, dec)[row, np.arange(dec.shape[1]), targets[row]]
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


@functools.lru_cache(maxsize=None)
def one_layer_tiny():
  """(config, params with a scalar head) of a tiny T5 with one layer each side, initialised
  once for the tests below (a T5 without the head ignores the head's parameters)."""
  config = t5_config(size="tiny", vocab_size=64, num_encoder_layers=1, num_decoder_layers=1)
  model = t5.T5(config, with_scalar_head=True)
  return config, flax.linen.meta.unbox(jax.jit(lambda r: t5.init_params(model, r))(
      jax.random.PRNGKey(0)))


def test_scalar_head_shapes_and_values():
  # One layer each side: the head reads the final hidden state, whatever the depth.
  config, params = one_layer_tiny()
  model = t5.T5(config, with_scalar_head=True)
  enc, dec = np.ones((2, 5), np.int32), np.zeros((2, 4), np.int32)
  logits, hidden = jax.jit(functools.partial(model.apply, return_hidden=True))(
      {"params": params}, enc, dec)
  assert logits.shape == (2, 4, 64) and hidden.shape == (2, 4, config.d_model)
  scores = jax.jit(functools.partial(model.apply, method=t5.T5.score))({"params": params},
                                                                        hidden)
  assert scores.shape == (2, 4) and scores.dtype == jnp.float32
  head = params["scalar_head"]
  np.testing.assert_allclose(scores, np.asarray(hidden) @ head["kernel"][:, 0] + head["bias"][0],
                             atol=1e-5)
  with pytest.raises(ValueError, match="with_scalar_head"):
    t5.T5(config).apply({"params": params}, hidden, method=t5.T5.score)


def test_packed_segments_equal_separate_rows():
  """Two examples packed in one row (segment ids) give the logits they get alone."""
  _, config, params = hf_model("t5_1_1")
  rng = np.random.RandomState(8)
  # Packed with trailing padding into 11 encoder / 7 decoder tokens, and in a batch of 3: the
  # shapes of random_batch, so the forwards without segment ids reuse the other tests' program.
  lengths = [(4, 3), (5, 2)]  # (encoder, target) per example.
  encs = [rng.randint(2, VOCAB, n).astype(np.int32) for n, _ in lengths]
  targets = [rng.randint(2, VOCAB, m).astype(np.int32) for _, m in lengths]
  # Alone: one row each, right-padded to a common shape (padding cannot reach valid positions).
  alone_enc = np.zeros((3, 11), np.int32)
  alone_dec = np.zeros((3, 7), np.int32)
  for row, (enc, tgt) in enumerate(zip(encs, targets)):
    alone_enc[row, :len(enc)] = enc
    alone_dec[row, :len(tgt)] = np.asarray(t5.shift_right(tgt[None]))[0]
  alone = np.asarray(forward(config, {"params": params}, alone_enc, alone_dec))
  pad_enc, pad_dec = 2, 2  # Trailing padding in the packed row too.
  packed_enc, packed_dec = np.zeros((3, 11), np.int32), np.zeros((3, 7), np.int32)
  enc_seg, dec_seg = np.zeros((3, 11), np.int32), np.zeros((3, 7), np.int32)
  packed_enc[0] = np.concatenate(encs + [np.zeros(pad_enc, np.int32)])
  enc_seg[0] = np.concatenate([np.full(n, i + 1) for i, (n, _) in enumerate(lengths)] +
                              [np.zeros(pad_enc)])
  packed_dec[0] = np.concatenate([np.asarray(t5.shift_right(t[None]))[0] for t in targets] +
                                 [np.zeros(pad_dec, np.int32)])
  dec_seg[0] = np.concatenate([np.full(m, i + 1) for i, (_, m) in enumerate(lengths)] +
                              [np.zeros(pad_dec)])
  packed = np.asarray(forward(config, {"params": params}, packed_enc, packed_dec,
                              encoder_segment_ids=enc_seg,
                              decoder_segment_ids=dec_seg))[0]
  np.testing.assert_allclose(packed[:3], alone[0, :3], atol=1e-4, rtol=1e-4)
  np.testing.assert_allclose(packed[3:5], alone[1, :2], atol=1e-4, rtol=1e-4)
  assert np.all(np.isfinite(packed))
  # Without segment ids the second example would see the first: the mask matters.
  unmasked = np.asarray(forward(config, {"params": params}, packed_enc, packed_dec))[0]
  assert np.abs(unmasked[3:5] - alone[1, :2]).max() > 1e-2


def test_config_validation_names_the_field():
  with pytest.raises(ValueError, match="d_model"):
    T5Config(d_model=0)
  with pytest.raises(ValueError, match="feed_forward_proj"):
    T5Config(feed_forward_proj="swish")


def _forced_fused_config(config: T5Config, **changes) -> T5Config:
  """`config` with attention_impl="cudnn" even in float32.

  The config refuses "cudnn" in float32 because cuDNN has no float32 kernel; these tests run
  the fused path through JAX's reference implementation (`fused_attention_backend="xla"`),
  which takes float32, so that a mistake in the masks, lengths or bias shows at 1e-5.
  """
  fused = dataclasses.replace(config, attention_impl="einsum", fused_attention_backend="xla",
                              **changes)
  object.__setattr__(fused, "attention_impl", "cudnn")
  return fused


def _packed_batch():
  """One packed row of two examples (encoder 5 + 6 tokens, targets 4 + 3) and padding."""
  enc = np.array([[7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 0, 0]], np.int32)
  enc_seg = np.array([[1] * 5 + [2] * 6 + [0, 0]], np.int32)
  dec_tokens = np.array([[21, 22, 23, 24, 31, 32, 33, 0, 0]], np.int32)
  dec_seg = np.array([[1] * 4 + [2] * 3 + [0, 0]], np.int32)
  dec_in = np.array([[0, 21, 22, 23, 0, 31, 32, 0, 0]], np.int32)
  return {"encoder_input_tokens": enc, "decoder_input_tokens": dec_in,
          "decoder_target_tokens": dec_tokens, "decoder_loss_weights": (dec_seg > 0),
          "encoder_segment_ids": enc_seg, "decoder_segment_ids": dec_seg}


def _padded_batch():
  """Four right-padded rows (encoder 12, decoder 6)."""
  enc, dec = random_batch(21, batch=4, enc_len=12, dec_len=6)
  enc[0] = np.where(enc[0] == 0, 3, enc[0])  # Right padding only: row 0 had a gap.
  assert all(np.all(np.diff((row != 0).astype(int)) <= 0) for row in enc)
  assert (enc == 0).any()
  targets = np.concatenate([dec[:, 1:], np.full((4, 1), 1, np.int32)], axis=1)
  return {"encoder_input_tokens": enc, "decoder_input_tokens": dec,
          "decoder_target_tokens": targets}


@functools.lru_cache(maxsize=None)
def _logits_grads_loss(cfg: T5Config, packed: bool):
  """(logits, grads, loss) of `cfg` on the packed or the padded batch; cached, so the einsum
  reference of the padded batch is computed once for both of its fused cases."""
  batch = _packed_batch() if packed else _padded_batch()
  model = t5.T5(cfg)
  loss_fn = losses.seq2seq_loss_fn(model)
  @jax.jit  # Gradients and logits in one program: one compile per configuration.
  def run(p, b):
    grads, metrics = jax.grad(lambda p: loss_fn(p, b, None), has_aux=True)(p)
    logits = model.apply({"params": p}, b["encoder_input_tokens"], b["decoder_input_tokens"],
                         encoder_segment_ids=b.get("encoder_segment_ids"),
                         decoder_segment_ids=b.get("decoder_segment_ids"))
    return logits, grads, metrics["loss"]
  logits, grads, loss = run(hf_model("t5_1_1")[2], batch)
  return np.asarray(logits), grads, float(loss)


@pytest.mark.parametrize("case", ["padding_mask", "key_lengths", "packed"])
def test_fused_attention_path_matches_einsum(case):
  """attention_impl="cudnn" (run by JAX's reference kernel) gives einsum's logits and grads.

  Covers the three ways the fused path masks: a dense padding mask, per-row key lengths
  (`right_padded_inputs`) and packed segments with the causal flag; the gradient of the
  relative-position embeddings goes through the fused kernel's bias.
  """
  _, config, _ = hf_model("t5_1_1")
  packed = case == "packed"
  batch = _packed_batch() if packed else _padded_batch()
  einsum_cfg = dataclasses.replace(config, attention_impl="einsum")
  fused_cfg = _forced_fused_config(config, right_padded_inputs=(case == "key_lengths"))
  outputs = {"einsum": _logits_grads_loss(einsum_cfg, packed),
             "fused": _logits_grads_loss(fused_cfg, packed)}
  valid = np.asarray(batch.get("decoder_segment_ids", np.ones((4, 6)))) > 0
  np.testing.assert_allclose(outputs["fused"][0][valid], outputs["einsum"][0][valid],
                             atol=2e-5, rtol=1e-5)
  np.testing.assert_allclose(outputs["fused"][2], outputs["einsum"][2], rtol=1e-5)
  for path, got, want in zip(
      trainer_lib.param_paths(outputs["einsum"][1]),
      jax.tree_util.tree_leaves(outputs["fused"][1]),
      jax.tree_util.tree_leaves(outputs["einsum"][1])):
    scale = float(np.abs(want).max()) + 1e-12
    assert float(np.abs(np.asarray(got) - np.asarray(want)).max()) <= 1e-4 * scale, path
  relpos = outputs["einsum"][1]["encoder"]["relpos_bias"]["rel_embedding"]
  assert float(np.abs(relpos).max()) > 0  # The bias gradient is really exercised.


def _uses_fused(config: T5Config, **call) -> bool:
  return ops_lib.ModelOps.for_config(config).use_fused_attention(**call)


def test_attention_impl_choice_and_validation():
  cfg = t5_config(size="tiny", dtype="bfloat16")
  # On a CPU "auto" is einsum; einsum is einsum everywhere; cudnn is cudnn.
  assert not _uses_fused(cfg, deterministic=True, query_length=8, key_length=8)
  assert _uses_fused(cfg.replace(attention_impl="cudnn"), deterministic=False,
                         query_length=7, key_length=8)
  assert not _uses_fused(cfg.replace(attention_impl="einsum"), deterministic=True,
                         query_length=8, key_length=8)
  with pytest.raises(ValueError, match="attention_impl"):
    T5Config(attention_impl="flash")


def test_auto_attention_takes_cudnn_only_where_it_applies(monkeypatch):
  monkeypatch.setattr(ops_lib, "cudnn_attention_available", lambda: True)  # As on a CUDA GPU.
  bf16 = t5_config(size="tiny", dtype="bfloat16")
  assert _uses_fused(bf16, deterministic=False, query_length=8, key_length=16)
  assert not _uses_fused(bf16.replace(dtype="float32"), deterministic=True,
                         query_length=8, key_length=8)
  assert not _uses_fused(bf16, deterministic=True, query_length=7, key_length=8)
  dropout = bf16.replace(dropout_rate=0.1)
  assert not _uses_fused(dropout, deterministic=False, query_length=8, key_length=8)
  assert _uses_fused(dropout, deterministic=True, query_length=8, key_length=8)
  assert not _uses_fused(bf16.replace(d_kv=12), deterministic=True,
                         query_length=8, key_length=8)
  with pytest.raises(ValueError, match="bfloat16 or float16"):
    T5Config(attention_impl="cudnn", dtype="float32")
  with pytest.raises(ValueError, match="dropout"):
    T5Config(attention_impl="cudnn", dtype="bfloat16", dropout_rate=0.1)
  with pytest.raises(ValueError, match="d_kv"):
    T5Config(attention_impl="cudnn", dtype="bfloat16", d_kv=12)


def test_architecture_ignores_how_to_compute():
  tiny = t5_config(size="tiny")
  computed_differently = tiny.replace(dtype="bfloat16", attention_impl="einsum", remat=True,
                                      right_padded_inputs=True, dropout_rate=0.1,
                                      fused_attention_backend="xla", gpu_bias_as_diagonals=True,
                                      cpu_weight_gradients="autodiff")
  assert computed_differently.architecture() == tiny.architecture()
  assert tiny.replace(d_ff=256).architecture() != tiny.architecture()


def test_teacher_forced_rows_sharing_an_encoding_equal_repeated_encodings():
  """G decoder rows per input against one encoding = the same rows against G copies of it."""
  # One layer each side: the grouping is in the cross-attention every decoder layer shares.
  cfg, params = one_layer_tiny()
  model = t5.T5(cfg)
  rng = np.random.default_rng(0)
  inputs = rng.integers(2, 64, (2, 7)).astype(np.int32)
  inputs[1, 5:] = 0  # Padding, so the shared mask matters.
  targets = rng.integers(2, 64, (2 * 3, 5)).astype(np.int32)
  mask = inputs != 0

  # Compiled: op by op, every op of the model and its gradient would compile on its own.
  encode = jax.jit(lambda p: model.apply({"params": p}, inputs, encoder_mask=mask,
                                         method=t5.T5.encode))
  decode = jax.jit(lambda p, enc, enc_mask: model.apply({"params": p}, enc, enc_mask, targets,
                                                        method=t5.T5.decode))
  decode_grad = jax.jit(jax.grad(lambda p, enc, enc_mask: decode(p, enc, enc_mask)[0].sum()))

  def run(rows_per_input):
    encoded = encode(params)
    enc, enc_mask = encoded, mask
    if rows_per_input:
      enc, enc_mask = np.repeat(encoded, 3, axis=0), np.repeat(mask, 3, axis=0)
    logits, hidden = decode(params, enc, enc_mask)
    return logits, hidden, decode_grad(params, enc, enc_mask)

  shared, repeated = run(False), run(True)
  np.testing.assert_allclose(shared[0], repeated[0], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(shared[1], repeated[1], rtol=1e-5, atol=1e-5)
  for a, b in zip(jax.tree_util.tree_leaves(shared[2]), jax.tree_util.tree_leaves(repeated[2])):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
  encoded = encode(params)
  with pytest.raises(ValueError, match="equal groups"):
    model.apply({"params": params}, encoded, mask, targets[:5], method=t5.T5.decode)
  dropout = t5.T5(dataclasses.replace(cfg, dropout_rate=0.1))
  with pytest.raises(ValueError, match="deterministic"):
    dropout.apply({"params": params}, encoded, mask, targets, deterministic=False,
                  method=t5.T5.decode, rngs={"dropout": jax.random.PRNGKey(1)})


def test_decode_step_ops_are_explicit_arguments_of_cached_steps_only():
  """A cached decoding step multiplies and attends through the `step_ops` it is given (every
  product of the step, keyed by module path); teacher forcing and building the cache take
  none, and refuse them."""
  cfg = t5_config(size="tiny", vocab_size=64, num_decoder_layers=2)
  model = t5.T5(cfg)
  params = jax.eval_shape(lambda r: flax.core.meta.unbox(t5.init_params(model, r)),
                          jax.random.PRNGKey(0))
  encoded = jax.ShapeDtypeStruct((2, 5, cfg.d_model), jnp.float32)
  mask = jnp.ones((2, 5), bool)
  cache = jax.eval_shape(lambda p, e: model.apply(
      {"params": p}, e, mask, 4, method=t5.T5.init_cache, mutable=["cache"])[1]["cache"],
      params, encoded)

  class Recording(ops_lib.DecodeStepOps):
    def __init__(self):
      self.calls = []

    def products(self, path, names, x, kernels, **kwargs):
      self.calls.append(("/".join(path), names))
      return super().products(path, names, x, kernels, **kwargs)

    def attention(self, path, query, key, value, bias):
      self.calls.append(("/".join(path), "attention"))
      return None

  recording = Recording()
  jax.eval_shape(lambda p, c: model.apply(
      {"params": p, "cache": c}, None, mask, jnp.zeros((2, 1), jnp.int32), decode=True,
      max_decode_length=4, step_ops=recording, method=t5.T5.decode, mutable=["cache"]),
      params, cache)
  from jaxmoral import decoding  # pylint: disable=g-import-not-at-top
  expected = {tuple(key.split(":")[0].split("/")) for key in decoding.decoder_step_kernels(
      flax.core.meta.unbox(params))}
  products = [tuple(path.split("/")) for path, names in recording.calls if names != "attention"]
  assert sorted(products) == sorted(expected)  # One call per product the backends prepare.
  assert sum(names == "attention" for _, names in recording.calls) == 2 * cfg.num_decoder_layers
  with pytest.raises(ValueError, match="cached decoding steps"):
    jax.eval_shape(lambda p: model.apply(
        {"params": p}, encoded, mask, jnp.zeros((2, 3), jnp.int32),
        step_ops=ops_lib.DecodeStepOps(), method=t5.T5.decode), params)


@pytest.mark.parametrize("scalar_head", [False, True])
def test_abstract_params_are_what_init_params_makes(scalar_head):
  """The kept shapes (for shardings, loads and compiles) are those of real parameters: the
  same tree, shapes, dtypes and logical axes as `init_params` gives, traced once."""
  config = t5_config(size="tiny", vocab_size=VOCAB, d_model=16, d_kv=4, d_ff=32,
                     num_encoder_layers=1, num_decoder_layers=1)
  model = t5.T5(config, with_scalar_head=scalar_head)
  made = t5.init_params(model, jax.random.PRNGKey(3))
  kept = t5.abstract_params(model)
  is_box = lambda x: isinstance(x, flax.linen.LogicallyPartitioned)  # noqa: E731
  made_leaves, made_tree = jax.tree_util.tree_flatten(made, is_leaf=is_box)
  kept_leaves, kept_tree = jax.tree_util.tree_flatten(kept, is_leaf=is_box)
  assert kept_tree == made_tree
  for k, m in zip(kept_leaves, made_leaves, strict=True):
    assert isinstance(k.value, jax.ShapeDtypeStruct)
    assert (k.value.shape, k.value.dtype, k.names) == (m.value.shape, m.value.dtype, m.names)
  assert ("scalar_head" in kept) == scalar_head
  assert t5.abstract_params(t5.T5(config, with_scalar_head=scalar_head)) is kept
