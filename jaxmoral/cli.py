"""`jaxmoral <command>`: a thin layer that parses flags and gin, then calls one library function.

Core commands take T5X's gin conventions::

  jaxmoral train  --gin_file=configs/core/tiny_cpu.gin --gin.MODEL_DIR=/tmp/run
  jaxmoral eval   --gin_file=... --gin.MODEL_DIR=/tmp/run
  jaxmoral infer  --gin_file=... --gin.MODEL_DIR=/tmp/run --gin.INFER_INPUT=in.txt
  jaxmoral export --model_dir=/tmp/run --output=/tmp/exported [--dtype=bfloat16]
  jaxmoral compile --gin_file=configs/... --topology=v5e:8x8

Method commands: `jaxmoral npov ...`, `jaxmoral diamante ...`, `jaxmoral clarify ...`; and
`jaxmoral demo` runs every method end to end on the bundled sample data.
Every command's work is one library call that a notebook can make too.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from typing import Any, Callable, Sequence

from jaxmoral import compilation_cache, gin_utils

# Sub-commands whose work is a gin-configured library function: (module, function).
GIN_COMMANDS: dict[str, tuple[str, str, str]] = {
    "train": ("jaxmoral.runs", "train_run", "Train a model from a gin config (T5X style)."),
    "eval": ("jaxmoral.runs", "eval_run", "Evaluate the latest checkpoint of MODEL_DIR."),
    "infer": ("jaxmoral.runs", "infer_run", "Decode inputs with the latest checkpoint."),
}


def _quiet_logs() -> None:
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  os.environ.setdefault("HF_HUB_OFFLINE", "1")
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s",
                      datefmt="%H:%M:%S")
  for noisy in ("absl", "jax._src", "orbax", "tensorflow", "etils"):
    logging.getLogger(noisy).setLevel(logging.WARNING)
  # gin logs every search-path miss (at ERROR) while resolving includes; those are not errors.
  for handler in logging.getLogger().handlers:
    handler.addFilter(lambda record: "gin" not in record.pathname.replace("\\", "/").split("/")[-2:-1])


# What TensorFlow 2.21 writes to stderr on import, whatever TF_CPP_MIN_LOG_LEVEL says: about
# oneDNN, a missing CUDA driver on a CPU machine, absl's pre-init notice, a failed cuInit.
_TF_START_UP_NOISE = ("oneDNN custom operations are on", "Could not find cuda drivers",
                      "All log messages before absl::InitializeLog()", "failed call to cuInit")


def _tensorflow_for_input_pipelines_only() -> None:
  """Imports TensorFlow (seqio's input pipelines) with its start-up lines filtered out of
  stderr, and hides every GPU from it, as T5X does: TensorFlow would otherwise reserve GPU
  memory that JAX needs. Anything else TensorFlow writes meanwhile is passed on."""
  import tempfile  # pylint: disable=g-import-not-at-top
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile(mode="w+b") as captured:
    os.dup2(captured.fileno(), 2)
    try:
      import tensorflow as tf  # pylint: disable=g-import-not-at-top
      tf.config.set_visible_devices([], "GPU")
    except ImportError:  # seqio's own import will say what is missing, if it is needed.
      pass
    except RuntimeError:  # TensorFlow already ran in this process: leave its devices be.
      pass
    finally:
      os.dup2(saved, 2)
      os.close(saved)
      captured.seek(0)
      for line in captured.read().decode(errors="replace").splitlines(keepends=True):
        if not any(noise in line for noise in _TF_START_UP_NOISE):
          sys.stderr.write(line)


def _call_with_gin(module: str, function: str, gin_args: gin_utils.GinArgs,
                   extra_bindings: Sequence[str] = ()) -> Any:
  fn: Callable[..., Any] = getattr(importlib.import_module(module), function)
  gin_utils.parse_gin(gin_args, extra_bindings=extra_bindings)
  gin_utils.check_required()
  return fn()


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="jaxmoral", description=__doc__.split("\n\n")[0],
      epilog="Gin flags for every command: --gin_file=F (repeatable), --gin.NAME=VALUE, "
             "--gin_bindings='NAME = VALUE', --gin_search_paths=DIRS. "
             f"{compilation_cache.FLAG}=DIR|none (anywhere on the line): where compiled "
             "programs are kept between runs (default ~/.cache/jaxmoral/xla).")
  sub = parser.add_subparsers(dest="command", required=True)
  for name, (_, _, help_text) in GIN_COMMANDS.items():
    sub.add_parser(name, help=help_text)

  export = sub.add_parser("export", help="Write a params-only Orbax checkpoint of a run.")
  export.add_argument("--model_dir", required=True)
  export.add_argument("--output", required=True)
  export.add_argument("--step", type=int, default=None)
  export.add_argument("--dtype", default=None, choices=[None, "float32", "bfloat16"])

  compile_ = sub.add_parser("compile", help="AOT-compile a config's train step for a topology.")
  compile_.add_argument("--topology", required=True,
                        help="e.g. v5e:8x8, v4:2x2x2, v5p:4x4x4 (libtpu needed), or cpu:8")
  compile_.add_argument("--report", default=None, help="Write the memory/FLOP report (JSON).")

  vocab = sub.add_parser("vocab", help="Train the demo SentencePiece vocabulary.")
  vocab.add_argument("--output_dir", required=True)

  demo = sub.add_parser("demo", help="Run every method end to end on bundled sample data.")
  demo.add_argument("--workdir", default="demo_out")
  demo.add_argument("--only", default=None, help="comma list: core,npov,diamante,clarify")

  for method in ("npov", "diamante", "clarify"):
    method_parser = sub.add_parser(method, help=f"{method} commands (see `jaxmoral {method} -h`).")
    method_parser.add_argument("action", help="see the method's documentation in README.md")
    method_parser.add_argument("rest", nargs=argparse.REMAINDER)
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = _parser()
  try:
    cache_flag, argv = compilation_cache.split_flag(argv)
  except ValueError as error:
    parser.error(str(error))
  gin_args, rest = gin_utils.split_gin_args(argv)
  args = parser.parse_args(rest)
  _quiet_logs()
  _tensorflow_for_input_pipelines_only()
  # `compile` goes without: compile-only TPU executables cannot be loaded back.
  cache_dir = (None if args.command == "compile"
               else compilation_cache.resolve_cache_dir(cache_flag))
  if cache_dir is None:  # Also overrides a JAX_COMPILATION_CACHE_DIR that JAX read itself.
    compilation_cache.disable()
  else:
    compilation_cache.enable(cache_dir)
  if args.command not in ("compile", "vocab", "export"):
    from jaxmoral import partitioning
    # A no-op for one process; joins the job under JAX_COORDINATOR_ADDRESS, SLURM or a TPU pod.
    partitioning.initialize_distributed()
  try:
    if args.command in GIN_COMMANDS:
      module, function, _ = GIN_COMMANDS[args.command]
      _call_with_gin(module, function, gin_args)
    elif args.command == "export":
      from jaxmoral import runs
      runs.export_run(model_dir=args.model_dir, output_dir=args.output, step=args.step,
                      dtype=args.dtype)
    elif args.command == "compile":
      from jaxmoral import aot
      gin_utils.parse_gin(gin_args)
      aot.compile_for_topology(topology=args.topology, report_path=args.report)
    elif args.command == "vocab":
      from jaxmoral.data import vocab
      print(vocab.build_demo_vocabulary(output_dir=args.output_dir))
    elif args.command == "demo":
      from jaxmoral import demo
      only = tuple(args.only.split(",")) if args.only else None
      demo.run_all(workdir=args.workdir, only=only)
    else:
      method = importlib.import_module(f"jaxmoral.{args.command}.commands")
      return int(method.main(args.action, args.rest, gin_args) or 0)
  except (ValueError, FileNotFoundError) as error:
    print(f"jaxmoral {args.command}: error: {gin_utils.explain_gin_error(error)}",
          file=sys.stderr)
    return 2
  except TypeError as error:
    # A type error inside a gin-bound call is a configuration error (gin adds "In call to
    # configurable"); anywhere else it is a bug and keeps its traceback.
    if "In call to configurable" not in str(error):
      raise
    print(f"jaxmoral {args.command}: error: {error}", file=sys.stderr)
    if gin_args.read_as_strings:
      print(f"  note: read as strings, not being Python literals: "
            f"{', '.join(gin_args.read_as_strings)}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
