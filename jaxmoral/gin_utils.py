"""Gin handling with T5X's command-line conventions.

`--gin_file=PATH` (repeatable), `--gin.NAME=VALUE` (a binding, T5X's shorthand for
`--gin_bindings='NAME = VALUE'`), `--gin_bindings=...` and `--gin_search_paths=...`.
Library code never reads gin: only the CLI parses it, then calls gin-bound entry points.
"""

from __future__ import annotations

import ast
import dataclasses
import io
import os
import pathlib
import re
import tokenize
from typing import Sequence

import gin

PROJECT_ROOT = pathlib.Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class GinArgs:
  """Gin files, bindings and search paths taken out of a command line."""
  files: tuple[str, ...] = ()
  bindings: tuple[str, ...] = ()
  search_paths: tuple[str, ...] = ()
  # `--gin.NAME=VALUE` flags whose VALUE was no Python literal and so became a string; named
  # when a configurable then fails on a type (e.g. --gin.TRAIN_STEPS=1O00).
  read_as_strings: tuple[str, ...] = ()


_LITERAL_START = re.compile(r"^\s*([@%\[\(\{'\"]|-?\d|True$|False$|None$)")


def _as_gin_value(value: str) -> str:
  """Leaves gin syntax alone; quotes a bare word such as a path (a common slip)."""
  if _LITERAL_START.match(value):
    return value
  try:
    ast.literal_eval(value)
    return value
  except (ValueError, SyntaxError):
    return repr(value)


def split_gin_args(argv: Sequence[str]) -> tuple[GinArgs, list[str]]:
  """Separates gin flags (T5X forms) from the other arguments.

  Args:
    argv: Command-line arguments (without the program name).

  Returns:
    The gin arguments and the remaining arguments in order.
  """
  files, bindings, paths, rest, quoted = [], [], [], [], []
  args = list(argv)
  i = 0
  while i < len(args):
    arg = args[i]
    def take_value(flag: str) -> str:
      nonlocal i
      if arg.startswith(flag + "="):
        return arg[len(flag) + 1:]
      if i + 1 >= len(args):
        raise SystemExit(f"error: {flag} needs a value")
      i += 1
      return args[i]
    if arg.startswith("--gin."):
      name, sep, value = arg[len("--gin."):].partition("=")
      if not sep:
        raise SystemExit(f"error: {arg!r}: expected --gin.NAME=VALUE")
      gin_value = _as_gin_value(value)
      if gin_value != value:
        quoted.append(arg)
      bindings.append(f"{name} = {gin_value}")
    elif arg == "--gin_file" or arg.startswith("--gin_file="):
      files.extend(v for v in take_value("--gin_file").split(",") if v)
    elif arg == "--gin_bindings" or arg.startswith("--gin_bindings="):
      bindings.append(take_value("--gin_bindings"))
    elif arg == "--gin_search_paths" or arg.startswith("--gin_search_paths="):
      paths.extend(v for v in take_value("--gin_search_paths").split(",") if v)
    else:
      rest.append(arg)
    i += 1
  return GinArgs(tuple(files), tuple(bindings), tuple(paths), tuple(quoted)), rest


def parse_gin(gin_args: GinArgs, *, extra_bindings: Sequence[str] = ()) -> None:
  """Parses gin files and bindings; files are found in the search paths and the project root.

  Raises:
    FileNotFoundError: A gin file (or an include) is in none of the search paths.
  """
  search_paths = list(dict.fromkeys([*gin_args.search_paths, os.getcwd(), str(PROJECT_ROOT)]))
  for path in search_paths:
    gin.add_config_file_search_path(path)
  for name in gin_args.files:
    if _find_gin_file(name, search_paths) is None:
      raise FileNotFoundError(f"gin file {name!r} not found in search paths {search_paths}")
  bindings = [*gin_args.bindings, *extra_bindings]
  try:
    gin.parse_config_files_and_bindings(list(gin_args.files), bindings, finalize_config=False)
  except (SyntaxError, tokenize.TokenError) as error:
    raise _syntax_error(error, gin_args.files, search_paths, bindings) from error


def _find_gin_file(name: str, search_paths: Sequence[str]) -> pathlib.Path | None:
  """The first search path holding `name`, else `name` itself if it is a file, else None."""
  for path in (*(pathlib.Path(p) / name for p in search_paths), pathlib.Path(name)):
    if path.is_file():
      return path
  return None


def _syntax_error(error: SyntaxError | tokenize.TokenError, files: Sequence[str],
                  search_paths: Sequence[str], bindings: Sequence[str]) -> ValueError:
  """A ValueError naming the gin file and line, or the binding, that does not parse."""
  if isinstance(error, SyntaxError):
    if error.filename:
      where = f"{error.filename}, line {error.lineno}"
    else:
      where = f"binding {(error.text or '').strip()!r}"
    return ValueError(f"gin: cannot parse {where}: {error.msg}")
  # An unclosed bracket or string: gin's tokenizer names no file, so find the culprit.
  paths = [_find_gin_file(name, search_paths) for name in files]
  sources = [(str(path), path.read_text()) for path in paths if path is not None]
  sources += [(f"binding {binding!r}", binding) for binding in bindings]
  for where, text in sources:
    try:
      list(tokenize.generate_tokens(io.StringIO(text).readline))
    except tokenize.TokenError:
      return ValueError(f"gin: cannot parse {where}: {error.args[0]} (an unclosed bracket "
                        f"or string)")
  return ValueError(f"gin: cannot parse an included file: {error.args[0]}")


def _is_required(value: object) -> bool:
  # `%gin.REQUIRED` parses to a reference to the constant named "gin.REQUIRED".
  return value is gin.REQUIRED or (type(value).__name__ == "ConfigurableReference"
                                   and getattr(value, "_scoped_selector", "").startswith("gin.REQUIRED"))


def unbound_required() -> list[str]:
  """Names of `%gin.REQUIRED` macros and parameters that nothing bound.

  gin 0.5 passes an unresolved REQUIRED through as a sentinel object, so the CLI checks
  before calling anything and names what is missing.
  """
  missing = []
  for (scope, selector), params in gin.config._CONFIG.items():  # pylint: disable=protected-access
    for param, value in params.items():
      if _is_required(value):
        missing.append(scope if selector == "gin.macro" else f"{selector}.{param}")
  return missing


def check_required() -> None:
  """Raises a clear error naming every `%gin.REQUIRED` value that was never given."""
  missing = unbound_required()
  if missing:
    flags = " ".join(f"--gin.{name}=..." for name in missing)
    raise ValueError(f"gin: required value(s) not given: {', '.join(missing)}. "
                     f"Bind them in a gin file or on the command line ({flags}).")


def explain_gin_error(error: BaseException) -> str:
  """A one-paragraph message for errors raised while calling gin-bound functions.

  `%gin.REQUIRED` values that were never bound surface as a ValueError naming the
  parameter; we add which flag fixes it.
  """
  text = str(error)
  match = re.search(r"Required bindings for `?([\w.]+)`? not provided in config: \[([^\]]*)\]",
                    text)
  if match:
    fn, params = match.group(1), match.group(2)
    return (f"gin: {fn} needs {params}, marked %gin.REQUIRED and never given. Bind it in a "
            f"gin file or on the command line, e.g. --gin.MODEL_DIR=/path/to/run.")
  return text


def write_operative_config(model_dir: str | os.PathLike[str], *, name: str = "config.gin") -> str:
  """Writes the final gin config (every bound value) to MODEL_DIR/config.gin."""
  path = pathlib.Path(model_dir) / name
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(gin.config_str())
  return str(path)


def summarize_gin_config() -> str:
  return gin.config_str()
