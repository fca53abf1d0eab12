#!/usr/bin/env bash
# The trained ReLU model's figures for docs/sparsity.md: held-out perplexity beside its SiLU twin,
# the share of exactly-zero FFN neurons per layer, and the predictor the default `powerinfer
# calibrate` trains on it (recall, precision, achieved sparsity, sparse vs dense perplexity).
#
#   scripts/relu_model_report.sh RELU_RUN SILU_RUN [MAX_TOKENS]
#
# RELU_RUN and SILU_RUN are `powerinfer train-relu -o DIR` folders (same --size; --act relu / silu).
set -euo pipefail
relu=$1 silu=$2 max=${3:-20000}
cd "$(dirname "$0")/.."
# calibration.txt: the end of the held-out documents (train-relu writes it; remade here for older runs,
# whose calibration.txt was the end of the training text)
python3 -c "
import sys; from pathlib import Path
from powerinfer.training.train import calibration_text
Path(sys.argv[1], 'calibration.txt').write_text(calibration_text(Path(sys.argv[1], 'heldout.txt').read_text()))" "$relu"
for run in "$relu" "$silu"; do
    echo "== $run: $(python3 -c "import json,sys; s=json.load(open(sys.argv[1])); print(s['activation'], s['params'], 'params,', s['train_tokens'], 'training tokens,', s['seconds'], 's')" "$run/summary.json")"
    python3 launch.py perplexity -m "$run/model.gguf" --text "$run/heldout.txt" --max-tokens "$max"
done
echo "== exactly-zero FFN neurons per layer (first 2048 held-out tokens), $relu"
python3 -c "
import sys; from pathlib import Path
from powerinfer.training.train import zero_share
z = zero_share(Path(sys.argv[1], 'model.gguf'), Path(sys.argv[1], 'heldout.txt').read_text()[:40000], 2048)
print(' '.join(f'{v:.1%}' for v in z), ' mean', f'{z.mean():.1%}')" "$relu"
echo "== powerinfer calibrate (default settings) on $relu/calibration.txt, then perplexity with it"
python3 launch.py calibrate -m "$relu/model.gguf" -o "$relu/model.predictor" --text "$relu/calibration.txt"
python3 launch.py perplexity -m "$relu/model.gguf" --text "$relu/heldout.txt" --max-tokens "$max" --predictor "$relu/model.predictor"
