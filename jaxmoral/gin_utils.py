"""Gin handling with T5X's command-line conventions: `--gin_file=PATH` (repeatable),
`--gin.NAME=VALUE` (T5X's shorthand for `--gin_bindings='NAME = VALUE'`), `--gin_bindings`
and `--gin_search_paths`. Library code never reads gin: only the CLI parses it, then calls
gin-bound entry points.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import re
import tokenize
from typing import Any, Callable, Sequence

import gin

from jaxmoral import gin_checks
from jaxmoral import gin_files
from jaxmoral import run_layout


@dataclasses.dataclass(frozen=True)
class GinArgs:
  """Gin files, bindings and search paths taken out of a command line."""
  files: tuple[str, ...] = ()
  bindings: tuple[str, ...] = ()
  search_paths: tuple[str, ...] = ()
  # `--gin.NAME=VALUE` flags whose VALUE, no Python literal, became a string: named when a
  # configurable then fails on a type (--gin.TRAIN_STEPS=1O00).
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
  """Separates gin flags (T5X forms) from the other arguments (kept in order) of `argv`."""
  files: list[str] = []
  paths: list[str] = []
  bindings, rest, quoted, flags = [], [], [], []
  args = iter(argv)
  for arg in args:
    flag, sep, given = arg.partition("=")
    if flag in ("--gin_file", "--gin_bindings", "--gin_search_paths") and not sep:
      given = next(args, None)
      if given is None:
        raise SystemExit(f"error: {flag} needs a value")
    if arg.startswith("--gin."):
      name, sep, value = arg[len("--gin."):].partition("=")
      if not sep:
        raise SystemExit(f"error: {arg!r}: expected --gin.NAME=VALUE")
      gin_value = _as_gin_value(value)
      if gin_value != value:
        quoted.append(arg)
      bindings.append(f"{name} = {gin_value}")
      flags.append(arg)
    elif flag == "--gin_file":
      files.extend(v for v in given.split(",") if v)
    elif flag == "--gin_bindings":
      bindings.append(given)
      flags.append(f"--gin_bindings={given}")
    elif flag == "--gin_search_paths":
      paths.extend(v for v in given.split(",") if v)
    else:
      rest.append(arg)
  return GinArgs(tuple(files), tuple(bindings), tuple(paths), tuple(quoted), tuple(flags)), rest


def search_paths(gin_args: GinArgs) -> list[str]:
  """Where gin files are found: the search paths given, the working directory, then the
  project's gin files (`gin_files.project_roots`)."""
  return list(dict.fromkeys([*gin_args.search_paths, os.getcwd(),
                             *map(str, gin_files.project_roots())]))


def _parse(parse: Callable[[], Any], sources: gin_checks.BindingSources,
           paths: Sequence[str], flags: Sequence[str | None] = ()) -> None:
  """Runs gin's `parse` of `sources`, its errors as one line (`gin_checks`)."""
  try:
    parse()
  except ImportError as error:
    raise gin_checks.import_error(error) from None
  except (SyntaxError, tokenize.TokenError) as error:
    raise gin_checks.syntax_error(error, sources.files, paths, sources.bindings,
                                  flags) from error
  except (ValueError, KeyError) as error:
    raise gin_checks.binding_error(error, sources) from error


def parse_gin(gin_args: GinArgs, *, extra_bindings: Sequence[str] = (),
              extra_binding_flags: Sequence[str] = ()) -> None:
  """Parses gin files (found as `search_paths` says) and bindings, after the modules whose
  configurables the command uses are imported. Everything bound must be readable
  (`gin_checks.check_everything_is_read`); relative paths written in the files are resolved
  (`gin_files.resolve_relative_paths`).

  Args:
    extra_bindings: Bindings made by a command's own flags, parsed after `gin_args.bindings`.
      A macro of a gin file that only the bindings they override read (`--init_checkpoint=X`
      over `train.init_checkpoint = %INIT_CHECKPOINT`) is left unread by choice: no error.
    extra_binding_flags: The flag each of `extra_bindings` came from, to name it in errors.

  Raises:
    FileNotFoundError: A gin file (or an include) is in none of the search paths.
    ValueError: A file or binding does not parse, binds an unknown name, or defines what
      nothing reads (one line: the name, where, close valid names).
  """
  paths = search_paths(gin_args)
  for path in paths:
    gin_files.add_search_path(path)
  for name in gin_args.files:
    if gin_files.find_gin_file(name, paths) is None:
      raise FileNotFoundError(f"gin file {name!r} not found in search paths {paths}")
  gin_files.warn_shadowing(gin_args.files, paths)
  bindings = list(gin_args.bindings)
  sources = gin_checks.BindingSources(gin_args.files, bindings, gin_args.binding_flags)
  _parse(lambda: gin.parse_config_files_and_bindings(list(gin_args.files), bindings,
                                                     finalize_config=False), sources, paths)
  read_before_flags: set[str] = set()
  if extra_bindings:
    read_before_flags = gin_checks.read_macros()
    _parse(lambda: gin.parse_config(list(extra_bindings)),
           gin_checks.BindingSources((), extra_bindings, extra_binding_flags), paths,
           extra_binding_flags)
    sources = gin_checks.BindingSources(gin_args.files, [*bindings, *extra_bindings],
                                        [*sources.flags, *extra_binding_flags])
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
  """A one-paragraph message for an error raised calling a gin-bound function: an unbound
  `%gin.REQUIRED` value's ValueError says which flag fixes it."""
  text = str(error)
  match = re.search(r"Required bindings for `?([\w.]+)`? not provided in config: \[([^\]]*)\]",
                    text)
  if match:
    fn, params = match.group(1), match.group(2)
    return (f"gin: {fn} needs {params}, marked %gin.REQUIRED and never given. Bind it in a "
            f"gin file or on the command line, e.g. --gin.MODEL_DIR=/path/to/run.")
  return text


def bound_value(selector: str, param: str) -> Any:
  """The value gin binds to `param` of configurable `selector` (its module imported), macros
  followed, a configurable reference (`@fn()`) returned uncalled; None when nothing binds it.
  For checks before a gin-bound function is called (that its output is writable)."""
  value = gin_files.query(f"{selector}.{param}")
  for _ in range(64):  # A macro of a macro...; gin refuses cycles, never loop anyway.
    if not (isinstance(value, gin.config.ConfigurableReference)
            and value.configurable.selector == gin_files.MACRO):
      break
    value = gin_files.macro_value(value.config_key[0])
  return value


def write_operative_config(model_dir: str | os.PathLike[str]) -> str:
  """Writes the final gin config (every bound value) to MODEL_DIR/config.gin."""
  from jaxmoral import fileio  # pylint: disable=g-import-not-at-top
  path = fileio.join(model_dir, run_layout.CONFIG_FILE)
  fileio.makedirs(model_dir)
  fileio.write_text(path, gin.config_str())
  return path
