"""Make a smaller student from a teacher the DistilBERT way (Sanh et al. 2019): keep every k-th layer.

The student keeps the teacher's embeddings, final norm, head and tokenizer, so it shares the
vocabulary and starts close to the teacher; it is saved as a plain Hugging Face model folder.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from tunekit import TunekitError
from tunekit.owned import atomic_dir

log = logging.getLogger(__name__)


def kept_layers(n_layers: int, keep_every: int) -> list[int]:
    """Layers 0, k, 2k, ... (DistilBERT took one layer in two, starting from the first)."""
    return list(range(0, n_layers, keep_every))


def make_student(teacher_path: str, keep_every: int, out_dir: Path) -> Path:
    """Write the student to out_dir (reused if already there) and return its path."""
    out_dir = Path(out_dir)
    if (out_dir / "config.json").is_file():
        return out_dir
    from transformers import AutoModelForCausalLM, AutoTokenizer

    teacher = AutoModelForCausalLM.from_pretrained(teacher_path, dtype=torch.bfloat16)
    layers = teacher.get_decoder().layers
    keep = kept_layers(len(layers), keep_every)
    if keep_every < 2 or len(keep) == len(layers):
        raise TunekitError(f"distill.student_keep_every={keep_every} keeps all {len(layers)} layers; use 2 or more")
    teacher.get_decoder().layers = torch.nn.ModuleList(layers[i] for i in keep)
    for new_idx, layer in enumerate(teacher.get_decoder().layers):
        layer.self_attn.layer_idx = new_idx  # KV-cache slots are indexed by position in the stack
    config = teacher.config
    config.num_hidden_layers = len(keep)
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in keep]
    tokenizer = AutoTokenizer.from_pretrained(teacher_path)
    log.info("student: %d of %d teacher layers (every %d-th) -> %s", len(keep), len(layers), keep_every, out_dir)

    def write(tmp: Path) -> None:
        teacher.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    atomic_dir(out_dir, write)
    return out_dir
