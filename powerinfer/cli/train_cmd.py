"""``powerinfer train-relu``: the command line of powerinfer/training.

Runs in: the CLI process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from powerinfer.flags import Parser, configure_logging
from powerinfer.training.corpus import DEFAULT_CORPUS
from powerinfer.training.train import ACTIVATIONS, RECIPES, train


def run_train(argv: Sequence[str]) -> int:
    p = Parser(prog="powerinfer train-relu", description="Train a llama-shaped ReLU-family model from scratch on Debian's "
               "Python documentation (apt-get install python3.11-doc), deterministically, into a folder with model.gguf.")
    p.add_argument("-o", "--output", required=True, help="folder for the checkpoint, model.gguf, heldout.txt and the logs")
    p.add_argument("--act", choices=ACTIVATIONS, default="relu", help="FFN activation (default relu; silu for the twin)")
    p.add_argument("--size", choices=tuple(RECIPES), default="full", help="recipe: ci (~1 min), small (~15 min), full (~80 min)")
    p.add_argument("--corpus", default=str(DEFAULT_CORPUS), help=f"folder of .txt files (default {DEFAULT_CORPUS})")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the batches (default 0)")
    p.add_argument("-t", "--threads", type=int, default=2, help="torch threads (default 2; part of the recipe)")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"), help="log level (default INFO)")
    args = p.parse_args(argv)
    configure_logging(args.log_level, False)
    path = train(Path(args.output), args.act, args.size, Path(args.corpus), args.seed, args.threads)
    print(f"wrote {path}")
    return 0
