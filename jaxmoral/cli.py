"""`jaxmoral <command>`: a thin layer that parses flags and gin, then calls one library function.

Core commands (train, eval, infer, cache) take T5X's gin flags; method commands, `jaxmoral
<npov|diamante|clarify> <action> --NAME=VALUE ...`, bind one gin-configurable function each
(`jaxmoral.action_commands`). `--help` answers without importing JAX, TensorFlow or seqio.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import re
import sys
from typing import Any, Mapping, Optional, Sequence

from jaxmoral import compilation_cache
from jaxmoral import fileio
from jaxmoral import gin_utils
from jaxmoral import preemption
from jaxmoral import runtime

# Sub-commands whose work is a gin-configured library function: (module, function, help).
GIN_COMMANDS: dict[str, tuple[str, str, str]] = {
    "train": ("jaxmoral.runs", "train_run", "Train a model from a gin config (T5X style)."),
    "eval": ("jaxmoral.runs", "eval_run", "Evaluate the latest checkpoint of MODEL_DIR."),
    "infer": ("jaxmoral.runs", "infer_run", "Decode inputs with the latest checkpoint."),
    "cache": ("jaxmoral.runs", "cache_run",
              "Write a config's data into DATA_CACHE (then train there without TensorFlow)."),
}
# What a gin command's help adds to its description.
_GIN_COMMAND_NOTES = {
    "infer": "INFER_INPUT: plain text, one input a line, or JSONL (runs.infer_run.input_field "
             "names the key, default 'input'). INFER_OUTPUT: JSONL, one record {\"input\", "
             "\"predictions\", \"scores\"} per input line, in order; a blank input line gives a "
             "record with empty input and no predictions, so line N of the output always "
             "answers line N of the input. Inputs longer than runs.infer_run.input_length "
             "tokens (default 128, EOS included) are truncated; stderr says how many.",
}
# The run fragment every config of the gin commands includes: what their --help lists.
RUN_FRAGMENT = "gin/runs/seq2seq.gin"
# Each gin command's --help example, one of README.md's or docs/cli.md's (tests/test_docs.py).
_GIN_COMMAND_EXAMPLES = {
    "train": "jaxmoral train --gin_file=configs/core/tiny_cpu.gin --gin.MODEL_DIR=/tmp/tiny",
    "eval": "jaxmoral eval --gin_file=configs/core/tiny_cpu.gin --gin.MODEL_DIR=/tmp/tiny",
    "infer": "jaxmoral infer --gin_file=configs/core/tiny_cpu.gin --gin.MODEL_DIR=/tmp/tiny "
             "--gin.INFER_INPUT=examples/inputs.txt "
             "--gin.INFER_OUTPUT=/tmp/tiny/predictions.jsonl",
    "cache": "jaxmoral cache --gin_file=configs/core/tiny_cpu.gin "
             "--gin.DATA_CACHE=\"'/tmp/cache'\" --gin.MODEL_DIR=\"'/tmp/run'\"",
}
# Commands whose action's work lives in jaxmoral.<command>.commands.
METHOD_COMMANDS = ("npov", "diamante", "clarify")
HELP_FLAGS = ("-h", "--help")


TFDS_DATA_DIR_FLAG = "--tfds_data_dir"
DISTRIBUTED_FLAGS = {"--coordinator_address": "coordinator_address",
                     "--num_processes": "num_processes", "--process_count": "num_processes",
                     "--process_id": "process_id", "--process_index": "process_id"}
# Every flag taken from anywhere on the line (`split_flags`).
LINE_FLAGS = (compilation_cache.FLAG, TFDS_DATA_DIR_FLAG, *DISTRIBUTED_FLAGS)
# Commands that run in one process (no `jax.distributed.initialize`).
SINGLE_PROCESS_COMMANDS = ("compile", "vocab", "export", "explore")
# Commands configured by their own flags only: gin flags given to them (ignored) are an error.
NO_GIN_COMMANDS = ("export", "vocab", "demo", "explore")


def common_flags() -> list[tuple[str, str]]:
  """`(flag, what it does)` of the flags every gin command takes, for its --help."""
  return [
      ("--gin_file=F", "a gin file (repeatable; comma lists too), looked up in the "
                       "--gin_search_paths, the working folder, then the project's gin/ and "
                       "configs/ (a checkout's or the installed package's)"),
      ("--gin.NAME=VALUE", "binds a macro (--gin.TRAIN_STEPS=100) or a parameter "
                           "(--gin.runs.train_run.log_every=10); a bare word is a string"),
      ("--gin_bindings='NAME = VALUE'", "a binding as gin writes it (repeatable)"),
      ("--gin_search_paths=DIRS", "comma list of folders searched first for gin files and "
                                  "their includes"),
      (f"{compilation_cache.FLAG}=DIR|none", "where compiled programs are kept between runs "
                                             "(default ~/.cache/jaxmoral/xla); none: off"),
      (f"{TFDS_DATA_DIR_FLAG}=DIR", "where TFDS-backed seqio Tasks read their prepared data, "
                                    "a folder or gs:// URL (T5X's flag)"),
      ("--coordinator_address=HOST:PORT", "multi-host: with --num_processes=N --process_id=I "
                                          "(T5X's --process_count, --process_index too; or "
                                          "JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, "
                                          "JAX_PROCESS_ID; SLURM and TPU pods are detected)"),
  ]


def gin_command_help(command: str, gin_args: gin_utils.GinArgs) -> str:
  """`jaxmoral <gin command> --help` (`cli_help.gin_command_usage`)."""
  module, function, help_text = GIN_COMMANDS[command]
  from jaxmoral import cli_help  # pylint: disable=import-outside-toplevel
  return cli_help.gin_command_usage(
      prog=f"jaxmoral {command}",
      description=" ".join(filter(None, (help_text, _GIN_COMMAND_NOTES.get(command)))),
      function=f"{module.rsplit('.', 1)[-1]}.{function}", files=gin_args.files,
      default_files=(RUN_FRAGMENT,), search_paths=gin_utils.search_paths(gin_args),
      flags=common_flags(), example=_GIN_COMMAND_EXAMPLES[command])


def unknown_flag_message(args: Sequence[str], known: Sequence[str]) -> str:
  """One line for arguments no parser took, each flag with the closest known one
  ("--gin_flie=x: unknown flag; did you mean --gin_file?")."""
  import difflib  # pylint: disable=import-outside-toplevel
  parts = []
  for arg in args:
    flag = arg.split("=", 1)[0]
    close = difflib.get_close_matches(flag, known, n=1, cutoff=0.7) if flag.startswith("-") else []
    parts.append(f"{arg}: unknown {'flag' if flag.startswith('-') else 'argument'}"
                 + (f"; did you mean {close[0]}?" if close else ""))
  return "; ".join(parts)


def _known_flags(parser: argparse.ArgumentParser) -> list[str]:
  """Every flag a command takes: its own (read from its usage), gin's, the line flags."""
  own = re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", parser.format_usage())
  return list(dict.fromkeys([*own, "--gin_file", "--gin_bindings", "--gin_search_paths",
                             *LINE_FLAGS]))


class _Parser(argparse.ArgumentParser):
  """The command line's parser, with each command's own parser by name (for its errors)."""
  command_parsers: Mapping[str, argparse.ArgumentParser] = {}


def _original(error: BaseException) -> BaseException:
  """The exception gin wrapped: gin re-raises an error from inside a configurable as a proxy
  whose OSError fields (errno, strerror, filename) read None."""
  for _ in range(64):
    getattr_fn = type(error).__dict__.get("__getattr__")
    cells = getattr(getattr_fn, "__closure__", None) or ()
    inner = [c.cell_contents for c in cells if isinstance(c.cell_contents, BaseException)]
    if not inner:
      break
    error = inner[0]
  return error


def error_message(error: BaseException) -> str:
  """The one-paragraph message of an error a command reports: an OSError with a path reads
  `<strerror>: <path>` ("Read-only file system: /data/run"), however deep in gin calls."""
  original = _original(error)
  if isinstance(original, OSError) and original.strerror and original.filename is not None:
    message = f"{original.strerror}: {os.fsdecode(original.filename)}"
    if original.filename2 is not None:
      message += f" -> {os.fsdecode(original.filename2)}"
    return message
  # The message the library raised: gin's "In call to configurable ..." suffix would make a
  # user's one-line error two lines and name an internal function.
  return gin_utils.explain_gin_error(original)


def user_error_message(error: BaseException) -> Optional[str]:
  """The one-line message of a user's mistake, or None for a bug (which keeps its traceback):
  a ValueError, an OSError, a FloatingPointError (train's NonFiniteLossError: a setting,
  mostly), or a type error in a gin-bound call that jaxmoral's own operations did not raise."""
  if isinstance(error, (ValueError, OSError, FloatingPointError)):
    return error_message(error)
  if (isinstance(error, TypeError) and "In call to configurable" in str(error)
      and not _is_an_operation_in_jaxmoral(error)):
    return _configurable_error_message(error)
  return None


def _is_an_operation_in_jaxmoral(error: BaseException) -> bool:
  """True when an operation in jaxmoral's own code (`x in config`, a call with the wrong
  arguments), not a `raise` statement, raised `error`: a bug, however deep in a gin call."""
  import linecache  # pylint: disable=g-import-not-at-top
  tb = error.__traceback__
  if tb is None:
    return False
  while tb.tb_next is not None:
    tb = tb.tb_next
  filename = os.path.abspath(tb.tb_frame.f_code.co_filename)
  package = os.path.dirname(os.path.abspath(__file__)) + os.sep
  return (filename.startswith(package)
          and not linecache.getline(filename, tb.tb_lineno).lstrip().startswith("raise"))


def peer_failure_message(error: BaseException) -> Optional[str]:
  """One line for a collective that failed because another process of the job died (Gloo's
  "Connection closed by peer", "Task N heartbeat timeout"), naming it as far as the error
  does; None for any other error."""
  text = str(_original(error))
  task = re.search(r"Task (\d+) heartbeat timeout|tasks are unhealthy[^\n]*\n(\d+)", text)
  lost = re.search(r"Connection (?:closed|reset) by peer|Connection refused|Broken pipe", text)
  if task is None and lost is None:
    return None
  # Gloo names the peer's address: "... [127.0.0.1]:25514" (before or after the reason).
  address = re.search(r"\[([^\]]+)\]:(\d+)", text)
  who = (f"process {task.group(1) or task.group(2)}" if task else
         f"the process at {address.group(1)} (port {address.group(2)})" if address else
         "another process")
  return (f"{who} of this job stopped (crashed, killed or preempted), so this process stops "
          "too; see that process's log, then restart every process to resume from the last "
          "checkpoint")


def _configurable_error_message(error: TypeError) -> str:
  """A type error from a configurable: the library's message and, unless it starts with it,
  the configurable gin named (`in OPTIMIZER/make_schedule`)."""
  message = error_message(error)
  match = re.search(r"In call to configurable '([\w.]+)'.*?(?: in scope '([\w./]+)')?$",
                    str(error), re.MULTILINE)
  if match and not message.startswith(match.group(1)):
    name = f"{match.group(2)}/{match.group(1)}" if match.group(2) else match.group(1)
    message += f" (in {name})"
  return message


def quiet_logs(*, force: bool = False) -> None:
  """Start-up of a jaxmoral process (the command line, the experiments): INFO lines with the
  time, libraries' chatter at WARNING (the Hub's settings stay the user's).

  Args:
    force: Replace handlers that imports installed on the root logger (a script whose
      imports log before it starts); the command line leaves them (a test's capture).
  """
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s",
                      datefmt="%H:%M:%S", force=force)
  # The storage clients too: fsspec logs each file a bucket run opens at INFO.
  for noisy in ("absl", "jax._src", "orbax", "tensorflow", "etils", "fsspec", "google",
                "urllib3", "aiohttp"):
    logging.getLogger(noisy).setLevel(logging.WARNING)
  # google.auth's Compute Engine metadata probe warns on every try off Google Cloud (a
  # missing credential the command reports, `fileio.describe_storage_error`); gcsfs logs a
  # traceback for a request out of retries, then raises it (the command reports it).
  for name, level in (("google.auth.compute_engine._metadata", logging.ERROR),
                      ("google.auth._default", logging.ERROR), ("gcsfs", logging.CRITICAL)):
    logging.getLogger(name).setLevel(level)
  # gin logs every search-path miss (at ERROR) while resolving includes; those are not errors.
  for handler in logging.getLogger().handlers:
    handler.addFilter(
        lambda record: "gin" not in record.pathname.replace("\\", "/").split("/")[-2:-1])
    handler.addFilter(_not_disk_full_report)
  report_disk_full_once()


def _not_disk_full_report(record: logging.LogRecord) -> bool:
  """False for a checkpoint writer's report of a full disk: the command reports it itself, in
  one line naming the folder (`checkpoints.CheckpointManager`)."""
  if record.levelno < logging.ERROR or "jaxmoral" in record.name:
    return True
  error = record.exc_info[1] if record.exc_info else None
  return (fileio.disk_full_errno(RuntimeError(record.getMessage())) is None
          and (error is None or fileio.disk_full_errno(error) is None))


def report_disk_full_once() -> None:
  """A full disk while saving is reported once, by the command: the aborted save's other
  writers' "Event loop is closed" unraisables (dozens a save) and asyncio's reports of their
  unawaited full-disk tasks (logged when collected, even after the error line) are dropped."""
  previous = sys.unraisablehook
  if not getattr(previous, "drops_closed_loop_callbacks", False):

    def hook(unraisable: Any) -> None:
      error = unraisable.exc_value
      if not (isinstance(error, RuntimeError) and str(error) == "Event loop is closed"):
        previous(unraisable)

    hook.drops_closed_loop_callbacks = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook
  logging.getLogger("asyncio").addFilter(_not_disk_full_report)  # Added once, however called.


def split_flags(argv: Sequence[str], flags: Sequence[str]) -> tuple[dict[str, str], list[str]]:
  """Takes `--flag=VALUE` or `--flag VALUE` of the named flags out of argv, from anywhere
  (before argparse, so before or after any sub-command): `{flag: value}` of those given (the
  last one wins) and the rest of argv. A ValueError if a flag ends argv without a value."""
  values: dict[str, str] = {}
  rest: list[str] = []
  args = iter(argv)
  for arg in args:
    flag, sep, value = arg.partition("=")
    if flag in flags and sep:
      values[flag] = value
    elif arg in flags:
      given = next(args, None)
      if given is None:
        raise ValueError(f"{arg} needs a value")
      values[arg] = given
    else:
      rest.append(arg)
  return values, rest


def _distributed_arguments(flags: dict[str, str]) -> dict[str, Any]:
  """`initialize_distributed`'s keyword arguments from the distributed flags."""
  kwargs: dict[str, Any] = {}
  for flag, name in DISTRIBUTED_FLAGS.items():
    try:
      if flag in flags:
        kwargs[name] = flags[flag] if name == "coordinator_address" else int(flags[flag])
    except ValueError:
      raise ValueError(f"{flag} needs an integer, got {flags[flag]!r}") from None
  return kwargs


class _VersionAction(argparse.Action):
  """`--version`: `software.describe()`, looked up only when asked (it runs git)."""

  def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any):
    super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

  def __call__(self, parser, namespace, values, option_string=None):
    from jaxmoral import software  # pylint: disable=import-outside-toplevel
    print(software.describe())
    parser.exit()


def _parser() -> _Parser:
  parser = _Parser(
      prog="jaxmoral", description=__doc__.split("\n\n")[0],
      epilog=" ".join(f"{flag}: {text}." for flag, text in common_flags())
      + f" The gin flags are for every command but {', '.join(NO_GIN_COMMANDS)}; the others "
      "are taken from anywhere on the line.")
  parser.add_argument("--version", action=_VersionAction,
                      help="print jaxmoral's version and commit and the libraries' versions")
  sub = parser.add_subparsers(dest="command", required=True)
  parser.command_parsers = sub.choices
  for name, (_, _, help_text) in GIN_COMMANDS.items():
    sub.add_parser(name, help=help_text)  # Its --help is `gin_command_help`.

  export = sub.add_parser("export", help="Export a run (or any model directory) on its own.")
  export.add_argument("--model_dir", required=True,
                      help="a run, one step of it, or any model directory / Hub id")
  export.add_argument("--output", required=True)
  export.add_argument("--step", type=int, default=None)
  export.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                      help="cast the params (default: keep the run's float32)")
  export.add_argument("--format", default="jaxmoral", choices=["jaxmoral", "hf"],
                      help="jaxmoral (params/ + config.json + vocab/) or hf (model.safetensors "
                           "+ config.json + spiece.model, loads in transformers)")
  export.add_argument("--overwrite", action="store_true", help="replace an existing export")
  export.add_argument("--num_partitions", type=int, default=None,
                      help="read and write the parameters sharded over a model axis of this "
                           "many devices (the run's MODEL_PARALLEL; default: one device)")

  compile_ = sub.add_parser("compile", help="AOT-compile a config's train step for a topology.")
  compile_.add_argument("--topology", required=True,
                        help="e.g. v5e:8x8, v4:2x2x2, v5p:4x4x4 (libtpu needed), or cpu:8")
  compile_.add_argument("--report", default=None, help="Write the memory/FLOP report (JSON).")

  vocab = sub.add_parser("vocab", help="Train the demo SentencePiece vocabulary.")
  vocab.add_argument("--output_dir", required=True)

  demo = sub.add_parser("demo", help="Run every method end to end on bundled sample data.")
  demo.add_argument("--workdir", default="demo_out")
  demo.add_argument("--only", default=None, help="comma list: core,npov,diamante,clarify")

  explore = sub.add_parser(
      "explore", help="Browse results folders in a local web page (read-only).",
      description="Serves a read-only web page of what the folders hold (demo_out, runs, "
                  "experiment results, NPOV / ClarifyDelphi / Diamante outputs); with a model "
                  "folder among them, live-input boxes call the library.")
  explore.add_argument("dirs", nargs="+", metavar="DIR")
  explore.add_argument("--port", type=int, default=8765, help="default 8765")
  explore.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default: this machine only; any other "
                            "address requires the token printed in the URL)")
  explore.add_argument("--allowed_host", action="append", default=[], metavar="NAME",
                       help="a further host name the browser may use to reach it "
                            "(repeatable; the loopback names and --host always are)")

  for method in METHOD_COMMANDS:
    # The commands modules import action_commands and gin_utils only (their actions'
    # modules load when run).
    actions = list(importlib.import_module(f"jaxmoral.{method}.commands").ACTIONS)
    method_parser = sub.add_parser(
        method, help=f"{method} commands (see `jaxmoral {method} -h`).",
        epilog=f"`jaxmoral {method} ACTION --help` lists an action's flags: each --NAME=VALUE "
               f"binds an argument of the action's gin-configurable function.")
    method_parser.add_argument("action", help=f"one of: {', '.join(actions)}")
    method_parser.add_argument("rest", nargs=argparse.REMAINDER,
                               help="the action's --NAME=VALUE flags and gin flags")
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  """Runs one command; returns its exit status (2: a usage, configuration or file error, one
  line `jaxmoral <command>: error: ...` on stderr; 143 / 130: training stopped by SIGTERM /
  SIGINT after saving its step, `jaxmoral.preemption`; 130 also for Ctrl-C elsewhere).
  """
  # Before anything imports JAX (the commands below do).
  runtime.platforms_without_absent_tpu()
  runtime.configure()
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = _parser()
  try:
    flags, argv = split_flags(argv, LINE_FLAGS)
    distributed = _distributed_arguments(flags)
  except ValueError as error:
    parser.error(str(error))
  gin_args, rest = gin_utils.split_gin_args(argv)
  if rest and rest[0] in GIN_COMMANDS and any(arg in HELP_FLAGS for arg in rest[1:]):
    print(gin_command_help(rest[0], gin_args))
    return 0
  args, unknown = parser.parse_known_args(rest)
  if unknown:
    command_parser = parser.command_parsers.get(args.command, parser)
    command_parser.error(unknown_flag_message(unknown, _known_flags(command_parser)))
  if distributed and args.command in SINGLE_PROCESS_COMMANDS:
    parser.error(f"{args.command} runs in one process; "
                 f"{', '.join(DISTRIBUTED_FLAGS)} are for the other commands")
  if args.command in NO_GIN_COMMANDS and gin_args != gin_utils.GinArgs():
    parser.error(f"{args.command} takes no gin flags (--gin_file, --gin.NAME=VALUE, "
                 f"--gin_bindings, --gin_search_paths); see `jaxmoral {args.command} -h`")
  try:
    if args.command in METHOD_COMMANDS and any(arg in HELP_FLAGS for arg in args.rest):
      # An action's usage: before TensorFlow, JAX and the distributed runtime start.
      method = importlib.import_module(f"jaxmoral.{args.command}.commands")
      return int(method.main(args.action, args.rest, gin_args) or 0)
    return _run(args, gin_args, flags, distributed)
  except preemption.Stopped as stopped:  # SIGTERM / SIGINT while training: saved, no error.
    print(f"jaxmoral {args.command}: {error_message(stopped)}", file=sys.stderr)
    return stopped.exit_status
  except KeyboardInterrupt:  # Ctrl-C outside a training loop (which saves and stops instead).
    print(f"jaxmoral {args.command}: interrupted", file=sys.stderr)
    return 130
  except RuntimeError as error:
    message = peer_failure_message(error)
    if message is None:
      raise
    print(f"jaxmoral {args.command}: error: {message}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    # Not through exit handlers: JAX's distributed shutdown would wait for the dead process
    # and then abort with a C++ stack trace.
    os._exit(1)
  except (ValueError, OSError, TypeError, FloatingPointError) as error:
    message = user_error_message(error)
    if message is None:
      raise
    print(f"jaxmoral {args.command}: error: {message}", file=sys.stderr)
    if isinstance(error, TypeError) and gin_args.read_as_strings:
      print(f"  note: read as strings, not being Python literals: "
            f"{', '.join(gin_args.read_as_strings)}", file=sys.stderr)
    return 2


def _run(args: argparse.Namespace, gin_args: gin_utils.GinArgs, flags: dict[str, str],
         distributed: dict[str, Any]) -> int:
  """The work of `main` once the command line is parsed."""
  quiet_logs()
  if args.command == "explore":  # A web server: no TensorFlow start-up, no compilation cache.
    from jaxmoral.explore import server  # Imported when run: keeps --help fast.
    return server.serve(dirs=args.dirs, port=args.port, host=args.host,
                        allowed_hosts=args.allowed_host)
  runtime.own_gpus_for_jax()  # TensorFlow, if seqio is used, stays off the GPUs.
  # `compile` goes without: compile-only TPU executables cannot be loaded back.
  if args.command == "compile":
    compilation_cache.disable()
  else:
    compilation_cache.configure(flags.get(compilation_cache.FLAG))
  if args.command not in SINGLE_PROCESS_COMMANDS:
    from jaxmoral import partitioning  # Imported when run: keeps --help fast.
    # Before gin, whose configurables may touch devices (a no-op for one process).
    partitioning.initialize_distributed(**distributed)
  if TFDS_DATA_DIR_FLAG in flags:
    # Where every TFDS-backed seqio Task reads its prepared data, as T5X's --tfds_data_dir.
    import seqio  # pylint: disable=g-import-not-at-top  # TensorFlow: only when asked for.
    seqio.set_tfds_data_dir_override(flags[TFDS_DATA_DIR_FLAG])
  if args.command in GIN_COMMANDS:
    module, function, _ = GIN_COMMANDS[args.command]
    fn = getattr(importlib.import_module(module), function)
    gin_utils.parse_gin(gin_args)
    gin_utils.check_required()
    fn()
  elif args.command == "export":
    from jaxmoral import partitioning  # pylint: disable=import-outside-toplevel
    from jaxmoral import runs  # pylint: disable=import-outside-toplevel
    partitioner = (partitioning.PjitPartitioner(num_partitions=args.num_partitions)
                   if args.num_partitions else None)
    runs.export_run(model_dir=args.model_dir, output_dir=args.output, step=args.step,
                    dtype=args.dtype, output_format=args.format, overwrite=args.overwrite,
                    partitioner=partitioner)
  elif args.command == "compile":
    from jaxmoral import aot  # pylint: disable=import-outside-toplevel
    gin_utils.parse_gin(gin_args)
    if args.report:
      fileio.check_writable(args.report)
    aot.compile_for_topology(topology=args.topology, report_path=args.report)
  elif args.command == "vocab":
    from jaxmoral.data import vocab  # pylint: disable=import-outside-toplevel
    fileio.check_writable(args.output_dir, directory=True)
    print(vocab.build_demo_vocabulary(output_dir=args.output_dir))
  elif args.command == "demo":
    from jaxmoral import demo  # pylint: disable=import-outside-toplevel
    fileio.check_writable(args.workdir, directory=True)
    only = tuple(args.only.split(",")) if args.only else None
    demo.run_all(workdir=args.workdir, only=only)
  else:
    method = importlib.import_module(f"jaxmoral.{args.command}.commands")
    return int(method.main(args.action, args.rest, gin_args) or 0)
  return 0


if __name__ == "__main__":
  sys.exit(main())
