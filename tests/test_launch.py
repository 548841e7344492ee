"""launch/: the scripts that start runs, against stand-ins for `jaxmoral`, `gcloud` and `python3`.

Each stand-in is a small executable that records what it was given (argv, the launcher's
variables, the commit it ran at) as one JSON line, so a test reads exactly what a worker would
have run. The TPU pod script runs against a real git origin (a bare repository in tmp_path)
and a fake `gcloud` that executes the ssh command in a per-node home folder.
"""

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import git

ROOT = pathlib.Path(__file__).resolve().parents[1]
QUOTED = "--gin.MODEL_DIR='/gcs/bucket/run 1'"  # quotes and a space must reach jaxmoral intact

# A stand-in `jaxmoral`: one JSON line per call to $STUB_LOG; STUB_BEHAVIOUR_<process id> may
# make a process fail ("fail") or wait to be stopped ("wait"), writing its pid to $STUB_LOG.pids.
_RECORDING_JAXMORAL = textwrap.dedent(f"""\
    #!{sys.executable}
    import json, os, subprocess, sys, time
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    env = {{k: v for k, v in os.environ.items() if k.startswith(("JAX_", "XLA_"))}}
    with open(os.environ["STUB_LOG"], "a") as f:
      f.write(json.dumps({{"argv": sys.argv[1:], "env": env, "head": head.strip()}}) + "\\n")
    print("hello from", os.environ.get("JAX_PROCESS_ID", "-"), flush=True)
    behaviour = os.environ.get("STUB_BEHAVIOUR_" + os.environ.get("JAX_PROCESS_ID", "0"), "")
    if behaviour:
      with open(os.environ["STUB_LOG"] + ".pids", "a") as f:
        f.write(f"{{os.getpid()}}\\n")
    if behaviour == "fail":
      time.sleep(0.5)
      sys.exit(3)
    import signal
    if behaviour == "ignore_term":  # as a process whose peer died: it never gets to exit
      signal.signal(signal.SIGTERM, signal.SIG_IGN)
    def save_and_exit(*_):  # as jaxmoral on a preemption notice: save, then stop
      time.sleep(1.5)
      print("saved", flush=True)
      open(os.environ["STUB_LOG"] + ".saved" + os.environ["JAX_PROCESS_ID"], "w").close()
      sys.exit(0)
    if behaviour == "save_on_term":
      signal.signal(signal.SIGTERM, save_and_exit)
    if behaviour in ("wait", "ignore_term", "save_on_term"):
      time.sleep(120)
      open(os.environ["STUB_LOG"] + ".not_stopped", "w").close()
    """)


def _executable(path: pathlib.Path, text: str) -> pathlib.Path:
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(text)
  path.chmod(0o755)
  return path


def _calls(log: pathlib.Path) -> list[dict]:
  return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  # A zombie (stopped, not yet reaped by its parent) is not running.
  status = pathlib.Path(f"/proc/{pid}/status")
  return not (status.exists() and "\nState:\tZ" in status.read_text())


def _dead(pids: list[int], seconds: float = 10.0) -> bool:
  """Whether every pid has stopped running within `seconds` (a kill is not instantaneous)."""
  deadline = time.monotonic() + seconds
  while any(_alive(pid) for pid in pids):
    if time.monotonic() > deadline:
      return False
    time.sleep(0.05)
  return True


def _pids(log: pathlib.Path) -> list[int]:
  path = pathlib.Path(str(log) + ".pids")
  return [int(p) for p in path.read_text().split()] if path.exists() else []


# --- local.sh -------------------------------------------------------------------------------


@pytest.fixture
def local_env(tmp_path):
  log = tmp_path / "calls.jsonl"
  stub = _executable(tmp_path / "bin" / "jaxmoral", _RECORDING_JAXMORAL)
  env = {**os.environ, "JAXMORAL": str(stub), "STUB_LOG": str(log),
         "JAXMORAL_COORDINATOR_PORT": "23456"}
  env.pop("XLA_FLAGS", None)
  return env, log


def test_local_processes_get_their_ids_and_prefixed_output(local_env):
  env, log = local_env
  result = subprocess.run([ROOT / "launch/local.sh", "-n", "2", "--", "train", QUOTED],
                          env=env, capture_output=True, text=True, timeout=60)
  assert result.returncode == 0, result.stderr
  calls = sorted(_calls(log), key=lambda c: c["env"]["JAX_PROCESS_ID"])
  assert [c["argv"] for c in calls] == [["train", QUOTED]] * 2
  assert [(c["env"]["JAX_PROCESS_ID"], c["env"]["JAX_NUM_PROCESSES"],
           c["env"]["JAX_COORDINATOR_ADDRESS"]) for c in calls] == [
               ("0", "2", "127.0.0.1:23456"), ("1", "2", "127.0.0.1:23456")]
  assert sorted(result.stdout.splitlines()) == ["[process 0] hello from 0",
                                                "[process 1] hello from 1"]


def test_one_local_process_runs_in_place_with_its_devices(local_env):
  env, log = local_env
  result = subprocess.run([ROOT / "launch/local.sh", "-d", "4", "--", "eval", QUOTED],
                          env=env, capture_output=True, text=True, timeout=60)
  assert result.returncode == 0, result.stderr
  (call,) = _calls(log)
  assert call["argv"] == ["eval", QUOTED] and "JAX_PROCESS_ID" not in call["env"]
  assert "--xla_force_host_platform_device_count=4" in call["env"]["XLA_FLAGS"]
  assert result.stdout == "hello from -\n"  # no prefix, no process of its own


def test_a_failed_local_process_stops_the_others(local_env):
  # Before: the launcher waited for process 0, which (in a real run) waits on the coordinator
  # for ever once process 1 is gone.
  env, log = local_env
  env.update(STUB_BEHAVIOUR_0="wait", STUB_BEHAVIOUR_1="fail")
  start = time.monotonic()
  result = subprocess.run([ROOT / "launch/local.sh", "-n", "2", "--", "train"],
                          env=env, capture_output=True, text=True, timeout=100)
  assert result.returncode == 3
  assert time.monotonic() - start < 60
  assert "a process exited with status 3; stopping the others" in result.stderr
  assert "Terminated" not in result.stderr  # no job-control chatter
  assert len(_pids(log)) == 2 and _dead(_pids(log))
  assert not pathlib.Path(str(log) + ".not_stopped").exists()


def test_a_process_that_ignores_sigterm_is_killed_after_the_grace_period(local_env):
  env, log = local_env
  env.update(STUB_BEHAVIOUR_0="ignore_term", STUB_BEHAVIOUR_1="fail",
             JAXMORAL_STOP_GRACE_SECONDS="1")
  result = subprocess.run([ROOT / "launch/local.sh", "-n", "2", "--", "train"],
                          env=env, capture_output=True, text=True, timeout=100)
  assert result.returncode == 3
  assert len(_pids(log)) == 2 and _dead(_pids(log))


def test_stopping_the_local_launcher_lets_every_process_save_first(local_env):
  # SIGTERM is jaxmoral's preemption notice: each process saves before it exits, and its
  # last lines still come through the launcher.
  env, log = local_env
  env.update(STUB_BEHAVIOUR_0="save_on_term", STUB_BEHAVIOUR_1="save_on_term")
  launcher = subprocess.Popen([ROOT / "launch/local.sh", "-n", "2", "--", "train"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  deadline = time.monotonic() + 60
  while len(_pids(log)) < 2 and time.monotonic() < deadline:
    time.sleep(0.1)
  assert len(_pids(log)) == 2
  launcher.send_signal(signal.SIGTERM)
  out, _ = launcher.communicate(timeout=60)
  assert launcher.returncode == 143  # 128 + SIGTERM, as a shell reports it
  assert "[process 0] saved" in out.splitlines() and "[process 1] saved" in out.splitlines()
  assert all(pathlib.Path(f"{log}.saved{i}").exists() for i in (0, 1))
  assert _dead(_pids(log))


# --- gpu.sh ---------------------------------------------------------------------------------


@pytest.fixture
def gpu_root(tmp_path):
  root = tmp_path / "checkout"
  shutil.copy(ROOT / "launch/gpu.sh", _executable(root / "launch/gpu.sh", ""))
  return root


def test_gpu_launch_sets_xla_defaults_unless_the_caller_chose(gpu_root, tmp_path):
  log = tmp_path / "calls.jsonl"
  _executable(gpu_root / ".venv/bin/jaxmoral", _RECORDING_JAXMORAL)
  env = {**os.environ, "STUB_LOG": str(log)}
  env.pop("XLA_FLAGS", None)
  env.pop("XLA_PYTHON_CLIENT_MEM_FRACTION", None)
  script = gpu_root / "launch/gpu.sh"
  assert subprocess.run([script, "--", "train", QUOTED], env=env, timeout=60).returncode == 0
  env["XLA_FLAGS"] = "--xla_gpu_enable_latency_hiding_scheduler=false"
  env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = "0.5"
  assert subprocess.run([script, "train"], env=env, timeout=60).returncode == 0
  first, second = _calls(log)
  assert first["argv"] == ["train", QUOTED]
  assert first["env"]["XLA_FLAGS"].split() == ["--xla_gpu_enable_latency_hiding_scheduler=true"]
  assert first["env"]["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.92"
  assert second["env"]["XLA_FLAGS"] == "--xla_gpu_enable_latency_hiding_scheduler=false"
  assert second["env"]["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.5"


def test_gpu_launch_without_an_install_says_how(gpu_root):
  result = subprocess.run([gpu_root / "launch/gpu.sh", "--", "train"], capture_output=True,
                          text=True, timeout=60)
  assert result.returncode == 2
  assert result.stderr.strip().endswith("run " + str(gpu_root / "launch/gpu.sh")
                                        + " --install -- COMMAND once")


# --- tpu_pod.sh -----------------------------------------------------------------------------

class Pod:
  """A git origin, a developer's checkout holding launch/tpu_pod.sh, and stand-ins for the
  pod: `gcloud` runs the ssh command in workers/<node> (one home per node), `python3 -m venv`
  makes a venv whose pip logs its calls and whose jaxmoral records them."""

  def __init__(self, tmp_path: pathlib.Path):
    self.tmp = tmp_path
    self.log = tmp_path / "calls.jsonl"
    self.origin = tmp_path / "origin.git"
    git(tmp_path, "init", "-q", "--bare", str(self.origin))
    self.dev = tmp_path / "dev"
    git(tmp_path, "clone", "-q", str(self.origin), str(self.dev))
    shutil.copy(ROOT / "launch/tpu_pod.sh", _executable(self.dev / "launch/tpu_pod.sh", ""))
    (self.dev / "setup.cfg").write_text("[metadata]\nname = jaxmoral\n")
    (self.dev / ".gitignore").write_text(".venv\n")
    self.commit("first", push=True)
    bin_dir = tmp_path / "fakebin"
    recorder = _executable(tmp_path / "recording_jaxmoral", _RECORDING_JAXMORAL)
    _executable(bin_dir / "gcloud", textwrap.dedent(f"""\
        #!{sys.executable}
        import json, os, pathlib, subprocess, sys
        args = sys.argv[1:]
        with open({str(tmp_path / "gcloud.jsonl")!r}, "a") as f:
          f.write(json.dumps(args) + "\\n")
        node = args[args.index("ssh") + 1]
        command = next(a.split("=", 1)[1] for a in args if a.startswith("--command="))
        home = pathlib.Path({str(tmp_path / "workers")!r}) / node
        home.mkdir(parents=True, exist_ok=True)
        sys.exit(subprocess.run(["bash", "-c", command], cwd=home).returncode)
        """))
    _executable(bin_dir / "python3", textwrap.dedent(f"""\
        #!/usr/bin/env bash
        [ "$1 $2" = "-m venv" ] || exit 97
        mkdir -p "$3/bin"
        printf '#!/usr/bin/env bash\\necho "$*" >> {tmp_path / "pip.log"}\\n' > "$3/bin/pip"
        cp {recorder} "$3/bin/jaxmoral"
        chmod +x "$3/bin/pip" "$3/bin/jaxmoral"
        """))
    self.env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
                "STUB_LOG": str(self.log)}
    for name in ("JAXMORAL_COMMIT", "JAXMORAL_REPO_URL"):
      self.env.pop(name, None)

  def commit(self, message: str, push: bool) -> str:
    git(self.dev, "add", "-A")
    git(self.dev, "commit", "-q", "-m", message)
    if push:
      git(self.dev, "push", "-q", "origin", "main")
    return git(self.dev, "rev-parse", "HEAD")

  def launch(self, *flags: str, command=("train", QUOTED)) -> subprocess.CompletedProcess:
    return subprocess.run([self.dev / "launch/tpu_pod.sh", "--tpu=pod", "--zone=z", *flags,
                           "--", *command], env=self.env, capture_output=True, text=True,
                          timeout=120)

  def gcloud_calls(self) -> list[list[str]]:
    path = self.tmp / "gcloud.jsonl"
    return [json.loads(l) for l in path.read_text().splitlines()] if path.exists() else []

  def pip_calls(self) -> list[str]:
    path = self.tmp / "pip.log"
    return path.read_text().splitlines() if path.exists() else []


def test_pod_workers_run_the_pushed_commit_and_install_once_per_metadata(tmp_path):
  pod = Pod(tmp_path)
  head = git(pod.dev, "rev-parse", "HEAD")
  result = pod.launch()
  assert result.returncode == 0, result.stderr
  (gcloud,) = pod.gcloud_calls()
  assert gcloud[:5] == ["compute", "tpus", "tpu-vm", "ssh", "pod"]
  assert "--zone=z" in gcloud and "--worker=all" in gcloud
  (call,) = _calls(pod.log)
  assert call["argv"] == ["train", QUOTED] and call["head"] == head
  assert pod.pip_calls() == ["install -q -U pip", "install -q -e .[tpu]"]

  # Same metadata: no second install. New metadata (a dependency added): installed again.
  assert pod.launch().returncode == 0
  assert len(pod.pip_calls()) == 2
  (pod.dev / "setup.cfg").write_text("[metadata]\nname = jaxmoral\n[options]\nx = 1\n")
  new_head = pod.commit("a dependency", push=True)
  assert pod.launch().returncode == 0
  assert len(pod.pip_calls()) == 4 and _calls(pod.log)[-1]["head"] == new_head


def test_pod_launch_refuses_a_commit_that_is_not_on_origin(tmp_path):
  pod = Pod(tmp_path)
  (pod.dev / "notes.txt").write_text("local only\n")
  head = pod.commit("local", push=False)
  result = pod.launch()
  assert result.returncode == 2
  assert (f"commit {head} is on no branch of origin: push it, or set JAXMORAL_COMMIT"
          in result.stderr)
  assert pod.gcloud_calls() == []


def test_pod_workers_stop_when_they_cannot_fetch(tmp_path):
  # Before: `git fetch && git checkout` under set -e went on after a failed fetch and ran the
  # command at whatever commit the worker had.
  pod = Pod(tmp_path)
  assert pod.launch().returncode == 0
  (pod.dev / "notes.txt").write_text("second\n")
  pod.commit("second", push=True)
  pod.origin.rename(tmp_path / "origin_unreachable.git")
  assert pod.launch().returncode != 0
  assert len(_calls(pod.log)) == 1  # only the first launch ran jaxmoral


def test_pod_slices(tmp_path):
  pod = Pod(tmp_path)
  result = pod.launch("--slices=2")
  assert result.returncode == 2 and "--slices=2 needs --queued" in result.stderr
  assert pod.launch("--queued", "--slices=2").returncode == 0
  assert sorted(call[4] for call in pod.gcloud_calls()) == ["pod-0", "pod-1"]
  assert [c["argv"] for c in _calls(pod.log)] == [["train", QUOTED]] * 2
  result = pod.launch(command=())
  assert result.returncode == 2 and "no command after --" in result.stderr
