"""`jaxmoral.action_commands`: the one dispatcher of the method command lines (diamante, npov,
clarify): flags -> gin bindings, --help, output checks, required flags, the JSON result."""

from __future__ import annotations

import importlib
import inspect
import json
import os
import pathlib
import subprocess
import sys
import types
from typing import Optional, Sequence

import gin
import pytest

from jaxmoral import action_commands
from jaxmoral import cli_help
from jaxmoral import cli
from jaxmoral import gin_utils

# What runs is tested here, not how it is sharded (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("one_device")

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROBE_MODULE = "jaxmoral_probe_actions"
# What the probe action was last called with.
CALLS: list[dict] = []


@gin.configurable(module=PROBE_MODULE)
def probe(*, name: str, count: int = 1, words: Sequence[str] = ("x",), loud: bool = False,
          ratio: Optional[float] = None, output_path: str = "probe_out.json") -> dict:
  """A stand-in action that records its arguments."""
  arguments = dict(name=name, count=count, words=words, loud=loud, ratio=ratio,
                   output_path=output_path)
  CALLS.append(arguments)
  return arguments


ACTIONS = {"probe": (PROBE_MODULE, "probe")}
OUTPUTS = {"probe": {"output_path": False}}


@pytest.fixture(autouse=True)
def _probe_module(monkeypatch):
  module = types.ModuleType(PROBE_MODULE)
  module.probe = probe
  monkeypatch.setitem(sys.modules, PROBE_MODULE, module)
  CALLS.clear()
  gin.clear_config()
  yield
  gin.clear_config()


def _run(flags, gin_args=gin_utils.GinArgs(), **kwargs) -> int:
  return action_commands.run_action("probe_method", ACTIONS, OUTPUTS, "probe", flags, gin_args,
                                    **kwargs)


def test_a_flag_is_the_gin_binding_of_the_functions_argument(tmp_path):
  out = str(tmp_path / "o.json")
  flags = ["--name=/data/x", "--count=3", "--ratio=0.5", f"--output_path={out}"]
  _run(flags)
  gin.clear_config()
  # The same values as `--gin.<module>.<function>.NAME=VALUE` flags of the command line.
  gin_args, rest = gin_utils.split_gin_args(
      [f"--gin.{PROBE_MODULE}.probe.{flag[2:]}" for flag in flags])
  assert rest == []
  _run([], gin_args)
  assert CALLS[0] == CALLS[1] == {"name": "/data/x", "count": 3, "words": ("x",),
                                  "loud": False, "ratio": 0.5, "output_path": out}


def test_flags_override_gin_files_and_bindings(tmp_path):
  config = tmp_path / "probe.gin"
  config.write_text(f"{PROBE_MODULE}.probe.name = 'from_file'\n"
                    f"{PROBE_MODULE}.probe.count = 2\n")
  _run(["--count=5", f"--output_path={tmp_path / 'o.json'}"],
       gin_utils.GinArgs(files=(str(config),)))
  assert (CALLS[0]["name"], CALLS[0]["count"]) == ("from_file", 5)


def test_sequence_and_bool_flags(tmp_path):
  out = f"--output_path={tmp_path / 'o.json'}"
  _run(["--name=n", "--words=bad, ok,good", "--loud", out])
  assert CALLS[-1]["words"] == ("bad", "ok", "good") and CALLS[-1]["loud"] is True
  gin.clear_config()
  # One word is a one-word tuple, not its letters; a gin tuple is taken as it is.
  _run(["--name=n", "--words=rouge", "--loud=false", out])
  assert CALLS[-1]["words"] == ("rouge",) and CALLS[-1]["loud"] is False
  gin.clear_config()
  _run(["--name=n", "--words=('a', 'b')", out])
  assert CALLS[-1]["words"] == ("a", "b")


def test_the_result_is_printed_as_json_unless_the_action_prints_its_own(tmp_path, capsys):
  out = f"--output_path={tmp_path / 'o.json'}"
  _run(["--name=n", out])
  assert json.loads(capsys.readouterr().out)["name"] == "n"
  gin.clear_config()
  _run(["--name=n", out], prints_own_result=("probe",))
  assert capsys.readouterr().out == "" and len(CALLS) == 2


@pytest.mark.parametrize("flags, message", [
    (["--name=n", "--cuont=2"], r"^probe: unknown flag --cuont; close: --count \(see "
                                r"`jaxmoral probe_method probe --help`\)$"),
    (["--name=n", "--bogus=1", "--other=2"], r"^probe: unknown flags --bogus, --other \(see"),
    (["--count=2"], r"^probe: --name is required \(or bind "
                    rf"{PROBE_MODULE}.probe.name in gin\)$"),
    (["--name", "n"], r"^probe: expected --name=value flags, got '--name' \(see"),
])
def test_flag_errors_are_one_line_naming_the_flag(flags, message):
  with pytest.raises(ValueError, match=message) as error:
    _run(flags)
  assert "\n" not in str(error.value) and not CALLS


def test_unknown_action_lists_the_actions():
  with pytest.raises(ValueError, match=r"unknown action 'prob' of `jaxmoral probe_method`; "
                                       r"known: probe"):
    action_commands.run_action("probe_method", ACTIONS, OUTPUTS, "prob", [],
                               gin_utils.GinArgs())


def test_outputs_are_checked_before_the_call_also_at_their_default(tmp_path, monkeypatch):
  a_file = tmp_path / "a_file"
  a_file.write_text("")
  with pytest.raises(NotADirectoryError):
    _run(["--name=n", f"--output_path={a_file / 'o.json'}"])
  # Unbound, the default path (relative to the working directory) is the one checked.
  monkeypatch.chdir(a_file.parent)
  (tmp_path / "probe_out.json").mkdir()
  gin.clear_config()
  with pytest.raises(IsADirectoryError):
    _run(["--name=n"])
  assert not CALLS


@pytest.mark.parametrize("method", ["diamante", "npov", "clarify"])
def test_help_lists_every_flag_of_every_action(method, capsys):
  commands = importlib.import_module(f"jaxmoral.{method}.commands")
  for action, (module, function) in commands.ACTIONS.items():
    assert commands.main(action, ["--help"], gin_utils.GinArgs()) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: jaxmoral {method} {action} ")
    fn = getattr(importlib.import_module(module), function)
    for name, parameter in inspect.signature(fn).parameters.items():
      if name in cli_help.NOT_FLAGS:  # Set by `jaxmoral compile`, never a user.
        assert f"--{name}" not in text, (method, action, name)
        with pytest.raises(ValueError, match=f"unknown flag --{name}"):
          commands.main(action, [f"--{name}=True"], gin_utils.GinArgs())
      elif not any(kind in str(parameter.annotation) for kind in ("Callable", "TextIO")):
        assert f"  --{name}=VALUE" in text, (method, action, name)


@pytest.mark.parametrize("method", ["diamante", "npov", "clarify"])
def test_every_action_is_a_keyword_only_gin_configurable_with_its_outputs(method):
  commands = importlib.import_module(f"jaxmoral.{method}.commands")
  assert set(commands.OUTPUTS) <= set(commands.ACTIONS)
  for action, (module, function) in commands.ACTIONS.items():
    fn = getattr(importlib.import_module(module), function)
    parameters = inspect.signature(fn).parameters
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in parameters.values()), action
    assert set(commands.OUTPUTS.get(action, {})) <= set(parameters), action
    gin.parse_config(f"{module}.{function}.{next(iter(parameters))} = 'x'")  # Registered.
    gin.clear_config()


def test_help_imports_no_model_code():
  code = ("import sys\n"
          "from jaxmoral import cli\n"
          "for argv in (['npov', 'detect', '--help'], ['clarify', 'train-ppo', '--help'],\n"
          "             ['diamante', 'eval', '-h']):\n"
          "  assert cli.main(argv) == 0\n"
          "loaded = sorted(m for m in ('jax', 'tensorflow', 'seqio', 'flax') if m in sys.modules)\n"
          "assert not loaded, loaded\n")
  done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                        timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
  assert done.returncode == 0, done.stderr
  assert "usage: jaxmoral clarify train-ppo" in done.stdout


def test_cli_reports_a_bad_flag_in_one_line(capsys):
  assert cli.main(["clarify", "chat", "--question_model_dir=q", "--fusion_model_dir=f",
                   "--judge_model_dir=j", "--transcript=t.jsonl"]) == 2
  err = capsys.readouterr().err
  errors = [line for line in err.splitlines() if line.startswith("jaxmoral")]
  assert len(errors) == 1 and "Traceback" not in err, err
  assert errors[0] == ("jaxmoral clarify: error: chat: unknown flag --transcript; close: "
                       "--transcript_path (see `jaxmoral clarify chat --help`)")


def test_a_flag_may_override_what_reads_a_gin_files_macro(tmp_path):
  config = tmp_path / "probe.gin"
  config.write_text(f"NAME = 'from_macro'\n{PROBE_MODULE}.probe.name = %NAME\n")
  _run(["--name=from_flag", f"--output_path={tmp_path / 'o.json'}"],
       gin_utils.GinArgs(files=(str(config),)))
  assert CALLS[-1]["name"] == "from_flag"
  # A macro the command line defines and nothing reads is still a misspelling.
  gin.clear_config()
  with pytest.raises(ValueError, match=r"macro NAMES \(--gin.NAMES=x\) is never read"):
    _run([f"--output_path={tmp_path / 'o.json'}"],
         gin_utils.split_gin_args(["--gin.NAMES=x", f"--gin_file={config}"])[0])


def test_a_bad_flag_value_is_named_by_its_flag():
  with pytest.raises(ValueError, match=r"cannot parse binding .*--count=\[1"):
    _run(["--name=n", "--count=[1,"])


def test_a_long_result_prints_as_a_short_summary_and_its_path():
  result = {"auc": {"rouge": 0.81234567, "salience": 0.5}, "n": 40,
            "per_example": [{"score": i} for i in range(2000)],
            "tables": {"a": {"b": 1}}, **{f"m{i}": i for i in range(30)}}
  text = action_commands.result_summary(result, written=["/tmp/eval/results.json"])
  lines = text.splitlines()
  assert len(lines) == action_commands.SUMMARY_LINES + 2
  assert lines[:5] == ["auc.rouge: 0.8123", "auc.salience: 0.5", "n: 40",
                       "per_example: [2000 items]", "tables: {1 entries}"]
  assert lines[-2] == "... (15 more)" and lines[-1] == "wrote /tmp/eval/results.json"
  short = {"loss": 1.5}
  assert json.loads(action_commands.result_summary(short, written=["x"])) == short


@gin.configurable(module=PROBE_MODULE)
def reader(*, test_path: str, model_dir: str = "google/t5-v1_1-small") -> dict:
  """A stand-in action that reads a file and a model directory."""
  CALLS.append(dict(test_path=test_path, model_dir=model_dir))
  return {}


def test_input_flags_resolve_as_gin_paths_and_are_checked_before_the_action(
    tmp_path, monkeypatch):
  sys.modules[PROBE_MODULE].reader = reader
  monkeypatch.chdir(tmp_path)
  actions = {"reader": (PROBE_MODULE, "reader")}
  run = lambda flags: action_commands.run_action(  # noqa: E731
      "probe_method", actions, {}, "reader", flags, gin_utils.GinArgs())
  # Relative to the project root, as a gin file's path, when the working folder has nothing.
  run(["--test_path=jaxmoral/data/demo/dialogues.jsonl", "--model_dir=google/t5-v1_1-small"])
  assert CALLS[-1] == {"test_path": str(ROOT / "jaxmoral/data/demo/dialogues.jsonl"),
                       "model_dir": "google/t5-v1_1-small"}  # A Hub id stays.
  gin.clear_config()
  (tmp_path / "jaxmoral/data/demo").mkdir(parents=True)
  (tmp_path / "jaxmoral/data/demo/dialogues.jsonl").write_text("")
  run(["--test_path=jaxmoral/data/demo/dialogues.jsonl"])  # The working folder's comes first.
  assert CALLS[-1]["test_path"] == "jaxmoral/data/demo/dialogues.jsonl"
  gin.clear_config()
  calls = len(CALLS)
  with pytest.raises(FileNotFoundError, match="--test_path: no such file"):
    run(["--test_path=no/such.jsonl"])
  with pytest.raises(FileNotFoundError, match="--model_dir: no such file"):
    run([f"--test_path={tmp_path}", "--model_dir=/no/such/run"])
  assert len(CALLS) == calls  # Nothing ran.
  monkeypatch.chdir(ROOT)  # The working folder is the project root: named once.
  with pytest.raises(FileNotFoundError) as info:
    run(["--test_path=no/such.jsonl"])
  assert str(info.value.strerror).count(str(ROOT)) == 1, info.value.strerror
