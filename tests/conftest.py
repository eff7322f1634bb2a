"""Shared fixtures: the bundled model pair, the eval prompts, tiny random checkpoints for fast tests.

Add fixtures here only when several test files need them; keep them cheap (session scope).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from steerspec.serving import grpc_env

grpc_env.apply()  # the same gRPC transport as the CLI; before any test module imports grpc

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

# transformers binds its log handler to the sys.stderr of its first use: make that pytest's session
# stream, not a test's capsys stream, which is closed after that test (later warnings then fail to write)
hf_logging.get_logger()

ROOT = Path(__file__).resolve().parent.parent
ASSETS = ROOT / "steerspec" / "assets"
BUNDLED_VERIFIER = ASSETS / "models" / "verifier"
BUNDLED_DRAFTER = ASSETS / "models" / "pretrained"

# One intra-op thread: the models are tiny, so extra threads only spin (3x slower on a shared
# 2-core box), and results then never depend on the thread count. STEERSPEC_TEST_THREADS overrides.
torch.set_num_threads(int(os.environ.get("STEERSPEC_TEST_THREADS", "1")))

_CORPUS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "class Queue:\n    def __init__(self):\n        self.items = []\n\n    def put(self, item):\n        self.items.append(item)\n",
    "import os\nimport sys\n\nfor name in sorted(os.listdir(path)):\n    print(name, file=sys.stderr)\n",
    "The quick brown fox jumps over the lazy dog. Return the value of the attribute.\n",
] * 4

TINY_PROMPTS = [
    "def fibonacci(n):",
    "class Queue:",
    "import os\n",
    "for name in sorted(",
    "    return",
    "The quick brown",
    "self.items",
    "print(name",
]


def bundled_pair_present() -> bool:
    return (BUNDLED_VERIFIER / "config.json").is_file() and (BUNDLED_DRAFTER / "config.json").is_file()


def load_prompts(name: str = "indist", limit: int | None = None) -> list[str]:
    """Prompts of a bundled eval set (steerspec/assets/eval/<name>.jsonl)."""
    path = ASSETS / "eval" / f"{name}.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    prompts = [r["prompt"] for r in rows]
    return prompts[:limit] if limit else prompts


def save_tiny_tokenizer(path: Path):
    """A small byte-level BPE tokenizer (vocab ~300) saved so AutoTokenizer loads it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    fast.save_pretrained(str(path))
    return fast


def make_tiny_model_dir(path: Path, model_type: str = "llama", seed: int = 0, vocab_size: int = 320,
                        hidden_size: int = 64, layers: int = 2, base: Path | None = None,
                        noise: float = 0.0, eos_token_id: int = 0) -> Path:
    """Save a tiny random SwiGLU decoder (+ tokenizer) at `path`.

    With `base`, copy that model's weights and add Gaussian `noise` (a drafter that agrees with
    its verifier most of the time). A large init range keeps logits peaked, so greedy argmaxes
    are far from ties.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    if base is not None:
        model = AutoModelForCausalLM.from_pretrained(str(base), local_files_only=True, dtype=torch.float32)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(noise * p.std() * torch.randn_like(p))
    else:
        extra = {"sliding_window": None} if model_type in ("mistral", "qwen2", "qwen3") else {}
        if model_type == "qwen3":
            extra["head_dim"] = 16
        config = AutoConfig.for_model(
            model_type, vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, initializer_range=0.2, tie_word_embeddings=False,
            eos_token_id=eos_token_id, bos_token_id=eos_token_id, **extra,
        )
        model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(str(path))
    save_tiny_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> tuple[Path, Path]:
    """(verifier dir, drafter dir): a tiny random Llama and a noisy copy of it."""
    root = tmp_path_factory.mktemp("tiny_pair")
    verifier = make_tiny_model_dir(root / "verifier", seed=1)
    drafter = make_tiny_model_dir(root / "drafter", seed=2, base=verifier, noise=0.05)
    return verifier, drafter


@pytest.fixture(scope="session")
def model_pair(tiny_pair) -> tuple[Path, Path]:
    """The bundled (verifier, pretrained drafter) directories; the tiny pair until they exist.

    STEERSPEC_TEST_PAIR="VERIFIER_DIR:DRAFTER_DIR" points the suite at another local pair.
    """
    override = os.environ.get("STEERSPEC_TEST_PAIR")
    if override:
        verifier, drafter = override.split(":")
        return Path(verifier), Path(drafter)
    if bundled_pair_present():
        return BUNDLED_VERIFIER, BUNDLED_DRAFTER
    return tiny_pair


@pytest.fixture(scope="session")
def eval_prompts(model_pair) -> list[str]:
    """indist prompts when the bundled pair and eval set exist, else short generic prompts."""
    if (bundled_pair_present() or os.environ.get("STEERSPEC_TEST_PAIR")) and (ASSETS / "eval" / "indist.jsonl").is_file():
        return load_prompts("indist")
    return list(TINY_PROMPTS) * 2


@pytest.fixture(scope="session")
def loaded_pair(model_pair):
    """(verifier model, drafter model, tokenizer) loaded once per session, float32 on CPU."""
    from steerspec.models import load_model, load_tokenizer

    verifier_dir, drafter_dir = model_pair
    return load_model(verifier_dir), load_model(drafter_dir), load_tokenizer(verifier_dir)

GREEDY_PROMPTS, GREEDY_TOKENS = 16, 32


@pytest.fixture(scope="session")
def pair_greedy(loaded_pair, eval_prompts):
    """(prompt ids, config, references): the first 16 eval prompts and the verifier alone's greedy
    32 tokens after each (EOS included); a smaller budget's greedy output is a prefix of these."""
    from steerspec.decoding.engine import DecodeConfig, autoregressive_generate
    from steerspec.models import cached_lm, context_length, eos_token_ids

    verifier, drafter, tok = loaded_pair
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in eval_prompts[:GREEDY_PROMPTS]]
    config = DecodeConfig(max_new_tokens=GREEDY_TOKENS, eos_token_ids=eos_token_ids(verifier, tok),
                          max_length=min(context_length(verifier), context_length(drafter)))
    v = cached_lm(verifier)
    return prompts, config, [autoregressive_generate(v, ids, config).token_ids for ids in prompts]


@pytest.fixture(scope="session")
def ray_cluster():
    """One two-node Ray on loopback for the whole test session, started by the first test that asks for it.

    Head node {"edge": 2, CPU 1} (drafters and coordinators), second node {"verifier": 1, CPU 1}; the
    driver connects through `coordinator.ray_setup.init_ray`, so the project's deployments find Ray
    already up and share it instead of each starting (and paying for) their own.
    """
    from coordinator.ray_setup import import_ray, init_ray

    ray = import_ray()
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"edge": 2}, "include_dashboard": False, "node_ip_address": "127.0.0.1"})
    try:
        cluster.add_node(num_cpus=1, resources={"verifier": 1}, node_ip_address="127.0.0.1")
        cluster.wait_for_nodes()
        init_ray(cluster.address)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


pytest_plugins = ["conftest_redis"]

# The markers a test's fixtures imply (pyproject.toml declares them; `make test-fast` leaves them out).
FIXTURE_MARKERS = {"redis_url": "redis", "redis_proc": "redis", "ray_cluster": "ray"}


def pytest_collection_modifyitems(config, items):
    """Mark every test by what its fixtures start: a real redis-server, a Ray cluster."""
    for item in items:
        for fixture in getattr(item, "fixturenames", ()):
            marker = FIXTURE_MARKERS.get(fixture)
            if marker is not None and marker not in item.keywords:
                item.add_marker(getattr(pytest.mark, marker))
