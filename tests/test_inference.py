"""inference.py: the one batch-inference path, checked against NumPy and decoding.py."""

from __future__ import annotations

import flax.linen as nn
import jax
import numpy as np
import pytest

from jaxmoral import api
from jaxmoral import decoding
from jaxmoral import inference
from jaxmoral import partitioning
from jaxmoral import token_rows
from jaxmoral.data import vocab as vocab_lib
from jaxmoral.models import config as config_lib
from jaxmoral.models import t5

CONFIG = config_lib.t5_config(size="tiny", num_encoder_layers=1, num_decoder_layers=1)
INPUTS = ["Is it okay to lie to a friend?", "Helping a stranger.", "Why?"]
TARGETS = ["It depends on why.", "It is good.", "Because I was asked to help them out."]


@pytest.fixture(scope="module")
def params():
  return nn.meta.unbox(t5.init_params(t5.T5(CONFIG), jax.random.PRNGKey(7)))


@pytest.fixture(scope="module")
def vocabulary():
  return vocab_lib.get_vocabulary(None)  # The demo vocabulary (500 ids).


@pytest.fixture(scope="module")
def one(params, vocabulary):
  """The model on one device, without a mesh."""
  with partitioning.default_devices(jax.devices()[:1]):
    return inference.InferenceModel.from_params(CONFIG, params, vocabulary=vocabulary)


def _np_log_softmax(x):
  x = np.asarray(x, np.float64)
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _token_rows(seed, rows, longest):
  rng = np.random.RandomState(seed)
  return [list(rng.randint(2, 500, rng.randint(2, longest))) + [1] for _ in range(rows)]


def test_score_is_the_log_softmax_of_the_logits(one):
  inputs, targets = _token_rows(0, 5, 12), _token_rows(1, 5, 9)
  logits = one.logits(inputs, targets)
  assert logits.shape == (5, max(map(len, targets)), CONFIG.vocab_size)
  logp = _np_log_softmax(logits)
  expected = [sum(logp[i, t, tok] for t, tok in enumerate(row)) for i, row in enumerate(targets)]
  np.testing.assert_allclose(one.score(inputs, targets), expected, rtol=1e-4, atol=1e-4)
  # The logits are the network's own teacher-forced forward on the padded rows.
  enc = token_rows.padded(inputs, 16, 5)
  dec = token_rows.padded(targets, 16, 5)
  ref = t5.T5(CONFIG).apply({"params": one.params}, enc, np.asarray(t5.shift_right(dec, 0)))
  np.testing.assert_allclose(logits, np.asarray(ref)[:, :logits.shape[1]], atol=1e-5)


def test_bucketed_batches_give_what_each_row_gives_alone(one):
  inputs, targets = _token_rows(2, 11, 20), _token_rows(3, 11, 10)
  together = one.score(inputs, targets, batch_size=4)  # Chunks of 4, padded to 8 rows.
  alone = np.concatenate([one.score([i], [t]) for i, t in zip(inputs, targets, strict=True)])
  np.testing.assert_allclose(together, alone, rtol=1e-5, atol=1e-5)
  out = one.predict(inputs, max_decode_length=6, batch_size=4)
  for i, row in enumerate(inputs):
    single = one.predict([row], max_decode_length=6)
    np.testing.assert_array_equal(out.tokens[i], single.tokens[0])
    np.testing.assert_allclose(out.scores[i], single.scores[0], atol=1e-5)


def test_predict_is_decodings_sampler_and_beam_search(one):
  out = one.predict(INPUTS, max_decode_length=8)  # Greedy by default.
  enc = one.encode(INPUTS)
  ref = decoding.sample(one.module, one.params, encoder_input_tokens=enc, max_decode_length=8,
                        greedy=True)
  np.testing.assert_array_equal(out.tokens, np.asarray(ref.tokens))
  np.testing.assert_array_equal(out.lengths, np.asarray(ref.lengths))
  np.testing.assert_allclose(out.scores, np.asarray((ref.logprobs * ref.mask).sum(-1)),
                             atol=1e-5)
  assert out.texts == [[t] for t in one.decode_text(np.asarray(ref.tokens)[:, 0])]
  beam = one.predict(INPUTS, max_decode_length=8, beam_size=1)  # Beam 1 is greedy too.
  np.testing.assert_array_equal(beam.tokens, out.tokens)
  a = one.predict(INPUTS[:2], max_decode_length=5, num_samples=3, top_k=20, seed=1)
  b = one.predict(INPUTS[:2], max_decode_length=5, num_samples=3, top_k=20,
                  rng=jax.random.PRNGKey(1))
  assert a.tokens.shape == (2, 3, 5) and len(a.texts[0]) == 3
  np.testing.assert_array_equal(a.tokens, b.tokens)
  empty = one.predict([], max_decode_length=5, num_samples=2)
  assert empty.texts == [] and empty.tokens.shape == (0, 2, 5)


def test_label_distribution_of_one_and_several_token_labels(one, vocabulary):
  texts = ["judge: lying", "judge: helping a neighbor move", "x"]
  labels = ("wrong", "okay", "good")  # One token each in the demo vocabulary.
  ids = [list(vocabulary.encode(label)) for label in labels]
  assert all(len(i) == 1 for i in ids)
  logits = one.logits(texts, [[5]] * 3)[:, 0]  # Position 0 reads the start id only.
  class_logits = logits[:, [i[0] for i in ids]].astype(np.float64)
  expected = np.exp(class_logits - class_logits.max(-1, keepdims=True))
  expected /= expected.sum(-1, keepdims=True)
  np.testing.assert_allclose(one.label_distribution(texts, labels), expected, rtol=1e-5,
                             atol=1e-6)
  long_labels = ("entailment", "neutral", "contradiction")
  scores = np.stack([one.score(texts, [label] * 3) for label in long_labels], 1)
  np.testing.assert_allclose(one.label_distribution(texts, long_labels),
                             np.exp(_np_log_softmax(scores)), rtol=1e-4, atol=1e-6)
  with pytest.raises(ValueError, match="ONE token"):
    one.label_distribution(texts, long_labels, require_single_token=True)
  assert one.label_distribution([], labels).shape == (0, 3)


def test_fixed_shapes_truncate_keeping_eos_and_compile_once(one):
  fixed = one.with_shapes(input_length=6, batch_size=4)
  assert fixed.params is one.params and one.input_length is None
  rows = fixed.encode([[5, 6, 7, 8, 9, 10, 11, 1], [5, 1]])
  np.testing.assert_array_equal(rows, [[5, 6, 7, 8, 9, 1], [5, 1, 0, 0, 0, 0]])
  scorer = fixed.class_scorer()
  before = scorer._cache_size()
  for n in (1, 3, 9):  # Every call: (4, 6) rows, whatever the batch.
    fixed.label_distribution([[5, 6, 1]] * n, ("okay", "good"))
  assert scorer._cache_size() <= before + 1


def test_sharded_on_eight_devices_equals_one_device(one, params, vocabulary):
  partitioner = partitioning.PjitPartitioner(num_partitions=2, devices=jax.devices()[:8])
  mesh = inference.InferenceModel.from_params(CONFIG, params, vocabulary=vocabulary,
                                              partitioner=partitioner)
  leaf = mesh.params["token_embedder"]["embedding"]
  assert len(leaf.sharding.device_set) == 8
  inputs, targets = _token_rows(4, 10, 14), _token_rows(5, 10, 8)
  np.testing.assert_allclose(mesh.score(inputs, targets), one.score(inputs, targets),
                             rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(mesh.logits(inputs, targets), one.logits(inputs, targets),
                             atol=1e-4)
  np.testing.assert_array_equal(mesh.predict(inputs, max_decode_length=5).tokens,
                                one.predict(inputs, max_decode_length=5).tokens)
  np.testing.assert_allclose(mesh.label_distribution(INPUTS, ("okay", "good")),
                             one.label_distribution(INPUTS, ("okay", "good")), atol=1e-5)
  with pytest.raises(ValueError, match="not divisible by the mesh's data axis"):
    mesh.with_shapes(batch_size=6)


def test_api_model_is_the_facade(one, params, vocabulary):
  with partitioning.default_devices(jax.devices()[:1]):
    model = api.Model(CONFIG, params, vocabulary=vocabulary)
  assert isinstance(model, inference.InferenceModel)
  out = model.generate(INPUTS, max_decode_length=8)
  np.testing.assert_array_equal(out.tokens, one.predict(INPUTS, max_decode_length=8).tokens)
  assert repr(out.texts) in repr(out) and "tokens=<" in repr(out)
  assert out.decoded == out.texts
  # Text round trips and input errors: tests/test_api.py. A model without a vocabulary
  # returns tokens only, and `decoded` says so instead of returning None.
  bare = api.Model(CONFIG, params).generate(np.array([[5, 6, 1]]), max_decode_length=3)
  with pytest.raises(ValueError, match="no vocabulary"):
    _ = bare.decoded


def test_run_jits_a_scalar_head_function_on_the_mesh():
  # Diamante's preference score: any pure fn(module, params, *inputs) runs on the model's mesh.
  from jaxmoral.diamante import model as diamante_model  # pylint: disable=g-import-not-at-top
  head = nn.meta.unbox(t5.init_params(t5.T5(CONFIG, with_scalar_head=True),
                                      jax.random.PRNGKey(7)))
  encoder = np.asarray(_token_rows(6, 4, 10)[0] + [0] * 16)[None, :16].repeat(4, 0)
  targets = np.asarray([[r + [0] * (8 - len(r)) for r in _token_rows(7, 3, 7)]] * 4)
  with partitioning.default_devices(jax.devices()[:1]):
    one = inference.InferenceModel.from_params(CONFIG, head, with_scalar_head=True)
  mesh = inference.InferenceModel.from_params(
      CONFIG, head, with_scalar_head=True,
      partitioner=partitioning.PjitPartitioner(num_partitions=2, devices=jax.devices()[:8]))
  got = mesh.run(diamante_model.score_responses, encoder, targets, None)
  want = one.run(diamante_model.score_responses, encoder, targets, None)
  ref = diamante_model.score_responses(one.module, head, encoder, targets)
  for a, b, c in zip(got, want, ref, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(b, np.asarray(c), rtol=1e-5, atol=1e-5)
  assert got[0].shape == (4, 3)
