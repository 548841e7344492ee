"""Gin command-line handling: T5X flag forms, REQUIRED detection, search paths."""

import gin
import pytest

from jaxmoral import gin_utils


@pytest.fixture(autouse=True)
def _clean_gin():
  gin.clear_config()
  yield
  gin.clear_config()


@gin.configurable
def _entry(*, model_dir, steps=1, name="x"):
  return model_dir, steps, name


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
