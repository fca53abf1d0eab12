"""``powerinfer convert``: the command line of powerinfer/convert.

Runs in: the CLI process.
"""

from __future__ import annotations

import argparse
from typing import Sequence

from powerinfer.convert.run import convert
from powerinfer.convert.writer import OUTTYPES
from powerinfer.flags import Parser, configure_logging


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="powerinfer convert", description=(
        "Convert a Hugging Face checkpoint folder (llama, mistral, ProSparse, Bamboo) or one of our GGUF files into "
        "a GGUF file, or with --powerinfer into PowerInfer's own PWRI layout (runs in PowerInfer and here)."))
    p.add_argument("src", help="a Hugging Face folder (config.json, safetensors or a PyTorch .bin, tokenizer) or a .gguf file")
    p.add_argument("-o", "--outfile", required=True, help="the file to write (replaced only when complete)")
    p.add_argument("--outtype", choices=OUTTYPES, default="f16",
                   help="type of the weight matrices: f32, f16 (default), q8_0 or q4_0; vectors stay f32")
    p.add_argument("--predictor", default=None,
                   help="PowerInfer's predictor folder (model_N.pt per layer, optional config.json with sparse_threshold) "
                        "or one of our .predictor files; without --powerinfer it is written as OUT.predictor")
    p.add_argument("--powerinfer", action="store_true",
                   help="write PowerInfer's layout: PWRI magic, the transposed down projection and the predictors inside")
    p.add_argument("--log-level", default="WARNING", choices=("DEBUG", "INFO", "WARNING", "ERROR"), help="log level (default WARNING)")
    return p


def run_convert(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level, False)
    for path in convert(args.src, args.outfile, args.outtype, args.predictor, args.powerinfer):
        print(f"wrote {path}")
    return 0
