"""Wire protocol between the coordinator and worker processes (ZeroMQ, msgpack headers, raw tensor
frames; spec in docs/protocol.md). Runs in every process. Not built yet: the engine core runs its
shards in one process through the in-process executor, which has the same interface."""
