"""Bad inputs to the command line fail early, in one line, and lose nothing.

One case per item: unwritable outputs (6), infer's line alignment and truncation report (10),
non-UTF-8 chat input (11), mistyped run counts (12), a shipped config's data paths from
another working directory (13), TPU-free start-up and every action's --help (16, 17).
"""

import errno
import io
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import types

import flax.linen as nn
import gin
import jax
import numpy as np
import pytest

from jaxmoral import cli
from jaxmoral import runtime
from jaxmoral import gin_utils
from jaxmoral import model_dirs
from jaxmoral.data import vocab as vocab_lib
from jaxmoral.diamante import bundle as bundle_lib
from jaxmoral.diamante import data as diamante_data
from jaxmoral.diamante import inference
from jaxmoral.models import t5
from jaxmoral.models.config import t5_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
CORE = "--gin_file=configs/core/tiny_cpu.gin"
DIAMANTE = "--gin_file=configs/diamante/tiny_cpu.gin"


pytestmark = pytest.mark.usefixtures("one_device", "clean_gin")


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory, demo_vocab_path):
  """A random one-layer T5 as an export (no training, no init compile: shapes traced, values
  drawn by NumPy), for `infer`: what is tested is the command line."""
  config = t5_config(size="tiny", num_encoder_layers=1, num_decoder_layers=1)
  shapes = nn.meta.unbox(jax.eval_shape(lambda r: t5.init_params(t5.T5(config), r),
                                        jax.random.PRNGKey(0)))
  rng = np.random.default_rng(0)
  params = jax.tree_util.tree_map(
      lambda s: rng.normal(0.0, 0.05, s.shape).astype(s.dtype), shapes)
  return model_dirs.export(tmp_path_factory.mktemp("tiny") / "export", params=params,
                           config=config, vocabulary=vocab_lib.get_vocabulary(demo_vocab_path))


@pytest.fixture
def read_only_dir(tmp_path):
  """(a folder no new file can be made in, the error's strerror); skips where there is none."""
  folder = tmp_path / "read_only"
  folder.mkdir()
  folder.chmod(0o555)
  try:
    try:
      with tempfile.TemporaryFile(dir=folder):
        pass
    except PermissionError as error:
      yield folder, error.strerror
      return
  finally:
    folder.chmod(0o755)
  # Root ignores permissions; sysfs makes no new files for anyone (EACCES, or EROFS where
  # it is mounted read-only).
  try:
    with tempfile.TemporaryFile(dir="/sys"):
      pass
  except OSError as error:
    yield pathlib.Path("/sys"), error.strerror
    return
  pytest.skip("no read-only folder on this machine")


def _no_work(monkeypatch):
  """Fails the test if a model is loaded or an input read: the check must come first."""
  from jaxmoral.data import readers  # pylint: disable=g-import-not-at-top
  from jaxmoral.npov import task  # pylint: disable=g-import-not-at-top

  def work_started(*args, **kwargs):
    raise AssertionError("work started before the output was checked")
  monkeypatch.setattr(model_dirs, "load", work_started)
  monkeypatch.setattr(bundle_lib, "load", work_started)
  # What `npov detect` and `clarify chat-file` do first (the action's function is the
  # gin-registered one, so it is its first step that stands in for it).
  monkeypatch.setattr(task, "read_examples", work_started)
  monkeypatch.setattr(readers, "read_jsonl", work_started)


def _one_error_line(capsys) -> str:
  err = capsys.readouterr().err
  lines = [line for line in err.splitlines() if line.startswith("jaxmoral")]
  assert len(lines) == 1 and "Traceback" not in err, err
  return lines[0]


# --- 6. Unwritable outputs: one line naming the path, before any work. ------------------------


def _unwritable_cases(tmp: pathlib.Path, read_only: pathlib.Path):
  """(argv, the path the error names, its strerror) of each command that writes."""
  a_file = tmp / "a_file"
  a_file.write_text("keep me")
  under_file = a_file / "out"
  export = tmp  # Never loaded: the output is checked first.
  busy = tmp / "busy"  # An existing folder where a file is to be written.
  busy.mkdir()
  (busy / "eval_latest.json").mkdir()
  not_dir = os.strerror(errno.ENOTDIR)
  is_dir = os.strerror(errno.EISDIR)
  return {
      "train": (["train", CORE, f"--gin.MODEL_DIR={under_file}"], under_file, not_dir),
      # eval writes MODEL_DIR/eval_latest.json: here a folder.
      "eval": (["eval", CORE, f"--gin.MODEL_DIR={busy}"], busy / "eval_latest.json", is_dir),
      "infer": (["infer", CORE, f"--gin.MODEL_DIR={export}", f"--gin.INFER_INPUT={a_file}",
                 f"--gin.INFER_OUTPUT={busy}"], busy, is_dir),
      "export": (["export", f"--model_dir={tmp / 'model'}", f"--output={under_file}"], under_file,
                 not_dir),
      "npov detect": (["npov", "detect", f"--input_path={a_file}", f"--output_path={busy}"],
                      busy, is_dir),
      "clarify chat-file": (["clarify", "chat-file", f"--input_jsonl={a_file}",
                             f"--output_jsonl={under_file}", "--question_model_dir=q",
                             "--fusion_model_dir=f", "--judge_model_dir=j"], under_file,
                            not_dir),
      "diamante chat": (["diamante", "chat", f"--model_dir={export}",
                         f"--transcript_path={read_only / 'chat.jsonl'}"],
                        read_only / "chat.jsonl", None),
  }


@pytest.mark.parametrize("command", ["train", "eval", "infer", "export", "npov detect",
                                     "clarify chat-file", "diamante chat"])
def test_unwritable_output_is_one_line_before_any_work(command, tmp_path, read_only_dir,
                                                       monkeypatch, capsys):
  folder, read_only_error = read_only_dir
  argv, path, strerror = _unwritable_cases(tmp_path, folder)[command]
  _no_work(monkeypatch)
  assert cli.main(argv) == 2
  line = _one_error_line(capsys)
  assert line.endswith(f": error: {strerror or read_only_error}: {path}"), line
  assert (tmp_path / "a_file").read_text() == "keep me"
  assert not path.exists() or path.is_dir()  # Nothing written where it was to go.


def test_an_output_that_is_an_input_is_refused_before_any_work(tmp_path, tiny_export,
                                                               monkeypatch, capsys):
  """INFER_OUTPUT naming INFER_INPUT (or a link to it), and an export into the model
  directory it reads (with or without --overwrite): one line, nothing read or written."""
  inputs = tmp_path / "in.txt"
  inputs.write_text("a lie\n")
  (tmp_path / "link.txt").symlink_to(inputs)
  before = {p: p.read_bytes() for p in pathlib.Path(tiny_export).rglob("*") if p.is_file()}
  _no_work(monkeypatch)
  for output in (inputs, tmp_path / "link.txt"):
    assert cli.main(["infer", CORE, f"--gin.MODEL_DIR={tiny_export}",
                     f"--gin.INFER_INPUT={inputs}", f"--gin.INFER_OUTPUT={output}"]) == 2
    assert f"INFER_OUTPUT {output} is the INFER_INPUT file" in _one_error_line(capsys)
  assert inputs.read_text() == "a lie\n"
  for output, flags in ((tiny_export, []), (tiny_export, ["--overwrite"]),
                        (f"{tiny_export}/sub", [])):
    assert cli.main(["export", f"--model_dir={tiny_export}", f"--output={output}",
                     *flags]) == 2
    assert f"--output {output} is inside the model directory" in _one_error_line(capsys)
  after = {p: p.read_bytes() for p in pathlib.Path(tiny_export).rglob("*") if p.is_file()}
  assert after == before


# --- 10. infer: one output line per input line, truncation reported. ---------------------------


def test_infer_keeps_blank_lines_and_reports_truncation(tmp_path, tiny_export, capsys):
  inputs = tmp_path / "in.txt"
  long_line = "helping a friend move house " * 6
  inputs.write_text(f"a lie\n\n{long_line}\n  \n")
  output = tmp_path / "out.jsonl"
  assert cli.main(["infer", CORE, "--gin_file=gin/decoding/greedy.gin",
                   "--gin.MAX_DECODE_LENGTH=3", f"--gin.MODEL_DIR={tiny_export}",
                   f"--gin.INFER_INPUT={inputs}", f"--gin.INFER_OUTPUT={output}",
                   "--gin.runs.infer_run.input_length=8",
                   "--gin.runs.infer_run.batch_size=2"]) == 0
  rows = [json.loads(line) for line in output.read_text().splitlines()]
  assert [r["input"] for r in rows] == ["a lie", "", long_line, ""]
  assert [len(r["predictions"]) for r in rows] == [1, 0, 1, 0]
  err = capsys.readouterr().err
  assert "1 of 2 inputs are longer than input_length=8 tokens" in err, err
  assert "are truncated to 8" in err


# --- 11. Chat input that is not UTF-8: said, skipped, conversation goes on. --------------------


def _stdin(monkeypatch, data: bytes) -> None:
  # What a pipe gives Python in a C / C.UTF-8 locale: undecodable bytes as surrogates.
  monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8",
                                                     errors="surrogateescape"))


class _FakeClarifySession:
  """Stands in for the three models; encodes text strictly, as SentencePiece needs."""

  def turn(self, situation, answer_fn, turn):
    situation.encode("utf-8")
    answer = answer_fn(situation, "why?", "okay")
    if not answer:
      return None
    answer.encode("utf-8")
    return {"turn": turn, "situation": situation, "fused_situation": f"{situation}, {answer}",
            "new_judgment": "okay"}


@pytest.mark.parametrize("method", ["diamante", "clarify"])
def test_chat_skips_input_that_is_not_utf8(method, tmp_path, demo_vocab_path, monkeypatch,
                                           capsys):
  transcript = tmp_path / "chat.jsonl"
  if method == "diamante":
    # The model is not what is tested: a reply made after the real SentencePiece encoding
    # (which failed on the bad line).
    vocabulary = vocab_lib.get_vocabulary(demo_vocab_path)
    monkeypatch.setattr(bundle_lib, "load",
                        lambda _, **kwargs: types.SimpleNamespace(vocabulary=vocabulary))

    def respond(bundle, contexts, **kwargs):
      del kwargs
      for context in contexts:
        for utterance in context:
          bundle.vocabulary.encode(utterance)
      return [inference.Reply("ok", 0.0, (inference.Candidate("ok", 0.0, 0.0),))]
    monkeypatch.setattr(inference, "respond", respond)
    _stdin(monkeypatch, b"hi there\n\xff\xfe bad\nhow are you\n/quit\n")
    argv = ["diamante", "chat", f"--model_dir={tmp_path}", f"--transcript_path={transcript}"]
  else:
    from jaxmoral.clarify import chat  # pylint: disable=g-import-not-at-top
    monkeypatch.setattr(chat, "_session", lambda **kwargs: _FakeClarifySession())
    _stdin(monkeypatch, b"lying\n\xc3\x28 bad\nto a friend\n\n")
    # Folders that exist: input paths are checked before any model loads.
    argv = ["clarify", "chat", f"--question_model_dir={tmp_path}",
            f"--fusion_model_dir={tmp_path}", f"--judge_model_dir={tmp_path}",
            f"--transcript_path={transcript}"]
  assert cli.main(argv) == 0
  assert "input is not valid UTF-8; skipped" in capsys.readouterr().err
  records = [json.loads(line) for line in transcript.read_text().splitlines()]
  if method == "diamante":
    assert [r["text"] for r in records if r["speaker"] == "user"] == ["hi there", "how are you"]
  else:
    assert [r["fused_situation"] for r in records] == ["lying, to a friend"]


# --- 12. Mistyped run counts name the flag's macro, before anything is written. ----------------


@pytest.mark.parametrize("flag, message", [
    ("--gin.TRAIN_STEPS=abc", "train_steps (TRAIN_STEPS) must be a positive integer, got 'abc'"),
    ("--gin.TRAIN_STEPS=0", "train_steps (TRAIN_STEPS) must be a positive integer, got 0"),
    ("--gin.BATCH_SIZE=1.5", "batch_size (BATCH_SIZE) must be a positive integer, got 1.5"),
])
def test_bad_run_counts_name_the_macro(flag, message, tmp_path, capsys):
  model_dir = tmp_path / "run"
  # The Diamante config trains at a constant rate: nothing but train_run reads TRAIN_STEPS.
  assert cli.main(["diamante", "train", DIAMANTE, f"--gin.MODEL_DIR={model_dir}", flag]) == 2
  assert message in capsys.readouterr().err
  assert not model_dir.exists()


def test_a_data_cache_for_other_lengths_is_one_line(tmp_path, capsys):
  """`jaxmoral cache` without DATA_CACHE, and a run over a cache written for other
  TASK_FEATURE_LENGTHS: one line each, naming the flag or the field."""
  flags = ["--gin_file=configs/core/tiny_cpu.gin", f"--gin.MODEL_DIR='{tmp_path / 'run'}'"]
  assert cli.main(["cache", *flags]) == 2
  assert "--gin.DATA_CACHE=" in _one_error_line(capsys)
  cache = f"--gin.DATA_CACHE='{tmp_path / 'cache'}'"
  assert cli.main(["cache", *flags, cache]) == 0
  capsys.readouterr()
  assert cli.main(["train", *flags, cache,
                   "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 24}"]) == 2
  assert "holds rows for feature_lengths=" in _one_error_line(capsys)
  assert not (tmp_path / "run").exists()


# --- 13. A shipped config's relative data paths work from any working directory. ---------------


def test_shipped_config_reads_its_data_from_another_directory(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  # As for the `jaxmoral` command: the project root is not on sys.path (`python -m pytest`
  # puts it there, and gin's package-path lookup then fails on the namespace `configs`).
  monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(ROOT))])
  gin_utils.parse_gin(gin_utils.GinArgs(files=("configs/diamante/tiny_cpu.gin",),
                                        bindings=("MODEL_DIR = 'run'",)))
  data = diamante_data.DialogueData()  # pylint: disable=no-value-for-parameter
  assert pathlib.Path(data.train_path) == ROOT / "jaxmoral/data/demo/dialogues_train.jsonl"
  assert diamante_data.read_dialogues(data.train_path)
  # A path that exists relative to the working directory keeps meaning that file.
  gin.clear_config()
  own = tmp_path / "jaxmoral/data/demo/dialogues_train.jsonl"
  own.parent.mkdir(parents=True)
  own.write_text("")
  gin_utils.parse_gin(gin_utils.GinArgs(files=("configs/diamante/tiny_cpu.gin",),
                                        bindings=("MODEL_DIR = 'run'",)))
  assert diamante_data.DialogueData().train_path == "jaxmoral/data/demo/dialogues_train.jsonl"  # pylint: disable=no-value-for-parameter


# --- 16, 17. Start-up: --help of everything, no TPU runtime on a machine without one. ----------


@pytest.mark.parametrize("argv", [
    ["diamante", action, "--help"] for action in
    ("train", "candidates", "eval", "chat", "self_chat", "demo")] + [
        ["npov", action, "--help"] for action in ("detect", "evaluate", "demo")] + [
            ["clarify", action, "--help"] for action in
            ("train-model", "train-ppo", "evaluate", "chat", "chat-file", "demo")])
def test_every_action_prints_its_usage(argv, capsys):
  try:
    code = cli.main(argv)
  except SystemExit as exit_info:  # argparse's own --help
    code = exit_info.code or 0
  assert code == 0
  out = capsys.readouterr().out
  assert out.startswith(f"usage: jaxmoral {' '.join(argv[:2])}"), out


def test_jax_platforms_leave_out_an_absent_tpu(monkeypatch):
  monkeypatch.setattr(runtime, "_TPU_DEVICES", (str(ROOT / "no_such_device*"),))
  monkeypatch.setattr(runtime, "_NVIDIA_DEVICES", (str(ROOT / "no_such_gpu"),))
  monkeypatch.setattr(runtime, "_installed", lambda module: module == "libtpu")
  environ = {}
  assert runtime.platforms_without_absent_tpu(environ) == "cpu" and environ == {
      "JAX_PLATFORMS": "cpu"}
  environ = {"JAX_PLATFORMS": ""}  # The user's choice (here: JAX's automatic one) stays.
  assert (runtime.platforms_without_absent_tpu(environ) is None
          and environ == {"JAX_PLATFORMS": ""})
  monkeypatch.setattr(runtime, "_TPU_DEVICES", (str(ROOT / "README*"),))  # "A TPU is here."
  assert runtime.platforms_without_absent_tpu({}) is None


def test_compile_only_libtpu_gets_host_settings_only_where_no_tpu_is_attached(monkeypatch):
  monkeypatch.setattr(runtime, "_TPU_DEVICES", (str(ROOT / "no_such_device*"),))
  environ = {"TPU_WORKER_HOSTNAMES": "10.0.0.2"}  # The user's value stays.
  assert runtime.quiet_compile_only_tpu(environ) == ["TPU_SKIP_MDS_QUERY", "TPU_ACCELERATOR_TYPE"]
  assert environ["TPU_WORKER_HOSTNAMES"] == "10.0.0.2" and environ["TPU_SKIP_MDS_QUERY"] == "1"
  monkeypatch.setattr(runtime, "_TPU_DEVICES", (str(ROOT / "README*"),))  # "A TPU is here."
  environ = {}
  assert runtime.quiet_compile_only_tpu(environ) == [] and environ == {}


def test_help_starts_without_the_tpu_runtime():
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  for argv in (["--help"], ["diamante", "chat", "--help"]):
    done = subprocess.run([sys.executable, "-m", "jaxmoral.cli", *argv], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: jaxmoral")
    assert "TPU" not in done.stderr and "libtpu" not in done.stderr, done.stderr
