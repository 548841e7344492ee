"""Gin handling with T5X's command-line conventions.

`--gin_file=PATH` (repeatable), `--gin.NAME=VALUE` (a binding, T5X's shorthand for
`--gin_bindings='NAME = VALUE'`), `--gin_bindings=...` and `--gin_search_paths=...`.
Library code never reads gin: only the CLI parses it, then calls gin-bound entry points.

`parse_gin` also rejects what nothing could read (a misspelt `--gin.TRAIN_STEP=5` would
otherwise be a new macro, silently ignored): macros that no binding or macro refers to,
parameters and configurables that do not exist, and scopes that nothing enters. A relative
path written in a gin file that names nothing in the working directory is looked up next to
the gin file, then in the project root, where shipped configs write them from.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import io
import logging
import os
import pathlib
import re
import sys
import tokenize
from typing import Any, Collection, Iterable, Iterator, NamedTuple, Sequence

import gin
from gin import config_parser

PROJECT_ROOT = pathlib.Path(__file__).resolve().parents[1]

logger = logging.getLogger(__name__)


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


# Where gin looks for gin files, in its order: '' (the name as given) first, then each path
# `parse_gin` gave `gin.add_config_file_search_path`, once. Recorded here because gin keeps its
# own list private, and the statements of a file are read from where gin read it.
_SEARCH_PATHS: list[str] = [""]


def _add_search_path(path: str) -> None:
  if path not in _SEARCH_PATHS:
    gin.add_config_file_search_path(path)
    _SEARCH_PATHS.append(path)


def parse_gin(gin_args: GinArgs, *, extra_bindings: Sequence[str] = (),
              extra_binding_flags: Sequence[str] = ()) -> None:
  """Parses gin files and bindings; files are found in the search paths and the project root.

  Call it after importing the modules whose configurables the command uses. Everything bound
  must be readable: see `check_everything_is_read`. Relative paths written in the gin files
  are resolved as `resolve_relative_paths` says.

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
  search_paths = list(dict.fromkeys([*gin_args.search_paths, os.getcwd(), str(PROJECT_ROOT)]))
  for path in search_paths:
    _add_search_path(path)
  for name in gin_args.files:
    if _find_gin_file(name, search_paths) is None:
      raise FileNotFoundError(f"gin file {name!r} not found in search paths {search_paths}")
  _warn_shadowing(gin_args.files, search_paths)
  bindings = list(gin_args.bindings)
  sources = _BindingSources(gin_args.files, bindings, gin_args.binding_flags)
  try:
    gin.parse_config_files_and_bindings(list(gin_args.files), bindings, finalize_config=False)
  except ImportError as error:
    raise _import_error(error) from None
  except (SyntaxError, tokenize.TokenError) as error:
    raise _syntax_error(error, gin_args.files, search_paths, bindings) from error
  except (ValueError, KeyError) as error:
    raise _binding_error(error, sources) from error
  read_before_flags: set[str] = set()
  if extra_bindings:
    read_before_flags = set(_macros()) - set(unreferenced_macros())
    flag_sources = _BindingSources((), extra_bindings, extra_binding_flags)
    try:
      gin.parse_config(list(extra_bindings))
    except ImportError as error:
      raise _import_error(error) from None
    except (SyntaxError, tokenize.TokenError) as error:
      raise _syntax_error(error, (), search_paths, extra_bindings,
                          extra_binding_flags) from error
    except (ValueError, KeyError) as error:
      raise _binding_error(error, flag_sources) from error
    flags = [*sources.flags, *extra_binding_flags,
             *[None] * (len(extra_bindings) - len(extra_binding_flags))]
    sources = _BindingSources(gin_args.files, [*bindings, *extra_bindings],
                              [flag or "" for flag in flags])
  check_everything_is_read(sources, read_before_flags=read_before_flags)
  # Imports JAX: not at module level, which `--help` reads.
  from jaxmoral import partitioning  # pylint: disable=import-outside-toplevel
  partitioning.check_same_config_on_every_process()
  resolve_relative_paths(gin_args.files)


def _is_relative_path(value: object) -> bool:
  """Whether `value` reads as a relative path with a folder part ('data/x.jsonl'); a bare
  word ('adamw', 'demo') is a name, not a path, and a URL ('gs://...') is not local."""
  return (isinstance(value, str) and "/" in value.replace(os.sep, "/") and "://" not in value
          and not os.path.isabs(value) and not value.startswith("~"))


def _binding_key(statement: config_parser.BindingStatement) -> tuple[str, str, str]:
  """The `gin.bind_parameter` key of a statement (a macro binds `gin.macro.value`)."""
  if not statement.arg_name:
    return _macro_name(statement), _MACRO, "value"
  return statement.scope, statement.selector, statement.arg_name


def resolve_relative_paths(files: Sequence[str]) -> dict[str, str]:
  """Rebinds relative paths written in gin `files` that name nothing in the working directory.

  A shipped config (e.g. configs/diamante/tiny_cpu.gin's `TRAIN_PATH =
  'jaxmoral/data/demo/dialogues.jsonl'`) is written relative to the project root, so it
  worked only from there. A string value of a file's binding or macro that reads as a
  relative path with a folder part and does not exist relative to the working directory is
  looked up, in order, relative to the folder of the gin file that binds it and relative to
  the project root; the first that exists is bound instead (absolute). What exists relative
  to the working directory, a path that exists nowhere (an output not yet written), and a
  value the command line overrode are left alone.

  Call after the files are parsed (`parse_gin` does).

  Args:
    files: The gin files given (their includes are followed).

  Returns:
    `{binding: resolved path}` of what was rebound.
  """
  last: dict[tuple[str, str, str], tuple[Any, str]] = {}
  for name in files:
    for statement, path in _file_statements(name):
      if isinstance(statement, config_parser.BindingStatement):
        last[_binding_key(statement)] = (statement.value, path)
  resolved = {}
  for key, (value, path) in last.items():
    if not _is_relative_path(value) or os.path.exists(value):
      continue
    try:
      parsed = gin.config.ParsedBindingKey.parse(key)
    except ValueError:  # Not a binding gin kept (it parsed every file already): leave it.
      continue
    current = _bound(parsed)
    if current != value:  # Another file or the command line bound something else since.
      continue
    for base in dict.fromkeys((pathlib.Path(path).resolve().parent, PROJECT_ROOT)):
      candidate = base / value
      if candidate.exists():
        gin.bind_parameter(key, str(candidate))
        shown = key[0] if key[1] == _MACRO else f"{key[1]}.{key[2]}"
        resolved[shown] = str(candidate)
        logger.info("gin: %s = %r (%s) is %s", shown, value, _display_path(path), candidate)
        break
  return resolved


def _bound(key: gin.config.ParsedBindingKey) -> Any:
  """The value bound to `key` (macros unresolved); None when nothing binds it."""
  scope, selector = key.config_key
  try:
    return gin.query_parameter(f"{scope}/{selector}.{key.arg_name}" if scope
                               else f"{selector}.{key.arg_name}")
  except ValueError:
    return None


def _macro_value(name: str) -> Any:
  """The value macro `name` (scoped: 'scope/NAME') is bound to, references unresolved; None
  when it is not defined."""
  try:
    return gin.query_parameter(f"{name}/{_MACRO}.value")
  except ValueError:
    return None


def _import_error(error: ImportError) -> ValueError:
  """One line for a gin `import` that fails: the file and line, and the module."""
  text = str(error)
  match = re.search(r'In file "([^"]+)", line (\d+)', text)
  where = f"{_display_path(match.group(1))}:{match.group(2)}: " if match else "gin: "
  first = text.splitlines()[0].strip('"') if text else repr(error)
  return ValueError(f"{where}import failed: {first} "
                    "(install the module, or fix the name in the gin file)")


_INCLUDE = re.compile(r"""^\s*include\s+['"]([^'"]+)['"]""", re.MULTILINE)


def _shadowed_project_file(path: pathlib.Path) -> pathlib.Path | None:
  """The project config that `path`, a file under the working directory of the same relative
  name, hides from the search path (None if it hides none)."""
  resolved = path.resolve()
  try:
    relative = resolved.relative_to(pathlib.Path.cwd().resolve())
  except ValueError:
    return None
  project = PROJECT_ROOT / relative
  return project if project.is_file() and project.resolve() != resolved else None


def _warn_shadowing(files: Sequence[str], search_paths: Sequence[str]) -> None:
  """Logs each gin file (or include) read from the working directory in place of the project
  config of the same name, with its absolute path (errors in it name that path too)."""
  todo, seen = list(files), set()
  while todo:
    name = todo.pop()
    path = _find_gin_file(name, search_paths)
    if path is None or path.resolve() in seen:
      continue
    seen.add(path.resolve())
    hidden = _shadowed_project_file(path)
    if hidden is not None:
      logger.warning("gin file %r is read from %s, which shadows the project's %s", name,
                     path.resolve(), hidden)
    try:
      todo.extend(_INCLUDE.findall(path.read_text(encoding="utf-8", errors="replace")))
    except OSError:
      continue


def _find_gin_file(name: str, search_paths: Sequence[str]) -> pathlib.Path | None:
  """The first search path holding `name`, else `name` itself if it is a file, else None."""
  for path in (*(pathlib.Path(p) / name for p in search_paths), pathlib.Path(name)):
    if path.is_file():
      return path
  return None


def _syntax_error(error: SyntaxError | tokenize.TokenError, files: Sequence[str],
                  search_paths: Sequence[str], bindings: Sequence[str],
                  flags: Sequence[str | None] = ()) -> ValueError:
  """A ValueError naming the gin file and line, or the binding (its flag if `flags` gives
  one, in the order of `bindings`), that does not parse."""
  flag_of = {binding: flag for binding, flag in zip(bindings, flags, strict=False) if flag}

  def shown(binding: str) -> str:
    return f"binding {binding!r}" + (f" ({flag_of[binding]})" if binding in flag_of else "")
  if isinstance(error, SyntaxError):
    if error.filename:
      where = f"{_display_path(error.filename)}, line {error.lineno}"
    else:
      where = shown((error.text or "").strip())
    return ValueError(f"gin: cannot parse {where}: {error.msg}")
  # An unclosed bracket or string: gin's tokenizer names no file, so find the culprit.
  paths = [_find_gin_file(name, search_paths) for name in files]
  sources = [(_display_path(str(path)), path.read_text()) for path in paths if path is not None]
  sources += [(shown(binding), binding) for binding in bindings]
  for where, text in sources:
    try:
      list(tokenize.generate_tokens(io.StringIO(text).readline))
    except tokenize.TokenError:
      return ValueError(f"gin: cannot parse {where}: {error.args[0]} (an unclosed bracket "
                        f"or string)")
  return ValueError(f"gin: cannot parse an included file: {error.args[0]}")


_MACRO = "gin.macro"


class _BindingSources:
  """Says where a binding came from: a command-line flag, or a gin file and line."""

  def __init__(self, files: Sequence[str], bindings: Sequence[str],
               binding_flags: Sequence[str]) -> None:
    self.files = tuple(files)
    self.bindings = tuple(bindings)
    # `extra_bindings` (a command's own flags) have no flag of their own here.
    self.flags: tuple[str | None, ...] = (
        tuple(binding_flags) + (None,) * (len(bindings) - len(binding_flags)))

  def of_binding_line(self, line_num: int) -> str:
    """The flag (or binding) on line `line_num` of the newline-joined bindings gin parsed."""
    for binding, flag in zip(self.bindings, self.flags, strict=False):
      if line_num <= binding.count("\n") + 1:
        return flag or f"binding {binding!r}"
      line_num -= binding.count("\n") + 1
    return "the command-line bindings"

  def statements(self) -> Iterator[tuple[config_parser.BindingStatement, str, bool]]:
    """Every binding statement as gin reads them (files with their includes in place, then the
    bindings), with where it is and whether that is on the command line."""
    for name in self.files:
      for statement, path in _file_statements(name):
        if isinstance(statement, config_parser.BindingStatement):
          yield (statement, f"{_display_path(path)}, line {statement.location.line_num}",
                 False)
    for binding, flag in zip(self.bindings, self.flags, strict=False):
      for statement in config_parser.ConfigParser(binding, _Unresolved()):
        if isinstance(statement, config_parser.BindingStatement):
          yield statement, flag or f"binding {binding!r}", True

  def macro_definitions(self) -> dict[str, tuple[str, bool]]:
    """Where each macro is last defined, and whether that is on the command line."""
    return {_macro_name(statement): (where, on_command_line)
            for statement, where, on_command_line in self.statements()
            if not statement.arg_name}

  def binding(self, scope: str, selector: str, param: str) -> str | None:
    """Where `scope/selector.param` is last bound (either selector in full or in part)."""
    found = None
    for statement, where, _ in self.statements():
      if (statement.arg_name == param and statement.scope == scope
          and _same_configurable(statement.selector, selector)):
        found = where
    return found


def _same_configurable(one: str, other: str) -> bool:
  """Whether two selectors, each in full or in part, name the same configurable."""
  if f".{one}".endswith(f".{other}") or f".{other}".endswith(f".{one}"):
    return True
  configurable = _configurable(one)
  return configurable is not None and configurable is _configurable(other)


class _Unresolved(config_parser.ParserDelegate):
  """Reads gin statements without importing modules or resolving references."""

  def configurable_reference(self, scoped_configurable_name: str, evaluate: bool) -> None:
    return None

  def macro(self, macro_name: str) -> None:
    return None


def _macro_name(statement: config_parser.BindingStatement) -> str:
  return f"{statement.scope}/{statement.selector}" if statement.scope else statement.selector


def _file_statements(name: str, depth: int = 0) -> Iterator[tuple[Any, str]]:
  """The statements of gin file `name` and (in place) of its includes, with their file."""
  # Found as gin finds them: in the search paths it was given, in order.
  prefixes = [""] if os.path.isabs(name) else _SEARCH_PATHS
  path = next((p for p in (os.path.join(prefix, name) for prefix in prefixes)
               if os.path.isfile(p)), None)
  if path is None or depth > 64:  # gin parsed it, so neither happens; never loop.
    return
  with open(path) as f:
    for statement in config_parser.ConfigParser(f, _Unresolved()):
      if isinstance(statement, config_parser.IncludeStatement):
        yield from _file_statements(statement.filename, depth + 1)
      else:
        yield statement, path


def _display_path(path: str) -> str:
  """`path` relative to the working directory or the project root where it is inside one;
  absolute where a file of the working directory shadows the project's of the same name."""
  if _shadowed_project_file(pathlib.Path(path)) is not None:
    return str(pathlib.Path(path).resolve())
  for root in (pathlib.Path.cwd(), PROJECT_ROOT):
    try:
      return str(pathlib.Path(path).resolve().relative_to(root))
    except ValueError:
      continue
  return path


class _Reference(NamedTuple):
  """A reference in a binding's value as gin prints it: `@scope/name()` or `%NAME`."""
  name: str  # The configurable's selector as written, or the macro's name (with its scope).
  scopes: tuple[str, ...]  # The scope parts a configurable reference enters.
  is_macro: bool


class _Listing(config_parser.ParserDelegate):
  """Reads gin statements with their references as `_Reference` (nothing imported)."""

  def configurable_reference(self, scoped_configurable_name: str,
                             evaluate: bool) -> _Reference:
    *scopes, name = scoped_configurable_name.split("/")
    return _Reference(name, tuple(scopes), False)

  def macro(self, macro_name: str) -> _Reference:
    return _Reference(macro_name, (), True)


# Every binding gin holds: {(scope, selector): {parameter: value}}; a macro NAME (or
# scope/NAME) is (NAME, "gin.macro") with parameter "value".
_Config = dict[tuple[str, str], dict[str, Any]]


def _config() -> _Config:
  """Every binding gin holds, selectors minimal, values as written (references as
  `_Reference`).

  Read from gin's own printout of its whole config (`gin.config_str`) with gin's own parser:
  gin's public API answers for one named binding (`gin.query_parameter`) but lists its
  bindings only as that text. The checks that everything bound is read need all of them.
  """
  config: _Config = {}
  for statement in config_parser.ConfigParser(gin.config_str(), _Listing()):
    if isinstance(statement, config_parser.BindingStatement):
      if statement.arg_name:
        key, param = (statement.scope, statement.selector), statement.arg_name
      else:
        key, param = (_macro_name(statement), _MACRO), "value"
      config.setdefault(key, {})[param] = statement.value
  return config


def _in_value(value: Any) -> Iterator[_Reference]:
  """The references anywhere in a value (tuples, lists, dict keys and values)."""
  if isinstance(value, _Reference):
    yield value
  elif isinstance(value, (list, tuple, set)):
    for item in value:
      yield from _in_value(item)
  elif isinstance(value, dict):
    for item in value.items():
      yield from _in_value(item)


def _references(config: _Config) -> Iterator[tuple[tuple[str, str], _Reference]]:
  """Every reference (`@name`, `%MACRO`) in the config, with the key of its binding."""
  for key, params in config.items():
    for value in params.values():
      for ref in _in_value(value):
        yield key, ref


def unreferenced_macros() -> list[str]:
  """Macros of the parsed config that no binding and no other macro refers to (`%NAME`).

  References count wherever they are: in tuples, lists and dicts, in the bindings of a
  function that another binding calls (`@fn()`), in scoped bindings, in other macros.
  """
  return _unreferenced_macros(_config())


def _unreferenced_macros(config: _Config) -> list[str]:
  referenced: set[str] = set()
  for (scope, selector), ref in _references(config):
    if ref.is_macro and not (selector == _MACRO and scope == ref.name):
      # `%X` evaluated in scope s also reads a macro bound as `s/X`: count the bare name too.
      referenced.update((ref.name, ref.name.rsplit("/", 1)[-1]))
  return sorted(scope for scope, selector in config
                if selector == _MACRO and scope not in referenced
                and scope.rsplit("/", 1)[-1] not in referenced)


def _is_export(name: str) -> bool:
  """Whether macro `name` just names an object built by a configurable (`@fn()`).

  Fragments export MODEL_CONFIG, OPTIMIZER and PARTITIONER for includers; a command may
  build the object from the configurable's own bindings instead (`jaxmoral compile` builds
  `partitioning.PjitPartitioner` itself), and those bindings are checked on their own.
  """
  value = _macro_value(name)
  return (isinstance(value, gin.config.ConfigurableReference)
          and value.configurable.selector not in (_MACRO, "gin.constant"))


def _entered_scopes(config: _Config) -> set[str]:
  return {part for _, ref in _references(config) for part in ref.scopes}


def _unentered_scopes(config: _Config) -> list[tuple[str, str, str, str]]:
  """(scope part, scope, selector, parameter) of scoped bindings whose scope no reference
  (`@scope/fn()`) enters.

  jaxmoral enters no scope in code (no `gin.config_scope`), so such a binding is never read.
  """
  entered = _entered_scopes(config)
  unread = []
  for (scope, selector), params in config.items():
    if selector == _MACRO or not scope:
      continue
    missing = [part for part in scope.split("/") if part not in entered]
    unread += [(missing[0], scope, selector, param) for param in params if missing]
  return unread


def _configurable(selector: str) -> Any:
  """The registered configurable `selector` names (in full or in part); None if it names
  none or more than one."""
  try:
    return gin.get_configurable(selector)
  except (KeyError, ValueError):
    return None


def _parameters(selector: str) -> list[str]:
  """The keyword parameters of a registered configurable (empty if it has no signature)."""
  try:
    signature = inspect.signature(_configurable(selector))
  except (TypeError, ValueError):
    return []
  return [name for name, param in signature.parameters.items()
          if param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY)]


def _registered_selectors() -> list[str]:
  """The selectors, in full and in part, of the configurables defined in the project's
  imported modules (the package, experiments, tests), as gin resolves them.

  gin lists no registered names publicly, so they are found from the other side: a module
  attribute that gin knows as a configurable, named by each dotted suffix of its module path
  (a configurable registered with `module="decoding"` is `decoding.NAME`) that gin resolves to
  it. For the close-name suggestions of an unknown configurable, on the error path only.
  """
  selectors = []
  for module in list(sys.modules.values()):
    if not str(getattr(module, "__file__", None) or "").startswith(str(PROJECT_ROOT)):
      continue
    for attribute, value in list(vars(module).items()):
      if not callable(value) or getattr(value, "__module__", None) != module.__name__:
        continue
      try:
        configurable = gin.get_configurable(value)
      except (KeyError, ValueError, TypeError):
        continue
      parts = module.__name__.split(".")
      for candidate in dict.fromkeys(
          [attribute] + [f"{'.'.join(parts[i:])}.{attribute}" for i in range(len(parts))]
          + [f"{part}.{attribute}" for part in parts]):
        if _configurable(candidate) is configurable:
          selectors.append(candidate)
  return selectors


def _close(name: str, candidates: Iterable[str], *, last_part: bool = False) -> list[str]:
  """Candidates close to `name` (case ignored), compared whole or by their last dotted part."""
  by_key: dict[str, list[str]] = {}
  for candidate in dict.fromkeys(candidates):
    keys = {candidate.lower(), candidate.rsplit(".", 1)[-1].lower()} if last_part else {
        candidate.lower()}
    for key in keys:
      by_key.setdefault(key, []).append(candidate)
  matches = difflib.get_close_matches(name.lower(), list(by_key), n=3, cutoff=0.7)
  return list(dict.fromkeys(c for match in matches for c in by_key[match]))[:4]


def _suggest(names: Sequence[str]) -> str:
  return f"; close valid names: {', '.join(names)}" if names else ""


def _macros() -> list[str]:
  """Every macro of the parsed config."""
  return [scope for scope, selector in _config() if selector == _MACRO]


def check_everything_is_read(sources: _BindingSources | None = None, *,
                             read_before_flags: Collection[str] = ()) -> None:
  """Raises if the parsed config defines a macro or scope that nothing can read.

  An unread macro is one that no binding and no other macro refers to, most often a
  misspelling on the command line (`--gin.TRAIN_STEP=5` for TRAIN_STEPS). A gin file may
  leave unread a macro that only names what a configurable builds (`OPTIMIZER =
  @optimizers.make_optimizer()`), for includers; the command line may not.

  Args:
    sources: Where the parsed files and bindings came from (to name them); None names
      nothing.
    read_before_flags: Macros read before a command's own flags overrode bindings; one of
      them defined in a file is no error (the flag replaced what read it).

  Raises:
    ValueError: One line naming each unread macro or scope, where it is set, and close names.
  """
  config = _config()
  problems = []
  unread = _unreferenced_macros(config)
  if unread:
    where = sources.macro_definitions() if sources else {}
    macros = sorted({ref.name for _, ref in _references(config) if ref.is_macro} | {
        scope for scope, selector in config if selector == _MACRO})
    params = [f"{selector}.{param}" for scope, selector in config
              if selector != _MACRO for param in _parameters(selector)]
    for name in unread:
      place, on_command_line = where.get(name, (None, False))
      if not on_command_line and (_is_export(name) or name in read_before_flags):
        continue
      close = _close(name, [m for m in macros if m != name] + params, last_part=True)
      problems.append(f"macro {name}{f' ({place})' if place else ''} is never read: no "
                      f"binding or macro refers to %{name}{_suggest(close)}")
  scopes = sorted(_entered_scopes(config))
  for part, scope, selector, param in _unentered_scopes(config):
    place = sources.binding(scope, selector, param) if sources else None
    problems.append(f"scope {part!r} of {scope}/{selector}.{param}"
                    f"{f' ({place})' if place else ''} is never entered: no reference "
                    f"@{part}/... exists{_suggest(_close(part, scopes))}")
  if problems:
    raise ValueError("gin: " + " ".join(f"{problem}." for problem in dict.fromkeys(problems)))


# gin's parse errors carry their place as extra lines: "\n  In file "F", line N\n    TEXT".
_GIN_LOCATION = re.compile(r'\n  In (?:file "(?P<file>[^"]*)",|bindings string) line '
                           r'(?P<line>\d+)\n')
_UNKNOWN_PARAMETER = re.compile(r"^Configurable '(?P<selector>[^']+)' doesn't have a "
                                r"parameter named '(?P<param>[^']+)'\.")
_UNKNOWN_CONFIGURABLE = re.compile(r"^No configurable matching (?:reference )?'@?"
                                   r"(?P<selector>[^'(]+)(?:\(\))?'\.")


def _binding_error(error: ValueError | KeyError, sources: _BindingSources) -> ValueError:
  """gin's error for a binding it cannot make, as one line naming the flag or file and line."""
  text = str(error)
  location = _GIN_LOCATION.search(text)
  message = text[:location.start()] if location else text.split("\n", 1)[0]
  if isinstance(error, KeyError):  # str() of a KeyError is the repr of its message.
    message = message.strip("'\"")
  where = ""
  if location and location.group("file"):
    where = f" ({_display_path(location.group('file'))}, line {location.group('line')})"
  elif location:
    where = f" ({sources.of_binding_line(int(location.group('line')))})"
  unknown_param = _UNKNOWN_PARAMETER.match(message)
  unknown = _UNKNOWN_CONFIGURABLE.match(message)
  if unknown_param:
    selector, param = unknown_param.group("selector", "param")
    names = _parameters(selector)
    close = [f"{selector}.{name}" for name in _close(param, names)]
    return ValueError(f"gin: {selector} has no parameter {param!r}{where}"
                      f"{_suggest(close)}")
  if unknown:
    selector = unknown.group("selector")
    depth = selector.count(".") + 1
    # Compared with the registered names cut to as many dotted parts as the one given.
    suffixes = [".".join(registered.split(".")[-depth:])
                for registered in _registered_selectors() if registered.count(".") >= depth - 1]
    return ValueError(f"gin: no configurable {selector!r} is registered (misspelt, or its "
                      f"module not imported){where}{_suggest(_close(selector, suffixes))}")
  return ValueError(f"gin: {' '.join(message.split())}{where}")


def _is_required(value: object) -> bool:
  # `%gin.REQUIRED` reads as a reference to the macro named "gin.REQUIRED".
  return value is gin.REQUIRED or (isinstance(value, _Reference) and value.is_macro
                                   and value.name == "gin.REQUIRED")


def unbound_required() -> list[str]:
  """Names of `%gin.REQUIRED` macros and parameters that nothing bound.

  gin 0.5 passes an unresolved REQUIRED through as a sentinel object, so the CLI checks
  before calling anything and names what is missing.
  """
  missing = []
  for (scope, selector), params in _config().items():
    for param, value in params.items():
      if _is_required(value):
        missing.append(scope if selector == _MACRO else
                       f"{scope + '/' if scope else ''}{selector}.{param}")
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
            and value.configurable.selector == _MACRO):
      break
    value = _macro_value(value.config_key[0])
  return value


class _Written:
  """A reference or macro in a parsed value, kept as written (`@name()`, `%NAME`)."""

  def __init__(self, text: str) -> None:
    self.text = text

  def __repr__(self) -> str:
    return self.text


class _Symbolic(config_parser.ParserDelegate):
  """Reads gin statements with references and macros kept symbolic (nothing imported)."""

  def configurable_reference(self, scoped_configurable_name: str, evaluate: bool) -> _Written:
    return _Written(f"@{_complete(scoped_configurable_name)}{'()' if evaluate else ''}")

  def macro(self, macro_name: str) -> _Written:
    return _Written(f"%{macro_name}")


def _complete(selector: str) -> str:
  """`selector` named by the Python path of the configurable it resolves to ('runs.train_run'
  -> 'jaxmoral.runs.train_run') when it names one; else as written (ambiguous, or a module
  this process has not imported). A scope prefix ('ppo/...') is kept."""
  scope, _, name = selector.rpartition("/")
  configurable = _configurable(name)
  complete = (f"{configurable.__module__}.{configurable.__qualname__}" if configurable
              is not None else name)
  return f"{scope}/{complete}" if scope else complete


def config_bindings(text: str) -> dict[str, str]:
  """`{binding: value}` of a gin config text (a config.gin, `gin.config_str()`), read by gin's
  own parser: continued lines, comments and a value's layout do not matter, selectors are
  completed through gin's registry (gin prints one minimally or in full depending on what is
  imported), references and macros are compared as written.

  Raises:
    ValueError: `text` is not gin (the parser's message, with its line).
  """
  bindings = {}
  try:
    for statement in config_parser.ConfigParser(text, _Symbolic()):
      if not isinstance(statement, config_parser.BindingStatement):
        continue  # import / include statements bind nothing.
      name = _macro_name(statement)  # scope/selector; a macro's name when no arg_name.
      if statement.arg_name:
        name = f"{_complete(name)}.{statement.arg_name}"
      bindings[name] = repr(statement.value)
  except (SyntaxError, tokenize.TokenError) as error:
    raise ValueError(f"not a gin config: {error}") from error
  return bindings


def binding_changes(before: str, after: str) -> list[str]:
  """The bindings that differ between two gin config texts (`config_bindings`): "- binding =
  value" as `before` has it, "+ binding = value" as `after` has it, sorted by binding."""
  old, new = config_bindings(before), config_bindings(after)
  changes = []
  for name in sorted(old.keys() | new.keys()):
    if old.get(name) != new.get(name):
      changes += [f"- {name} = {old[name]}"] if name in old else []
      changes += [f"+ {name} = {new[name]}"] if name in new else []
  return changes


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
