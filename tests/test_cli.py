"""`jaxmoral train | eval | infer | export` end to end on the tiny CPU config."""

import json
import os
import pathlib
import re
import subprocess
import sys

import gin
import jax
import numpy as np
import pytest

from jaxmoral import checkpoints, model_dirs, params_export
from jaxmoral import cli
from jaxmoral import metric_writers


pytestmark = pytest.mark.usefixtures("one_device", "clean_gin")
ROOT = pathlib.Path(__file__).resolve().parents[1]


@gin.configurable(module="test_cli")
def first_device() -> list[jax.Device]:
  return jax.devices()[:1]


TINY = ["--gin_file=configs/core/tiny_cpu.gin", "--gin.TRAIN_STEPS=12",
        "--gin.CHECKPOINT_EVERY=6", "--gin.EVAL_EVERY=6", "--gin.BATCH_SIZE=8",
        "--gin.runs.train_run.log_every=6", "--gin.WARMUP_STEPS=2",
        # One layer each: what is tested is the command line, not the depth.
        "--gin.config.t5_config.num_encoder_layers=1",
        "--gin.config.t5_config.num_decoder_layers=1",
        # One device: what is tested is the command line, not sharding (the 8-device data
        # parallel mesh costs more to compile and run).
        "--gin.partitioning.PjitPartitioner.devices=@test_cli.first_device()"]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
  model_dir = tmp_path_factory.mktemp("run")
  gin.clear_config()
  assert cli.main(["train", *TINY, f"--gin.MODEL_DIR={model_dir}"]) == 0
  gin.clear_config()
  return model_dir


def test_train_writes_config_checkpoints_and_tensorboard(trained_run):
  assert (trained_run / "config.gin").is_file()
  assert "TRAIN_STEPS = 12" in (trained_run / "config.gin").read_text()
  assert sorted(p.name for p in (trained_run / "checkpoints").iterdir()
                if p.name.isdigit()) == ["12", "6"]
  assert list((trained_run / "train").glob("events.out.tfevents*"))
  assert list((trained_run / "eval").glob("events.out.tfevents*"))
  # As in T5X, the config in TensorBoard's Text tab (an indented markdown code block).
  config_text = metric_writers.read_texts(str(trained_run / "train"))["config"][0]
  assert config_text.splitlines() == [
      "    " + line for line in (trained_run / "config.gin").read_text().splitlines()]
  info = model_dirs.inspect(trained_run)
  assert info.config.d_model == 64 and info.vocabulary.vocab_size <= info.config.vocab_size


def test_missing_required_model_dir_is_a_clear_error(capsys):
  assert cli.main(["train", "--gin_file=configs/core/tiny_cpu.gin"]) == 2
  err = capsys.readouterr().err
  assert "MODEL_DIR" in err and "--gin.MODEL_DIR=" in err


def test_a_mistyped_number_is_a_config_error_naming_the_flag(capsys, tmp_path):
  code = cli.main(["train", *TINY, f"--gin.MODEL_DIR={tmp_path}", "--gin.TRAIN_STEPS=l0"])
  assert code == 2
  err = capsys.readouterr().err
  assert "jaxmoral train: error: make_schedule: total_steps must be a positive int" in err
  assert "In call to configurable" not in err  # gin's suffix: a second line naming internals
  assert "read as strings" in err and "--gin.TRAIN_STEPS=l0" in err
  gin.clear_config()
  code = cli.main(["train", *TINY, f"--gin.MODEL_DIR={tmp_path}", "--gin.TRAIN_STEPS=1O"])
  assert code == 2
  assert ("jaxmoral train: error: gin: cannot parse binding 'TRAIN_STEPS = 1O'"
          in capsys.readouterr().err)


@gin.configurable
def _takes_a_count(count: int = 1) -> int:
  return count + 1  # a str count: Python's own TypeError, which names no function


def test_a_type_error_in_a_configurable_is_one_line_naming_it(capsys, monkeypatch):
  gin.clear_config()
  gin.parse_config("test_scope/_takes_a_count.count = 'x'")
  monkeypatch.setattr(cli, "_run", lambda *args: _takes_a_count_in_scope())
  assert cli.main(["train", "--gin_file=configs/core/tiny_cpu.gin"]) == 2
  err = capsys.readouterr().err
  assert err == ('jaxmoral train: error: can only concatenate str (not "int") to str '
                 "(in test_scope/_takes_a_count)\n")
  gin.clear_config()


@gin.configurable
def _counts_flops_of(tokens: object = 1) -> float:
  from jaxmoral import aot  # pylint: disable=g-import-not-at-top
  from jaxmoral.models.config import t5_config  # pylint: disable=g-import-not-at-top
  return aot.t5_forward_flops(t5_config(size="tiny"), encoder_tokens=tokens, decoder_tokens=1)


def test_a_type_error_of_an_operation_in_jaxmoral_keeps_its_traceback():
  """A bug (an operation of jaxmoral's own code on the wrong type), however deep inside a
  gin-bound call it happens, is not passed off as a configuration mistake."""
  gin.clear_config()
  gin.parse_config("_counts_flops_of.tokens = None")
  with pytest.raises(TypeError) as error:
    _counts_flops_of()
  assert "In call to configurable '_counts_flops_of'" in str(error.value)
  assert cli.user_error_message(error.value) is None
  gin.clear_config()


def _takes_a_count_in_scope() -> int:
  with gin.config_scope("test_scope"):
    return _takes_a_count()


def test_eval_infer_export(trained_run, tmp_path):
  assert cli.main(["eval", *TINY, f"--gin.MODEL_DIR={trained_run}"]) == 0
  report = json.loads((trained_run / "eval_latest.json").read_text())
  assert 0.0 <= report["metrics"]["accuracy"] <= 1.0 and np.isfinite(report["metrics"]["loss"])
  assert report["samples"] and {"input", "target", "prediction"} <= set(report["samples"][0])
  # What training's own evaluation of the last step reported: the same loss (z-loss included).
  logged = metric_writers.read_scalars(str(trained_run / "eval"))
  assert report["metrics"]["z_loss"] > 0, report["metrics"]
  for name in ("loss", "z_loss", "accuracy"):
    np.testing.assert_allclose(report["metrics"][name], logged[name][12], rtol=2e-5,
                               err_msg=name)

  gin.clear_config()
  inputs = tmp_path / "in.txt"
  inputs.write_text("taking a day off work to help a friend move\nlying about grades\n")
  output = tmp_path / "out.jsonl"
  assert cli.main(["infer", *TINY, f"--gin.MODEL_DIR={trained_run}",
                   f"--gin.INFER_INPUT={inputs}", f"--gin.INFER_OUTPUT={output}"]) == 0
  rows = [json.loads(line) for line in output.read_text().splitlines()]
  assert [r["input"] for r in rows] == ["taking a day off work to help a friend move",
                                        "lying about grades"]
  assert all(isinstance(r["predictions"][0], str) for r in rows)

  # A decoding fragment from gin/decoding/: beam search, 3 hypotheses per input, best first.
  gin.clear_config()
  beams = tmp_path / "beams.jsonl"
  assert cli.main(["infer", *TINY, "--gin_file=gin/decoding/beam_search.gin",
                   "--gin.BEAM_SIZE=3", "--gin.MAX_DECODE_LENGTH=8",
                   f"--gin.MODEL_DIR={trained_run}", f"--gin.INFER_INPUT={inputs}",
                   f"--gin.INFER_OUTPUT={beams}"]) == 0
  rows = [json.loads(line) for line in beams.read_text().splitlines()]
  assert [len(r["predictions"]) for r in rows] == [3, 3]
  assert all(r["scores"] == sorted(r["scores"], reverse=True) for r in rows)

  exported = tmp_path / "exported"
  assert cli.main(["export", f"--model_dir={trained_run}", f"--output={exported}",
                   "--dtype=bfloat16"]) == 0
  params, config = params_export.load_exported(exported)
  original = model_dirs.load(trained_run).params
  leaves = jax.tree_util.tree_leaves(params)
  assert all(leaf.dtype == jax.numpy.bfloat16 for leaf in leaves)
  for a, b in zip(leaves, jax.tree_util.tree_leaves(original)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b.astype(jax.numpy.bfloat16)))
  assert config["d_model"] == 64
  assert (exported / "vocab" / "spiece.model").is_file()


_FAKE_TENSORFLOW = """
import os, sys, types
def set_visible_devices(devices, kind):
  os.write(2, b"I0000 port.cc:153] oneDNN custom operations are on. You may see...\\n")
  os.write(2, b"E0000 cuda_platform.cc:52] failed call to cuInit: UNKNOWN ERROR (303)\\n")
  os.write(2, b"a real TensorFlow warning\\n")
  print("hidden", kind, devices)
sys.modules["tensorflow"] = types.SimpleNamespace(
    config=types.SimpleNamespace(set_visible_devices=set_visible_devices))
from jaxmoral import runtime
runtime.own_gpus_for_jax()  # As the command line chooses.
runtime.tensorflow_for_input_pipelines_only()
print("after", file=sys.stderr)
"""


def test_tensorflow_start_up_noise_is_filtered_and_gpus_hidden():
  done = subprocess.run([sys.executable, "-c", _FAKE_TENSORFLOW], capture_output=True,
                        text=True, timeout=120, check=True)
  assert done.stdout.strip() == "hidden GPU []"
  assert done.stderr.splitlines() == ["a real TensorFlow warning", "after"], done.stderr


def test_real_tensorflow_import_leaves_no_start_up_noise():
  script = ("from jaxmoral import runtime\nruntime.own_gpus_for_jax()\n"
            "runtime.tensorflow_for_input_pipelines_only()\n"
            "import tensorflow as tf\nprint(tf.config.get_visible_devices('GPU'))\n")
  done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        timeout=300, check=True)
  assert done.stdout.strip() == "[]"
  noise = [line for line in done.stderr.splitlines()
           if any(n in line for n in cli._TF_START_UP_NOISE)]  # pylint: disable=protected-access
  assert not noise, done.stderr


def test_train_logs_the_learning_rate(trained_run):
  # TINY: a linear warm-up of 2 steps to the tiny config's rate, then a linear decay.
  rates = metric_writers.read_scalars(str(trained_run / "train"))["learning_rate"]
  assert sorted(rates) == [6, 12] and rates[6] > rates[12] > 0


def test_infer_without_its_files_names_the_flag(capsys, tmp_path):
  assert cli.main(["infer", *TINY, f"--gin.MODEL_DIR={tmp_path}"]) == 2
  assert "--gin.INFER_INPUT=PATH" in capsys.readouterr().err
  gin.clear_config()
  assert cli.main(["infer", *TINY, f"--gin.MODEL_DIR={tmp_path}",
                   f"--gin.INFER_INPUT={tmp_path / 'in.txt'}"]) == 2
  err = capsys.readouterr().err
  assert "--gin.INFER_OUTPUT=PATH" in err and "read as strings" not in err


@pytest.mark.parametrize("argv, message", [
    (["export", "--model_dir=a", "--output=b", "--gin_file=x.gin"], "export takes no gin flags"),
    (["vocab", "--output_dir=a", "--gin.X=1"], "vocab takes no gin flags"),
    (["export", "--model_dir=a", "--output=b", "--num_processes=2"], "export runs in one process"),
    (["train", "--num_processes=two"], "--num_processes needs an integer, got 'two'"),
])
def test_flags_a_command_would_ignore_are_errors(capsys, argv, message):
  with pytest.raises(SystemExit) as exit_info:
    cli.main(argv)
  assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_distributed_flags_reach_jax_distributed(capsys, tmp_path, monkeypatch):
  for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    monkeypatch.delenv(name, raising=False)
  # T5X's names; the coordinator is missing, so the job is refused before anything runs.
  assert cli.main(["train", "--process_count=2", *TINY, f"--gin.MODEL_DIR={tmp_path}",
                   "--process_index", "1"]) == 2
  assert "also need ['coordinator_address']" in capsys.readouterr().err
  assert cli._distributed_arguments(cli.split_flags(
      ["--coordinator_address=h:1", "--num_processes=4", "--process_id=3"],
      list(cli.DISTRIBUTED_FLAGS))[0]) == {"coordinator_address": "h:1", "num_processes": 4,
                                           "process_id": 3}


def test_init_checkpoint_may_name_one_step_of_a_run(trained_run, tmp_path):
  """A run fine-tuned from step 6 of another starts from exactly those parameters."""
  step6 = model_dirs.load(trained_run / "checkpoints" / "6")
  latest = model_dirs.load(trained_run)
  assert any(not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(
      jax.tree_util.tree_leaves(step6.params), jax.tree_util.tree_leaves(latest.params)))
  tuned = tmp_path / "tuned"
  gin.clear_config()
  assert cli.main(["train", *TINY, f"--gin.MODEL_DIR={tuned}", "--gin.TRAIN_STEPS=1",
                   "--gin.OPTIMIZER=@optimizers.make_optimizer()",
                   "--gin.optimizers.make_optimizer.learning_rate=3e-3",
                   "--gin.optimizers.make_optimizer.weight_decay=0.0",
                   "--gin.optimizers.make_optimizer.grad_clip_norm=None", "--gin.EVAL_EVERY=0",
                   f"--gin.INIT_CHECKPOINT='{trained_run / 'checkpoints' / '6'}'",
                   "--gin.CHECKPOINT_EVERY=1"]) == 0
  gin.clear_config()
  with checkpoints.CheckpointManager(tmp_path / "tuned" / "checkpoints") as manager:
    assert manager.all_steps() == [1]
  # The first Adam step (no weight decay) moves a parameter by lr * g / (|g| + eps): lr, or
  # nothing (no gradient), bar the few with |g| ~ eps. Only a start from step 6 gives that.
  moved = np.concatenate([np.abs(np.asarray(a) - np.asarray(b)).ravel() for a, b in zip(
      jax.tree_util.tree_leaves(model_dirs.load(tuned).params),
      jax.tree_util.tree_leaves(step6.params))])
  assert moved.max() <= 3e-3 * (1 + 1e-4)
  assert np.mean((moved < 1e-6) | (np.abs(moved - 3e-3) < 3e-5)) > 0.99
  with pytest.raises(FileNotFoundError, match="no checkpoint for step 7"):
    model_dirs.load(trained_run / "checkpoints" / "7")
  with pytest.raises(FileNotFoundError, match="no model found"):
    model_dirs.load(tmp_path)

@pytest.mark.parametrize("method", cli.METHOD_COMMANDS)
def test_method_help_lists_the_actions_of_its_table(method, capsys):
  import importlib  # pylint: disable=g-import-not-at-top
  with pytest.raises(SystemExit) as exit_info:
    cli.main([method, "-h"])
  assert exit_info.value.code == 0
  out = " ".join(capsys.readouterr().out.split())
  actions = importlib.import_module(f"jaxmoral.{method}.commands").ACTIONS
  assert f"one of: {', '.join(actions)}" in out


@pytest.mark.parametrize("argv, message", [
    (["npov", "detect", "--output_path=o.jsonl"],
     "jaxmoral npov: error: detect: --input_path is required (or bind "
     "jaxmoral.npov.actions.detect_file.input_path in gin)"),
    (["clarify", "train-model", "--which=judge", "--model_dir=/tmp/unused", "--steps=3"],
     "jaxmoral clarify: error: train-model: unknown flag --steps; close: --train_steps (see "
     "`jaxmoral clarify train-model --help`)"),
    (["npov", "classify"], "jaxmoral npov: error: unknown action 'classify' of `jaxmoral npov`; "
                           "known: detect, evaluate, train-classifier, demo"),
])
def test_method_flag_errors_are_one_line(argv, message, capsys):
  assert cli.main(argv) == 2
  err = capsys.readouterr().err
  errors = [line for line in err.splitlines() if line.startswith("jaxmoral")]
  assert errors == [message] and "Traceback" not in err, err


def test_the_cli_leaves_the_hub_online_and_says_when_it_is_unreachable(capsys, tmp_path,
                                                                        monkeypatch):
  """No HF_HUB_OFFLINE of the command line's own: a Hub id is downloaded where the Hub is
  reachable. Here it is not (the endpoint is a closed port): one line naming the cache and
  HF_HUB_OFFLINE."""
  from huggingface_hub import constants  # pylint: disable=g-import-not-at-top
  monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
  monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
  monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
  monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
  monkeypatch.chdir(tmp_path)
  status = cli.main(["export", "--model_dir=jaxmoral-test/absent", f"--output={tmp_path}/out"])
  assert "HF_HUB_OFFLINE" not in os.environ
  err = capsys.readouterr().err.strip()
  assert status == 2 and "\n" not in err, err
  assert "unreachable" in err and "HF_HUB_OFFLINE" in err and str(tmp_path / "hub") in err


def _help(capsys, argv):
  assert cli.main(argv) == 0
  return capsys.readouterr().out


def _macro_lines(text):
  return dict(re.findall(r"^  ([A-Z][A-Z_]+)  +(.+)$", text, re.MULTILINE))


def test_gin_command_help_lists_the_macros_its_config_reads_the_flags_and_an_example(capsys):
  fragment = (ROOT / cli.RUN_FRAGMENT).read_text()
  written = dict(re.findall(r"^([A-Z_]+) = (.+)$", fragment, re.MULTILINE))
  macros = _macro_lines(_help(capsys, ["train", "--help"]))
  # Every macro of the run fragment that train_run reads, as written there.
  assert macros["TRAIN_STEPS"] == written["TRAIN_STEPS"] == "1000"
  assert macros["TASK_FEATURE_LENGTHS"] == written["TASK_FEATURE_LENGTHS"]
  assert macros["MODEL_DIR"] == "required" and "INFER_INPUT" not in macros
  # With a config given, its values (and what its includes set).
  config = _help(capsys, ["train", "--help", "--gin_file=configs/core/tiny_cpu.gin"])
  assert _macro_lines(config)["TRAIN_STEPS"] == "300"
  assert _macro_lines(config)["OPTIMIZER"].startswith("@")
  for flag in ("--gin_search_paths=", "--compilation_cache_dir=", "--tfds_data_dir="):
    assert f"\n  {flag}" in config, flag
  assert max(len(line) for line in config.splitlines()) <= 100
  # Each command's example is a documented command (tests/test_docs.py runs those).
  documented = " ".join(" ".join((ROOT / name).read_text().replace("\\\n", " ").split("\n"))
                        for name in ("README.md", "docs/cli.md"))
  documented = " ".join(documented.split())
  for command in cli.GIN_COMMANDS:
    text = _help(capsys, [command, "-h"])
    example = " ".join(text.split("example:\n", 1)[1].replace("\\\n", " ").split())
    assert example.startswith(f"jaxmoral {command} ") and example in documented, example
  assert _macro_lines(_help(capsys, ["infer", "--help"]))["INFER_INPUT"] == "None"


@pytest.mark.parametrize("argv, suggestion", [
    (["train", "--gin_flie=configs/core/tiny_cpu.gin"], "did you mean --gin_file?"),
    (["eval", "--tfds_data_dri=/tmp/tfds"], "did you mean --tfds_data_dir?"),
    (["export", "--model_dir=x", "--output=y", "--dtpye=bfloat16"], "did you mean --dtype?")])
def test_a_misspelt_flag_gets_the_closest_one(argv, suggestion, capsys):
  with pytest.raises(SystemExit) as info:
    cli.main(argv)
  err = capsys.readouterr().err
  assert info.value.code == 2 and err.splitlines()[-1] == (
      f"jaxmoral {argv[0]}: error: {argv[-1]}: unknown flag; {suggestion}"), err
