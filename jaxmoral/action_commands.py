"""`jaxmoral <method> <action> [--name=value ...]`: one gin-bound library call per action.

Each method's `commands` module is a table: `ACTIONS` names each action's keyword-only
`@gin.configurable` function, `OUTPUTS` the parameters naming what it writes. `run_action` does
the rest for all of them: `--help` from the source (no JAX start-up), flags as gin bindings,
one-line errors for unknown and missing flags, inputs and outputs checked before any work, the
result printed.
"""

from __future__ import annotations

import ast
import difflib
import errno
import importlib
import inspect
import json
import os
import re
import textwrap
from typing import Any, Callable, Collection, Mapping, Sequence

import gin

from jaxmoral import cli_help
from jaxmoral import fileio
from jaxmoral import gin_files
from jaxmoral import gin_utils

HELP_FLAGS = ("-h", "--help")
# Annotations of parameters that take several strings: a comma list given to one is a tuple.
_SEQUENCE_TYPE = re.compile(r"^(Optional\[)?(Sequence|tuple|list|Tuple|List|Collection)\b")
_FLAG = re.compile(r"^--(?P<name>[A-Za-z_]\w*)(?:=(?P<value>.*))?$", re.DOTALL)
_VALUES_NOTE = ("A flag's value that is no Python literal is a string; for a sequence "
                "parameter a comma list (a,b,c) is a tuple of strings; a bare --NAME of a bool "
                "parameter means True.")


def _as_tuple_of_words(value: str) -> str | None:
  """`a,b,c` (bare words) as the gin tuple `('a', 'b', 'c')`; None if `value` is a literal."""
  try:
    ast.literal_eval(value)
    return None
  except (ValueError, SyntaxError):
    if value.lstrip()[:1] in ("@", "%", "(", "[", "{", "'", '"'):  # Gin syntax: left alone.
      return None
    return repr(tuple(word.strip() for word in value.split(",") if word.strip()))


def flag_bindings(selector: str, flags: Sequence[str],
                  parameters: Mapping[str, inspect.Parameter] | None = None) -> list[str]:
  """`--name=value` flags (`--name` for a bool parameter; a ValueError for any other form) as
  gin bindings of configurable `selector`'s `name`, one per flag, in order. The annotations of
  the function's `parameters` make a comma list a tuple and a bare `--name` True; None reads
  every value as `--gin.` does."""
  parameters = parameters or {}
  bindings = []
  for flag in flags:
    match = _FLAG.match(flag)
    name, value = match.group("name", "value") if match else ("", None)
    annotation = _annotation_text(parameters.get(name))
    if value is None and annotation != "bool":
      raise ValueError(f"expected --name=value flags, got {flag!r}")
    value = "True" if value is None else value
    if annotation in ("bool", "Optional[bool]") and value.lower() in ("true", "false"):
      value = value.capitalize()  # A string 'false' would be a true value.
    words = _as_tuple_of_words(value) if _SEQUENCE_TYPE.match(annotation) else None
    if words is not None:
      bindings.append(f"{selector}.{name} = {words}")
    else:  # As --gin. reads it.
      bindings += gin_utils.split_gin_args([f"--gin.{selector}.{name}={value}"])[0].bindings
  return bindings


def _annotation_text(parameter: inspect.Parameter | None) -> str:
  """A parameter's annotation as written ("Optional[Sequence[str]]", "bool"); "" if none."""
  if parameter is None or parameter.annotation is inspect.Parameter.empty:
    return ""
  annotation = parameter.annotation
  if isinstance(annotation, str):  # Modules with `from __future__ import annotations`.
    return annotation
  if isinstance(annotation, type):
    return annotation.__name__
  return str(annotation).replace("typing.", "")


def _parameters(fn: Callable[..., Any]) -> dict[str, inspect.Parameter]:
  """The parameters a flag may bind (gin's wrapper keeps the wrapped signature)."""
  return {name: p for name, p in inspect.signature(fn).parameters.items()
          if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and name not in cli_help.NOT_FLAGS}


def _check_flag_names(action: str, prog: str, flags: Sequence[str],
                      parameters: Mapping[str, inspect.Parameter]) -> None:
  """Raises a one-line error naming each flag that binds no parameter of the action."""
  unknown = [f"--{match.group('name')}" for match in map(_FLAG.match, flags)
             if match and match.group("name") not in parameters]
  if not unknown:
    return
  close = {f"--{name}" for flag in unknown
           for name in difflib.get_close_matches(flag[2:], list(parameters), n=2, cutoff=0.6)}
  hint = f"; close: {', '.join(sorted(close))}" if close else ""
  raise ValueError(f"{action}: unknown flag{'s' if len(unknown) > 1 else ''} "
                   f"{', '.join(unknown)}{hint} (see `{prog} --help`)")


def _check_given(action: str, selector: str,
                 parameters: Mapping[str, inspect.Parameter]) -> None:
  """Raises a one-line error naming the flags of required parameters nothing binds."""
  missing = [name for name, p in parameters.items()
             if p.default is inspect.Parameter.empty and not _is_bound(selector, name)]
  if missing:
    flags = ", ".join(f"--{name}" for name in missing)
    raise ValueError(f"{action}: {flags} {'is' if len(missing) == 1 else 'are'} required "
                     f"(or bind {selector}.{missing[0]} in gin)")


def _is_bound(selector: str, name: str) -> bool:
  try:
    gin.query_parameter(f"{selector}.{name}")
    return True
  except ValueError:
    return False


def _output_paths(selector: str, outputs: Mapping[str, bool],
                  parameters: Mapping[str, inspect.Parameter]) -> list[tuple[str, bool]]:
  """(path, is a directory) of what an action writes: as bound, else its default."""
  paths = []
  for name, directory in outputs.items():
    path = gin_utils.bound_value(selector, name)
    if path is None and name in parameters:
      path = parameters[name].default
    if isinstance(path, (str, os.PathLike)):
      paths.append((os.fspath(path), directory))
  return paths


def run_action(method: str, actions: Mapping[str, tuple[str, str]],
               outputs: Mapping[str, Mapping[str, bool]], action: str, rest: Sequence[str],
               gin_args: gin_utils.GinArgs, *, prints_own_result: Collection[str] = (),
               configurable_modules: Sequence[str] = ()) -> int:
  """Runs one action of a method's command line; returns the exit status, 0. Raises a one-line
  ValueError for an unknown action or flag, a flag not `--name=value`, a required flag missing
  or a gin error, an OSError where an output cannot be written.

  Args:
    method: The command, e.g. "npov" (named in usage and errors).
    actions: `{action: (module, function)}`: each a keyword-only gin configurable.
    outputs: `{action: {parameter: is a directory}}` of what each action writes.
    rest: The action's flags (`--name=value`, or `--help`).
    prints_own_result: Actions whose function reports for itself (a chat): no JSON printed.
    configurable_modules: Modules whose configurables a config may bind, imported before gin
      parses (detectors the action's module imports only when used).
  """
  if action not in actions:
    raise ValueError(f"unknown action {action!r} of `jaxmoral {method}`; known: "
                     f"{', '.join(actions)}")
  prog = f"jaxmoral {method} {action}"
  if any(arg in HELP_FLAGS for arg in rest):  # The function's flags, how values are read.
    print(cli_help.function_usage(*actions[action], prog=prog))
    print(f"\n{textwrap.fill(_VALUES_NOTE, 78)}")
    return 0
  fn = bind_action(actions, outputs, action, rest, gin_args, prog=prog,
                   configurable_modules=configurable_modules)
  selector = ".".join(actions[action])
  check_inputs(selector, rest, outputs.get(action, {}))
  result = fn()
  if action not in prints_own_result:
    written = _output_paths(selector, outputs.get(action, {}), _parameters(fn))
    print(result_summary(result, written=[path for path, _ in written]))
  return 0


def bind_action(actions: Mapping[str, tuple[str, str]],
                outputs: Mapping[str, Mapping[str, bool]], action: str, rest: Sequence[str],
                gin_args: gin_utils.GinArgs, *, prog: str,
                configurable_modules: Sequence[str] = ()) -> Callable[[], Any]:
  """The action's function with its flags and gin configuration bound and checked, its
  outputs writable: everything `run_action` does before any work (a dry run stops here).
  Raises as `run_action`."""
  module, function = actions[action]
  selector = f"{module}.{function}"
  for name in configurable_modules:
    importlib.import_module(name)
  fn = getattr(importlib.import_module(module), function)
  parameters = _parameters(fn)
  _check_flag_names(action, prog, rest, parameters)
  try:
    bindings = flag_bindings(selector, rest, parameters)
  except ValueError as error:
    raise ValueError(f"{action}: {error} (see `{prog} --help`)") from None
  gin_utils.parse_gin(gin_args, extra_bindings=bindings, extra_binding_flags=rest)
  gin_utils.check_required()
  _check_given(action, selector, parameters)
  resolve_input_flags(selector, rest, outputs.get(action, {}))
  for path, directory in _output_paths(selector, outputs.get(action, {}), parameters):
    fileio.check_writable(path, directory=directory)
  return fn


# Flags that name something an action reads (unless in its OUTPUTS).
_INPUT_FLAG = re.compile(r"(^|_)(path|dir|jsonl|file)$")
# A Hugging Face Hub id ("google/t5-v1_1-base"): a model directory that is not a local path.
_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def _input_flags(rest: Sequence[str], outputs: Mapping[str, bool]) -> list[str]:
  names = [arg[2:].partition("=")[0] for arg in rest if arg.startswith("--")]
  return [name for name in names if _INPUT_FLAG.search(name) and name not in outputs]


def resolve_input_flags(selector: str, rest: Sequence[str], outputs: Mapping[str, bool]) -> None:
  """Binds an input flag's relative path that names nothing in the working directory but
  something in the project root as that absolute path, as gin files' paths resolve."""
  for name in _input_flags(rest, outputs):
    value = gin_utils.bound_value(selector, name)
    if (isinstance(value, str) and value and not os.path.isabs(value) and "://" not in value
        and not os.path.exists(value)):
      candidate = gin_files.PROJECT_ROOT / value
      if candidate.exists():
        gin.bind_parameter(f"{selector}.{name}", str(candidate))


def check_inputs(selector: str, rest: Sequence[str], outputs: Mapping[str, bool]) -> None:
  """Raises FileNotFoundError naming the flag when an input flag (a `*dir` flag: or Hub id)
  names nothing, before any work: a model that loads first would make a typo cost minutes."""
  for name in _input_flags(rest, outputs):
    value = gin_utils.bound_value(selector, name)
    if (not isinstance(value, str) or not value or "://" in value or os.path.exists(value)
        or (name.endswith("dir") and _HUB_ID.match(value))):
      continue
    folders = " and ".join(dict.fromkeys((os.getcwd(), str(gin_files.PROJECT_ROOT))))
    raise FileNotFoundError(errno.ENOENT, f"--{name}: no such file or folder (looked in "
                            f"{folders})", value)


SUMMARY_LINES = 20  # At most this many result lines on stdout; the files hold everything.


def _scalar(value: Any) -> str:
  if isinstance(value, float):
    return f"{value:.4g}"
  text = str(value)
  return text if len(text) <= 60 else text[:57] + "..."


def result_summary(result: Any, *, written: Sequence[str] = ()) -> str:
  """What an action prints: its result as JSON when under `SUMMARY_LINES` lines, else at most
  that many `name: value` lines (nested mappings dotted, one level; a list or deeper mapping
  as its size), then where the full result was written."""
  dump = json.dumps(result, indent=2, sort_keys=True, default=str)
  if dump.count("\n") < SUMMARY_LINES:
    return dump
  lines: list[str] = []
  if isinstance(result, Mapping):
    for key, value in result.items():
      if isinstance(value, Mapping) and all(not isinstance(v, (Mapping, list, tuple))
                                            for v in value.values()):
        lines += [f"{key}.{k}: {_scalar(v)}" for k, v in value.items()]
      elif isinstance(value, Mapping):
        lines.append(f"{key}: {{{len(value)} entries}}")
      elif isinstance(value, (list, tuple)):
        lines.append(f"{key}: [{len(value)} items]")
      else:
        lines.append(f"{key}: {_scalar(value)}")
  elif result is not None:
    lines.append(_scalar(result))
  if len(lines) > SUMMARY_LINES:
    lines = lines[:SUMMARY_LINES] + [f"... ({len(lines) - SUMMARY_LINES} more)"]
  lines += [f"wrote {path}" for path in written]
  return "\n".join(lines)
