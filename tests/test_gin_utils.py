"""The gin layer (`gin_utils`, `gin_checks`, `gin_files`), through the CLI's entry `parse_gin`:
T5X flag forms, REQUIRED detection, search paths, and that everything bound can be read (no
misspelt macro, parameter, configurable or scope), on gin's public API only.

One file for the three modules: their behaviour is what `parse_gin` does, and the test
configurables below (whose module name appears in gin's messages) are registered once."""

import glob
import importlib
import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import gin
import pytest

from jaxmoral import gin_checks
from jaxmoral import gin_files
from jaxmoral import gin_utils


pytestmark = pytest.mark.usefixtures("one_device", "clean_gin")


@gin.configurable
def _entry(*, model_dir, steps=1, name="x"):
  return model_dir, steps, name


@gin.configurable
def _make(*, value: object = None) -> object:
  return value


# Two configurables that the short selector `twin` matches: binding `twin.a` is ambiguous.
@gin.configurable("twin", module="test_gin_utils_left")
def _left_twin(*, a: int = 0) -> int:
  return a


@gin.configurable("twin", module="test_gin_utils_right")
def _right_twin(*, a: int = 0) -> int:
  return a


def _parse(tmp_path: pathlib.Path, content: str, *flags: str) -> str:
  """parse_gin of gin text (a file named after the test) and command-line flags."""
  # gin keeps every search path it was given, so each test needs a file name of its own.
  name = f"config_{tmp_path.name}.gin"
  (tmp_path / name).write_text(textwrap.dedent(content))
  gin_args, rest = gin_utils.split_gin_args([f"--gin_file={name}", *flags,
                                             f"--gin_search_paths={tmp_path}"])
  assert not rest
  gin_utils.parse_gin(gin_args)
  return name


def test_split_gin_args_t5x_forms():
  gin_args, rest = gin_utils.split_gin_args([
      "--gin_file=a.gin", "--gin_file", "b.gin,c.gin", "--gin.MODEL_DIR=/tmp/run",
      "--gin.TRAIN_STEPS=10", "--gin_bindings=x.y = 3", "--other", "--gin_search_paths=/p,/q",
      "--gin.NAME='quoted'", "--gin.REF=@foo()"])
  assert gin_args.files == ("a.gin", "b.gin", "c.gin")
  assert gin_args.bindings == ("MODEL_DIR = '/tmp/run'", "TRAIN_STEPS = 10", "x.y = 3",
                               "NAME = 'quoted'", "REF = @foo()")
  assert gin_args.search_paths == ("/p", "/q")
  assert rest == ["--other"]
  assert gin_args.read_as_strings == ("--gin.MODEL_DIR=/tmp/run",)
  assert gin_args.binding_flags == ("--gin.MODEL_DIR=/tmp/run", "--gin.TRAIN_STEPS=10",
                                    "--gin_bindings=x.y = 3", "--gin.NAME='quoted'",
                                    "--gin.REF=@foo()")


def test_split_gin_args_rejects_binding_without_value():
  with pytest.raises(SystemExit, match="--gin.NAME=VALUE"):
    gin_utils.split_gin_args(["--gin.MODEL_DIR"])


def test_required_macro_and_parameter_are_named():
  gin.parse_config("MODEL_DIR = %gin.REQUIRED\n"
                   "test_gin_utils._entry.model_dir = %MODEL_DIR\n"
                   "test_gin_utils._entry.steps = %gin.REQUIRED\n")
  with pytest.raises(ValueError) as info:
    gin_utils.check_required()
  assert "MODEL_DIR" in str(info.value) and "_entry.steps" in str(info.value)
  gin.parse_config("MODEL_DIR = '/r'\ntest_gin_utils._entry.steps = 3")
  gin_utils.check_required()
  assert _entry() == ("/r", 3, "x")


def test_parse_gin_finds_project_fragments_from_any_cwd(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  gin_args, _ = gin_utils.split_gin_args(["--gin_file=gin/models/t5_1_1_small.gin",
                                          "--gin.config.t5_config.dropout_rate=0.1"])
  gin_utils.parse_gin(gin_args)
  config = gin.query_parameter("%MODEL_CONFIG").scoped_configurable_fn()
  assert config.d_model == 512 and config.num_encoder_layers == 8
  assert config.dropout_rate == 0.1


def test_missing_gin_file_is_named(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  gin_args, _ = gin_utils.split_gin_args(["--gin_file=nope/missing.gin"])
  with pytest.raises(FileNotFoundError, match="missing.gin"):
    gin_utils.parse_gin(gin_args)


@pytest.mark.parametrize("content, binding, message", [
    ("X = 1\nY = 1O\n", None, r"\.gin, line 2: Expected newline"),
    ("X = 1\nY = [1, 2\n", None, r"\.gin: EOF in multi-line statement"),
    ("X = 1\n", "TRAIN_STEPS = 1O", r"binding 'TRAIN_STEPS = 1O': Expected newline"),
    ("X = 1\n", "Y = (1", r"binding 'Y = \(1': EOF in multi-line statement"),
])
def test_syntax_errors_name_the_file_line_or_binding(tmp_path, content, binding, message):
  # gin keeps every search path it was given, so each case needs a file name of its own.
  name = f"bad_{tmp_path.name}.gin"
  (tmp_path / name).write_text(content)
  gin_args = gin_utils.GinArgs(files=(name,), bindings=(binding,) if binding else (),
                               search_paths=(str(tmp_path),))
  with pytest.raises(ValueError, match=message):
    gin_utils.parse_gin(gin_args)


def test_write_operative_config(tmp_path):
  gin.parse_config("test_gin_utils._entry.model_dir = '/d'")
  _entry()
  path = gin_utils.write_operative_config(tmp_path)
  assert "_entry.model_dir = '/d'" in open(path).read()


def test_config_bindings_read_values_as_gin_does_and_complete_selectors():
  # The module of `_entry` is this file's: gin prints its selector minimally or in full.
  module = _entry.__module__
  written = textwrap.dedent(f"""\
      from jaxmoral import runs
      # A comment, then a value gin continues over lines.
      {module}._entry.name = ['a long string', 'another',
          'and more']
      _make.value = @{module}._entry()
      scope/_entry.steps = %STEPS
      STEPS = 1e-05
      twin.a = 3
      """)
  bindings = gin_files.config_bindings(written)
  assert bindings == {
      f"{module}._entry.name": "['a long string', 'another', 'and more']",
      f"{module}._make.value": f"@{module}._entry()",
      f"scope/{module}._entry.steps": "%STEPS",
      "STEPS": "1e-05",
      "twin.a": "3",  # Ambiguous in the registry: kept as written.
  }
  # The same config printed otherwise: minimal selectors, one line, 0.00001.
  printed = ("_entry.name = ['a long string', 'another', 'and more']\n"
             "_make.value = @_entry()\nscope/_entry.steps = %STEPS\nSTEPS = 0.00001\n"
             "twin.a = 3\n")
  assert gin_files.config_bindings(printed) == bindings
  assert gin_files.binding_changes(written, printed) == []
  changed = printed.replace("STEPS = 0.00001", "STEPS = 2").replace("twin.a = 3\n", "") + (
      "_entry.model_dir = '/d'\n")
  assert gin_files.binding_changes(written, changed) == [
      "- STEPS = 1e-05", "+ STEPS = 2", f"+ {module}._entry.model_dir = '/d'", "- twin.a = 3"]
  with pytest.raises(ValueError, match="not a gin config"):
    gin_files.config_bindings("_entry.name = [unclosed\n")


@pytest.mark.parametrize("fragment, field, expected", [
    ("greedy", "sample_config", {"greedy": True, "max_decode_length": 64}),
    ("sample", "sample_config", {"greedy": False, "top_p": 0.9, "num_samples": 1}),
    ("beam_search", "beam_config", {"beam_size": 4, "length_penalty": 0.6}),
])
def test_decoding_fragments_configure_infer(fragment, field, expected):
  gin_args, _ = gin_utils.split_gin_args([
      "--gin_file=configs/core/tiny_cpu.gin", f"--gin_file=gin/decoding/{fragment}.gin",
      "--gin.MODEL_DIR=/tmp/unused"])
  gin_utils.parse_gin(gin_args)
  config = gin.query_parameter(f"runs.infer_run.{field}").scoped_configurable_fn()
  assert {key: getattr(config, key) for key in expected} == expected


# -- everything bound is read --------------------------------------------------------------------
def test_misspelt_macro_on_the_command_line_is_an_error_naming_the_flag():
  gin_args, _ = gin_utils.split_gin_args([
      "--gin_file=configs/core/tiny_cpu.gin", "--gin.MODEL_DIR=/tmp/unused",
      "--gin.TRAIN_STEP=5"])
  with pytest.raises(ValueError) as info:
    gin_utils.parse_gin(gin_args)
  message = str(info.value)
  assert "\n" not in message
  assert message.startswith("gin: macro TRAIN_STEP (--gin.TRAIN_STEP=5) is never read")
  assert "close valid names: TRAIN_STEPS" in message
  # A macro that only another command reads (infer's INFER_INPUT) is read: no error.
  gin.clear_config()
  gin_args, _ = gin_utils.split_gin_args([
      "--gin_file=configs/core/tiny_cpu.gin", "--gin.MODEL_DIR=/tmp/unused",
      "--gin.TRAIN_STEPS=5", "--gin.INFER_INPUT=in.txt"])
  gin_utils.parse_gin(gin_args)
  assert gin_checks.unreferenced_macros() == []


def test_train_with_a_misspelt_macro_stops_before_training(tmp_path, capsys):
  from jaxmoral import cli  # pylint: disable=g-import-not-at-top
  code = cli.main(["train", "--gin_file=configs/core/tiny_cpu.gin",
                   f"--gin.MODEL_DIR={tmp_path}", "--gin.TRAIN_STEP=5"])
  err = capsys.readouterr().err
  assert code == 2 and not os.listdir(tmp_path)
  assert len(err.strip().splitlines()) == 1
  assert "--gin.TRAIN_STEP=5" in err and "TRAIN_STEPS" in err


def test_unread_macro_in_a_file_names_the_file_and_line(tmp_path):
  with pytest.raises(ValueError) as info:
    _parse(tmp_path, """\
        DIR = '/d'
        test_gin_utils._entry.model_dir = %DIR
        STEPZ = 3
        """)
  assert str(info.value) == (
      f"gin: macro STEPZ ({tmp_path / f'config_{tmp_path.name}.gin'}, line 3) is never read: "
      f"no binding or macro refers to %STEPZ; close valid names: _entry.steps.")


def test_references_anywhere_count_as_reads(tmp_path):
  # Macros read inside tuples, lists and dicts, by other macros, by the bindings of a function
  # another binding calls (`@fn()`) and by scoped bindings; an export (`NAME = @fn()`) that
  # a file defines for its includers may go unread.
  _parse(tmp_path, """\
      DIR = '/d'
      A = 1
      B = 2
      C = %A
      D = 4
      INNER = 'inner'
      SCOPED = 'scoped'
      OBJECT = @test_gin_utils._make()
      test_gin_utils._entry.model_dir = %DIR
      test_gin_utils._entry.steps = (%C, [%B], {'d': %D})
      test_gin_utils._entry.name = [@test_gin_utils._make(), @scope/test_gin_utils._make()]
      test_gin_utils._make.value = %INNER
      scope/test_gin_utils._make.value = %SCOPED
      """, "--gin.B=3")
  assert _entry() == ("/d", (1, [3], {"d": 4}), ["inner", "scoped"])
  assert gin_checks.unreferenced_macros() == ["OBJECT"]


def test_an_unread_export_on_the_command_line_is_an_error(tmp_path):
  with pytest.raises(ValueError, match=r"^gin: macro OBJECT \(--gin.OBJECT=@test_gin_utils"
                                       r"._make\(\)\) is never read"):
    _parse(tmp_path, "test_gin_utils._entry.model_dir = '/d'\n",
           "--gin.OBJECT=@test_gin_utils._make()")


def test_a_scope_nothing_enters_is_an_error(tmp_path):
  content = """\
      test_gin_utils._entry.model_dir = '/d'
      test_gin_utils._entry.name = @scope/test_gin_utils._make()
      """
  with pytest.raises(ValueError) as info:
    _parse(tmp_path, content, "--gin.scoep/test_gin_utils._make.value=1")
  assert str(info.value) == (
      "gin: scope 'scoep' of scoep/_make.value (--gin.scoep/test_gin_utils._make.value=1) is "
      "never entered: no reference @scoep/... exists; close valid names: scope.")
  gin.clear_config()
  _parse(tmp_path, content, "--gin.scope/test_gin_utils._make.value=1")
  assert _entry() == ("/d", 1, 1)


@pytest.mark.parametrize("flags, message", [
    (["--gin.runs.train_run.train_step=5"],
     "gin: runs.train_run has no parameter 'train_step' (--gin.runs.train_run.train_step=5); "
     "close valid names: runs.train_run.train_steps"),
    (["--gin.runs.trian_run.train_steps=5"],
     "gin: no configurable 'runs.trian_run' is registered (misspelt, or its module not "
     "imported) (--gin.runs.trian_run.train_steps=5); close valid names: runs.train_run"),
    (["--gin_bindings=runs.train_run.data = @runs.Seq2SeqDta()"],
     "gin: no configurable 'runs.Seq2SeqDta' is registered (misspelt, or its module not "
     "imported) (--gin_bindings=runs.train_run.data = @runs.Seq2SeqDta()); close valid names: "
     "runs.Seq2SeqData"),
    # Registered under a module name of its own (`module="diamante"`), not its Python module's.
    (["--gin.diamante.DiamanteModl.config=None"],
     "gin: no configurable 'diamante.DiamanteModl' is registered (misspelt, or its module not "
     "imported) (--gin.diamante.DiamanteModl.config=None); close valid names: "
     "diamante.DiamanteModel"),
])
def test_unknown_parameter_or_configurable_is_one_line(flags, message, monkeypatch):
  importlib.import_module("jaxmoral.diamante.diamante_model")
  # The suggestions look through sys.modules, which may hold None (an import blocked so).
  monkeypatch.setitem(sys.modules, "blocked_by_a_test", None)
  gin_args, _ = gin_utils.split_gin_args(["--gin_file=configs/core/tiny_cpu.gin",
                                          "--gin.MODEL_DIR=/tmp/unused", *flags])
  with pytest.raises(ValueError) as info:
    gin_utils.parse_gin(gin_args)
  assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_errors_in_files_and_ambiguous_selectors_are_one_line(tmp_path):
  with pytest.raises(ValueError) as info:
    _parse(tmp_path, "X = 1\ntest_gin_utils._entry.stepz = %X\n")
  path = tmp_path / f"config_{tmp_path.name}.gin"
  assert str(info.value) == (f"gin: test_gin_utils._entry has no parameter 'stepz' ({path}, "
                             f"line 2); close valid names: test_gin_utils._entry.steps")
  gin.clear_config()
  # gin raises a KeyError for an ambiguous selector; it is a config error like the others.
  with pytest.raises(ValueError, match=r"^gin: Ambiguous selector 'twin', matches .*\(binding "
                                       r"'twin.a = 1'\)$"):
    gin_utils.parse_gin(gin_utils.GinArgs(bindings=("twin.a = 1",)))


# Configs meant to be added after another one (their header says so), parsed after it.
ADD_ONS = {"configs/diamante/nll_only.gin": ("configs/diamante/tiny_cpu.gin",)}
# configs/experiments/ bind the configurables of the experiments/ scripts, which register them:
# tests/test_experiments.py parses those with their scripts imported.
SHIPPED = sorted([p for p in glob.glob("configs/**/*.gin", root_dir=gin_files.PROJECT_ROOT,
                                       recursive=True)
                  if not p.startswith("configs/experiments/")]
                 + glob.glob("gin/**/*.gin", root_dir=gin_files.PROJECT_ROOT, recursive=True))

_PARSE_EACH = textwrap.dedent("""
    import json, sys
    import gin
    from jaxmoral import gin_checks, gin_utils
    results = {}
    for files in json.loads(sys.argv[1]):
      gin.clear_config()
      try:
        gin_utils.parse_gin(gin_utils.GinArgs(files=tuple(files)))
      except Exception as error:  # pylint: disable=broad-except
        results[files[-1]] = {"error": f"{type(error).__name__}: {error}"}
        continue
      unread = gin_checks.unreferenced_macros()
      exports = [n for n in unread
                 if isinstance(gin.query_parameter(f"%{n}"), gin.config.ConfigurableReference)]
      results[files[-1]] = {"error": None, "unread": unread, "exports": exports}
    print("RESULTS " + json.dumps(results))
""")


@pytest.fixture(scope="module")
def shipped_results() -> dict[str, dict[str, object]]:
  """parse_gin of every shipped config and fragment, each in a fresh config, in a new process.

  gin's registry outlives `gin.clear_config()`: once a test has imported Diamante's `demo`,
  configs/npov/tiny_cpu_demo.gin's `demo.run_demo` is ambiguous, which no command meets.
  """
  runs = [[*ADD_ONS.get(path, ()), path] for path in SHIPPED]
  proc = subprocess.run([sys.executable, "-c", _PARSE_EACH, json.dumps(runs)],
                        cwd=gin_files.PROJECT_ROOT, capture_output=True, text=True, check=False)
  lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS ")]
  assert lines, proc.stderr[-3000:]
  return json.loads(lines[-1][len("RESULTS "):])


@pytest.mark.parametrize("path", SHIPPED)
def test_shipped_configs_parse_and_leave_only_exports_unread(shipped_results, path):
  result = shipped_results[path]
  assert result["error"] is None, result["error"]
  # What nothing reads is only what a fragment exports for includers (e.g. PARTITIONER, which
  # `jaxmoral compile` does not read: it builds `partitioning.PjitPartitioner` itself).
  assert result["unread"] == result["exports"]


def test_an_included_project_config_is_read_from_another_folder_with_the_root_on_sys_path(
    tmp_path, monkeypatch):
  """`python -m ...` from the project root puts it on sys.path; gin then reads an include that
  is not under the working directory as a package file of `configs` (T5X's configs work so)."""
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(sys, "path", [str(gin_files.PROJECT_ROOT), *sys.path])
  importlib.import_module("jaxmoral.diamante.commands")
  gin_utils.parse_gin(gin_utils.GinArgs(
      files=("configs/diamante/generator_tiny_cpu.gin",), bindings=("MODEL_DIR = 'run'",)))
  # The include (configs/diamante/tiny_cpu.gin) was read: its training data are bound.
  assert gin.query_parameter("%TRAIN_PATH").endswith("jaxmoral/data/demo/dialogues_train.jsonl")
  # Which holds for every config folder: each is a package.
  folders = [p for p in (gin_files.PROJECT_ROOT / "configs").rglob("*")
             if p.is_dir() and p.name != "__pycache__"]
  assert [f for f in folders if not (f / "__init__.py").is_file()] == []


def test_jaxmoral_reads_no_private_gin_state():
  """The gin layer uses gin's public API only (the listing comes from `gin.config_str`)."""
  private = re.compile(r"gin\.(config|config_parser|resource_reader)\._[A-Za-z]")
  offenders = [f"{path.relative_to(gin_files.PROJECT_ROOT)}:{number}"
               for path in sorted((gin_files.PROJECT_ROOT / "jaxmoral").rglob("*.py"))
               for number, line in enumerate(path.read_text().splitlines(), 1)
               if private.search(line)]
  assert not offenders, offenders
