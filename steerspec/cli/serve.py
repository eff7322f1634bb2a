"""`steerspec serve verifier|drafter|coordinator`: run one service standalone."""

from steerspec.cli.dispatch import register_group

COMMANDS = (
    ("verifier", "verifier_service.cli", "the remote verifier gRPC server"),
    ("drafter", "drafter_service.cli", "the edge drafter gRPC server"),
    ("coordinator", "coordinator.cli", "the coordinator gRPC server (public Generate API)"),
)


def register(subparsers) -> None:
    register_group(subparsers, "serve", "run a SteerSpec service", COMMANDS)
