"""Developer tools, apart from the runtime: nothing a user's process imports to run a model
(api, coordinator, workers, server) imports anything here.

Runs in: the developer's process. ``fuzz/`` (file, request and template fuzzers; above the CLI,
whose commands it drives) and ``harness/`` (benchmarks, the load test, grammar timing, the GPU
check, a fake NUMA topology; below the CLI, whose dev commands run them).
"""
