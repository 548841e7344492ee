"""Gin handling with T5X's command-line conventions.

`--gin_file=PATH` (repeatable), `--gin.NAME=VALUE` (a binding, T5X's shorthand for
`--gin_bindings='NAME = VALUE'`), `--gin_bindings=...` and `--gin_search_paths=...`.
Library code never reads gin: only the CLI parses it, then calls gin-bound entry points.

`parse_gin` also rejects what nothing could read (`gin_checks`) and resolves relative paths
written in gin files (`gin_files`).
"""

from __future__ import annotations

import ast
import dataclasses
import os
import re
import tokenize
from typing import Any, Sequence

import gin

from jaxmoral import gin_checks
from jaxmoral import gin_files


@dataclasses.dataclass(frozen=True)
class GinArgs:
  """Gin files, bindings and search paths taken out of a command line."""
  files: tuple[str, ...] = ()
  bindings: tuple[str, ...] = ()
  search_paths: tuple[str, ...] = ()
  # `--gin.NAME=VALUE` flags whose VALUE was no Python literal and so became a string; named
  # when a configurable then fails on a type (e.g. --gin.TRAIN_STEPS=1O00).
  read_as_strings: tuple[str, ...] = ()
  # The flag each of `bindings` came from (same order), to name it in errors; may be empty.
  binding_flags: tuple[str, ...] = ()


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
  files: list[str] = []
  paths: list[str] = []
  bindings, rest, quoted, flags = [], [], [], []
  args = list(argv)
  i = 0
  while i < len(args):
    arg = args[i]
    def take_value(flag: str, arg: str = arg) -> str:
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
      flags.append(arg)
    elif arg == "--gin_file" or arg.startswith("--gin_file="):
      files.extend(v for v in take_value("--gin_file").split(",") if v)
    elif arg == "--gin_bindings" or arg.startswith("--gin_bindings="):
      binding = take_value("--gin_bindings")
      bindings.append(binding)
      flags.append(f"--gin_bindings={binding}")
    elif arg == "--gin_search_paths" or arg.startswith("--gin_search_paths="):
      paths.extend(v for v in take_value("--gin_search_paths").split(",") if v)
    else:
      rest.append(arg)
    i += 1
  return GinArgs(tuple(files), tuple(bindings), tuple(paths), tuple(quoted), tuple(flags)), rest


def parse_gin(gin_args: GinArgs, *, extra_bindings: Sequence[str] = (),
              extra_binding_flags: Sequence[str] = ()) -> None:
  """Parses gin files and bindings; files are found in the search paths, the working directory,
  the project root and the gin files a wheel ships (`gin_files.project_roots`).

  Call it after importing the modules whose configurables the command uses. Everything bound
  must be readable: see `gin_checks.check_everything_is_read`. Relative paths written in the
  gin files are resolved as `gin_files.resolve_relative_paths` says.

  Args:
    gin_args: Files, bindings and search paths from `split_gin_args`.
    extra_bindings: Bindings made by a command's own flags, parsed after `gin_args.bindings`.
      A macro of a gin file that only the bindings they override read (`--init_checkpoint=X`
      over `train.init_checkpoint = %INIT_CHECKPOINT`) is left unread by choice: no error.
    extra_binding_flags: The flag each of `extra_bindings` came from, to name it in errors.

  Raises:
    FileNotFoundError: A gin file (or an include) is in none of the search paths.
    ValueError: A file or binding does not parse, binds an unknown configurable or parameter,
      or defines a macro or scope that nothing reads (one line naming it, its flag or file and
      line, and close valid names).
  """
  search_paths = list(dict.fromkeys([*gin_args.search_paths, os.getcwd(),
                                     *map(str, gin_files.project_roots())]))
  for path in search_paths:
    gin_files.add_search_path(path)
  for name in gin_args.files:
    if gin_files.find_gin_file(name, search_paths) is None:
      raise FileNotFoundError(f"gin file {name!r} not found in search paths {search_paths}")
  gin_files.warn_shadowing(gin_args.files, search_paths)
  bindings = list(gin_args.bindings)
  sources = gin_checks.BindingSources(gin_args.files, bindings, gin_args.binding_flags)
  try:
    gin.parse_config_files_and_bindings(list(gin_args.files), bindings, finalize_config=False)
  except ImportError as error:
    raise gin_checks.import_error(error) from None
  except (SyntaxError, tokenize.TokenError) as error:
    raise gin_checks.syntax_error(error, gin_args.files, search_paths, bindings) from error
  except (ValueError, KeyError) as error:
    raise gin_checks.binding_error(error, sources) from error
  read_before_flags: set[str] = set()
  if extra_bindings:
    read_before_flags = gin_checks.read_macros()
    flag_sources = gin_checks.BindingSources((), extra_bindings, extra_binding_flags)
    try:
      gin.parse_config(list(extra_bindings))
    except ImportError as error:
      raise gin_checks.import_error(error) from None
    except (SyntaxError, tokenize.TokenError) as error:
      raise gin_checks.syntax_error(error, (), search_paths, extra_bindings,
                          extra_binding_flags) from error
    except (ValueError, KeyError) as error:
      raise gin_checks.binding_error(error, flag_sources) from error
    flags = [*sources.flags, *extra_binding_flags,
             *[None] * (len(extra_bindings) - len(extra_binding_flags))]
    sources = gin_checks.BindingSources(gin_args.files, [*bindings, *extra_bindings],
                              [flag or "" for flag in flags])
  gin_checks.check_everything_is_read(sources, read_before_flags=read_before_flags)
  # Imports JAX: not at module level, which `--help` reads.
  from jaxmoral import partitioning  # pylint: disable=import-outside-toplevel
  partitioning.check_same_config_on_every_process()
  gin_files.resolve_relative_paths(gin_args.files)


def check_required() -> None:
  """Raises a clear error naming every `%gin.REQUIRED` value that was never given."""
  missing = gin_checks.unbound_required()
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


def bound_value(selector: str, param: str) -> Any:
  """The value gin binds to `param` of configurable `selector`, macros followed.

  For checks made before a gin-bound function is called (e.g. that its output is writable).
  Only macro references are followed: a reference to a configurable (`@fn()`) is returned
  as it is, never called.

  Args:
    selector: The configurable, e.g. "jaxmoral.diamante.chat.chat" (its module imported).
    param: One of its parameters.

  Returns:
    The bound value; None when nothing binds it (the function's default applies).
  """
  try:
    value = gin.query_parameter(f"{selector}.{param}")
  except ValueError:
    return None
  for _ in range(64):  # A macro of a macro...; gin refuses cycles, never loop anyway.
    if not (isinstance(value, gin.config.ConfigurableReference)
            and value.configurable.selector == gin_files.MACRO):
      break
    value = gin_files.macro_value(value.config_key[0])
  return value


# Where a run keeps its final gin config (T5X's name).
OPERATIVE_CONFIG_FILE = "config.gin"


def write_operative_config(model_dir: str | os.PathLike[str], *,
                           name: str = OPERATIVE_CONFIG_FILE) -> str:
  """Writes the final gin config (every bound value) to MODEL_DIR/config.gin."""
  from jaxmoral import fileio  # pylint: disable=g-import-not-at-top
  path = fileio.join(model_dir, name)
  fileio.makedirs(model_dir)
  fileio.write_text(path, gin.config_str())
  return path
