"""The edge drafter gRPC service (DrafterService): per-session KV caches, blocks out, feedback in."""
