"""Diamante through the core run: the joint model learns to rank, the NLL-only ablation leaves
the head alone, and the run directory is the inference model."""

import gin
import numpy as np
import pytest

import toy_dialogues
from jaxmoral import optimizers, params_export, partitioning, runs
from jaxmoral.diamante import bundle as bundle_lib
from jaxmoral.diamante import data
from jaxmoral.diamante import diamante_model
from jaxmoral.models.config import t5_config

# Learning is tested here (tests/test_one_path.py shards Diamante): tests/conftest.py.
pytestmark = pytest.mark.usefixtures("one_device")

CONFIG = t5_config(size="tiny", num_encoder_layers=1, num_decoder_layers=1)
LENGTHS = {"inputs": 40, "targets": 14}


def _train(model_dir, turns, *, steps, pe_weight=1.0, checkpoint_every=20, vocab_size=120):
  train_path = str(model_dir) + "_train.jsonl"
  data.write_turns(train_path, turns)
  return runs.train_run(
      model_dir=str(model_dir), model=diamante_model.DiamanteModel(config=CONFIG,
                                                                  pe_weight=pe_weight),
      data=data.DialogueData(train_path=train_path, vocab_size=vocab_size),
      train_steps=steps, batch_size=8, feature_lengths=LENGTHS,
      optimizer=optimizers.make_optimizer(name="adamw", learning_rate=3e-3),
      partitioner=partitioning.PjitPartitioner(), log_every=10,
      checkpoint_every=checkpoint_every)


def test_joint_training_learns_to_rank_and_its_run_is_the_model(tmp_path):
  result = _train(tmp_path / "joint", toy_dialogues.toy_turns(30, seed=0), steps=40)
  assert result["step"] == 40
  for key in ("train/nll", "train/pe_loss", "train/rank_accuracy", "train/gap_human_model",
              "train/gap_human_random", "train/gap_model_random"):
    assert np.isfinite(result[key]), key
  # Toy candidates are generic and random responses off-topic: over the last 10 steps (fresh
  # draws each epoch) the head orders most pairs right (chance: 0.5).
  assert result["train/rank_accuracy"] > 0.75
  assert result["train/gap_human_random"] > 0
  # The run directory loads for inference: the head, the trained vocabulary, the lengths.
  bundle = bundle_lib.load(tmp_path / "joint")
  assert bundle.module.with_scalar_head and bundle.features.context_length == 40
  assert bundle.features.response_length == 14
  assert bundle.vocabulary.sentencepiece_model_file.startswith(str(tmp_path / "joint" / "vocab"))


def test_nll_only_ablation_never_updates_the_score_head(tmp_path):
  model_dir = tmp_path / "nll_only"
  # Two updates between the checkpoints show it as ten do (the decoder's logits move in one).
  _train(model_dir, toy_dialogues.toy_turns(20, seed=1), steps=4, pe_weight=0.0, checkpoint_every=2)
  ckpt = model_dir / "checkpoints"
  early = params_export.restore_params_from_run(ckpt, step=2)
  late = params_export.restore_params_from_run(ckpt, step=4)
  for name in ("kernel", "bias"):
    np.testing.assert_array_equal(early["scalar_head"][name], late["scalar_head"][name])
  assert np.abs(early["decoder"]["logits_dense"]["kernel"]
                - late["decoder"]["logits_dense"]["kernel"]).max() > 0


def test_bad_arguments_are_named(tmp_path):
  with pytest.raises(ValueError, match="DiamanteModel.pe_weight"):
    diamante_model.DiamanteModel(config=CONFIG, pe_weight=-1.0)
  data.write_turns(tmp_path / "x.jsonl", toy_dialogues.toy_turns(2))
  with pytest.raises(ValueError, match="DialogueData.vocab_path: no such file"):
    data.DialogueData(train_path=str(tmp_path / "x.jsonl"),
                      vocab_path=str(tmp_path / "none.model")).vocabulary(str(tmp_path))
  with pytest.raises(ValueError, match="DialogueData.train_path: no such file"):
    data.DialogueData(train_path=str(tmp_path / "none.jsonl")).sources(
        vocabulary=None, batch_size=8, feature_lengths=LENGTHS, seed=0)


def test_a_bad_data_file_fails_before_training_and_leaves_no_run_dir(tmp_path):
  """The error names the file and line; the run folder this call made is gone again, and a
  folder that existed before is left alone."""
  bad = tmp_path / "bad.jsonl"
  data.write_turns(bad, toy_dialogues.toy_turns(2))
  lines = len(bad.read_text().splitlines())
  with open(bad, "a") as f:
    f.write('{"context": 3}\n')
  for model_dir, existed in ((tmp_path / "new_run", False), (tmp_path / "old_run", True)):
    if existed:
      model_dir.mkdir()
      (model_dir / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=rf"bad\.jsonl:{lines + 1}: missing required field"):
      runs.train_run(model_dir=str(model_dir), model=diamante_model.DiamanteModel(config=CONFIG),
                     data=data.DialogueData(train_path=str(bad), vocab_size=120),
                     train_steps=2, batch_size=8, feature_lengths=LENGTHS,
                     optimizer=optimizers.make_optimizer(name="adamw", learning_rate=1e-3))
    assert model_dir.exists() == existed
  assert (tmp_path / "old_run" / "notes.txt").read_text() == "mine"


def test_diamante_train_command_is_the_core_run_with_its_gin(tmp_path):
  from jaxmoral import cli  # pylint: disable=g-import-not-at-top
  gin.clear_config()
  try:
    assert cli.main(["diamante", "train", "--gin_file=configs/diamante/tiny_cpu.gin",
                     f"--gin.MODEL_DIR={tmp_path}", "--gin.TRAIN_STEPS=2",
                     "--gin.CHECKPOINT_EVERY=2", "--gin.PE_WEIGHT=0.0",
                     # What is checked is the command and its gin, not the model's size: the
                     # shapes, loss and optimizer of the NLL-only run above, whose train step
                     # the compilation cache then serves to this one.
                     "--gin.LEARNING_RATE=3e-3", "--gin.BATCH_SIZE=8",
                     f"--gin.TASK_FEATURE_LENGTHS={LENGTHS}",
                     "--gin.config.t5_config.num_encoder_layers=1",
                     "--gin.config.t5_config.num_decoder_layers=1",
                     "--gin.diamante.DialogueData.vocab_size=120"]) == 0
  finally:
    gin.clear_config()
  assert "PE_WEIGHT = 0.0" in (tmp_path / "config.gin").read_text()
  assert bundle_lib.load(tmp_path).module.with_scalar_head
