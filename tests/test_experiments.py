"""The fidelity experiments' configs and report logic, and the demos' truth lines (no training:
a few seconds)."""

import json
import os
import pathlib
import shutil
import signal
import sys

import gin
import numpy as np
import pytest

from jaxmoral import demo
from jaxmoral import gin_utils
from jaxmoral import metrics
from jaxmoral import preemption
from jaxmoral.clarify import evaluate as clarify_evaluate

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

import clarify_best_of_n  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
import clarify_judge  # noqa: E402,F401  pylint: disable=g-import-not-at-top,wrong-import-position
import clarify_table4  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
import diamante_fig3  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
import experiment_lib  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
import npov_table1  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
import reverdict  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position


@pytest.fixture(autouse=True)
def _clean_gin(monkeypatch):
  monkeypatch.chdir(ROOT)
  gin.clear_config()
  yield
  gin.clear_config()


def _parse(*flags: str) -> None:
  gin_args, rest = gin_utils.split_gin_args(list(flags))
  assert not rest
  gin_utils.parse_gin(gin_args)
  gin_utils.check_required()


@pytest.mark.parametrize("files, steps, size", [
    (("diamante_fig3_cpu.gin",), 500, "mini"),
    (("diamante_fig3_cpu.gin", "diamante_fig3_smoke.gin"), 3, "mini"),
    (("diamante_fig3_cpu.gin", "diamante_fig3_cpu_short.gin"), 200, "mini"),
    (("diamante_fig3_cpu.gin", "diamante_fig3_cpu_short.gin", "diamante_fig3_cpu_head_lr.gin"),
     200, "mini"),
    (("diamante_fig3_gpu.gin",), 5000, "small"),
])
def test_diamante_configs_parse(files, steps, size):
  _parse(*(f"--gin_file=configs/experiments/{f}" for f in files),
         "--gin.INIT_CHECKPOINT='/base'")
  assert gin.query_parameter("%TRAIN_STEPS") == steps
  assert gin.query_parameter("%INIT_CHECKPOINT") == "/base"
  assert gin.query_parameter("config.t5_config.size") == size


@pytest.mark.parametrize("files, macro, value", [
    (("npov_table1_cpu.gin",), "%BASE_STEPS", 600),
    (("npov_table1_cpu.gin", "npov_table1_smoke.gin"), "%BASE_STEPS", 2),
    (("npov_table1_gpu.gin",), "%BASE_STEPS", 3000),
    (("npov_table1_gpu.gin",), "npov_table1.run_experiment.pack_base", True),
    (("npov_table1_cpu.gin", "npov_table1_cpu_finetuned_classifiers.gin"),
     "npov_table1.run_experiment.classifier_tuning", "full"),
    (("npov_table1_cpu.gin", "npov_table1_cpu_unbalanced.gin"),
     "npov_table1.run_experiment.balanced_sides", False),
    (("npov_table1_cpu.gin", "npov_table1_cpu_salience_all.gin"),
     "npov_table1.run_experiment.max_salience_examples", None),
    (("npov_table1_cpu.gin", "npov_table1_cpu_unbalanced.gin",
      "npov_table1_cpu_substitution_probe.gin", "npov_table1_cpu_substitution_training.gin"),
     "npov_table1.run_experiment.classifier_substitutions", True),
    (("clarify_table4_cpu.gin",), "%PPO_ITERATIONS", 40),
    (("clarify_table4_cpu.gin", "clarify_table4_smoke.gin"), "%PPO_ITERATIONS", 1),
    (("clarify_table4_gpu.gin",), "%PPO_ITERATIONS", 300),
    # The original recipe (gin/ppo/clarifydelphi.gin) in every ClarifyDelphi experiment.
    (("clarify_table4_gpu.gin",), "ppo_trainer.PPOConfig.kl_control", "fixed"),
    (("clarify_table4_cpu.gin",), "ppo_trainer.PPOConfig.num_minibatches", 1),
    (("clarify_table4_cpu.gin",), "clarify_table4.run_experiment.ppo_run", "ppo_recipe"),
    (("clarify_table4_cpu_dedicated.gin",), "clarify_table4.run_experiment.dedicated_roles",
     {"answer": 400, "fusion": 600}),
    (("clarify_table4_cpu_dedicated_kl.gin",), "ppo_trainer.PPOConfig.init_kl_coef", 0.15),
    (("clarify_table4_cpu_packed.gin",), "clarify_table4.run_experiment.pack", True),
    (("clarify_table4_cpu_packed.gin",), "clarify_table4.run_experiment.dedicated_roles",
     {"answer": 180, "fusion": 430}),
    (("clarify_table4_cpu_packed.gin",), "ppo_trainer.PPOConfig.whiten_rewards", True),
    (("clarify_table4_cpu_answer1000.gin",), "clarify_table4.run_experiment.pack",
     ["multitask"]),
    (("clarify_table4_cpu_answer1000.gin",), "clarify_table4.run_experiment.dedicated_roles",
     {"answer": 1000, "fusion": 600}),
    (("clarify_table4_cpu_answer1000.gin",), "ppo_trainer.PPOConfig.batch_size", 64),
    (("clarify_table4_cpu_answer1000.gin",), "%PPO_ITERATIONS", 120),
    (("clarify_table4_cpu_answer1000.gin",), "clarify_table4.run_experiment.systems", None),
    (("clarify_best_of_n_cpu.gin",), "clarify_best_of_n.run_experiment.samples_per_situation",
     8),
    (("clarify_best_of_n_cpu.gin",), "clarify_best_of_n.run_experiment.num_train_situations",
     256),
    (("clarify_best_of_n_cpu.gin", "clarify_best_of_n_smoke.gin"), "%NAME",
     "clarify_best_of_n_smoke"),
    (("clarify_judge_cpu.gin",), "clarify_table4.run_experiment.dedicated_roles",
     {"answer": 1000, "fusion": 600, "judge": 600}),
    (("clarify_judge_cpu.gin", "clarify_judge_smoke.gin"), "%NAME", "clarify_judge_smoke"),
])
def test_npov_and_clarify_configs_parse(files, macro, value):
  _parse(*(f"--gin_file=configs/experiments/{f}" for f in files),
         "--gin.INIT_CHECKPOINT='/base'")
  assert gin.query_parameter(macro) == value


def test_clarify_gpu_config_scores_every_system():
  # Unbound means run_experiment's default, None: every system of the table.
  _parse("--gin_file=configs/experiments/clarify_table4_gpu.gin", "--gin.INIT_CHECKPOINT='/base'")
  with pytest.raises(ValueError, match="no value bound"):
    gin.query_parameter("clarify_table4.run_experiment.systems")


def test_diamante_config_needs_the_base():
  with pytest.raises(ValueError, match="INIT_CHECKPOINT"):
    _parse("--gin_file=configs/experiments/diamante_fig3_cpu.gin")


def test_command_line_quotes_gin_strings_readably():
  assert experiment_lib._quote("--gin.INIT_CHECKPOINT='/runs/pt'") == \
      "--gin.INIT_CHECKPOINT=\"'/runs/pt'\""
  assert experiment_lib._quote("--gin_file=configs/x.gin") == "--gin_file=configs/x.gin"


@gin.configurable
def _experiment_needing_data(*, command: str, data_dir: str = "/nonexistent/perspectrum",
                             bug: bool = False) -> dict:
  del command
  if bug:
    return {}["missing key"]  # a bug: keeps its traceback
  raise FileNotFoundError(2, "No such file or directory", f"{data_dir}/arguments.json")


def test_an_experiments_missing_data_is_one_line_and_a_bug_keeps_its_traceback(
    tmp_path, capsys):
  config = tmp_path / "exp.gin"
  config.write_text("_experiment_needing_data.data_dir = '/data/missing'\n")
  assert experiment_lib.main(_experiment_needing_data, [f"--gin_file={config}"]) == 2
  err = capsys.readouterr().err
  assert err.splitlines()[-1] == "error: No such file or directory: /data/missing/arguments.json"
  assert "Traceback" not in err
  gin.clear_config()
  with pytest.raises(KeyError):
    experiment_lib.main(_experiment_needing_data,
                        [f"--gin_file={config}", "--gin._experiment_needing_data.bug=True"])


@gin.configurable
def _experiment_stopped_by_sigterm(*, command: str) -> dict:
  del command
  raise preemption.Stopped(signal.SIGTERM, step=7, where="/runs/stage/checkpoints")


def test_an_experiment_stopped_by_a_signal_is_one_line_and_its_exit_status(tmp_path, capsys):
  config = tmp_path / "exp.gin"
  config.write_text("")
  assert experiment_lib.main(_experiment_stopped_by_sigterm, [f"--gin_file={config}"]) == 143
  err = capsys.readouterr().err
  assert "Traceback" not in err
  assert err.strip().splitlines()[-1] == (
      "stopped by SIGTERM: saved step 7 to /runs/stage/checkpoints; run the same command "
      "again to resume (exit status 143)")


def test_the_diamante_experiment_without_the_dialogue_extra_is_one_line(tmp_path, capsys,
                                                                       monkeypatch):
  monkeypatch.setitem(sys.modules, "chitchat_dataset", None)  # Not installed (tests lack it).
  assert experiment_lib.main(diamante_fig3.run_experiment, [
      "--gin_file=configs/experiments/diamante_fig3_cpu.gin", "--gin.INIT_CHECKPOINT='/unused'",
      f"--gin.WORKDIR='{tmp_path}'"]) == 2
  err = capsys.readouterr().err
  assert "Traceback" not in err
  assert err.splitlines()[-1].startswith("error: the chitchat corpus needs the dialogue extra")


def test_mean_ci_is_the_bootstrap_of_the_mean():
  values = np.random.default_rng(0).random(50)
  ours = experiment_lib.mean_ci(values, num_resamples=300, seed=3)
  reference = metrics.bootstrap_ci(np.mean, values, num_resamples=300, seed=3)
  np.testing.assert_allclose(tuple(ours), tuple(reference), rtol=1e-12)
  diff = experiment_lib.paired_diff_ci(values, values * 0.5, num_resamples=300, seed=3)
  np.testing.assert_allclose(tuple(diff),
                             tuple(metrics.bootstrap_ci(np.mean, values * 0.5,
                                                        num_resamples=300, seed=3)), rtol=1e-12)


def _per_context(pref_hits, gen_hits, n=200):
  rng = np.random.default_rng(1)
  out = {"turn": np.arange(n, dtype=float), "random/p@1": np.full(n, 1 / 15),
         "pe_accuracy": rng.random(n)}
  for ranker, rate in (("preference", pref_hits), ("generation", gen_hits),
                       ("generation_per_token", gen_hits)):
    hits = (rng.random(n) < rate).astype(float)
    for key in ("map", "mrr", "p@1"):
      out[f"{ranker}/{key}"] = hits
  return out


@pytest.mark.parametrize("pref, gen, head, expected", [
    (0.6, 0.05, 0.07, "agrees"), (0.02, 0.5, 0.07, "disagrees"),
    (0.1, 0.1, 0.07, "not shown"),
    # Far above generation and chance, but an untrained head ranks as well: not shown.
    (0.6, 0.05, 0.6, "not shown")])
def test_diamante_verdict_follows_the_paired_intervals(pref, gen, head, expected):
  per = {"joint": _per_context(pref, gen), "nll_only": _per_context(head, gen)}
  results = diamante_fig3.summarize(per, num_resamples=200, seed=0)
  assert results["verdict"] == expected
  table = results["table"]["joint"]["preference"]["p@1"]
  assert table["low"] <= table["estimate"] <= table["high"]
  # The chance part is paired with each context's random-ranker P@1 (here 1/15).
  chance = results["differences"]["joint: preference - random"]["p@1"]
  assert chance["estimate"] == pytest.approx(table["estimate"] - 1 / 15)


def test_diamante_head_optimizer_updates_only_the_scalar_head():
  import jax.numpy as jnp
  from jaxmoral import optimizers
  params = {"decoder": {"kernel": jnp.ones((2, 3))},
            "scalar_head": {"kernel": jnp.ones((3, 1)), "bias": jnp.zeros((1,))}}
  grads = {"decoder": {"kernel": jnp.full((2, 3), 2.0)},
           "scalar_head": {"kernel": jnp.full((3, 1), 2.0), "bias": jnp.full((1,), 2.0)}}
  rest = optimizers.make_optimizer(name="sgd", learning_rate=0.25)
  both = diamante_fig3.with_head_optimizer(
      optimizer=rest, head_optimizer=optimizers.make_optimizer(name="sgd", learning_rate=1.5))
  updates, _ = both.update(grads, both.init(params), params)
  np.testing.assert_allclose(updates["decoder"]["kernel"], -0.5)  # rest: -0.25 * 2
  np.testing.assert_allclose(updates["scalar_head"]["kernel"], -3.0)  # head: -1.5 * 2
  np.testing.assert_allclose(updates["scalar_head"]["bias"], -3.0)
  assert float(both.learning_rate(0)) == 0.25


@pytest.mark.parametrize("intervals, baselines, required, expected", [
    ([(0.2, 0.1, 0.3), (0.05, 0.01, 0.09)], [0.0, 0.0], [True, True], "agrees"),
    ([(0.2, 0.1, 0.3), (0.05, -0.01, 0.09)], [0.0, 0.0], [True, True], "not shown"),
    ([(0.2, 0.1, 0.3), (-0.05, -0.09, -0.01)], [0.0, 0.0], [True, True], "disagrees"),
    ([(0.8, 0.7, 0.9), (0.8, 0.7, 0.9)], [0.5, 0.75], [True, True], "not shown"),
    ([(0.2, 0.1, 0.3), None], [0.0, 0.0], [True, True], "not shown"),   # a required part absent
    ([(0.2, 0.1, 0.3), None], [0.0, 0.0], [True, False], "agrees"),     # an optional one
    ([None, None], [0.0, 0.0], [False, False], "not shown"),            # nothing measured
    ([], [], [], "not shown")])
def test_claim_verdict_needs_every_part_above_its_baseline(intervals, baselines, required,
                                                           expected):
  parts = [experiment_lib.ClaimPart(f"part {i}", _ci(*c) if c else None, baseline=b,
                                    required=r, null="a null" if i == len(intervals) - 1 else None)
           for i, (c, b, r) in enumerate(zip(intervals, baselines, required))]
  word, why = experiment_lib.claim_verdict(parts)
  assert word == expected
  if not any(c for c in intervals):
    assert why.startswith("no part measured")
  elif expected != "agrees":  # The why names first what keeps it from agreeing.
    first = next(p for p in parts if p.status != "shown" and (p.required or p.interval))
    assert why.startswith(first.name)


def test_a_claim_must_name_its_null():
  with pytest.raises(ValueError, match="names its null"):
    experiment_lib.claim_verdict([experiment_lib.ClaimPart("above chance", _ci(0.8, 0.7, 0.9),
                                                           baseline=0.5)])


def test_the_diamante_table_of_record_is_not_shown():
  # The CPU config's table, reproduced: P@1 by preference 0.077 [0.050, 0.107] against a
  # random ranker's 1/15 (15 items in every context, so the paired difference is the interval
  # shifted by 1/15), the NLL-only model's untrained head 0.070 [0.040, 0.100].
  chance = 1 / 15
  assert experiment_lib.ClaimPart("P@1 above chance", _ci(0.077, 0.050, 0.107),
                                  baseline=chance).status == "not shown"
  differences = {
      "joint: preference - random": {"p@1": _ci(0.077 - chance, 0.050 - chance,
                                                0.107 - chance)},
      "preference: joint - nll_only": {"p@1": _ci(0.007, -0.033, 0.050),
                                       "map": _ci(-0.004, -0.043, 0.036)},
      "joint: preference - generation": {"p@1": _ci(0.037, 0.003, 0.070)},
      "joint: preference - generation_per_token": {"p@1": _ci(0.060, 0.027, 0.093)}}
  word, why = diamante_fig3.verdict({"differences": differences})
  assert word == "not shown"
  assert why.startswith("joint P@1 by preference minus a random ranker's (chance): +0.010 "
                        "[-0.017, +0.040] vs 0: not shown; joint minus NLL-only (untrained "
                        "head) P@1 by preference: +0.007 [-0.033, +0.050] vs 0: not shown; ")
  # Without the NLL-only run the claim's part about joint training is missing: not shown.
  del differences["preference: joint - nll_only"]
  differences["joint: preference - random"]["p@1"] = _ci(0.1, 0.05, 0.15)
  word, why = diamante_fig3.verdict({"differences": differences})
  assert word == "not shown" and "NLL-only (untrained head) P@1 by preference: not measured" in why


@pytest.mark.parametrize("old", [
    ["Claim: paper: X. This run **agrees** (+0.1 [+0.0, +0.2])."],
    ["- rouge: paper: R; this run: hallucination above chance.",
     "- salience: paper: S; this run: hallucination not shown."]])
def test_reverdict_replaces_only_the_verdict_lines(old):
  table = ["#### run", "", "| a | b |", "|---|---|", "| 1 | 2 |", ""]
  tail = ["", "Seconds: total 5.", "", "Plot: `p.png`."]
  got = reverdict.splice("\n".join(table + old + tail) + "\n", ["Rule.", "", "**new**"])
  assert got == "\n".join(table + ["Rule.", "", "**new**"] + tail) + "\n"


def _words(lines):
  return [next((w for w in demo.VERDICTS if f" — {w}" in line), None) for line in lines]


def test_interval_verdict_needs_the_whole_interval_on_one_side():
  assert demo.interval_verdict(0.01, 0.2) == "agrees"
  assert demo.interval_verdict(-0.2, -0.01) == "disagrees"
  assert demo.interval_verdict(-0.01, 0.2) == "cannot tell"
  assert demo.interval_verdict(0.45, 0.62, null=0.5) == "cannot tell"
  assert demo.interval_verdict(0.55, 0.62, null=0.5) == "agrees"
  with pytest.raises(ValueError, match="verdict must be one of"):
    demo.truth_line(method="npov", paper="p", this_run="r", verdict="maybe")


def test_demo_prints_each_verdict_once_short_with_one_pointer_to_the_results(
    tmp_path, monkeypatch, capsys):
  lines = {part: [demo.truth_line(method=part, paper=f"{part} claim", this_run="x 0.5",
                                  verdict=verdict)]
           for part, verdict in (("npov", "agrees"), ("clarify", "cannot tell"))}
  monkeypatch.setattr(demo, "_method_demo",
                      lambda part: lambda workdir: {"truth": lines[part]})
  monkeypatch.chdir(tmp_path)
  demo.run_all(workdir=tmp_path / "demo_out", only=("npov", "clarify"))
  out = capsys.readouterr().out
  flat = " ".join(out.split())  # Lines are wrapped to the demo's width.
  for (line,) in lines.values():
    assert flat.count(" ".join(line.split())) == 1
    assert len(line.splitlines()) <= 2 and len(line) < 300  # no quoted results
  assert out.count("experiments/results/") == 1
  assert max(len(line) for line in out.splitlines()) <= demo.WIDTH
  # The closing hints run in a new shell: each command is on PATH or a path to a program.
  hints = [line.split(": ", 1)[1].split() for line in out.splitlines()
           if line.startswith(("Every run's curves: ", "Look at the examples in a browser: "))]
  assert [words[-2:] for words in hints] == [["--logdir", "demo_out"], ["explore", "demo_out"]]
  for words in hints:
    program = shutil.which(words[0]) or words[0]
    assert os.path.isfile(program) and os.access(program, os.X_OK), words


def _situations(jsd, flips):
  return {"per_situation": {"jsd": list(jsd), "flips_pct": list(100.0 * np.asarray(flips))}}


def test_clarify_truth_lines_use_the_paired_interval_over_situations():
  rng = np.random.default_rng(0)
  n = 60
  sft = _situations(rng.random(n) * 0.1, rng.random(n) < 0.2)
  better = _situations(np.asarray(sft["per_situation"]["jsd"]) + 0.05 + 0.01 * rng.random(n),
                       np.ones(n, bool))
  lines = demo.clarify_truth_lines({"ppo": better, "finetuned": sft})
  assert _words(lines) == ["agrees", "agrees"]
  assert _words(demo.clarify_truth_lines({"ppo": sft, "finetuned": better})) == \
      ["disagrees", "disagrees"]
  # Same questions' numbers in another order: no paired difference to speak of.
  shuffled = _situations(rng.permutation(sft["per_situation"]["jsd"]),
                         rng.permutation(sft["per_situation"]["flips_pct"]) > 0)
  assert _words(demo.clarify_truth_lines({"ppo": shuffled, "finetuned": sft})) == \
      ["cannot tell"] * 2
  # The quoted interval: a NumPy percentile bootstrap of the per-situation differences.
  diff = np.asarray(better["per_situation"]["jsd"]) - np.asarray(sft["per_situation"]["jsd"])
  idx = np.random.default_rng(0).integers(0, n, size=(1000, n))
  low, high = np.percentile(diff[idx].mean(axis=1), [2.5, 97.5])
  assert f"[{low:+.3f}, {high:+.3f}] over {n} situations" in lines[0]
  assert "Table 4" in lines[0] and "experiments/clarify_table4.py" in lines[0]
  assert all(len(line.splitlines()) <= 2 for line in lines)


def test_npov_truth_lines_need_chance_and_the_inputs_length():
  from jaxmoral.npov import evaluate  # pylint: disable=g-import-not-at-top
  from jaxmoral.npov.detectors import base  # pylint: disable=g-import-not-at-top
  examples = _npov_length_slice()
  slices = {"unparaphrased": examples}
  truth = np.array([float(e.hallucination or e.coverage) for e in examples])
  score = truth + 0.5 * np.random.default_rng(0).random(len(examples))
  dets = {"rouge": [base.Detection(x, x) for x in score],  # reads content: beats the length
          "salience": [base.Detection(-x, -x) for x in score],  # below chance
          "classifier": evaluate.input_length_detections(examples)}  # only the length
  results = {"unparaphrased": {d: evaluate.evaluate_slice(examples, v) for d, v in dets.items()}}
  lines = demo.npov_truth_lines(results, slices, num_resamples=100)
  assert _words(lines) == ["agrees", "disagrees", "cannot tell"]
  assert ".772" in lines[0] and "minus the input length's +" in lines[0]
  assert "minus the input length's +0.000 [+0.000, +0.000]" in lines[2]
  n = sum(not e.coverage for e in examples)
  assert f"hallucination 1.000 [1.000, 1.000] ({n} examples" in lines[0]
  # A model-based detector as good as ROUGE-1 still cannot agree here: its untrained-model
  # null is the experiment's. Without the examples no null is measured at all.
  results["unparaphrased"]["salience"] = results["unparaphrased"]["rouge"]
  assert _words(demo.npov_truth_lines(results, slices, num_resamples=100))[1] == "cannot tell"
  assert _words(demo.npov_truth_lines(results, num_resamples=100))[0] == "cannot tell"


def test_diamante_truth_line_needs_chance_and_the_better_rival():
  n = 40
  hits = (np.arange(n) % 2).astype(float)
  per = {"preference/p@1": hits, "generation/p@1": np.zeros(n),
         "generation_per_token/p@1": hits * (np.arange(n) % 4 == 1),
         "random/p@1": np.full(n, 0.125)}
  line, = demo.diamante_truth_lines(per)
  assert _words([line]) == ["agrees"] and "minus generation per token" in line
  assert "0.500 by preference vs 0.125 by chance" in line and f"over {n} contexts" in line
  # Above both generation rankers, but a random ranker does as well: cannot tell.
  per["random/p@1"] = np.full(n, 0.45)
  assert _words(demo.diamante_truth_lines(per)) == ["cannot tell"]
  per["random/p@1"] = np.full(n, 0.125)
  per["generation_per_token/p@1"] = np.ones(n)
  assert _words(demo.diamante_truth_lines(per)) == ["disagrees"]
  per["generation_per_token/p@1"] = hits[::-1].copy()
  assert _words(demo.diamante_truth_lines(per)) == ["cannot tell"]


def _ci(estimate, low, high):
  return {"estimate": estimate, "low": low, "high": high}


def test_npov_verdicts_need_each_measured_slice_above_chance():
  good, bad, unsure = _ci(0.8, 0.7, 0.9), _ci(0.3, 0.2, 0.4), _ci(0.55, 0.45, 0.65)
  perfect = _ci(1.0, 1.0, 1.0)
  auc = {"salience": {sl: {"hallucination": {"example": good}, "coverage": {"example": unsure}}
                      for sl in ("paraphrased", "unparaphrased")},  # as read back from JSON
         "classifier": {"unparaphrased": {"hallucination": {"example": good},
                                          "coverage": {"example": good}},
                        "paraphrased": {"hallucination": {"example": bad},
                                        "coverage": {"example": None}}},
         # The smoke run's ROUGE coverage: perfect on one slice, the other not measured.
         "rouge": {"unparaphrased": {"hallucination": {"example": unsure},
                                     "coverage": {"example": perfect}},
                   "paraphrased": {"hallucination": {"example": good},
                                   "coverage": {"example": None}}}}
  # Every null of every detector beaten on every slice: the verdict is chance's.
  beaten = {d: {sl: {n: {"difference": {e: _ci(0.1, 0.05, 0.15) for e in npov_table1.ERRORS}}
                     for n in npov_table1.NULLS[d]} for sl in ("unparaphrased", "paraphrased")}
            for d in auc}
  got = {d: {e: (v["verdict"], v["slices"]) for e, v in by_e.items()}
         for d, by_e in npov_table1.verdicts(auc, beaten).items()}
  both = lambda a, b: {"unparaphrased": a, "paraphrased": b}  # noqa: E731
  assert got == {
      "salience": {"hallucination": ("agrees", both("shown", "shown")),
                   "coverage": ("not shown", both("not shown", "not shown"))},
      "classifier": {"hallucination": ("disagrees", both("shown", "contradicted")),
                     "coverage": ("agrees", both("shown", "not measured"))},
      "rouge": {"hallucination": ("not shown", both("not shown", "shown")),
                "coverage": ("agrees", both("shown", "not measured"))}}
  assert list(got["salience"]["hallucination"][1]) == ["unparaphrased", "paraphrased"]
  # Results without the nulls (written before they were measured) show nothing.
  unmeasured = npov_table1.verdicts(auc)["salience"]["hallucination"]
  assert unmeasured["verdict"] == "not shown"
  assert unmeasured["why"].startswith("unparaphrased ROC AUC minus the untrained model's: "
                                      "not measured")
  # One null not beaten on one slice: not shown, that part named first.
  beaten["salience"]["paraphrased"]["input length"]["difference"]["hallucination"] = _ci(
      0.0, -0.05, 0.05)
  one = npov_table1.verdicts(auc, beaten)["salience"]["hallucination"]
  assert one["verdict"] == "not shown"
  assert one["why"].startswith("paraphrased ROC AUC minus the input length's: +0.000")


def _npov_length_slice():
  """A synthetic slice of the demo corpus: clean, hallucination and coverage variants."""
  from jaxmoral.data import demo as demo_data  # pylint: disable=g-import-not-at-top
  from jaxmoral.npov import knowledge_base as kb_lib  # pylint: disable=g-import-not-at-top
  from jaxmoral.npov import synthetic  # pylint: disable=g-import-not-at-top
  topics = kb_lib.read_kb_jsonl(demo_data.path("npov_kb.jsonl"))
  sources = kb_lib.sample_examples(topics, seed=0, examples_per_topic=4, max_per_side=3)
  return synthetic.make_test_slices(sources, topics, seed=1)["unparaphrased"]


def test_a_detector_that_only_reads_the_inputs_length_is_not_shown():
  examples = _npov_length_slice()
  length_only = npov_table1.length_detections(examples)
  auc = {"salience": {"unparaphrased": npov_table1.auc_intervals(
      examples, length_only, num_resamples=100, seed=0)}}
  assert auc["salience"]["unparaphrased"]["hallucination"]["example"]["low"] > 0.5
  untrained = [type(d)(0.0, 0.0) for d in length_only]  # An untrained model that ties all.
  nulls = {"salience": {"unparaphrased": npov_table1.null_intervals(
      examples, length_only, npov_table1.null_detections("salience", examples, untrained),
      num_resamples=100, seed=0)}}
  found = nulls["salience"]["unparaphrased"]
  assert found["input length"]["difference"]["hallucination"]["estimate"] == 0.0
  assert found["input length"]["auc"]["coverage"] == auc["salience"]["unparaphrased"][
      "coverage"]["example"]
  verdicts = npov_table1.verdicts(auc, nulls)["salience"]
  # Above chance and above the untrained model, but not above the input's length.
  assert verdicts["hallucination"]["slices"]["unparaphrased"] == "shown"
  assert {v["verdict"] for v in verdicts.values()} == {"not shown"}
  assert verdicts["hallucination"]["why"].startswith(
      "unparaphrased ROC AUC minus the input length's: +0.000 [+0.000, +0.000] vs 0: not shown")


def test_npov_within_example_word_auc_against_numpy():
  from jaxmoral.npov import evaluate  # pylint: disable=g-import-not-at-top
  from jaxmoral.npov.detectors import rouge  # pylint: disable=g-import-not-at-top
  examples = _npov_length_slice()[:60]
  detections = rouge.RougeDetector().detect_batch(examples)
  got = npov_table1.auc_intervals(examples, detections, num_resamples=50, seed=0)
  for error in npov_table1.ERRORS:
    labels, scores, units = evaluate.word_arrays(examples, detections, error)
    # Reference: every (positive, negative) word pair of one example, by enumeration.
    pairs = [float(scores[a] > scores[b]) + 0.5 * float(scores[a] == scores[b])
             for a in np.flatnonzero(labels == 1) for b in np.flatnonzero(labels == 0)
             if units[a] == units[b]]
    assert got[error]["word_within"]["estimate"] == pytest.approx(np.mean(pairs))
    assert evaluate.evaluate_slice(examples, detections)[error][
        "within_example_word_auc"] == pytest.approx(np.mean(pairs))


def test_npov_length_nulls_take_their_stronger_sign():
  from jaxmoral import metrics as m  # pylint: disable=g-import-not-at-top
  examples = _npov_length_slice()
  for null, count in npov_table1.LENGTH_NULLS.items():
    dets = npov_table1.null_detections("classifier", examples)[null]
    for error in npov_table1.ERRORS:
      other = npov_table1.ERRORS[1 - npov_table1.ERRORS.index(error)]
      keep = [i for i, e in enumerate(examples) if not getattr(e, other)]
      labels = [int(getattr(examples[i], error)) for i in keep]
      raw = [count(examples[i]) for i in keep]
      got = m.roc_auc(labels, [getattr(dets[i], error) for i in keep])
      assert got == pytest.approx(max(m.roc_auc(labels, raw), 1 - m.roc_auc(labels, raw)))
  assert "untrained model" not in npov_table1.null_detections("salience", examples)


def test_npov_ordering_is_the_paired_bootstrap_of_the_auc_difference():
  from types import SimpleNamespace
  rng = np.random.default_rng(2)
  n = 40
  labels = np.arange(n) % 2
  examples = [SimpleNamespace(hallucination=bool(y), coverage=False) for y in labels]
  det = lambda scores: [SimpleNamespace(hallucination=float(x), coverage=0.0,  # noqa: E731
                                        response_words=[], argument_words=[]) for x in scores]
  better, worse = labels + rng.random(n), labels + 3 * rng.random(n)
  got = npov_table1.ordering_intervals(examples, det(better), det(worse), num_resamples=100,
                                       seed=4)
  assert got["coverage"] is None  # One class only.
  # Reference: the same resampled examples for both detectors, a NumPy percentile interval.
  idx = np.random.default_rng(4).integers(0, n, size=(100, n))
  diffs = [metrics.roc_auc(labels[i], better[i]) - metrics.roc_auc(labels[i], worse[i])
           for i in idx if len(set(labels[i])) == 2]
  h = got["hallucination"]
  assert h["estimate"] == pytest.approx(metrics.roc_auc(labels, better)
                                        - metrics.roc_auc(labels, worse))
  np.testing.assert_allclose([h["low"], h["high"]], np.percentile(diffs, [2.5, 97.5]))
  # The pipeline's pairing: salience scored a third of the examples; each pair on what both
  # scored.
  sample = np.arange(0, n, 3)
  kept = {"classifier": {"s": (np.arange(n), det(better))},
          "rouge": {"s": (np.arange(n), det(worse))},
          "salience": {"s": (sample, det(worse[sample]))}}
  paired = npov_table1.paper_ordering({"s": examples}, kept, num_resamples=100, seed=4)
  assert paired["classifier - rouge"]["s"]["hallucination"] == h
  on_sample = npov_table1.ordering_intervals(
      [examples[i] for i in sample], det(better[sample]), det(worse[sample]),
      num_resamples=100, seed=4)
  assert paired["classifier - salience"]["s"] == on_sample
  assert on_sample["hallucination"]["n"] == len(sample)
  order = {"classifier - rouge": {"unparaphrased": got},
           "classifier - salience": {"unparaphrased": {"hallucination": _ci(-0.1, -0.2, 0.0),
                                                       "coverage": None}}}
  verdicts = npov_table1.ordering_verdicts(order)
  assert h["low"] > 0  # Shown against ROUGE-1, not against salience (its interval holds 0).
  assert verdicts["hallucination"]["verdict"] == "not shown"
  assert verdicts["hallucination"]["why"].startswith("classifier - salience ROC AUC")
  assert verdicts["coverage"]["verdict"] == "not shown"  # Nothing measured.
  assert npov_table1.ordering_verdicts({})["hallucination"]["verdict"] == "not shown"


def test_npov_plot_keeps_the_report_order_when_read_back_from_json(monkeypatch, tmp_path):
  from jaxmoral import pictures
  drawn = {}
  monkeypatch.setattr(pictures, "save_figure",
                      lambda fig, path, dpi: drawn.setdefault("fig", fig) and path)
  ci = {"example": _ci(0.6, 0.55, 0.65), "word": None}
  auc = {det: {sl: {e: ci for e in npov_table1.ERRORS} for sl in ("unparaphrased", "paraphrased")}
         for det in ("rouge", "salience", npov_table1.CONTROL)}
  # As write_results stores it: keys sorted ("input_length" < "rouge", "paraphrased" first).
  results = json.loads(json.dumps({"auc": auc, "slices": {"unparaphrased": 3,
                                                          "paraphrased": 3}}, sort_keys=True))
  npov_table1.plot(results, str(tmp_path / "p.png"), title="t")
  example_panel = drawn["fig"].axes[0]
  assert [t.get_text().split()[0] for t in example_panel.get_xticklabels()] == [
      "unpara", "unpara", "paraph", "paraph"]
  legend = drawn["fig"].axes[-1].get_legend()
  assert [t.get_text() for t in legend.get_texts() if t.get_text() != "chance"] == [
      "rouge", "salience", npov_table1.CONTROL]


@pytest.mark.parametrize("jsd, flips, expected", [
    (_ci(0.02, 0.01, 0.03), _ci(5.0, 1.0, 9.0), "agrees"),
    (_ci(-0.07, -0.09, -0.05), _ci(-3.0, -6.0, 1.0), "disagrees"),
    (_ci(0.01, -0.01, 0.03), _ci(2.0, 1.0, 3.0), "not shown")])
def test_clarify_verdict_follows_the_paired_intervals(jsd, flips, expected):
  word, why = clarify_table4.verdict({"ppo - finetuned": {"jsd": jsd, "flips_pct": flips}})
  assert word == expected and "PPO minus SFT" in why


def _curves(n, **metrics):
  return {"iterations": list(range(1, n + 1)), "episodes": [64 * i for i in range(1, n + 1)],
          "metrics": {k: list(v) for k, v in metrics.items()}}


def test_clarify_diagnosis_names_settings_and_capacity():
  """Each finding is read off the curves and table as stated; its interval is a bootstrap of
  the quarters' means, centred on the plain difference."""
  n = 40
  rising = np.linspace(0.005, 0.015, n)
  flat_dev = {"ppo@rollout - finetuned@rollout": {"jsd": _ci(0.0, -0.002, 0.002)}}
  base = {"verdict": "not shown", "setup": {"kl_control": "adaptive", "kl_target": 2.0},
          "table": {"finetuned": {"jsd": _ci(0.0077, 0.006, 0.009)}}}
  capacity = {**base, "differences": flat_dev, "ppo_curves": _curves(
      n, raw_score_mean=rising, reward_mean=np.linspace(0, 1, n),
      non_score_reward=np.full(n, -0.1), kl=np.full(n, 2.0), clipfrac=np.full(n, 0.05),
      approx_kl=np.full(n, 0.005), value_explained_variance=np.full(n, 0.5),
      rollout_entropy=np.full(n, 1.2))}
  found = clarify_table4.diagnosis(capacity)
  assert [f["points_to"] for f in found] == ["capacity", "capacity"]
  assert "raised its training reward (training reward, last quarter minus first: 0.0077" in (
      found[0]["finding"])  # The last 10 minus the first 10 of the line: 30 steps of 0.01 / 39.
  gain = clarify_table4._gain_ci(rising)  # pylint: disable=protected-access
  assert gain["estimate"] == pytest.approx(rising[-10:].mean() - rising[:10].mean())
  assert gain["low"] <= gain["estimate"] <= gain["high"]
  # A run that failed in its update: every settings finding, each with its number.
  drifting = {**base, "differences": flat_dev, "ppo_curves": _curves(
      n, raw_score_mean=np.full(n, 0.008) + np.tile([0.001, -0.001], n // 2),
      reward_mean=np.linspace(0, 0.1, n), non_score_reward=np.full(n, -0.2),
      kl=np.full(n, 4.0), clipfrac=np.full(n, 0.3), approx_kl=np.full(n, 0.05),
      value_explained_variance=np.full(n, -0.2), rollout_entropy=np.linspace(1.0, 2.5, n))}
  settings = [f["finding"] for f in clarify_table4.diagnosis(drifting)
              if f["points_to"] == "settings"]
  assert len(settings) == 7 and settings[0].startswith("PPO did not raise the reward")
  assert any("KL penalty (0.200" in f for f in settings)
  assert any("ended at 4.00 nats" in f for f in settings)
  assert any(f.startswith("30 % of tokens clipped") for f in settings)
  assert any("approx-KL per update 0.050" in f for f in settings)
  assert any("explains -0.20" in f for f in settings)
  assert any("(drift)" in f for f in settings)
  lines = clarify_table4.diagnosis_lines(drifting)
  assert lines[1].startswith("Diagnosis") and lines[3].startswith("- settings: PPO did not")
  assert lines[-1].startswith("- capacity: the reward is nearly flat")
  # A shown claim needs no diagnosis; a run without curves gets the table's finding only.
  assert clarify_table4.diagnosis_lines({**drifting, "verdict": "agrees"}) == []
  assert [f["points_to"] for f in clarify_table4.diagnosis({**base, "differences": {}})] == [
      "capacity"]
  # A judge no better than its majority class is a capacity finding; a better one is none.
  judge = {"examples": 178, "accuracy": 0.433, "majority_class_accuracy": 0.506,
           "accuracy_minus_majority": _ci(-0.073, -0.16, 0.01)}
  found = clarify_table4.diagnosis({**base, "differences": {}, "judge": judge})
  assert found[0]["points_to"] == "capacity" and "right on 43.3 % of its 178" in (
      found[0]["finding"])
  sharp = {**judge, "accuracy_minus_majority": _ci(0.2, 0.1, 0.3)}
  assert len(clarify_table4.diagnosis({**base, "differences": {}, "judge": sharp})) == 1


def test_clarify_supervised_models_per_role():
  one = clarify_table4.supervised_models(separate_models=False, dedicated_roles=None,
                                         train_steps=100)
  assert one == {"multitask": 100}
  alone = clarify_table4.supervised_models(separate_models=True, dedicated_roles=None,
                                           train_steps=100)
  assert alone == {role: 100 for role in clarify_table4.ROLES}
  mixed = clarify_table4.supervised_models(
      separate_models=False, dedicated_roles={"fusion": 30, "answer": 20}, train_steps=100)
  assert mixed == {"multitask": 100, "answer": 20, "fusion": 30}
  every = clarify_table4.supervised_models(
      separate_models=False, dedicated_roles={r: 5 for r in clarify_table4.ROLES},
      train_steps=100)
  assert "multitask" not in every  # No role is left to it.
  dirs = clarify_table4.role_model_dirs("/w", mixed)
  assert dirs["answer"] == "/w/answer_model" and dirs["fusion"] == "/w/fusion_model"
  assert {dirs[r] for r in ("question", "judge", "nli", "relevance")} == {"/w/multitask_model"}
  setup = {"supervised_models": mixed, "mixing_cap": 4000, "separate_models": False,
           "train_steps": 100}
  assert clarify_table4.models_line(setup) == (
      "one multi-task model (at most 4000 pairs per role) (100 steps) for question, judge, "
      "nli, relevance; an answer model of its own (20 steps); a fusion model of its own "
      "(30 steps)")
  assert clarify_table4.models_line({**setup, "pack": True}).endswith(
      "(30 steps), every one on packed rows")
  assert clarify_table4.models_line({**setup, "pack": sorted(mixed)}).endswith(
      "(30 steps), every one on packed rows")
  assert clarify_table4.models_line({**setup, "pack": ["multitask"]}) == (
      "one multi-task model (at most 4000 pairs per role) (100 steps, packed) for question, "
      "judge, nli, relevance; an answer model of its own (20 steps); a fusion model of its "
      "own (30 steps)")
  for bad, match in (({"answr": 5}, "unknown role"), ({"answer": 0}, ">= 1")):
    with pytest.raises(ValueError, match=match):
      clarify_table4.supervised_models(separate_models=False, dedicated_roles=bad,
                                       train_steps=1)
  with pytest.raises(ValueError, match="drop dedicated_roles"):
    clarify_table4.supervised_models(separate_models=True, dedicated_roles={"answer": 5},
                                     train_steps=1)


def test_clarify_packs_the_stages_named():
  stages = {"multitask": 100, "answer": 20, "fusion": 30}
  assert clarify_table4.packed_stages(True, stages) == set(stages)
  assert clarify_table4.packed_stages(False, stages) == set()
  assert clarify_table4.packed_stages(["multitask"], stages) == {"multitask"}
  assert clarify_table4.packed_stages("fusion", stages) == {"fusion"}
  with pytest.raises(ValueError, match=r"run_experiment.pack: \['judge'\] not among"):
    clarify_table4.packed_stages(["multitask", "judge"], stages)  # judge is in multitask


def test_clarify_verdict_refuses_a_policy_that_stopped_asking():
  gains = {"jsd": _ci(0.02, 0.01, 0.03), "flips_pct": _ci(9.0, 4.0, 15.0)}
  word, why = clarify_table4.verdict({"ppo - finetuned": {
      **gains, "question_pct": _ci(-64.0, -70.0, -58.0)}})
  assert word == "not shown" and "fell by 64.0 points [58.0, 70.0]" in why
  word, _ = clarify_table4.verdict({"ppo - finetuned": {
      **gains, "question_pct": _ci(-5.0, -12.0, 2.0)}})  # Within the tolerance: judged.
  assert word == "agrees"


def test_clarify_system_metrics_count_questions():
  class Result:  # The fields of reward.RewardResult that per_situation_metrics reads.
    scores = [0.1, 0.0, 0.2, 0.0]
    jsd = [0.1, 0.0, 0.3, 0.0]
    flips = [True, False, True, False]
    filtered = [False, True, False, True]

    def row(self, i):  # One question's pipeline, kept for reading examples.
      return {"jsd": self.jsd[i]}
  questions = ["Why?", "bed", "Who was there? ", "relevant"]

  class Reward:
    def score_questions(self, situations, asked):
      assert asked == questions and len(situations) == 4
      return Result()

  evaluated = clarify_evaluate.evaluate_generator(lambda s: list(questions), ["s"] * 4,
                                                  Reward())
  got = clarify_table4.system_metrics(evaluated, num_resamples=200, seed=0)
  assert got["per_situation"]["question_pct"] == [100.0, 0.0, 100.0, 0.0]
  assert got["question_pct"]["estimate"] == pytest.approx(50.0)
  assert got["flips_pct"]["estimate"] == pytest.approx(50.0)
  assert got["jsd"]["estimate"] == pytest.approx(np.mean(Result.scores))
  assert got["questions"] == questions
  # The same numbers as the library's means (one computation, two reports).
  assert got["jsd"]["estimate"] == pytest.approx(evaluated["jsd"])
  assert got["question_pct"]["estimate"] == pytest.approx(evaluated["question_pct"])
  assert got["wh_pct"]["why"]["estimate"] == pytest.approx(25.0)
  assert got["wh_pct"]["other"]["estimate"] == pytest.approx(50.0)
  assert got["distinct_1"] == evaluated["distinct_1"]


def test_a_finished_stage_is_reused_and_a_damaged_one_trained_again(tmp_path):
  from jaxmoral import checkpoints  # pylint: disable=g-import-not-at-top
  from jaxmoral import integrity  # pylint: disable=g-import-not-at-top
  run_dir, calls = tmp_path / "run", []

  def train():  # Stands in for a run: its final checkpoint (step 3) with a manifest.
    calls.append(1)
    step = run_dir / "checkpoints" / "3"
    (step / checkpoints.STATE_ITEM).mkdir(parents=True, exist_ok=True)
    (step / checkpoints.STATE_ITEM / "_METADATA").write_text("{}")
    integrity.write_integrity_manifest(step)
    return {"step": 3, "train/loss": 1.5, "done": True, "name": "x"}

  first = experiment_lib.train_stage(str(run_dir), 3, train)
  assert calls == [1] and not first["reused"] and "resumed_from_step" not in first
  assert first["result"] == {"step": 3, "train/loss": 1.5}  # the numbers only
  again = experiment_lib.train_stage(str(run_dir), 3, train)
  assert calls == [1] and again["reused"] and again["seconds"] == first["seconds"]
  # Another final step is another stage; a damaged final checkpoint is trained again.
  other = experiment_lib.train_stage(str(run_dir), 4, lambda: calls.append(2) or "/a/path")
  assert other["result"] == {} and calls == [1, 2]  # A stage may return a path, not numbers.
  assert other["resumed_from_step"] == 3  # Its run resumed from the save an earlier one left.
  (run_dir / "checkpoints" / "3" / checkpoints.STATE_ITEM / "_METADATA").write_text("{ }")
  assert not experiment_lib.train_stage(str(run_dir), 3, train)["reused"] and calls == [1, 2, 1]


def test_changed_bindings_name_what_a_run_was_trained_under_otherwise(tmp_path, caplog):
  from jaxmoral import checkpoints  # pylint: disable=g-import-not-at-top
  from jaxmoral import integrity  # pylint: disable=g-import-not-at-top
  long = repr(["x" * 30] * 4)  # Printed by gin over several lines.
  gin.clear_config()
  try:
    gin.parse_config(["NAME = 'a'", f"LONG = {long}", "clarify_table4.run_experiment.seed = 3"])
    run_dir = tmp_path / "run"
    assert experiment_lib.changed_bindings(str(run_dir)) == []  # No config.gin: nothing known.
    run_dir.mkdir()
    (run_dir / "config.gin").write_text(gin.config_str())
    assert experiment_lib.changed_bindings(str(run_dir)) == []
    gin.clear_config()
    gin.parse_config(["NAME = 'a'", f"LONG = {long}", "clarify_table4.run_experiment.seed = 4"])
    assert experiment_lib.changed_bindings(str(run_dir)) == [
        "- clarify_table4.run_experiment.seed = 3", "+ clarify_table4.run_experiment.seed = 4"]
    # A finished stage reused under other bindings says so (and is still reused).
    step = run_dir / "checkpoints" / "2"
    (step / checkpoints.STATE_ITEM).mkdir(parents=True)
    (step / checkpoints.STATE_ITEM / "_METADATA").write_text("{}")
    integrity.write_integrity_manifest(step)
    with caplog.at_level("WARNING", logger=experiment_lib.logger.name):
      assert experiment_lib.train_stage(str(run_dir), 2, lambda: pytest.fail("retrained"))[
          "reused"]
    assert "reused as it was trained under other gin bindings" in caplog.text
    assert "+ clarify_table4.run_experiment.seed = 4" in caplog.text
    # A config.gin gin cannot read is named, not taken for "no change".
    (run_dir / "config.gin").write_text("seed = [unclosed\n")
    changed = experiment_lib.changed_bindings(str(run_dir))
    assert len(changed) == 1 and changed[0].startswith(f"? {run_dir / 'config.gin'}: not a gin")
  finally:
    gin.clear_config()


def test_changed_bindings_read_a_run_in_a_bucket(gcs):
  from jaxmoral import fileio  # pylint: disable=g-import-not-at-top
  run_dir = "gs://bucket/experiments/changed_bindings"
  gin.clear_config()
  try:
    gin.parse_config(["clarify_table4.run_experiment.seed = 3"])
    fileio.write_text(f"{run_dir}/config.gin", gin.config_str())
    gin.clear_config()
    gin.parse_config(["clarify_table4.run_experiment.seed = 4"])
    assert experiment_lib.changed_bindings(run_dir) == [
        "- clarify_table4.run_experiment.seed = 3", "+ clarify_table4.run_experiment.seed = 4"]
  finally:
    gin.clear_config()


@pytest.mark.parametrize("steps,saves,every", [(120, 10, 12), (125, 10, 13), (7, 10, 1),
                                                (1, 1, 1), (1500, 10, 150)])
def test_stage_checkpoint_period_gives_at_most_the_saves_asked(steps, saves, every):
  got = experiment_lib.checkpoint_every(steps, saves=saves)
  assert got == every
  # Saves at multiples of the period and at the end: never more than asked, the end included.
  assert len(set(range(got, steps + 1, got)) | {steps}) <= saves


def test_stage_checkpoint_period_refuses_no_saves():
  with pytest.raises(ValueError, match="saves must be >= 1"):
    experiment_lib.checkpoint_every(10, saves=0)


def test_write_results_draws_the_plot_before_the_report_names_it(tmp_path, capsys):
  def plot(results, path, *, title):
    pathlib.Path(path).write_text(title)
    return path

  def report(results, *, name):
    return f"# {name}\nplot: {results['plot']}, x {results['x']}"

  out = experiment_lib.write_results({"x": 1.5}, results_dir=str(tmp_path / "r"), name="n",
                                     title="T", plot=plot, report=report)
  png, md = tmp_path / "r" / "n.png", tmp_path / "r" / "n.md"
  assert out["plot"] == str(png) and png.read_text() == "T"
  assert md.read_text() == f"# n\nplot: {png}, x 1.5\n"
  assert json.loads((tmp_path / "r" / "n.json").read_text()) == {"plot": str(png), "x": 1.5}
  assert f"plot: {png}, x 1.5" in capsys.readouterr().out


def test_npov_length_control_against_scipy():
  from jaxmoral.npov import task  # pylint: disable=g-import-not-at-top
  from jaxmoral.npov.detectors import base  # pylint: disable=g-import-not-at-top
  import scipy.stats  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  words = "alpha beta gamma delta epsilon zeta theta kappa lambda sigma".split()
  examples = []
  for i in range(40):
    n = int(rng.integers(1, 5))
    pro = tuple(" ".join(rng.choice(words, size=int(rng.integers(2, 6)))) for _ in range(n))
    kind = i % 3  # clean, hallucination, coverage
    examples.append(task.NpovExample(id=str(i), topic="t", query="Is it so?", pro=pro, con=(),
                                     response="r", hallucination=kind == 1, coverage=kind == 2))
  # The control scores shorter inputs as hallucinations and longer ones as coverage errors;
  # a synthetic hallucination (an argument removed) is always shorter than its source.
  from jaxmoral.npov import synthetic  # pylint: disable=g-import-not-at-top
  counts = [npov_table1.input_words(e) for e in examples]
  control = npov_table1.length_detections(examples)
  assert [d.coverage for d in control] == counts
  assert [d.hallucination for d in control] == [-c for c in counts]
  for e in examples:
    if len(e.pro) > 1:
      shorter = synthetic.make_hallucination(e, np.random.default_rng(1))
      assert npov_table1.input_words(shorter) < npov_table1.input_words(e)
  # A score made of length plus a signal: the length-matched AUC sees the signal only.
  signal = rng.normal(size=len(examples))
  detections = [base.Detection(2.0 * c + s + (1.5 if e.hallucination else 0.0), 0.0)
                for e, c, s in zip(examples, counts, signal)]
  out = npov_table1.length_dependence(examples, detections, num_resamples=200, seed=0)
  chosen = [k for k, e in enumerate(examples) if not e.coverage]
  scores = np.array([detections[k].hallucination for k in chosen])
  lengths = np.array(counts)[chosen]
  labels = np.array([int(examples[k].hallucination) for k in chosen])
  assert out["hallucination"]["spearman"] == pytest.approx(
      scipy.stats.spearmanr(scores, lengths).statistic)
  pairs = [float(scores[a] > scores[b]) + 0.5 * float(scores[a] == scores[b])
           for a in np.flatnonzero(labels == 1) for b in np.flatnonzero(labels == 0)
           if lengths[a] == lengths[b]]
  assert pairs and out["hallucination"]["length_matched_auc"]["estimate"] == pytest.approx(
      np.mean(pairs))
  assert out["coverage"]["spearman"] is None  # a constant score has no correlation
  # The control itself tells nothing beyond length.
  assert npov_table1.length_matched_auc(labels, -lengths, lengths) == 0.5
  # The side-balance control: |#pro - #con| for both errors; on balanced sources it separates
  # every synthetic error (which always unbalances the sides) from every clean example.
  balanced = [e.replace(con=e.pro) for e in examples if not (e.hallucination or e.coverage)]
  errors = [synthetic.make_hallucination(e, np.random.default_rng(2)) for e in balanced]
  scores = npov_table1.imbalance_detections(balanced + errors)
  assert [d.hallucination for d in scores] == [d.coverage for d in scores] == [
      abs(len(e.pro) - len(e.con)) for e in balanced + errors]
  assert all(d.hallucination == 0 for d in scores[:len(balanced)])
  assert all(d.hallucination == 1 for d in scores[len(balanced):])
  # The point-count control reads the template's lead phrases: every synthetic error of a
  # template response is told apart, clean ones score 0.
  source = task.NpovExample(id="s", topic="t", query="Is it so?", pro=("a b", "c d"),
                            con=("e f",), response=task.template_response(
                                "Is it so?", ("a b", "c d"), ("e f",)))
  assert task.template_points(source.response) == {"pro": 2, "con": 1}
  assert task.template_points("A free answer.") == {"pro": 0, "con": 0}
  variants = [source, source.replace(pro=("a b",), hallucination=True),
              source.replace(con=("e f", "g h"), coverage=True)]
  assert [(d.hallucination, d.coverage) for d in npov_table1.count_detections(variants)] == [
      (0.0, 0.0), (1.0, 0.0), (0.0, 1.0)]



def test_npov_substitution_probe_auc_against_scipy():
  """Clean/substituted pairs; the probe's AUC is Mann-Whitney's; counting gets 0.5."""
  from jaxmoral.npov import knowledge_base as kb_lib  # pylint: disable=g-import-not-at-top
  from jaxmoral.npov.detectors import base  # pylint: disable=g-import-not-at-top
  import scipy.stats  # pylint: disable=g-import-not-at-top
  topics = [kb_lib.Topic(id=f"t{k}", query=f"Is {k} so?", split="test", clusters=tuple(
      kb_lib.Cluster(texts=(f"argument {k} {i} text",), stance="pro" if i % 2 else "con")
      for i in range(8))) for k in range(30)]
  sources = kb_lib.sample_examples(topics, seed=0, max_per_side=2)
  examples = npov_table1.substitution_examples(sources, topics, seed=1)
  assert len(examples) == 2 * len(sources) and [e.hallucination for e in examples[:4]] == [
      False, True, False, True]
  assert [e.replace(hallucination=True) for e in examples[::2]] == [
      e.replace(hallucination=True, coverage=False) for e in sources]
  rng = np.random.default_rng(0)
  scores = rng.normal(size=len(examples)) + 0.8 * np.arange(len(examples)) % 2
  detections = [base.Detection(float(x), float(-x)) for x in scores]
  got = npov_table1.substitution_auc(examples, detections, num_resamples=200, seed=0)
  labels = np.arange(len(examples)) % 2
  u = scipy.stats.mannwhitneyu(scores[labels == 1], scores[labels == 0]).statistic
  assert got["hallucination"]["estimate"] == pytest.approx(u / (labels.sum() ** 2))
  assert got["coverage"]["estimate"] == pytest.approx(1 - u / (labels.sum() ** 2))
  assert got["hallucination"]["low"] < got["hallucination"]["estimate"] < got[
      "hallucination"]["high"]
  counted = npov_table1.substitution_auc(examples, npov_table1.count_detections(examples),
                                         num_resamples=200, seed=0)
  assert {e: v["estimate"] for e, v in counted.items()} == {"hallucination": 0.5,
                                                            "coverage": 0.5}


def test_npov_classifier_run_names_keep_earlier_workdirs():
  """Each training setting has its own run folder; a new setting adds a suffix and
  the existing names stay, so existing workdirs are reused rather than retrained."""
  names = {(t, b, s): npov_table1.classifier_run_name("coverage", tuning=t, balanced_sides=b,
                                                      substitutions=s)
           for t in ("prompt", "full") for b in (True, False) for s in (False, True)}
  assert len(set(names.values())) == len(names)
  assert names["prompt", True, False] == "classifier_coverage"
  assert names["full", True, False] == "classifier_full_coverage"
  assert names["full", False, False] == "classifier_full_unbalanced_coverage"
  assert names["full", False, True] == "classifier_full_unbalanced_substituted_coverage"


def test_clarify_reward_probe_stage_summary():
  import clarify_reward_probe  # pylint: disable=g-import-not-at-top
  from jaxmoral.clarify import reward  # pylint: disable=g-import-not-at-top
  base = np.array([[0.1, 0.6, 0.3], [0.2, 0.2, 0.6]])
  p_w = np.array([[0.5, 0.4, 0.1], [0.2, 0.2, 0.6]])
  p_s = np.array([[0.1, 0.4, 0.5], [0.2, 0.2, 0.6]])
  result = reward.RewardResult(
      scores=np.array([0.2, 0.0]), jsd=np.array([0.2, 0.0]), filtered=np.array([False, True]),
      flips=np.array([True, False]), judgment=["ok", "good"], base_distribution=base,
      weakener=["a", "b "], strengthener=["c", "b"], weakened_situation=["x", "y"],
      strengthened_situation=["z", "y"], weakened_distribution=p_w,
      strengthened_distribution=p_s, weakener_filtered=np.array([False, True]),
      strengthener_filtered=np.array([False, False]))
  got = clarify_reward_probe.stage_summary(result)
  assert got["answers_weakener_equals_strengthener"] == 0.5  # "b " and "b" are the same answer
  assert got["fusions_weakened_equals_strengthened"] == 0.5
  assert got["weakener_filtered_pct"] == 50.0 and got["strengthener_filtered_pct"] == 0.0
  assert got["judge_base_verdicts"] == {"good": 0.5, "ok": 0.5}
  assert got["judge_base_max_prob"] == pytest.approx(0.6)
  assert got["judge_base_entropy_nats"] == pytest.approx(
      np.mean([-(r * np.log(r)).sum() for r in base]))
  assert got["judge_total_variation_w_vs_s"] == pytest.approx((0.4 + 0.0) / 2)
  assert got["judge_total_variation_base_vs_w"] == pytest.approx((0.4 + 0.0) / 2)
  assert got["reward_mean"] == pytest.approx(0.1) and got["jsd_unfiltered_mean"] == pytest.approx(0.1)


def test_clarify_reward_probe_reads_the_experiment_config():
  import clarify_reward_probe  # pylint: disable=g-import-not-at-top
  _parse("--gin_file=configs/experiments/clarify_table4_cpu.gin", "--gin.INIT_CHECKPOINT='/b'")
  assert clarify_reward_probe._bound("workdir") == "/tmp/jaxmoral_experiments/clarify_table4_cpu"
  config = clarify_reward_probe._bound("reward_config")
  assert config.input_length == 96 and config.batch_size == 64
  assert clarify_reward_probe._bound("max_eval_situations") == 300
  assert clarify_reward_probe._bound("question_length", 32) == 32  # unbound: the default


def test_clarify_systems_subset_keeps_table_order_and_refuses_unknown_names():
  assert clarify_table4.evaluated_systems(None) == clarify_table4.SYSTEMS
  assert clarify_table4.evaluated_systems(["ppo@greedy", "why", "ppo"]) == \
      ("why", "ppo", "ppo@greedy")
  for bad in (["ppo", "sft"], [], ["ppo", "ppo"]):
    with pytest.raises(ValueError, match="run_experiment.systems"):
      clarify_table4.evaluated_systems(bad)


def test_clarify_kl_config_evaluates_known_systems():
  _parse("--gin_file=configs/experiments/clarify_table4_cpu_dedicated_kl.gin",
         "--gin.INIT_CHECKPOINT='/base'")
  systems = gin.query_parameter("clarify_table4.run_experiment.systems")
  assert set(clarify_table4.evaluated_systems(systems)) >= {"finetuned", "ppo"}


def test_clarify_reward_probe_finds_the_dedicated_models(tmp_path):
  import clarify_reward_probe  # pylint: disable=g-import-not-at-top
  _parse("--gin_file=configs/experiments/clarify_table4_cpu_dedicated.gin",
         "--gin.INIT_CHECKPOINT='/b'", f"--gin.WORKDIR='{tmp_path}'")
  assert clarify_reward_probe._bound("dedicated_roles") == {"answer": 400, "fusion": 600}
  (tmp_path / "multitask_model").mkdir()
  with pytest.raises(FileNotFoundError, match="answer_model, .*fusion_model: run"):
    clarify_reward_probe.probe()


def test_the_npov_demo_table_fits_the_demo_width_with_every_number():
  from jaxmoral.npov import demo as npov_demo  # pylint: disable=g-import-not-at-top
  cell = {"example_auc": 0.8123, "example_auc_ci": [0.7012, 1.0], "word_auc": 0.6,
          "num_examples": 160, "num_positive": 80, "num_words": 12345}
  results = {s: {d: {e: cell for e in ("hallucination", "coverage")}
                 for d in ("rouge", "salience", "classifier")}
             for s in ("unparaphrased", "paraphrased")}
  table = npov_demo.summary_table(results)
  assert max(len(line) for line in table.splitlines()) <= demo.WIDTH
  rows = [line for line in table.splitlines() if line.startswith("unparaphrased  classifier")]
  assert rows and rows[0].split()[2:] == ["81.2", "[70.1,", "100.0]", "60.0", "81.2", "[70.1,",
                                          "100.0]", "60.0"]
  assert "n, paraphrased coverage: 160 examples (80 with the error), 12345 words" in table


def test_the_diamante_demo_names_a_different_candidate_or_says_there_is_none():
  from jaxmoral.diamante import demo as diamante_demo  # pylint: disable=g-import-not-at-top
  from jaxmoral.diamante import inference  # pylint: disable=g-import-not-at-top
  same = inference.Candidate(text="ok", score=6.56, logprob=-1.0)
  reply = inference.Reply(text="ok", score=6.56, candidates=(same, same))
  assert diamante_demo._candidates_note(reply) == ("score 6.56, best of 2 candidates, all the "
                                                   "same text")
  other = inference.Candidate(text="fine", score=5.1, logprob=-2.0)
  reply = inference.Reply(text="ok", score=6.56, candidates=(same, other, same))
  assert diamante_demo._candidates_note(reply).endswith("(2 different); lowest 5.10: fine")


def test_clarify_reward_spread_and_judge_quality():
  scores = np.array([[0.0, 0.2, 0.1], [0.0, 0.0, 0.0]])
  spread = clarify_best_of_n.reward_spread(scores)
  assert spread["zero_pct"] == pytest.approx(100 * 4 / 6)
  assert spread["situations_all_zero_pct"] == 50.0
  assert spread["best_minus_mean"] == pytest.approx(((0.2 - 0.1) + 0.0) / 2)
  assert spread["within_situation_std"] == pytest.approx(np.std([0.0, 0.2, 0.1]) / 2)
  p = np.array([[0.8, 0.1, 0.1], [1 / 3, 1 / 3, 1 / 3], [0.1, 0.2, 0.7]])
  judge = clarify_table4.judge_quality(p, [0, 1, 2])
  assert judge["accuracy"] == pytest.approx(2 / 3)  # The uniform row's argmax is class 0.
  assert judge["majority_class_accuracy"] == pytest.approx(1 / 3)
  # Against its null, per example: right (1, 0, 1) minus the majority class's (1, 0, 0).
  assert judge["accuracy_minus_majority"]["estimate"] == pytest.approx(1 / 3)
  want = -np.sum(p * np.log(p), axis=1).mean()
  assert judge["mean_entropy_nats"] == pytest.approx(want)
  assert judge["uniform_entropy_nats"] == pytest.approx(np.log(3))


def test_clarify_reads_the_judge_pairs_its_training_held_out():
  from jaxmoral.clarify import data as data_lib  # pylint: disable=g-import-not-at-top
  from jaxmoral.clarify import formats  # pylint: disable=g-import-not-at-top
  from jaxmoral.data import pairs as pairs_lib  # pylint: disable=g-import-not-at-top
  classes = formats.DEMO_JUDGE_CLASSES
  held = clarify_table4.heldout_judge_examples("demo", judge_classes=classes)
  trained = data_lib.build_pairs("judge", "demo", judge_classes=classes)
  validation = set(pairs_lib.split_pairs(trained, rule="hash")["validation"])
  mapping = dict(zip(formats.JUDGMENTS, classes, strict=True))
  got = {(formats.judge_input(s), mapping[formats.JUDGMENTS[label]]) for s, label in held}
  assert held and got == validation
