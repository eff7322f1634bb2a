"""`steerspec bench engine|remote|capacity|sd2|hop|http|overlap|step|layouts|invariance|sprinter|policies|soak`: benchmarks that print a
table and write JSON."""

from steerspec.cli.dispatch import register_group

COMMANDS = (
    ("engine", "steerspec.bench.in_process", "in-process engine vs verifier alone vs transformers assisted generation"),
    ("remote", "steerspec.bench.remote", "distributed path over an emulated remote link"),
    ("capacity", "steerspec.bench.capacity",
     "many sessions sharing one verifier: goodput, latency and SLO per mode against the verifier alone"),
    ("sd2", "steerspec.bench.drafters", "pretrained vs distilled vs SD² drafters (SD² paper Table 1 layout)"),
    ("hop", "steerspec.bench.hop", "one gRPC hop after idle under grpc's two TCP transports"),
    ("http", "steerspec.bench.http_api",
     "the OpenAI-compatible HTTP API beside the gRPC SDK at the same load: TPOT and throughput, interleaved"),
    ("sprinter", "steerspec.bench.lossy", "SPRINTER (lossy) vs exact: calls saved, speed at RTTs, η's, bounds, quality"),
    ("overlap", "steerspec.bench.overlap", "teacher-forced draft acceptance Σ min(p, q) per drafter and q truncation"),
    ("policies", "steerspec.bench.policies", "draft-length policies (GammaTune Table 2, Pacer Tables 1/6 layouts) at RTTs"),
    ("soak", "steerspec.bench.soak", "chaos soak: clients generate while parts are killed; nothing lost, repeated or wrong"),
    ("step", "steerspec.bench.step", "per-step latencies (drafter step, k+1 extend, draft/verify block) vs an HF floor"),
    ("layouts", "steerspec.bench.weight_layouts", "CPU weight layout per pass of n rows: input-major vs out-major copies"),
    ("invariance", "steerspec.bench.invariance",
     "what batch-invariant verify passes cost per pass size and dtype (and that they are bit-identical)"),
)


def register(subparsers) -> None:
    register_group(subparsers, "bench", "benchmarks (table + JSON)", COMMANDS)
