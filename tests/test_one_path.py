"""One path from pretrained weights to a sharded run, for every method.

Each method starts from the same Hugging Face checkpoint (written by `transformers` in
conftest.py), runs a few steps through its ordinary entry point with every model on a
(data 2, model 2) mesh of 4 of the 8 fake CPU devices, and must equal the same run on one
device: the core seq2seq run, prompt tuning, Diamante (a fresh scalar head on the pretrained
T5), and ClarifyDelphi PPO with all five models (question, answer, NLI, fusion, judge) sharded.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxmoral import model_dirs
from jaxmoral import optimizers
from jaxmoral import partitioning
from jaxmoral import prompt_tuning
from jaxmoral import runs
from jaxmoral.data import demo as demo_data
from jaxmoral.data import readers
from jaxmoral.diamante import data as diamante_data
from jaxmoral.diamante import diamante_model
from jaxmoral.models import trainable

STEPS = 3


def mesh() -> partitioning.PjitPartitioner:
  # Data 2 x model 2: both axes split (every sharded dimension of the tiny T5 divides 2) as on
  # 8 devices, and programs over 4 devices compile and run faster on a 2-core machine.
  return partitioning.PjitPartitioner(num_partitions=2, devices=jax.devices()[:4])


def one_device() -> partitioning.PjitPartitioner:
  return partitioning.PjitPartitioner(devices=jax.devices()[:1])


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
  rows = [{"inputs": f"question: {r['situation']}", "targets": r["question"]}
          for r in demo_data.clarify_questions()[:64]]
  return readers.write_jsonl(tmp_path_factory.mktemp("pairs") / "pairs.jsonl", rows)


def _assert_runs_equal(a, b, *, rtol=2e-4, atol=2e-5):
  """The two runs' final parameters (model_dirs reads them back, any format); `a` is the mesh
  run, read back onto the mesh (`_load_sharded`'s result), `b` a run directory."""
  pa, pb = a.params, model_dirs.load(b).params
  leaves_a = jax.tree_util.tree_leaves_with_path(jax.device_get(pa))
  leaves_b = jax.tree.leaves(jax.device_get(pb))
  assert len(leaves_a) == len(leaves_b)
  for (path, x), y in zip(leaves_a, leaves_b):
    name = jax.tree_util.keystr(path)
    np.testing.assert_allclose(x, y, rtol=rtol, atol=atol, err_msg=name)


def _load_sharded(run_dir, *, check=True):
  """The run read back onto the mesh (once: the equality and the other checks share it);
  `check`: its parameters are split over the mesh where their rules say so."""
  loaded = model_dirs.load(run_dir, partitioner=mesh())
  if check:
    kernel = loaded.params["decoder"]["layers_0"]["mlp"]["wi_0"]["kernel"]
    assert kernel.sharding.spec[1] == "model" and len(kernel.sharding.device_set) == 4
  return loaded


def _train(model_dir, *, model, data, partitioner, init_checkpoint, feature_lengths):
  return runs.train_run(
      model_dir=str(model_dir), model=model, data=data, train_steps=STEPS, batch_size=8,
      feature_lengths=feature_lengths,
      # Adam's eps well above float32 gradient noise: with the default 1e-8, a gradient entry
      # that is ~0 in exact arithmetic gets a full +-lr step whose sign is that noise (reduction
      # order differs between the mesh and one device, and between CPUs).
      optimizer=optimizers.make_optimizer(name="adamw", learning_rate=1e-3, eps=1e-5),
      partitioner=partitioner, init_checkpoint=str(init_checkpoint), log_every=STEPS,
      checkpoint_every=STEPS, seed=0)


@pytest.mark.parametrize("method", ["seq2seq", "prompt_tuning"])
def test_seq2seq_and_prompt_tuning_from_hf_sharded_equal_one_device(method, tmp_path, hf_t5,
                                                                    pairs):
  hf_dir, _ = hf_t5
  config = model_dirs.inspect(hf_dir).config
  model = (trainable.Seq2SeqModel(config=config) if method == "seq2seq" else
           prompt_tuning.PromptTuningModel(config=config,
                                           prompt=prompt_tuning.PromptConfig(length=3)))
  lengths = {"inputs": 32, "targets": 16}
  results = []
  for name, partitioner in (("mesh", mesh()), ("one", one_device())):
    result = _train(tmp_path / name, model=model, data=runs.Seq2SeqData(train_file=pairs),
                    partitioner=partitioner, init_checkpoint=hf_dir, feature_lengths=lengths)
    assert result["step"] == STEPS and np.isfinite(result["train/loss"])
    results.append(result)
  # The run's closing evaluation (the held-out pairs) too.
  np.testing.assert_allclose(results[0]["eval/loss"], results[1]["eval/loss"], rtol=1e-4)
  sharded = _load_sharded(tmp_path / "mesh", check=method == "seq2seq")
  _assert_runs_equal(sharded, tmp_path / "one")
  if method == "prompt_tuning":
    base = jax.device_get(model_dirs.load(hf_dir).params)
    tuned = sharded
    # Only the prompt moved; the base is the checkpoint's, bit for bit.
    for x, y in zip(jax.tree.leaves(base), jax.tree.leaves(jax.device_get(tuned.params))):
      np.testing.assert_array_equal(x, y)
    assert tuned.prompt.shape == (3, config.d_model)
    assert np.allclose(prompt_tuning.load_prompt(tmp_path / "mesh")[0], tuned.prompt)


def test_diamante_from_hf_sharded_equals_one_device(tmp_path, hf_t5):
  hf_dir, _ = hf_t5
  config = model_dirs.inspect(hf_dir).config
  data = diamante_data.DialogueData(train_path=str(demo_data.path("dialogues.jsonl")))
  for name, partitioner in (("mesh", mesh()), ("one", one_device())):
    _train(tmp_path / name, model=diamante_model.DiamanteModel(config=config), data=data,
           partitioner=partitioner, init_checkpoint=hf_dir,
           feature_lengths={"inputs": 32, "targets": 12})
  run = _load_sharded(tmp_path / "mesh", check=False)
  _assert_runs_equal(run, tmp_path / "one")
  assert run.has_scalar_head and run.vocabulary is not None  # The checkpoint's vocabulary.
  # The T5 moved from the pretrained weights; the head was added fresh.
  pretrained = jax.device_get(model_dirs.load(hf_dir).params)
  moved = jax.device_get(run.params)["decoder"]["layers_0"]["mlp"]["wo"]["kernel"]
  assert not np.allclose(moved, pretrained["decoder"]["layers_0"]["mlp"]["wo"]["kernel"])


def test_clarify_ppo_with_five_models_from_hf_sharded_resumed_equals_one_device(tmp_path,
                                                                              hf_t5):
  """PPO from the HF checkpoint with the question, answer, NLI, fusion and judge models all
  sharded, stopped after 1 iteration and resumed to 2, equals 2 straight iterations on one
  device: the same parameters, the same reward curve (sampled answers are keyed by iteration,
  so the resumed run draws what the uninterrupted one drew)."""
  from jaxmoral.clarify import reward as reward_lib  # pylint: disable=g-import-not-at-top
  from jaxmoral.clarify import training  # pylint: disable=g-import-not-at-top
  from jaxmoral.rl import ppo_trainer  # pylint: disable=g-import-not-at-top
  hf_dir, _ = hf_t5
  # Rollouts of 4 prompts (2 per data shard), 2 minibatches of 2: the fewest that still split
  # every batch over the data axis; 2 iterations x 4 = the 8 prompts. The reward scale is
  # measured on all 8 (two rollout batches): over 4 the rewards can all be equal, and the run
  # would use the sigma0 = 1 fallback instead of a measured scale.
  ppo_config = ppo_trainer.PPOConfig(batch_size=4, num_ppo_epochs=1, num_minibatches=2,
                                     max_prompt_length=32, max_response_length=8,
                                     reward_norm_num_prompts=8)
  reward_config = reward_lib.RewardConfig(judge_classes=("wrong", "okay", "good"),
                                          input_length=32, max_answer_length=8,
                                          max_fusion_length=16, batch_size=4,
                                          answer_greedy=False)

  def ppo(name, partitioner, iterations):
    return training.train_clarify_ppo(
        model_dir=str(tmp_path / name), question_model_dir=str(hf_dir),
        answer_model_dir=str(hf_dir), fusion_model_dir=str(hf_dir),
        judge_model_dir=str(hf_dir), nli_model_dir=str(hf_dir), ppo_config=ppo_config,
        optimizer=optimizers.make_optimizer(name="adamw", learning_rate=1e-4),
        num_iterations=iterations, reward_config=reward_config, max_prompts=8,
        # Checkpoints only at each run's end (1, then 2; the straight run's 2): resuming needs
        # no more, and each save costs a second.
        partitioner=partitioner, log_every=1, checkpoint_every=2, sample_every=0,
        async_checkpoint=False)

  sharded = mesh()
  first = ppo("mesh", sharded, 1)
  assert (tmp_path / "mesh" / "checkpoints" / "1").is_dir()  # What the next run resumes.
  resumed = ppo("mesh", sharded, 2)
  straight = ppo("one", one_device(), 2)
  assert first["iteration"] == 1 and resumed["iteration"] == straight["iteration"] == 2
  assert resumed["reward_curve_values"][:1] == first["reward_curve_values"]
  np.testing.assert_allclose(resumed["reward_curve_values"], straight["reward_curve_values"],
                             rtol=1e-4, atol=1e-5)
  assert resumed["reward_curve"].endswith(".png")
  tuned = _load_sharded(tmp_path / "mesh")
  _assert_runs_equal(tuned, tmp_path / "one")
  # The PPO run directory is the tuned question generator, and it moved from the checkpoint.
  pretrained = model_dirs.load(hf_dir)
  assert tuned.info.format == "run" and tuned.vocabulary is not None
  assert any(not np.allclose(a, b) for a, b in zip(
      jax.tree.leaves(jax.device_get(tuned.params)),
      jax.tree.leaves(jax.device_get(pretrained.params))))
