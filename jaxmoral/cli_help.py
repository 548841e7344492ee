"""Help text of gin-bound functions, read from their source so `--help` never waits for JAX.

A command whose `--NAME=VALUE` flags bind a function's parameters shows that function's
signature and Google-style docstring (`function_usage`), as `jaxmoral <method> <action>
--help` does.
"""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import re
import textwrap


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
