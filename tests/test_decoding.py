"""Tests for jaxmoral.decoding against teacher-forced recomputation and NumPy references."""

from unittest import mock

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxmoral import decoding
from jaxmoral.backends import cpu_kernels
from jaxmoral.models.config import t5_config
from jaxmoral.models.t5 import T5, init_params, shift_right

EOS = 1
T = 12


@pytest.fixture(scope="module")
def setup():
  model = T5(t5_config(size="tiny", num_encoder_layers=1, num_decoder_layers=1))
  params = _init(model, 0)
  # Scale the EOS column of the output layer so that some rows stop early and some do not:
  # exercises the after-EOS zeros and the per-row lengths.
  kernel = params["decoder"]["logits_dense"]["kernel"]
  params = jax.tree.map(lambda a: a, params)
  # Compiled (the same values as op by op, where each op would compile on its own).
  params["decoder"]["logits_dense"]["kernel"] = jax.jit(lambda k: k.at[:, EOS].multiply(3.0))(
      kernel)
  inputs = np.array(jax.jit(lambda key: jax.random.randint(key, (4, 7), 2, 512))(
      jax.random.PRNGKey(1)), np.int32)
  inputs[1, 5:] = 0  # Padding in one row.

  @jax.jit
  def teacher_forced(params, inputs, targets):
    """Full recomputation without a cache: (batch, T, vocab) logits for every prefix."""
    return model.apply({"params": params}, inputs, shift_right(targets))

  return model, params, inputs, teacher_forced


def _init(model, seed):
  """The model's parameters, initialised in one compiled program (op by op, every op of the
  initialisation would compile on its own); the same values as an eager init."""
  return nn.unbox(jax.jit(lambda rng: init_params(model, rng))(jax.random.PRNGKey(seed)))


def _lengths_from_eos(tokens):
  """Independent lengths: first EOS position + 1, else the full width."""
  has = (tokens == EOS).any(-1)
  return np.where(has, (tokens == EOS).argmax(-1) + 1, tokens.shape[-1])


def _np_log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  with np.errstate(divide="ignore"):
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _np_process(logits, *, temperature, top_k, top_p, banned=None):
  """NumPy reference of the sampled-from distribution: log-probs with -inf outside it."""
  x = logits.astype(np.float64).copy()
  if banned is not None:
    x[banned] = -np.inf
  x = x / temperature
  if top_k:
    kth = np.sort(x)[::-1][top_k - 1]
    order = np.argsort(-x, kind="stable")
    keep = np.zeros(x.shape, bool)
    keep[order[:top_k]] = True
    assert (x[keep] >= kth).all()
    x[~keep] = -np.inf
  if top_p < 1.0:
    order = np.argsort(-x, kind="stable")
    probs = np.exp(_np_log_softmax(x))[order]
    before = np.cumsum(probs) - probs
    drop = order[(before >= top_p) & (np.arange(len(x)) > 0)]
    x[drop] = -np.inf
  return _np_log_softmax(x)


def _np_banned(prefix, n, vocab):
  """Tokens that complete an n-gram already in `prefix` (plain Python)."""
  banned = np.zeros(vocab, bool)
  if len(prefix) < n - 1:
    return banned
  tail = tuple(prefix[len(prefix) - n + 1:]) if n > 1 else ()
  for j in range(len(prefix) - n + 1):
    if tuple(prefix[j:j + n - 1]) == tail:
      banned[prefix[j + n - 1]] = True
  return banned


def test_greedy_cached_equals_full_recomputation(setup):
  model, params, inputs, teacher_forced = setup
  out = decoding.sample(model, params, encoder_input_tokens=inputs, max_decode_length=T,
                        greedy=True)
  # Reference: argmax loop, each step recomputing the whole prefix without a cache.
  ref = np.zeros((len(inputs), T), np.int32)
  ref_lp = np.zeros((len(inputs), T), np.float32)
  done = np.zeros(len(inputs), bool)
  for t in range(T):
    logits = np.asarray(teacher_forced(params, inputs, jnp.asarray(ref)))[:, t]
    token = np.where(done, 0, logits.argmax(-1))
    ref[:, t] = token
    ref_lp[:, t] = np.where(done, 0.0, _np_log_softmax(logits)[np.arange(len(token)), token])
    done |= token == EOS
  np.testing.assert_array_equal(np.asarray(out.tokens[:, 0]), ref)
  np.testing.assert_allclose(np.asarray(out.logprobs[:, 0]), ref_lp, atol=1e-4)
  np.testing.assert_array_equal(np.asarray(out.lengths[:, 0]), _lengths_from_eos(ref))
  assert 1 < len(set(_lengths_from_eos(ref))), "fixture should give early and late EOS"


# One sampler's settings that several tests use: one compiled program between them.
SHARED_SAMPLING = dict(max_decode_length=T, num_samples=3, temperature=0.7, top_k=20, top_p=0.8,
                       no_repeat_ngram_size=0, return_raw_logprobs=True)


@pytest.mark.parametrize("temperature,top_k,top_p,ngram", [(0.7, 20, 0.8, 0), (1.3, 0, 0.9, 2)])
def test_sample_logprobs_match_processed_distribution(setup, temperature, top_k, top_p, ngram):
  model, params, inputs, teacher_forced = setup
  n = 3
  out = decoding.sample(model, params, encoder_input_tokens=inputs, rng=jax.random.PRNGKey(3),
                        max_decode_length=T, num_samples=n, temperature=temperature,
                        top_k=top_k, top_p=top_p, no_repeat_ngram_size=ngram,
                        return_raw_logprobs=True)
  tokens = np.asarray(out.tokens).reshape(-1, T)
  logprobs = np.asarray(out.logprobs).reshape(-1, T)
  raw = np.asarray(out.raw_logprobs).reshape(-1, T)
  lengths = np.asarray(out.lengths).reshape(-1)
  np.testing.assert_array_equal(lengths, _lengths_from_eos(tokens))
  logits = np.asarray(teacher_forced(params, np.repeat(inputs, n, axis=0), jnp.asarray(tokens)))
  for r in range(len(tokens)):
    for t in range(T):
      if t >= lengths[r]:
        assert tokens[r, t] == 0 and logprobs[r, t] == 0.0 and raw[r, t] == 0.0
        continue
      banned = _np_banned(list(tokens[r, :t]), ngram, logits.shape[-1]) if ngram else None
      ref = _np_process(logits[r, t], temperature=temperature, top_k=top_k, top_p=top_p,
                        banned=banned)
      assert np.isfinite(ref[tokens[r, t]]), f"row {r} step {t}: token outside the kept set"
      np.testing.assert_allclose(logprobs[r, t], ref[tokens[r, t]], atol=2e-4)
      np.testing.assert_allclose(raw[r, t], _np_log_softmax(logits[r, t])[tokens[r, t]],
                                 atol=2e-4)
  assert (lengths < T).any() and (lengths == T).any()
  # Samples of one input differ (the per-row draws are independent).
  assert len({tuple(s) for s in np.asarray(out.tokens)[0]}) > 1


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 4, 1.0), (1.0, 0, 0.7),
                                                      (2.0, 5, 0.8), (0.5, 0, 1.0)])
def test_sample_logits_frequencies(temperature, top_k, top_p):
  probs = np.array([0.02, 0.3, 0.07, 0.15, 0.1, 0.2, 0.04, 0.12])
  logits = np.log(probs).astype(np.float32)
  expected = np.exp(_np_process(logits, temperature=temperature, top_k=top_k, top_p=top_p))
  draws = 40000
  tokens, logprobs = jax.jit(
      lambda rng: decoding.sample_logits(rng, jnp.broadcast_to(logits, (draws, 8)),
                                         temperature=temperature, top_k=top_k, top_p=top_p)
  )(jax.random.PRNGKey(7))
  tokens, logprobs = np.asarray(tokens), np.asarray(logprobs)
  counts = np.bincount(tokens, minlength=8)
  assert counts[expected == 0].sum() == 0, "a token outside top-k / nucleus was drawn"
  kept = expected > 0
  result = stats.chisquare(counts[kept], draws * expected[kept])
  assert result.pvalue > 1e-3, (counts, draws * expected)
  np.testing.assert_allclose(logprobs, np.log(expected[tokens]), rtol=1e-5, atol=1e-5)


def test_sample_logits_top_k_exact_with_ties_and_greedy():
  logits = jnp.array([[0.0, 1.0, 1.0, 1.0, -1.0]])
  tokens, _ = jax.jit(lambda rng, x: decoding.sample_logits(rng, x, top_k=2))(
      jax.random.PRNGKey(0), jnp.repeat(logits, 2000, 0))
  assert len(set(np.asarray(tokens).tolist())) == 2  # Exactly k survive a tie at the cutoff.
  token, logprob = jax.jit(lambda x: decoding.sample_logits(None, x, greedy=True, top_p=0.01))(
      logits)
  assert int(token[0]) in (1, 2, 3) and float(logprob[0]) == 0.0  # Top token always kept.


def test_first_max_index_is_argmax_with_ties_and_inf():
  rng = np.random.default_rng(0)
  x = rng.integers(-3, 4, (64, 37)).astype(np.float32)  # Many ties.
  x[5] = -np.inf
  x[6, 10:] = np.inf
  np.testing.assert_array_equal(np.asarray(jax.jit(decoding.first_max_index)(x)),
                                x.argmax(-1))


def _np_nucleus(probs, top_p):
  """Sort-based reference: keep while the mass sorted before a token is < p (stable order).

  Also returns, per row, how close the sorted mass before the last kept and the first dropped
  token came to p: float32 sums may decide those (only those) the other way.
  """
  keep = np.zeros(probs.shape, bool)
  margin = np.zeros(len(probs))
  for r, row in enumerate(probs.astype(np.float64)):
    order = np.argsort(-row, kind="stable")
    before = np.cumsum(row[order]) - row[order]
    kept = (before < top_p) | (np.arange(len(row)) == 0)
    keep[r, order[kept]] = True
    n = kept.sum()
    margin[r] = min(abs(before[i] - top_p) for i in (n - 1, n) if 0 < i < len(row))
  return keep, margin


# One compiled mask for every case of this file: the mask is 2 x 31 unrolled masked sums, and
# compiling it once per top_p (a static argument) cost more than the rest of these tests. A
# traced top_p takes the same code; only the comparisons' operand is a value, not a constant.
_NUCLEUS_MASK = jax.jit(decoding.nucleus_mask)
_SOFTMAX = jax.jit(lambda x: jax.nn.softmax(x, axis=-1))
NUCLEUS_ROWS, NUCLEUS_VOCAB = 24, 3000


@pytest.mark.parametrize("kind", ["peaked", "flat", "ties", "banned"])
def test_nucleus_mask_equals_sorted_cumulative_mass(kind):
  rng = np.random.default_rng({"peaked": 0, "flat": 1, "ties": 2, "banned": 3}[kind])
  rows, vocab = NUCLEUS_ROWS, NUCLEUS_VOCAB
  if kind == "peaked":
    logits = rng.normal(size=(rows, vocab)) * 4.0
  elif kind == "flat":
    logits = rng.normal(size=(rows, vocab)) * 0.05
  elif kind == "ties":
    logits = rng.integers(-4, 3, (rows, vocab)).astype(np.float64)  # Many equal probabilities.
  else:
    logits = rng.normal(size=(rows, vocab))
    logits[rng.random((rows, vocab)) < 0.9] = -np.inf  # Zero-probability tokens.
  probs = np.asarray(_SOFTMAX(jnp.asarray(logits, jnp.float32)))
  for top_p in (0.01, 0.3, 0.6, 0.9, 0.99, 0.999):
    got = np.asarray(_NUCLEUS_MASK(jnp.asarray(probs), np.float32(top_p)))
    want, margin = _np_nucleus(probs, top_p)
    differs = (got != want).any(-1)
    # A row may differ only where float64 and float32 sums straddle p.
    assert (margin[differs] < 1e-6).all(), (kind, top_p, np.flatnonzero(differs))
    assert differs.sum() <= 1, (kind, top_p, np.flatnonzero(differs))
    # Kept sets are most-likely sets: no dropped token is more likely than a kept one.
    lowest_kept = np.where(got, probs, np.inf).min(-1)
    assert (np.where(got, 0, probs).max(-1) <= lowest_kept).all()


def test_nucleus_mask_sharded_over_rows_equals_unsharded():
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
  # The shape of the unsharded cases above: the unsharded mask reuses their compiled program.
  logits = np.random.default_rng(6).normal(size=(NUCLEUS_ROWS, NUCLEUS_VOCAB)) * 3.0
  # Row 3: 7 equally likely tokens (1/7 each), so p = 0.5 cuts through the tie: keep 4.
  logits[3] = -30.0
  logits[3, 10:17] = 5.0
  probs = _SOFTMAX(jnp.asarray(logits, jnp.float32))
  sharded = jax.device_put(probs, jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec("data", "model")))
  top_p = np.float32(0.5)
  got = _NUCLEUS_MASK(sharded, top_p)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(_NUCLEUS_MASK(probs, top_p)))
  np.testing.assert_array_equal(np.asarray(got), _np_nucleus(np.asarray(probs), 0.5)[0])
  np.testing.assert_array_equal(np.flatnonzero(np.asarray(got)[3]), [10, 11, 12, 13])


def test_top_p_over_whole_vocab_equals_top_p_after_a_full_sort():
  logits = jax.random.normal(jax.random.PRNGKey(5), (32, 500)) * 2.0
  # Compiled: op by op, each step of the search would compile on its own.
  whole = jax.jit(lambda x: decoding.sample_logits(None, x, top_p=0.7, temperature=0.8,
                                                   greedy=True))(logits)
  sorted_path = jax.jit(lambda x: decoding.sample_logits(None, x, top_k=500, top_p=0.7,
                                                         temperature=0.8, greedy=True))(logits)
  np.testing.assert_array_equal(np.asarray(whole[0]), np.asarray(sorted_path[0]))
  np.testing.assert_allclose(np.asarray(whole[1]), np.asarray(sorted_path[1]), atol=1e-6)


def test_sampling_draws_as_jax_random_categorical():
  logits = jax.random.normal(jax.random.PRNGKey(3), (256, 50))
  tokens, _ = jax.jit(decoding.sample_logits)(jax.random.PRNGKey(4), logits)
  # Compiled: op by op, each op of the draw would compile on its own.
  np.testing.assert_array_equal(np.asarray(tokens), np.asarray(
      jax.jit(jax.random.categorical)(jax.random.PRNGKey(4), logits)))


def test_ngram_ban_mask_matches_python():
  rng = np.random.default_rng(0)
  vocab = 6
  generated = rng.integers(0, vocab, size=(5, 14)).astype(np.int32)
  for n in (1, 2, 3):
    ban = jax.jit(lambda g, s: decoding.ngram_ban_mask(g, s, ngram_size=n, vocab_size=vocab))
    for step in range(15):
      mask = np.asarray(ban(generated, step))
      for r in range(len(generated)):
        np.testing.assert_array_equal(mask[r], _np_banned(list(generated[r, :step]), n, vocab),
                                      err_msg=f"n={n} step={step} row={r}")


def _repeats(row, n):
  grams = [tuple(row[j:j + n]) for j in range(len(row) - n + 1)]
  return len(grams) - len(set(grams))


def test_ngram_blocking_never_repeats(setup):
  # n = 3; n = 2 inside sampling is test_sample_logprobs_match_processed_distribution's second
  # case, which checks every drawn token against the banned set (so no 2-gram repeats), and
  # the mask itself is checked for n = 1, 2, 3 in test_ngram_ban_mask_matches_python.
  n = 3
  model, params, inputs, _ = setup
  params = jax.tree.map(lambda a: a, params)
  params["decoder"]["logits_dense"]["kernel"] = params["decoder"]["logits_dense"][
      "kernel"].at[:, EOS].set(-10.0)  # No EOS: long rows, many chances to repeat.
  length = 24
  kwargs = dict(encoder_input_tokens=inputs, rng=jax.random.PRNGKey(5),
                max_decode_length=length, num_samples=4, top_k=3)
  free = np.asarray(decoding.sample(model, params, **kwargs).tokens).reshape(-1, length)
  assert sum(_repeats(r, n) for r in free) > 0, "without blocking the test would be vacuous"
  out = decoding.sample(model, params, no_repeat_ngram_size=n, **kwargs)
  for row, size in zip(np.asarray(out.tokens).reshape(-1, length),
                       np.asarray(out.lengths).reshape(-1)):
    assert _repeats(row[:size], n) == 0, row


def test_beam_one_equals_greedy(setup):
  model, params, inputs, _ = setup
  greedy = decoding.sample(model, params, encoder_input_tokens=inputs, max_decode_length=T,
                           greedy=True)
  tokens, scores = decoding.beam_search(model, params, encoder_input_tokens=inputs,
                                        beam_size=1, max_decode_length=T, length_penalty=0.0)
  np.testing.assert_array_equal(np.asarray(tokens[:, 0]), np.asarray(greedy.tokens[:, 0]))
  np.testing.assert_allclose(np.asarray(scores[:, 0]),
                             np.asarray(greedy.logprobs[:, 0].sum(-1)), atol=1e-4)


def _reference_beam_search(teacher_forced, params, inputs, k, alpha):
  """k live hypotheses; of each step's 2k best extensions, EOS ones ranked < k finish."""
  live, finished = [([], 0.0)], []
  for step in range(T):
    prefixes = np.zeros((k, T), np.int32)
    for i, (seq, _) in enumerate(live):
      prefixes[i, :len(seq)] = seq
    logits = np.asarray(teacher_forced(params, np.repeat(inputs[None], k, 0), prefixes))
    candidates = []
    for i, (seq, lp) in enumerate(live):
      token_lp = _np_log_softmax(logits[i, step].astype(np.float64))
      for token in np.argsort(-token_lp)[:2 * k]:
        candidates.append((lp + token_lp[token], seq + [int(token)]))
    candidates.sort(key=lambda c: -c[0])
    live = []
    for rank, (lp, seq) in enumerate(candidates[:2 * k]):
      if seq[-1] == EOS or step == T - 1:
        if rank < k or step == T - 1:
          finished.append((seq, lp / ((5.0 + len(seq)) / 6.0) ** alpha))
      elif len(live) < k:
        live.append((seq, lp))
  finished.sort(key=lambda f: -f[1])
  return [(seq + [0] * (T - len(seq)), score) for seq, score in finished[:k]]


def test_beam_scores_are_penalised_likelihoods(setup):
  model, params, inputs, teacher_forced = setup
  alpha, k = 0.6, 4
  tokens, scores = decoding.beam_search(model, params, encoder_input_tokens=inputs,
                                        beam_size=k, max_decode_length=T, length_penalty=alpha)
  tokens, scores = np.asarray(tokens), np.asarray(scores)
  assert tokens.shape == (len(inputs), k, T) and scores.shape == (len(inputs), k)
  flat = tokens.reshape(-1, T)
  lengths = _lengths_from_eos(flat)
  loglik = np.asarray(decoding.score_sequences(
      model, params, encoder_input_tokens=np.repeat(inputs, k, 0), targets=flat,
      lengths=jnp.asarray(lengths)))
  penalty = ((5.0 + lengths) / 6.0) ** alpha
  np.testing.assert_allclose(scores.reshape(-1), loglik / penalty, rtol=1e-4, atol=1e-4)
  assert (np.diff(scores, axis=1) <= 1e-6).all(), "not best first"
  for b in range(len(inputs)):
    assert len({tuple(s) for s in tokens[b]}) == k, "duplicate hypotheses"
  # After EOS only zeros.
  for row, size in zip(flat, lengths):
    assert (row[size:] == 0).all()
  # Independent reference: the same search rule in plain Python, recomputing every prefix
  # without a cache and without early stopping.
  for b in range(len(inputs)):
    ref = _reference_beam_search(teacher_forced, params, inputs[b], k, alpha)
    np.testing.assert_array_equal(tokens[b], np.array([seq for seq, _ in ref]))
    np.testing.assert_allclose(scores[b], [score for _, score in ref], rtol=1e-4, atol=1e-4)
  greedy = decoding.sample(model, params, encoder_input_tokens=inputs, max_decode_length=T,
                           greedy=True)
  g_len = np.asarray(greedy.lengths[:, 0])
  g_score = np.asarray(greedy.logprobs[:, 0].sum(-1)) / ((5.0 + g_len) / 6.0) ** alpha
  assert (scores[:, 0] >= g_score - 1e-5).all()
  assert (scores[:, 0] > g_score + 1e-3).any(), "beam search found nothing better than greedy"


def test_score_sequences_matches_numpy(setup):
  model, params, inputs, teacher_forced = setup
  targets = np.zeros((4, T), np.int32)  # Width T: reuses the compiled reference.
  targets[:, :4] = [[5, 6, 1, 0], [7, 1, 0, 0], [9, 9, 9, 9], [3, 1, 0, 0]]
  logits = np.asarray(teacher_forced(params, inputs, targets))
  lp = _np_log_softmax(logits)
  ref = [sum(lp[b, t, targets[b, t]] for t in range(T) if targets[b, t] != 0) for b in range(4)]
  got = decoding.score_sequences(model, params, encoder_input_tokens=inputs, targets=targets)
  np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-4)


def test_score_sequences_with_candidates_equals_one_call_per_candidate(setup):
  model, params, inputs, _ = setup
  rng = np.random.default_rng(4)
  candidates = rng.integers(2, 30, (len(inputs), 3, T)).astype(np.int32)
  lengths = rng.integers(1, T + 1, (len(inputs), 3)).astype(np.int32)
  got = np.asarray(decoding.score_sequences(model, params, encoder_input_tokens=inputs,
                                            targets=candidates, lengths=lengths))
  assert got.shape == (len(inputs), 3)
  for c in range(3):
    one = decoding.score_sequences(model, params, encoder_input_tokens=inputs,
                                   targets=candidates[:, c], lengths=lengths[:, c])
    np.testing.assert_allclose(got[:, c], np.asarray(one), rtol=1e-5, atol=1e-5)
  assert len(set(np.round(got[0], 3))) == 3  # The candidates really differ.
  with pytest.raises(ValueError, match="lengths shape"):
    decoding.score_sequences(model, params, encoder_input_tokens=inputs, targets=candidates,
                             lengths=lengths[:, 0])


def test_compiles_once_and_nests_in_jit(setup):
  model, params, inputs, _ = setup
  # The settings of test_sample_logprobs_match_processed_distribution's first case: sample()
  # goes through this same cached function, so its program is shared (it may have been traced
  # there already, once).
  fn = decoding.make_sampler(model, **SHARED_SAMPLING)
  assert decoding.make_sampler(model, **SHARED_SAMPLING) is fn
  traces = decoding._TRACE_COUNT["sample"]
  first = fn(params, inputs, rng=jax.random.PRNGKey(0))
  assert decoding._TRACE_COUNT["sample"] in (traces, traces + 1)
  traces, compiled = decoding._TRACE_COUNT["sample"], fn._cache_size()
  second = fn(params, inputs[::-1].copy(), rng=jax.random.PRNGKey(1))
  assert decoding._TRACE_COUNT["sample"] == traces  # Not retraced ...
  assert fn._cache_size() == compiled  # ... nor recompiled.
  assert not np.array_equal(np.asarray(first.tokens), np.asarray(second.tokens))

  @jax.jit
  def rollout(params, inputs, rng):
    out = decoding.sample(model, params, encoder_input_tokens=inputs, rng=rng,
                          **SHARED_SAMPLING)
    return out.tokens, out.logprobs.sum(-1)

  tokens, total = rollout(params, inputs, jax.random.PRNGKey(0))
  np.testing.assert_array_equal(np.asarray(tokens), np.asarray(first.tokens))
  np.testing.assert_allclose(np.asarray(total), np.asarray(first.logprobs.sum(-1)), atol=1e-5)


def test_decode_weights_are_prepared_once_and_decode_like_none(setup):
  """The owner of the parameters prepares the backend's kernels once; every call reuses them,
  and decodes exactly as a call that stacks XLA's kernels inside the trace."""
  model, params, inputs, _ = setup
  reference = decoding.sample(model, params, encoder_input_tokens=inputs,
                              max_decode_length=T, greedy=True)
  weights = decoding.prepare_decode_weights(model, params, backend="xla")
  assert weights.backend == "xla"
  expected = decoding.decoder_step_kernels(params)
  stacked = {k: v for k, v in expected.items() if len(v) > 1}
  assert set(weights.kernels) == set(stacked)  # The query/key/value and gated-MLP stacks.
  for key, sources in stacked.items():
    np.testing.assert_array_equal(np.asarray(weights.kernels[key]),
                                  np.asarray(jnp.stack(sources, axis=1)))
  sampler = decoding.make_sampler(model, max_decode_length=T, greedy=True)
  first = sampler(params, inputs, decode_weights=weights)
  compiled = sampler._cache_size()
  second = sampler(params, inputs, decode_weights=weights)
  assert sampler._cache_size() == compiled  # Reused: nothing rebuilt or retraced.
  for out in (first, second):
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(reference.tokens))
  # "auto" picks the CPU kernels only where they beat XLA's dots (AVX-512), else XLA's ops.
  auto = decoding.prepare_decode_weights(model, params)
  assert auto.backend == ("cpu_packed" if cpu_kernels.available() and cpu_kernels.has_avx512()
                          else "xla")
  with mock.patch.object(cpu_kernels, "has_avx512", lambda: False):
    assert decoding.prepare_decode_weights(model, params).backend == "xla"
  with gin.unlock_config():
    gin.bind_parameter("decoding.prepare_decode_weights.backend", "gpu_magic")
  try:  # The gin binding reaches the callers that pass no backend.
    with pytest.raises(ValueError, match="unknown backend 'gpu_magic'"):
      decoding.prepare_decode_weights(model, params)
  finally:
    gin.clear_config()
  with pytest.raises(ValueError, match="unknown backend 'gpu_magic'"):
    decoding.prepare_decode_weights(model, params, backend="gpu_magic")


def test_samples_and_beams_share_their_inputs_cross_attention_cache(setup):
  model, params, inputs, _ = setup
  # Compiled: op by op, every op of the encoder and the cache would compile on its own.
  encoded, mask = jax.jit(lambda p, x: decoding._encode(model, p, x, None, None))(params, inputs)
  cache = jax.jit(lambda p, e, m: decoding._init_cache(model, p, e, m, T, rows_per_input=3))(
      params, encoded, mask)
  for path, x in jax.tree_util.tree_leaves_with_path(cache):
    names = [getattr(p, "key", "") for p in path]
    if "cached_key" in names or "cached_value" in names:
      cross = "encoder_decoder_attention" in names
      assert x.shape[0] == len(inputs) * (1 if cross else 3), (names, x.shape)
  with pytest.raises(ValueError, match="rows_per_input"):
    decoding._init_cache(model, params, encoded, mask, T, rows_per_input=0)
  # Greedy samples of one input are identical, and equal to decoding it alone.
  many = decoding.sample(model, params, encoder_input_tokens=inputs, max_decode_length=T,
                         greedy=True, num_samples=3)
  one = decoding.sample(model, params, encoder_input_tokens=inputs, max_decode_length=T,
                        greedy=True)
  for i in range(3):
    np.testing.assert_array_equal(np.asarray(many.tokens[:, i]), np.asarray(one.tokens[:, 0]))
    np.testing.assert_allclose(np.asarray(many.logprobs[:, i]), np.asarray(one.logprobs[:, 0]),
                               atol=1e-5)


@pytest.mark.skipif(not cpu_kernels.available(), reason="no packed CPU kernel here")
def test_packed_cpu_kernels_decode_as_xla_dot(setup, monkeypatch):
  """Sampling and beam search through the "cpu_packed" backend against XLA's dot."""
  model, params, inputs, _ = setup
  kwargs = dict(encoder_input_tokens=inputs, max_decode_length=T)

  def run(weights):
    # The settings of test_sample_logprobs_match_processed_distribution's first case and
    # test_beam_scores_are_penalised_likelihoods: with weights=None (XLA's kernels stacked
    # inside the trace, which test_decode_weights_are_prepared_once_and_decode_like_none shows
    # decode as prepared "xla" weights) the reference reuses their programs.
    sampled = decoding.sample(model, params, encoder_input_tokens=inputs,
                              rng=jax.random.PRNGKey(5), decode_weights=weights,
                              **SHARED_SAMPLING)
    beams = decoding.beam_search(model, params, beam_size=4, length_penalty=0.6,
                                 decode_weights=weights, **kwargs)
    return sampled, beams

  sampler = decoding.make_sampler(model, max_decode_length=T, greedy=True)
  packed_weights = decoding.prepare_decode_weights(model, params, backend="cpu_packed")
  assert packed_weights.backend == "cpu_packed"
  assert "jaxmoral_packed_matmul" in sampler.lower(
      params, inputs, decode_weights=packed_weights).as_text()
  packed = run(packed_weights)
  monkeypatch.setenv("JAXMORAL_CPU_KERNELS", "0")
  with pytest.raises(ValueError, match="'cpu_packed' does not apply"):
    decoding.prepare_decode_weights(model, params, backend="cpu_packed")
  xla_weights = decoding.prepare_decode_weights(model, params)
  assert xla_weights.backend == "xla"
  assert "jaxmoral_packed_matmul" not in sampler.lower(
      params, inputs, decode_weights=xla_weights).as_text()
  xla = run(None)
  for ours, ref in zip(jax.tree.leaves(packed), jax.tree.leaves(xla)):
    if np.issubdtype(np.asarray(ref).dtype, np.integer):
      np.testing.assert_array_equal(np.asarray(ours), np.asarray(ref))
    else:
      np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_encoder_embeds_equal_tokens(setup):
  model, params, inputs, _ = setup
  embeds = model.apply({"params": params}, jnp.asarray(inputs), method=T5.embed)
  by_ids = decoding.sample(model, params, encoder_input_tokens=inputs, max_decode_length=T,
                           greedy=True)
  by_embeds = decoding.sample(model, params, encoder_embeds=embeds, encoder_mask=inputs != 0,
                              max_decode_length=T, greedy=True)
  np.testing.assert_array_equal(np.asarray(by_ids.tokens), np.asarray(by_embeds.tokens))


def test_bad_arguments_name_the_field(setup):
  model, params, inputs, _ = setup
  with pytest.raises(ValueError, match="top_p"):
    decoding.sample(model, params, encoder_input_tokens=inputs, rng=jax.random.PRNGKey(0),
                    max_decode_length=T, top_p=0.0)
  with pytest.raises(ValueError, match="temperature"):
    decoding.make_sampler(model, max_decode_length=T, temperature=0.0)
  with pytest.raises(ValueError, match="beam_size"):
    decoding.make_beam_search(model, beam_size=0, max_decode_length=T)
  with pytest.raises(ValueError, match="rng"):
    decoding.sample(model, params, encoder_input_tokens=inputs, max_decode_length=T)
  with pytest.raises(ValueError, match="encoder_mask"):
    decoding.sample(model, params, encoder_embeds=jnp.zeros((1, 3, 64)), max_decode_length=T,
                    greedy=True)


def test_decoding_starts_from_the_models_start_id_and_pads_with_its_pad_id(setup):
  # pad_token_id (= the decoder start id, as in T5) 3, not 0: sampling and beam search must
  # decode the model that teacher forcing and scoring use. The fixture's parameters (its EOS
  # column scaled up, so that rows end early) fit: the pad id is no parameter.
  _, params, _, _ = setup
  model = T5(t5_config(size="tiny", pad_token_id=3, num_encoder_layers=1, num_decoder_layers=1))
  inputs = np.array([[5, 6, 7, 1, 3, 3], [9, 8, 1, 3, 3, 3], [4, 4, 4, 4, 4, 1]], np.int32)
  out = decoding.sample(model, params, encoder_input_tokens=inputs, max_decode_length=8,
                        greedy=True, eos_id=EOS)
  tokens, lengths = np.asarray(out.tokens[:, 0]), np.asarray(out.lengths[:, 0])
  logits = np.asarray(jax.jit(model.apply)({"params": params}, inputs, shift_right(tokens, 3)))
  for row, n in enumerate(lengths):
    np.testing.assert_array_equal(tokens[row, :n], logits[row, :n].argmax(-1))
    assert (tokens[row, n:] == 3).all()
  assert lengths.min() < 8  # Some row ended early, so the padding was exercised.
  scores = decoding.score_sequences(model, params, encoder_input_tokens=inputs,
                                    targets=out.tokens[:, 0], lengths=out.lengths[:, 0])
  np.testing.assert_allclose(np.asarray(out.logprobs[:, 0]).sum(-1), scores, rtol=1e-5)
  beams, _ = decoding.beam_search(model, params, encoder_input_tokens=inputs, beam_size=1,
                                  max_decode_length=8, eos_id=EOS)
  np.testing.assert_array_equal(np.asarray(beams[:, 0]), tokens)
