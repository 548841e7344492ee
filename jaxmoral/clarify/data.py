"""Training pairs of the ClarifyDelphi models from δ-Clarify files or the bundled demo corpus.

Sources (`source="demo"` = `jaxmoral.data.demo`; `source=<folder>` = a folder laid out like
`../shared/data`: `delta_clarify/<split>.tsv`, `delta_clarify_silver/*.tsv`,
`fusion/*.csv`). All files are read with `jaxmoral.data.readers`, so a malformed row fails with
its file and line; an unknown header column, and a file without rows, fail naming the file.
A folder's splits are the `delta_clarify/*.tsv` files present (train, dev, test, ...); every
model's inputs (`INPUTS`) must be present, or the error lists what is missing.

Silver labels (no gold judge or NLI data is available here; documented rules):

* Judge. The default judgment of a situation is the polarity of its rule of thumb
  (`default_judgment`): "You should…", "It's good/nice/polite/important…", "It's wrong/rude/bad
  NOT to…" -> good; "It's bad/wrong/rude/mean…", "You shouldn't…", "It's not okay…" -> bad;
  anything else ("It's okay/understandable/expected…") -> ok. Under an update
  (`shifted_judgment`): a strengthener keeps the judgment; a weakener moves good and bad to ok
  and ok to bad (weakening "it's okay to" makes it not okay). The updated situation the judge
  sees is "<situation>, <update>" (the fusion model's job at inference time).
* NLI (premise = situation, hypothesis = answer). neutral: the silver weakener/strengthener
  answers (they add information); entailment: the situation itself and answers whose fused
  output equals the situation (they add nothing); contradiction: negations of the situation
  ("I was not <situation>", "I have never been <situation>").
* Relevance (discriminator baseline). positive: a situation's annotated questions; negative:
  questions of the most similar other situation by word overlap (Jaccard).
"""

from __future__ import annotations

import os
import re
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from jaxmoral import fileio
from jaxmoral.clarify import formats
from jaxmoral.data import demo
from jaxmoral.data import readers

Pair = tuple[str, str]
WHICH = ("question", "answer", "fusion", "judge", "nli", "relevance")
QUESTION_COLUMNS = ["id", "source", "situation", "question"]
SILVER_COLUMNS = ["Hypothesis", "Update", "UpdateType", "question_davinci", "situation"]
# Known but unused: the released silver TSV's provenance column.
SILVER_OPTIONAL_COLUMNS = ["DataSource"]
# The row kinds each model trains on ("judgments" exist in the demo corpus only).
INPUTS = {"question": ("questions",), "answer": ("answers",), "fusion": ("fusion",),
          "judge": ("answers",), "nli": ("answers", "fusion"), "relevance": ("questions",)}
# Where a data folder keeps each row kind.
_FOLDERS = {"questions": ("delta_clarify", "{split}.tsv", "the δ-Clarify folder"),
            "answers": ("delta_clarify_silver", "*.tsv", "the silver folder"),
            "fusion": ("fusion", "*.csv", "the fusion folder")}
DEMO_SPLITS = ("train", "dev")

_GOOD = re.compile(r"^(you should(?! not)(?!n't)|you must(?! not)|you ought to|people should|"
                   r"it's (good|nice|kind|polite|important|right|great|admirable|responsible|"
                   r"considerate|helpful|thoughtful|brave|generous|courteous|commendable|"
                   r"respectful|honorable|fair|smart|wise|healthy)|"
                   r"it's (wrong|bad|rude|mean|selfish|inconsiderate|unfair) (to )?not |"
                   r"you're expected to|it's expected|always |[a-z' ]{1,30} (should|must) "
                   r"(?!not|never)(?!n't))")
_BAD = re.compile(r"^(it's (bad|wrong|rude|mean|not (ok|okay|good|right|nice|acceptable|polite|"
                  r"fair|appropriate))|it's (selfish|inconsiderate|unfair|cruel|hurtful|"
                  r"disrespectful|inappropriate|unacceptable|dangerous|illegal|irresponsible|"
                  r"frowned upon|gross|weird|hypocritical|shameful|immoral|unkind|petty)|"
                  r"you should(n't| not| never)|you shouldn't|you must not|don't|never|"
                  r"it's never|[a-z' ]{1,30} (shouldn't|should not|should never|must not) )")


def _normalise_rot(text: str) -> str:
  text = " ".join(text.lower().replace("’", "'").split())
  for long, short in (("it is", "it's"), ("you are", "you're"), ("do not", "don't"),
                      ("should not", "shouldn't")):
    text = re.sub(rf"^{long}\b", short, text)
    text = text.replace(f" {long} ", f" {short} ")
  return text


def default_judgment(rule_of_thumb: str) -> str:
  """bad | ok | good from the polarity of a rule of thumb (see the module docstring)."""
  text = _normalise_rot(rule_of_thumb)
  # Double negation ("it's wrong not to ...") first: the good pattern includes it.
  if _GOOD.match(text):
    return "good"
  if _BAD.match(text):
    return "bad"
  return "ok"


def shifted_judgment(judgment: str, update_type: str) -> str:
  """The judgment after an update: strengtheners keep it, weakeners move it (module doc)."""
  if judgment not in formats.JUDGMENTS:
    raise ValueError(f"judgment must be one of {formats.JUDGMENTS}, got {judgment!r}")
  if update_type == "strengthener":
    return judgment
  if update_type == "weakener":
    return "bad" if judgment == "ok" else "ok"
  raise ValueError(f"update_type must be one of {formats.UPDATE_TYPES}, got {update_type!r}")


# Every reader rejects unknown header columns (a misspelt one would read as missing) and a
# file without rows (it would train on nothing without saying which file was empty).
def read_questions(path: str | os.PathLike) -> list[dict[str, str]]:
  """δ-Clarify TSV rows (id, source, situation, question)."""
  return readers.read_tsv(path, columns=QUESTION_COLUMNS, optional=(), allow_empty=False)


def read_silver(path: str | os.PathLike) -> list[dict[str, str]]:
  """δ-Clarify silver rows in the demo answers' keys: situation, judgment, question,
  update_type, answer, hypothesis (the judgment derived by `default_judgment`)."""
  rows = readers.read_tsv(path, columns=SILVER_COLUMNS, optional=SILVER_OPTIONAL_COLUMNS,
                          allow_empty=False)
  out = []
  for r, line in zip(rows, rows.lines, strict=False):
    if r["UpdateType"] not in formats.UPDATE_TYPES:
      raise readers.DataError(path, line, f"unknown update type {r['UpdateType']!r}",
                              "UpdateType")
    out.append({"situation": r["situation"], "judgment": default_judgment(r["Hypothesis"]),
                "question": r["question_davinci"], "update_type": r["UpdateType"],
                "answer": r["Update"], "hypothesis": r["Hypothesis"]})
  return out


def read_fusion(path: str | os.PathLike) -> list[dict[str, str]]:
  """Fusion CSV rows (input, output)."""
  return readers.read_csv(path, columns=["input", "output"], optional=(), allow_empty=False)


def question_pairs(rows: Iterable[dict[str, str]], *, wh_conditioned: str = "both") -> list[Pair]:
  """θQ pairs. `wh_conditioned`: "no" (plain), "yes" (with the question's first word), "both"."""
  if wh_conditioned not in ("no", "yes", "both"):
    raise ValueError(f"wh_conditioned must be 'no', 'yes' or 'both', got {wh_conditioned!r}")
  pairs = []
  for r in rows:
    if wh_conditioned in ("no", "both"):
      pairs.append((formats.question_input(r["situation"]), formats.clean(r["question"])))
    word = formats.first_word(r["question"])
    if wh_conditioned in ("yes", "both") and word:
      pairs.append((formats.question_input(r["situation"], word), formats.clean(r["question"])))
  return pairs


def answer_pairs(rows: Iterable[dict[str, str]]) -> list[Pair]:
  """θA pairs from answer rows (demo answers or `read_silver`)."""
  return [(formats.answer_input(judgment=r["judgment"], situation=r["situation"],
                                update_type=r["update_type"], question=r["question"]),
           formats.clean(r["answer"])) for r in rows]


def fusion_pairs(rows: Iterable[dict[str, str]]) -> list[Pair]:
  return [(formats.clean(r["input"]), formats.clean(r["output"])) for r in rows]


def updated_situation(situation: str, answer: str) -> str:
  """Concatenated s ⊕ a for silver judge labels (the fusion model does better at inference)."""
  return f"{formats.clean(situation).rstrip('.')}, {formats.clean(answer)}"


def judge_examples(*, answers: Iterable[dict[str, str]] = (),
                   judgments: Iterable[dict[str, str]] = ()) -> list[tuple[str, str]]:
  """(situation, bad|ok|good): given judgments, plus silver ones from answer rows (default
  judgment of the situation and the shifted one of situation ⊕ answer). Deduplicated."""
  out: dict[str, str] = {}
  for r in judgments:
    out.setdefault(formats.clean(r["situation"]), r["judgment"])
  for r in answers:
    out.setdefault(formats.clean(r["situation"]), r["judgment"])
    out.setdefault(updated_situation(r["situation"], r["answer"]),
                   shifted_judgment(r["judgment"], r["update_type"]))
  return list(out.items())


def judge_pairs(examples: Iterable[tuple[str, str]], *,
                classes: Sequence[str] = formats.T5_JUDGE_CLASSES) -> list[Pair]:
  """Judge pairs; targets are the configured class strings (in bad, ok, good order)."""
  classes = formats.check_classes(classes, field="classes", names=formats.JUDGMENTS)
  mapping = dict(zip(formats.JUDGMENTS, classes, strict=True))
  return [(formats.judge_input(s), mapping[j]) for s, j in examples]


def _fused_equals_situation(row: dict[str, str]) -> Optional[tuple[str, str]]:
  """(situation, answer) of a fusion row whose output only restates the situation."""
  match = re.match(r"SITUATION:\s*(.*?)\s*QUESTION:\s*(.*?)\s*ANSWER:\s*(.*)$",
                   formats.clean(row["input"]))
  if not match:
    return None
  situation, _, answer = match.groups()
  norm = lambda t: re.sub(r"[^a-z0-9 ]", "", t.lower()).strip()  # noqa: E731
  return (situation, answer) if norm(situation) == norm(row["output"]) else None


def nli_examples(*, answers: Iterable[dict[str, str]],
                 fusion: Iterable[dict[str, str]] = ()) -> list[tuple[str, str, str]]:
  """Silver (premise, hypothesis, label) triples (rules in the module docstring)."""
  out: list[tuple[str, str, str]] = []
  seen: set[str] = set()
  for r in answers:
    s = formats.clean(r["situation"]).rstrip(".")
    out.append((s, formats.clean(r["answer"]), "neutral"))
    if s not in seen:
      seen.add(s)
      out += [(s, s, "entailment"), (s, f"I was {s}.", "entailment"),
              (s, f"I was not {s}.", "contradiction"),
              (s, f"I have never been {s}.", "contradiction")]
  return out + [(*restated, "entailment") for restated in map(_fused_equals_situation, fusion)
                if restated]


def nli_pairs(examples: Iterable[tuple[str, str, str]], *,
              labels: Sequence[str] = formats.NLI_LABELS) -> list[Pair]:
  labels = formats.check_classes(labels, field="labels")
  mapping = dict(zip(formats.NLI_LABELS, labels, strict=False))
  return [(formats.nli_input(premise=p, hypothesis=h), mapping[y]) for p, h, y in examples]


def similar_situations(situations: Sequence[str]) -> dict[str, str]:
  """Each situation's most similar other situation by word overlap (Jaccard), vectorised."""
  from scipy import sparse
  words = [set(re.findall(r"[a-z']+", s.lower())) for s in situations]
  index = {w: i for i, w in enumerate(sorted(set().union(*words)))} if words else {}
  rows = [i for i, ws in enumerate(words) for _ in ws]
  cols = [index[w] for ws in words for w in ws]
  x = sparse.csr_matrix((np.ones(len(rows), np.float32), (rows, cols)),
                        shape=(len(words), max(len(index), 1)))
  sizes = np.array([len(ws) for ws in words], np.float32)
  out = {}
  for start in range(0, len(words), 512):
    inter = (x[start:start + 512] @ x.T).toarray()
    union = sizes[start:start + 512, None] + sizes[None, :] - inter
    jaccard = np.where(union > 0, inter / np.maximum(union, 1), 0.0)
    for k in range(len(jaccard)):
      jaccard[k, start + k] = -1.0
      if len(words) > 1:
        out[situations[start + k]] = situations[int(np.argmax(jaccard[k]))]
  return out


def relevance_pairs(rows: Iterable[dict[str, str]], *,
                    labels: Sequence[str] = formats.RELEVANCE_LABELS) -> list[Pair]:
  """Discriminator pairs: own questions relevant, the most similar situation's irrelevant."""
  labels = formats.check_classes(labels, field="labels")
  by_situation: dict[str, list[str]] = {}
  for r in rows:
    by_situation.setdefault(formats.clean(r["situation"]), []).append(
        formats.clean(r["question"]))
  neighbour = similar_situations(list(by_situation))
  pairs = []
  for s, questions in by_situation.items():
    for k, q in enumerate(questions):
      pairs.append((formats.relevance_input(situation=s, question=q), labels[0]))
      others = by_situation.get(neighbour.get(s, ""), [])
      if others:
        pairs.append((formats.relevance_input(situation=s, question=others[k % len(others)]),
                      labels[1]))
  return pairs


def folder_splits(source: str | os.PathLike) -> list[str]:
  """The splits of a data folder: the names of its `delta_clarify/*.tsv` files, sorted."""
  return sorted(p.stem for p in (fileio.path(source) / "delta_clarify").glob("*.tsv")
                if p.is_file())


def _kind_files(root: Any, kind: str, split: str) -> tuple[list[Any], Optional[str]]:
  """(files of one row kind, None) or ([], what is missing) in a data folder."""
  folder, pattern, name = _FOLDERS[kind]
  directory = root / folder
  if not directory.is_dir():
    return [], f"{name} {folder}/ is missing"
  if kind == "questions":
    path = directory / pattern.format(split=split)
    if path.is_file():
      return [path], None
    return [], (f"{folder}/{path.name} is missing (splits present: "
                f"{', '.join(folder_splits(root)) or 'none'})")
  files = sorted(p for p in directory.glob(pattern) if p.is_file())
  return (files, None) if files else ([], f"{name} {folder}/ has no {pattern} file")


def source_files(source: str, which: str, *, split: str = "train",
                 purpose: Optional[str] = None) -> dict[str, list[Any]]:
  """{row kind: files} of a data folder for the kinds `INPUTS` lists for `which` (one of
  `WHICH` or "multitask"), all checked before any file is read.

  `purpose` says what the files are for in messages (default "--which=<which>").

  Raises:
    FileNotFoundError: `source` is not a folder, or inputs are missing; one line listing every
      missing input and the models that need it.
    ValueError: an unknown `which`, or a split that is not a file name.
  """
  names = _which_models(which)
  # A split names a file in delta_clarify/; a path would read outside the folder.
  if not isinstance(split, str) or not split or split.startswith(".") or any(
      c in split for c in "/\\*?["):
    raise ValueError(f"clarify data: split must be a file name without extension like 'train' "
                     f"or 'dev', got {split!r}")
  root = fileio.path(source)  # A local folder or a bucket URL (`etils.epath.Path`).
  if not root.is_dir():
    raise FileNotFoundError(f"clarify data source {source!r}: not 'demo' and not a folder")
  files, missing = {}, []
  for kind in dict.fromkeys(k for w in names for k in INPUTS[w]):
    files[kind], problem = _kind_files(root, kind, split)
    if problem:
      needed_by = ", ".join(w for w in names if kind in INPUTS[w])
      missing.append(problem if purpose else f"{problem} (needed by {needed_by})")
  if missing:
    raise FileNotFoundError(f"clarify data {root}: {purpose or f'--which={which}'} (split "
                            f"{split!r}) lacks inputs: {'; '.join(missing)}")
  return files


def _which_models(which: str) -> tuple[str, ...]:
  if which == "multitask":
    return WHICH
  if which not in WHICH:
    raise ValueError(f"which must be one of {WHICH + ('multitask',)}, got {which!r}")
  return (which,)


def load_source(source: str, *, split: str = "train", which: str = "multitask",
                purpose: Optional[str] = None) -> dict[str, list[dict[str, str]]]:
  """Rows of every kind the model(s) `which` need: {"questions", "answers", "fusion",
  "judgments"} (kinds not needed are empty).

  Args:
    source: "demo" (bundled corpus) or a folder laid out like `../shared/data`.
    split: δ-Clarify split for the questions (a folder's: any `delta_clarify/<split>.tsv`
      present; the demo's: "train" or "dev", which only `situations` tells apart); the silver
      answers and the fusion data exist as one (dev) file each and are used for every split.
    which, purpose: See `source_files`.

  Raises:
    FileNotFoundError: missing inputs (all listed), see `source_files`.
    readers.DataError: a malformed, empty or header-only file, or an unknown column.
  """
  if source == "demo":
    _which_models(which)
    if split not in DEMO_SPLITS:
      raise ValueError(f"clarify data 'demo': split must be 'train' or 'dev', got {split!r}")
    return {"questions": demo.clarify_questions(), "answers": demo.clarify_answers(),
            "fusion": demo.clarify_fusion(), "judgments": demo.clarify_judgments()}
  files = source_files(source, which, split=split, purpose=purpose)
  read = {"questions": read_questions, "answers": read_silver, "fusion": read_fusion}
  rows = {kind: [r for f in files.get(kind, ()) for r in read[kind](f)] for kind in read}
  return {**rows, "judgments": []}


def build_pairs(which: str, source: str = "demo", *, split: str = "train",
                judge_classes: Sequence[str] = formats.T5_JUDGE_CLASSES,
                nli_labels: Sequence[str] = formats.NLI_LABELS,
                relevance_labels: Sequence[str] = formats.RELEVANCE_LABELS,
                mixing_cap: Optional[int] = None, seed: int = 0) -> list[Pair]:
  """Training pairs of one model (`which` in WHICH) or of all ("multitask").

  Args:
    source: "demo" or a data folder.
    split: δ-Clarify split of the questions.
    judge_classes, nli_labels, relevance_labels: Targets of those models.
    mixing_cap: T5's examples-proportional mixing with an artificial limit: a model with
      more pairs than this contributes a seeded random `mixing_cap` of them, so small tasks
      (answers: about 1 % of the shared data's pairs) are not drowned by question
      generation. None: every pair.
    seed: Seed of that subsample.

  Raises:
    FileNotFoundError: an input of a requested model is missing (all are listed).
    ValueError: an unknown `which`, or no pairs for a requested model.
  """
  if mixing_cap is not None and mixing_cap <= 0:
    raise ValueError(f"mixing_cap must be > 0 (or None), got {mixing_cap}")
  names = _which_models(which)
  rows = load_source(source, split=split, which=which)  # Every input checked up front.
  pairs: list[Pair] = []
  for name in names:
    built = _pairs_of(name, rows, judge_classes=judge_classes, nli_labels=nli_labels,
                      relevance_labels=relevance_labels)
    if not built:
      raise ValueError(f"clarify data {source}: no {name} pairs (split {split!r})")
    if mixing_cap is not None and len(built) > mixing_cap:
      keep = np.random.default_rng([seed, WHICH.index(name)]).choice(
          len(built), size=mixing_cap, replace=False)
      built = [built[i] for i in np.sort(keep)]
    pairs += built
  return pairs


def _pairs_of(which: str, rows: dict[str, list[dict[str, str]]], *,
              judge_classes: Sequence[str], nli_labels: Sequence[str],
              relevance_labels: Sequence[str]) -> list[Pair]:
  if which == "question":
    return question_pairs(rows["questions"])
  if which == "answer":
    return answer_pairs(rows["answers"])
  if which == "fusion":
    return fusion_pairs(rows["fusion"])
  if which == "judge":
    return judge_pairs(judge_examples(answers=rows["answers"], judgments=rows["judgments"]),
                       classes=judge_classes)
  if which == "nli":
    return nli_pairs(nli_examples(answers=rows["answers"], fusion=rows["fusion"]),
                     labels=nli_labels)
  return relevance_pairs(rows["questions"], labels=relevance_labels)


DEMO_DEV_EVERY = 5  # The bundled corpus is one file; see `situations`.


def situations(source: str = "demo", *, split: str = "train") -> list[str]:
  """The distinct situations of a split (PPO prompts, evaluation inputs), in file order.

  The demo corpus's "dev" split is every `DEMO_DEV_EVERY`-th distinct situation and its
  "train" split the others, so PPO on "train" and evaluation on "dev" never share one.
  """
  rows = load_source(source, split=split, which="question",
                     purpose="situations")["questions"]
  distinct = list(dict.fromkeys(formats.clean(r["situation"]) for r in rows))
  if source == "demo":
    distinct = [s for i, s in enumerate(distinct) if (i % DEMO_DEV_EVERY == 0) == (split == "dev")]
  return distinct


def write_pairs(pairs: Sequence[Pair], path: str | os.PathLike) -> str:
  """Writes pairs as JSONL {"inputs", "targets"} (what `runs.Seq2SeqData` reads)."""
  if not pairs:
    raise ValueError(f"write_pairs: no pairs for {path}")
  return readers.write_jsonl(path, ({"inputs": x, "targets": y} for x, y in pairs))


