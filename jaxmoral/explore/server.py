"""The explorer's web app (Flask, served by waitress) and `serve`, what `jaxmoral explore` runs.

Flask is small and synchronous: its handlers call the library's blocking JAX functions
directly; waitress is a pure-Python WSGI server, so the explorer runs wherever jaxmoral does.
Pages are rendered on the server (Jinja2) with inline SVG charts; the one script and the style
sheet ship in the package. Nothing is fetched from the network.
"""

from __future__ import annotations

import collections
import importlib
import logging
import mimetypes
import pathlib
import socket
import traceback
from typing import Any, Callable, Optional, Sequence

import flask
import markupsafe
import werkzeug.exceptions

from jaxmoral import run_layout
from jaxmoral.explore import charts
from jaxmoral.explore import folders
from jaxmoral.explore import live
from jaxmoral.explore import security
from jaxmoral.explore import sources

logger = logging.getLogger(__name__)

# Files the browser may fetch from the folders: pictures, and the library's heatmap pages
# (shown in a sandboxed frame, scripts off).
_SERVED_TYPES = {".png": "image/png", ".svg": "image/svg+xml", ".html": "text/html",
                 ".txt": "text/plain", ".gin": "text/plain", ".md": "text/plain"}
VIEW_TITLES = {"npov": "NPOV", "clarify": "ClarifyDelphi", "diamante": "Diamante",
               "runs": "Runs", "experiments": "Experiments"}
_KIND_VIEW = {"npov": "npov", "npov_scores": "npov", "npov_results": "npov",
              "clarify_evaluation": "clarify", "clarify_chat": "clarify",
              "reward_curve": "clarify", "diamante_dialogues": "diamante",
              "diamante_metrics": "diamante", "diamante_chat": "diamante", "run": "runs",
              "experiment": "experiments", "model": "models"}


def _message(error: BaseException) -> str:
  """One line for the page: "STRERROR: PATH" for a file error; a short prefix of what the user
  typed; paths by their folder's label, never their place on disk."""
  if isinstance(error, OSError) and error.strerror and error.filename is not None:
    text = security.short(f"{error.strerror}: {error.filename}")
  else:
    text = security.short(str(error) or type(error).__name__, 4 * security.MAX_ECHO)
  shown = flask.current_app.config.get("EXPLORE_FOLDERS", ()) if flask.has_app_context() else ()
  return security.redact(text, shown)


def attempt(fn: Callable[[], Any]) -> dict[str, Any]:
  """{"value": fn()} or {"error": one-line message}: one part of a page that may fail."""
  try:
    return {"value": fn()}
  except folders.Forbidden:
    raise
  except Exception as error:  # pylint: disable=broad-except
    logger.info("explore: %s", "".join(traceback.format_exception_only(error)).strip())
    return {"error": _message(error)}


def create_app(roots: folders.Roots, *, guard: Optional[security.Guard] = None) -> flask.Flask:
  """The read-only app over `roots`, accepting what `guard` accepts (default: a loopback
  server's)."""
  guard = guard or security.Guard.for_bind("127.0.0.1")
  here = pathlib.Path(__file__).parent
  app = flask.Flask("jaxmoral.explore", template_folder=str(here / "templates"),
                    static_folder=str(here / "static"))
  # Flask limits multipart forms only; the body limit covers every encoding.
  shown_folders = [(str(f), roots.label(i)) for i, f in enumerate(roots.folders)]
  app.config.update(MAX_CONTENT_LENGTH=security.MAX_BODY_BYTES,
                    MAX_FORM_MEMORY_SIZE=security.MAX_BODY_BYTES,
                    MAX_FORM_PARTS=security.MAX_FIELDS, EXPLORE_FOLDERS=shown_folders)

  def finalize(value: Any) -> Any:
    # Every value a page shows: the folders by their labels, controls and bidi overrides
    # by name (a result file's U+202E must not reorder the page's text).
    if isinstance(value, pathlib.PurePath):
      value = str(value)
    if isinstance(value, str) and not isinstance(value, markupsafe.Markup):
      for path, label in shown_folders:
        value = value.replace(path, label)
      return security.visible(value)
    return value

  app.jinja_env.finalize = finalize
  app.jinja_env.globals.update(charts=charts, sources=sources, roots=roots,
                               VIEW_TITLES=VIEW_TITLES, markup=markupsafe.Markup,
                               token_field=security.TOKEN_FIELD, form_token=guard.token)
  app.jinja_env.filters["fmt"] = _fmt

  def arg_path() -> tuple[int, pathlib.Path]:
    root = flask.request.values.get("root", "0")
    return int(root), roots.resolve(root, flask.request.values.get("path", ""))

  def found_by_view() -> dict[str, list[folders.Found]]:
    grouped: dict[str, list[folders.Found]] = collections.defaultdict(list)
    found = [(_KIND_VIEW[item.kind], item) for item in folders.discover(roots)]
    for view, item in dict.fromkeys(  # One NPOV page per folder (score files, ROC results).
        (view, folders.Found("npov", item.root, item.path.rpartition("/")[0])
         if view == "npov" else item) for view, item in found):
      grouped[view].append(item)
    return grouped

  def model_choices() -> dict[str, Any]:
    """Each live box's models and the judge classes of the ClarifyDelphi box's default."""
    found = [(f"{m.root}:{m.path}", f"{roots.label(m.root)}/{m.path}",
              str(roots.resolve(m.root, m.path)))
             for m in found_by_view().get("models", [])]
    choices: dict[str, Any] = live.choices_for_jobs(found)
    first = (choices["clarify"] or [None])[0]
    classes = live.model_judge_classes(model_dir(first["value"])) if first else None
    choices["clarify_classes"] = ",".join(classes) if classes else ""
    return choices

  def required_model(value: Optional[str], what: str) -> str:
    if not value:
      raise ValueError(f"choose {what}")
    return str(model_dir(value))

  def model_dir(value: Optional[str]) -> Optional[str]:
    if not value:
      return None
    root, _, path = value.partition(":")
    return str(roots.resolve(root, path))

  render = flask.render_template

  def page(template: str, root: int, path: pathlib.Path, **context: Any) -> str:
    return render(template, root=root, path=roots.relative(root, path), **context)

  def message(title: str, text: str, status: int) -> tuple[str, int]:
    return render("message.html", title=title, message=text), status

  @app.before_request
  def check_request():
    request = flask.request
    headers = request.headers
    form_token = None
    if request.method == "POST":
      form = request.form  # Parsed within MAX_CONTENT_LENGTH (413 beyond).
      if sum(len(values) for _, values in form.lists()) > security.MAX_FIELDS:
        raise werkzeug.exceptions.RequestEntityTooLarge()
      form_token = form.get(security.TOKEN_FIELD)
    refusal = guard.refusal(
        method=request.method, host=request.host, url_root=request.host_url,
        origin=headers.get("Origin"), fetch_site=headers.get("Sec-Fetch-Site"),
        query_token=request.args.get(security.TOKEN_FIELD),
        cookie_token=request.cookies.get(security.cookie_name(request.host)),
        form_token=form_token)
    if refusal:
      raise folders.Forbidden(refusal)

  @app.after_request
  def headers(response):
    request = flask.request
    if guard.token_required and guard.matches(request.args.get(security.TOKEN_FIELD)):
      # The token from the printed URL, kept for the pages it links to (not sent by another
      # site's requests: SameSite=Strict).
      response.set_cookie(security.cookie_name(request.host), guard.token, httponly=True,
                          samesite="Strict")
    response.headers.setdefault("Content-Security-Policy", security.CONTENT_SECURITY_POLICY)
    response.headers.setdefault("X-Frame-Options", "DENY")
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Referrer-Policy"] = "no-referrer"
    return response

  @app.errorhandler(folders.Forbidden)
  def forbidden(error):
    return message("Forbidden", _message(error), 403)

  @app.errorhandler(413)
  def too_large(error):
    del error
    return message("Too large", f"a request may carry at most {security.MAX_BODY_BYTES >> 20} "
                   f"MB and {security.MAX_FIELDS} fields", 413)

  @app.errorhandler(404)
  def not_found(error):
    return message("Not found", str(error), 404)

  @app.errorhandler(Exception)
  def failed(error):
    if isinstance(error, werkzeug.exceptions.HTTPException):
      return error
    logger.exception("explore: %s failed", flask.request.path)
    return message("Error", _message(error), 500)

  @app.route("/favicon.ico")
  def favicon():
    return flask.Response(status=204)

  @app.route("/")
  def index():
    verdicts = [(index, attempt(lambda f=folder: sources.demo_verdicts(f / "summary.json")))
                for index, folder in enumerate(roots.folders)
                if folders.is_regular_inside(folder / "summary.json", folder)]
    return render("index.html", grouped=attempt(found_by_view), models=model_choices(),
                  verdicts=verdicts)

  @app.route("/file")
  def file():
    _, path = arg_path()
    kind = _SERVED_TYPES.get(path.suffix.lower())
    if kind is None:
      return message("Not shown", f"{path.name}: only pictures and text are served", 404)
    if not path.is_file():
      return message("Not found", f"no file {path.name}", 404)
    response = flask.send_file(path, mimetype=kind, conditional=True)
    response.headers["Content-Security-Policy"] = security.FILE_SECURITY_POLICY
    response.headers["X-Frame-Options"] = "SAMEORIGIN"  # The heatmap's frame.
    return response

  @app.route("/npov")
  def npov():
    root, folder = arg_path()
    data = attempt(lambda: sources.npov_folder(folder)) if any(
        folders.regular_files(folder, "scores*.jsonl")) else None
    rocs = [(roots.relative(root, p), attempt(lambda p=p: sources.npov_results(p)))
            for p in folders.regular_files(folder, "*.json")
            + folders.regular_files(folder, "*/results.json")
            if folders.classify_file(p) == "npov_results"]
    return page("npov.html", root, folder, data=data, rocs=rocs, models=model_choices())

  @app.route("/npov/example")
  def npov_example():
    root, folder = arg_path()
    data = sources.npov_folder(folder)
    wanted = flask.request.values.get("id", "")
    example = next((e for e in data["examples"] if e["id"] == wanted), None)
    if example is None:
      return message("Not found", f"no example {wanted!r} in {folder.name}", 404)
    from jaxmoral.npov import actions  # pylint: disable=import-outside-toplevel
    heatmap = folder / "heatmaps" / actions.heatmap_file_name(wanted)
    return page("npov_example.html", root, folder, example=example,
                detectors=data["detectors"], shading=sources.word_shading(example),
                heatmap=roots.relative(root, heatmap)
                if folders.is_regular_inside(heatmap, folder) else None)

  @app.route("/live/npov", methods=["POST"])
  def live_npov():
    form = flask.request.form
    result = attempt(lambda: live.npov_salience(
        base_dir=required_model(form.get("model"), "a base model"), query=form.get("query", ""),
        pro=form.get("pro", ""), con=form.get("con", ""), response=form.get("response", ""),
        generator_dir=model_dir(form.get("generator"))))
    shading = sources.detection_shading(result["value"]) if result.get("value") else None
    return render("live_npov.html", form=form, result=result, models=model_choices(),
                  shading=shading)

  @app.route("/clarify")
  def clarify():
    root, path = arg_path()
    kind = folders.classify_file(path) if path.is_file() else None
    if kind == "clarify_chat":
      return page("clarify_chat.html", root, path,
                  chat=attempt(lambda: sources.clarify_chat(path)))
    if kind == "reward_curve":
      return page("clarify_curve.html", root, path,
                  curve=attempt(lambda: sources.reward_curve(path)),
                  curves=attempt(lambda: sources.learning_curves(path)))
    return page("clarify.html", root, path, selected=flask.request.values.get("i"),
                data=attempt(lambda: sources.clarify_evaluation(path)))

  @app.route("/live/clarify", methods=["POST"])
  def live_clarify():
    form = flask.request.form

    def ask():
      model = required_model(form.get("model"), "the answer, fusion and judge model")
      return live.clarify_question(
          situation=form.get("situation", ""), question=form.get("question", ""),
          question_dir=model_dir(form.get("question_model")), answer_dir=model,
          fusion_dir=model, judge_dir=model, nli_dir=model_dir(form.get("nli_model")),
          judge_classes=live.parse_classes(form.get("judge_classes", "")))
    result = attempt(ask)
    return render("live_clarify.html", form=form, result=result, models=model_choices())

  @app.route("/diamante", methods=["GET", "POST"])
  def diamante():
    root, path = arg_path()
    kind = folders.classify_file(path) if path.is_file() else None
    if kind == "diamante_metrics":
      return page("diamante_metrics.html", root, path,
                  metrics=attempt(lambda: sources.diamante_metrics(path)),
                  rankings=attempt(lambda: sources.diamante_rankings(path)),
                  samples=attempt(lambda: sources.diamante_samples(path)))
    if kind == "diamante_chat":
      return page("diamante_chat.html", root, path, chat=attempt(lambda: sources.read_jsonl(path)))
    contexts = attempt(lambda: sources.diamante_dialogues(path))
    # A model runs on a POST only (the form's, with its token): a GET, which any page can
    # send from an <img>, never starts a computation.
    chosen = flask.request.values.get("model") if flask.request.method == "POST" else None
    evaluation_files = [p for p in folders.regular_files(path.parent, "*.json")
                        if folders.classify_file(p) == "diamante_metrics"]
    evaluations = [(roots.relative(root, p), attempt(lambda p=p: sources.diamante_metrics(p)))
                   for p in evaluation_files]

    def rank_all():
      # The contexts as evaluation ranks them (`diamante.evaluate.ranking_items`: the human
      # response first, candidates equal to it dropped), without random responses.
      from jaxmoral.diamante import data  # pylint: disable=import-outside-toplevel
      from jaxmoral.diamante import evaluate  # pylint: disable=import-outside-toplevel
      turns = data.read_dialogues(path)[:len(contexts["value"])]
      items = evaluate.ranking_items(turns, num_random=0, max_candidates=10, seed=0)
      limit = min(max(flask.request.values.get("max", 20, type=int), 0), 200)
      return {index: live.diamante_rank(model_dir=model_dir(chosen),
                                        context=turns[index].context, responses=responses)
              for index, responses, _ in items[:limit]}

    def stored():
      # Without a model: the rankings an evaluation beside the file wrote, for the contexts
      # it ranked (matched by their utterances, so another test file's evaluation shows none).
      shown = {c["index"]: c["context"] for c in contexts["value"]}
      return {entry["turn"]: entry["ranking"] for p in evaluation_files
              for entry in sources.diamante_rankings(p)
              if shown.get(entry["turn"]) == entry["context"]}
    rankings = attempt(rank_all if chosen else stored) if "value" in contexts else {}
    return page("diamante.html", root, path, contexts=contexts, rankings=rankings,
                chosen=chosen, models=model_choices(), evaluations=evaluations)

  @app.route("/live/diamante", methods=["POST"])
  def live_diamante():
    form = flask.request.form
    result = attempt(lambda: live.diamante_rank(
        model_dir=required_model(form.get("model"), "a Diamante model"),
        context=form.get("context", "").splitlines(),
        responses=form.get("responses", "").splitlines()))
    return render("live_diamante.html", form=form, result=result, models=model_choices())

  @app.route("/runs")
  def runs():
    root, path = arg_path()
    config = path / run_layout.CONFIG_FILE
    return page(
        "runs.html", root, path, scalars=attempt(lambda: sources.run_scalars(path)),
        config=attempt(lambda: config.read_text(encoding="utf-8"))
        if folders.is_regular_inside(config, path) else None,
        software=attempt(lambda: sources.run_software(path)),
        checkpoints=attempt(lambda: sources.run_checkpoints(path)))

  @app.route("/experiments")
  def experiments():
    root, path = arg_path()
    return page("experiments.html", root, path, result=attempt(lambda: sources.experiment(path)),
                folder=roots.relative(root, path.parent))

  return app


def _fmt(value: Any, digits: int = 4) -> str:
  if value is None:
    return "—"
  if isinstance(value, bool):
    return str(value).lower()
  return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


# Every module a page or a live form imports (NLTK, JAX, Orbax, TensorFlow, TensorBoard's
# protos), imported before the server accepts a request. Importing them while requests are
# served is unsafe, not just slow: some libraries (TFDS through etils) swap
# `builtins.__import__` for the whole process while they load, and a request thread importing
# anything meanwhile (werkzeug does, inside `send_file`) fails with a 500.
_SERVED_MODULES = ("jaxmoral.npov.detectors.rouge", "jaxmoral.npov.task", "jaxmoral.npov.detect",
                   "jaxmoral.npov.actions", "jaxmoral.metrics", "jaxmoral.metric_writers",
                   "jaxmoral.run_dirs", "jaxmoral.software", "jaxmoral.rl.ppo_trainer",
                   "jaxmoral.clarify.reward", "jaxmoral.clarify.formats",
                   "jaxmoral.clarify.models", "jaxmoral.diamante.data",
                   "jaxmoral.diamante.evaluate", "jaxmoral.diamante.bundle",
                   "jaxmoral.diamante.inference")


def make_server(*, dirs: Sequence[str], port: int = 8765, host: str = "127.0.0.1",
                allowed_hosts: Sequence[str] = ()) -> tuple[Any, list[str]]:
  """The waitress server over `dirs`, bound (not yet serving), and the lines to print (`serve`
  says more)."""
  import waitress  # pylint: disable=import-outside-toplevel
  roots = folders.Roots(dirs)
  guard = security.Guard.for_bind(host, allowed_hosts)
  app = create_app(roots, guard=guard)
  mimetypes.add_type("image/svg+xml", ".svg")
  try:
    server = waitress.create_server(app, host=host, port=port, threads=4,
                                    max_request_body_size=security.MAX_BODY_BYTES)
  except OSError as error:
    raise ValueError(f"cannot listen on {host}:{port} ({error.strerror}); "
                     f"choose another --port") from None
  shown = ", ".join(str(f) for f in roots.folders)
  port = server.effective_port
  name = socket.gethostname() if host in security.WILDCARD_ADDRESSES else host
  name = f"[{name}]" if ":" in name else name
  if not guard.token_required:
    return server, [f"jaxmoral explore: http://{name}:{port}/ ({shown}; read-only; "
                    "Ctrl-C stops)"]
  return server, [
      f"jaxmoral explore: WARNING: listening on {host or '*'}:{port}, not on this machine "
      "only: whoever can reach this port and has the token below can read these folders and "
      "run their models. Keep the URL private; serve on 127.0.0.1 (the default) and forward "
      "the port (ssh -L) to avoid this.",
      f"jaxmoral explore: answers to the host names {', '.join(sorted(guard.allowed_hosts))}"
      " (add one with --allowed_host=NAME)",
      f"jaxmoral explore: http://{name}:{port}/?{security.TOKEN_FIELD}={guard.token} "
      f"({shown}; read-only; Ctrl-C stops)"]


def serve(*, dirs: Sequence[str], port: int = 8765, host: str = "127.0.0.1",
          allowed_hosts: Sequence[str] = ()) -> int:
  """Serves the explorer until interrupted (Ctrl-C); returns 0.

  Args:
    port: The port (0: any free one).
    host: The address it listens on. Anything but a loopback address requires the token
      it prints in its URL.
    allowed_hosts: Host names it answers to besides the loopback names and `host`.

  Raises:
    ValueError: A folder is missing, or the port is taken.
  """
  server, lines = make_server(dirs=dirs, port=port, host=host, allowed_hosts=allowed_hosts)
  # The port is bound: a browser that connects now waits in the listen queue.
  for module in _SERVED_MODULES:
    try:
      importlib.import_module(module)
    except Exception:  # pylint: disable=broad-except  (the page that needs it will say why)
      logger.debug("explore: importing %s failed", module, exc_info=True)
  for line in lines:
    print(line, flush=True)
  try:
    server.run()
  except KeyboardInterrupt:
    pass
  finally:
    server.close()
  return 0
