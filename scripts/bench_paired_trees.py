"""Paired decode benchmark of two source trees (A: e.g. a worktree of an older commit, B: this one),
alternating rounds in one run: ``python scripts/bench_paired_trees.py TREE_A TREE_B MODEL {process|inprocess} ROUNDS TOKENS``.

Runs in: a shell (a developer tool; each tree runs in a child process of its own).

Each side is a long-lived subprocess with its own source tree on sys.path, its model loaded once;
per round each decodes N greedy tokens after a fixed prompt; the figure is the median of the
per-round B/A tokens-per-second ratios."""
import json, os, statistics, subprocess, sys

CHILD = r'''
import sys, time, json
sys.path.insert(0, sys.argv[1])
import numpy as np
from powerinfer.api import LLM
llm = LLM(sys.argv[2], n_ctx=256, n_threads=2, executor=sys.argv[3], pin=False)
ids = llm.tokenize("The history of the city begins with a small settlement on the river, where")
print("ready", flush=True)
for line in sys.stdin:
    n = int(line)
    eng = llm.engine
    eng.rewind_all()
    t = time.perf_counter(); tok = int(np.argmax(eng.eval(ids)[-1])); pre = len(ids) / (time.perf_counter() - t)
    t = time.perf_counter()
    for _ in range(n):
        tok = int(np.argmax(eng.eval([tok])[-1]))
    print(json.dumps({"decode": n / (time.perf_counter() - t), "prefill": pre}), flush=True)
'''
trees, model, executor, rounds, n = sys.argv[1:3], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
# PYTHONPATH too, not only sys.path: the worker processes a side starts (`python -m powerinfer...`) must
# import its tree, not the installed package (before this, both sides' pools ran the installed workers)
procs = [subprocess.Popen([sys.executable, "-c", CHILD, t, model, executor], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                          cwd="/tmp", env={**os.environ, "PYTHONPATH": t}) for t in trees]
for p in procs:
    assert p.stdout.readline().strip() == "ready"
res = {0: [], 1: []}
for r in range(rounds):
    for i in ((0, 1) if r % 2 == 0 else (1, 0)):
        procs[i].stdin.write(f"{n}\n"); procs[i].stdin.flush()
        res[i].append(json.loads(procs[i].stdout.readline()))
for p in procs:
    p.stdin.close(); p.wait()
for key in ("decode", "prefill"):
    ratios = [b[key] / a[key] for a, b in zip(res[0], res[1])]
    print(f"{executor} {key}: B/A median {statistics.median(ratios):.3f} (rounds {', '.join(f'{x:.3f}' for x in ratios)}); "
          f"A median {statistics.median(a[key] for a in res[0]):.1f} tok/s, B median {statistics.median(b[key] for b in res[1]):.1f} tok/s")
