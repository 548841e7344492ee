"""`jaxmoral explore` in a real browser: headless Chromium (Selenium, the system's
chromedriver) against the command started on a free port, over folders this module writes
with the library's own writers and tiny random models.

One server and one browser serve the whole module. Without Chromium the browser tests skip
(with the reason), except in CI (`CI=true`), where they fail. `JAXMORAL_EXPLORE_SCREENSHOT=PATH`
also saves the README's screenshot there.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import numpy as np
import pytest

from jaxmoral.explore import folders

# What runs is tested here, not how it is sharded (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("one_device")

REPO = pathlib.Path(__file__).resolve().parents[1]
CHROMIUM = ("/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome")
CHROMEDRIVER = ("/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver")
SITUATIONS = ("lying to a friend to protect their feelings", "skipping a family dinner",
              "borrowing a bike without asking")


def _first(paths):
  return next((p for p in paths if os.path.exists(p)), None) or shutil.which(
      os.path.basename(paths[0]))


def _browser_or_skip() -> tuple[str, str]:
  browser, driver = _first(CHROMIUM), _first(CHROMEDRIVER)
  missing = [n for n, p in (("chromium", browser), ("chromium-driver", driver)) if not p]
  try:
    import selenium  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
  except ImportError:
    missing.append("selenium (pip)")
  if missing:
    reason = f"browser tests need {', '.join(missing)} (apt-get install chromium chromium-driver)"
    if os.environ.get("CI") == "true":
      pytest.fail(reason + "; CI must run them")
    pytest.skip(reason)
  return browser, driver


# -- the folders --------------------------------------------------------------------------------


def _npov_examples():
  from jaxmoral.npov import task  # pylint: disable=import-outside-toplevel
  base = dict(topic="t1", query="Should school uniforms be compulsory?",
              pro=("Uniforms reduce bullying about clothes.", "Uniforms save families money."),
              con=("Uniforms limit self expression.",))
  response = ("Opinions differ. Supporters say uniforms reduce bullying and save money, "
              "while critics say they limit self expression.")
  return [
      task.NpovExample(id="clean-1", response=response, hallucination=False, coverage=False,
                       **base),
      task.NpovExample(id="hall-1", response=response + " Uniforms also improve grades.",
                       hallucination=True, coverage=False,
                       removed_argument="Uniforms improve grades.", **base),
      task.NpovExample(id="cov-1", response="Opinions differ. Supporters say uniforms save "
                       "money.", hallucination=False, coverage=True,
                       added_argument="Uniforms limit self expression.", **base),
      task.NpovExample(id="para-1", response=response, hallucination=False, coverage=False,
                       paraphrased=True, **base),
      task.NpovExample(id="para-hall", response=response + " Teachers prefer them too.",
                       hallucination=True, coverage=False, paraphrased=True,
                       removed_argument="Teachers prefer uniforms.", **base),
  ]


class _StubReward:
  """A reward pipeline's result without models: `evaluate.compare` writes the real file."""

  def score_questions(self, situations, questions):
    from jaxmoral.clarify import reward as reward_lib  # pylint: disable=import-outside-toplevel
    n = len(situations)
    rng = np.random.default_rng(len(questions[0]))
    weak = rng.dirichlet(np.ones(3), n)
    strong = rng.dirichlet(np.ones(3), n)
    from jaxmoral import metrics  # pylint: disable=import-outside-toplevel
    jsd = np.asarray(metrics.jensen_shannon(weak, strong), np.float64).reshape(n)
    filtered = np.asarray([i == 1 for i in range(n)])
    return reward_lib.RewardResult(
        scores=np.where(filtered, 0.0, jsd), jsd=jsd, filtered=filtered,
        flips=(weak.argmax(1) != strong.argmax(1)) & ~filtered, judgment=["bad"] * n,
        base_distribution=rng.dirichlet(np.ones(3), n),
        weakener=[f"because {s} was kind" for s in situations],
        strengthener=[f"because {s} hurt someone" for s in situations],
        weakened_situation=[f"{s}, to be kind" for s in situations],
        strengthened_situation=[f"{s}, to hurt someone" for s in situations],
        weakened_distribution=weak, strengthened_distribution=strong,
        weakener_filtered=filtered, strengthener_filtered=np.zeros(n, bool))


def make_folders(root: pathlib.Path, vocab_path: str) -> dict:
  """Demo-like output folders (the library's writers, tiny random models); returns what the
  pages must show."""
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  from jaxmoral import checkpoints  # pylint: disable=import-outside-toplevel
  from jaxmoral import integrity  # pylint: disable=import-outside-toplevel
  from jaxmoral import model_dirs  # pylint: disable=import-outside-toplevel
  from jaxmoral import metric_writers  # pylint: disable=import-outside-toplevel
  from jaxmoral.clarify import baselines  # pylint: disable=import-outside-toplevel
  from jaxmoral.clarify import evaluate as clarify_eval  # pylint: disable=import-outside-toplevel
  from jaxmoral.data import vocab as vocab_lib  # pylint: disable=import-outside-toplevel
  from jaxmoral.diamante import data as diamante_data  # pylint: disable=import-outside-toplevel
  from jaxmoral.models import config as config_lib  # pylint: disable=import-outside-toplevel
  from jaxmoral.models import t5  # pylint: disable=import-outside-toplevel
  from jaxmoral.npov import actions  # pylint: disable=import-outside-toplevel
  from jaxmoral.npov import task  # pylint: disable=import-outside-toplevel
  from jaxmoral.npov.detectors import base  # pylint: disable=import-outside-toplevel

  demo = root / "demo_out"
  models = root / "models"
  # One random tiny T5 with Diamante's scalar head serves every live box: the NPOV base, the
  # ClarifyDelphi reward's models (they read it without the head) and the Diamante ranker.
  tiny = config_lib.t5_config(size="tiny", num_encoder_layers=1, num_decoder_layers=1)
  joint = t5.T5(tiny, with_scalar_head=True)
  params = nn.meta.unbox(jax.jit(lambda r: t5.init_params(joint, r))(jax.random.PRNGKey(3)))
  params["scalar_head"]["kernel"] = params["scalar_head"]["kernel"] * 5.0
  model_dir = models / "t5_joint"
  model_dirs.export(model_dir, params=params, config=tiny,
                    vocabulary=vocab_lib.get_vocabulary(vocab_path),
                    settings={"data": {"separator": diamante_data.DEFAULT_SEPARATOR},
                              "feature_lengths": {"inputs": 32, "targets": 12}})
  # NPOV: a responses file, the ROUGE detector's scores and ROC results, classifier scores.
  detect_dir = demo / "npov" / "detect"
  detect_dir.mkdir(parents=True, exist_ok=True)
  examples = _npov_examples()
  task.write_examples(examples, detect_dir / "responses.jsonl")
  actions.detect_file(input_path=str(detect_dir / "responses.jsonl"),
                      output_path=str(detect_dir / "scores_rouge.jsonl"), detector="rouge",
                      roc_dir=str(detect_dir))
  # The salience detector over the random model, with its heatmaps, as `make demo` runs it.
  actions.detect_file(input_path=str(detect_dir / "responses.jsonl"),
                      output_path=str(detect_dir / "scores.jsonl"), detector="salience",
                      base_dir=str(model_dir), heatmap_dir=str(detect_dir / "heatmaps"))
  classifier = {e.id: base.Detection(hallucination=0.1 + 0.15 * i, coverage=0.8 - 0.1 * i)
                for i, e in enumerate(examples)}
  with open(detect_dir / "scores_classifier.jsonl", "w", encoding="utf-8") as f:
    for e in examples:
      f.write(json.dumps({"id": e.id, **classifier[e.id].to_json()}) + "\n")
  bad = demo / "npov" / "bad"
  bad.mkdir(parents=True)
  shutil.copy(detect_dir / "responses.jsonl", bad / "responses.jsonl")
  (bad / "scores.jsonl").write_text('{"id": "clean-1", "hallucination": 0.5\nnot json\n')

  # ClarifyDelphi: `evaluate.compare`'s file (two systems), a chat transcript, a PPO curve.
  clarify = demo / "clarify"
  clarify.mkdir(parents=True)
  systems = {"why": baselines.why_generator(),
             "finetuned": lambda s: [f"What did you mean by {x.split()[0]}?" for x in s]}
  evaluation = clarify_eval.compare(systems, list(SITUATIONS), _StubReward(),
                                    output_json=clarify / "evaluation.json", print_table=False)
  turns = [{"turn": 1, "situation": SITUATIONS[0], "judgment": "bad",
            "distribution": {"bad": 0.6, "ok": 0.3, "good": 0.1}, "question": "Why?",
            "answer": "I had a good reason.", "fused_situation": SITUATIONS[0] + " for a reason",
            "new_judgment": "ok", "new_distribution": {"bad": 0.2, "ok": 0.5, "good": 0.3}},
           {"turn": 2, "situation": SITUATIONS[0] + " for a reason", "judgment": "ok",
            "distribution": {"bad": 0.2, "ok": 0.5, "good": 0.3}, "question": "Who was hurt?",
            "answer": "Nobody was hurt.", "fused_situation": "nobody was hurt",
            "new_judgment": "good", "new_distribution": {"bad": 0.1, "ok": 0.3, "good": 0.6}}]
  # As `chat.chat_from_file` writes them: each turn names its conversation.
  (clarify / "chat_transcript.jsonl").write_text("".join(
      json.dumps({**t, "conversation": 0}) + "\n" for t in turns))
  ppo = clarify / "ppo"
  ppo.mkdir()
  curve = {"iterations": [1, 2, 3, 4], "raw_reward_mean": [0.01, 0.015, 0.02, 0.031]}
  (ppo / "reward_curve.json").write_text(json.dumps(curve))

  # Diamante: a dialogue file with candidates, metrics, a self-chat; a random joint model.
  diamante = demo / "diamante"
  dialogues = [(["Hi! How was your weekend?", "Great, I went hiking.", "Where did you go?"],
                [[], ["It was fine.", "I stayed home."], ["Nowhere.", "To the hills."]]),
               (["Do you like music?", "Yes, mostly jazz."],  # a candidate that is r_H
                [[], ["No.", "Yes, mostly jazz.", "I like rock."]])]
  diamante_data.write_dialogues(diamante / "test.jsonl", dialogues)
  metrics = {"preference/p@1": 0.5, "preference/mrr": 0.7, "preference/map": 0.7,
             "generation/p@1": 0.25, "generation/mrr": 0.5, "generation/map": 0.5,
             "generation_per_token/p@1": 0.25, "generation_per_token/mrr": 0.55,
             "generation_per_token/map": 0.55, "random/p@1": 0.2, "pe_accuracy": 0.6,
             "num_contexts": 4.0}
  # Two contexts as `diamante evaluate` writes them ranked: the first and the third turn of
  # test.jsonl (r_H first, then model candidates and a random response; scores unsorted).
  rankings = [
      {"turn": 0, "context": ["Hi! How was your weekend?"],
       "responses": ["Great, I went hiking.", "It was fine.", "I stayed home.", "No."],
       "kinds": ["human", "model", "model", "random"], "scores": [0.2, 0.7, -0.1, 0.05],
       "logprobs": [-9.0, -4.5, -6.0, -3.0], "lengths": [6, 4, 4, 2]},
      {"turn": 2, "context": ["Do you like music?"],
       "responses": ["Yes, mostly jazz.", "No.", "I like rock.", "Where did you go?"],
       "kinds": ["human", "model", "model", "random"], "scores": [1.5, -0.4, 0.3, 0.1],
       "logprobs": [-7.0, -2.0, -5.0, -8.0], "lengths": [5, 2, 4, 5]}]
  samples = [{"context": ["Hi!", "How was your weekend?"], "response": "Great, thanks!",
              "score": 0.9, "candidates": [{"text": "Great, thanks!", "score": 0.9},
                                           {"text": "It rained.", "score": 0.2}]}]
  (diamante / "eval.json").write_text(json.dumps({**metrics, "samples": samples,
                                                  "rankings": rankings}, indent=2))
  chat = [{"turn": 1, "speaker": "user", "text": "Hi! How was your weekend?"},
          {"turn": 2, "speaker": "bot", "text": "Great, thanks!", "score": 0.9,
           "candidates": [["Great, thanks!", 0.9], ["Bad.", -0.3], ["It rained.", 0.2]]}]
  (diamante / "self_chat.jsonl").write_text("".join(json.dumps(t) + "\n" for t in chat))

  # A run: TensorBoard scalars (the trainer's writer), config.gin, software.jsonl, two
  # checkpoint steps, the second damaged after its manifest was written.
  run = demo / "core" / "run"
  writers = metric_writers.MetricWriters(str(run))
  loss = {step: 4.0 / (1 + step / 50) for step in (10, 20, 30, 40, 50)}
  for step, value in loss.items():
    writers.scalars("train", step, {"loss": value})
  writers.scalars("eval", 50, {"loss": 3.1})
  writers.close()
  (run / "config.gin").write_text("train.train_steps = 50\nBATCH_SIZE = 8\n")
  software = {"step": 0, "time": "2026-11-27T20:00:00+00:00", "commit": "abc1234def567",
              "modified": True, "versions": {"jaxmoral": "0.1.0", "jax": "0.10.2"}}
  (run / "software.jsonl").write_text(json.dumps(software) + "\n")
  for step in (25, 50):
    state = run / "checkpoints" / str(step) / checkpoints.STATE_ITEM
    state.mkdir(parents=True)
    (state / "_METADATA").write_text("{}")
    (state / "data.bin").write_bytes(bytes(range(64)) * 4)
    integrity.write_integrity_manifest(state.parent)
  (run / "checkpoints" / "50" / checkpoints.STATE_ITEM / "data.bin").write_bytes(b"x" * 256)

  # The demo's summary.json: one verdict line, as `demo.truth_line` writes it.
  verdict = ("paper: PPO raises the average JSD (Table 4)\n  this run: avg JSD PPO 0.012 vs "
             "SFT 0.010, +0.002 [-0.001, +0.004] over 3 situations — cannot tell")
  (demo / "summary.json").write_text(json.dumps({"clarify": {"truth": [verdict], "seconds": 1.0},
                                                 "total_seconds": 1.0}))
  # An experiment's results, as committed.
  results = root / "experiments"
  results.mkdir(exist_ok=True)
  for suffix in (".json", ".md", ".png"):
    shutil.copy(REPO / "experiments" / "results" / f"diamante_fig3_cpu_shuffled_base{suffix}", results)
  return {"demo": demo, "models": models, "examples": examples, "classifier": classifier,
          "evaluation": evaluation, "curve": curve, "metrics": metrics, "loss": loss,
          "rankings": rankings,
          "model_dir": model_dir, "dialogues": dialogues,
          "results": results}


# -- without a browser: confinement and bad files (run everywhere) -------------------------------


def test_paths_outside_the_folders_are_refused(tmp_path):
  from jaxmoral.explore import server  # pylint: disable=import-outside-toplevel
  shown, outside = tmp_path / "shown", tmp_path / "outside"
  (shown / "sub").mkdir(parents=True)
  outside.mkdir()
  (outside / "secret.txt").write_text("the-secret-content")
  (shown / "sub" / "notes.txt").write_text("notes")
  (shown / "link").symlink_to(outside)
  roots = folders.Roots([shown])
  assert roots.resolve(0, "sub/notes.txt") == (shown / "sub" / "notes.txt").resolve()
  for root, path in ((0, "../outside/secret.txt"), (0, "sub/../../outside"), (0, "/etc/passwd"),
                     (0, str(outside / "secret.txt")), (0, "link/secret.txt"), (1, ""),
                     ("x", ""), (0, "sub\\..\\..\\outside")):
    with pytest.raises(folders.Forbidden):
      roots.resolve(root, path)
  client = server.create_app(roots).test_client()
  assert client.get("/file?root=0&path=sub/notes.txt").data == b"notes"
  for url in ("/file?root=0&path=../outside/secret.txt", "/file?root=0&path=link/secret.txt",
              "/runs?root=0&path=/etc", "/npov?root=3&path="):
    response = client.get(url)
    assert response.status_code == 403 and b"the-secret-content" not in response.data, url
  bad = shown / "detect"
  bad.mkdir()
  (bad / "responses.jsonl").write_text("{\"query\": \"q\", \"pro\": [\"a\"], \"con\": [],"
                                       " \"response\": \"r\"}\n")
  (bad / "scores.jsonl").write_text("{not json\n")
  page = client.get("/npov?root=0&path=detect")
  assert page.status_code == 200
  assert b'class="problem" role="alert">scores.jsonl:1: not JSON' in page.data
  assert client.get("/clarify?root=0&path=missing.json").status_code == 200  # said on the page


# -- the server and the browser -----------------------------------------------------------------


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _snapshot(root: pathlib.Path) -> dict[str, tuple[int, int]]:
  """(size, mtime) of every file: the explorer must change none."""
  return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")
          if p.is_file()}


@pytest.fixture(scope="session")
def chromium_paths() -> tuple[str, str]:
  """(browser, driver): asked first, so a machine without them skips before any work."""
  return _browser_or_skip()


@pytest.fixture(scope="module")
def site(tmp_path_factory, chromium_paths, demo_vocab_path):
  """The folders, and `jaxmoral explore` serving them on a free port."""
  del chromium_paths
  root = tmp_path_factory.mktemp("explore")
  demo, models, results = (root / name for name in ("demo_out", "models", "experiments"))
  for folder in (demo, models, results):
    folder.mkdir()
  # The server starts first: it reads the folders on each request, and its start-up overlaps
  # the writing of the files.
  port = _free_port()
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(
      [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
  log_path = tmp_path_factory.mktemp("explore_server") / "server.log"
  log = open(log_path, "w")  # pylint: disable=consider-using-with
  process = subprocess.Popen(  # pylint: disable=consider-using-with
      [sys.executable, "-m", "jaxmoral.cli", "explore", str(demo), str(models), str(results),
       f"--port={port}"], stdout=log, stderr=subprocess.STDOUT, env=env)
  made = make_folders(root, demo_vocab_path)
  made["before"] = _snapshot(root)
  url = f"http://127.0.0.1:{port}"
  deadline = time.time() + 180  # it imports what its pages use before it serves
  while True:
    try:
      urllib.request.urlopen(url + "/favicon.ico", timeout=2)  # pylint: disable=consider-using-with
      break
    except OSError:  # refused, or not answered yet (URLError, TimeoutError)
      if process.poll() is not None or time.time() > deadline:
        process.kill()
        pytest.fail(f"jaxmoral explore did not start: {log_path.read_text()}")
      time.sleep(0.2)
  made.update(url=url, root=root, process=process, log_path=log_path)
  yield made
  process.terminate()
  process.wait(timeout=20)
  log.close()


@pytest.fixture(scope="module")
def browser(site, chromium_paths):
  chromium, chromedriver = chromium_paths
  from selenium import webdriver  # pylint: disable=import-outside-toplevel
  from selenium.webdriver.chrome.service import Service  # pylint: disable=import-outside-toplevel
  options = webdriver.ChromeOptions()
  options.binary_location = chromium
  for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
               "--window-size=1400,1000", "--disable-extensions"):
    options.add_argument(flag)
  options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
  driver = webdriver.Chrome(service=Service(chromedriver), options=options)
  driver.set_page_load_timeout(120)
  shots = site["root"] / "screenshots"
  shots.mkdir()

  def open_page(path: str, shot: str | None = None):
    driver.get(site["url"] + path)
    if shot:
      from selenium.common import exceptions  # pylint: disable=import-outside-toplevel
      try:
        driver.save_screenshot(str(shots / f"{shot}.png"))
      except exceptions.TimeoutException:  # It can time out on a loaded machine: load again.
        driver.get(site["url"] + path)
        driver.save_screenshot(str(shots / f"{shot}.png"))
    errors = [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
    # A server error's traceback is in the server's log, not the browser's.
    assert not errors, f"{path}: console errors {errors}; server log ends: " \
        f"{site['log_path'].read_text()[-3000:]}"
    return driver

  driver.open_page = open_page
  driver.shots = shots
  yield driver
  driver.quit()


def _no_console_errors(driver) -> None:
  errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
  assert not errors, f"console errors: {errors}"


def _texts(driver, css: str) -> list[str]:
  from selenium.webdriver.common.by import By  # pylint: disable=import-outside-toplevel
  return [e.text for e in driver.find_elements(By.CSS_SELECTOR, css)]


def _visible_ids(driver) -> list[str]:
  from selenium.webdriver.common.by import By  # pylint: disable=import-outside-toplevel
  return [r.get_attribute("data-id") for r in driver.find_elements(
      By.CSS_SELECTOR, "#examples tbody tr") if r.is_displayed()]


def test_index_links_every_view(site, browser):
  from selenium.webdriver.common.by import By  # pylint: disable=import-outside-toplevel
  driver = browser.open_page("/", "index")
  kinds = {e.get_attribute("data-kind") for e in driver.find_elements(By.CSS_SELECTOR,
                                                                       "a.view-link")}
  assert kinds == {"npov", "clarify_evaluation", "clarify_chat", "reward_curve",
                   "diamante_dialogues", "diamante_metrics", "diamante_chat", "run",
                   "experiment"}
  # The chat transcript under ClarifyDelphi, nothing under Diamante but Diamante's files.
  assert {e.get_attribute("data-kind") for e in driver.find_elements(
      By.CSS_SELECTOR, "#diamante a.view-link")} == {"diamante_dialogues", "diamante_metrics",
                                                     "diamante_chat"}
  assert "clarify/chat_transcript.jsonl" in driver.find_element(By.ID, "clarify").text
  # The demo's verdicts, as its summary.json has them.
  verdict = driver.find_element(By.CSS_SELECTOR, '#verdicts-0 li[data-part="clarify"]').text
  assert verdict == ("[clarify] paper: PPO raises the average JSD (Table 4)\nthis run: avg JSD "
                     "PPO 0.012 vs SFT 0.010, +0.002 [-0.001, +0.004] over 3 situations — "
                     "cannot tell")
  # Each box offers the models that can do its job: the run without loadable checkpoints
  # (core/run) none; Diamante's ranker needs the scalar head t5_joint has.
  for form in ("live-npov", "live-clarify", "live-diamante"):
    options = driver.find_elements(By.CSS_SELECTOR, f'#{form} select[name="model"] option')
    assert [o.get_attribute("value") for o in options] == ["1:t5_joint"], form
  for link in [e.get_attribute("href") for e in driver.find_elements(By.CSS_SELECTOR,
                                                                       "a.view-link")]:
    browser.open_page(link[len(site["url"]):])
    assert not driver.find_elements(By.CSS_SELECTOR, ".problem") or "bad" in link, link


def test_npov_table_sorts_filters_and_opens_an_example(site, browser):
  from selenium.webdriver.common.by import By  # pylint: disable=import-outside-toplevel
  from selenium.webdriver.support.ui import Select  # pylint: disable=import-outside-toplevel
  from jaxmoral.npov.detectors import rouge  # pylint: disable=import-outside-toplevel
  driver = browser.open_page("/npov?root=0&path=npov/detect", "npov")
  examples = site["examples"]
  assert _visible_ids(driver) == [e.id for e in examples]
  detect_dir = site["demo"] / "npov" / "detect"
  salience = {r["id"]: r for r in map(json.loads, (detect_dir / "scores.jsonl").read_text(
      ).splitlines())}
  # Scores as the files hold them; ROUGE-1 as the library computes it.
  for e in examples:
    row = driver.find_element(By.CSS_SELECTOR, f'tr[data-id="{e.id}"]')
    cells = {(c.get_attribute("data-detector"), c.get_attribute("data-error-type")): c.text
             for c in row.find_elements(By.CSS_SELECTOR, "td[data-detector]")}
    assert cells[("classifier", "hallucination")] == f"{site['classifier'][e.id].hallucination:.4f}"
    assert cells[("rouge", "coverage")] == f"{rouge.RougeDetector().detect(e).coverage:.4f}"
    assert cells[("salience", "hallucination")] == f"{salience[e.id]['hallucination']:.4f}"
  # Sorting: by the classifier's hallucination score, then descending.
  header = driver.find_element(By.XPATH, "//table[@id='examples']//th[.='classifier hall.']")
  header.click()
  by_score = sorted(examples, key=lambda e: site["classifier"][e.id].hallucination)
  assert _visible_ids(driver) == [e.id for e in by_score]
  header.click()
  assert _visible_ids(driver) == [e.id for e in reversed(by_score)]
  # Filtering by error type and paraphrase.
  Select(driver.find_element(By.CSS_SELECTOR, 'select[data-filter="error"]')).select_by_value(
      "hallucination")
  assert sorted(_visible_ids(driver)) == sorted(e.id for e in examples if e.hallucination)
  Select(driver.find_element(By.CSS_SELECTOR, 'select[data-filter="paraphrased"]')
         ).select_by_value("yes")
  assert _visible_ids(driver) == ["para-hall"]
  driver.save_screenshot(str(browser.shots / "npov-filtered.png"))
  # ROC curves: one per slice and error type, the detector's AUC from results.json.
  results = json.loads((site["demo"] / "npov" / "detect" / "results.json").read_text())
  auc = results["input"]["rouge"]["hallucination"]["example_auc"]
  series = [e.get_attribute("data-series") for e in driver.find_elements(
      By.CSS_SELECTOR, 'figure[data-error="hallucination"] polyline')]
  assert series == [f"rouge (AUC {auc:.3f})"]
  # The AUC table: x 100 with the 95 % interval, the word level, and n.
  for error in ("hallucination", "coverage"):
    r = results["input"]["rouge"][error]
    row = driver.find_element(By.CSS_SELECTOR, 'table.aucs tr[data-detector="rouge"]')
    cell = row.find_element(By.CSS_SELECTOR, f'td[data-error="{error}"][data-level="example"]')
    lo, hi = r["example_auc_ci"]
    assert cell.text == f"{100 * r['example_auc']:.1f} [{100 * lo:.1f}, {100 * hi:.1f}]"
    word = row.find_element(By.CSS_SELECTOR, f'td[data-error="{error}"][data-level="word"]')
    assert word.text == (f"{100 * r['word_auc']:.1f}" if r["word_auc"] is not None else "—")
    n = row.find_element(By.CSS_SELECTOR, f'td[data-error="{error}"][data-level="n"]').text
    assert n == f"{r['num_examples']} ({r['num_positive']} pos), {r['num_words']} words"
  # An example: its arguments, response, ROUGE overlaps and classifier probabilities.
  driver.find_element(By.CSS_SELECTOR, 'tr[data-id="para-hall"] a.example-link').click()
  browser.save_screenshot(str(browser.shots / "npov-example.png"))
  assert driver.find_element(By.ID, "example-id").text == "para-hall"
  example = examples[-1]
  assert driver.find_element(By.ID, "response").text.split() == example.response.split()
  # The response shaded by the salience detector's word scores, as scores.jsonl has them.
  spans = driver.find_elements(By.CSS_SELECTOR, "#response .sal")
  words = salience["para-hall"]["response_words"]
  assert [s.text for s in spans] == [w["text"] for w in words]
  np.testing.assert_allclose([float(s.get_attribute("data-score")) for s in spans],
                             [w["score"] for w in words], atol=1e-6)
  # Drawn on the heatmap's scale (darkest: the example's highest word score), and flagged by
  # its rule: more than one standard deviation above the mean of the response's words.
  scores = np.array([w["score"] for w in words])
  arguments = [w["score"] for w in salience["para-hall"]["argument_words"]]
  darkest = max(scores.max(), *arguments)
  np.testing.assert_allclose([float(s.get_attribute("style").split(":")[1].strip(" ;")) for s in spans],
                             np.clip(scores / darkest, 0, 1), atol=1e-6)
  flagged = [s.text for s in spans if "flagged" in s.get_attribute("class")]
  assert flagged == [w["text"] for w in words if w["score"] > scores.mean() + scores.std()]
  assert 0 < len(flagged) < len(words)
  # The arguments by the same detector's coverage word scores.
  shaded = driver.find_elements(By.CSS_SELECTOR, ".argument .sal.cov")
  np.testing.assert_allclose(sorted(float(s.get_attribute("data-score")) for s in shaded),
                             sorted(arguments), atol=1e-6)
  overlaps = {w.text for w in rouge.RougeDetector().detect(example).response_words
              if w.score == 0.0}
  assert {s.text for s in spans if "overlap" in s.get_attribute("class")} == overlaps
  driver.switch_to.frame(driver.find_element(By.CSS_SELECTOR, "iframe.heatmap"))
  assert driver.find_element(By.TAG_NAME, "h3").text == example.query  # the library's page
  assert len(driver.find_elements(By.CSS_SELECTOR, "tr:first-child th")) == len(words) + 2
  driver.switch_to.default_content()
  p_no = site["classifier"]["para-hall"].hallucination
  assert f"P(YES) {1 - p_no:.3f}, P(NO) {p_no:.3f}" in driver.find_element(
      By.CSS_SELECTOR, 'tr[data-detector="classifier"]').text
  _no_console_errors(driver)


def test_clarify_views_match_the_files(site, browser):
  from selenium.webdriver.common.by import By  # pylint: disable=import-outside-toplevel
  evaluation = site["evaluation"]
  driver = browser.open_page("/clarify?root=0&path=clarify/evaluation.json", "clarify")
  for name, result in evaluation.items():
    cells = _texts(driver, f'#situations td.jsd[data-system="{name}"]')
    assert cells == [f"{v:.4f}" for v in result["per_situation"]["jsd"]]
  # The means with their 95 % interval over situations (the library's bootstrap), the
  # percentages as percentages, and what each system is.
  from jaxmoral import metrics  # pylint: disable=import-outside-toplevel
  for name, result in evaluation.items():
    row = driver.find_element(By.CSS_SELECTOR, f'#summary tr[data-system="{name}"]')
    jsd = result["per_situation"]["jsd"]
    ci = metrics.bootstrap_ci(np.mean, np.asarray(jsd, np.float64))
    assert row.find_element(By.CSS_SELECTOR, 'td[data-metric="jsd"]').text == \
        f"{result['jsd']:.4f} [{ci.low:.4f}, {ci.high:.4f}]"
    flips = result["per_situation"]["flips_pct"]
    ci = metrics.bootstrap_ci(np.mean, np.asarray(flips, np.float64))
    assert row.find_element(By.CSS_SELECTOR, 'td[data-metric="flips_pct"]').text == \
        f"{result['flips_pct']:.1f} [{ci.low:.1f}, {ci.high:.1f}]"
  described = driver.find_element(By.ID, "system-descriptions").text
  assert "Why are you <situation>?" in described and "nucleus sampling" in described
  driver.find_element(By.CSS_SELECTOR, 'tr[data-index="0"] a.situation-link').click()
  _no_console_errors(driver)
  driver.save_screenshot(str(browser.shots / "clarify-situation.png"))
  if os.environ.get("JAXMORAL_EXPLORE_SCREENSHOT"):  # the README's picture (docs/explore.png)
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(1400, height + 140)  # the whole page, header to last verdict
    driver.execute_script("window.scrollTo(0, 0)")
    driver.save_screenshot(os.environ["JAXMORAL_EXPLORE_SCREENSHOT"])
    driver.set_window_size(1400, 1000)
  for name, result in evaluation.items():
    row = result["per_question"][0]
    system = driver.find_element(By.CSS_SELECTOR, f'#detail .system[data-system="{name}"]')
    text = system.text
    for key in ("question", "weakener", "strengthener", "weakened_situation",
                "strengthened_situation"):
      assert row[key] in text
    assert system.find_element(By.CSS_SELECTOR, ".jsd").text == f"{row['jsd']:.6f}"
    bars = system.find_elements(By.CSS_SELECTOR, "svg.bars text.value")
    shown = [float(b.text) for b in bars]
    expected = (row["base_distribution"] + row["weakened_distribution"]
                + row["strengthened_distribution"])
    np.testing.assert_allclose(shown, expected, atol=6e-4)
  driver = browser.open_page("/clarify?root=0&path=clarify/chat_transcript.jsonl", "chat")
  assert _texts(driver, ".question") == ["Why?", "Who was hurt?"]
  assert len(driver.find_elements(By.CSS_SELECTOR, "section.chat")) == 1
  driver = browser.open_page("/clarify?root=0&path=clarify/ppo/reward_curve.json", "curve")
  rows = [r.split() for r in _texts(driver, "table.curve tbody tr")]
  assert rows == [[str(i), f"{v:.6f}"] for i, v in zip(site["curve"]["iterations"],
                                                     site["curve"]["raw_reward_mean"])]


def test_diamante_views_rank_as_the_library(site, browser):
  from selenium.webdriver.common.by import By  # pylint: disable=import-outside-toplevel
  from selenium.webdriver.support.ui import Select  # pylint: disable=import-outside-toplevel
  from jaxmoral import metrics  # pylint: disable=import-outside-toplevel
  from jaxmoral.diamante import bundle as bundle_lib  # pylint: disable=import-outside-toplevel
  from jaxmoral.diamante import inference  # pylint: disable=import-outside-toplevel
  driver = browser.open_page("/diamante?root=0&path=diamante/eval.json", "diamante-metrics")
  assert driver.find_element(By.CSS_SELECTOR, 'tr[data-ranker="preference"]').text.split()[1:] \
      == [f"{site['metrics'][f'preference/{k}']:.4f}" for k in ("p@1", "mrr", "map")]
  definitions = driver.find_element(By.ID, "metric-definitions").text
  assert "Over the 4 test contexts" in definitions and "MRR: the mean of 1 / its rank" in \
      definitions
  # The contexts the evaluation ranked, by its stored scores, without a model.
  def stored_rows(ranking):
    """(response and its kind badge, score) best first by the stored scores."""
    order = np.argsort(-np.asarray(ranking["scores"]), kind="stable")
    return [(f"{ranking['responses'][i]} {ranking['kinds'][i]}",
             pytest.approx(ranking["scores"][i], abs=1e-6)) for i in order]

  def table(section):
    return [(r.find_element(By.CSS_SELECTOR, "td.text").text,
             float(r.find_element(By.CSS_SELECTOR, "td.score").text))
            for r in section.find_elements(By.CSS_SELECTOR, "table.ranking tbody tr")]

  # The replies it generated, each the best of its candidates by preference score.
  sample = driver.find_element(By.CSS_SELECTOR, "#diamante-samples tr.sample")
  assert sample.find_element(By.CSS_SELECTOR, "td.score").text == "0.90"
  assert sample.text.startswith("Hi! | How was your weekend? Great, thanks!")
  assert [li.text for li in sample.find_elements(By.CSS_SELECTOR, "ol.candidates li")] == [
      "Great, thanks! 0.90", "It rained. 0.20"]
  sections = driver.find_elements(By.CSS_SELECTOR, "section.context.ranked")
  assert [int(s.get_attribute("data-turn")) for s in sections] == [0, 2]
  for section, ranking in zip(sections, site["rankings"]):
    assert table(section) == stored_rows(ranking)
  # Context 1: r_H (0.2) is second after a candidate (0.7); context 3: first.
  assert [s.find_element(By.CSS_SELECTOR, "h3 small").text for s in sections] == [
      "human response ranked 2 of 4", "human response ranked 1 of 4"]
  driver.save_screenshot(str(browser.shots / "diamante-evaluation.png"))
  driver = browser.open_page("/diamante?root=0&path=diamante/self_chat.jsonl", "self-chat")
  assert "Great, thanks!" in driver.find_element(By.CSS_SELECTOR, "tr.chosen").get_attribute(
      "textContent")
  driver = browser.open_page("/diamante?root=0&path=diamante/test.jsonl", "diamante")
  assert f"P@1 {site['metrics']['preference/p@1']:.4f}" in driver.find_element(
      By.CSS_SELECTOR, ".metrics.evaluation").text
  # No model chosen: the contexts the evaluation beside the file ranked show its rankings.
  assert driver.find_element(By.ID, "stored-rankings").is_displayed()
  stored = {int(s.get_attribute("data-index")): s
            for s in driver.find_elements(By.CSS_SELECTOR, "section.context")}
  for ranking in site["rankings"]:
    assert table(stored[ranking["turn"]]) == stored_rows(ranking)
  assert not stored[1].find_elements(By.CSS_SELECTOR, "table.ranking")  # Not evaluated.
  assert driver.find_element(By.ID, "p-at-1").text == "0.5000"  # Ranked 2nd, then 1st.
  assert "random responses from other dialogues included" in driver.find_element(
      By.ID, "ranking-definition").text
  Select(driver.find_element(By.NAME, "model")).select_by_value("1:t5_joint")
  driver.find_element(By.CSS_SELECTOR, "#rank-form button").click()
  driver.save_screenshot(str(browser.shots / "diamante-ranked.png"))
  bundle = bundle_lib.load(str(site["model_dir"]))
  p_at_1 = []
  contexts = [(d[:i], d[i], cs[i]) for d, cs in site["dialogues"] for i in range(1, len(d))]
  sections = driver.find_elements(By.CSS_SELECTOR, "section.context")
  assert len(sections) == len(contexts)
  for section, (context, human, candidates) in zip(sections, contexts):
    responses = [human, *(c for c in candidates if c != human)]  # as evaluation ranks them
    scores, _ = inference.rank_texts(bundle, context, responses)
    order = np.argsort(-np.asarray(scores), kind="stable")
    rows = section.find_elements(By.CSS_SELECTOR, "table.ranking tbody tr")
    assert [r.find_element(By.CSS_SELECTOR, "td.text").text.replace(" human", "")
            for r in rows] == [responses[i] for i in order]
    np.testing.assert_allclose([float(r.find_element(By.CSS_SELECTOR, "td.score").text)
                                for r in rows], np.asarray(scores)[order], atol=2e-6)
    assert "human" in rows[list(order).index(0)].get_attribute("class")
    p_at_1.append(metrics.ranking_metrics([np.asarray(scores)],
                                          [np.arange(len(responses)) == 0])["p@1"])
  assert driver.find_element(By.ID, "p-at-1").text == f"{np.mean(p_at_1):.4f}"
  # Why these differ from the evaluation's: no random responses here.
  assert "also ranks random responses" in driver.find_element(By.ID, "ranking-definition").text
  _no_console_errors(driver)


def test_run_and_experiment_views(site, browser):
  from selenium.webdriver.common.by import By  # pylint: disable=import-outside-toplevel
  driver = browser.open_page("/runs?root=0&path=core/run", "run")
  points = driver.find_elements(By.CSS_SELECTOR, 'figure[data-tag="loss"] circle title')
  assert [t.get_attribute("textContent") for t in points] == [
      "eval: 50, 3.1", *(f"train: {s}, {v:.4g}" for s, v in site["loss"].items())]
  steps = {r.get_attribute("data-step"): r.get_attribute("class") for r in
           driver.find_elements(By.CSS_SELECTOR, "#checkpoints tbody tr")}
  assert steps == {"25": "ok", "50": "damaged"}
  assert "state/data.bin" in driver.find_element(By.CSS_SELECTOR, "tr.damaged").text
  assert "BATCH_SIZE = 8" in driver.find_element(By.CSS_SELECTOR, "pre.config").text
  assert "jaxmoral 0.1.0 (commit abc1234def56, modified), jax 0.10.2" in driver.find_element(
      By.ID, "software").text
  driver = browser.open_page("/experiments?root=2&path=diamante_fig3_cpu_shuffled_base.json",
                             "experiment")
  data = json.loads((site["results"] / "diamante_fig3_cpu_shuffled_base.json").read_text())
  ci = data["differences"]
  first = next(iter(ci.values()))
  first_metric = next(iter(first.values()))
  row = driver.find_element(By.CSS_SELECTOR, 'table[data-group="differences"] tbody tr').text
  assert f"{first_metric['estimate']:.4f}" in row and f"{first_metric['low']:.4f}" in row
  assert driver.execute_script(
      "const i = document.querySelector('img.plot'); return i.complete && i.naturalWidth") > 0


def test_live_npov_salience_is_the_library_result(site, browser):
  from selenium.webdriver.common.by import By  # pylint: disable=import-outside-toplevel
  from selenium.webdriver.support.ui import Select  # pylint: disable=import-outside-toplevel
  from jaxmoral.npov import detect  # pylint: disable=import-outside-toplevel
  from jaxmoral.npov import task  # pylint: disable=import-outside-toplevel
  driver = browser.open_page("/npov?root=0&path=npov/detect", "npov-live")
  form = driver.find_element(By.ID, "live-npov")
  Select(form.find_element(By.NAME, "model")).select_by_value("1:t5_joint")
  typed = {"query": "Should school uniforms be compulsory?",
           "pro": "Uniforms reduce bullying.\nUniforms save money.",
           "con": "Uniforms limit self expression.",
           "response": "Uniforms reduce bullying but limit expression and improve grades."}
  for name, value in typed.items():
    form.find_element(By.NAME, name).send_keys(value)
  form.find_element(By.CSS_SELECTOR, "button").click()
  driver.save_screenshot(str(browser.shots / "npov-live.png"))
  assert not driver.find_elements(By.CSS_SELECTOR, ".problem"), driver.page_source[:2000]
  detector = detect.build_detector("salience", base_dir=str(site["model_dir"]))
  example = task.NpovExample(id="live", topic="live", query=typed["query"],
                             pro=tuple(typed["pro"].split("\n")), con=(typed["con"],),
                             response=typed["response"])
  expected = detector.detect_from_map(detector.word_map(example))
  assert driver.find_element(By.ID, "live-hallucination").text == f"{expected.hallucination:.6f}"
  assert driver.find_element(By.ID, "live-coverage").text == f"{expected.coverage:.6f}"
  shown = [float(c.text) for c in driver.find_elements(By.CSS_SELECTOR, "tr.live-word td.num")]
  np.testing.assert_allclose(shown, [w.score for w in expected.response_words], atol=2e-6)
  assert len(driver.find_elements(By.CSS_SELECTOR, "#live-result .response .sal")) == len(shown)
  _no_console_errors(driver)


def test_live_clarify_question_is_the_library_reward(site, browser):
  from selenium.webdriver.common.by import By  # pylint: disable=import-outside-toplevel
  from selenium.webdriver.support.ui import Select  # pylint: disable=import-outside-toplevel
  from jaxmoral.clarify import reward as reward_lib  # pylint: disable=import-outside-toplevel
  driver = browser.open_page("/", "clarify-live-form")
  form = driver.find_element(By.ID, "live-clarify")
  Select(form.find_element(By.NAME, "model")).select_by_value("1:t5_joint")
  # Pre-filled with the classes the model's vocabulary spells as one token each.
  assert form.find_element(By.NAME, "judge_classes").get_attribute("value") == "wrong,okay,good"
  situation, question = SITUATIONS[1], "Why did you skip it?"
  form.find_element(By.NAME, "situation").send_keys(situation)
  form.find_element(By.NAME, "question").send_keys(question)
  form.find_element(By.CSS_SELECTOR, "button").click()
  driver.save_screenshot(str(browser.shots / "clarify-live.png"))
  assert not driver.find_elements(By.CSS_SELECTOR, ".problem"), driver.page_source[:2000]
  model = str(site["model_dir"])
  reward = reward_lib.DefeasibilityReward.from_dirs(
      answer_model_dir=model, fusion_model_dir=model, judge_model_dir=model,
      config=reward_lib.RewardConfig(judge_classes=("wrong", "okay", "good"), use_nli=False,
                                     batch_size=1))
  expected = reward.score_questions([situation], [question]).row(0)
  result = driver.find_element(By.ID, "live-result")
  assert result.find_element(By.CSS_SELECTOR, ".jsd").text == f"{expected['jsd']:.6f}"
  shown_text = " ".join(result.text.split())  # the browser collapses runs of spaces
  for key in ("weakener", "strengthener", "weakened_situation", "strengthened_situation"):
    assert " ".join(expected[key].split()) in shown_text
  shown = [float(b.text) for b in result.find_elements(By.CSS_SELECTOR, "svg.bars text.value")]
  np.testing.assert_allclose(shown, expected["base_distribution"] + expected[
      "weakened_distribution"] + expected["strengthened_distribution"], atol=6e-4)
  _no_console_errors(driver)


def test_live_diamante_ranking_is_the_library_ranking(site, browser):
  from selenium.webdriver.common.by import By  # pylint: disable=import-outside-toplevel
  from selenium.webdriver.support.ui import Select  # pylint: disable=import-outside-toplevel
  from jaxmoral.diamante import bundle as bundle_lib  # pylint: disable=import-outside-toplevel
  from jaxmoral.diamante import inference  # pylint: disable=import-outside-toplevel
  driver = browser.open_page("/", "diamante-live-form")
  form = driver.find_element(By.ID, "live-diamante")
  Select(form.find_element(By.NAME, "model")).select_by_value("1:t5_joint")
  context = ["Hi! How was your weekend?"]
  responses = ["Great, I went hiking.", "It was fine.", "I stayed home."]
  form.find_element(By.NAME, "context").send_keys("\n".join(context))
  form.find_element(By.NAME, "responses").send_keys("\n".join(responses))
  form.find_element(By.CSS_SELECTOR, "button").click()
  driver.save_screenshot(str(browser.shots / "diamante-live.png"))
  scores, logprobs = inference.rank_texts(bundle_lib.load(str(site["model_dir"])), context,
                                          responses)
  order = np.argsort(-scores, kind="stable")
  rows = driver.find_elements(By.CSS_SELECTOR, "#live-result table.ranking tbody tr")
  assert [r.find_element(By.CSS_SELECTOR, "td.text").text.replace(" human", "")
          for r in rows] == [responses[i] for i in order]
  np.testing.assert_allclose(
      [[float(c.text) for c in r.find_elements(By.CSS_SELECTOR, "td.num")[:2]] for r in rows],
      np.stack([scores, logprobs], 1)[order], atol=2e-4)
  _no_console_errors(driver)


def test_confinement_bad_files_and_read_only(site, browser):
  from selenium.webdriver.common.by import By  # pylint: disable=import-outside-toplevel
  for path in ("/npov?root=0&path=../models", "/npov?root=0&path=" + str(site["models"]),
               "/file?root=1&path=t5_joint/../../demo_out/summary.png",
               "/runs?root=0&path=%2Fetc", "/runs?root=7&path=", "/file?root=0&path=..%2F"):
    with pytest.raises(urllib.error.HTTPError) as raised:
      urllib.request.urlopen(site["url"] + path, timeout=30)  # pylint: disable=consider-using-with
    assert raised.value.code == 403, path
  # A page of another site whose name was re-pointed at 127.0.0.1 (DNS rebinding).
  request = urllib.request.Request(site["url"] + "/", headers={"Host": "attacker.example"})
  with pytest.raises(urllib.error.HTTPError) as raised:
    urllib.request.urlopen(request, timeout=30)  # pylint: disable=consider-using-with
  assert raised.value.code == 403
  # A link inside a folder that leads outside it.
  with pytest.raises(folders.Forbidden):
    link_root = site["root"] / "linked"
    link_root.mkdir(exist_ok=True)
    link = link_root / "out"
    if not link.exists():
      link.symlink_to(site["models"])
    folders.Roots([link_root]).resolve(0, "out/t5_joint")
  driver = browser.open_page("/npov?root=0&path=npov/bad", "bad-file")
  problem = driver.find_element(By.CSS_SELECTOR, ".problem").text
  assert problem.startswith("scores.jsonl:1: not JSON"), problem
  assert _visible_ids(driver) == [e.id for e in site["examples"]]  # the rest still shows
  driver = browser.open_page("/clarify?root=0&path=npov/bad/scores.jsonl", "bad-clarify")
  assert "not JSON" in driver.find_element(By.CSS_SELECTOR, ".problem").text
  assert site["process"].poll() is None  # the server is still up
  after = _snapshot(site["root"])
  assert {k: v for k, v in after.items() if k in site["before"]} == site["before"]
  assert not [k for k in after if k not in site["before"] and "/screenshots/" not in k
              and "/linked/" not in k]


# -- what the server refuses: other sites, other hosts, large bodies, special files -------------


def _open(url: str, *, data: bytes | None = None, headers: dict | None = None,
          timeout: float = 30):
  """(status, headers, body) of a request, an HTTP error's included."""
  request = urllib.request.Request(url, data=data, headers=headers or {})
  try:
    with urllib.request.urlopen(request, timeout=timeout) as response:
      return response.status, response.headers, response.read()
  except urllib.error.HTTPError as error:
    return error.code, error.headers, error.read()


def _form_token(page: bytes) -> str:
  import re  # pylint: disable=import-outside-toplevel
  return re.search(rb'name="token" value="([^"]+)"', page).group(1).decode()


def _post(url: str, fields: dict, headers: dict | None = None):
  body = urllib.parse.urlencode(fields).encode()
  return _open(url, data=body, headers={
      "Content-Type": "application/x-www-form-urlencoded", **(headers or {})})


def _problem(page: bytes) -> str:
  import html  # pylint: disable=import-outside-toplevel
  import re  # pylint: disable=import-outside-toplevel
  found = re.search(rb'class="problem" role="alert">(.*?)</div>', page, re.S)
  return html.unescape(found.group(1).decode()) if found else ""


def test_forms_of_other_sites_and_gets_run_no_model(site):
  url = site["url"]
  status, headers, index = _open(url + "/")
  assert status == 200
  # Every page: no framing by other pages, no sniffing, no referrer, only its own script.
  policy = headers["Content-Security-Policy"]
  assert "frame-ancestors 'none'" in policy and "script-src 'self'" in policy
  assert "default-src 'none'" in policy
  assert (headers["X-Frame-Options"], headers["X-Content-Type-Options"],
          headers["Referrer-Policy"]) == ("DENY", "nosniff", "no-referrer")
  status, headers, _ = _open(url + "/file?root=2&path=diamante_fig3_cpu_shuffled_base.png")
  assert status == 200 and headers["X-Content-Type-Options"] == "nosniff"
  assert "sandbox" in headers["Content-Security-Policy"]
  # The index names the folders, not where they are on the disk.
  assert str(site["root"]).encode() not in index
  token = _form_token(index)
  typed = {"model": "1:t5_joint", "query": "q", "pro": "a", "con": "b", "response": "r s t"}
  for fields, headers in (
      (typed, {"Origin": "http://evil.example"}),  # a form of another site, no token
      ({**typed, "token": token}, {"Origin": "http://evil.example"}),
      ({**typed, "token": token}, {"Sec-Fetch-Site": "cross-site"}),
      ({**typed, "token": token}, {"Origin": "null", "Sec-Fetch-Site": "cross-site"}),
      ({**typed, "token": "guessed"}, {}),
      (typed, {})):
    status, _, page = _post(url + "/live/npov", fields, headers)
    assert status == 403 and b"live-hallucination" not in page, (fields, headers)
  # A GET (an <img> of any page can send one) ranks nothing, whatever it asks for.
  _, _, page = _open(url + "/diamante?root=0&path=diamante/test.jsonl&model=1:t5_joint&max=99")
  assert b'data-index="1"' in page
  assert b'id="p-at-1">0.5000' in page  # the stored rankings of the two evaluated contexts
  section = page.split(b'data-index="1"')[1].split(b"</section>")[0]
  assert b"table class=\"ranking" not in section


def test_bodies_fields_lines_and_classes_are_capped(site):
  url = site["url"]
  token = _form_token(_open(url + "/")[2])
  # 10 MB announced: refused once the headers are read, before any of the body is.
  port = int(url.rpartition(":")[2])
  with socket.create_connection(("127.0.0.1", port), timeout=30) as connection:
    connection.sendall(b"POST /live/npov HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                       b"application/x-www-form-urlencoded\r\nContent-Length: 10485760\r\n\r\n"
                       + b"response=" + b"w" * 1000)
    answer = connection.recv(65536)
  assert answer.startswith(b"HTTP/1.1 413") and b"www" not in answer
  status, _, _ = _post(url + "/live/npov", {"token": token, **{f"f{i}": "x" for i in range(40)}})
  assert status == 413
  status, _, page = _post(url + "/live/npov", {"token": token, "model": "1:t5_joint",
                                               "pro": "an argument\n" * 500, "response": "r"})
  assert status == 200 and _problem(page) == "at most 64 pro arguments (got 500)"
  status, _, page = _post(url + "/live/clarify", {
      "token": token, "model": "1:t5_joint", "situation": "s", "question": "q?",
      "judge_classes": ",".join(["c"] * 100000)})
  assert status == 200
  assert _problem(page) == "the judge takes 3 classes (bad, ok, good); got 100000"
  # Classes the judge's vocabulary cannot score: said for the page, with the model's own.
  status, _, page = _post(url + "/live/clarify", {
      "token": token, "model": "1:t5_joint", "situation": "s", "question": "q?",
      "judge_classes": "bad,okay,good"})
  assert _problem(page) == ("the judge model cannot score the classes bad, okay, good: each "
                            "must be one token of its vocabulary; this model's are wrong, "
                            "okay, good")
  status, _, page = _post(url + "/live/diamante", {"token": token, "context": "c",
                                                   "responses": "r"})
  assert _problem(page) == "choose a Diamante model"


def test_special_files_and_links_out_are_not_read(site, tmp_path):
  special = site["demo"] / "specials"
  special.mkdir()
  outside = tmp_path / "outside.json"
  outside.write_text(json.dumps({"preference/p@1": 0.5}))
  try:
    os.mkfifo(special / "stuck.jsonl")
    (special / "big.json").symlink_to("/dev/zero")
    (special / "leak.json").symlink_to(outside)
    (special / "sub").symlink_to(tmp_path)
    for _ in range(6):  # more than the server's threads: none may be left blocked
      status, _, page = _open(site["url"] + "/", timeout=20)
      assert status == 200
    assert b"specials/" not in page
    for path in ("specials/stuck.jsonl", "specials/big.json", "specials/leak.json",
                 "specials/sub/outside.json"):
      status, _, page = _open(f"{site['url']}/diamante?root=0&path={path}", timeout=20)
      assert status == 403, path
    status, _, _ = _open(site["url"] + "/static/explore.css", timeout=20)
    assert status == 200
  finally:
    shutil.rmtree(special)


def test_a_manifest_naming_files_outside_its_step_is_no_oracle(site):
  from jaxmoral import checkpoints  # pylint: disable=import-outside-toplevel
  from jaxmoral import integrity  # pylint: disable=import-outside-toplevel
  run = site["demo"] / "probe_run"
  state = run / "checkpoints" / "7" / checkpoints.STATE_ITEM
  state.mkdir(parents=True)
  try:
    (run / "config.gin").write_text("")
    (state / "data.bin").write_bytes(b"d" * 16)
    integrity.write_integrity_manifest(state.parent)
    manifest = json.loads((state.parent / integrity.INTEGRITY_FILE).read_text())
    entry = {"size": 1, "sha256": "0" * 64}
    manifest["files"].update({"../../../../../../../../etc/passwd": entry,
                              "/etc/hostname": entry})
    (state.parent / integrity.INTEGRITY_FILE).write_text(json.dumps(manifest))
    status, _, page = _open(site["url"] + "/runs?root=0&path=probe_run")
    assert status == 200
    row = page.split(b'data-step="7"')[1].split(b"</tr>")[0]
    assert b"names a file outside the step folder" in row and b"damaged" in page
    assert b"passwd" not in page and b"hostname" not in page and b"bytes" not in row
  finally:
    shutil.rmtree(run)


def test_checkpoint_verification_is_cached_per_step(site, monkeypatch):
  from jaxmoral import checkpoints  # pylint: disable=import-outside-toplevel
  from jaxmoral.explore import sources  # pylint: disable=import-outside-toplevel
  calls = []
  verify = checkpoints.verify_step
  monkeypatch.setattr(checkpoints, "verify_step",
                      lambda *a, **k: calls.append(a[1]) or verify(*a, **k))
  run = site["demo"] / "core" / "run"
  first = sources.run_checkpoints(run)
  assert sources.run_checkpoints(run) == first and sorted(calls) == [25, 50]
  data = run / "checkpoints" / "25" / checkpoints.STATE_ITEM / "data.bin"
  original = data.read_bytes()
  stat = data.stat()
  try:
    data.write_bytes(b"y" * len(original))  # same size, new contents: hashed again
    assert [c["ok"] for c in sources.run_checkpoints(run)] == [False, False]
    assert sorted(calls) == [25, 25, 50]
  finally:
    data.write_bytes(original)
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_controls_and_bidi_overrides_are_shown_by_name(site, browser):
  from selenium.webdriver.common.by import By  # pylint: disable=import-outside-toplevel
  probe = site["demo"] / "probe"
  probe.mkdir()
  try:
    turn = {"turn": 1, "situation": "s", "judgment": "bad", "question": "Why\u202e?dias\x00x",
            "answer": "a", "fused_situation": "f", "new_judgment": "ok"}
    (probe / "transcript.jsonl").write_text(json.dumps(turn) + "\n")
    driver = browser.open_page("/clarify?root=0&path=probe/transcript.jsonl")
    assert driver.find_element(By.CSS_SELECTOR, ".question").text == \
        "Why⟨U+202E⟩?dias⟨U+0000⟩x"
    # A missing file's message names it by its folder's label, not by its place on disk.
    status, _, page = _open(site["url"] + "/runs?root=0&path=probe/nothing")
    assert str(site["root"]).encode() not in page
    from jaxmoral.explore import security  # pylint: disable=import-outside-toplevel
    assert security.redact(f"cannot open '{site['demo']}/a.json' or '/home/u/.cache/b.bin'",
                           [(str(site["demo"]), "demo_out")]) == \
        "cannot open 'demo_out/a.json' or '…/b.bin'"
  finally:
    shutil.rmtree(probe)


@contextlib.contextmanager
def _running(served):
  """Runs a waitress server in a thread until the block ends. Closing it under its running
  loop makes the loop's next select fail on the closed socket (EBADF): that is the loop
  ending, not an error, so the thread ends quietly and is joined."""
  closed = threading.Event()

  def run():
    try:
      served.run()
    except (OSError, ValueError):  # EBADF, or a descriptor already -1.
      if not closed.is_set():
        raise

  thread = threading.Thread(target=run, daemon=True)
  thread.start()
  try:
    yield
  finally:
    closed.set()
    served.close()
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def remote_server(site):
  """The explorer bound to every address (its token required), in this process."""
  from jaxmoral.explore import server  # pylint: disable=import-outside-toplevel
  served, lines = server.make_server(dirs=[str(site["demo"])], port=0, host="0.0.0.0")
  with _running(served):
    yield served, lines


def test_served_beyond_this_machine_needs_the_token(remote_server, site):
  import re  # pylint: disable=import-outside-toplevel
  served, lines = remote_server
  assert "WARNING" in lines[0]
  token = re.search(r"\?token=(\S+)", lines[-1]).group(1)
  url = f"http://127.0.0.1:{served.effective_port}"
  status, _, page = _open(url + "/")
  assert status == 403 and b"needs its token" in page
  status, headers, page = _open(f"{url}/?token={token}")
  assert status == 200 and b"Results explorer" in page
  assert str(site["demo"]).encode() not in page
  cookie = headers["Set-Cookie"].split(";")[0]
  assert "HttpOnly" in headers["Set-Cookie"] and "SameSite=Strict" in headers["Set-Cookie"]
  assert _open(url + "/npov?root=0&path=npov/detect", headers={"Cookie": cookie})[0] == 200
  assert _open(url + "/npov?root=0&path=npov/detect",
               headers={"Cookie": cookie.split("=")[0] + "=guessed"})[0] == 403
  # Another site's name re-pointed at this machine, with the token: still refused.
  assert _open(f"{url}/?token={token}", headers={"Host": "evil.example"})[0] == 403
  status, _, _ = _post(url + "/live/npov", {"token": token, "response": "r"},
                       {"Host": "evil.example", "Origin": "http://evil.example",
                        "Cookie": cookie})
  assert status == 403


def test_other_loopback_addresses_keep_the_host_check(site):
  from jaxmoral.explore import server  # pylint: disable=import-outside-toplevel
  try:
    served, lines = server.make_server(dirs=[str(site["demo"])], port=0, host="127.0.0.2")
  except ValueError as error:
    pytest.skip(f"no 127.0.0.2 here: {error}")
  with _running(served):
    assert "token" not in lines[0]
    url = f"http://127.0.0.2:{served.effective_port}"
    assert _open(url + "/")[0] == 200
    assert _open(url + "/", headers={"Host": "attacker.example"})[0] == 403


def test_live_clarify_loads_its_question_model_once(monkeypatch):
  import types  # pylint: disable=import-outside-toplevel

  from jaxmoral.clarify import models  # pylint: disable=import-outside-toplevel
  from jaxmoral.explore import live  # pylint: disable=import-outside-toplevel
  loads = []
  model = types.SimpleNamespace(
      predict=lambda inputs, **k: types.SimpleNamespace(texts=[["Why?"]]))
  monkeypatch.setattr(models, "load_model", lambda d, **k: loads.append(d) or model)
  result = types.SimpleNamespace(row=lambda i: {"jsd": 0.25})
  monkeypatch.setattr(live, "_reward", lambda *a: types.SimpleNamespace(
      score_questions=lambda situations, questions: result))
  live._question_model.cache_clear()  # pylint: disable=protected-access
  for _ in range(3):
    row = live.clarify_question(situation="s", question="", question_dir="/q", answer_dir="/a",
                                fusion_dir="/a", judge_dir="/a", judge_classes=("a", "b", "c"))
  assert loads == ["/q"] and row == {"situation": "s", "question": "Why?", "jsd": 0.25}
  live._question_model.cache_clear()  # pylint: disable=protected-access


def test_a_ppo_runs_learning_curves_are_read_against_episodes(tmp_path):
  """The ClarifyDelphi curve view's extra charts: every recorded metric but the reward (which
  has its own chart), by episodes; a file with the reward only has none."""
  from jaxmoral.explore import sources  # pylint: disable=g-import-not-at-top
  path = tmp_path / "reward_curve.json"
  path.write_text(json.dumps({"iterations": [1, 2], "episodes": [64, 128],
                              "raw_reward_mean": [0.1, 0.2],
                              "metrics": {"raw_score_mean": [0.1, 0.2], "kl": [0.5, 1.5],
                                          "kl_coef": [0.15, 0.15]}}))
  assert sources.learning_curves(path) == {"kl": [(64.0, 0.5), (128.0, 1.5)],
                                           "kl_coef": [(64.0, 0.15), (128.0, 0.15)]}
  path.write_text(json.dumps({"iterations": [1], "raw_reward_mean": [0.1]}))
  assert sources.learning_curves(path) == {}


def test_the_app_caps_form_bodies_under_any_server(tmp_path):
  """Flask's own limit, for a server other than waitress: a form-encoded body is capped as a
  multipart one is, before its fields are read."""
  from jaxmoral.explore import server  # pylint: disable=import-outside-toplevel
  client = server.create_app(folders.Roots([tmp_path])).test_client()
  response = client.post("/live/npov", data={"response": "w" * (2 << 20)})
  assert response.status_code == 413 and b"www" not in response.data
