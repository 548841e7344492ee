"""What a parsed gin config must satisfy, and gin's errors as one line.

Everything bound must be readable: a misspelt `--gin.TRAIN_STEP=5` would otherwise be a new
macro, silently ignored. So unreferenced macros, unentered scopes and unbound `%gin.REQUIRED`
values are errors, as are gin's parse errors, each one line naming the flag or the file and
line, and close valid names.
"""

from __future__ import annotations

import difflib
import inspect
import io
import os
import re
import sys
import tokenize
from typing import Any, Collection, Iterable, Iterator, Sequence

import gin
from gin import config_parser

from jaxmoral import gin_files


def import_error(error: ImportError) -> ValueError:
  """One line for a gin `import` that fails: the file and line, and the module."""
  text = str(error)
  match = re.search(r'In file "([^"]+)", line (\d+)', text)
  where = f"{gin_files.display_path(match.group(1))}:{match.group(2)}: " if match else "gin: "
  first = text.splitlines()[0].strip('"') if text else repr(error)
  return ValueError(f"{where}import failed: {first} "
                    "(install the module, or fix the name in the gin file)")


def syntax_error(error: SyntaxError | tokenize.TokenError, files: Sequence[str],
                  search_paths: Sequence[str], bindings: Sequence[str],
                  flags: Sequence[str | None] = ()) -> ValueError:
  """A ValueError naming the gin file and line, or the binding (its flag if `flags` gives
  one, in the order of `bindings`), that does not parse."""
  flag_of = {binding: flag for binding, flag in zip(bindings, flags, strict=False) if flag}

  def shown(binding: str) -> str:
    return f"binding {binding!r}" + (f" ({flag_of[binding]})" if binding in flag_of else "")
  if isinstance(error, SyntaxError):
    where = (f"{gin_files.display_path(error.filename)}, line {error.lineno}"
             if error.filename else shown((error.text or "").strip()))
    return ValueError(f"gin: cannot parse {where}: {error.msg}")
  # An unclosed bracket or string: gin's tokenizer names no file, so find the culprit.
  paths = [gin_files.find_gin_file(name, search_paths) for name in files]
  sources = [(gin_files.display_path(str(path)), path.read_text()) for path in paths
             if path is not None]
  sources += [(shown(binding), binding) for binding in bindings]
  for where, text in sources:
    try:
      list(tokenize.generate_tokens(io.StringIO(text).readline))
    except tokenize.TokenError:
      return ValueError(f"gin: cannot parse {where}: {error.args[0]} (an unclosed bracket "
                        f"or string)")
  return ValueError(f"gin: cannot parse an included file: {error.args[0]}")


class BindingSources:
  """Says where a binding came from: a command-line flag, or a gin file and line."""

  def __init__(self, files: Sequence[str], bindings: Sequence[str],
               binding_flags: Sequence[str | None]) -> None:
    self.files = tuple(files)
    self.bindings = tuple(bindings)
    # Bindings without a flag (a command's own flags' bindings) are named as written.
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
      for statement, path in gin_files.file_statements(name):
        yield (statement, f"{gin_files.display_path(path)}, line {statement.location.line_num}",
               False)
    for binding, flag in zip(self.bindings, self.flags, strict=False):
      for statement in config_parser.ConfigParser(binding, gin_files.Unresolved()):
        if isinstance(statement, config_parser.BindingStatement):
          yield statement, flag or f"binding {binding!r}", True

  def macro_definitions(self) -> dict[str, tuple[str, bool]]:
    """Where each macro is last defined, and whether that is on the command line."""
    return {gin_files.macro_name(statement): (where, on_command_line)
            for statement, where, on_command_line in self.statements()
            if not statement.arg_name}

  def binding(self, scope: str, selector: str, param: str) -> str | None:
    """Where `scope/selector.param` is last bound (selectors in full or in part)."""
    return next((where for statement, where, _ in reversed(list(self.statements()))
                 if statement.arg_name == param and statement.scope == scope
                 and _same_configurable(statement.selector, selector)), None)


def _same_configurable(one: str, other: str) -> bool:
  """Whether two selectors, each in full or in part, name the same configurable."""
  if f".{one}".endswith(f".{other}") or f".{other}".endswith(f".{one}"):
    return True
  configurable = gin_files.find_configurable(one)
  return configurable is not None and configurable is gin_files.find_configurable(other)


# Every binding gin holds: {(scope, selector): {parameter: value}}; a macro NAME (or
# scope/NAME) is (NAME, "gin.macro") with parameter "value".
_Config = dict[tuple[str, str], dict[str, Any]]


def _config() -> _Config:
  """Every binding gin holds, selectors minimal, references as written: gin's printout
  (`gin.config_str`) read back by its parser, since gin's public API lists them only so."""
  config: _Config = {}
  for statement in config_parser.ConfigParser(gin.config_str(), gin_files.Unresolved()):
    if isinstance(statement, config_parser.BindingStatement):
      if statement.arg_name:
        key, param = (statement.scope, statement.selector), statement.arg_name
      else:
        key, param = (gin_files.macro_name(statement), gin_files.MACRO), "value"
      config.setdefault(key, {})[param] = statement.value
  return config


def _references(config: _Config) -> Iterator[tuple[tuple[str, str], str]]:
  """Every reference in the config as written (`@scope/name()`, `%MACRO`), with its key."""
  return ((key, text) for key, params in config.items() for value in params.values()
          for text in gin_files.written_references(value))


def unreferenced_macros(config: _Config | None = None) -> list[str]:
  """Macros of the parsed config (or `config`) that no binding and no other macro refers to
  (`%NAME`), wherever the references are (containers, scoped bindings, called functions')."""
  config = _config() if config is None else config
  referenced: set[str] = set()
  for (scope, selector), text in _references(config):
    if text.startswith("%") and not (selector == gin_files.MACRO and scope == text[1:]):
      # `%X` evaluated in scope s also reads a macro bound as `s/X`: count the bare name too.
      referenced.update((text[1:], text[1:].rsplit("/", 1)[-1]))
  return sorted(scope for scope, selector in config
                if selector == gin_files.MACRO and scope not in referenced
                and scope.rsplit("/", 1)[-1] not in referenced)


def _is_export(name: str) -> bool:
  """Whether macro `name` just names an object built by a configurable (`@fn()`): fragments
  export MODEL_CONFIG, OPTIMIZER, PARTITIONER for includers, which may build it from the
  configurable's own bindings instead (`jaxmoral compile`), checked on their own."""
  value = gin_files.macro_value(name)
  return (isinstance(value, gin.config.ConfigurableReference)
          and value.configurable.selector not in (gin_files.MACRO, "gin.constant"))


def _entered_scopes(config: _Config) -> set[str]:
  return {part for _, text in _references(config) if text.startswith("@")
          for part in text[1:].split("/")[:-1]}


def _unentered_scopes(config: _Config) -> list[tuple[str, str, str, str]]:
  """(scope part, scope, selector, parameter) of scoped bindings whose scope no reference
  (`@scope/fn()`) enters: jaxmoral enters no scope in code, so they are never read."""
  entered = _entered_scopes(config)
  unread = []
  for (scope, selector), params in config.items():
    if selector == gin_files.MACRO or not scope:
      continue
    missing = [part for part in scope.split("/") if part not in entered]
    unread += [(missing[0], scope, selector, param) for param in params if missing]
  return unread


def _parameters(selector: str) -> list[str]:
  """The keyword parameters of a registered configurable (empty if it has no signature)."""
  try:
    signature = inspect.signature(gin_files.find_configurable(selector))
  except (TypeError, ValueError):
    return []
  return [name for name, param in signature.parameters.items()
          if param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY)]


def _registered_selectors() -> list[str]:
  """The selectors, in full and in part, of the configurables in jaxmoral's imported modules
  and those under the project root or the working directory (for close-name suggestions):
  gin lists none publicly, so each module attribute gin knows is named by each dotted suffix
  of its module path that gin resolves to it."""
  selectors = []
  roots = tuple(f"{root}{os.sep}" for root in (gin_files.PROJECT_ROOT, os.getcwd()))
  for module in list(sys.modules.values()):
    name = getattr(module, "__name__", None)  # sys.modules may hold None (a blocked import).
    path = str(getattr(module, "__file__", None) or "")
    if not isinstance(name, str) or not (name.split(".")[0] == "jaxmoral"
                                         or path.startswith(roots)):
      continue
    for attribute, value in list(getattr(module, "__dict__", {}).items()):
      try:
        # Where defined or imported: gin's name may be another module's (`runs.Seq2SeqData`).
        if not callable(value):
          continue
        configurable = gin.get_configurable(value)
      except Exception:  # pylint: disable=broad-except
        # Any object a module holds is asked (a proxy, a mock may raise anything): a hint
        # must never turn the one-line error it adds to into a traceback.
        continue
      parts = name.split(".")
      for candidate in dict.fromkeys(
          [attribute] + [f"{'.'.join(parts[i:])}.{attribute}" for i in range(len(parts))]
          + [f"{part}.{attribute}" for part in parts]):
        if gin_files.find_configurable(candidate) is configurable:
          selectors.append(candidate)
  return selectors


def _close(name: str, candidates: Iterable[str], *, last_part: bool = False) -> list[str]:
  """Candidates close to `name` (case ignored), compared whole or by their last dotted part."""
  by_key: dict[str, list[str]] = {}
  for candidate in dict.fromkeys(candidates):
    last = candidate.rsplit(".", 1)[-1] if last_part else candidate
    for key in {candidate.lower(), last.lower()}:
      by_key.setdefault(key, []).append(candidate)
  matches = difflib.get_close_matches(name.lower(), list(by_key), n=3, cutoff=0.7)
  return list(dict.fromkeys(c for match in matches for c in by_key[match]))[:4]


def _suggest(names: Sequence[str]) -> str:
  return f"; close valid names: {', '.join(names)}" if names else ""


def read_macros() -> set[str]:
  """The macros of the parsed config that a binding or another macro refers to."""
  config = _config()
  unread = set(unreferenced_macros(config))
  return {scope for scope, selector in config
          if selector == gin_files.MACRO and scope not in unread}


def check_everything_is_read(sources: BindingSources, *,
                             read_before_flags: Collection[str] = ()) -> None:
  """Raises a ValueError, one line naming each, where it is set and close names, if the
  parsed config defines a macro or scope that nothing can read (most often a misspelling on
  the command line); a gin file, not the command line, may leave an export unread (`_is_export`).

  Args:
    sources: Where the parsed files and bindings came from (to name them).
    read_before_flags: Macros read before a command's own flags overrode bindings
      (`parse_gin`'s `extra_bindings`): one of them defined in a file is no error.
  """
  config = _config()
  problems = []
  unread = unreferenced_macros(config)
  if unread:
    where = sources.macro_definitions()
    macros = sorted({text[1:] for _, text in _references(config) if text.startswith("%")} | {
        scope for scope, selector in config if selector == gin_files.MACRO})
    params = [f"{selector}.{param}" for scope, selector in config
              if selector != gin_files.MACRO for param in _parameters(selector)]
    for name in unread:
      place, on_command_line = where.get(name, (None, False))
      if not on_command_line and (_is_export(name) or name in read_before_flags):
        continue
      close = _close(name, [m for m in macros if m != name] + params, last_part=True)
      problems.append(f"macro {name}{f' ({place})' if place else ''} is never read: no "
                      f"binding or macro refers to %{name}{_suggest(close)}")
  scopes = sorted(_entered_scopes(config))
  for part, scope, selector, param in _unentered_scopes(config):
    place = sources.binding(scope, selector, param)
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


def binding_error(error: ValueError | KeyError, sources: BindingSources) -> ValueError:
  """gin's error for a binding it cannot make, as one line naming the flag or file and line."""
  text = str(error)
  location = _GIN_LOCATION.search(text)
  message = text[:location.start()] if location else text.split("\n", 1)[0]
  if isinstance(error, KeyError):  # str() of a KeyError is the repr of its message.
    message = message.strip("'\"")
  where = ""
  if location and location.group("file"):
    where = f" ({gin_files.display_path(location.group('file'))}, line {location.group('line')})"
  elif location:
    where = f" ({sources.of_binding_line(int(location.group('line')))})"
  unknown_param = _UNKNOWN_PARAMETER.match(message)
  unknown = _UNKNOWN_CONFIGURABLE.match(message)
  if unknown_param:
    selector, param = unknown_param.group("selector", "param")
    close = [f"{selector}.{name}" for name in _close(param, _parameters(selector))]
    return ValueError(f"gin: {selector} has no parameter {param!r}{where}{_suggest(close)}")
  if unknown:
    selector = unknown.group("selector")
    depth = selector.count(".") + 1
    # Compared with the registered names cut to as many dotted parts as the one given.
    suffixes = [".".join(registered.split(".")[-depth:])
                for registered in _registered_selectors() if registered.count(".") >= depth - 1]
    return ValueError(f"gin: no configurable {selector!r} is registered (misspelt, or its "
                      f"module not imported){where}{_suggest(_close(selector, suffixes))}")
  return ValueError(f"gin: {' '.join(message.split())}{where}")


def unbound_required() -> list[str]:
  """Names of `%gin.REQUIRED` macros and parameters that nothing bound (gin 0.5 passes an
  unresolved REQUIRED on as a sentinel, so the CLI checks before calling anything)."""
  return [scope if selector == gin_files.MACRO else
          f"{scope + '/' if scope else ''}{selector}.{param}"
          for (scope, selector), params in _config().items() for param, value in params.items()
          # `%gin.REQUIRED` reads as a reference to the macro named "gin.REQUIRED".
          if value is gin.REQUIRED or repr(value) == "%gin.REQUIRED"]
