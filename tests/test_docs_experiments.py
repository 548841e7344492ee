"""The documented pretraining and experiment commands run in full, on data the test writes.

tests/test_docs.py finds every documented command and dry-runs these (their hours); here they
run end to end as their tiny variant, the documented command with flags appended (the rest as
written, as `test_docs.SHORTER` makes a training short), in about a minute on 2 cores:

- Pretraining (`jaxmoral train --gin_file=configs/core/pretrain_span_corruption*.gin`, in
  README.md, docs/experiments.md and the configs' headers): once per config, through
  `cli.main`, with `TINY_PRETRAINING`: the demo corpus alone (no `../shared`: the data folder
  unset, the demo vocabulary), a 1-layer tiny T5 1.1, 4 steps of 8 rows of 32 / 8 tokens. The
  commands of one config differ only in what those flags set (MODEL_DIR, TRAIN_STEPS,
  BATCH_SIZE), so one of them stands for all; the smoke base (/tmp/pt_smoke) is the one run.
- The experiments' smoke commands (`python experiments/X.py ... --gin_file=..._smoke.gin
  --gin.INIT_CHECKPOINT="'/tmp/pt_smoke'"`, docs/experiments.md and the smoke configs'
  headers), for each of the four scripts, in-process as the script's `__main__` runs them
  (`experiment_lib.main`), from that tiny base, with `TINY_MODEL` (the base's model), WORKDIR
  in the test's folder (the results go there: RESULTS_DIR defaults to it) and the data flag
  of each (`DATA_FLAGS`: CHITCHAT_PATH, PERSPECTRUM_DIR, DATA_DIR) pointing at a folder laid
  out like `../shared/data`, which `write_shared_like_data` writes from the bundled demo
  corpus (jaxmoral/data/demo): δ-Clarify, silver and fusion files, PERSPECTRUM's three JSON
  files, and chitchat conversations in the layout of the chitchat package's `dataset.json`
  (so Diamante's experiment needs no `dialogue` extra). ClarifyDelphi's reward probe reads
  the runs of clarify_table4's smoke run, in the same WORKDIR: the two run as one chain.
  Each smoke command is that of the script's config of record (README.md's "Reproducing the
  papers"); the other configs of docs/experiments.md (ablations and earlier configs, a
  smoke run each of 4-30 s) are the dry run's, in tests/test_docs.py.
"""

from __future__ import annotations

import csv
import importlib
import json
import os
import pathlib
import sys
from typing import Any, Iterator

import gin
import pytest
import sentencepiece

import test_docs
from jaxmoral import cli
from jaxmoral import metric_writers
from jaxmoral.clarify import formats
from jaxmoral.data import demo
from jaxmoral.data import vocab

# What runs is tested here, not how it is sharded (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("one_device")

ROOT = test_docs.ROOT
PRETRAINING = "jaxmoral train --gin_file=configs/core/pretrain_span_corruption"
SMOKE_BASE = "pt_smoke"  # The base the smoke commands start from: /tmp/pt_smoke.
# The model of the tiny base and of every run from it.
TINY_MODEL = ["--gin.config.t5_config.size='tiny'", *test_docs.ONE_LAYER]
# Appended to a pretraining command: as docs/experiments.md says, without ../shared.
TINY_PRETRAINING = [*TINY_MODEL, "--gin.TRAIN_STEPS=4", "--gin.BATCH_SIZE=8",
                    "--gin.CHECKPOINT_EVERY=4",
                    "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}",
                    "--gin.DATA_DIR=None", "--gin.VOCABULARY_PATH=None",
                    "--gin.pretraining_corpus.register_pretraining_mixture.sources=['demo']"]
SCRIPTS = ("diamante_fig3", "npov_table1", "clarify_table4", "clarify_reward_probe",
           "clarify_best_of_n", "clarify_judge")
# Each script's data flag and its place in the folder `write_shared_like_data` writes.
DATA_FLAGS = {"diamante_fig3": ("CHITCHAT_PATH", "chitchat/dataset.json"),
              "npov_table1": ("PERSPECTRUM_DIR", "perspectrum"),
              "clarify_table4": ("DATA_DIR", ""), "clarify_reward_probe": ("DATA_DIR", ""),
              "clarify_best_of_n": ("DATA_DIR", ""), "clarify_judge": ("DATA_DIR", "")}
# The rest of each script's tiny variant. ClarifyDelphi's judge classes are one token each in
# the base's vocabulary, the demo one (`formats.DEMO_JUDGE_CLASSES`); NPOV's salience, a
# backward pass per 16 response tokens, is its slowest part.
_DEMO_JUDGE = [f"--gin.reward.RewardConfig.judge_classes={formats.DEMO_JUDGE_CLASSES!r}"]
TINY_EXTRA = {"diamante_fig3": [], "clarify_table4": _DEMO_JUDGE,
              "clarify_reward_probe": _DEMO_JUDGE, "clarify_best_of_n": _DEMO_JUDGE,
              "clarify_judge": _DEMO_JUDGE,
              "npov_table1": ["--gin.TASK_FEATURE_LENGTHS={'inputs': 64, 'targets': 64}",
                              "--gin.npov_table1.run_experiment.max_salience_examples=2"]}
# Every DEV_EVERY-th demo situation, and PERSPECTRUM claim, is held out.
DEV_EVERY = 5


def _tsv(path: pathlib.Path, rows: list[dict[str, str]]) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  with open(path, "w", newline="", encoding="utf-8") as f:
    writer = csv.DictWriter(f, fieldnames=list(rows[0]), delimiter="\t",
                            lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)


def write_shared_like_data(folder: pathlib.Path) -> pathlib.Path:
  """A folder laid out like `../shared/data` (its README), of the bundled demo corpus.

  - delta_clarify/{train,dev}.tsv: the demo questions (same columns), every `DEV_EVERY`-th
    situation in dev;
  - delta_clarify_silver/sc_dev_questions_gpt.tsv: the demo answers in the silver columns;
  - fusion/fusion_dev.csv: the demo fusion pairs;
  - perspectrum/: the demo knowledge base as PERSPECTRUM's claims, perspective pool and
    split files (a topic's argument clusters: SUPPORT for pro, UNDERMINE for con);
  - chitchat/dataset.json: the demo dialogues' utterances in the chitchat package's layout.
  """
  questions = demo.clarify_questions()
  situations = list(dict.fromkeys(r["situation"] for r in questions))
  dev = set(situations[::DEV_EVERY])
  for split, held_out in (("train", False), ("dev", True)):
    _tsv(folder / "delta_clarify" / f"{split}.tsv",
         [r for r in questions if (r["situation"] in dev) == held_out])
  _tsv(folder / "delta_clarify_silver" / "sc_dev_questions_gpt.tsv", [
      {"DataSource": "jaxmoral-demo", "Hypothesis": r["hypothesis"], "Update": r["answer"],
       "UpdateType": r["update_type"], "question_davinci": r["question"],
       "situation": r["situation"]} for r in demo.clarify_answers()])
  fusion = folder / "fusion" / "fusion_dev.csv"
  fusion.parent.mkdir(parents=True)
  with open(fusion, "w", newline="", encoding="utf-8") as f:
    writer = csv.DictWriter(f, fieldnames=["input", "output"])
    writer.writeheader()
    writer.writerows(demo.clarify_fusion())
  claims, pool, splits = [], [], {}
  for claim_id, topic in enumerate(demo.npov_kb(), 1):
    perspectives = []
    for side, stance in (("pro", "SUPPORT"), ("con", "UNDERMINE")):
      for cluster in topic[side]:
        pids = [len(pool) + i + 1 for i in range(len(cluster))]
        pool += [{"pId": p, "text": text, "source": "jaxmoral-demo"}
                 for p, text in zip(pids, cluster, strict=True)]
        perspectives.append({"pids": pids, "stance_label_3": stance})
    claims.append({"cId": claim_id, "text": topic["query"], "perspectives": perspectives})
    splits[str(claim_id)] = "test" if claim_id % DEV_EVERY == 0 else "train"
  perspectrum = folder / "perspectrum"
  perspectrum.mkdir()
  for name, value in (("perspectrum_with_answers_v1.0.json", claims),
                      ("perspective_pool_v1.0.json", pool),
                      ("dataset_split_v1.0.json", splits)):
    (perspectrum / name).write_text(json.dumps(value))
  (folder / "chitchat").mkdir()
  (folder / "chitchat" / "dataset.json").write_text(json.dumps({
      f"demo-{i:02d}": {"messages": [[{"text": turn["utterance"]}]
                                     for turn in row["conversation"]]}
      for i, row in enumerate(demo.dialogues())}))
  return folder


def _gin_files(words: list[str]) -> list[str]:
  return [w.split("=", 1)[1] for w in words if w.startswith("--gin_file=")]


def pretraining_commands() -> dict[str, list[str]]:
  """{config: the words of the documented command that stands for all of that config's}."""
  by_config: dict[str, list[list[str]]] = {}
  for _, command in test_docs.COMMANDS:
    if command.startswith(PRETRAINING):
      words = test_docs._words(command)  # pylint: disable=protected-access
      by_config.setdefault(_gin_files(words)[0], []).append(words)
  chosen = {}
  for config, commands in by_config.items():
    # The same but for what the tiny variant sets.
    rest = {tuple(w for w in c if not w.startswith(("--gin.MODEL_DIR=", "--gin.TRAIN_STEPS=",
                                                    "--gin.BATCH_SIZE=")))
            for c in commands}
    assert len(rest) == 1, (config, rest)
    chosen[config] = next((c for c in commands if f"'/tmp/{SMOKE_BASE}'" in " ".join(c)),
                          commands[0])
  return chosen


def smoke_commands() -> list[list[str]]:
  """The words of each documented experiment smoke command, each once."""
  commands = test_docs._once(  # pylint: disable=protected-access
      c for _, c in test_docs.COMMANDS
      if c.startswith("python experiments/") and "_smoke.gin" in c)
  return [test_docs._words(c) for c in commands]  # pylint: disable=protected-access


def _model_dir(words: list[str], folder: pathlib.Path) -> tuple[list[str], pathlib.Path]:
  """`words` with their MODEL_DIR moved into `folder` (same name, quoted as written), and that
  folder."""
  out, model_dir = [], None
  for word in words:
    if word.startswith("--gin.MODEL_DIR="):
      path = word.split("=", 1)[1].strip("'\"")
      model_dir = folder / pathlib.PurePath(path).name
      word = word.replace(path, str(model_dir))
    out.append(word)
  assert model_dir is not None, words
  return out, model_dir


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Iterator[dict[str, pathlib.Path]]:
  """{config: its run} of every pretraining config's documented command, run in full as its
  tiny variant from an empty folder; the smoke base is `<folder>/pt_smoke`."""
  folder = tmp_path_factory.mktemp("pretrained")
  runs = {}
  with pytest.MonkeyPatch.context() as patch:
    patch.chdir(folder)
    for config, words in pretraining_commands().items():
      words, runs[config] = _model_dir(words, folder)
      gin.clear_config()
      assert cli.main([*words[1:], *TINY_PRETRAINING]) == 0, words
    gin.clear_config()
  yield runs


@pytest.fixture(scope="module")
def shared_like_data(tmp_path_factory) -> pathlib.Path:
  return write_shared_like_data(tmp_path_factory.mktemp("data"))


def test_the_documented_pretraining_runs_in_full(pretrained):
  assert set(pretrained) == {"configs/core/pretrain_span_corruption.gin",
                             "configs/core/pretrain_span_corruption_small_gpu.gin"}
  assert pretrained["configs/core/pretrain_span_corruption.gin"].name == SMOKE_BASE
  for config, run in pretrained.items():
    assert (run / "checkpoints" / "4").is_dir(), config
    corpus = json.loads((run / "pretraining_corpus.json").read_text())
    assert corpus["settings"]["sources"] == ["demo"] and corpus["settings"]["data_dir"] is None
    assert corpus["texts"]["train"] > 100 and corpus["texts"]["validation"] > 0, corpus
    spiece = sentencepiece.SentencePieceProcessor(model_file=str(run / "vocab" / "spiece.model"))
    assert spiece.get_piece_size() == vocab.DEMO_VOCAB_SIZE, config  # The demo vocabulary.
    losses = metric_writers.read_scalars(str(run / "train"))["loss"]
    assert list(losses) == [4] and 0 < losses[4] < 20, losses


def run_script(words: list[str]) -> int:
  """`python experiments/X.py ARGS` in-process, as the script's `__main__` runs it."""
  script = pathlib.PurePath(words[1]).stem
  sys.path.insert(0, str(ROOT / "experiments"))
  try:
    module = importlib.import_module(script)
    common = importlib.import_module("experiment_lib")
    if script == "clarify_reward_probe":  # It reads the configurable clarify_table4 binds.
      importlib.import_module("clarify_table4")
  finally:
    sys.path.remove(str(ROOT / "experiments"))
  run = module.probe if script == "clarify_reward_probe" else module.run_experiment
  gin.clear_config()
  try:
    with pytest.MonkeyPatch.context() as patch:
      patch.setattr(sys, "argv", [str(ROOT / words[1]), *words[2:]])  # As python sets it.
      environment = dict(os.environ)  # Its start-up's defaults (TF_CPP_MIN_LOG_LEVEL, ...).
      try:
        return common.main(run, words[2:])
      finally:
        os.environ.clear()
        os.environ.update(environment)
  finally:
    gin.clear_config()


def _smoke(script: str, base: pathlib.Path, data: pathlib.Path,
           workdir: pathlib.Path) -> list[str]:
  """The documented smoke command of `script` from the tiny base, on `data`, into `workdir`."""
  commands = [w for w in smoke_commands() if pathlib.PurePath(w[1]).stem == script]
  assert len(commands) == 1, commands
  words = [w.replace(f"'/tmp/{SMOKE_BASE}'", f"'{base}'") for w in commands[0]]
  assert f"--gin.INIT_CHECKPOINT='{base}'" in words, words
  macro, place = DATA_FLAGS[script]
  return [*words, *TINY_MODEL, *TINY_EXTRA[script], f"--gin.WORKDIR='{workdir}'",
          f"--gin.{macro}='{data / place if place else data}'"]


def test_every_script_has_a_documented_smoke_command():
  assert sorted(pathlib.PurePath(w[1]).stem for w in smoke_commands()) == sorted(SCRIPTS)


@pytest.fixture
def base(pretrained, tmp_path, monkeypatch) -> pathlib.Path:
  """The smoke base; the experiment runs from an empty folder."""
  monkeypatch.chdir(tmp_path)
  return pretrained["configs/core/pretrain_span_corruption.gin"]


def _results(workdir: pathlib.Path, name: str) -> dict[str, Any]:
  """The results an experiment wrote into its WORKDIR (RESULTS_DIR's default): its report, plot
  and numbers."""
  assert {f"{name}.{ext}" for ext in ("md", "png", "json")} <= {p.name for p in
                                                               workdir.iterdir()}, workdir
  results = json.loads((workdir / f"{name}.json").read_text())
  assert results["command"].startswith("python ") and name.rsplit("_", 1)[0] in (
      workdir / f"{name}.md").read_text()
  return results


def test_the_documented_diamante_smoke_runs_in_full(base, shared_like_data, tmp_path):
  workdir = tmp_path / "diamante"
  assert run_script(_smoke("diamante_fig3", base, shared_like_data, workdir)) == 0
  results = _results(workdir, "diamante_fig3_smoke")
  setup = results["setup"]
  assert setup["chitchat_path"] == str(shared_like_data / DATA_FLAGS["diamante_fig3"][1])
  assert setup["init_checkpoint"] == str(base) and setup["model"]["layers"] == "1+1"
  assert setup["train_conversations"] == 12 and setup["test_contexts"] > 0, setup
  # Each model's human response ranked among 3 candidates and 2 random responses, every way.
  for model in ("joint", "nll_only"):
    assert {"preference", "generation", "generation_per_token"} <= set(
        results["table"][model]), results["table"]
    per_context = results["per_context"][model]
    assert len(per_context["turn"]) == setup["test_contexts"]
    assert all(1 / 5 <= mrr <= 1 for mrr in per_context["preference/mrr"]), per_context
  assert results["verdict"] in ("agrees", "disagrees", "not shown"), results["verdict"]


def test_the_documented_npov_smoke_runs_in_full(base, shared_like_data, tmp_path):
  workdir = tmp_path / "npov"
  assert run_script(_smoke("npov_table1", base, shared_like_data, workdir)) == 0
  results = _results(workdir, "npov_table1_smoke")
  topics = demo.npov_kb()
  held_out = len(topics) // DEV_EVERY
  assert results["setup"]["claims_by_split"] == {"train": len(topics) - held_out, "dev": 0,
                                                 "test": held_out}, results["setup"]
  assert set(results["slices"]) == {"unparaphrased", "paraphrased"}
  # Every detector of the config, and the controls, scored both slices: both errors, but
  # salience, whose 2 sampled examples hold a clean one and one kind of error only.
  assert {"rouge", "salience", "classifier"} <= set(results["auc"]), results["auc"].keys()
  for detector, by_slice in results["auc"].items():
    assert set(by_slice) == {"unparaphrased", "paraphrased"}, detector
    for name, by_error in by_slice.items():
      scored = {e: a["example"] for e, a in by_error.items() if a["example"] is not None}
      assert set(scored) == {"hallucination", "coverage"} or (
          detector == "salience" and scored), (detector, name, by_error)
      assert all(a["n"] > 0 and 0 <= a["estimate"] <= 1 for a in scored.values()), scored
  for stage in ("base", "generator", "classifier_hallucination", "classifier_coverage"):
    assert (workdir / stage / "checkpoints").is_dir(), stage


def test_the_documented_clarify_smokes_run_in_full(base, shared_like_data, tmp_path, capsys):
  """clarify_table4's smoke command, then the reward probe's on its runs (same WORKDIR)."""
  workdir = tmp_path / "clarify"
  assert run_script(_smoke("clarify_table4", base, shared_like_data, workdir)) == 0
  results = _results(workdir, "clarify_table4_smoke")
  dev = len(list(dict.fromkeys(r["situation"] for r in demo.clarify_questions())))
  dev = (dev + DEV_EVERY - 1) // DEV_EVERY
  setup = results["setup"]
  assert setup["data_dir"] == str(shared_like_data) and setup["eval_situations"] == min(dev, 8)
  assert {"why", "finetuned", "pipeline", "discriminator", "ppo"} <= set(results["table"])
  for system, row in results["table"].items():
    assert len(row["per_situation"]["jsd"]) == setup["eval_situations"], system
  assert "ppo - finetuned" in results["differences"] and results["ppo_reward_curve"]
  # The same run's judge on its held-out silver labels, and the diagnosis that reads it.
  assert results["judge"]["examples"] > 0 and 0 <= results["judge"]["accuracy"] <= 1
  assert isinstance(results["diagnosis"], list)
  assert "Judge on" in (workdir / "clarify_table4_smoke.md").read_text(encoding="utf-8")
  capsys.readouterr()
  assert run_script(_smoke("clarify_reward_probe", base, shared_like_data, workdir)) == 0
  out = capsys.readouterr().out
  probe = json.loads(out[out.index("\n{") + 1:out.rindex("\n}") + 2])
  # The config of record's models: the multi-task one, and the answer and fusion models of
  # their own (`dedicated_roles`), each trained the smoke config's TRAIN_STEPS at most.
  dedicated = {"answer", "fusion"}
  assert probe["model_dirs"] == {
      role: str(workdir / f"{role if role in dedicated else 'multitask'}_model")
      for role in ("question", "answer", "fusion", "judge", "nli", "relevance")
  }, probe["model_dirs"]
  for which in ("multitask", *dedicated):
    assert test_docs.checkpoint_steps(workdir / f"{which}_model")[-1] == 2, which
  assert probe["summary"]["situations"] == setup["eval_situations"], probe["summary"]
  assert len(probe["examples"]) == min(5, setup["eval_situations"])
  # Best-of-n and the judge's quality on the same runs: a fine-tuned copy of SFT beside them.
  assert run_script(_smoke("clarify_best_of_n", base, shared_like_data, workdir)) == 0
  best = _results(workdir, "clarify_best_of_n_smoke")
  assert best["setup"]["eval_situations"] == setup["eval_situations"]
  assert len(best["evaluation"]["per_situation"]["copy"]) == setup["eval_situations"]
  assert {"low", "high", "estimate"} <= set(best["evaluation"]["copy - sft"])
  assert best["judge"]["examples"] > 0 and 0 <= best["judge"]["accuracy"] <= 1
  assert {"low", "high", "estimate"} <= set(best["evaluation"]["copy - random_copy"])
  assert len(best["evaluation"]["per_situation"]["random_copy"]) == setup["eval_situations"]
  for kind in ("best", "random"):
    assert test_docs.checkpoint_steps(workdir / f"{kind}_of_2_question")[-1] == 2, kind
  # A judge of its own in the same WORKDIR, every checkpoint against the majority class, the
  # multi-task judge beside it on the same held-out examples.
  assert run_script(_smoke("clarify_judge", base, shared_like_data, workdir)) == 0
  judge = _results(workdir, "clarify_judge_smoke")
  assert sorted(map(int, judge["curve"])) == [1, 2]
  assert test_docs.checkpoint_steps(workdir / "judge_model") == [1, 2]
  for quality in (*judge["curve"].values(), judge["multitask"]):
    assert quality["examples"] == best["judge"]["examples"] > 0
  assert judge["verdict"] in ("agrees", "not shown", "disagrees")
