"""Gin files and what they say: where gin finds a file, the statements of a file and its
includes as gin's own parser reads them, relative paths in them, and config texts compared.

The project's gin files (gin/, configs/) are in the project root of a checkout; an installed
wheel carries them in SHIPPED_ROOT (setup.py copies them there), searched after it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import re
import tokenize
from typing import Any, Iterator, Sequence

import gin
from gin import config_parser

PROJECT_ROOT = pathlib.Path(__file__).resolve().parents[1]
SHIPPED_ROOT = pathlib.Path(__file__).resolve().parent / "shipped_configs"

logger = logging.getLogger(__name__)


# Where gin looks for gin files, in its order: '' (the name as given), then each path added
# (`add_search_path`). Kept here because gin's own list is private, and a file's statements
# are read from where gin read it.
_SEARCH_PATHS: list[str] = [""]


def add_search_path(path: str) -> None:
  """Has gin look for gin files in `path` too, after the paths added before."""
  if path not in _SEARCH_PATHS:
    gin.add_config_file_search_path(path)
    _SEARCH_PATHS.append(path)


def project_roots() -> list[pathlib.Path]:
  """The folders holding the project's gin/ and configs/, in search order: the project root,
  then the wheel's SHIPPED_ROOT where it exists."""
  return [PROJECT_ROOT, *([SHIPPED_ROOT] if SHIPPED_ROOT.is_dir() else [])]


def find_gin_file(name: str, search_paths: Sequence[str]) -> pathlib.Path | None:
  """The first search path holding `name`, else `name` itself if it is a file, else None."""
  return next((path for path in (*(pathlib.Path(p) / name for p in search_paths),
                                 pathlib.Path(name)) if path.is_file()), None)


_INCLUDE = re.compile(r"""^\s*include\s+['"]([^'"]+)['"]""", re.MULTILINE)


def _shadowed_project_file(path: pathlib.Path) -> pathlib.Path | None:
  """The project config that `path`, under the working directory, hides by its relative name
  (None for none)."""
  resolved = path.resolve()
  try:
    relative = resolved.relative_to(pathlib.Path.cwd().resolve())
  except ValueError:
    return None
  project = next((root / relative for root in project_roots() if (root / relative).is_file()),
                 None)
  return project if project is not None and project.resolve() != resolved else None


def warn_shadowing(files: Sequence[str], search_paths: Sequence[str]) -> None:
  """Logs each gin file (or include) read from the working directory in place of the project
  config of the same name, with its absolute path."""
  todo, seen = list(files), set()
  while todo:
    name = todo.pop()
    path = find_gin_file(name, search_paths)
    if path is None or path.resolve() in seen:
      continue
    seen.add(path.resolve())
    hidden = _shadowed_project_file(path)
    if hidden is not None:
      logger.warning("gin file %r is read from %s, which shadows the project's %s", name,
                     path.resolve(), hidden)
    with contextlib.suppress(OSError):
      todo.extend(_INCLUDE.findall(path.read_text(encoding="utf-8", errors="replace")))


def display_path(path: str) -> str:
  """`path` relative to the working directory or the project root where it is inside one;
  absolute where a file of the working directory shadows the project's of the same name."""
  resolved = pathlib.Path(path).resolve()
  if _shadowed_project_file(pathlib.Path(path)) is not None:
    return str(resolved)
  root = next((root for root in (pathlib.Path.cwd(), *reversed(project_roots()))
               if resolved.is_relative_to(root)), None)
  return str(resolved.relative_to(root)) if root is not None else path


MACRO = "gin.macro"


def macro_name(statement: config_parser.BindingStatement) -> str:
  return f"{statement.scope}/{statement.selector}" if statement.scope else statement.selector


def file_statements(name: str, search_paths: Sequence[str] | None = None, depth: int = 0
                    ) -> Iterator[tuple[config_parser.BindingStatement, str]]:
  """The binding statements of gin file `name` and (in place) of its includes, with their file,
  references and macros kept as written (`%NAME`, `@name()`; nothing imported or bound). Files
  are found in `search_paths`, by default in gin's (`_SEARCH_PATHS`: where gin found them)."""
  found = find_gin_file(name, _SEARCH_PATHS if search_paths is None else search_paths)
  if found is None or depth > 64:  # Never loop (gin refuses a cycle of includes).
    return
  path = str(found)
  with open(path, encoding="utf-8") as f:
    for statement in config_parser.ConfigParser(f, Unresolved()):
      if isinstance(statement, config_parser.IncludeStatement):
        yield from file_statements(statement.filename, search_paths, depth + 1)
      elif isinstance(statement, config_parser.BindingStatement):
        yield statement, path


def _is_relative_path(value: object) -> bool:
  """Whether `value` reads as a relative path with a folder part ('data/x.jsonl'); a bare
  word ('adamw', 'demo') is a name, not a path, and a URL ('gs://...') is not local."""
  return (isinstance(value, str) and "/" in value.replace(os.sep, "/") and "://" not in value
          and not os.path.isabs(value) and not value.startswith("~"))


def resolve_relative_paths(files: Sequence[str]) -> None:
  """Rebinds relative paths written in gin `files` (and includes) that name nothing in the
  working directory (each logged). Call after parsing (`parse_gin` does).

  Shipped configs write paths relative to the project root (`TRAIN_PATH =
  'jaxmoral/data/demo/dialogues_train.jsonl'`). A file's string value with a folder part that
  does not exist from the working directory is looked up next to the gin file binding it,
  then in the project root; the first that exists is bound instead (absolute). A path that
  exists nowhere (an output) and a value the command line overrode are left alone.
  """
  last: dict[tuple[str, str, str], tuple[Any, str]] = {}
  for name in files:
    for statement, path in file_statements(name):  # As `gin.bind_parameter` keys them:
      key = ((statement.scope, statement.selector, statement.arg_name) if statement.arg_name
             else (macro_name(statement), MACRO, "value"))  # a macro binds gin.macro.value.
      last[key] = (statement.value, path)
  for key, (value, path) in last.items():
    if not _is_relative_path(value) or os.path.exists(value):
      continue
    try:
      parsed = gin.config.ParsedBindingKey.parse(key)
    except ValueError:  # Not a binding gin kept (it parsed every file already): leave it.
      continue
    scope, selector = parsed.config_key
    if query(f"{scope + '/' if scope else ''}{selector}.{parsed.arg_name}") != value:
      continue  # Another file or the command line bound something else since.
    for base in dict.fromkeys((pathlib.Path(path).resolve().parent, PROJECT_ROOT)):
      candidate = base / value
      if candidate.exists():
        gin.bind_parameter(key, str(candidate))
        shown = key[0] if key[1] == MACRO else f"{key[1]}.{key[2]}"
        logger.info("gin: %s = %r (%s) is %s", shown, value, display_path(path), candidate)
        break


def query(binding: str) -> Any:
  """The value bound to `binding` ('scope/selector.param'), references unresolved; None when
  nothing binds it."""
  try:
    return gin.query_parameter(binding)
  except ValueError:
    return None


def macro_value(name: str) -> Any:
  """The value macro `name` (scoped: 'scope/NAME') is bound to, as `query`."""
  return query(f"{name}/{MACRO}.value")


def find_configurable(selector: str) -> Any:
  """The registered configurable `selector` names (in full or in part); None if it names
  none or more than one."""
  try:
    return gin.get_configurable(selector)
  except (KeyError, ValueError):
    return None


class _Written:
  """A reference or macro in a parsed value, kept as written (`@name()`, `%NAME`)."""

  def __init__(self, text: str) -> None:
    self.text = text

  def __repr__(self) -> str:
    return self.text


class Unresolved(config_parser.ParserDelegate):
  """Reads gin statements with references and macros kept as written (nothing imported)."""

  def configurable_reference(self, scoped_configurable_name: str, evaluate: bool) -> _Written:
    return _Written(f"@{_complete(scoped_configurable_name)}{'()' if evaluate else ''}")

  def macro(self, macro_name: str) -> _Written:
    return _Written(f"%{macro_name}")


def _complete(selector: str) -> str:
  """`selector` (its scope kept) by the Python path of the configurable it resolves to
  ('runs.train_run' -> 'jaxmoral.runs.train_run'); else as written (ambiguous, not imported)."""
  scope, _, name = selector.rpartition("/")
  configurable = find_configurable(name)
  complete = (f"{configurable.__module__}.{configurable.__qualname__}" if configurable
              is not None else name)
  return f"{scope}/{complete}" if scope else complete


def written_references(value: Any) -> Iterator[str]:
  """The references and macros (`%NAME`, `@name()`) in a value parsed with `Unresolved`,
  containers' too (a dict's keys, then values)."""
  if isinstance(value, _Written):
    yield value.text
  elif isinstance(value, (dict, list, tuple, set)):
    for item in (*value.keys(), *value.values()) if isinstance(value, dict) else value:
      yield from written_references(item)


def config_bindings(text: str) -> dict[str, str]:
  """`{binding: value}` of a gin config text (a config.gin, `gin.config_str()`) by gin's own
  parser: layout and comments do not matter, selectors are completed (gin prints one
  minimally or in full depending on what is imported), references kept as written. A text
  that is not gin raises a ValueError with the parser's message."""
  bindings = {}
  try:
    for statement in config_parser.ConfigParser(text, Unresolved()):
      if not isinstance(statement, config_parser.BindingStatement):
        continue  # import / include statements bind nothing.
      name = macro_name(statement)  # scope/selector; a macro's name when no arg_name.
      if statement.arg_name:
        name = f"{_complete(name)}.{statement.arg_name}"
      bindings[name] = repr(statement.value)
  except (SyntaxError, tokenize.TokenError) as error:
    raise ValueError(f"not a gin config: {error}") from error
  return bindings


def binding_changes(before: str, after: str) -> list[str]:
  """The bindings that differ between two gin config texts, sorted: "- binding = value" as
  `before` has it, "+ binding = value" as `after` has it."""
  old, new = config_bindings(before), config_bindings(after)
  changes = []
  for name in sorted(old.keys() | new.keys()):
    if old.get(name) != new.get(name):
      changes += [f"- {name} = {old[name]}"] if name in old else []
      changes += [f"+ {name} = {new[name]}"] if name in new else []
  return changes
