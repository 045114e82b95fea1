"""A new LoRA trained over a frozen one (`model.adapter`): two named peft adapters on the same layers.

    y = W x + s_start B_start A_start x + s B A dropout(x)

The start adapter is peft's adapter `start`, loaded with peft's own loader and frozen, its dropout
(whatever its adapter_config.json says) removed: it is part of the model trained over; the adapter
the run trains is peft's `default`, so that everything that saves, loads and counts the trained
part (its file keys, tunekit.methods.registry's save/load checks, the optimizer) sees it alone.
Both are active in every layer; peft's `active_adapter` stays `default` (its config is the one
peft's model-level code reads). Layers the start targets but the new one does not keep the start
alone, and the other way round.

The reference of a preference objective is base + start: `start_only` scales the new adapter by 0
for the length of the context (its output adds an exact zero), without touching which adapters are
active nor requires_grad (peft's own set_adapter would mark the start trainable and the new adapter
frozen). Merging folds both in (tunekit.methods.lora.method.LoRA.merge merges every active adapter
of a layer).

The fused kernel and the compute-dtype path over a 4-bit base compute one adapter; a layer with two
active adapters runs peft's own forward (tunekit.methods.lora.backend), in the reference forward as
in the trained model's, so both round alike.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING

from tunekit import TunekitError

if TYPE_CHECKING:
    import torch.nn as nn

START = "start"  # the frozen adapter's peft name
TRAINED = "default"  # the adapter the run trains
# Written beside every adapter the run saves: a copy of the folder alone is not the trained model, and
# tunekit.runs.open refuses to load it without its run (which reloads the start, its hash checked).
RECORD = "start_adapter.json"


def is_start_param(name: str) -> bool:
    """A parameter of the frozen start adapter (`...lora_A.start.weight`)."""
    return f".{START}." in name


def has_start(model: nn.Module) -> bool:
    return START in (getattr(model, "peft_config", None) or {})


def stack(model: nn.Module, peft_cfg, folder: Path, key: str = "model.adapter") -> nn.Module:
    """`model` (the prepared base) with the adapter in `folder` loaded frozen as `start` and a new
    adapter `default` of `peft_cfg` beside it, both active; only `default` trains."""
    import torch.nn as nn
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer
    from peft.tuners.tuners_utils import set_adapter

    try:
        peft_model = PeftModel.from_pretrained(model, str(folder), adapter_name=START, is_trainable=False)
    except (ValueError, KeyError, RuntimeError) as e:
        raise TunekitError(f"{key}: the LoRA adapter in {folder} does not fit the base model "
                           f"({str(e).splitlines()[0][:160]})") from None
    try:
        peft_model.add_adapter(TRAINED, peft_cfg)
    except ValueError as e:
        raise TunekitError(f"method: peft refuses this LoRA config: {str(e).splitlines()[0]}") from None
    for m in peft_model.modules():  # the start is part of the model: no dropout of its own in training mode
        if isinstance(m, LoraLayer) and START in m.lora_dropout:
            m.lora_dropout[START] = nn.Identity()
    object.__setattr__(peft_model, "_tunekit_start", Path(folder).resolve())
    set_adapter(peft_model.base_model.model, [START, TRAINED])
    peft_model.base_model.active_adapter = TRAINED
    for name, p in peft_model.named_parameters():
        p.requires_grad_(not is_start_param(name) and (f".{TRAINED}." in name))
    return peft_model


@contextlib.contextmanager
def start_only(model: nn.Module):
    """While open, every LoRA layer computes base + start: the new adapter stays active but scaled by 0,
    so that each layer runs the very code path (and rounding) of the trained model's forward, which
    differs from its one-adapter path over a 4-bit base (tunekit.methods.lora.backend); adding the
    exact zero leaves base + start bit for bit, and the first step's policy equals the reference."""
    from peft.tuners.lora import LoraLayer

    layers = [m for m in model.modules() if isinstance(m, LoraLayer) and TRAINED in m.scaling]
    before = [m.scaling[TRAINED] for m in layers]
    for m in layers:
        m.scaling[TRAINED] = 0.0
    try:
        yield
    finally:
        for m, scale in zip(layers, before):
            m.scaling[TRAINED] = scale

def write_record(model: nn.Module, out_dir: Path) -> None:
    """RECORD in an adapter folder saved from a stacked model: the start's folder and sha256."""
    import json

    from tunekit.owned import sha256_file

    folder = getattr(model, "_tunekit_start", None)
    if folder is None:
        return
    (Path(out_dir) / RECORD).write_text(json.dumps(
        {"start_adapter": str(folder), "sha256": sha256_file(folder / "adapter_model.safetensors"),
         "note": "trained over this frozen LoRA (model.adapter): load the run folder, or export it merged"}, indent=2))
