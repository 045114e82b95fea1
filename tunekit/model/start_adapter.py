"""`model.adapter`: the LoRA adapter a run starts from, loaded frozen under the adapter it trains.

It names a tunekit run folder (its `adapter/`, the base its config.yaml trained over) or a peft
LoRA folder (adapter_config.json + adapter_model.safetensors, its base in
`base_model_name_or_path`). Everything here reads small files only, so that a wrong folder is
refused before the model loads:

    open_start(path)              the folder, its adapter_config.json, the base it records, its hash
    check_start_base(start, ...)  the same base as model.path, and tensors that fit the model's layers

The content hash (sha256 of adapter_model.safetensors) goes into the run's fingerprint (a resume
refuses a changed file) and summary.json; `tunekit eval`/`export`/`generate` of the run reload the
adapter from the recorded path and refuse it where the hash differs (tunekit.runs.open).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from tunekit import TunekitError

KEY = "model.adapter"
WEIGHTS = "adapter_model.safetensors"
# adapter_config.json keys of peft features that stacking under a new LoRA does not handle (each must be off)
UNSUPPORTED = {"use_dora": "DoRA", "modules_to_save": "modules_to_save", "lora_bias": "LoRA biases",
               "layer_replication": "layer replication", "trainable_token_indices": "trainable tokens",
               "target_parameters": "target_parameters"}
LOFTQ_FILE = "loftq_init.safetensors"  # tunekit.methods.lora.loftq_io.LOFTQ_INIT_FILE (a LoftQ start's base differs)


@dataclass(frozen=True)
class StartAdapter:
    """The adapter `model.adapter` names, read from its small files."""

    given: str  # as written in the config
    folder: Path  # the adapter folder (RUN/adapter, or the folder given)
    run_dir: Optional[Path]  # the run it belongs to, where `given` is a run folder
    base: Optional[str]  # the base it trained over, as recorded (None: a run over the default model, or unrecorded)
    recorded: bool  # whether the folder records its base at all
    config: dict  # adapter_config.json
    sha256: str  # of adapter_model.safetensors

    def record(self) -> dict:
        """What summary.json keeps of it."""
        return {"path": self.given, "folder": str(self.folder.resolve()), "sha256": self.sha256,
                "base": self.base if self.recorded else "(not recorded)"}


def open_start(path: str, key: str = KEY) -> StartAdapter:
    """The adapter folder `path` names, checked: it exists, holds a whole LoRA adapter whose features
    a stacked start supports, and (a run) did not itself start from another adapter."""
    import yaml

    from tunekit.model.folder import _safetensors_header, read_json
    from tunekit.owned import sha256_file

    p = Path(str(path)).expanduser()
    if not p.exists():
        raise TunekitError(f"{key}: no such folder: {path}")
    if not p.is_dir():
        raise TunekitError(f"{key}: {path} is a file; give a tunekit run folder or a LoRA adapter folder "
                           "(adapter_config.json + adapter_model.safetensors)")
    run_dir, folder, base, recorded = None, p, None, False
    if (p / "config.yaml").is_file():
        run_dir, folder = p, p / "adapter"
        try:
            saved = yaml.safe_load((p / "config.yaml").read_text()) or {}
            model = saved.get("model") or {}
        except (OSError, ValueError, yaml.YAMLError, AttributeError) as e:
            raise TunekitError(f"{key}: {p / 'config.yaml'} is not a readable tunekit config "
                               f"({type(e).__name__})") from None
        base, recorded = model.get("path"), True
        if model.get("adapter"):
            raise TunekitError(f"{key}: the run {p} itself started from the adapter {model['adapter']}; stacking a "
                               "third adapter is not supported: export that run merged (tunekit export RUN --format "
                               "merged) and train on the merged folder (model.path=...) instead")
        if not (folder / WEIGHTS).is_file():
            raise TunekitError(f"{key}: the run {p} has no finished adapter ({folder / WEIGHTS}); finish or resume "
                               "it first")
    if not (folder / "adapter_config.json").is_file() or not (folder / WEIGHTS).is_file():
        raise TunekitError(f"{key}: {p} holds no adapter (neither a tunekit run folder with adapter/ nor a peft "
                           f"adapter folder with adapter_config.json and {WEIGHTS})")
    cfg = read_json(folder / "adapter_config.json", key)
    kind = cfg.get("peft_type") or cfg.get("method")
    if kind != "LORA":
        raise TunekitError(f"{key}: {folder} holds a {kind} adapter; model.adapter takes a LoRA adapter (a run of "
                           "recipe lora, qlora or dpo, or a peft LoRA folder)")
    used = [what for k, what in UNSUPPORTED.items() if cfg.get(k) not in (None, False, {}, [], "none")]
    if (folder / LOFTQ_FILE).is_file():
        used.append("a LoftQ start (it trained over another base than model.path's weights)")
    if used:
        raise TunekitError(f"{key}: {folder} uses {', '.join(used)}; a frozen start supports plain LoRA (rsLoRA "
                           "allowed): export it merged and train on the merged folder instead")
    _safetensors_header(folder / WEIGHTS, key)  # whole, before any model loads
    if run_dir is None:
        base = cfg.get("base_model_name_or_path")
        recorded = bool(base)
    return StartAdapter(str(path), folder, run_dir, base, recorded, cfg, sha256_file(folder / WEIGHTS))


def _local(path: Optional[str]) -> Optional[Path]:
    """The folder a model.path value names on this machine (the default model once converted), or None
    (a hub id, or a path recorded on another machine)."""
    if path is None:
        from tunekit.model.default import converted_default_dir

        return converted_default_dir()
    p = Path(str(path)).expanduser()
    return p.resolve() if p.is_dir() else None


def check_start_base(start: StartAdapter, model_path: Optional[str], skeleton=None, key: str = KEY) -> Optional[str]:
    """`start` trained over the base model.path names, and every tensor of it fits a Linear of `skeleton`
    (the base built on the meta device) in shape. The recorded base (a run's model.path, a peft folder's
    base_model_name_or_path) and model.path are compared as folders where both are on this machine
    (the same folder, or refused naming both), as names otherwise; a base recorded as a name that is
    not on this machine (a hub id, another machine's path) and differs from model.path leaves the shapes
    to decide: the note that says so is returned (None otherwise)."""
    note = None
    if start.recorded and start.base != model_path:
        recorded, given = _local(start.base), _local(model_path)
        where = f"the run {start.run_dir} trained over" if start.run_dir else f"{start.folder} was trained over"
        if recorded is not None and given is not None:
            same = recorded == given
        elif recorded is not None or start.base is None:
            same = False  # a local (or the default) base against a name: not the same folder
        else:
            same, note = True, (f"{key}: {where} {start.base}, which is not a folder on this machine; model.path "
                                f"{model_path or '(the default model)'} is taken for it, checked by the tensors' "
                                "shapes")
        if not same:
            raise TunekitError(f"{key}: {where} {start.base or 'the default model'}, but model.path is "
                               f"{model_path or 'the default model'}; a frozen start adapter needs the base it "
                               "trained over (set model.path to it)")
    if skeleton is not None:
        check_fits(start, skeleton, key)
    return note


def check_fits(start: StartAdapter, skeleton, key: str = KEY) -> None:
    """Each lora_A (r, in) / lora_B (out, r) of the adapter's file names a Linear of `skeleton` with
    those in/out features (another architecture, or another size of it, is named here)."""
    import torch.nn as nn

    from tunekit.model.folder import _safetensors_header

    shapes = _safetensors_header(start.folder / WEIGHTS, key)
    modules = dict(skeleton.named_modules())
    head = skeleton.get_output_embeddings() if hasattr(skeleton, "get_output_embeddings") else None
    head_name = next((n for n, m in modules.items() if head is not None and m is head), None)
    for name, shape in sorted(shapes.items()):
        part = ".lora_A." if ".lora_A." in name else ".lora_B." if ".lora_B." in name else None
        if part is None:  # an embedding's LoRA (lora_embedding_A/B), a trained bias...: not a start tunekit stacks
            raise TunekitError(f"{key}: {start.folder}'s tensor {name} is not a Linear layer's lora_A/lora_B; a frozen "
                               "start supports LoRA on Linear layers only: export it merged and train on that folder")
        path = name.split(part)[0].removeprefix("base_model.model.")
        layer = modules.get(path)
        if head_name is not None and path == head_name:
            raise TunekitError(f"{key}: {start.folder} has a LoRA on the output head ({path}), which tunekit's loss "
                               "reads as a plain weight (the LoRA would be ignored); export it merged and train on "
                               "the merged folder instead")
        if not isinstance(layer, nn.Linear):
            raise TunekitError(f"{key}: {start.folder}'s tensor {name} names no Linear layer {path!r} in "
                               f"{type(skeleton).__name__} (model.path): the adapter is of another architecture")
        want = layer.in_features if part == ".lora_A." else layer.out_features
        got = shape[1] if part == ".lora_A." else shape[0]
        if len(shape) != 2 or got != want:
            raise TunekitError(f"{key}: {start.folder}'s tensor {name} has shape {shape}, but {path} of model.path "
                               f"is Linear({layer.in_features} -> {layer.out_features}): the adapter is of another "
                               "model size")
