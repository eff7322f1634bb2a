"""The README's multi-host recipe, executed as written: the verifier "host" on 127.0.0.2, the edge on 127.0.0.3.

The commands are read from the README's `<!-- recipe: ... -->` blocks (so they cannot drift), run as separate
`steerspec serve` processes with TLS and bearer tokens, and the SDK's greedy output is checked against the
verifier alone; then the same recipe with a coordinator tokenizer and a drafter of another vocabulary (same
size, two ids swapped), each refused with a message naming both models and the fix.
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
from pathlib import Path
from typing import Dict, List

import pytest

from coord_helpers import greedy_reference, service_env
from pki_helpers import _issue, _write

ROOT = Path(__file__).resolve().parents[2]
VERIFIER_HOST, EDGE_HOST = "127.0.0.2", "127.0.0.3"
TOKEN = "recipe-token"
PROMPT = "def fibonacci(n):\n"


def recipe_blocks(readme: Path = ROOT / "README.md") -> Dict[str, List[str]]:
    """{'verifier host': [command, ...], 'edge host': [...]}: each block's commands, continuations joined."""
    text = readme.read_text(encoding="utf-8")
    blocks: Dict[str, List[str]] = {}
    for name, body in re.findall(r"<!-- recipe: ([\w ]+) -->\s*```bash\n(.*?)```", text, flags=re.S):
        commands, current = [], ""
        for line in body.splitlines():
            current += line.rstrip().rstrip("\\") + " " if line.rstrip().endswith("\\") else line.strip()
            if not line.rstrip().endswith("\\"):
                if current.strip():
                    commands.append(re.sub(r"\s+", " ", current.strip()).removesuffix("&").strip())
                current = ""
        blocks[name] = commands
    return blocks


def make_certs(root: Path) -> None:
    """certs/ as the recipe expects: a CA, one certificate per host for its address, the tokens."""
    import ipaddress

    from cryptography import x509

    certs = root / "certs"
    certs.mkdir(parents=True)
    ca_key, ca_cert = _issue("recipe-ca", None, None, ca=True)
    _write(certs / "ca", ca_key, ca_cert)
    for name, host in (("verifier", VERIFIER_HOST), ("edge", EDGE_HOST)):
        _write(certs / name, *_issue(name, ca_key, ca_cert.subject,
                                      san=[x509.IPAddress(ipaddress.ip_address(host))]))
    (certs / "tokens").write_text(f"{TOKEN}\n")
    (certs / "token").write_text(f"{TOKEN}\n")


class Recipe:
    """The recipe's processes in one working directory; stopped (SIGTERM, then SIGKILL) on close."""

    def __init__(self, cwd: Path, verifier_model: str, drafter_model: str) -> None:
        self.cwd = cwd
        env = service_env()
        env.update(VERIFIER_HOST=VERIFIER_HOST, EDGE_HOST=EDGE_HOST, VERIFIER_MODEL=verifier_model,
                   DRAFTER_MODEL=drafter_model, PATH=f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}")
        for key in [k for k in env if k.startswith(("STEERSPEC_TLS", "STEERSPEC_TOKEN", "STEERSPEC_AUTH"))]:
            del env[key]
        self.env = env
        self.procs: List[subprocess.Popen] = []

    def start(self, command: str, extra: str = "") -> tuple:
        """Start one command as written (plus `extra` flags); (process, log path)."""
        log = self.cwd / f"service-{len(self.procs)}.log"
        proc = subprocess.Popen(["bash", "-c", f"exec {command} {extra}"], cwd=self.cwd, env=self.env,
                                stdout=open(log, "w"), stderr=subprocess.STDOUT, text=True)
        self.procs.append(proc)
        return proc, log

    def wait_serving(self, proc, log: Path, timeout_s: float = 180.0) -> str:
        """The address the service printed once serving; raises with its log when it exits first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            match = re.search(r"serving .*?on (127\.0\.0\.\d+:\d+)", log.read_text())
            if match:
                return match.group(1)
            if proc.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"not serving (exit {proc.poll()}): {log.read_text()[-3000:]}")

    def wait_exit(self, proc, timeout_s: float = 120.0) -> int:
        return proc.wait(timeout=timeout_s)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def permuted_copy(src: Path, dst: Path, weights: bool) -> Path:
    """A copy of a checkpoint whose tokenizer has two vocabulary ids swapped: same size, other content."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and (weights or not f.name.endswith(".safetensors")):
            shutil.copy(f, dst / f.name)
    data = json.loads((dst / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    keys = [k for k, v in sorted(vocab.items(), key=lambda kv: kv[1])][300:302]
    vocab[keys[0]], vocab[keys[1]] = vocab[keys[1]], vocab[keys[0]]
    (dst / "tokenizer.json").write_text(json.dumps(data))
    return dst


@pytest.fixture
def recipe_dir(tmp_path) -> Path:
    make_certs(tmp_path)
    return tmp_path


def sdk_greedy(target: str, cwd: Path, n: int):
    from steerspec import Client

    with Client(target, tls_ca=str(cwd / "certs" / "ca.pem"), token=TOKEN, retries=2) as client:
        return client.complete(PROMPT, max_new_tokens=n, temperature=0.0, timeout=120)


def run_recipe(recipe_dir: Path, verifier: str, drafter: str, n: int):
    """Start the recipe's three services as written, one generation through the SDK -> its Summary."""
    blocks = recipe_blocks()
    recipe = Recipe(recipe_dir, verifier, drafter)
    try:
        (v_cmd,), (d_cmd, c_cmd) = blocks["verifier host"], blocks["edge host"]
        recipe.wait_serving(*recipe.start(v_cmd))
        recipe.wait_serving(*recipe.start(d_cmd))
        target = recipe.wait_serving(*recipe.start(c_cmd))
        assert target == f"{EDGE_HOST}:50051"
        return sdk_greedy(target, recipe_dir, n)
    finally:
        recipe.close()


def test_the_readme_recipe_has_the_three_services_and_no_tokenizer_flag():
    blocks = recipe_blocks()
    assert [c.split()[:3] for c in blocks["verifier host"]] == [["steerspec", "serve", "verifier"]]
    assert [c.split()[:3] for c in blocks["edge host"]] == [["steerspec", "serve", "drafter"],
                                                             ["steerspec", "serve", "coordinator"]]
    everything = " ".join(blocks["verifier host"] + blocks["edge host"])
    assert "--tokenizer" not in everything and "--host" in everything and "--tls-cert" in everything
    assert "--token-file" in everything and "--auth-tokens" in everything


@pytest.mark.slow
def test_recipe_on_the_tiny_pair_gives_the_verifiers_greedy_output(recipe_dir):
    from steerspec.models import load_tokenizer, resolve_model_dir

    summary = run_recipe(recipe_dir, "verifier", "pretrained", 24)
    prompt_ids = load_tokenizer("verifier")(PROMPT, add_special_tokens=False)["input_ids"]
    reference = greedy_reference(resolve_model_dir("verifier"), prompt_ids, 24)
    assert list(summary.token_ids) == reference[:len(summary.token_ids)] and summary.token_ids
    assert summary.drafted > 0  # speculative: the edge drafter drafted


@pytest.mark.slow
def test_recipe_refuses_a_coordinator_tokenizer_of_another_vocabulary(recipe_dir):
    from steerspec.models import resolve_model_dir

    permuted = permuted_copy(resolve_model_dir("verifier"), recipe_dir / "permuted-tokenizer", weights=False)
    blocks = recipe_blocks()
    recipe = Recipe(recipe_dir, "verifier", "pretrained")
    try:
        recipe.wait_serving(*recipe.start(blocks["verifier host"][0]))
        proc, log = recipe.start(blocks["edge host"][1], f"--tokenizer {permuted}")
        assert recipe.wait_exit(proc) == 2
        lines = [line for line in log.read_text().splitlines() if line.strip()]
        assert len(lines) == 1, lines
        line = lines[0]
        assert line.startswith("steerspec: error: the coordinator's model") and "'verifier'" in line
        assert str(permuted) in line and "tokenizer" in line and "Drop --tokenizer" in line
        assert "vocab 4096" in line  # same size: only the content tells them apart
    finally:
        recipe.close()


@pytest.mark.slow
def test_recipe_refuses_a_drafter_of_another_vocabulary(recipe_dir):
    from steerspec.models import resolve_model_dir

    permuted = permuted_copy(resolve_model_dir("pretrained"), recipe_dir / "permuted-drafter", weights=True)
    blocks = recipe_blocks()
    recipe = Recipe(recipe_dir, "verifier", str(permuted))
    try:
        recipe.wait_serving(*recipe.start(blocks["verifier host"][0]))
        recipe.wait_serving(*recipe.start(blocks["edge host"][0]))
        proc, log = recipe.start(blocks["edge host"][1])
        assert recipe.wait_exit(proc) == 2
        lines = [line for line in log.read_text().splitlines() if line.strip()]
        assert len(lines) == 1, lines
        line = lines[0]
        assert line.startswith(f"steerspec: error: --drafter {EDGE_HOST}:50062: the drafter's model")
        assert str(permuted) in line and "'verifier'" in line and "Use a drafter of the verifier's model" in line
    finally:
        recipe.close()


@pytest.mark.slow
@pytest.mark.real_pair
def test_recipe_on_the_real_pair(recipe_dir):
    from steerspec.models import load_tokenizer, smollm2

    if not smollm2.available():
        pytest.skip(f"the smollm2 verifier is not installed ({smollm2.INSTALL_HINT})")
    summary = run_recipe(recipe_dir, "smollm2", "smollm2-sd2", 16)
    prompt_ids = load_tokenizer("smollm2")(PROMPT, add_special_tokens=False)["input_ids"]
    reference = greedy_reference(smollm2.ensure_model_dir(), prompt_ids, 16)
    assert list(summary.token_ids) == reference and summary.drafted > 0
