"""Serving across hosts on Ray: a model's layers split into pipeline stages, one per node.

Runs in: the coordinator (``pipeline``: the executor, Ray's driver) and one Ray actor process per
stage on its node (``stage``).

Ray places the stages (a placement group, one bundle per stage) and reports a lost node; the
activations travel between stages point to point over ZeroMQ (``wire``: a msgpack header and raw
frames, no pickle), one hop per stage per step. Ray is imported only by ``pipeline`` and only
when the flags ask for a cluster (``--ray-address``, ``--pipeline-stages``): without them nothing
here is imported, and ``plan`` and ``wire`` need no Ray at all. docs/distributed.md tells the rest.
"""
