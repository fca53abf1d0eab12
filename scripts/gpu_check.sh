#!/usr/bin/env bash
# The GPU check: on a machine with an NVIDIA GPU and no internet, install what it needs from the wheelhouse
# carried in the working tree, then run every kernel against its numpy oracle, SmolLM2 fully on the GPU against
# llama.cpp's reference, and the neuron-split vs layer-split benchmark; prints one summary table.
# Runs in: the GPU machine's shell, from the checkout (prepare on a connected machine: scripts/prepare_gpu_wheelhouse.sh).
#
#   bash scripts/gpu_check.sh                      # everything: about 4 minutes on an H200 with 16 cores (timed in parts)
#   PARTS=kernels,smollm2 bash scripts/gpu_check.sh
#
# Environment: WHEELHOUSE (default .whl), PARTS (kernels,smollm2,overhead,bench), SMOLLM2_GGUF (the model file; default: the
# halves build/gpu_check/smollm2.part-{a,b} or /tmp/powerinfer-parts/smollm2.part-{a,b}, joined and checked),
# BENCH_ARGS (extra flags for the benchmark, e.g. "--bench-layers 32 --vram-budget 4"), OUT (copies the log there).
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELHOUSE=${WHEELHOUSE:-.whl}
SITE=${SITE:-/tmp/powerinfer-site}
PY=${PYTHON:-python3}
SMOLLM2_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
t0=$(date +%s)
export PYTHONUNBUFFERED=1

echo "== environment"
nvidia-smi --query-gpu=name,memory.total,memory.free,driver_version --format=csv,noheader || echo "nvidia-smi failed"
"$PY" --version; nvcc --version | tail -1; nproc

echo "== install (offline, from $WHEELHOUSE)"
mkdir -p "$SITE"
PIP=("$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE")
"${PIP[@]}" $(ls "$WHEELHOUSE"/*.whl | grep -v /pycuda-) || exit 1
"${PIP[@]}" "$WHEELHOUSE"/pycuda-*.whl 2>/dev/null || echo "no pycuda wheel for this Python"
export PYTHONPATH="$SITE:$PWD"
if ! "$PY" -c "import pycuda.driver" 2>/dev/null; then
    # no prebuilt wheel for this Python: build pycuda from its sdist (a few minutes), linking the driver's libcuda
    echo "building pycuda from $(ls "$WHEELHOUSE"/pycuda-*.tar.gz)"
    export LIBRARY_PATH="/usr/local/nvidia/lib64:/usr/lib/x86_64-linux-gnu:$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")/lib64/stubs:${LIBRARY_PATH:-}"
    MAX_JOBS=$(nproc) "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --target "$SITE" "$WHEELHOUSE"/pycuda-*.tar.gz || exit 1
fi
"$PY" -c "import pycuda.driver as c; c.init(); d = c.Device(0); print('pycuda', d.name(), d.compute_capability())" || exit 1

MODEL=${SMOLLM2_GGUF:-}
if [[ -z "$MODEL" ]]; then
    a=$(ls build/gpu_check/smollm2.part-a /tmp/powerinfer-parts/smollm2.part-a 2>/dev/null | head -1)
    b=$(ls build/gpu_check/smollm2.part-b /tmp/powerinfer-parts/smollm2.part-b 2>/dev/null | head -1)
    if [[ -n "$a" && -n "$b" ]]; then
        MODEL=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf
        cat "$a" "$b" > "$MODEL"
    fi
fi
ARGS=(--parts "${PARTS:-kernels,smollm2,overhead,bench}")
if [[ -n "$MODEL" && -f "$MODEL" ]]; then
    if [[ "$(sha256sum "$MODEL" | cut -d' ' -f1)" == "$SMOLLM2_SHA256" ]]; then ARGS+=(--smollm2 "$MODEL"); else echo "SmolLM2 at $MODEL has the wrong sha256: skipped"; fi
fi
for fx in tests/fixtures/llamacpp_reference.json ../shared/fixtures/llamacpp_reference.json shared/fixtures/llamacpp_reference.json "$WHEELHOUSE"/fixtures/llamacpp_reference.json; do
    [[ -f "$fx" ]] && { ARGS+=(--fixture "$fx"); break; }
done

echo "== check (setup took $(( $(date +%s) - t0 ))s)"
# shellcheck disable=SC2086
"$PY" -m powerinfer.devtools.harness.gpu_check "${ARGS[@]}" ${BENCH_ARGS:-} 2>&1 | tee /tmp/powerinfer-gpu-check.log
rc=${PIPESTATUS[0]}
[[ -n "${OUT:-}" ]] && cp /tmp/powerinfer-gpu-check.log "$OUT/" 2>/dev/null
echo "gpu_check.sh: exit $rc after $(( $(date +%s) - t0 ))s"
exit "$rc"
