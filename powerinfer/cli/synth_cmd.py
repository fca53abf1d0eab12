"""``powerinfer synth``: write a synthetic ReLU-family model whose sparsity a predictor can learn.

Runs in: the CLI process (the writer is powerinfer/sparsity/relu_model.py, the measurement
powerinfer/sparsity/relu_measure.py).

The files stand in for ReluLLaMA / Bamboo at sizes we cannot download here: TinyLlama-1.1B and
Llama-2-7B shapes, random weights with the firing statistics of real ReLU models planted (85-90% of
neurons zero per token, a hot fifth carrying ~80% of the firings) and learnable (gate directions in
a low-rank subspace). After writing, the file itself is measured: zero share per layer, the hot
fifth's share, and a rank-limited predictor's recall on tokens it did not train on.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Sequence

from gguf import GGMLQuantizationType

from powerinfer.flags import Parser, configure_logging
from powerinfer.sparsity.calibrate import default_rank
from powerinfer.sparsity.relu_measure import fit_predictors, measure_sparsity
from powerinfer.sparsity.relu_model import WRITABLE_TYPES, ReluSparseSpec, write_relu_sparse_gguf

SHAPE_NAMES = {"tiny": "tiny", "1b": "tinyllama-1.1b", "7b": "llama2-7b"}
ACTS = {"reglu": "relu", "drelu": "drelu", "silu": "silu"}  # the flag's names -> the file's activation


def run_synth(argv: Sequence[str]) -> int:
    p = Parser(prog="powerinfer synth", description="Write a synthetic ReLU-family llama GGUF with planted, learnable "
               "activation sparsity (deterministic for a seed), then measure it from the file.")
    p.add_argument("-o", "--output", required=True, type=Path, help="the .gguf file to write")
    p.add_argument("--act", choices=tuple(ACTS), default="reglu",
                   help="reglu: relu(gate) * up (ReluLLaMA); drelu: relu(gate) * relu(up) (Bamboo); "
                        "silu: a plain llama file with near-zero SiLU gates (default reglu)")
    p.add_argument("--shape", choices=tuple(SHAPE_NAMES), default="1b",
                   help="1b: TinyLlama-1.1B (22 x 2048, 5632 neurons); 7b: Llama-2-7B (32 x 4096, 11008); tiny: 2 x 128 (tests)")
    p.add_argument("--quant", choices=[t.name.lower() for t in WRITABLE_TYPES], default="q4_0",
                   help="type of the 2-D matrices (default q4_0; the embeddings are q8_0 unless this is a float type)")
    p.add_argument("--sparsity", type=float, default=0.89, help="target share of FFN neurons zero per token (default 0.89)")
    p.add_argument("--gate-rank", type=int, default=None,
                   help="rank of the subspace the gate directions lie in (default d_model / 64, at least 4); "
                        "0: full rank, firing no predictor below full rank can learn")
    p.add_argument("--logit-std", type=float, default=None,
                   help="scale the output norm so the logits spread about this much, as a trained model's do (default 3 for "
                        "reglu/drelu; 0 for silu: unscaled, the older planted file byte for byte)")
    p.add_argument("--seed", type=int, default=0, help="seed of every weight (default 0)")
    p.add_argument("--measure-layers", type=int, default=2, help="layers measured after writing (default 2; 0: none)")
    p.add_argument("--measure-tokens", type=int, default=1024, help="tokens for the measurement and the predictor fit (default 1024)")
    p.add_argument("--log-level", default="WARNING", choices=("DEBUG", "INFO", "WARNING", "ERROR"), help="log level (default WARNING)")
    args = p.parse_args(argv)
    configure_logging(args.log_level, False)
    base = ReluSparseSpec.shape(SHAPE_NAMES[args.shape], qtype=GGMLQuantizationType[args.quant.upper()])
    rank = max(4, base.d_model // 64) if args.gate_rank is None else args.gate_rank
    # A ReLU's zero is exact, so the gate needs no SiLU-sized gain to switch neurons off.
    spec = replace(base, act=ACTS[args.act], gate_rank=rank, inactive_fraction=args.sparsity, seed=args.seed,
                   gate_scale=base.gate_scale if args.act == "silu" else 1.0,
                   logit_std=args.logit_std if args.logit_std is not None else (0.0 if args.act == "silu" else 3.0))
    if args.measure_layers < 0 or args.measure_tokens < 640:
        p.error("--measure-layers must be >= 0 and --measure-tokens >= 640")
    t0 = time.perf_counter()
    write_relu_sparse_gguf(args.output, spec, progress=True)
    print(f"wrote {args.output}: {args.output.stat().st_size / 2**20:.1f} MiB in {time.perf_counter() - t0:.1f}s "
          f"({args.act}, gate rank {rank or 'full'}, seed {args.seed})")
    if args.measure_layers:
        t0 = time.perf_counter()
        # Other tokens than the writer's calibration ones: the plant must generalize.
        stats = measure_sparsity(args.output, n_tokens=args.measure_tokens, layers=args.measure_layers, seed=args.seed + 1)
        print(stats.format())
        pred_rank = default_rank(spec.d_model)
        for fit in fit_predictors(args.output, pred_rank, n_tokens=args.measure_tokens, layers=args.measure_layers, seed=args.seed + 2):
            print(fit.format())
        print(f"measured in {time.perf_counter() - t0:.1f}s")
    return 0
