"""The remote verifier gRPC service (VerifierService): batched verification with per-session KV caches."""
