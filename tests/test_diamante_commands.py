"""`jaxmoral diamante <action>`: flags become gin bindings of the action's function."""

import gin
import pytest

from jaxmoral import action_commands
from jaxmoral import gin_utils
from jaxmoral.diamante import commands


def test_flags_bind_the_action_function():
  bindings = action_commands.flag_bindings("jaxmoral.diamante.evaluate.evaluate",
                                           ["--model_dir=/tmp/run", "--num_random=3"])
  assert bindings == ["jaxmoral.diamante.evaluate.evaluate.model_dir = '/tmp/run'",
                      "jaxmoral.diamante.evaluate.evaluate.num_random = 3"]
  with pytest.raises(ValueError, match="--name=value"):
    action_commands.flag_bindings("f", ["positional"])


def test_unknown_flag_names_the_flag_and_the_action():
  try:
    with pytest.raises(ValueError, match=r"^eval: unknown flag --num_randm; close: "
                                         r"--num_random"):
      commands.main("eval", ["--model_dir=/tmp/run", "--num_randm=3"], gin_utils.GinArgs())
  finally:
    gin.clear_config()


def test_every_action_names_a_gin_configurable_with_keyword_only_arguments():
  import importlib
  import inspect
  for action, (module, function) in commands.ACTIONS.items():
    fn = getattr(importlib.import_module(module), function)
    params = inspect.signature(fn).parameters.values()
    assert params and all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params), action
    first = next(iter(params)).name
    try:
      gin.parse_config(f"{module}.{function}.{first} = 'x'")  # raises unless registered
    finally:
      gin.clear_config()
  with pytest.raises(ValueError, match="unknown action"):
    commands.main("nope", [], gin_utils.GinArgs())


def test_main_calls_the_function_with_flag_values(monkeypatch, capsys, tmp_path):
  seen = {}
  from jaxmoral.diamante import chat

  @gin.configurable("jaxmoral.diamante.chat.self_chat_probe")
  def probe(*, model_dir, num_rounds):
    seen.update(model_dir=model_dir, num_rounds=num_rounds)
    return []

  monkeypatch.setitem(commands.ACTIONS, "probe", ("jaxmoral.diamante.chat", "self_chat_probe"))
  monkeypatch.setattr(chat, "self_chat_probe", probe, raising=False)
  try:
    assert commands.main("probe", [f"--model_dir={tmp_path}", "--num_rounds=2"],
                         gin_utils.GinArgs()) == 0
  finally:
    gin.clear_config()
  assert seen == {"model_dir": str(tmp_path), "num_rounds": 2}
  assert "[]" in capsys.readouterr().out
