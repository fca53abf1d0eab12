#!/usr/bin/env bash
# Prepares what scripts/gpu_check.sh needs on a GPU machine that has no internet, on a machine that has.
# Runs in: a developer's shell (PyPI reachable), from anywhere inside the checkout.
#
#   scripts/prepare_gpu_wheelhouse.sh            # -> .whl/ (git-ignored): wheels, pycuda, the llama.cpp fixture
#                                                #    build/gpu_check/smollm2.part-{a,b} (git-ignored): the model in halves
#
# .whl/ holds, for CPython 3.12 on x86-64 Linux (the GPU image's python; PY_VERSION overrides):
#   * the packages the image lacks: pycuda's pytools, platformdirs, mako, siphash24, and the project's gguf, pyzmq;
#   * pycuda: its sdist always, and a wheel built here when a Python of that version and nvcc are found (pycuda
#     publishes no wheels; building it there costs minutes of GPU-machine time). The wheel links libcuda.so.1
#     through a stub library made here; the GPU machine's driver provides the real one;
#   * the llama.cpp reference fixture (tests/fixtures travels with the working tree; kept for older checkouts).
# The image already has torch, numpy, tokenizers, jinja2, msgpack, psutil, tqdm, requests, pyyaml, markupsafe,
# typing-extensions, setuptools and wheel (/work/.library/device/KINDS.md); EXTRA_PACKAGES adds more.
# SmolLM2 (98 MB) does not fit one 64 MiB device call, so it is split in two halves: see docs/gpu.md.
set -euo pipefail
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
OUT=${WHEELHOUSE:-.whl}
PY_VERSION=${PY_VERSION:-3.12}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT" build/gpu_check

PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64)
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp "${PLATFORMS[@]}" \
    -d "$OUT" pytools platformdirs mako siphash24 gguf pyzmq ${EXTRA_PACKAGES:-}
"$PYTHON" -m pip download -q --no-deps -d "$OUT" pycuda  # only an sdist exists: the fallback

# A wheel of pycuda for that Python, when one and nvcc are here.
PY_BUILD=""
for cand in "python$PY_VERSION" "$HOME/.pyenv/versions/$PY_VERSION"*/bin/python; do
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c "import sys; assert sys.version.startswith('$PY_VERSION')" 2>/dev/null; then
        PY_BUILD=$(command -v "$cand"); break
    fi
done
NVCC=$(command -v nvcc || true)
if [[ -n "$PY_BUILD" && -n "$NVCC" ]] && ! ls "$OUT"/pycuda-*-cp${PY_VERSION/./}-*.whl >/dev/null 2>&1; then
    # the toolkit root, also when nvcc on PATH is a wrapper script: ask nvcc where its headers are
    CUDA_ROOT=${CUDA_ROOT:-$("$NVCC" -dryrun -c -x cu /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -1)}
    CUDA_ROOT=$(readlink -f "${CUDA_ROOT:-$(dirname "$(dirname "$(readlink -f "$NVCC")")")}")
    [[ -f "$CUDA_ROOT/include/cuda.h" ]] || { echo "error: no cuda.h under $CUDA_ROOT (set CUDA_ROOT)"; exit 1; }
    WORK=$(mktemp -d)
    trap 'rm -rf "$WORK"' EXIT
    # The stub only satisfies the linker; --no-as-needed keeps libcuda.so.1 in the wheel's NEEDED entries.
    printf 'void powerinfer_libcuda_stub(void) {}\n' > "$WORK/stub.c"
    mkdir "$WORK/stub" && cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$WORK/stub/libcuda.so" "$WORK/stub.c"
    tar xzf "$OUT"/pycuda-*.tar.gz -C "$WORK"
    SRC=$(echo "$WORK"/pycuda-*/)
    (cd "$SRC" && "$PY_BUILD" configure.py --cuda-root="$CUDA_ROOT" --cudadrv-lib-dir="$WORK/stub" --no-cuda-enable-curand >/dev/null \
        && sed -i "s|^LDFLAGS = .*|LDFLAGS = ['-Wl,--no-as-needed', '-L$WORK/stub', '-lcuda']|" siteconf.py)
    echo "building a pycuda wheel for Python $PY_VERSION against $CUDA_ROOT (a few minutes)"
    "$PY_BUILD" -m pip wheel -q --no-deps "$SRC" -w "$OUT"
    so=$(mktemp -d) && (cd "$so" && unzip -q "$OLDPWD/$OUT"/pycuda-*-cp${PY_VERSION/./}-*.whl 'pycuda/_driver*' \
        && readelf -d pycuda/_driver*.so | grep -q 'libcuda.so.1') || { echo "error: the pycuda wheel does not link libcuda.so.1"; exit 1; }
    rm -rf "$so"
else
    echo "no python$PY_VERSION or nvcc here (or a wheel exists): gpu_check.sh builds pycuda from the sdist on the GPU machine"
fi

FIXTURE=tests/fixtures/llamacpp_reference.json
[[ -f "$FIXTURE" ]] && mkdir -p "$OUT/fixtures" && cp "$FIXTURE" "$OUT/fixtures/"

# SmolLM2 in two halves (each carried by its own device call, see docs/gpu.md).
MODEL=$("$PYTHON" -c "from powerinfer.fetch import fetch_model; print(fetch_model('smollm2'))" 2>/dev/null || true)
if [[ -n "$MODEL" && -f "$MODEL" ]]; then
    half=$(( ($(stat -c %s "$MODEL") + 1) / 2 ))
    head -c "$half" "$MODEL" > build/gpu_check/smollm2.part-a
    tail -c +$((half + 1)) "$MODEL" > build/gpu_check/smollm2.part-b
fi
du -sh "$OUT" build/gpu_check/* 2>/dev/null
ls "$OUT"
