"""Each output the library writes, read into what a page shows (plain dicts and lists).

Readers take a confined path (`folders.Roots.resolve`) and use the library's own reader where
there is one. A bad file raises (ValueError, OSError): the page shows the message in place of
that part.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import pathlib
import re
from typing import Any, Mapping, Optional

import numpy as np

from jaxmoral.explore import folders

ERROR_TYPES = ("hallucination", "coverage")
JUDGMENTS = ("bad", "ok", "good")


def read_jsonl(path: pathlib.Path) -> list[dict[str, Any]]:
  """Objects of a JSONL file; a bad line raises naming `path:line`."""
  rows = []
  with open(path, encoding="utf-8") as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except ValueError as error:
        raise ValueError(f"{path.name}:{number}: not JSON ({error})") from None
      if not isinstance(row, dict):
        raise ValueError(f"{path.name}:{number}: expected a JSON object")
      rows.append(row)
  return rows


def read_json(path: pathlib.Path, expected: Optional[str] = None) -> Any:
  """A JSON file's value; with `expected` (what the message says it should be), an object."""
  try:
    data = json.loads(path.read_text(encoding="utf-8"))
  except ValueError as error:
    raise ValueError(f"{path.name}: not JSON ({error})") from None
  if expected is not None and not isinstance(data, dict):
    raise ValueError(f"{path.name}: expected {expected}")
  return data


def _verdict(line: Any) -> dict[str, str]:
  paper, _, this_run = str(line).partition("\n")
  return {"paper": paper.removeprefix("paper: ").strip(),
          "this_run": this_run.strip().removeprefix("this run: ")}


def demo_verdicts(path: pathlib.Path) -> dict[str, list[dict[str, str]]]:
  """`jaxmoral demo`'s summary.json verdicts (`demo.truth_line`): {part: [{paper, this_run}]}."""
  data = read_json(path, "the demo's summary object")
  return {part: [_verdict(line) for line in summary["truth"]]
          for part, summary in data.items()
          if isinstance(summary, dict) and isinstance(summary.get("truth"), list)}


def detector_name(path: pathlib.Path, records: list[dict[str, Any]]) -> str:
  """A score file's detector: `scores_<detector>.jsonl` names it; else a file without word
  scores is the classifiers', one beside heatmaps/ salience's."""
  match = re.fullmatch(r"scores[_-](\w+)\.jsonl", path.name)
  if match:
    return match.group(1)
  if records and not any(r.get("response_words") or r.get("argument_words") for r in records):
    return "classifier"
  if (path.parent / "heatmaps").is_dir():
    return "salience"
  return path.stem


def error_type(example: Any) -> str:
  if example.hallucination:
    return "hallucination"
  if example.coverage:
    return "coverage"
  if example.hallucination is None and example.coverage is None:
    return "unlabelled"
  return "clean"


def npov_folder(folder: pathlib.Path) -> dict[str, Any]:
  """{"examples", "detectors", "problems"} of a `npov detect` output folder: the examples of
  `responses.jsonl` (else the JSONL whose ids the scores name) with each `scores*.jsonl`
  detector's scores and ROUGE-1 overlaps (computed here), and unreadable files' messages."""
  from jaxmoral.npov import task  # pylint: disable=import-outside-toplevel
  from jaxmoral.npov.detectors import rouge  # pylint: disable=import-outside-toplevel
  problems: list[str] = []
  scores: dict[str, dict[str, dict[str, Any]]] = {}
  for path in folders.regular_files(folder, "scores*.jsonl"):
    try:
      records = read_jsonl(path)
      for number, record in enumerate(records, 1):
        for key in ("id", "hallucination", "coverage"):
          if key not in record:
            raise ValueError(f"{path.name}:{number}: no {key!r}")
      scores[detector_name(path, records)] = {str(r["id"]): r for r in records}
    except (OSError, ValueError) as error:
      problems.append(str(error))
  ids = {i for by_id in scores.values() for i in by_id}
  examples = None
  for path in [folder / "responses.jsonl"] + [
      p for p in folders.regular_files(folder, "*.jsonl")
      if not p.name.startswith("scores") and p.name != "responses.jsonl"]:
    if not folders.is_regular_inside(path, folder.resolve()):
      continue
    try:
      read = task.read_examples(path, require_response=True)
    except (OSError, ValueError) as error:
      if path.name == "responses.jsonl":
        problems.append(str(error))
      continue
    if path.name == "responses.jsonl" or ids & {e.id for e in read}:
      examples = read
      break
  if examples is None:
    raise ValueError(f"{folder.name}: no input examples (responses.jsonl) beside the scores")
  detector = rouge.RougeDetector()
  rows = []
  for position, example in enumerate(examples):
    overlap = detector.detect(example)
    rows.append({
        "position": position, "id": example.id, "query": example.query,
        "pro": list(example.pro), "con": list(example.con), "response": example.response,
        "error_type": error_type(example), "paraphrased": bool(example.paraphrased),
        "removed_argument": example.removed_argument, "added_argument": example.added_argument,
        "rouge": {"hallucination": overlap.hallucination, "coverage": overlap.coverage},
        "rouge_response": [w.to_json() for w in overlap.response_words],
        "rouge_arguments": [w.to_json() for w in overlap.argument_words],
        "scores": {name: by_id[example.id] for name, by_id in scores.items()
                   if example.id in by_id}})
  return {"examples": rows, "detectors": list(scores), "problems": problems}


def detection_shading(detection: Mapping[str, Any]) -> Optional[Any]:
  """The `plots.WordShading` of one detector's scores of an example (a scores.jsonl record or
  `Detection.to_json()`), so the page and the heatmap agree; None without word scores."""
  from jaxmoral.npov import plots  # pylint: disable=import-outside-toplevel
  response = [w["score"] for w in detection.get("response_words") or ()]
  arguments = [w["score"] for w in detection.get("argument_words") or ()]
  return plots.word_shading(response, arguments) if response or arguments else None


def word_shading(row: Mapping[str, Any]) -> dict[str, Any]:
  """{detector: `plots.WordShading`} of one `npov_folder` example's word-scoring detectors."""
  return {name: shading for name, scores in row["scores"].items()
          if (shading := detection_shading(scores)) is not None}


def npov_results(path: pathlib.Path) -> dict[str, Any]:
  """`npov evaluate`'s results.json, {slice: {detector: {error: {labels, scores, ...}}}}."""
  data = read_json(path, "{slice: {detector: ...}}")
  for slice_name, by_detector in data.items():
    if not isinstance(by_detector, dict):
      raise ValueError(f"{path.name}: slice {slice_name!r} is not an object")
    for det, by_error in by_detector.items():
      for error in ERROR_TYPES:
        entry = by_error.get(error) if isinstance(by_error, dict) else None
        if not isinstance(entry, dict) or len(entry.get("labels", ())) != len(
            entry.get("scores", ())):
          raise ValueError(f"{path.name}: {slice_name}/{det}/{error} has no matching "
                           "labels and scores")
  return data


def roc_points(labels: list[int], scores: list[float]) -> Optional[list[tuple[float, float]]]:
  """The ROC curve's (FPR, TPR) points by the library's `metrics.roc_curve` (None: one class)."""
  from jaxmoral import metrics  # pylint: disable=import-outside-toplevel
  if len(set(labels)) < 2:
    return None
  fpr, tpr, _ = metrics.roc_curve(np.asarray(labels), np.asarray(scores, np.float64))
  return list(zip(fpr.tolist(), tpr.tolist(), strict=True))


# `per_situation` lists as the `RewardResult.row` fields they keep.
_ROW_FIELDS = {"jsd": "scores", "jsd_unfiltered": "jsd", "flips_pct": "flips",
               "filtered_pct": "filtered"}


def clarify_evaluation(path: pathlib.Path) -> dict[str, Any]:
  """`clarify evaluate`'s JSON by situation: {"systems", "situations": [{"situation",
  "by_system": {system: row}}], "summary", "intervals"}; a row is `RewardResult.row` where the
  file has it (`per_question`), else what `per_situation` keeps."""
  data = read_json(path)
  if not isinstance(data, dict) or not data:
    raise ValueError(f"{path.name}: expected {{system: metrics}}")
  systems = list(data)
  count = max(len(v.get("questions", ())) for v in data.values())
  situations: list[dict[str, Any]] = []
  for i in range(count):
    entry: dict[str, Any] = {"index": i, "situation": None, "by_system": {}}
    for name, result in data.items():
      rows = result.get("per_question") or []
      per = result.get("per_situation") or {}
      if i < len(rows):
        row = dict(rows[i])
      else:
        questions = result.get("questions") or []
        if i >= len(questions):
          continue
        row = {"question": questions[i], **{
            field: bool(per[key][i]) if key.endswith("_pct") else per[key][i]
            for key, field in _ROW_FIELDS.items() if i < len(per.get(key, ()))}}
      samples = result.get("samples") or []
      situation = row.get("situation") or (samples[i]["situation"] if i < len(samples) and
                                           isinstance(samples[i], dict) else None)
      entry["situation"] = entry["situation"] or situation
      entry["by_system"][name] = row
    situations.append(entry)
  summary = {name: {k: v for k, v in data[name].items()
                    if isinstance(v, (int, float)) and not isinstance(v, bool)}
             for name in systems}
  return {"systems": systems, "situations": situations, "summary": summary,
          "intervals": {name: _situation_intervals(data[name].get("per_situation"))
                        for name in systems}}


def _situation_intervals(per_situation: Any) -> dict[str, tuple[float, float, int]]:
  """{metric: (low, high, n)}: each per-situation mean's 95 % bootstrap interval over
  situations, as the demo's verdicts resample them."""
  from jaxmoral import metrics  # pylint: disable=import-outside-toplevel
  out: dict[str, tuple[float, float, int]] = {}
  for key, values in (per_situation or {}).items():
    try:
      array = np.asarray(values, np.float64).reshape(-1)
    except (TypeError, ValueError):
      continue
    if len(array) >= 2 and np.isfinite(array).all():
      ci = metrics.bootstrap_ci(np.mean, array)
      out[key] = (float(ci.low), float(ci.high), len(array))
  return out


# What each system of `clarify evaluate` is (`clarify.baselines`), for its page.
CLARIFY_SYSTEMS = {
    "why": "the template \"Why are you <situation>?\" (no model)",
    "finetuned": "the supervised question model alone, nucleus sampling (top-p 0.6)",
    "ppo": "the question model after PPO on the defeasibility reward, sampled the same way",
    "pipeline": "14 questions per situation, one per wh-word (the question model given "
                "\"wh: <word>\"), the one the defeasibility reward (with the NLI filter) "
                "ranks first",
    "pipeline_no_nli": "the same 14 wh-word questions ranked by the reward without the NLI "
                       "filter",
    "discriminator": "sampled candidates of the question model, the one a relevance "
                     "classifier finds most relevant to the situation",
}
CLARIFY_METRICS = {
    "jsd": "the reward: Jensen-Shannon divergence of the judge's verdicts on the weakened and "
           "the strengthened situation, 0 where the NLI filter dropped an answer",
    "jsd_unfiltered": "the same divergence without the filter",
    "flips_pct": "situations whose two answers flip the judge's verdict (%)",
    "filtered_pct": "situations where the NLI filter dropped an answer (%)",
    "question_pct": "outputs that are questions, ending in \"?\" (%)",
    "distinct_1": "distinct words over all words of the questions",
    "distinct_2": "distinct word pairs over all word pairs",
}


def clarify_chat(path: pathlib.Path) -> list[list[dict[str, Any]]]:
  """A chat transcript's turns, one list per conversation (by its "conversation" index where
  turns carry one, as `clarify.chat.chat_from_file` writes them; else restarting at turn 1)."""
  conversations: list[list[dict[str, Any]]] = []
  last = None
  for row in read_jsonl(path):
    index = row.get("conversation")
    if not conversations or (index != last if index is not None else
                             int(row.get("turn", 0) or 0) <= 1):
      conversations.append([])
    last = index
    conversations[-1].append(row)
  return conversations


def reward_curve(path: pathlib.Path) -> list[tuple[float, float]]:
  """(iteration, mean raw reward) of a PPO run's reward_curve.json."""
  from jaxmoral.rl import ppo_trainer  # pylint: disable=import-outside-toplevel
  try:
    curve = ppo_trainer.read_reward_curve(path)
  except (KeyError, TypeError) as error:
    raise ValueError(f"{path.name}: not a reward curve (no {error})") from None
  return sorted((float(k), float(v)) for k, v in curve.items())


def learning_curves(path: pathlib.Path) -> dict[str, list[tuple[float, float]]]:
  """{metric: (episodes, value) points} of a PPO run's reward_curve.json besides the reward."""
  from jaxmoral.rl import ppo_trainer  # pylint: disable=import-outside-toplevel
  curves = ppo_trainer.read_learning_curves(path)
  rows, episodes = curves["rows"], curves["episodes"]
  names = {name for row in rows.values() for name in row} - {"raw_score_mean"}
  return {name: [(float(episodes.get(i, i)), rows[i][name]) for i in sorted(rows)
                 if name in rows[i]]
          for name in ppo_trainer.CURVE_METRICS if name in names}


def distribution(value: Any) -> list[float]:
  """A judge distribution as [bad, ok, good] (a list, or a {judgment: p} dict)."""
  if isinstance(value, dict):
    return [float(value.get(k, float("nan"))) for k in JUDGMENTS]
  return [float(v) for v in value]


def diamante_dialogues(path: pathlib.Path, *, limit: int = 200) -> list[dict[str, Any]]:
  """The response positions of a Diamante JSONL (context, human response, candidates)."""
  from jaxmoral.diamante import data  # pylint: disable=import-outside-toplevel
  turns = data.read_dialogues(path)
  return [{"index": i, "context": list(t.context), "response": t.response,
           "candidates": list(t.candidates), "dialogue": t.dialogue}
          for i, t in enumerate(turns[:limit])]


def diamante_metrics(path: pathlib.Path) -> dict[str, dict[str, float]]:
  """`diamante evaluate`'s metrics: {ranker: {map, mrr, p@1}} plus "other" values."""
  data = read_json(path, "an object of metrics")
  out: dict[str, dict[str, float]] = {}
  for key, value in data.items():
    if isinstance(value, (int, float)):  # Not the "samples" and "rankings" lists.
      ranker, _, metric = key.rpartition("/")
      out.setdefault(ranker or "other", {})[metric] = value
  return out


def diamante_samples(path: pathlib.Path) -> list[dict[str, Any]]:
  """The generated replies an evaluation recorded (its "samples": `{"context", "response",
  "score"}`, the demo's with best-first `"candidates"` `{"text", "score"}`)."""
  data = read_json(path)
  samples = data.get("samples", []) if isinstance(data, dict) else []
  out = []
  for i, sample in enumerate(samples):
    try:
      candidates = [{"text": str(c["text"]), "score": float(c["score"])}
                    for c in sample.get("candidates", [])]
      out.append({"context": [str(u) for u in sample["context"]],
                  "response": str(sample["response"]), "score": float(sample["score"]),
                  "candidates": candidates})
    except (KeyError, TypeError, ValueError, AttributeError) as error:
      raise ValueError(f"{path.name}: sample {i + 1} is malformed ({error!r})") from None
  return out


def diamante_rankings(path: pathlib.Path) -> list[dict[str, Any]]:
  """The contexts `diamante evaluate` ranked (its "rankings", `evaluate.rank_contexts`):
  `{"turn", "context", "ranking"}`, the ranking `ranked`'s of the stored scores."""
  data = read_json(path)
  rankings = data.get("rankings", []) if isinstance(data, dict) else []
  out = []
  for entry in rankings:
    try:
      kinds = list(entry["kinds"])
      ranking = ranked(list(entry["responses"]), entry["scores"], entry["logprobs"],
                       entry["lengths"], kinds.index("human") if "human" in kinds else None,
                       kinds=kinds)
      out.append({"turn": int(entry["turn"]), "context": list(entry["context"]),
                  "ranking": ranking})
    except (KeyError, TypeError, ValueError) as error:
      raise ValueError(f"{path.name}: a ranking of context {entry.get('turn', '?')} is "
                       f"malformed ({error!r})") from None
  return out


def ranked(responses: list[str], scores: list[float], logprobs: list[float],
           lengths: list[int], human: Optional[int],
           kinds: Optional[list[str]] = None) -> dict[str, Any]:
  """Responses best first by preference score, the human one (index `human`) marked, each
  one's kind where given ("model", "random"), and the human response's ranking metrics."""
  from jaxmoral import metrics  # pylint: disable=import-outside-toplevel
  kinds = kinds if kinds is not None else [""] * len(responses)
  rows: list[dict[str, Any]] = [
      {"text": t, "score": float(s), "logprob": float(lp), "tokens": int(n),
       "per_token": float(lp) / max(int(n), 1), "human": i == human, "kind": k}
      for i, (t, s, lp, n, k) in enumerate(zip(responses, scores, logprobs, lengths, kinds,
                                               strict=True))]
  rows.sort(key=lambda r: -r["score"])
  result: dict[str, Any] = {"rows": rows}
  labels = np.asarray([r["human"] for r in rows])
  if labels.any():
    for ranker, key in (("preference", "score"), ("generation", "logprob"),
                        ("generation_per_token", "per_token")):
      values = np.asarray([r[key] for r in rows], np.float64)
      result[ranker] = metrics.ranking_metrics([values], [labels])
  return result


def run_scalars(run: pathlib.Path) -> dict[str, dict[str, list[tuple[int, float]]]]:
  """{tag: {subfolder ("train", "eval"; "." for the run itself): [(step, value)]}} of the
  TensorBoard events: one chart per tag, a line per subfolder, as TensorBoard draws them."""
  from jaxmoral import metric_writers  # pylint: disable=import-outside-toplevel
  out: dict[str, dict[str, list[tuple[int, float]]]] = {}
  for folder in [run] + sorted(p for p in run.iterdir() if p.is_dir()):
    if not any("tfevents" in p.name for p in folder.iterdir() if p.is_file()):
      continue
    for tag, points in sorted(metric_writers.read_scalars(str(folder)).items()):
      out.setdefault(tag, {})[folder.name if folder != run else "."] = sorted(points.items())
  return out


_MAX_MANIFEST_BYTES = 1 << 24


def _manifest_files(step_dir: pathlib.Path) -> Optional[list[str]]:
  """The files a step's manifest names (None: no manifest, or one the check will refuse).

  Raises:
    ValueError: An entry leads out of the step folder (unnamed: the page must not say what
      lies outside).
  """
  from jaxmoral import integrity  # pylint: disable=import-outside-toplevel
  manifest = step_dir / integrity.INTEGRITY_FILE
  if not folders.is_regular_inside(manifest, step_dir):
    return None
  with open(manifest, "rb") as f:
    data = f.read(_MAX_MANIFEST_BYTES + 1)
  try:
    files = json.loads(data)["files"] if len(data) <= _MAX_MANIFEST_BYTES else None
    names = [str(rel) for rel in files] if isinstance(files, dict) else None
  except (ValueError, KeyError, TypeError):
    return None
  if names is None:
    return None
  base = step_dir.resolve()
  for rel in names:
    if base not in (base / rel).resolve().parents or folders.unsafe(rel):
      raise ValueError(f"damaged: its {integrity.INTEGRITY_FILE} names a file outside the "
                       "step folder; not checked")
  return names


def _step_stamp(step_dir: pathlib.Path, names: Optional[list[str]]) -> tuple[Any, ...]:
  """What a verification's result depends on: the manifest's and its files' size and time."""
  from jaxmoral import integrity  # pylint: disable=import-outside-toplevel
  stamps: list[tuple[Any, ...]] = []
  for rel in [integrity.INTEGRITY_FILE, *(names or ())]:
    try:
      info = (step_dir / rel).stat()
      stamps.append((rel, info.st_size, info.st_mtime_ns, info.st_ino))
    except OSError:
      stamps.append((rel, None))
  return (str(step_dir), tuple(stamps))


def run_checkpoints(run: pathlib.Path) -> list[dict[str, Any]]:
  """Each saved step with its integrity status (`checkpoints.verify_step`, digests compared),
  hashed once while its files are unchanged; a manifest naming files outside is refused."""
  from jaxmoral import run_dirs  # pylint: disable=import-outside-toplevel
  out = []
  directory = run_dirs.checkpoints_dir(run)
  for step in run_dirs.saved_steps(run):
    step_dir = pathlib.Path(directory) / str(step)
    try:
      status, ok = _verified(_step_stamp(step_dir, _manifest_files(step_dir)), directory, step)
    except (OSError, ValueError) as error:
      status, ok = str(error), False
    out.append({"step": step, "status": status, "ok": ok})
  return out


@functools.lru_cache(maxsize=1024)
def _verified(stamp: tuple[Any, ...], directory: str, step: int) -> tuple[str, bool]:
  """(status, ok) of a step by `checkpoints.verify_step`, cached by `stamp` (`_step_stamp`)."""
  del stamp  # The cache key: a step whose files changed is hashed again.
  from jaxmoral import checkpoints  # pylint: disable=import-outside-toplevel
  try:
    verified = checkpoints.verify_step(directory, step, full=True)
    return ("verified" if verified else "no manifest (written before manifests)", True)
  except (OSError, ValueError) as error:
    return (str(error), False)


def run_software(run: pathlib.Path) -> list[dict[str, Any]]:
  """software.jsonl's records, each with its one-line `software.describe`."""
  from jaxmoral import software  # pylint: disable=import-outside-toplevel
  try:
    records = software.read_records(run)
  except ValueError as error:
    raise ValueError(f"software.jsonl: not JSON lines ({error})") from None
  out = []
  for record in records:
    try:
      description = software.describe(record)
    except (KeyError, TypeError, AttributeError):
      description = json.dumps(record, sort_keys=True)
    out.append({"step": record.get("step"), "time": record.get("time"),
                "description": description})
  return out


def intervals(data: Any, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], dict]]:
  """Every (key path, {estimate, low, high}) in a results object, in file order."""
  if not isinstance(data, dict):
    return []
  if all(isinstance(data.get(k), (int, float)) for k in ("estimate", "low", "high")):
    return [(prefix, data)]
  return [found for key, value in data.items()
          for found in intervals(value, prefix + (str(key),))]


def experiment(path: pathlib.Path) -> dict[str, Any]:
  """An experiment's results: command, machine, verdicts, every interval (grouped by its
  first key), its plot and its markdown report."""
  data = read_json(path, "an object")
  groups: dict[str, list[dict[str, Any]]] = {}
  for keys, ci in intervals(data):
    if keys[0] in ("setup", "machine", "timings"):
      continue
    groups.setdefault(keys[0], []).append({"name": " / ".join(keys[1:]) or keys[0], **ci})
  for rows in groups.values():
    finite = [v for r in rows for v in (r["low"], r["high"], r["estimate"]) if
              isinstance(v, (int, float)) and math.isfinite(v)]
    lo, hi = (min(finite), max(finite)) if finite else (0.0, 1.0)
    for r in rows:
      r["axis"] = (min(lo, 0.0) if lo >= 0 or hi <= 0 else lo, hi if hi > lo else lo + 1)
  plot = path.with_suffix(".png")
  report = path.with_suffix(".md")
  return {"command": data.get("command"), "machine": data.get("machine"),
          "verdicts": {k: v for k, v in data.items() if k.startswith("verdict")},
          "groups": groups,
          "plot": plot.name if folders.is_regular_inside(plot, path.parent) else None,
          "report": report.read_text(encoding="utf-8")
          if folders.is_regular_inside(report, path.parent) else None}


def markdown_tables(text: str) -> list[dict[str, Any]]:
  """The pipe tables of a markdown report, each {"header", "rows"}, with the heading above."""
  tables: list[dict[str, Any]] = []
  heading = None
  lines = (line.strip() for line in text.splitlines())
  for piped, group in itertools.groupby(lines, key=lambda line: line.startswith("|")):
    block = list(group)
    if not piped:
      heading = next((h.lstrip("#").strip() for h in reversed(block) if h.startswith("#")), heading)
      continue
    # A table: a header row, its |---| separator row, then rows up to the next unpiped line.
    start = next((j for j in range(len(block) - 1)
                  if re.match(r"^\|[\s:|-]+\|$", block[j + 1])), None)
    if start is not None:
      cells = [[c.strip() for c in row.strip("|").split("|")] for row in block[start:]]
      tables.append({"heading": heading, "header": cells[0], "rows": cells[2:]})
  return tables
