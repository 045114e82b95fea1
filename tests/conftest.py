"""Shared fixtures: a tiny random Llama (fast unit and CLI tests) and the real default model.

The tiny model uses the real SmolLM2 tokenizer (from the converted default model), so chat
templates, EOS == pad and the 49k vocabulary behave exactly as in a real run.
"""

from __future__ import annotations

import os

# One intra-op thread for the test process and every `tunekit` it starts: the tiny model's ops are
# far too small to split, and two processes each spinning 2 OpenMP threads on a 2-core machine
# wait for each other's cores many times over. Set before torch is imported anywhere.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import gc  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# Without CUDA the Triton kernels run in Triton's numpy interpreter, which must be on before triton
# is imported (its own @jit library functions are decorated then). Set here, not in
# tests/kernels/conftest.py: pytest reads a folder's conftest.py only when it collects that folder,
# and the folders collected before kernels/ import triton (tests/device's through bitsandbytes).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# What `tunekit.commands.main.main` sets for itself: set here, so that a test calling main in-process leaves
# os.environ as it found it, and the fork server (tests/_helpers.py) keeps serving instead of being
# restarted (a fresh import of the stack) for an environment that moved.
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
# The tokenized cache (tunekit.data.cache) of every run the suite starts: a folder of the session's own
# (the xdist workers inherit the controller's), removed at exit; never the user's ~/.cache, and no run
# sees what an earlier session cached.
if not os.environ.get("TUNEKIT_DATA_CACHE"):
    import atexit
    import shutil
    import tempfile

    os.environ["TUNEKIT_DATA_CACHE"] = tempfile.mkdtemp(prefix="tunekit-test-tokenized-")
    atexit.register(shutil.rmtree, os.environ["TUNEKIT_DATA_CACHE"], True)


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto` (pyproject.toml): one worker per core this process may use, at most 4. Each worker
    is single-threaded (OMP_NUM_THREADS=1 above) and some tests start 2-3 processes of their own."""
    return max(1, min(4, len(os.sched_getaffinity(0))))


# The longest modules, longest first (their serial times: benchmarks/history/test-suite-2026-11-25.md;
# test_compile's with inductor's cache empty, as on a CI machine). Workers take whole modules in
# this order (pyproject.toml turns off xdist's own reordering, which sorts modules by their number
# of tests), so the long ones start first and the short ones fill in after them instead of one
# worker finishing a long module alone at the end.
LONGEST_FIRST = ("kernels/test_doctor.py", "export/test_export.py", "kernels/test_tiles.py", "plan/test_plan_measured.py",
                 "plan/test_fsdp_measured.py",
                 "speed/test_compile.py", "train/test_fsdp.py", "train/test_fsdp_load.py", "infer/test_taskeval.py",
                 "commands/test_bad_input.py", "model/test_default_model.py", "train/test_shared_start.py",
                 "scripts/test_bench_train.py", "scripts/test_bench_task.py",
                 "train/test_resume.py", "train/test_distributed.py", "train/test_rank_failure.py",
                 "export/test_gguf_adapter.py", "methods/test_methods.py", "commands/test_recipes.py",
                 "infer/test_gguf_eval.py")


def pytest_configure(config):
    # A module moved or renamed without its entry above would silently lose its place in the order.
    moved = [name for name in LONGEST_FIRST if not (Path(__file__).parent / name).is_file()]
    if moved:
        raise pytest.UsageError(f"tests/conftest.py: LONGEST_FIRST names modules that are not there: {moved}")


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        path = item.nodeid.split("::")[0]
        return next((i for i, name in enumerate(LONGEST_FIRST) if path == f"tests/{name}"), len(LONGEST_FIRST))

    items.sort(key=rank)  # stable: every other module, and the tests within a module, keep their order


# Python's cyclic collector walks every object the process holds at each full collection. A worker
# holds hundreds of thousands of them (torch, transformers, peft, tokenizers, fixtures' caches), so
# every full collection is slow, and a suite runs many (timed with gc.callbacks: most of them gone
# after this): the explicit gc.collect() of export and eval freeing a model, and the millions of
# objects gguf's reader builds. So before each test what is left over is collected,
# then everything that lives on is frozen (gc.freeze: left out of every later collection, never freed
# by one). A test's own objects stay collectable; what is frozen is what later tests share anyway.
# Cost: a cyclic structure alive before a test that dies later (a module fixture's model) is not
# reclaimed; the workers' peak memory did not grow.
@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config):
    gc.unfreeze()  # the interpreter's last collection at exit sees everything again (nanobind counts leaks)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from tunekit.model import default_model_dir as convert

    return convert()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_model_dir) -> Path:
    """2-layer Llama, hidden 64, random weights, bf16 on disk, SmolLM2's tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-llama")
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    from _helpers import TOKENIZER_FOLDERS

    TOKENIZER_FOLDERS.append(out)  # the folder most commands of the suite load
    return out


@pytest.fixture(scope="session")
def template_less_model_dir(tmp_path_factory, tiny_model_dir) -> Path:
    """The tiny model with a base model's tokenizer: no chat template, no ChatML tokens
    (tests/_helpers.template_less_base)."""
    from _helpers import template_less_base

    return template_less_base(tiny_model_dir, tmp_path_factory.mktemp("template-less"))


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """48 short alpaca rows: enough for a few steps and a held-out split."""
    out = tmp_path_factory.mktemp("data") / "tiny.jsonl"
    # responses of varied length, so micro-batches hold different numbers of trained tokens
    rows = [{"instruction": f"What is {i} plus {i}?", "input": "",
             "output": f"{i} plus {i} is {2 * i}." + " Adding is easy." * (i % 5)} for i in range(48)]
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


@pytest.fixture(autouse=True)
def _restore_cudnn_attention_switch():
    """A training run turns torch's process-wide cuDNN attention switch off (kernels.cudnn_attention)
    and puts it back in cleanup(); many tests build a run without cleaning up, so each test starts
    from torch's default here."""
    yield
    torch.backends.cuda.enable_cudnn_sdp(True)
