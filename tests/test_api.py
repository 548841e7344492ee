"""api.py: the notebook `Model`, checked against torch (same weights) and decoding.py."""

from __future__ import annotations

import shutil

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import hf_logits  # noqa: E402
from jaxmoral import api  # noqa: E402
from jaxmoral import checkpoints  # noqa: E402
from jaxmoral import decoding  # noqa: E402
from jaxmoral import inference  # noqa: E402
from jaxmoral import params_export  # noqa: E402
from jaxmoral.data import vocab as vocab_lib  # noqa: E402

# What runs is tested here, not how it is sharded (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("one_device")

INPUTS = ["Is it okay to lie to a friend?", "Helping a stranger.", "Why?"]
TARGETS = ["It depends on why.", "It is good.", "Because I was asked to help them out."]


@pytest.fixture(scope="module")
def vocabulary():
  return vocab_lib.get_vocabulary(None)  # The demo vocabulary (500 ids), built once.


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, vocabulary):
  """A random tiny T5 1.1 saved by transformers, with the vocabulary as spiece.model."""
  torch.manual_seed(0)
  config = transformers.T5Config(vocab_size=512, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                 num_heads=4, dropout_rate=0.0, feed_forward_proj="gated-gelu",
                                 tie_word_embeddings=False)
  model = transformers.T5ForConditionalGeneration(config).eval()
  with torch.no_grad():
    for p in model.parameters():
      p.mul_(1.0 + 0.3 * torch.randn_like(p))
    model.lm_head.weight = torch.nn.Parameter(torch.randn(512, 32) * 32 ** -0.5)
  directory = tmp_path_factory.mktemp("hf")
  model.save_pretrained(directory, safe_serialization=True)
  shutil.copyfile(vocabulary.sentencepiece_model_file, directory / "spiece.model")
  return directory, model


@pytest.fixture(scope="module")
def model(hf_dir):
  return api.Model.from_pretrained(hf_dir[0])


def _padded(rows):
  out = np.zeros((len(rows), max(map(len, rows))), np.int32)
  for i, row in enumerate(rows):
    out[i, :len(row)] = row
  return out


def _torch_logits(torch_model, enc, targets):
  dec = np.zeros_like(targets)
  dec[:, 1:] = targets[:, :-1]
  return hf_logits(torch_model, enc, dec)


def test_hf_dir_logits_match_torch(model, hf_dir):
  assert model.vocabulary is not None  # spiece.model picked up from the HF folder.
  enc = _padded(model.encode_text(INPUTS))
  targets = _padded(model.encode_text(TARGETS))
  assert np.all(enc[np.arange(3), (enc != 0).sum(1) - 1] == 1)  # EOS appended.
  ours = model.logits(INPUTS, TARGETS)
  ref = _torch_logits(hf_dir[1], enc, targets)
  assert ours.shape == ref.shape
  valid = targets != 0
  np.testing.assert_allclose(ours[valid], ref[valid], atol=2e-4, rtol=1e-4)
  # Token ids in give the same as texts in.
  np.testing.assert_array_equal(model.logits(enc, targets), ours)


def test_score_is_sum_of_torch_token_logprobs(model, hf_dir):
  enc = _padded(model.encode_text(INPUTS))
  targets = _padded(model.encode_text(TARGETS))
  ref_logits = _torch_logits(hf_dir[1], enc, targets).astype(np.float64)
  log_probs = ref_logits - np.log(np.exp(ref_logits).sum(-1, keepdims=True))
  token_lp = np.take_along_axis(log_probs, targets[..., None], -1)[..., 0]
  expected = (token_lp * (targets != 0)).sum(1)
  scores = model.score(INPUTS, TARGETS)
  assert scores.shape == (3,)
  np.testing.assert_allclose(scores, expected, atol=1e-3, rtol=1e-4)
  # Batching does not change the numbers; buckets keep the compile count small.
  np.testing.assert_allclose(model.score(INPUTS, TARGETS, batch_size=2), scores, atol=1e-4)


def test_exported_dir_gives_same_logits(model, tmp_path, vocabulary):
  params_export.export_params(model.params, tmp_path, config=model.config.to_dict())
  (tmp_path / "vocab").mkdir()
  shutil.copyfile(vocabulary.sentencepiece_model_file, tmp_path / "vocab" / "spiece.model")
  exported = api.Model.from_pretrained(tmp_path)
  assert exported.config == model.config and exported.vocabulary is not None
  np.testing.assert_allclose(exported.logits(INPUTS, TARGETS), model.logits(INPUTS, TARGETS),
                             atol=1e-6)


def test_run_dir_loads_latest_checkpoint(model, tmp_path, vocabulary):
  (tmp_path / "model_config.json").write_text(model.config.to_json())
  with checkpoints.CheckpointManager(tmp_path / "checkpoints", async_save=False) as manager:
    zeros = jax.tree_util.tree_map(np.zeros_like, model.params)
    manager.save(1, {"params": zeros, "step": np.int32(1)}, force=True)
    manager.save(2, {"params": model.params, "step": np.int32(2)}, force=True)
  run = api.Model.from_pretrained(tmp_path, vocabulary=vocabulary.sentencepiece_model_file)
  np.testing.assert_allclose(run.score(INPUTS, TARGETS), model.score(INPUTS, TARGETS),
                             atol=1e-5)
  first = api.Model.from_pretrained(tmp_path, step=1)
  assert first.vocabulary is None  # No vocab/ folder in this run dir, none given.
  assert np.all(first.params["token_embedder"]["embedding"] == 0)


def test_generate_greedy_equals_decoding_sample(model):
  out = model.generate(INPUTS, max_decode_length=12, greedy=True)
  enc = _padded(model.encode_text(INPUTS))
  ref = decoding.sample(model.module, model.params, encoder_input_tokens=enc,
                        max_decode_length=12, greedy=True)
  np.testing.assert_array_equal(out.tokens, np.asarray(ref.tokens))
  np.testing.assert_array_equal(out.lengths, np.asarray(ref.lengths))
  np.testing.assert_allclose(out.scores, np.asarray((ref.logprobs * ref.mask).sum(-1)),
                             atol=1e-5)
  assert out.texts == [[t] for t in model.decode_text(np.asarray(ref.tokens)[:, 0])]
  # beam_size=1 is greedy search too (decoding.beam_search's contract).
  beam = model.generate(INPUTS, max_decode_length=12, beam_size=1)
  np.testing.assert_array_equal(beam.tokens, out.tokens)


def test_generate_defaults_to_greedy_with_a_short_repr(model):
  default = model.generate(INPUTS, max_decode_length=12)
  greedy = model.generate(INPUTS, max_decode_length=12, greedy=True)
  np.testing.assert_array_equal(default.tokens, greedy.tokens)
  sampled = model.generate(INPUTS, max_decode_length=12, temperature=0.7, seed=3)
  assert not np.array_equal(sampled.tokens, greedy.tokens)
  shown = repr(default)
  assert repr(default.texts) in shown and "tokens=<" in shown
  assert str(default.tokens[0, 0].tolist()) not in shown and len(shown) < 2000


def test_sampling_options_and_seeds(model):
  a = model.generate(INPUTS[:2], max_decode_length=6, num_samples=3, top_k=20, seed=1)
  b = model.generate(INPUTS[:2], max_decode_length=6, num_samples=3, top_k=20, seed=1)
  assert a.tokens.shape == (2, 3, 6) and len(a.texts) == 2 and len(a.texts[0]) == 3
  np.testing.assert_array_equal(a.tokens, b.tokens)
  c = model.generate(INPUTS[:2], max_decode_length=6, num_samples=3, top_k=20, seed=2)
  assert not np.array_equal(a.tokens, c.tokens)


def test_text_round_trip_and_input_errors(model, tmp_path):
  ids = model.encode_text(["Is it okay to lie?"])
  assert ids[0][-1] == 1
  assert model.decode_text(ids) == ["Is it okay to lie?"]
  with pytest.raises(TypeError, match="list of strings"):
    model.score("one string", ["x"])
  with pytest.raises(ValueError, match="inputs has 2 rows but targets has 1"):
    model.score(INPUTS[:2], TARGETS[:1])
  with pytest.raises(ValueError, match=r"targets\[0\]: token ids outside \[0, 512\)"):
    model.score([[5, 1]], [[600, 1]])
  bare = api.Model(model.config, model.params)
  with pytest.raises(ValueError, match="no vocabulary"):
    bare.encode_text(["hi"])
  assert bare.generate(np.array([[5, 6, 1]]), max_decode_length=3, greedy=True).texts is None
  with pytest.raises(FileNotFoundError, match="no model found"):
    api.Model.from_pretrained(tmp_path)


def test_bucketing_keeps_compiles_few(model):
  fresh = api.Model(model.config, model.params, vocabulary=model.vocabulary)
  # Compiled functions are kept per model (shared by models of one config and mesh).
  fn = fresh.jitted(inference._teacher_forced_logits, 2)
  before = fn._cache_size()
  rng = np.random.RandomState(0)
  for rows, enc_len, dec_len in [(1, 17, 32), (3, 32, 20), (8, 24, 24)]:  # One bucket shape.
    fresh.logits(rng.randint(2, 500, (rows, enc_len)), rng.randint(2, 500, (rows, dec_len)))
  assert fn._cache_size() == before + 1
  fresh.logits(rng.randint(2, 500, (9, 33)), rng.randint(2, 500, (9, 3)))  # Next bucket.
  assert fn._cache_size() == before + 2
