"""Every path a run or an experiment touches goes through `jaxmoral.fileio`, checked statically.

`open`, `os`'s file functions, `os.path`'s file queries, `shutil`, `glob` and `tempfile`
only know local paths: given `gs://bucket/x` they make a local folder `gs:` or report that
nothing exists. So outside `fileio`, jaxmoral and the experiment runners (`experiments/`) call
them only where a path is local by design, and every such function is listed here with its
reason. A new direct call elsewhere fails this test, naming the function: go through `fileio`
(local and object-store paths alike), or add the function below with the reason its paths are
always local. Methods of `pathlib.Path` objects are not seen here; the runtime counterpart,
`conftest.bucket_paths_stay_in_the_bucket`, catches those on the paths the storage tests reach.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCES = (ROOT / "jaxmoral", ROOT / "experiments")

OS_FILE_FUNCTIONS = frozenset({
    "access", "chmod", "link", "listdir", "lstat", "makedirs", "mkdir", "open", "readlink",
    "remove", "removedirs", "rename", "replace", "rmdir", "scandir", "stat", "symlink", "unlink",
    "utime", "walk"})
OS_PATH_QUERIES = frozenset({"abspath", "exists", "getmtime", "getsize", "isdir", "isfile",
                             "islink", "lexists", "realpath"})
OTHER_CALLS = frozenset({"open", "glob.glob", "glob.iglob", "tempfile.mkdtemp",
                         "tempfile.mkstemp", "tempfile.NamedTemporaryFile"})

# {module: (why its paths are local, the functions that call the local file layer)}.
LOCAL_BY_DESIGN: dict[str, tuple[str, frozenset[str]]] = {
    "jaxmoral.action_commands": (
        "resolves relative input flags; a URL is passed on untouched (`'://' in value`)",
        frozenset({"check_inputs", "resolve_input_flags"})),
    "jaxmoral.aot": ("reads /proc/meminfo", frozenset({"available_host_bytes"})),
    "jaxmoral.checkpoints": ("the local disk-full cleanup",
                             frozenset({"CheckpointManager._disk_full_is_one_line"})),
    "jaxmoral.clarify.models": ("a cache key: the absolute form of a local folder, else the URL",
                                frozenset({"load_model"})),
    "jaxmoral.cli": ("source files of a traceback", frozenset({"_is_an_operation_in_jaxmoral"})),
    "jaxmoral.compilation_cache": (
        "the XLA compilation cache is local only (a URL is refused with one line)", frozenset({
            "SignedCache.get", "SignedCache.put", "_secret", "_sign_entries",
            "_sign_entries.get_file_cache", "configure", "enable", "uncapped_entries",
            "untrusted_reason"})),
    "jaxmoral.backends.cpu_kernels.__init__": (
        "the compiled-kernel cache in the user's private folder, /proc/cpuinfo", frozenset({
            "_cache_dir", "_compiler", "_cpu_signature", "_folder_problem", "_install",
            "_read_own_file", "_write_atomically", "build"})),
    "jaxmoral.data.index_cache": (
        "a local folder: a bucket cache is copied through `fileio.local_folder` first",
        frozenset({"read", "write", "_verify", "_version"})),
    "jaxmoral.data.tasks": ("a stream position's local scratch copy (uploaded through fileio)",
                            frozenset({"TaskSource._save_position"})),
    "jaxmoral.data.vocab": ("SentencePiece writes local files; they are uploaded after",
                            frozenset({"build_demo_vocabulary"})),
    "jaxmoral.diamante.data": ("the local folder SentencePiece trains in "
                               "(`run_dirs.vocabulary_build_dir`)",
                               frozenset({"DialogueData.vocabulary"})),
    "jaxmoral.explore.folders": ("the explorer serves local folders only",
                                 frozenset({"Roots.walk", "_first_json", "_json_keys"})),
    "jaxmoral.explore.live": ("the explorer serves local folders only",
                              frozenset({"model_traits"})),
    "jaxmoral.explore.sources": ("the explorer serves local folders only",
                                 frozenset({"read_jsonl", "_manifest_files"})),
    "jaxmoral.demo": ("finds the environment's console scripts on this machine's PATH",
                      frozenset({"installed_command"})),
    "jaxmoral.gin_files": ("gin files are local (gin reads them itself)",
                           frozenset({"file_statements", "resolve_relative_paths"})),
    "jaxmoral.integrity": ("resolves local links only (a URL has none)",
                           frozenset({"_refuse_entries_outside"})),
    "jaxmoral.models.hf_import": ("the file mode of a local export (a bucket has none)",
                                  frozenset({"export_hf_t5"})),
    "jaxmoral.npov.demo": ("the demo's local workdir", frozenset({"run_demo"})),
    "jaxmoral.data.seq2seq": ("copies a local folder; to a URL through fileio",
                              frozenset({"_copy_folder"})),
    "jaxmoral.run_dirs": (
        "the local run lock (a bucket run's lock is a conditional object write in fileio)",
        frozenset({"RunDirLock._acquire_file", "RunDirLock._take_over", "_HeldLock._beat"})),
    "jaxmoral.runtime": ("device nodes under /dev",
                         frozenset({"platforms_without_absent_tpu", "_tpu_attached"})),
    "experiments.experiment_lib": ("the script's own path, for the report's command line",
                                   frozenset({"command_line"})),
}


def _dotted(node: ast.expr) -> str:
  parts = []
  while isinstance(node, ast.Attribute):
    parts.append(node.attr)
    node = node.value
  if isinstance(node, ast.Name):
    parts.append(node.id)
  return ".".join(reversed(parts))


def _is_local_file_call(name: str) -> bool:
  module, _, function = name.rpartition(".")
  return (name in OTHER_CALLS or name.startswith("shutil.")
          or (module == "os" and function in OS_FILE_FUNCTIONS)
          or (module == "os.path" and function in OS_PATH_QUERIES))


def local_file_calls(source: str) -> dict[str, set[str]]:
  """{qualified function (`Class.method`, `outer.inner`): the local file calls it makes}."""
  calls: dict[str, set[str]] = {}
  scope: list[str] = []

  def visit(node: ast.AST) -> None:
    named = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    if named:
      scope.append(node.name)  # type: ignore[union-attr]
    if isinstance(node, ast.Call) and _is_local_file_call(name := _dotted(node.func)):
      calls.setdefault(".".join(scope) or "<module>", set()).add(name)
    for child in ast.iter_child_nodes(node):
      visit(child)
    if named:
      scope.pop()

  visit(ast.parse(source))
  return calls


def _module_name(path: pathlib.Path) -> str:
  return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def test_the_rule_sees_direct_file_calls():
  calls = local_file_calls(
      "import os, shutil\n"
      "def save(d):\n  os.makedirs(d)\n  with open(d + '/x', 'w') as f: f.write('')\n"
      "class Run:\n  def clean(self, d):\n    shutil.rmtree(d)\n"
      "def through_the_layer(d):\n  fileio.makedirs(d)\n  os.path.join(d, 'x')\n")
  assert calls == {"save": {"os.makedirs", "open"}, "Run.clean": {"shutil.rmtree"}}


def test_only_functions_local_by_design_call_the_local_file_layer():
  found = {}
  for path in sorted(p for source in SOURCES for p in source.rglob("*.py")):
    if path.name == "fileio.py":
      continue
    for function, names in local_file_calls(path.read_text(encoding="utf-8")).items():
      found[(_module_name(path), function)] = names
  allowed = {(module, function) for module, (_, functions) in LOCAL_BY_DESIGN.items()
             for function in functions}
  unlisted = [f"{module}.{function}: {', '.join(sorted(found[(module, function)]))}"
              for module, function in sorted(set(found) - allowed)]
  assert not unlisted, ("direct file calls outside jaxmoral.fileio (they break gs:// paths; go "
                        "through fileio, or list the function in LOCAL_BY_DESIGN with the "
                        "reason its paths are local):\n  " + "\n  ".join(unlisted))
  stale = sorted(f"{module}.{function}" for module, function in allowed - set(found))
  assert not stale, f"listed but no longer calling the local file layer: {stale}"
