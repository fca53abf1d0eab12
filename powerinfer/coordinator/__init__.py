"""Coordinator: the token loop (embeddings, norms, output head, sampling) and the executors that run
each layer's shards. Runs in the coordinator process (the user's process for the Python API)."""
