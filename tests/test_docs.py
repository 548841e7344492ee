"""Every documented command runs as written.

Where commands are found, and how they are marked (what `documented_commands` relies on):

- Markdown (README.md, docs/*.md): every line of a fenced block whose info string is `sh`
  (```sh). A trailing `\\` continues a line; `  # ...` after a command is a comment. Other
  blocks (```python, a plain ``` layout block) hold no commands.
- gin files (configs/**/*.gin, gin/**/*.gin): the comment lines of the header (those before
  the first line that is not a comment) whose text after `#` and spaces starts with
  `jaxmoral `, `python ` or `launch/`; a trailing `\\` continues it on the next comment line.

Placeholders (`PLACEHOLDERS`, filled in before a command runs): `BASE`, `PROMPT`, `PROMPT_H`,
`PROMPT_C`, `RUN`, `NAME`, `ZONE`, `BUCKET`, `responses.jsonl`, `kb.jsonl`, `dialogues.jsonl`,
`test.jsonl`, `situations.jsonl`, a value `...` (any value), `configs/...` (a config: the tiny
one) and a bare `...` argument (the rest of a command: the tiny config and a MODEL_DIR).

What runs in full, each long command through a tiny variant of itself (the same command with
flags appended that shorten it: fewer steps, one layer a side, shorter rows):

- Here, in-process through `cli.main` and on one shared tiny run, the quickstart of the
  README's first screen: train (`SHORTER`: a few steps instead of 300, same flags otherwise),
  infer on the shipped examples/inputs.txt, export for transformers (and its files' modes),
  TensorBoard reading the run; then every other documented command on that run (/tmp/tiny:
  eval, infer with each `gin/decoding` fragment, a bfloat16 export); and the commands the docs
  once broke that need no trained model (a gin-less `clarify train-model --which=judge`, in
  `test_clarify_judge_defaults_*`); the commands that load no model (ROUGE-1 detection and
  evaluation).
- Here as well, each method's chain as the docs give it, its trainings made short the same
  way (`SHORTER`), outputs under /tmp into the test's folder: Diamante's (train, the NLL-only
  ablation, the candidate generator, candidates, eval, chat with a scripted user, self-chat),
  ClarifyDelphi's (train-model without and with a config, train-ppo, evaluate, chat with a
  scripted user, chat-file) and NPOV's model-based detectors' (BASE, its PROMPT, PROMPT_H and
  PROMPT_C by `npov train-classifier`, `npov detect` with salience, its heat maps and ROC
  curves, and with the classifiers, `npov evaluate --prompts_dir=RUN` over a RUN laid out as
  `npov demo`'s workdir, of those runs); and docs/cli.md's `jaxmoral cache` with the `train`
  that reads the cache.
- tests/test_docs_services.py: the method demos, the fine-tune from a Hub id (offline, from a
  Hub cache holding a stand-in), both `jaxmoral explore` commands (served and fetched), the
  commands on a bucket (against the storage emulator), the local two-process launch
  (`launch/local.sh`) and every pod compile (a tiny model with the pod config's partitioning,
  compiled for its topology's chips).
- tests/test_docs_experiments.py: the pretraining commands (on the demo corpus) and each
  experiment script's smoke command, end to end from that tiny base, on data laid out as
  ../shared/data that the test writes from the demo corpus.
- Every other command is dry-run, exactly as written but for the placeholders: parsed as the
  command line parses it, its gin files and bindings parsed and checked (files found from
  another folder than the project root, `%gin.REQUIRED` values given, no unread macro), an
  action's flags bound and its outputs checked writable (`action_commands.bind_action`, all
  that `run_action` does before the work; a `compile`, up to its first lowering:
  `aot.plan_compile`). These include the full-size variants of what runs in full above
  (the pod compiles; the experiments, hours each), and the experiment configs other than the
  configs of record (ablations and earlier configs: their smoke variants take 4-30 s each).
  `python experiments/X.py`: the script's gin files and bindings as `experiment_lib.main`
  parses them, after its configurables are imported. `launch/gpu.sh` and
  `launch/tpu_pod.sh ... -- CMD`: CMD, as the launcher runs it on each host (the launchers
  themselves reach hardware, GPU hosts and a TPU pod: tests/test_launch.py runs them with
  stand-ins for `gcloud` and the hosts). `make`, `. .venv/bin/activate`
  and `tensorboard`: the tool is there (`make test` is this suite, `make demo` runs the
  demos).
"""

from __future__ import annotations

import importlib
import io
import json
import os
import pathlib
import re
import shlex
import stat
import subprocess
import sys
from typing import Iterable, Optional

import gin
import pytest

from jaxmoral import action_commands, cli, gin_utils

# What runs is tested here, not how it is sharded (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("one_device")

ROOT = pathlib.Path(__file__).resolve().parents[1]
COMMAND_START = re.compile(r"^(jaxmoral|python|launch/|make|tensorboard|\. )")

# Values of the documented placeholders: {placeholder word: value}; PATH-like ones are files the
# package ships, the others any value the dry run accepts.
PLACEHOLDERS = {
    "responses.jsonl": "jaxmoral/data/demo/npov_examples.jsonl",
    "kb.jsonl": "jaxmoral/data/demo/npov_kb.jsonl",
    "dialogues.jsonl": "jaxmoral/data/demo/dialogues.jsonl",
    "test.jsonl": "jaxmoral/data/demo/dialogues_test.jsonl",
    "situations.jsonl": "situations.jsonl",
    "BASE": "/tmp/base_run", "PROMPT": "/tmp/prompt", "PROMPT_H": "/tmp/prompt_h",
    "PROMPT_C": "/tmp/prompt_c", "RUN": "/tmp/npov_run", "NAME": "pod", "ZONE": "zone",
    "BUCKET": "bucket", "configs/...": "configs/core/tiny_cpu.gin",
}
REST_OF_COMMAND = ["--gin_file=configs/core/tiny_cpu.gin", "--gin.MODEL_DIR=/tmp/docs_run"]
# Flags appended to a command run in full, to make it short (the rest is as written).
ONE_LAYER = ["--gin.config.t5_config.num_encoder_layers=1",
             "--gin.config.t5_config.num_decoder_layers=1"]
_FEW_STEPS = ["--gin.TRAIN_STEPS=4", "--gin.CHECKPOINT_EVERY=4", "--gin.BATCH_SIZE=8",
              *ONE_LAYER]
SHORTER = {"train": [*_FEW_STEPS, "--gin.EVAL_EVERY=4", "--gin.WARMUP_STEPS=1"],
           "diamante train": _FEW_STEPS,
           "clarify train-model": ["--train_steps=4", "--batch_size=8", *ONE_LAYER],
           "clarify train-ppo": ["--num_iterations=1"],
           "npov train-classifier": ["--train_steps=4", "--batch_size=8", "--max_examples=4"],
           "npov evaluate": ["--max_examples=1"]}


def _markdown_commands(path: pathlib.Path) -> list[tuple[str, str]]:
  commands, in_sh, pending, start = [], False, "", 0
  for number, line in enumerate(path.read_text().splitlines(), 1):
    if line.startswith("```"):
      in_sh = not in_sh and line.strip() == "```sh"
      continue
    if not in_sh:
      continue
    text = re.sub(r"\s+#\s.*$", "", line).rstrip()
    if not pending:
      start = number
    if text.endswith("\\"):
      pending += text[:-1] + " "
      continue
    text = re.sub(r"\s+", " ", pending + text).strip()
    pending = ""
    if text and not text.startswith("#"):
      commands.append((f"{path.relative_to(ROOT)}:{start}", text))
  return commands


def _gin_header_commands(path: pathlib.Path) -> list[tuple[str, str]]:
  commands, pending, start = [], "", 0
  for number, line in enumerate(path.read_text().splitlines(), 1):
    if not line.startswith("#"):
      break
    text = line[1:].strip()
    if pending:
      text = pending + text
    elif COMMAND_START.match(text) and not text.startswith(("make", ". ")):
      start = number
    else:
      continue
    if text.endswith("\\"):
      pending = text[:-1].rstrip() + " "
      continue
    pending = ""
    commands.append((f"{path.relative_to(ROOT)}:{start}", text))
  return commands


def documented_commands() -> list[tuple[str, str]]:
  """(where, command line) of every documented command, in file order."""
  commands = []
  for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
    commands += _markdown_commands(path)
  for folder in ("configs", "gin"):
    for path in sorted((ROOT / folder).rglob("*.gin")):
      commands += _gin_header_commands(path)
  return commands


def _words(command: str) -> list[str]:
  """The command's words with the placeholders filled in."""
  words = []
  for word in shlex.split(command):
    if word == "...":
      words += REST_OF_COMMAND
      continue
    name, sep, value = word.partition("=") if word.startswith("-") else ("", "", word)
    if sep and value == "...":
      value = "/tmp/docs_placeholder"
    for placeholder, filled in PLACEHOLDERS.items():
      value = re.sub(rf"(?<![\w/.]){re.escape(placeholder)}(?![\w.])", filled, value)
    words.append(f"{name}{sep}{value}" if sep else (value or word))
  return words


def _dry_run_jaxmoral(argv: list[str]) -> None:
  """What `cli.main` checks before any work, for one jaxmoral command line."""
  flags, argv = cli.split_flags(argv, cli.LINE_FLAGS)
  gin_args, rest = gin_utils.split_gin_args(argv)
  args = cli._parser().parse_args(rest)  # pylint: disable=protected-access
  gin.clear_config()
  if args.command in cli.GIN_COMMANDS:
    module, function, _ = cli.GIN_COMMANDS[args.command]
    importlib.import_module(module)
    gin_utils.parse_gin(gin_args)
    gin_utils.check_required()
  elif args.command == "compile":
    aot = importlib.import_module("jaxmoral.aot")
    gin_utils.parse_gin(gin_args)
    # Up to the first lowering: the topology, the run's target, its program on the topology's
    # devices and the stages, as `compile_for_topology` plans them.
    bound = gin.get_bindings("aot.compile_for_topology", resolve_references=False)
    try:
      aot.plan_compile(topology=args.topology, **{k: bound[k] for k in (
          "target", "num_slices", "stages") if k in bound})
    except ValueError as error:  # A machine without libtpu stops at the topology.
      if "needs libtpu" not in str(error):
        raise
    except FileNotFoundError as error:
      # A pod config's data under ../shared (the ClarifyDelphi target reads its vocabulary): a
      # user's clone has none, and the error names it before any lowering.
      if "../shared/" not in str(error) or (ROOT.parent / "shared").is_dir():
        raise
  elif args.command in cli.METHOD_COMMANDS:
    method = importlib.import_module(f"jaxmoral.{args.command}.commands")
    action_commands.bind_action(
        method.ACTIONS, method.OUTPUTS, args.action, args.rest, gin_args,
        prog=f"jaxmoral {args.command} {args.action}",
        configurable_modules=getattr(method, "CONFIGURABLE_MODULES", ()))
  gin.clear_config()


def _dry_run_experiment(script: str, argv: list[str]) -> None:
  sys.path.insert(0, str(ROOT / "experiments"))
  try:
    importlib.import_module(pathlib.Path(script).stem)
  finally:
    sys.path.remove(str(ROOT / "experiments"))
  gin_args, rest = gin_utils.split_gin_args(argv)
  assert not rest and gin_args.files, f"not an experiment command line: {argv}"
  gin.clear_config()
  gin_utils.parse_gin(gin_args)
  gin_utils.check_required()
  gin.clear_config()


def dry_run(command: str) -> None:
  """Checks one documented command up to the point where it would start work."""
  words = _words(command)
  if words[0] == "jaxmoral":
    _dry_run_jaxmoral(words[1:])
  elif words[0] == "python" and words[1].startswith("experiments/"):
    assert (ROOT / words[1]).is_file(), words[1]
    _dry_run_experiment(words[1], words[2:])
  elif words[0].startswith("launch/"):
    assert os.access(ROOT / words[0], os.X_OK), f"{words[0]} is not an executable launcher"
    _dry_run_jaxmoral(words[words.index("--") + 1:])
  elif words[0] == "make":
    targets = re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert all(w in targets for w in words[1:]), f"no make target {words[1:]}"
  elif words[0] == ".":
    assert words[1] == ".venv/bin/activate"  # What `make` creates.
  elif words[0] == "tensorboard":
    assert importlib.util.find_spec("tensorboard") is not None, "tensorboard is not installed"
  else:
    raise AssertionError(f"no rule to check {command!r}")


COMMANDS = documented_commands()


def test_the_extractor_finds_the_documented_commands():
  where = [w for w, _ in COMMANDS]
  texts = [c for _, c in COMMANDS]
  assert len(COMMANDS) > 60
  assert any(w.startswith("README.md") for w in where)
  assert any(w.startswith("configs/") for w in where)
  assert any(w.startswith("gin/") for w in where)
  # A continued line is one command; a comment after a command is not part of it.
  assert ("jaxmoral clarify train-ppo --gin_file=configs/clarify/tiny_cpu.gin --model_dir=/tmp/ppo "
          "--question_model_dir=/tmp/m --answer_model_dir=/tmp/m --fusion_model_dir=/tmp/m "
          "--judge_model_dir=/tmp/m --nli_model_dir=/tmp/m") in texts
  assert all("#" not in c.split("'")[0] for c in texts)


@pytest.fixture(autouse=True)
def _from_another_folder(tmp_path, monkeypatch):
  """Documented commands work from any folder: they run in an empty one."""
  monkeypatch.chdir(tmp_path)
  yield
  gin.clear_config()


def test_every_documented_command_passes_its_dry_run():
  failures = []
  for where, command in COMMANDS:
    try:
      dry_run(command)
    except (Exception, SystemExit) as error:  # pylint: disable=broad-except
      failures.append(f"{where}: {command}\n    {type(error).__name__}: "
                      f"{cli.user_error_message(error) or error}")
  assert not failures, "\n".join(failures)


def test_a_broken_command_fails_its_dry_run():
  with pytest.raises(ValueError, match="never read"):
    dry_run("jaxmoral train --gin_file=configs/core/tiny_cpu.gin --gin.MODEL_DIR=/tmp/x "
            "--gin.TRAIN_STEP=5")
  with pytest.raises(ValueError, match="num_randm"):
    dry_run("jaxmoral diamante eval --model_dir=/tmp/dm --test_path=test.jsonl --num_randm=3")
  with pytest.raises(FileNotFoundError):
    dry_run("jaxmoral train --gin_file=configs/core/no_such.gin --gin.MODEL_DIR=/tmp/x")


def _quickstart() -> list[list[str]]:
  """The README's first-screen jaxmoral commands, MODEL_DIR and outputs under `tmp`."""
  lines = (ROOT / "README.md").read_text().splitlines()
  first_screen = next(i for i, line in enumerate(lines, 1) if line.startswith("## "))
  return [_words(c) for w, c in COMMANDS if w.startswith("README.md:")
          and int(w.split(":")[1]) < first_screen and c.startswith(("jaxmoral", "tensorboard"))]


def test_the_quickstart_runs_in_full(tmp_path, capsys):
  commands = _quickstart()
  assert [c[:2] for c in commands] == [["jaxmoral", "train"], ["jaxmoral", "infer"],
                                       ["jaxmoral", "export"], ["tensorboard", "--logdir"]]
  run_dir = str(tmp_path / "tiny")

  def here(words: list[str]) -> list[str]:
    # /tmp/tiny... -> this test's folder; examples/inputs.txt from the project root (the
    # README's commands run there), the rest exactly as written.
    return [w.replace("/tmp/tiny", run_dir).replace("examples/", f"{ROOT}/examples/")
            for w in words]

  train, infer, export, tensorboard = (here(c) for c in commands)
  assert cli.main(train[1:] + SHORTER["train"]) == 0
  gin.clear_config()
  assert cli.main(infer[1:]) == 0
  gin.clear_config()
  lines = pathlib.Path(run_dir, "predictions.jsonl").read_text().splitlines()
  assert len(lines) == len((ROOT / "examples/inputs.txt").read_text().splitlines())
  assert cli.main(export[1:]) == 0
  exported = pathlib.Path(export[export.index("--output") + 1] if "--output" in export else
                          next(w.split("=", 1)[1] for w in export if w.startswith("--output=")))
  modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in exported.iterdir() if p.is_file()}
  assert "model.safetensors" in modes and len(set(modes.values())) == 1, modes
  # TensorBoard reads the run's event files.
  # pylint: disable-next=g-import-not-at-top
  from tensorboard.backend.event_processing import event_multiplexer
  logdir = tensorboard[tensorboard.index("--logdir") + 1]
  multiplexer = event_multiplexer.EventMultiplexer().AddRunsFromDirectory(logdir)
  multiplexer.Reload()
  assert any("loss" in tag for run in multiplexer.Runs().values() for tag in run["scalars"])
  # Every other documented command on that run (/tmp/tiny) runs in full as well: evaluation,
  # beam search, inference writing into the working folder, a bfloat16 export.
  quickstart = {" ".join(c) for c in commands}
  others = list(dict.fromkeys(c for _, c in COMMANDS if c.startswith("jaxmoral ")
                              and "/tmp/tiny" in c and c not in quickstart))
  assert {_words(c)[1] for c in others} == {"eval", "infer", "export"}, others
  inputs = len((ROOT / "examples/inputs.txt").read_text().splitlines())
  for command in others:
    words = here(_words(command))
    assert cli.main(words[1:]) == 0, command
    gin.clear_config()
    for word in words:
      value = word.split("=", 1)[-1].strip("'\"")
      if word.startswith("--gin.INFER_OUTPUT="):
        assert len(pathlib.Path(value).read_text().splitlines()) == inputs, command
      if word.startswith("--output="):
        assert (pathlib.Path(value) / "params").is_dir() or any(
            pathlib.Path(value).glob("*.safetensors")), command


def checkpoint_steps(run_dir: pathlib.Path) -> list[int]:
  """The steps a run directory holds checkpoints of."""
  return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


def _needs_no_model(command: str) -> bool:
  """A documented `npov` command that loads no model (ROUGE-1 alone), so it runs in full."""
  words = _words(command)
  return (words[:3] in (["jaxmoral", "npov", "detect"], ["jaxmoral", "npov", "evaluate"])
          and not any(w.startswith(("--base_dir", "--prompts_dir")) for w in words)
          and any("rouge" in w for w in words))


def _in_full(command: str, folder: pathlib.Path) -> list[str]:
  """A documented command's words for a run in full: /tmp/ paths into `folder`, the shipped
  inputs from the project root, a training made short (`SHORTER`)."""
  words = [w.replace("=/tmp/", f"={folder}/").replace("'/tmp/", f"'{folder}/")
           .replace("=jaxmoral/data/", f"={ROOT}/jaxmoral/data/") for w in _words(command)]
  kind = " ".join(words[1:3]) if words[1] in cli.METHOD_COMMANDS else words[1]
  return words + SHORTER.get(kind, [])


def _run_chain(commands: list[str], folder: pathlib.Path, monkeypatch,
               user_lines: str = "", inputs: Optional[dict[str, str]] = None) -> None:
  """Runs `commands` in full, in order (`_in_full`); `user_lines` are what a user types, and
  `inputs` gives placeholders other values than `PLACEHOLDERS` ({filled value: this one})."""
  for command in commands:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(user_lines.encode())))
    words = _in_full(command, folder)
    for old, new in (inputs or {}).items():
      words = [w.replace(old, new) for w in words]
    assert cli.main(words[1:]) == 0, command
    gin.clear_config()


def _chain(prefixes: tuple[str, ...]) -> list[str]:
  """The documented commands that start with one of `prefixes`, each once, trainings first."""
  commands = _once(c for _, c in COMMANDS if c.startswith(prefixes))
  return sorted(commands, key=lambda c: " train " not in f"{c} ")


def _once(commands: Iterable[str]) -> list[str]:
  """Each command once: two that are the same once their placeholders are filled are one."""
  return list({tuple(_words(c)): c for c in commands}.values())


def test_the_documented_diamante_commands_run_in_full(tmp_path, monkeypatch):
  commands = _chain(("jaxmoral diamante",))
  assert {_words(c)[2] for c in commands} == {"train", "candidates", "eval", "chat",
                                              "self_chat"}, commands
  _run_chain(commands, tmp_path, monkeypatch, user_lines="hello there\n/quit\n")
  assert {p.name for p in tmp_path.iterdir()} >= {"dm", "dm_nll", "gen", "chat.jsonl",
                                                  "self.jsonl", "with_candidates.jsonl"}
  chat = [json.loads(line) for line in (tmp_path / "chat.jsonl").read_text().splitlines()]
  assert [r["speaker"] for r in chat] == ["user", "bot"] and chat[0]["text"] == "hello there"
  dialogues = (ROOT / PLACEHOLDERS["dialogues.jsonl"]).read_text().splitlines()
  with_candidates = (tmp_path / "with_candidates.jsonl").read_text().splitlines()
  assert len(with_candidates) == len(dialogues)


def test_the_documented_clarify_commands_run_in_full(tmp_path, monkeypatch):
  """docs/methods.md's chain, which the tiny config's header repeats (a multitask model, PPO
  over it, NLI-filtered), with a user who gives the chat a situation, answers its first
  question and ends it with an empty answer; the demo runs in tests/test_docs_services.py."""
  commands = [c for c in _chain(("jaxmoral clarify",)) if " demo " not in f"{c} "]
  assert {_words(c)[2] for c in commands} == {"train-model", "train-ppo", "evaluate", "chat",
                                              "chat-file"}, commands
  (tmp_path / PLACEHOLDERS["situations.jsonl"]).write_text(
      '{"situation": "lying to a friend"}\n{"situation": "skipping class"}\n')
  _run_chain(commands, tmp_path, monkeypatch,
             user_lines="lying to a friend\nto protect them\n\n")
  evaluation = json.loads((tmp_path / "evaluation.json").read_text())
  assert {"why", "finetuned", "ppo"} <= set(evaluation) and evaluation["ppo"]["samples"]
  chat = [json.loads(line) for line in (tmp_path / "clarify_chat.jsonl").read_text().splitlines()]
  assert chat and chat[0]["answer"] == "to protect them", chat
  transcripts = [json.loads(line) for line in
                 (tmp_path / "transcripts.jsonl").read_text().splitlines()]
  assert sorted({t["conversation"] for t in transcripts}) == [0, 1], transcripts


def test_the_documented_npov_model_commands_run_in_full(tmp_path, monkeypatch):
  """BASE, PROMPT, PROMPT_H and PROMPT_C, and the salience and classifier detectors over them,
  as docs/methods.md and the prompt tuning header give them."""
  base_and_prompt = [c for _, c in COMMANDS if c.startswith("jaxmoral train ")
                     and ("/tmp/base_run" in c or "/tmp/prompt" in c)]
  classifiers = [c for _, c in COMMANDS if c.startswith("jaxmoral npov train-classifier")]
  detect = [c for _, c in COMMANDS if c.startswith("jaxmoral npov detect")
            and ("--detector=salience" in c or "--detector=classifier" in c)]
  evaluate = [c for _, c in COMMANDS if c.startswith("jaxmoral npov evaluate")
              and "--prompts_dir=RUN" in c]
  commands = _once(base_and_prompt + classifiers + detect + evaluate)
  assert len(commands) == 7, commands
  # RUN: a folder laid out as `npov demo`'s workdir, of the runs the chain trains.
  run = tmp_path / PLACEHOLDERS["RUN"].removeprefix("/tmp/")
  run.mkdir()
  for name, target in (("generator", "prompt"), ("classifier_hallucination", "prompt_h"),
                       ("classifier_coverage", "prompt_c")):
    (run / name).symlink_to(tmp_path / target)
  # responses.jsonl: four of the shipped examples, labelled, so that --roc_dir has curves to
  # draw (the shipped file has no labels).
  responses = tmp_path / "labelled.jsonl"
  rows = [json.loads(line) for line in
          (ROOT / PLACEHOLDERS["responses.jsonl"]).read_text().splitlines()[:4]]
  responses.write_text("".join(
      json.dumps({**row, "hallucination": i % 2, "coverage": i // 2}) + "\n"
      for i, row in enumerate(rows)))
  _run_chain(commands, tmp_path, monkeypatch,
             inputs={str(ROOT / PLACEHOLDERS["responses.jsonl"]): str(responses)})
  # The classifier detection ran after the salience one: its scores replaced them.
  scores = [json.loads(line) for line in (tmp_path / "scores.jsonl").read_text().splitlines()]
  assert len(scores) == len(rows), scores
  assert all(0 <= s[e] <= 1 for s in scores for e in ("hallucination", "coverage")), scores
  assert len(list((tmp_path / "heatmaps").glob("*.html"))) == len(rows)
  assert (tmp_path / "roc" / "results.json").is_file()
  for error in ("hallucination", "coverage"):
    pairs = (tmp_path / f"prompt_{error[0]}" / "data" / "train.jsonl").read_text().splitlines()
    assert {json.loads(p)["targets"] for p in pairs} == {"yes", "no"}, error
  results = json.loads((tmp_path / "npov_eval" / "results.json").read_text())
  assert {"rouge", "salience"} <= {d for by_detector in results.values() for d in by_detector}


def test_the_documented_data_cache_commands_run_in_full(tmp_path, monkeypatch):
  """docs/cli.md's `jaxmoral cache` and the `train` that reads its cache, as written."""
  commands = _once(c for _, c in COMMANDS if "--gin.DATA_CACHE=\"'/tmp/cache'\"" in c)
  assert [_words(c)[1] for c in commands] == ["cache", "train"], commands
  _run_chain(commands, tmp_path, monkeypatch)
  assert any((tmp_path / "cache").iterdir())
  assert (tmp_path / "run" / "checkpoints").is_dir()


def test_the_documented_commands_without_a_model_run_in_full(tmp_path):
  """The ROUGE-1 detection and evaluation commands, as written, from an empty folder: the
  placeholder inputs are the shipped demo files; PERSPECTRUM (../shared) where it is present."""
  commands = list(dict.fromkeys(c for _, c in COMMANDS if _needs_no_model(c)))
  assert {_words(c)[2] for c in commands} == {"detect", "evaluate"}, commands
  for command in commands:
    # Shipped inputs from the project root; outputs under /tmp into this test's folder.
    words = [w.replace("=/tmp/", f"={tmp_path}/").replace("=jaxmoral/data/",
                                                           f"={ROOT}/jaxmoral/data/")
             for w in _words(command)]
    if any("perspectrum" in w for w in words) and not (ROOT.parent / "shared/data").is_dir():
      continue  # A user's clone has no PERSPECTRUM; shared_dir's tests say so.
    assert cli.main(words[1:]) == 0, command
    gin.clear_config()
    for word in words:
      if word.startswith("--output_path="):
        lines = pathlib.Path(word.split("=", 1)[1]).read_text().splitlines()
        assert len(lines) == len((ROOT / PLACEHOLDERS["responses.jsonl"]).read_text(
            ).splitlines()), command
      if word.startswith("--output_dir="):
        assert any(pathlib.Path(word.split("=", 1)[1]).glob("*.json")), command


def test_clarify_judge_defaults_fit_the_demo_vocabulary(tmp_path, capsys):
  """`clarify train-model --which=judge --source=demo` without a gin file (as docs/methods.md has
  it) picks judge classes of the demo vocabulary; classes that do not fit fail naming
  --judge_classes and leave no run directory behind."""
  from jaxmoral.clarify import formats, training  # pylint: disable=g-import-not-at-top
  bad = tmp_path / "bad"
  code = cli.main(["clarify", "train-model", "--which=judge", "--source=demo",
                   f"--model_dir={bad}", "--judge_classes=bad,ok,good"])
  assert code == 2 and "--judge_classes" in capsys.readouterr().err
  assert not bad.exists()
  gin.clear_config()
  written = {}
  original = training.runs.train_run
  try:
    training.runs.train_run = lambda **kwargs: written.update(kwargs) or {"loss": 0.0}
    assert cli.main(["clarify", "train-model", "--which=judge", "--source=demo",
                     f"--model_dir={tmp_path / 'judge'}"]) == 0
  finally:
    training.runs.train_run = original
  rows = (tmp_path / "judge" / "data" / "judge_train.jsonl").read_text()
  assert all(f'"{c}"' in rows for c in formats.DEMO_JUDGE_CLASSES)


def test_import_jaxmoral_is_quiet():
  env = {k: v for k, v in os.environ.items()
         if k not in ("JAX_PLATFORMS", "TF_CPP_MIN_LOG_LEVEL")}
  env["PYTHONPATH"] = str(ROOT)
  result = subprocess.run(
      [sys.executable, "-c", "import jaxmoral, jax; from jaxmoral import api; "
       "from jaxmoral.data import vocab; jax.devices()"],
      env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
  assert result.returncode == 0 and result.stderr == "", result.stderr


def test_experiments_write_their_results_to_workdir_unless_told():
  sys.path.insert(0, str(ROOT / "experiments"))
  try:
    experiment_lib = importlib.import_module("experiment_lib")
    importlib.import_module("diamante_fig3")
  finally:
    sys.path.remove(str(ROOT / "experiments"))
  config = gin.config._CONFIG  # pylint: disable=protected-access
  for extra, want in (([], "WORKDIR"), (["--gin.RESULTS_DIR='/r'"], "/r")):
    gin.clear_config()
    gin_args, _ = gin_utils.split_gin_args(
        ["--gin_file=configs/experiments/diamante_fig3_cpu.gin", "--gin.INIT_CHECKPOINT='/x'",
         *extra])
    gin_utils.parse_gin(gin_args)
    experiment_lib._results_in_workdir(gin_args)  # pylint: disable=protected-access
    if not extra:
      want = config[("WORKDIR", "gin.macro")]["value"]
    assert config[("RESULTS_DIR", "gin.macro")]["value"] == want != "experiments/results"
