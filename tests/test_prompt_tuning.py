"""Soft prompt tuning: prompt placement and masks, initialisers, frozen base, save/load."""

import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoral import optimizers
from jaxmoral import partitioning
from jaxmoral import prompt_tuning as pt
from jaxmoral import run_layout
from jaxmoral import runs
from jaxmoral.models.config import t5_config
from jaxmoral.models.t5 import T5, init_params

# What is trained is tested here, not how it is sharded (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("one_device")

CFG = t5_config(size="tiny", vocab_size=128, d_model=32, d_kv=8, d_ff=64,
                num_encoder_layers=1, num_decoder_layers=1)


@pytest.fixture(scope="module")
def base():
  model = T5(CFG)
  return model, nn.meta.unbox(init_params(model, jax.random.PRNGKey(0)))


def test_prompt_equals_prefix_tokens_with_those_embeddings(base):
  """A prompt made of token embeddings must act exactly like those tokens prefixed: same
  positions and always-visible mask in encoder self- and decoder cross-attention."""
  model, params = base
  prefix = np.array([7, 9, 11])
  prompt = params["token_embedder"]["embedding"][prefix]
  tokens = jnp.array([[5, 6, 7, 8, 1, 0, 0], [20, 21, 1, 0, 0, 0, 0]])
  decoder = jnp.array([[0, 3, 4, 5], [0, 6, 7, 8]])
  prompted = jax.jit(pt.PromptedT5(CFG, 3).apply)(
      {"params": pt.prompted_params(params, prompt)}, tokens, decoder)
  # Reference: real tokens in front, padding moved to the end so no prompt row is masked.
  lengths = (tokens != 0).sum(1)
  ref_tokens = np.zeros((2, 10), np.int32)
  for b in range(2):
    ref_tokens[b, :3 + lengths[b]] = np.concatenate([prefix, np.asarray(tokens[b, :lengths[b]])])
  reference = jax.jit(model.apply)({"params": params}, jnp.asarray(ref_tokens), decoder)
  np.testing.assert_allclose(prompted, reference, atol=2e-5)


def test_initialisers(base):
  _, params = base
  table = np.asarray(params["token_embedder"]["embedding"])
  sample = pt.init_prompt(pt.PromptConfig(length=5, vocab_sample_size=20),
                          rng=jax.random.PRNGKey(1), embedding_table=table)
  rows = [int(np.flatnonzero((table == r).all(1))[0]) for r in sample]
  assert len(set(rows)) == 5 and max(rows) < 20  # without replacement, from the first N ids
  words = pt.init_prompt(pt.PromptConfig(length=3, init="words", init_words=("yes", "no"),
                                         vocab_sample_size=20),
                         rng=jax.random.PRNGKey(1), embedding_table=table,
                         word_ids=[[4], [5, 6]])
  np.testing.assert_array_equal(words[0], table[4])
  np.testing.assert_allclose(words[1], (table[5] + table[6]) / 2, rtol=1e-6)
  uniform = pt.init_prompt(pt.PromptConfig(init="uniform", uniform_scale=0.1),
                           rng=jax.random.PRNGKey(2), embedding_table=table)
  assert uniform.shape == (5, 32) and np.abs(uniform).max() <= 0.1
  with pytest.raises(ValueError, match="PromptConfig.vocab_sample_size"):
    pt.PromptConfig(length=6, vocab_sample_size=5)
  with pytest.raises(ValueError, match="d_model=32"):
    pt.prompted_params(params, np.zeros((5, 16)))


def _batch(seed):
  rng = np.random.default_rng(seed)
  enc = rng.integers(2, CFG.vocab_size, (8, 12)).astype(np.int32)
  enc[:, 9:] = 0
  targets = rng.integers(2, 12, (8, 6)).astype(np.int32)
  dec = np.zeros_like(targets)
  dec[:, 1:] = targets[:, :-1]
  return {"encoder_input_tokens": enc, "decoder_input_tokens": dec,
          "decoder_target_tokens": targets, "decoder_loss_weights": np.ones_like(targets)}


def test_training_updates_only_the_prompt(base):
  _, params = base
  optimizer = optimizers.make_optimizer(name="adafactor", learning_rate=0.3)
  trainer = runs.make_trainer(
      model=pt.PromptTuningModel(config=CFG, prompt=pt.PromptConfig(length=4)),
      optimizer=optimizer, partitioner=partitioning.PjitPartitioner())
  prompt = pt.init_prompt(pt.PromptConfig(length=4, vocab_sample_size=50),
                          rng=jax.random.PRNGKey(3), embedding_table=params["token_embedder"]
                          ["embedding"])
  state = trainer.init_state_from_params(pt.prompted_params(params, prompt))
  # Optimizer state exists for the prompt only: every non-scalar leaf is prompt-sized.
  opt_sizes = {np.size(x) for x in jax.tree_util.tree_leaves(state.opt_state) if np.size(x) > 1}
  assert opt_sizes <= {4, 32, 4 * 32}
  losses = []
  batch = _batch(0)
  for step in range(12):
    state, metrics = trainer.train_step(state, batch, jax.random.PRNGKey(step))
    losses.append(float(metrics["loss"]))
  assert losses[-1] < losses[0] - 0.1
  after = jax.device_get(state.params)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(after["base"]),
                          jax.tree_util.tree_leaves(params)):
    np.testing.assert_array_equal(a, b, err_msg=str(path))  # bit-identical base
  assert not np.allclose(after["prompt"], prompt)


@pytest.mark.parametrize("orbax", [False, True])
def test_saved_prompt_reloads_to_identical_outputs(base, tmp_path, orbax):
  model, params = base
  prompt = np.random.default_rng(0).normal(size=(5, 32)).astype(np.float32)
  pt.save_prompt(prompt, tmp_path, metadata={"task": "generator"}, orbax=orbax)
  if orbax:
    (tmp_path / pt.PROMPT_FILE).unlink()  # force the Orbax path
  loaded, meta = pt.load_prompt(tmp_path)
  assert meta["task"] == "generator" and meta["length"] == 5
  tokens = jnp.array([[5, 6, 7, 1]])
  decoder = jnp.array([[0, 3, 4]])
  prompted = pt.PromptedT5(CFG, 5)
  combined = pt.prompted_params(params, loaded)
  assert combined["base"] is params  # one base serves every prompt, no copy
  apply = jax.jit(prompted.apply)  # Compiled once: op by op, every op compiles on its own.
  np.testing.assert_array_equal(
      apply({"params": combined}, tokens, decoder),
      apply({"params": pt.prompted_params(params, prompt)}, tokens, decoder))
  # The prompted inputs drive the base model directly too (decoding uses this path).
  embeds, mask = pt.prompted_encoder_inputs(model, params, loaded, tokens)
  np.testing.assert_array_equal(
      jax.jit(model.apply)({"params": params}, None, decoder, encoder_embeds=embeds,
                           encoder_mask=mask),
      apply({"params": combined}, tokens, decoder))


def test_load_prompt_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="no prompt.npy"):
    pt.load_prompt(tmp_path)


def test_a_prompt_saves_to_and_loads_from_a_bucket(gcs):
  """A prompt-tuning run's MODEL_DIR may be gs://: `MODEL_DIR/prompt` is written there and
  found and read back from there (prompt.npy, metadata, the Orbax copy)."""
  from jaxmoral import fileio  # pylint: disable=g-import-not-at-top
  del gcs
  prompt = np.random.default_rng(1).normal(size=(3, 8)).astype(np.float32)
  run = "gs://bucket/prompt_run"
  assert pt.SavePromptHook(run, {}).directory == f"{run}/{run_layout.PROMPT_DIR}"  # A run's own.
  pt.save_prompt(prompt, f"{run}/{run_layout.PROMPT_DIR}", metadata={"task": "judge"}, orbax=True)
  assert pt.prompt_directory(run) == f"{run}/{run_layout.PROMPT_DIR}"
  loaded, meta = pt.load_prompt(run)
  np.testing.assert_array_equal(loaded, prompt)
  assert meta == {"task": "judge", "length": 3, "d_model": 8}
  fileio.remove(f"{run}/{run_layout.PROMPT_DIR}/{pt.PROMPT_FILE}")  # Then only the Orbax copy:
  np.testing.assert_array_equal(pt.load_prompt(run)[0], prompt)
  assert not os.path.exists("gs:")  # Nothing went to a local "gs:" folder.
