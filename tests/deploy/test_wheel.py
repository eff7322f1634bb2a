"""An installed wheel works (issue 46, item 5).

`pip wheel .` is built once from a copy of the checkout's files (so no build/ or egg-info lands in the
checkout and no stale build/lib leaks into the wheel), installed with `pip install --no-deps --target DIR`,
and run by this venv's interpreter with `-S`: no site processing, so the editable install's finder (which
maps `steerspec` and its subpackages onto the checkout) is not loaded, and PYTHONPATH is DIR then this
venv's site-packages for the dependencies only. The cwd is a temporary directory: the checkout is nowhere
on sys.path, which a probe in the installed interpreter checks before anything else runs.

Through that install: the wheel's file list (every package file of the checkout, the bundled models with
their policy_heads/ and sprinter/ folders, the eval sets, py.typed, the generated steerspec/v1 stubs, the
console script), `steerspec models`, `steerspec run` on the tiny bundled pair, and the three `serve`
commands as real processes on loopback with an SDK generation through the coordinator, each stopped by
SIGTERM. About 30-60 s on 2 cores; `-m "not slow"` skips it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("steerspec", "coordinator", "drafter_service", "verifier_service")
BUILD_FILES = ("pyproject.toml", "README.md", "LICENSE", "NOTICE")
TINY_MODELS = ("verifier", "pretrained", "distilled", "sd2")
PROMPT = "def fibonacci(n):"
NEW_TOKENS = 8


def _source_files() -> List[str]:
    """Paths (relative to ROOT) a build reads: tracked and untracked-not-ignored files of the packages
    and the build metadata; without git, the package trees less caches."""
    if (ROOT / ".git").exists() and shutil.which("git"):
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--",
                              *PACKAGES, *BUILD_FILES], cwd=ROOT, capture_output=True, timeout=60, check=True)
        names = [n for n in out.stdout.decode().split("\0") if n]
    else:
        names = list(BUILD_FILES)
        for package in PACKAGES:
            for path in (ROOT / package).rglob("*"):
                if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                    names.append(path.relative_to(ROOT).as_posix())
    return sorted(n for n in set(names) if (ROOT / n).is_file())  # a tracked file deleted in the tree: not read


@pytest.fixture(scope="module")
def sources() -> List[str]:
    pytest.importorskip("setuptools", minversion="77")
    if not (ROOT / "steerspec" / "assets" / "models" / "verifier" / "config.json").is_file():
        pytest.skip("the tiny bundled pair is not in this checkout")
    return _source_files()


@pytest.fixture(scope="module")
def wheel_file(tmp_path_factory, sources) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in sources:
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, src / name)
    out = tmp_path_factory.mktemp("wheelhouse")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "--disable-pip-version-check", "-q", "-w", str(out), str(src)],
                          cwd=str(out), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    wheels = list(out.glob("steerspec-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


class Installed:
    """The wheel installed in `target`, run by this interpreter with -S from `cwd`."""

    def __init__(self, target: Path, cwd: Path):
        self.target = target
        self.cwd = cwd
        deps = [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages")
                and Path(p).resolve() != ROOT]
        security = ("STEERSPEC_TLS_", "STEERSPEC_TOKEN", "STEERSPEC_AUTH_TOKENS", "STEERSPEC_INSECURE")
        env = {k: v for k, v in os.environ.items() if not k.startswith(security)}  # plaintext on loopback
        env.update(PYTHONPATH=os.pathsep.join([str(target), *deps]), PYTHONSAFEPATH="1", PYTHONNOUSERSITE="1",
                   PYTHONUNBUFFERED="1")
        for key, value in (("OMP_NUM_THREADS", "1"), ("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1")):
            env.setdefault(key, value)
        self.env = env

    def python(self, *args: str) -> List[str]:
        return [sys.executable, "-S", *args]

    def steerspec(self, *args: str) -> List[str]:
        return self.python("-m", "steerspec", *args)

    def run(self, cmd: List[str], timeout: float = 60.0) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, cwd=str(self.cwd), env=self.env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def installed(tmp_path_factory, wheel_file) -> Installed:
    target = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile",
                           "--disable-pip-version-check", "-q", "--target", str(target), str(wheel_file)],
                          cwd=str(target), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return Installed(target, tmp_path_factory.mktemp("cwd"))


@pytest.mark.slow
def test_the_wheel_carries_every_package_file_assets_and_stubs(wheel_file, sources):
    with zipfile.ZipFile(wheel_file) as zf:
        names = set(zf.namelist())
        info = {n.split("/", 1)[1]: zf.read(n).decode() for n in names
                if n.split("/", 1)[0].endswith(".dist-info") and n.endswith((".txt", "METADATA"))}
    packaged = {n for n in names if not n.split("/", 1)[0].endswith(".dist-info")}
    expected = {n for n in sources if n.split("/", 1)[0] in PACKAGES}
    assert sorted(expected - packaged) == [], "package files missing from the wheel"
    assert sorted(packaged - expected) == [], "files in the wheel that the checkout's packages lack"
    assert "steerspec/py.typed" in packaged
    for proto in ("common", "coordinator", "drafter", "verifier"):
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            assert f"steerspec/v1/{proto}{suffix}" in packaged
    models = ROOT / "steerspec" / "assets" / "models"
    for model in sorted(p for p in models.iterdir() if p.is_dir()):
        rel = f"steerspec/assets/models/{model.name}"
        assert f"{rel}/config.json" in packaged, model.name
        assert any(n.startswith(rel + "/") and n.endswith(".safetensors") for n in packaged), model.name
        for sub in ("policy_heads", "sprinter"):
            if (model / sub).is_dir():
                assert any(n.startswith(f"{rel}/{sub}/") and n.endswith(".safetensors") for n in packaged)
    for name in TINY_MODELS:
        assert f"steerspec/assets/models/{name}/tokenizer.json" in packaged, name
    for eval_set in ("indist", "fresh", "tests", "docs"):
        assert f"steerspec/assets/eval/{eval_set}.jsonl" in packaged
    assert not any(n.startswith(("tests/", "scripts/", "docs/", "deploy/", "proto/")) for n in names)
    assert re.search(r"^\[console_scripts\]\s*\nsteerspec = steerspec\.cli:main$", info["entry_points.txt"], re.M)
    assert set(info["top_level.txt"].split()) == set(PACKAGES)


PROBE = """
import importlib.metadata as md, json, sys
import steerspec, coordinator, drafter_service, verifier_service
import steerspec.v1.coordinator_pb2, steerspec.cli, coordinator.client
from steerspec.data import evalsets
from steerspec.models import checkpoints
dist = md.distribution("steerspec")
print(json.dumps({
    "files": [m.__file__ for m in (steerspec, coordinator, drafter_service, verifier_service,
                                   steerspec.v1.coordinator_pb2, steerspec.cli, coordinator.client)],
    "client": steerspec.Client.__module__, "assets": str(checkpoints.ASSETS_DIR), "eval": str(evalsets.assets_dir()),
    "path": sys.path, "meta_path": [repr(f) for f in sys.meta_path],
    "dist": str(dist.locate_file("")), "version": dist.version,
    "scripts": [(e.name, e.value) for e in dist.entry_points if e.group == "console_scripts"]}))
"""


@pytest.mark.slow
def test_the_installed_wheel_imports_from_its_own_directory(installed):
    proc = installed.run(installed.python("-c", PROBE))
    assert proc.returncode == 0, proc.stderr[-3000:]
    probe = json.loads(proc.stdout.strip().splitlines()[-1])
    target = str(installed.target)
    for path in probe["files"] + [probe["assets"], probe["eval"]]:
        assert path.startswith(target + os.sep), path
    # the checkout is on no entry, nor is any other copy of the packages (the venv's site-packages has only
    # the editable install's .pth and finder, which -S leaves unread)
    entries = [p for p in probe["path"] if p]  # "" (Python < 3.11, no PYTHONSAFEPATH): the empty temporary cwd
    assert str(ROOT) not in entries and entries[0] == target, probe["path"]
    for entry in entries[1:]:
        assert not any((Path(entry) / package).exists() for package in PACKAGES), entry
    assert not any("editable" in f.lower() for f in probe["meta_path"]), probe["meta_path"]
    assert Path(probe["dist"]).resolve() == installed.target.resolve()
    assert probe["scripts"] == [["steerspec", "steerspec.cli:main"]]
    assert probe["client"] == "coordinator.client"


@pytest.mark.slow
def test_models_lists_the_bundled_models(installed):
    script = installed.target / "bin" / "steerspec"  # the console script pip wrote from entry_points.txt
    assert script.is_file()
    proc = installed.run(installed.python(str(script), "models", "--json"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {row["name"]: row for row in json.loads(proc.stdout)}
    assert {"smollm2", "smollm2-sd2", "smollm2-pretrained", "smollm2-distilled", *TINY_MODELS} <= set(rows)
    for name in (*TINY_MODELS, "smollm2-sd2", "smollm2-pretrained", "smollm2-distilled"):
        path = Path(rows[name]["path"].split(" (")[0])  # smollm2-*: "DIR (+ embedding and head rows of smollm2)"
        assert path.is_relative_to(installed.target) and (path / "config.json").is_file(), rows[name]
    table = installed.run(installed.steerspec("models"), timeout=60)
    assert table.returncode == 0, table.stderr[-3000:]
    assert "bundled models" in table.stdout and "verifier" in table.stdout


@pytest.fixture(scope="module")
def run_text(installed) -> str:
    proc = installed.run(installed.steerspec("run", "--verifier", "verifier", "--drafter", "pretrained",
                                             "--max-new-tokens", str(NEW_TOKENS), "--threads", "1", PROMPT),
                         timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_run_generates_with_the_tiny_pair(run_text):
    lines = run_text.rstrip("\n").splitlines()
    assert re.search(rf"block_efficiency=\S+ .*\({NEW_TOKENS} tokens, .*speculative\)", lines[-1]), run_text
    assert "".join(lines[:-1]).strip(), run_text  # the generated text before the summary line


def _start(installed: Installed, name: str, *args: str) -> Tuple[subprocess.Popen, Path]:
    log = installed.cwd / f"{name}.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(installed.steerspec("serve", name, "--port", "0", "--grace-s", "1", *args),
                                cwd=str(installed.cwd), env=installed.env, stdout=fh, stderr=subprocess.STDOUT,
                                text=True)
    return proc, log


def _wait_serving(proc: subprocess.Popen, log: Path, timeout_s: float = 90.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        match = re.search(r"serving .*\bon (127\.0\.0\.1:\d+)", log.read_text())
        if match:
            return match.group(1)
        time.sleep(0.05)
    raise AssertionError(f"{log.stem} did not start (exit {proc.poll()}): {log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen, timeout_s: float = 20.0) -> Optional[int]:
    """SIGTERM, a bounded wait, SIGKILL when it does not exit; the exit status of the SIGTERM (None: killed)."""
    if proc.poll() is not None:
        return proc.returncode
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
        return None


CLIENT = """
import json, sys, steerspec
with steerspec.Client(sys.argv[1], retries=2) as client:
    summary = client.complete(sys.argv[2], max_new_tokens=int(sys.argv[3]), temperature=0.0, k=2, timeout=60)
print(json.dumps({"client": type(client).__module__, "sdk": steerspec.__file__, "text": summary.text,
                  "token_ids": summary.token_ids, "finish_reason": summary.finish_reason}))
"""


@pytest.mark.slow
def test_the_three_serve_commands_generate_through_the_sdk(installed, run_text):
    procs: Dict[str, Tuple[subprocess.Popen, Path]] = {}
    try:
        procs["verifier"] = _start(installed, "verifier", "--model", "verifier", "--threads", "1")
        procs["drafter"] = _start(installed, "drafter", "--model", "pretrained", "--threads", "1")
        verifier = _wait_serving(*procs["verifier"])
        drafter = _wait_serving(*procs["drafter"])
        procs["coordinator"] = _start(installed, "coordinator", "--verifier", verifier, "--drafter", drafter,
                                      "--tokenizer", "verifier")
        coordinator = _wait_serving(*procs["coordinator"])
        proc = installed.run(installed.python("-c", CLIENT, coordinator, PROMPT, str(NEW_TOKENS)), timeout=90)
        assert proc.returncode == 0, proc.stderr[-3000:]
        reply = json.loads(proc.stdout.strip().splitlines()[-1])
        assert reply["sdk"].startswith(str(installed.target) + os.sep), reply
        assert len(reply["token_ids"]) == NEW_TOKENS and reply["finish_reason"] == "length", reply
        # greedy and lossless both ways: the services' text is the verifier's, as `steerspec run` printed it
        assert reply["text"] and reply["text"] in run_text, (reply, run_text)
    finally:
        codes = {name: _stop(proc) for name, (proc, _) in reversed(list(procs.items()))}
    logs = {name: log.read_text()[-2000:] for name, (_, log) in procs.items()}
    assert codes == {"coordinator": 0, "drafter": 0, "verifier": 0}, (codes, logs)
