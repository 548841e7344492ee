"""Help text of gin-bound functions, read from their source so `--help` never waits for JAX:
an action's flags from its signature and docstring (`function_usage`), a gin-only command's
macros from its config's text (`gin_command_usage`).
"""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import re
import textwrap
from typing import Any, Optional, Sequence

from jaxmoral import gin_files


def _docstring_args(doc: str) -> dict[str, str]:
  """`{name: description}` of a Google-style docstring's Args section."""
  described: dict[str, str] = {}
  lines = iter(doc.splitlines())
  for line in lines:
    if line.strip() in ("Args:", "Arguments:"):
      break
  base, name = None, None
  for line in lines:
    if not line.strip():
      continue
    indent = len(line) - len(line.lstrip())
    if indent == 0:  # The next section (Returns:, Raises:).
      break
    match = re.match(r"(\*{0,2}\w+)(?: \([^)]*\))?:\s*(.*)", line.strip())
    if match and (base is None or indent == base):
      base, name = indent, match.group(1)
      described[name] = match.group(2)
    elif name is not None:
      described[name] += " " + line.strip()
  return described


# Parameters no --NAME=VALUE flag can give (a function or a stream: tests and notebooks).
_NOT_FLAG_TYPES = re.compile(r"\b(Callable|TextIO|IO)\b")
# Parameters that another command sets, never a user (nor gin: the entry points denylist them):
# `jaxmoral compile` calls a run's entry point in its compile-only mode, which returns the
# programs instead of training.
NOT_FLAGS = ("compile_only",)


def function_usage(module: str, function: str, *, prog: str) -> str:
  """The usage of a gin-bound function whose `--NAME=VALUE` flags bind its parameters, read
  from `module`'s source (signature and Google-style docstring), not imported: the usage line
  of command `prog` ("jaxmoral diamante chat"), the summary, and each flag with its type,
  default and description."""
  spec = importlib.util.find_spec(module)
  if spec is None or not spec.origin:
    raise ValueError(f"no module {module!r}")
  tree = ast.parse(pathlib.Path(spec.origin).read_text(encoding="utf-8"))
  node = next((n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
               and n.name == function), None)
  if node is None:
    raise ValueError(f"{module} has no function {function!r}")
  doc = ast.get_docstring(node) or ""
  described = _docstring_args(doc)
  args = node.args
  positional = args.posonlyargs + args.args
  defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
  params = (list(zip(positional, defaults, strict=True))
            + list(zip(args.kwonlyargs, args.kw_defaults, strict=True)))
  width = 78
  text = [f"usage: {prog} [--NAME=VALUE ...] [gin flags]", ""]
  summary = doc.split("\n\n")[0].strip()
  if summary:
    text += [textwrap.fill(" ".join(summary.split()), width), ""]
  text.append(textwrap.fill(f"flags (--NAME=VALUE binds {module}.{function}.NAME, a bare word "
                            "as a string; gin files and --gin.NAME=VALUE work as for every "
                            "command):", width))
  for arg, default in params:
    annotation = ast.unparse(arg.annotation) if arg.annotation else ""
    if arg.arg == "self" or arg.arg in NOT_FLAGS or _NOT_FLAG_TYPES.search(annotation):
      continue
    state = "required" if default is None else f"default {ast.unparse(default)}"
    text.append(f"  --{arg.arg}=VALUE  ({annotation + '; ' if annotation else ''}{state})")
    if described.get(arg.arg):
      text.append(textwrap.fill(described[arg.arg], width, initial_indent=" " * 6,
                                subsequent_indent=" " * 6))
  return "\n".join(text)


def _last_name(selector: str) -> str:
  """`runs.train_run` and `jaxmoral.runs.train_run` (and a scoped `s/runs.train_run`) ->
  `train_run`: a configurable as any file may write it."""
  return selector.rsplit("/", 1)[-1].rsplit(".", 1)[-1]


def macros_read(function: str, files: Sequence[str],
                search_paths: Sequence[str]) -> list[tuple[str, Optional[str]]]:
  """`(NAME, value as written or None if no file defines it)` of the macros the bindings of
  configurable `function` in gin `files` read, directly or through a configurable or macro
  they refer to, in the order first read; nothing imported."""
  bindings: dict[str, list[Any]] = {}
  macros: dict[str, Any] = {}
  for statement, _ in (s for name in files
                       for s in gin_files.file_statements(name, search_paths)):
    if statement.arg_name:
      bindings.setdefault(_last_name(statement.selector), []).append(statement.value)
    else:
      macros[gin_files.macro_name(statement)] = statement.value
  read: dict[str, None] = {}
  visited: set[str] = set()

  def visit(value: Any) -> None:
    for text in gin_files.written_references(value):
      if text.startswith("%") and not text.startswith("%gin.") and text[1:] not in read:
        read[text[1:]] = None
        visit(macros.get(text[1:]))
      elif text.startswith("@") and (
          selector := _last_name(text[1:].removesuffix("()"))) not in visited:
        visited.add(selector)
        for item in bindings.get(selector, ()):
          visit(item)

  visited.add(_last_name(function))
  for item in bindings.get(_last_name(function), ()):
    visit(item)
  return [(name, repr(macros[name]) if name in macros else None) for name in read]


def _columns(rows: Sequence[tuple[str, str]], width: int) -> list[str]:
  """`name  text` rows, each text wrapped in one column after the longest name."""
  indent = max((len(name) for name, _ in rows), default=0) + 2
  return [textwrap.fill(text, width, initial_indent=f"  {name:<{indent}}",
                        subsequent_indent=" " * (indent + 2)) for name, text in rows]


def gin_command_usage(*, prog: str, description: str, function: str, files: Sequence[str],
                      default_files: Sequence[str], search_paths: Sequence[str],
                      flags: Sequence[tuple[str, str]], example: str) -> str:
  """The `--help` of a command whose work is one gin-configured function (`jaxmoral train`):
  usage, description, the macros the config reads with their values, the flags, an example.

  Args:
    function: The configurable it calls, e.g. "runs.train_run".
    files: The gin files given on the command line, whose macros are listed; when none, those
      of `default_files` (the run fragment the configs include).
    search_paths: Where gin files are found, as `parse_gin` looks.
  """
  width = 100
  listed = list(files) or list(default_files)
  macros = macros_read(function, listed, search_paths)
  text = [f"usage: {prog} --gin_file=FILE [--gin_file=FILE ...] [--gin.NAME=VALUE ...] "
          f"[flags]", "", textwrap.fill(" ".join(description.split()), width), ""]
  where = ", ".join(listed) + ("" if files else
                               ", which the configs include; with --gin_file=F, F's")
  text.append(textwrap.fill(f"macros {function} reads ({where}); set any with "
                            f"--gin.NAME=VALUE:", width))
  text += _columns([(name, "required" if value == "%gin.REQUIRED" else
                     "set by an included model, optimizer or partitioning fragment"
                     if value is None else value) for name, value in macros], width)
  text += ["", "flags (anywhere on the line):", *_columns(flags, width), "", "example:",
           " \\\n".join(textwrap.wrap(example, width - 2, initial_indent="  ",  # Room for " \\".
                                    subsequent_indent="    ", break_long_words=False,
                                    break_on_hyphens=False))]
  return "\n".join(text)
