"""CPU workers: the per-shard layer operations (attention heads with their KV cache, FFN neurons).
Runs in CPU worker processes, or in the coordinator for the in-process executor."""
