"""SD² steering: the verifier's steering head W_hml, the drafter's W_s retrofit, and their checkpoints."""

from steerspec.steering.drafter import (
    DrafterSteering,
    SteeringHooks,
    attach_steering,
    drafter_shape,
    find_up_projections,
)
from steerspec.steering.io import (
    SteeringConfig,
    SteeringWeights,
    has_steering,
    load_steering,
    load_steering_head,
    save_drafter_checkpoint,
    save_steering,
)
from steerspec.steering.layers import default_layers, parse_layers
from steerspec.steering.verifier_head import SteeringHead, vector_from_bytes, vector_to_bytes

__all__ = [
    "DrafterSteering",
    "SteeringConfig",
    "SteeringHead",
    "SteeringHooks",
    "SteeringWeights",
    "attach_steering",
    "default_layers",
    "drafter_shape",
    "find_up_projections",
    "has_steering",
    "load_steering",
    "load_steering_head",
    "parse_layers",
    "save_drafter_checkpoint",
    "save_steering",
    "vector_from_bytes",
    "vector_to_bytes",
]
