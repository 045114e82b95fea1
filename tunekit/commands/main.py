"""`tunekit` command line: a small argparse dispatcher; each subcommand is one module of this package.

`tunekit COMMAND ARGS` imports tunekit.commands.COMMAND on use and calls its `main(ARGS)`; `train`
hands its words to Hydra (tunekit.commands.train). Nothing below this package imports it.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import warnings

from tunekit import TunekitError, __version__
from tunekit.commands.parse import fail
from tunekit.device.threads import openmp_env

def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="[tunekit] %(message)s", stream=sys.stderr)
    # Libraries' own chatter (deprecation notes, per-tensor progress bars) buries our lines.
    for name in ("transformers", "peft", "accelerate", "datasets", "bitsandbytes", "httpx", "urllib3", "huggingface_hub"):
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass


# Subcommands: name -> help. `tunekit NAME ARGS` calls tunekit.commands.NAME.main(ARGS); each parses
# its own words, and the module is imported on use (`train`'s words are Hydra overrides).
COMMANDS: dict[str, str] = {
    "train": "fine-tune: tunekit train recipe=NAME [key=value ...] (Hydra overrides)",
    "generate": ("greedy answers from a run, adapter or model folder (rows may mix soft prompts or LoRA "
                 "adapters): tunekit generate --help"),
    "chat": "talk to what you trained (chat template, streaming, history): tunekit chat RUN",
    "eval": "score a run on held-out rows (loss, exact match, accuracy; --base side by side): tunekit eval RUN",
    "export": "adapter | merged HF model | GGUF, each checked against the trained model: tunekit export --help",
    "doctor": "check this build on this machine (kernels, fused vs peft training, resume, export): a report",
    "plan": "will it fit? peak memory and FLOPs of a training step, nothing loaded: tunekit plan --help",
    "data": ("tokenize a run's rows once into the tokenized cache, ahead of training (the tokenizer only): "
             "tunekit data prepare recipe=NAME [key=value ...]"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tunekit",
        description="Parameter-efficient fine-tuning of causal LMs (QLoRA, LoRA, ...).",
        epilog=(
            "examples:\n"
            "  tunekit train recipe=qlora                       # QLoRA on the embedded default model/data\n"
            "  tunekit train recipe=lora trainer.max_steps=20 output_dir=runs/x\n"
            "  tunekit train recipe=qlora data.path=my.jsonl model.path=/models/llama\n"
            "  tunekit train -m recipe=qlora,lora               # a Hydra sweep\n"
            "  tunekit train recipe=qlora --cfg job             # print the resolved config\n"
            "  tunekit plan recipe=qlora model.preset=llama-3-8b --device cuda --memory 24   # will it fit?\n"
            "  tunekit train --help                             # all config groups and keys"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"tunekit {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return p


def main(argv: list[str] | None = None) -> None:
    # Before anything imports torch: libgomp reads how its threads wait once, at that import.
    os.environ.update(openmp_env(os.environ, torch_loaded="torch" in sys.modules))
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0] in ("-h", "--help", "--version"):
        parser.parse_args(argv or ["--help"])
        return
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        fail(f"{command}: unknown command (choose from: {', '.join(COMMANDS)}; tunekit --help)")
    _setup_logging()
    try:
        importlib.import_module(f"tunekit.commands.{command}").main(rest)
    except TunekitError as e:
        fail(str(e))


if __name__ == "__main__":
    main()
