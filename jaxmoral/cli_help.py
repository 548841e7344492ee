"""Help text of gin-bound functions, read from their source so `--help` never waits for JAX.

A command whose `--NAME=VALUE` flags bind a function's parameters shows that function's
signature and Google-style docstring (`function_usage`), as `jaxmoral <method> <action>
--help` does. A command configured by gin files only (`jaxmoral train`) lists the macros its
config reads, with their values (`gin_command_usage`).
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


def function_usage(module: str, function: str, *, prog: str, gin_only: bool = False) -> str:
  """The usage of a gin-bound function whose `--NAME=VALUE` flags bind its parameters.

  Read from the module's source (its signature and Google-style docstring), not by importing
  it: `jaxmoral <method> <action> --help` must not wait for JAX.

  Args:
    module: The function's module, e.g. "jaxmoral.diamante.chat".
    function: The function's name in it.
    prog: The command line shown, e.g. "jaxmoral diamante chat".
    gin_only: The command takes gin flags only: parameters are shown as
      `--gin.<function>.NAME=VALUE`.

  Returns:
    Text for the terminal: usage line, summary, and each flag with its type, default and
    description.
  """
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
  short = f"{module.rsplit('.', 1)[-1]}.{function}"
  flag = f"--gin.{short}." if gin_only else "--"
  text = [f"usage: {prog} {'--gin_file=F ' if gin_only else ''}[{flag}NAME=VALUE ...] "
          f"[gin flags]", ""]
  summary = doc.split("\n\n")[0].strip()
  if summary:
    text += [textwrap.fill(" ".join(summary.split()), width), ""]
  if gin_only:
    intro = (f"parameters (bound in a gin file or by {flag}NAME=VALUE; other gin flags work "
             f"as for every command):")
  else:
    intro = (f"flags (--NAME=VALUE binds {module}.{function}.NAME, a bare word as a string; "
             f"gin files and --gin.NAME=VALUE work as for every command):")
  text.append(textwrap.fill(intro, width))
  for arg, default in params:
    annotation = ast.unparse(arg.annotation) if arg.annotation else ""
    if arg.arg == "self" or arg.arg in NOT_FLAGS or _NOT_FLAG_TYPES.search(annotation):
      continue
    state = "required" if default is None else f"default {ast.unparse(default)}"
    head = f"  {flag}{arg.arg}=VALUE  ({annotation + '; ' if annotation else ''}{state})"
    text.append(head)
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
  """The macros the bindings of configurable `function` read in gin `files`, directly or
  through a configurable or macro they refer to, in the order first read: `(NAME, value as
  written)`, the value None where none of the files defines the macro.

  Read from the files' text (`gin_files.written_statements`), nothing imported: for `--help`.
  """
  bindings: dict[str, list[Any]] = {}
  macros: dict[str, Any] = {}
  for statement in (s for name in files
                    for s in gin_files.written_statements(name, search_paths)):
    if statement.arg_name:
      bindings.setdefault(_last_name(statement.selector), []).append(statement.value)
    else:
      macros[gin_files.macro_name(statement)] = statement.value
  read: dict[str, None] = {}
  visited: set[str] = set()

  def visit(value: Any) -> None:
    for text in gin_files.written_references(value):
      if text.startswith("%") and not text.startswith("%gin."):
        if text[1:] not in read:
          read[text[1:]] = None
          visit(macros.get(text[1:]))
      elif text.startswith("@"):
        selector = _last_name(text[1:].removesuffix("()"))
        if selector not in visited:
          visited.add(selector)
          for item in bindings.get(selector, ()):
            visit(item)

  visited.add(_last_name(function))
  for item in bindings.get(_last_name(function), ()):
    visit(item)
  return [(name, repr(macros[name]) if name in macros else None) for name in read]


def gin_command_usage(*, prog: str, description: str, function: str, files: Sequence[str],
                      default_files: Sequence[str], search_paths: Sequence[str],
                      flags: Sequence[tuple[str, str]], example: str) -> str:
  """The `--help` of a command whose work is one gin-configured function (`jaxmoral train`).

  Args:
    prog: The command line shown, e.g. "jaxmoral train".
    description: What the command does.
    function: The configurable it calls, e.g. "runs.train_run".
    files: The gin files given on the command line (their macros are listed), or none.
    default_files: What is listed when `files` is empty (the run fragment the configs
      include).
    search_paths: Where gin files are found, as `parse_gin` looks.
    flags: `(flag, what it does)` of the flags every such command takes.
    example: A command line that runs.

  Returns:
    Text for the terminal: usage, description, the macros the config reads with their values,
    the common flags, the example.
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
  name_width = max((len(name) for name, _ in macros), default=0) + 2
  for name, value in macros:
    shown = ("required" if value == "%gin.REQUIRED" else
             "set by an included model, optimizer or partitioning fragment"
             if value is None else value)
    text.append(textwrap.fill(shown, width, initial_indent=f"  {name:<{name_width}}",
                              subsequent_indent=" " * (name_width + 2)))
  text += ["", "flags (anywhere on the line):"]
  flag_width = max(len(flag) for flag, _ in flags) + 2
  for flag, what in flags:
    text.append(textwrap.fill(what, width, initial_indent=f"  {flag:<{flag_width}}",
                              subsequent_indent=" " * (flag_width + 2)))
  text += ["", "example:"]
  line = " "
  for word in example.split(" "):
    if len(line) + len(word) + 3 > width:
      text.append(line + " \\")
      line = "   "
    line += " " + word
  text.append(line)
  return "\n".join(text)
