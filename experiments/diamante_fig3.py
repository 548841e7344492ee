"""Diamante, Fig. 3 shape: does the jointly trained preference score find the human response?

Lu, Bao et al. (ACL 2023), Fig. 3: ranked by the jointly trained preference score s(c, r), the
human response comes first far more often than ranked by the generation probability, which is
close to random. Checked here on the chitchat corpus (BYU PCC human–human chats,
`jaxmoral.diamante.chitchat`, split by conversation id) from a span-corruption-pretrained T5
(INIT_CHECKPOINT), with the library's own commands:

1. a generator fine-tuned from INIT_CHECKPOINT on (context, human response) pairs of the train
   conversations (`runs.train_run` with `diamante.DialogueData(pairs=True)`, what
   `jaxmoral diamante train --gin_file=configs/diamante/generator_tiny_cpu.gin` runs) samples
   top-k candidates for every train turn (`candidates.generate_candidates`) and for the test
   contexts (`candidates.sample_candidates`);
2. the joint model (NLL + preference) and the NLL-only ablation, both from INIT_CHECKPOINT,
   same data, steps and seed (`runs.train_run` with `diamante.DiamanteModel`);
3. one context from each of `max_test_contexts` held-out conversations: its human response is
   ranked among its sampled candidates and `num_random` human responses of other test
   conversations (`evaluate.ranking_items`, the items of `jaxmoral diamante eval`) by the
   preference score, the generation log-prob and the log-prob per token; MAP, MRR and P@1 with
   95 % bootstrap intervals over contexts, and paired intervals of the differences.

  python experiments/diamante_fig3.py --gin_file=configs/experiments/diamante_fig3_cpu.gin \
      --gin.INIT_CHECKPOINT="'/work/runs/pretrain_mini'"

Writes `<RESULTS_DIR>/<NAME>.md` (tables), `.json` (every number), `.png` (the plot); the runs
go under WORKDIR, and a rerun resumes or reuses every finished stage.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from typing import Any, Mapping, Optional, Sequence

import gin
import numpy as np

import experiment_lib as common  # puts the project root on sys.path

# The library is imported where it is used, so that reading the configs (tests, --help) does
# not load JAX and the models.

logger = logging.getLogger("diamante_fig3")

RANKERS = (("preference", "preference score"), ("generation", "generation log-prob"),
           ("generation_per_token", "log-prob per token"))
METRICS = (("map", "MAP"), ("mrr", "MRR"), ("p@1", "P@1"))
MODELS = (("joint", 1.0), ("nll_only", 0.0))
PAPER = ("paper (Lu, Bao et al. 2023, Fig. 3): ranked by the jointly trained preference score "
         "the human response comes first far more often than by chance and than ranked by "
         "generation probability, which is close to random")


def _subsample(conversations: Sequence[Sequence[str]], limit: Optional[int],
               rng: np.random.Generator) -> list[list[str]]:
  """`limit` conversations drawn without replacement, kept in corpus order (None: all)."""
  if limit is None or limit >= len(conversations):
    return [list(c) for c in conversations]
  keep = np.sort(rng.choice(len(conversations), size=limit, replace=False))
  return [list(conversations[i]) for i in keep]


def choose_test_turns(turns: Sequence[Any], *, max_contexts: int,
                      seed: int) -> list[int]:
  """One random turn from each of `max_contexts` random conversations (independent contexts)."""
  by_dialogue: dict[int, list[int]] = {}
  for i, t in enumerate(turns):
    by_dialogue.setdefault(t.dialogue, []).append(i)
  rng = np.random.default_rng(seed)
  dialogues = rng.permutation(sorted(by_dialogue))[:max_contexts]
  return sorted(int(rng.choice(by_dialogue[int(d)])) for d in dialogues)


@gin.configurable(module="diamante_fig3")
def with_head_optimizer(*, optimizer: Any, head_optimizer: Any) -> Any:
  """`optimizer` for every parameter but the preference score's head (`scalar_head`), which
  `head_optimizer` updates: e.g. Adafactor without parameter scaling, whose steps do not
  shrink with the head's small initial weights. The optimizer's reported learning rate is
  `optimizer`'s."""
  # pylint: disable=import-outside-toplevel
  import jax
  import optax
  from jaxmoral import optimizers
  # pylint: enable=import-outside-toplevel

  def labels(params: Any) -> Any:
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "head" if any(getattr(k, "key", None) == "scalar_head" for k in path)
        else "rest", params)

  both = optax.multi_transform({"rest": optimizer, "head": head_optimizer}, labels)
  return optimizers.Optimizer(both.init, both.update, optimizer.learning_rate)


def _train(model_dir: str, **kwargs: Any) -> dict[str, Any]:
  """`runs.train_run` as a stage (`common.train_stage`)."""
  from jaxmoral import runs  # pylint: disable=import-outside-toplevel
  return common.train_stage(model_dir, kwargs["train_steps"],
                            lambda: runs.train_run(model_dir=model_dir, **kwargs))


@gin.configurable(module="diamante_fig3")
def run_experiment(*, workdir: str, results_dir: str, name: str, init_checkpoint: str,
                   model_config: Any, optimizer: Any, generator_optimizer: Any = None,
                   feature_lengths: Mapping[str, int], chitchat_path: Optional[str] = None,
                   batch_size: int = 16,
                   generator_steps: int = 300, train_steps: int = 1000,
                   max_train_dialogues: Optional[int] = 1000,
                   max_test_contexts: int = 300, min_turns: int = 4, max_turns: int = 8,
                   train_candidates: int = 3, test_candidates: int = 9, num_random: int = 5,
                   top_k: int = 10, pe_weight: float = 1.0,
                   models: Sequence[str] = ("joint", "nll_only"),
                   candidate_batch_size: int = 64, eval_batch_size: int = 16,
                   num_resamples: int = 1000, log_every: int = 50,
                   checkpoints_per_stage: int = 10, seed: int = 0,
                   command: str = "") -> dict[str, Any]:
  """Runs the whole experiment; writes and returns the results.

  Args:
    workdir: Runs, candidate files and the data split (WORKDIR).
    results_dir: Where `<name>.md/.json/.png` go (RESULTS_DIR).
    name: Name of the result files (NAME).
    init_checkpoint: The pretrained base (INIT_CHECKPOINT): a run, export or Hub id.
    model_config: The base's T5Config (MODEL_CONFIG, from a gin/models fragment).
    optimizer: Optimizer of the joint and NLL-only runs (OPTIMIZER).
    generator_optimizer: The generator's (default: `optimizer`).
    feature_lengths: `{"inputs": context tokens, "targets": response tokens}`.
    chitchat_path: The conversations, a file in the layout of the chitchat package's
      `dataset.json` (CHITCHAT_PATH; `chitchat.dialogues`); None: the installed package (the
      `dialogue` extra).
    batch_size: Quadruples (joint, NLL-only) or pairs (generator) per step.
    generator_steps: Fine-tuning steps of the candidate generator.
    train_steps: Steps of the joint and the NLL-only run each.
    max_train_dialogues: Train conversations used (None: all of the train split).
    max_test_contexts: Test contexts, one per held-out conversation.
    min_turns: Conversations with fewer turns are left out.
    max_turns: The first this many turns of each conversation are used.
    train_candidates: Sampled candidates per train turn (r_M is drawn from them).
    test_candidates: Sampled candidates per test context (ranked with r_H).
    num_random: Human responses of other test conversations added to each ranking.
    top_k: Top-k of the candidate sampling (the paper: 10).
    pe_weight: The joint model's weight of the preference loss (the paper: 1); the NLL-only
      ablation's is 0.
    models: Which of "joint" and "nll_only" to train and rank (both for a verdict; one
      alone trains it beside another invocation that shares its WORKDIR's other runs).
    candidate_batch_size: Contexts per sampling call.
    eval_batch_size: Contexts per scoring call.
    num_resamples: Bootstrap resamples.
    log_every: Training progress lines.
    checkpoints_per_stage: Checkpoints of each training stage, the last at its end (a
      stopped experiment resumes from the newest).
    seed: One seed for the split, the runs, the sampling and the bootstrap.
    command: The command line (written into the report).

  Returns:
    Every number of the report (also in `<results_dir>/<name>.json`).
  """
  # pylint: disable=import-outside-toplevel
  from jaxmoral.diamante import bundle as bundle_lib
  from jaxmoral.diamante import candidates as candidates_lib
  from jaxmoral.diamante import chitchat
  from jaxmoral.diamante import data as data_lib
  from jaxmoral.diamante import evaluate as evaluate_lib
  from jaxmoral.diamante import diamante_model
  from jaxmoral.models import trainable
  # pylint: enable=import-outside-toplevel
  started = time.time()
  common.fileio.makedirs(workdir)  # A local folder or a bucket URL.
  timings: dict[str, float] = {}
  context_length, response_length = (int(feature_lengths["inputs"]),
                                     int(feature_lengths["targets"]))

  # Data: train conversations (sampled), test conversations (all: random responses come from
  # them), one test context per sampled test conversation.
  rng = np.random.default_rng(seed)
  corpus = dict(min_turns=min_turns, max_turns=max_turns, path=chitchat_path)
  train_convs = _subsample(chitchat.dialogues(split="train", **corpus), max_train_dialogues, rng)
  test_convs = chitchat.dialogues(split="test", **corpus)
  train_turns = chitchat.turns(train_convs)
  test_turns = chitchat.turns(test_convs)
  chosen = choose_test_turns(test_turns, max_contexts=max_test_contexts, seed=seed)
  plain_train = os.path.join(workdir, "train.jsonl")
  data_lib.write_turns(plain_train, train_turns)
  logger.info("chitchat: %d train conversations (%d turns), %d test conversations, %d test "
              "contexts", len(train_convs), len(train_turns), len(test_convs), len(chosen))
  common_run = dict(batch_size=batch_size, feature_lengths=dict(feature_lengths),
                    init_checkpoint=init_checkpoint, seed=seed, log_every=log_every)

  # 1. The candidate generator and the stored candidates.
  gen_dir = os.path.join(workdir, "generator")
  gen_train = _train(
      gen_dir, model=trainable.Seq2SeqModel(config=model_config, z_loss=0.0),
      data=data_lib.DialogueData(train_path=plain_train, pairs=True),
      train_steps=generator_steps,
      checkpoint_every=common.checkpoint_every(generator_steps, saves=checkpoints_per_stage),
      optimizer=generator_optimizer or optimizer, **common_run)
  timings["generator_train_s"] = gen_train["seconds"]
  tick = time.time()
  with_candidates = os.path.join(workdir, "train_with_candidates.jsonl")
  test_path = os.path.join(workdir, "test_with_candidates.jsonl")
  reused = [path for path in (with_candidates, test_path) if common.fileio.isfile(path)]
  if not common.fileio.isfile(with_candidates):
    candidates_lib.generate_candidates(
        model_dir=gen_dir, turns=train_turns, output_path=with_candidates + ".tmp",
        num_candidates=train_candidates, top_k=top_k, max_decode_length=response_length - 1,
        batch_size=candidate_batch_size, seed=seed)
    common.fileio.rename(with_candidates + ".tmp", with_candidates)
  if not common.fileio.isfile(test_path):
    sampled = candidates_lib.sample_candidates(
        bundle_lib.load(gen_dir), [test_turns[i].context for i in chosen],
        num_candidates=test_candidates, top_k=top_k, max_decode_length=response_length - 1,
        batch_size=candidate_batch_size, seed=seed + 1)
    with_cands = list(test_turns)
    for i, cands in zip(chosen, sampled):
      with_cands[i] = dataclasses.replace(test_turns[i], candidates=tuple(cands))
    data_lib.write_turns(test_path + ".tmp", with_cands)
    common.fileio.rename(test_path + ".tmp", test_path)
  timings["candidates_s"] = time.time() - tick
  test_eval_turns = data_lib.read_dialogues(test_path)

  # 2. Joint and NLL-only from the same base, same data, steps and seed; 3. ranking.
  per_context: dict[str, dict[str, np.ndarray]] = {}
  trained: dict[str, dict[str, Any]] = {}
  unknown = sorted(set(models) - {m for m, _ in MODELS})
  if unknown or not models:
    raise ValueError(f"diamante_fig3.run_experiment.models: {unknown or 'none'} not among "
                     f"{[m for m, _ in MODELS]}")
  for model_name, weight in MODELS:
    if model_name not in models:
      continue
    run_dir = os.path.join(workdir, model_name)
    trained[model_name] = _train(
        run_dir, model=diamante_model.DiamanteModel(config=model_config,
                                                    pe_weight=weight * pe_weight),
        data=data_lib.DialogueData(train_path=with_candidates), train_steps=train_steps,
        checkpoint_every=common.checkpoint_every(train_steps, saves=checkpoints_per_stage),
        optimizer=optimizer, **common_run)
    timings[f"{model_name}_train_s"] = trained[model_name]["seconds"]
    tick = time.time()
    per_context[model_name] = evaluate_lib.rank_contexts(
        bundle_lib.load(run_dir), test_eval_turns, num_random=num_random,
        max_candidates=test_candidates, batch_size=eval_batch_size, seed=seed)
    timings[f"{model_name}_eval_s"] = time.time() - tick

  results = summarize(per_context, num_resamples=num_resamples, seed=seed)
  timings["total_s"] = time.time() - started
  reused += [os.path.join(workdir, k) for k, t in {"generator": gen_train, **trained}.items()
             if t.get("reused")]
  results.update({
      "command": command, "machine": common.machine(), "timings": timings, "reused": reused,
      "train": {k: t["result"] for k, t in {"generator": gen_train, **trained}.items()},
      "setup": {"init_checkpoint": init_checkpoint, "chitchat_path": chitchat_path,
                "model": trainable.describe(diamante_model.DiamanteModel(config=model_config)),
                "train_conversations": len(train_convs), "train_turns": len(train_turns),
                "test_conversations": len(test_convs), "test_contexts": len(chosen),
                "context_length": context_length, "response_length": response_length,
                "batch_size": batch_size, "generator_steps": generator_steps,
                "train_steps": train_steps, "train_candidates": train_candidates,
                "test_candidates": test_candidates, "num_random": num_random, "top_k": top_k,
                "pe_weight": pe_weight,
                "min_turns": min_turns, "max_turns": max_turns, "seed": seed,
                "num_resamples": num_resamples},
      "per_context": {m: {k: v.tolist() for k, v in pc.items()}
                      for m, pc in per_context.items()}})
  return common.write_results(results, results_dir=results_dir, name=name,
                              title=f"Diamante Fig. 3 shape ({name})", plot=plot, report=report)


def claim_parts(results: Mapping[str, Any]) -> list[Any]:
  """The paper's claim as parts (`common.ClaimPart`), each a paired interval of P@1 over the
  same test contexts: the joint model's preference score ranks the human response first more
  often than a random ranker (chance: 1 / the context's items), than the NLL-only model's
  untrained head (what joint training adds), and than generation log-prob, summed and per
  token. A missing NLL-only run leaves its part unmeasured, which the claim requires."""
  diffs = results["differences"]
  p1 = lambda key: diffs[key]["p@1"] if key in diffs else None  # noqa: E731
  return [
      common.ClaimPart("joint P@1 by preference minus a random ranker's (chance)",
                       p1("joint: preference - random")),
      common.ClaimPart("joint minus NLL-only (untrained head) P@1 by preference",
                       p1("preference: joint - nll_only"), null="untrained head"),
      common.ClaimPart("joint P@1 by preference minus by generation log-prob",
                       p1("joint: preference - generation")),
      common.ClaimPart("joint P@1 by preference minus by log-prob per token",
                       p1("joint: preference - generation_per_token"))]


def verdict(results: Mapping[str, Any]) -> tuple[str, str]:
  """(AGREES | DISAGREES | NOT_SHOWN, why) by `common.claim_verdict` on `claim_parts`."""
  return common.claim_verdict(claim_parts(results))


def summarize(per_context: Mapping[str, Mapping[str, np.ndarray]], *, num_resamples: int,
              seed: int) -> dict[str, Any]:
  """Means with bootstrap intervals over contexts, and paired intervals of differences."""
  ci = lambda v: common.ci_dict(common.mean_ci(v, num_resamples=num_resamples,  # noqa: E731
                                               seed=seed))
  diff = lambda a, b: common.ci_dict(common.paired_diff_ci(  # noqa: E731
      a, b, num_resamples=num_resamples, seed=seed))
  table: dict[str, Any] = {}
  for model_name, pc in per_context.items():
    table[model_name] = {ranker: {key: ci(pc[f"{ranker}/{key}"]) for key, _ in METRICS}
                         for ranker, _ in RANKERS}
    table[model_name]["pe_accuracy"] = ci(pc["pe_accuracy"][np.isfinite(pc["pe_accuracy"])])
    table[model_name]["random_p@1"] = float(np.mean(pc["random/p@1"]))
    table[model_name]["num_contexts"] = int(len(pc["turn"]))
  differences: dict[str, Any] = {}
  for model_name, pc in per_context.items():
    # Chance: a random ranker's expected P@1 in each context (1 / its items), paired.
    differences[f"{model_name}: preference - random"] = {
        "p@1": diff(pc["preference/p@1"], pc["random/p@1"])}
    for other in ("generation", "generation_per_token"):
      differences[f"{model_name}: preference - {other}"] = {
          key: diff(pc[f"preference/{key}"], pc[f"{other}/{key}"]) for key, _ in METRICS}
  if "joint" in per_context and "nll_only" in per_context:
    joint, ablation = per_context["joint"], per_context["nll_only"]
    if not np.array_equal(joint["turn"], ablation["turn"]):
      raise ValueError("summarize: joint and nll_only were ranked on different contexts")
    for ranker in ("preference", "generation", "generation_per_token"):
      differences[f"{ranker}: joint - nll_only"] = {
          key: diff(joint[f"{ranker}/{key}"], ablation[f"{ranker}/{key}"]) for key, _ in METRICS}
  results = {"table": table, "differences": differences}
  if "joint" in per_context:
    results["verdict"], results["verdict_why"] = verdict(results)
  return results


def verdict_lines(results: Mapping[str, Any]) -> list[str]:
  """The claim, the rule and this run's verdict (Markdown lines)."""
  return [f"Claim: {PAPER}; and joint training is what makes the score work. Tested as four "
          "parts, each a paired interval of P@1 over the same contexts: joint by preference "
          "above a random ranker, above the NLL-only model's untrained head, above generation "
          "log-prob and above log-prob per token.", "", common.VERDICT_RULE, "",
          f"This run: **{results['verdict']}** ({results['verdict_why']})."]


def report(results: Mapping[str, Any], *, name: str) -> str:
  """The Markdown section for bench/RESULTS.md."""
  s = results["setup"]
  t = results["timings"]
  weight = ("" if s.get("pe_weight", 1.0) == 1.0 else
            f" (the joint model's preference-loss weight {s['pe_weight']:g})")
  lines = [
      *common.report_head(results, name=name),
      f"Setup: base `{s['init_checkpoint']}` ({s['model']['params_m']}M parameters, "
      f"d_model {s['model']['d_model']}, {s['model']['layers']} layers); chitchat train split: "
      f"{s['train_conversations']} conversations (first {s['max_turns']} turns, >= "
      f"{s['min_turns']}), {s['train_turns']} turns; generator {s['generator_steps']} steps, "
      f"{s['train_candidates']} top-{s['top_k']} candidates per train turn; joint and nll_only "
      f"{s['train_steps']} steps each{weight}, batch {s['batch_size']}, context/response "
      f"{s['context_length']}/{s['response_length']} tokens, seed {s['seed']}. Test: "
      f"{s['test_contexts']} contexts, one from each of as many held-out conversations (of "
      f"{s['test_conversations']}); r_H among {s['test_candidates']} sampled candidates + "
      f"{s['num_random']} random human responses (ties against r_H; one relevant response, "
      f"so MAP equals MRR). Intervals: 95 % percentile bootstrap over contexts, "
      f"{s['num_resamples']} resamples.",
      "",
      "| model | ranked by | MAP | MRR | P@1 |",
      "|---|---|---|---|---|"]
  for model_name, _ in MODELS:
    if model_name not in results["table"]:
      continue
    row = results["table"][model_name]
    for ranker, label in RANKERS:
      if model_name == "nll_only" and ranker == "preference":
        label += " (untrained head)"
      cells = " | ".join(common.fmt(row[ranker][k]) for k, _ in METRICS)
      lines.append(f"| {model_name} | {label} | {cells} |")
  first = next(iter(results["table"].values()))
  lines += [f"| random ranker (expected) | — | — | — | {first['random_p@1']:.3f} |", "",
            "Paired differences (same contexts), 95 % intervals:", "",
            "| difference | ΔMAP | ΔMRR | ΔP@1 |", "|---|---|---|---|"]
  for label, by_key in results["differences"].items():
    cells = " | ".join(common.fmt(by_key.get(k)) for k, _ in METRICS)
    lines.append(f"| {label} | {cells} |")
  lines += ["", "| model | PE ranking accuracy (H>M, H>R, M>R pairs) | final train nll | "
            "final train pe_loss | train s | eval s |", "|---|---|---|---|---|---|"]
  for model_name, _ in MODELS:
    if model_name not in results["table"]:
      continue
    pe = results["table"][model_name]["pe_accuracy"]
    tr = results["train"].get(model_name, {})
    lines.append(f"| {model_name} | {common.fmt(pe)} | "
                 f"{tr.get('train/nll', float('nan')):.3f} | "
                 f"{tr.get('train/pe_loss', float('nan')):.3f} | "
                 f"{t.get(model_name + '_train_s', float('nan')):.0f} | "
                 f"{t.get(model_name + '_eval_s', float('nan')):.0f} |")
  lines += ["", f"Generator: {t['generator_train_s']:.0f} s training, candidates "
            f"{t['candidates_s']:.0f} s; whole experiment {t['total_s'] / 60:.1f} min."]
  if results.get("reused"):
    lines.append("Reused from an earlier invocation (their seconds are that one's): "
                 + ", ".join(f"`{p}`" for p in results["reused"]) + ".")
  lines.append("")
  if "verdict" in results:
    lines += verdict_lines(results)
  lines += ["", f"Plot: `{results['plot']}`."]
  return "\n".join(lines)


def plot(results: Mapping[str, Any], path: str, *, title: str) -> str:
  """MAP / MRR / P@1 bars with their intervals, per model and ranker."""
  from jaxmoral import pictures  # pylint: disable=import-outside-toplevel
  plt = pictures.pyplot()
  table = results["table"]
  models = [m for m, _ in MODELS if m in table]
  fig, axes = plt.subplots(1, len(METRICS), figsize=(4.2 * len(METRICS), 3.8), sharey=True)
  width = 0.8 / len(RANKERS)
  colors = ("tab:blue", "tab:orange", "tab:green")
  for ax, (key, label) in zip(np.atleast_1d(axes), METRICS):
    for r, ((ranker, ranker_label), color) in enumerate(zip(RANKERS, colors)):
      xs = np.arange(len(models)) + (r - (len(RANKERS) - 1) / 2) * width
      cis = [table[m][ranker][key] for m in models]
      est = np.array([c["estimate"] for c in cis])
      err = np.array([[c["estimate"] - c["low"] for c in cis],
                      [c["high"] - c["estimate"] for c in cis]])
      ax.bar(xs, est, width, yerr=err, capsize=3, color=color, label=ranker_label)
    if key == "p@1":
      ax.axhline(table[models[0]]["random_p@1"], color="gray", linestyle="--",
                 label="random ranker")
    ax.set_xticks(np.arange(len(models)))
    ax.set_xticklabels(models)
    ax.set_title(label)
    ax.grid(axis="y", alpha=0.3)
  np.atleast_1d(axes)[0].set_ylabel("human response ranked (95 % CI)")
  np.atleast_1d(axes)[-1].legend(fontsize=8, loc="upper right")
  fig.suptitle(title)
  return pictures.save_figure(fig, path, dpi=110)


if __name__ == "__main__":
  sys.exit(common.main(run_experiment))
