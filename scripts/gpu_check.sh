#!/usr/bin/env bash
# The GPU check (scripts/gpu_check.py), runnable on a bare GPU machine with no network.
#   here, once, with the network:  bash scripts/gpu_check.sh --prepare    (builds .carry/: packages + tokenizer)
#   on the GPU machine:            bash scripts/gpu_check.sh --out DIR    (name .carry in what travels)
#   dry run on a CPU:              bash scripts/gpu_check.sh --tiny --out DIR
#   step profiles (same setup):    bash scripts/gpu_check.sh profile --model DIR --out DIR --variant ...
# tunekit need not be installed there: the source tree is put on the path under its import names.
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
export WANDB_MODE=disabled HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 \
       PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if [ -d "$repo/.carry/site" ]; then export PYTHONPATH="$repo/.carry/site${PYTHONPATH:+:$PYTHONPATH}"; fi
PY=${PYTHON:-python3}
if [ -z "${PYTHON:-}" ] && [ -x "$repo/.venv/bin/python" ]; then PY="$repo/.venv/bin/python"; fi
if ! "$PY" -c "import tunekit, tunekit_kernels, tunekit_recipes" 2>/dev/null; then
  shim=$(mktemp -d)
  ln -s "$repo/tunekit" "$shim/tunekit"
  ln -s "$repo/kernels" "$shim/tunekit_kernels"
  ln -s "$repo/recipes" "$shim/tunekit_recipes"
  export PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}"
fi
# Not from the repository root: its kernels/ folder would shadow Hugging Face's `kernels` package.
cd "$(mktemp -d)" || exit 1
script=gpu_check.py
if [ "${1:-}" = profile ]; then script=gpu_profile.py; shift; fi
exec "$PY" "$repo/scripts/$script" "$@"
