"""`jaxmoral clarify <action>`: flags bind the action's function (the work itself is tested per
module); the defaults that make `train-model` run without a gin file."""

import json
import types

import gin
import pytest

from jaxmoral import action_commands
from jaxmoral import gin_utils
from jaxmoral.clarify import commands

PPO_MODEL_DIRS = ["--question_model_dir=q", "--answer_model_dir=a", "--fusion_model_dir=f",
                  "--judge_model_dir=j"]


@pytest.fixture(autouse=True)
def _clear_gin():
  gin.clear_config()
  yield
  gin.clear_config()


def test_unknown_action():
  with pytest.raises(ValueError, match="unknown action 'bogus'"):
    commands.main("bogus", [], gin_utils.GinArgs())


def test_train_ppo_names_missing_model_dirs():
  with pytest.raises(ValueError, match=r"^train-ppo: --question_model_dir, --answer_model_dir, "
                                       r"--fusion_model_dir, --judge_model_dir are required"):
    commands.main("train-ppo", ["--model_dir=/tmp/unused"], gin_utils.GinArgs())


def test_bad_flags_are_one_line_errors(tmp_path):
  # The argparse form `--which question` is no `--name=value` flag.
  with pytest.raises(ValueError, match=r"^train-model: expected --name=value flags, got "
                                       r"'--which'"):
    commands.main("train-model", ["--which", "judge", "--model_dir", "x"], gin_utils.GinArgs())
  gin.clear_config()
  with pytest.raises(ValueError, match=r"which must be one of .*got 'oracle'"):
    commands.main("train-model", ["--which=oracle", f"--model_dir={tmp_path / 'run'}"],
                  gin_utils.GinArgs())
  assert not (tmp_path / "run").exists()


def test_judge_classes_comma_list_is_a_tuple_and_configs_parse():
  from jaxmoral.clarify import chat  # pylint: disable=g-import-not-at-top
  parameters = action_commands._parameters(chat.chat)  # pylint: disable=protected-access
  bindings = action_commands.flag_bindings("jaxmoral.clarify.chat.chat",
                                           ["--judge_classes=wrong, okay,good"], parameters)
  assert bindings == ["jaxmoral.clarify.chat.chat.judge_classes = ('wrong', 'okay', 'good')"]
  gin_utils.parse_gin(gin_utils.GinArgs(files=("configs/clarify/tiny_cpu.gin",),
                                        bindings=tuple(bindings)))
  assert gin.query_parameter("clarify.chat.chat.judge_classes") == ("wrong", "okay", "good")
  assert gin.query_parameter("reward.RewardConfig.judge_classes") is not None


def _record_train_run(monkeypatch) -> dict:
  """Stands in for the core run: records what train_clarify_model hands it."""
  from jaxmoral.clarify import training  # pylint: disable=g-import-not-at-top
  seen = {}

  def train_run(**kwargs):
    seen.update(kwargs)
    return {"loss": 1.5}
  monkeypatch.setattr(training.runs, "train_run", train_run)
  return seen


def test_train_model_runs_without_a_gin_file(monkeypatch, tmp_path, capsys):
  from jaxmoral.models import config as config_lib  # pylint: disable=g-import-not-at-top
  seen = _record_train_run(monkeypatch)
  model_dir = tmp_path / "q"
  assert commands.main("train-model", ["--which=question", f"--model_dir={model_dir}",
                                       "--source=demo"], gin_utils.GinArgs()) == 0
  assert seen["model"].config == config_lib.t5_config(size="tiny")
  assert float(seen["optimizer"].learning_rate(0)) == pytest.approx(1e-3)
  assert (seen["train_steps"], seen["batch_size"]) == (1000, 32)
  assert seen["feature_lengths"] == {"inputs": 128, "targets": 32}
  assert (model_dir / "data" / "question_train.jsonl").exists()
  assert json.loads(capsys.readouterr().out) == {"loss": 1.5}


def test_train_model_flags_override_the_defaults(monkeypatch, tmp_path):
  from jaxmoral.models import config as config_lib  # pylint: disable=g-import-not-at-top
  seen = _record_train_run(monkeypatch)
  assert commands.main("train-model", ["--which=question", f"--model_dir={tmp_path / 'q'}",
                                       "--learning_rate=0.25", "--model_size=small",
                                       "--train_steps=7",
                                       "--feature_lengths={'inputs': 16, 'targets': 8}"],
                       gin_utils.GinArgs()) == 0
  assert float(seen["optimizer"].learning_rate(0)) == 0.25
  assert seen["model"].config == config_lib.t5_config(size="small")
  assert seen["train_steps"] == 7 and seen["feature_lengths"] == {"inputs": 16, "targets": 8}


@pytest.mark.parametrize("action, extra, macro", [
    ("train-model", ["--which=judge"], "LEARNING_RATE"),
    ("train-ppo", PPO_MODEL_DIRS, "PPO_LEARNING_RATE"),
])
def test_learning_rate_with_a_gin_optimizer_is_an_error(monkeypatch, tmp_path, action, extra,
                                                        macro):
  from jaxmoral.clarify import data as data_lib  # pylint: disable=g-import-not-at-top
  _model_dirs_in(tmp_path, monkeypatch)

  def read_data(*args, **kwargs):
    raise AssertionError("data read although the flag is ignored")
  monkeypatch.setattr(data_lib, "build_pairs", read_data)
  monkeypatch.setattr(data_lib, "situations", read_data)
  with pytest.raises(ValueError, match=rf"learning_rate=0.25 is the rate of the default AdamW.*"
                                       rf"--gin.{macro}=0.25"):
    commands.main(action, [f"--model_dir={tmp_path / 'run'}", "--learning_rate=0.25", *extra],
                  gin_utils.GinArgs(files=("configs/clarify/tiny_cpu.gin",)))


def _model_dirs_in(folder, monkeypatch):
  """PPO_MODEL_DIRS exist (input folders are checked before an action runs), in `folder`."""
  for arg in PPO_MODEL_DIRS:
    (folder / arg.split("=", 1)[1]).mkdir(exist_ok=True)
  monkeypatch.chdir(folder)


def test_train_ppo_defaults_apply_gin_bindings_of_ppo_config(monkeypatch, tmp_path):
  from jaxmoral.clarify import training  # pylint: disable=g-import-not-at-top
  _model_dirs_in(tmp_path, monkeypatch)
  seen = {}

  class Stop(Exception):
    pass

  def build_ppo_program(**kwargs):
    seen.update(kwargs)
    raise Stop
  monkeypatch.setattr(training.model_dirs, "inspect",
                      lambda path: types.SimpleNamespace(config="config", vocabulary="vocab"))
  monkeypatch.setattr(training.reward_lib.DefeasibilityReward, "from_dirs",
                      lambda **kwargs: "reward")
  monkeypatch.setattr(training, "build_ppo_program", build_ppo_program)
  with pytest.raises(Stop):
    commands.main("train-ppo", [f"--model_dir={tmp_path / 'ppo'}", *PPO_MODEL_DIRS,
                                "--learning_rate=0.5"],
                  gin_utils.GinArgs(bindings=("ppo_trainer.PPOConfig.batch_size = 8",)))
  assert seen["ppo_config"].batch_size == 8
  # The recipe's Adam: the rate decays linearly to 0 over the run's 100 iterations x 4 updates.
  rate = seen["optimizer"].learning_rate
  assert [float(rate(s)) for s in (0, 200, 400)] == pytest.approx([0.5, 0.25, 0.0])


def test_evaluate_checks_its_output_before_loading_a_model(monkeypatch, tmp_path):
  from jaxmoral.clarify import models  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(models, "load_model",
                      lambda *a, **k: pytest.fail("a model loaded before the output check"))
  a_file = tmp_path / "a_file"
  a_file.write_text("")
  with pytest.raises(NotADirectoryError):
    commands.main("evaluate", [*PPO_MODEL_DIRS, f"--output_path={a_file / 'eval.json'}"],
                  gin_utils.GinArgs())


@pytest.mark.parametrize("config", ["tiny_cpu", "gpu", "tpu_pod"])
def test_configs_give_chat_the_judge_classes_they_train(config):
  # With Diamante's `chat` module loaded too, as in a process that runs both methods: the
  # configs' selectors must name ClarifyDelphi's functions without ambiguity.
  import jaxmoral.diamante.chat  # noqa: F401  (loaded for its gin names)
  gin_utils.parse_gin(gin_utils.GinArgs(files=(f"configs/clarify/{config}.gin",)))
  trained = gin.query_parameter("training.train_clarify_model.judge_classes")
  for function in ("clarify.chat.chat", "clarify.chat.chat_from_file"):
    assert gin.query_parameter(f"{function}.judge_classes") == trained
