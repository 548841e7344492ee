"""Judge class distribution and multi-token label scoring against NumPy re-computation."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoral import inference
from jaxmoral.clarify import formats, judge, models, nli
from jaxmoral.data import vocab as vocab_lib
from jaxmoral.models import config as config_lib
from jaxmoral.models import t5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  vocabulary = vocab_lib.get_vocabulary(vocab_lib.build_demo_vocabulary(
      output_dir=tmp_path_factory.mktemp("vocab")))
  model = t5.T5(config_lib.t5_config(size="tiny", num_encoder_layers=1, num_decoder_layers=1))
  params = nn.meta.unbox(t5.init_params(model, jax.random.PRNGKey(3)))
  return models.ClarifyModel(model, params, vocabulary=vocabulary,
                             input_length=24, batch_size=4)


def _forward(cm, encoder_tokens, decoder_tokens):
  """Reference teacher-forced logits (jitted only for speed; no code shared with the scorer)."""
  fn = jax.jit(lambda p, e, d: cm.module.apply({"params": p}, e, d))
  return np.asarray(fn(cm.params, encoder_tokens, decoder_tokens))


def _np_log_softmax(x):
  x = np.asarray(x, np.float64)
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_class_distribution_is_softmax_of_class_logits(tiny):
  texts = ["judge: lying to a friend", "judge: helping a neighbor move", "judge: x"]
  tokens = tiny.encode(texts)
  ids = judge.class_token_ids(tiny.vocabulary, formats.DEMO_JUDGE_CLASSES)
  probs = np.asarray(jax.jit(inference.class_distribution, static_argnums=0)(
      tiny.module, tiny.params, jnp.asarray(tokens), jnp.asarray(ids)))
  # Reference: a full teacher-forced forward, first position, class logits, NumPy softmax.
  logits = _forward(tiny, tokens, np.zeros((3, 2), np.int32))[:, 0]
  class_logits = logits[:, ids].astype(np.float64)
  expected = np.exp(class_logits - class_logits.max(-1, keepdims=True))
  expected /= expected.sum(-1, keepdims=True)
  np.testing.assert_allclose(probs.sum(-1), 1.0, atol=1e-6)
  np.testing.assert_allclose(probs, expected, rtol=1e-5, atol=1e-6)
  # Equivalently: full-vocabulary probabilities of the class tokens renormalised by their sum.
  full = np.exp(_np_log_softmax(logits))[:, ids]
  np.testing.assert_allclose(probs, full / full.sum(-1, keepdims=True), rtol=1e-4, atol=1e-6)
  # The batched, padded host path gives the same rows (3 rows in a batch of 4).
  np.testing.assert_allclose(
      tiny.label_distribution(texts, formats.DEMO_JUDGE_CLASSES, require_single_token=True),
      probs, rtol=1e-5, atol=1e-6)


def test_class_must_be_one_token(tiny):
  with pytest.raises(ValueError, match="'entailment'.*ONE token"):
    judge.class_token_ids(tiny.vocabulary, ("good", "entailment"))
  with pytest.raises(ValueError, match="ONE token"):
    tiny.label_distribution(["judge: x"], ("bad", "ok", "good"), require_single_token=True)


def test_multi_token_labels_use_sequence_likelihood(tiny):
  inputs = ["nli premise: a hypothesis: b", "nli premise: lying hypothesis: I lied"]
  probs = tiny.label_distribution(inputs, formats.NLI_LABELS)
  tokens = tiny.encode(inputs)
  scores = []
  for label in formats.NLI_LABELS:
    target = list(tiny.vocabulary.encode(label)) + [1]
    dec_in = np.array([[0] + target[:-1]] * 2, np.int32)
    logp = _np_log_softmax(_forward(tiny, tokens, dec_in))
    scores.append(sum(logp[:, t, tok] for t, tok in enumerate(target)))
  scores = np.stack(scores, 1)
  expected = np.exp(scores - scores.max(1, keepdims=True))
  expected /= expected.sum(1, keepdims=True)
  np.testing.assert_allclose(probs, expected, rtol=1e-4, atol=1e-6)
  # The NLI filter drops rows whose argmax is entailment or contradiction.
  scorer = nli.NLIScorer(tiny)
  np.testing.assert_allclose(scorer.probabilities(["a", "lying"], ["b", "I lied"]), probs,
                             rtol=1e-5)
  flagged = nli.filter_answers(scorer, ["a", "lying"], ["b", "I lied"])
  np.testing.assert_array_equal(flagged, probs.argmax(1) != 1)
  assert not nli.filter_answers(scorer, ["a"], ["b"], enabled=False).any()
  np.testing.assert_array_equal(
      nli.filtered_from_probabilities(np.array([[.6, .3, .1], [.2, .5, .3], [.1, .2, .7]])),
      [True, False, True])


def test_fitting_classes_pick_the_classes_the_judges_vocabulary_has_as_one_token():
  class Vocabulary:
    def __init__(self, single):
      self.single = set(single)

    def encode(self, text):
      return [1] if text in self.single else [1, 2]

  t5_like = Vocabulary({"bad", "okay", "good", "wrong"})
  demo_like = Vocabulary({"wrong", "okay", "good"})
  assert judge.fitting_classes(t5_like) == formats.T5_JUDGE_CLASSES
  assert judge.fitting_classes(demo_like) == formats.DEMO_JUDGE_CLASSES
  # Neither fits: the preferred ones, whose use then names the flag.
  neither = Vocabulary(set())
  assert judge.fitting_classes(neither, preferred=("a", "b", "c")) == ("a", "b", "c")
  with pytest.raises(ValueError, match="--judge_classes"):
    judge.class_token_ids(neither, ("a", "b", "c"))
