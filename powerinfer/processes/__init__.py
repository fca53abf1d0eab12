"""Worker processes' life: starting, watching and stopping them (the coordinator's side,
``supervisor``), and what every worker does to live by it (``worker_runtime``, ``lifecycle``).

Runs in: the coordinator (``supervisor``: used by the CPU pool and the GPU worker's client) and
every worker process (``worker_runtime``, ``lifecycle``).

Split from ``powerinfer.protocol``, which is the wire format alone (messages, codec, transport,
errors). Deciding when to restart is not here either: the engine core owns that
(coordinator/engine_core.py: it checks its executor's health and restarts it); this package
only reports a worker gone or silent (``WorkerDiedError``) and starts a fresh set when asked.
"""
