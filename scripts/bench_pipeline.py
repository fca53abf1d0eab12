"""Pipeline stages on a local Ray cluster: the latency a stage hop adds per token, and decode
throughput with micro-batches on 2 stages against 1, in alternating rounds of one run.

    python scripts/bench_pipeline.py MODEL [ROUNDS] [TOKENS] [SEQS] [pool|inprocess]

Runs in: a shell (a developer tool): a head and three nodes of one CPU each on this machine
(ray.cluster_utils.Cluster); A = 1 stage, B = 2 stages, both loaded once, each stage a native pool of
one rank (not pinned: the stages share this machine's cores), or with "inprocess" the decoder in
the actor's process with one thread.
Per round: A then B decode TOKENS tokens of one sequence (latency), then SEQS sequences at once
(one EACH batch per step: B cuts it into two micro-batches, so both stages work at once).
Prints the medians of the per-round figures and ratios, and what crosses a hop per token.
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np
import ray
from ray.cluster_utils import Cluster

from powerinfer.api import LLM
from powerinfer.coordinator.cluster.options import ClusterOptions


def decode_s(llm: LLM, tokens: int, seqs: int) -> float:
    """Seconds per decode step of seqs sequences (each prefilled with a short prompt first)."""
    eng = llm.engine
    eng.rewind_all()
    ids = llm.tokenize("The history of the city begins with a small settlement on the river, where")
    last = []
    for s in range(seqs):
        last.append(int(np.argmax(eng.eval(ids, slot=s)[-1])))
    t = time.perf_counter()
    for _ in range(tokens):
        rows = eng.decode(last, list(range(seqs)))
        last = [int(np.argmax(r)) for r in rows]
    return (time.perf_counter() - t) / tokens


def main() -> None:
    model = sys.argv[1]
    rounds, tokens, seqs = (int(a) for a in (sys.argv[2:5] + ["8", "32", "4"][len(sys.argv[2:5]):]))
    inprocess = sys.argv[5:6] == ["inprocess"]
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "object_store_memory": 80 << 20})
    for _ in range(3):
        c.add_node(num_cpus=1, object_store_memory=80 << 20)
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False, configure_logging=False)
    try:
        a = LLM(model, n_ctx=512, n_slots=seqs, cluster=ClusterOptions(address=c.address, stages=1, threads=1, pin=False, inprocess=inprocess))
        b = LLM(model, n_ctx=512, n_slots=seqs, cluster=ClusterOptions(address=c.address, stages=2, threads=1, pin=False, inprocess=inprocess))
        one, many = [], []
        for _ in range(rounds):
            la, lb = decode_s(a, tokens, 1), decode_s(b, tokens, 1)
            ta, tb = decode_s(a, tokens, seqs), decode_s(b, tokens, seqs)
            one.append((la, lb))
            many.append((seqs / ta, seqs / tb))
        hop_us = statistics.median(1e6 * (lb - la) for la, lb in one)
        d = a.config.d_model
        print(f"model {a.config.name}: d_model {d}, {a.config.n_layers} layers; stages {'in process' if inprocess else 'native pools of one rank'}; "
              f"{rounds} rounds, {tokens} decode steps each")
        print(f"1 sequence: per token 1 stage {1e3 * statistics.median(x for x, _ in one):.2f} ms, 2 stages "
              f"{1e3 * statistics.median(y for _, y in one):.2f} ms; the added hop (median of per-round differences) {hop_us:.0f} us")
        print(f"{seqs} sequences (2 stages: {min(seqs, 2)} micro-batches): 1 stage {statistics.median(x for x, _ in many):.1f} tok/s, "
              f"2 stages {statistics.median(y for _, y in many):.1f} tok/s; 2/1 median of per-round ratios "
              f"{statistics.median(y / x for x, y in many):.3f}")
        per_hop = 4 * d + 200  # the residual stream's float32 row and a header of ~200 bytes, per token
        print(f"a hop carries {per_hop} bytes per token: {8 * per_hop / 10e9 * 1e6:.2f} us of wire time at 10 Gb/s "
              f"(plus the network's round trip, ~20-50 us on a LAN, against {hop_us:.0f} us measured on loopback here)")
        a.close()
        b.close()
    finally:
        ray.shutdown()
        c.shutdown()


if __name__ == "__main__":
    main()
