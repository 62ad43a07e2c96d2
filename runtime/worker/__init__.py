"""A worker process: the gRPC service, the executor of instruction streams, programs, sessions, checkpoints."""
