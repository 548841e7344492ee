"""`jaxmoral clarify <action>` flag handling (the work itself is tested per module)."""

import gin
import pytest

from jaxmoral import gin_utils
from jaxmoral.clarify import commands


@pytest.fixture(autouse=True)
def _clear_gin():
  gin.clear_config()
  yield
  gin.clear_config()


def test_unknown_action():
  with pytest.raises(ValueError, match="unknown action 'bogus'"):
    commands.main("bogus", [], gin_utils.GinArgs())


def test_train_ppo_names_missing_model_dir():
  with pytest.raises(ValueError, match="--question_model_dir is required"):
    commands.main("train-ppo", ["--model_dir", "/tmp/unused"], gin_utils.GinArgs())


def test_bad_flag_exits_with_usage():
  with pytest.raises(SystemExit):
    commands.main("train-model", ["--which", "oracle", "--model_dir", "x"], gin_utils.GinArgs())


def test_gin_config_parses_and_binds_entry_points():
  commands._parser("evaluate").parse_args(["--question_model_dir", "q"])
  gin_utils.parse_gin(gin_utils.GinArgs(files=("configs/clarify/tiny_cpu.gin",)))
  assert gin.query_parameter("reward.RewardConfig.judge_classes") is not None
  assert commands._classes("wrong, okay,good") == ("wrong", "okay", "good")


@pytest.mark.parametrize("action, extra, macro, fragment", [
    ("train-model", ["--which", "judge"], "LEARNING_RATE", "tiny_cpu"),
    ("train-ppo", ["--question_model_dir=q", "--answer_model_dir=a", "--fusion_model_dir=f",
                   "--judge_model_dir=j"], "PPO_LEARNING_RATE", "tiny_cpu"),
])
def test_learning_rate_flag_sets_the_gin_optimizers_rate(monkeypatch, action, extra, macro,
                                                         fragment):
  from jaxmoral.clarify import training  # pylint: disable=g-import-not-at-top
  seen = {}

  def fake(**kwargs):
    seen["rate"] = gin.query_parameter(f"%{macro}")
    seen["optimizer_rate"] = float(kwargs["optimizer"].learning_rate(0)) if "optimizer" in \
        kwargs else None
    return {}

  target = "train_clarify_model" if action == "train-model" else "train_clarify_ppo"
  monkeypatch.setattr(training, target, fake)
  gin_args = gin_utils.GinArgs(files=(f"configs/clarify/{fragment}.gin",))
  commands.main(action, ["--model_dir", "/tmp/unused", "--learning_rate", "0.25", *extra],
                gin_args)
  assert seen["rate"] == 0.25


def test_learning_rate_flag_without_a_gin_optimizer_builds_one(monkeypatch):
  from jaxmoral.clarify import training  # pylint: disable=g-import-not-at-top
  seen = {}
  monkeypatch.setattr(training, "train_clarify_model",
                      lambda **kw: seen.update(rate=float(kw["optimizer"].learning_rate(0))))
  commands.main("train-model", ["--which", "judge", "--model_dir", "/tmp/unused",
                                "--learning_rate", "0.25"], gin_utils.GinArgs())
  assert seen["rate"] == 0.25


def test_learning_rate_flag_a_gin_optimizer_does_not_read_is_an_error(monkeypatch, tmp_path):
  from jaxmoral.clarify import training  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(training, "train_clarify_model", lambda **kw: pytest.fail("trained"))
  config = tmp_path / "own_rate.gin"
  config.write_text("from jaxmoral import optimizers\n"
                    "from jaxmoral.clarify import training\n"
                    "training.train_clarify_model.optimizer = @optimizers.make_optimizer()\n"
                    "optimizers.make_optimizer.learning_rate = 0.1\n")
  with pytest.raises(ValueError, match="sets the gin macro LEARNING_RATE, which"):
    commands.main("train-model", ["--which", "judge", "--model_dir", "/tmp/unused",
                                  "--learning_rate", "0.25"],
                  gin_utils.GinArgs(files=(str(config),)))


@pytest.mark.parametrize("config", ["tiny_cpu", "gpu", "tpu_pod"])
def test_configs_give_chat_the_judge_classes_they_train(config):
  # With Diamante's `chat` module loaded too, as in a process that runs both methods: the
  # configs' selectors must name ClarifyDelphi's functions without ambiguity.
  import jaxmoral.diamante.chat  # pylint: disable=g-import-not-at-top,unused-import
  gin_utils.parse_gin(gin_utils.GinArgs(files=(f"configs/clarify/{config}.gin",)))
  trained = gin.query_parameter("training.train_clarify_model.judge_classes")
  for function in ("clarify.chat.chat", "clarify.chat.chat_from_file"):
    assert gin.query_parameter(f"{function}.judge_classes") == trained
