"""Salience detector: token salience against per-token jax.grad and finite differences;
chunked (vectorised) against one output token at a time; word merging and scores."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from jaxmoral.models.config import t5_config
from jaxmoral.models.t5 import T5, init_params, shift_right
from jaxmoral.npov import task
from jaxmoral.npov import text as text_lib
from jaxmoral.npov.detectors import salience

CFG = t5_config(size="tiny", vocab_size=128, d_model=32, d_kv=8, d_ff=64,
                num_encoder_layers=1, num_decoder_layers=1)
RNG = np.random.default_rng(0)
INPUT = [int(x) for x in RNG.integers(2, 128, 13)]
TARGET = [int(x) for x in RNG.integers(2, 128, 7)]


@pytest.fixture(scope="module")
def base():
  model = T5(CFG)
  return model, nn.meta.unbox(init_params(model, jax.random.PRNGKey(0)))


@jax.jit
def _chosen_logit(params, embeds, t, prompt=None):
  """logit of TARGET[t] at step t, from the given (unpadded) input embeddings."""
  if prompt is not None:
    embeds = jnp.concatenate([prompt[None], embeds], axis=1)
  mask = jnp.ones(embeds.shape[:2], bool)
  decoder = shift_right(jnp.array([TARGET]))
  logits = T5(CFG).apply({"params": params}, None, decoder, encoder_embeds=embeds,
                         encoder_mask=mask)
  return logits[0, t, jnp.array(TARGET)[t]]


_grad = jax.jit(jax.grad(_chosen_logit, argnums=1))


def _reference(model, params, prompt=None, norm=False):
  """One jax.grad per output token (no vmap, no chunks, no padding)."""
  embeds = model.apply({"params": params}, jnp.array([INPUT]), method=T5.embed)
  columns = []
  for t in range(len(TARGET)):
    grad = _grad(params, embeds, t, prompt)[0]
    columns.append(jnp.linalg.norm(grad, axis=-1) if norm else jnp.sum(grad * embeds[0], -1))
  return np.stack(columns, axis=1)


def test_chunked_token_salience_equals_per_token_grad(base):
  """Vectorised (chunks of 3 output tokens, padded input) == one jax.grad per output token
  on the unpadded input."""
  model, params = base
  got = salience.token_salience(model, params, input_ids=INPUT, target_ids=TARGET,
                                chunk_size=3, input_bucket=16)
  np.testing.assert_allclose(got, _reference(model, params), atol=2e-6, rtol=1e-4)


def test_grad_norm_and_prompt(base):
  model, params = base
  prompt = jax.random.normal(jax.random.PRNGKey(5), (4, CFG.d_model))
  got = salience.token_salience(model, params, input_ids=INPUT, target_ids=TARGET,
                                prompt=prompt, method="grad_norm", chunk_size=3,
                                input_bucket=16)
  np.testing.assert_allclose(got, _reference(model, params, prompt, norm=True),
                             atol=2e-6, rtol=1e-4)


def test_long_input_equals_per_token_grad():
  """256 input positions x a chunk of 16 on the `tiny` size: the program that XLA:CPU's
  YNNPACK reduce fusions miscompiled (gradients uncorrelated with jax.grad's) until
  `jaxmoral.backends.xla_flags` took reductions back from them."""
  config = t5_config(size="tiny")
  model = T5(config)
  params = nn.meta.unbox(init_params(model, jax.random.PRNGKey(1)))
  rng = np.random.default_rng(1)
  long_input = [int(x) for x in rng.integers(2, config.vocab_size, 250)]
  target = [int(x) for x in rng.integers(2, config.vocab_size, 16)]
  got = salience.token_salience(model, params, input_ids=long_input, target_ids=target,
                                chunk_size=16)

  @jax.jit
  def grad_x_input(embeds, t):
    def chosen(e):
      logits = model.apply({"params": params}, None, shift_right(jnp.array([target])),
                           encoder_embeds=e, encoder_mask=jnp.ones(e.shape[:2], bool))
      return logits[0, t, jnp.array(target)[t]]
    return jnp.sum(jax.grad(chosen)(embeds)[0] * embeds[0], -1)

  embeds = model.apply({"params": params}, jnp.array([long_input]), method=T5.embed)
  for t in (0, 7, 15):
    np.testing.assert_allclose(got[:, t], grad_x_input(embeds, t), atol=2e-6, rtol=1e-4)


def test_token_salience_matches_finite_differences(base):
  """grad . e_i is the derivative of the logit when input row i is scaled by (1 + eps)."""
  model, params = base
  got = salience.token_salience(model, params, input_ids=INPUT, target_ids=TARGET,
                                chunk_size=3, input_bucket=16)
  embeds = model.apply({"params": params}, jnp.array([INPUT]), method=T5.embed)
  eps = 1e-2
  for i, t in [(0, 0), (5, 3), (12, 6), (7, 1)]:
    up = embeds.at[0, i].multiply(1 + eps)
    down = embeds.at[0, i].multiply(1 - eps)
    fd = (_chosen_logit(params, up, t) - _chosen_logit(params, down, t)) / (2 * eps)
    assert got[i, t] == pytest.approx(float(fd), rel=2e-2, abs=2e-4)


class CharTokenizer:
  """Subword stand-in: up to 3 letters per token, the preceding whitespace attached."""

  def __call__(self, text):
    matches = list(re.finditer(r"\s*(?:[^\W_]{1,3}|[^\w\s]|_)", text))
    ids = tuple(3 + sum(map(ord, m.group(0).strip())) % 120 for m in matches)
    return salience.Tokenized(ids, tuple(m.span() for m in matches))


EXAMPLE = task.NpovExample(
    id="e", topic="t", query="Are zoos cruel?", pro=("Animals suffer in cages",),
    con=("Zoos protect endangered species", "Children learn"),
    response="Some say animals suffer. Others say zoos protect species and teach children.")


def test_word_map_and_scores_follow_the_definition(base):
  model, params = base
  tokenizer = CharTokenizer()
  word_map = salience.SalienceDetector(
      model=model, params=params, tokenizer=tokenizer,
      config=salience.SalienceConfig(chunk_size=8)).word_map(EXAMPLE)
  text, spans = task.format_input_with_spans(EXAMPLE)
  source, target = tokenizer(text), tokenizer(EXAMPLE.response)
  raw = salience.token_salience(model, params, input_ids=list(source.ids) + [1],
                                target_ids=list(target.ids) + [1], chunk_size=8)
  np.testing.assert_array_equal(word_map.token_matrix, raw)
  for aggregation in ("max", "sum", "neg_entropy"):
    detector = salience.SalienceDetector(
        model=model, params=params, tokenizer=tokenizer,
        config=salience.SalienceConfig(chunk_size=8, aggregation=aggregation))
    values = raw ** 2 / (raw ** 2).sum(0, keepdims=True)
    # Independent word merge: character masks instead of token groups.
    rows = [(s, w) for s in spans for w in text_lib.words(text[s.start:s.end])
            if not w.is_stopword]
    cols = [w for w in text_lib.words(EXAMPLE.response) if not w.is_stopword]
    assert [w.text for _, _, w in word_map.input_words] == [w.text for _, w in rows]
    assert [w.text for w in word_map.response_words] == [w.text for w in cols]
    assert "query" not in {w.text for _, _, w in word_map.input_words}  # markup dropped
    expected = np.zeros((len(rows), len(cols)))
    for r, (s, w) in enumerate(rows):
      ti = [k for k, (b, e) in enumerate(source.spans)
            if set(range(b, e)) & set(range(s.start + w.start, s.start + w.end))]
      for c, v in enumerate(cols):
        tj = [k for k, (b, e) in enumerate(target.spans) if set(range(b, e)) & set(range(v.start, v.end))]
        expected[r, c] = values[np.ix_(ti, tj)].max()
    np.testing.assert_allclose(word_map.matrix, expected, rtol=1e-6)
    detection = detector.detect_from_map(word_map)
    if aggregation == "max":
      attribution, contribution = expected.max(0), expected.max(1)
    elif aggregation == "sum":
      attribution, contribution = expected.sum(0), expected.sum(1)
    else:
      attribution = np.exp(-scipy.stats.entropy(expected, axis=0))
      contribution = np.exp(-scipy.stats.entropy(expected, axis=1))
    assert detection.hallucination == pytest.approx(1 - scipy.stats.gmean(attribution))
    sides = [contribution[[r for r, (s, _) in enumerate(rows) if s.field == side]]
             for side in ("pro", "con")]
    assert detection.coverage == pytest.approx(1 - min(scipy.stats.gmean(x) for x in sides))
    np.testing.assert_allclose([w.score for w in detection.response_words], 1 - attribution,
                               rtol=1e-6, atol=1e-6)
    assert len(detection.argument_words) == sum(len(x) for x in sides)


def test_sentencepiece_offsets_are_characters_in_non_ascii_text(tmp_path):
  import sentencepiece as spm  # pylint: disable=g-import-not-at-top
  from jaxmoral.data import vocab  # pylint: disable=g-import-not-at-top
  model_file = vocab.build_demo_vocabulary(output_dir=tmp_path)
  text = "Déjà vu: voters’ café prices — rise"
  tokenized = salience.SentencePieceTokenizer(model_file)(text)
  pieces = spm.SentencePieceProcessor(model_file=model_file).encode(text, return_type="proto").pieces
  raw = text.encode("utf-8")
  # Each token's character span holds the bytes SentencePiece says it came from.
  assert [text[b:e] for b, e in tokenized.spans] == [raw[p.begin:p.end].decode() for p in pieces]
  # So a word after the accents maps to exactly the tokens that spell it.
  for word in ("voters", "prices", "rise"):
    start = text.index(word)
    (group,) = salience._token_groups(tokenized.spans, [(start, start + len(word))])
    assert "".join(text[slice(*tokenized.spans[t])] for t in group).strip() == word
