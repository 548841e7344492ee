"""Diamante training: the joint run learns to rank; the NLL-only ablation leaves the head."""

import gin
import numpy as np
import pytest

from jaxmoral import checkpoints
from jaxmoral.diamante import bundle as bundle_lib
from jaxmoral.diamante import toy, train_lib

COMMON = dict(model_size="tiny", model_overrides=dict(num_encoder_layers=1, num_decoder_layers=1),
              vocab_size=120, context_length=40, response_length=14, batch_size=8,
              learning_rate=3e-3, log_every=10, checkpoint_every=20)


@pytest.mark.slow
def test_joint_training_learns_to_rank_and_exports(tmp_path):
  gin.clear_config()
  gin.parse_config("jaxmoral.diamante.train_lib.train_diamante.pe_weight = 1.0")
  try:
    result = train_lib.train_diamante(model_dir=str(tmp_path / "joint"),
                                      train_turns=toy.toy_turns(30, seed=0), train_steps=40,
                                      **COMMON)
  finally:
    gin.clear_config()
  assert result["step"] == 40
  # The gin config of the run is kept beside it, as `jaxmoral train` keeps its own.
  assert "train_diamante.pe_weight = 1.0" in (tmp_path / "joint" / "config.gin").read_text()
  for key in ("train/nll", "train/pe_loss", "train/rank_accuracy", "train/gap_human_model",
              "train/gap_human_random", "train/gap_model_random"):
    assert np.isfinite(result[key]), key
  # Toy candidates are generic and random responses off-topic: over the last 10 steps (fresh
  # draws each epoch) the head orders most pairs right (chance: 0.5).
  assert result["train/rank_accuracy"] > 0.75
  assert result["train/gap_human_random"] > 0
  bundle = bundle_lib.load_from(tmp_path / "joint")
  assert bundle.model.with_scalar_head and bundle.features.context_length == 40


@pytest.mark.slow
def test_nll_only_ablation_never_updates_the_score_head(tmp_path):
  model_dir = tmp_path / "nll_only"
  train_lib.train_diamante(model_dir=str(model_dir), train_turns=toy.toy_turns(20, seed=1),
                           train_steps=20, pe_weight=0.0, **dict(COMMON, checkpoint_every=10))
  ckpt = model_dir / "checkpoints"
  at_10 = checkpoints.restore_params_from_run(ckpt, step=10)
  at_20 = checkpoints.restore_params_from_run(ckpt, step=20)
  for name in ("kernel", "bias"):
    np.testing.assert_array_equal(at_10["scalar_head"][name], at_20["scalar_head"][name])
  assert np.abs(at_10["decoder"]["logits_dense"]["kernel"]
                - at_20["decoder"]["logits_dense"]["kernel"]).max() > 0


def test_bad_arguments_are_named(tmp_path):
  with pytest.raises(ValueError, match="train_steps"):
    train_lib.train_diamante(model_dir=str(tmp_path), train_turns=toy.toy_turns(2),
                             train_steps=0)
  with pytest.raises(ValueError, match="exactly one of train_path, train_turns"):
    train_lib.train_diamante(model_dir=str(tmp_path))
  with pytest.raises(FileNotFoundError, match="vocab_path"):
    train_lib.train_diamante(model_dir=str(tmp_path), train_turns=toy.toy_turns(2),
                             vocab_path=str(tmp_path / "none.model"))
