#!/usr/bin/env bash
# The engine's C kernels under AddressSanitizer and UndefinedBehaviorSanitizer, outside the test
# suite (a sanitized build is ~3x slower and needs the sanitizer runtimes preloaded into Python):
# builds engines/builtin/native/*.c with -fsanitize=address,undefined, swaps that library into
# the engine and runs the kernel tests against it; any out-of-bounds access or undefined
# operation aborts with the sanitizer's report.
#   bash scripts/sanitize_kernels.sh [pytest args]   # default: the native kernel tests
set -euo pipefail
cd "$(dirname "$0")/.."
CC=${CC:-gcc}
build=$(mktemp -d)
trap 'rm -rf "$build"' EXIT
"$CC" -O1 -g -march=native -fno-trapping-math -fopenmp -shared -fPIC -std=c11 \
    -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer \
    -o "$build/kernels.so" engines/builtin/native/*.c -lm
tests=("$@")
if [ ${#tests[@]} -eq 0 ]; then
    tests=(tests/engines/builtin/native/test_quant_kernels.py
           tests/engines/builtin/native/test_native_kernels.py
           tests/engines/builtin/test_decode_program.py)
fi
ASAN_OPTIONS=detect_leaks=0 \
LD_PRELOAD="$("$CC" -print-file-name=libasan.so):$("$CC" -print-file-name=libubsan.so)" \
PYTHONPATH=. SANITIZED_KERNELS="$build/kernels.so" .venv/bin/python - "${tests[@]}" <<'PY'
import os
import sys

import pytest

from engines.builtin import native

lib, layout = native.open_library(os.environ["SANITIZED_KERNELS"])
native._state.update(lib=lib, layout=layout, reason=None, built=None)
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", *sys.argv[1:]]))
PY
