"""Generated gRPC stubs for package steerspec.v1 (see scripts/gen_protos.py)."""
