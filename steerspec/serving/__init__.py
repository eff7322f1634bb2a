"""What the three services share: gRPC plumbing, the wire format, TLS and tokens, the Redis store, registration,
batching windows, model identity and the emulated link."""
