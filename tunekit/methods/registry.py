"""What a PEFT method is, and the registry everything else looks methods up in.

A method decides which small part of a frozen base trains. It is one file in this package with a
`Method` subclass registered under its name, and it owns everything about itself:

* its config: a dataclass of its `method.*` keys (defaults, one comment each) and `check_config`,
  the range checks naming the key; the method node's schema is the union of every registered
  method's keys (`config_schema`), and a key the chosen method does not read is refused
  (`check_own_keys`);
* its adapter folder: `write`/`read` in its standard format (PEFT, or tunekit's own), the kinds it
  is recognised by (`adapter_kinds`: adapter_config.json's "peft_type" or "method"), how to
  rebuild its structure from such a folder (`config_from_adapter`, `open_adapter`), `merge`;
* its part of the training plan: `plan_options` (its planner inputs) and `plan_terms`
  (tunekit.plan.terms), so that the planner never branches on a method's name.

The recipe calls `get_method(cfg.method.name)`. `save` and `load`, which everything else calls,
are defined once here around `write`/`read`, so that no method can save an incomplete adapter or
load one silently:

* save: write, then read the folder back; every trainable tensor must be there, equal to the
  model's (peft 0.21 once saved 0 tensors for layers it did not recognise).
* load: before touching the model, the folder must hold every tensor the model expects, in the
  expected shapes; the first missing or misfit key is named in one error.

Importing a method module must stay cheap (no torch, peft or transformers at import time): the
config schema is built from the registered methods whenever a command line is composed, before
anything else is needed. Layers and models are imported inside the functions that use them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional

from tunekit import TunekitError

if TYPE_CHECKING:  # annotations only: importing torch here would make every config composition pay for it
    import torch
    import torch.nn as nn

    from tunekit.plan.memory import TrainSetup
    from tunekit.plan.shape import ModelShape
    from tunekit.plan.terms import PlanTerms


@dataclasses.dataclass(frozen=True)
class NoOptions:
    """The planner options of a method that has none."""


class Method:
    name: str = "?"
    can_merge: bool = False
    # Whether the trained parameters are the model's own weights, kept in fp32 as master copies, so
    # that the forward computes under the precision policy's autocast (tunekit.device.precision). The other
    # methods add small parts that compute in fp32 and hand back the frozen base's dtype.
    autocast: bool = False
    # Whether the base's own weights are the trained part (no frozen copy to plan; fp32 residual
    # stream and head; a 4-bit base cannot train this way).
    trains_base: bool = False
    # Whether the method puts positions of its own before every example (prompt tuning's virtual
    # tokens), which packed rows' per-example attention cannot place (tunekit.speed.packed_attention).
    prepends_positions: bool = False
    # Whether `switched_off` can run the model as the base alone (the reference model of preference
    # objectives, tunekit.train.preference): peft's disable_adapter, or the hooks' switch below.
    can_switch_off: bool = False
    # Whether the method trains the embedding rows of tokens a run adds to the tokenizer
    # (data.chat_template; tunekit.model.vocab): LoRA, through peft's trainable tokens.
    trains_new_tokens: bool = False
    # The method.* keys this method reads: a dataclass (defaults and comments), or None for none.
    config: Optional[type] = None
    # adapter_config.json's "peft_type" (peft formats) or "method" (tunekit's formats) it writes.
    adapter_kinds: tuple = ()
    # The planner's inputs (a frozen dataclass; its defaults are the planner's defaults), and the
    # keywords older versions of tunekit.plan.memory.TrainSetup took for them: {keyword: option}.
    plan_options_type: type = NoOptions
    plan_aliases: dict = {}

    # ------------------------------------------------------------ config
    def settings(self, cfg) -> Any:
        """This method's keys read off a method config (tunekit.methods.MethodConfig or any object with
        the attributes): an instance of `config`, a key that is absent or null taking its default."""
        if self.config is None:
            return None
        values = {}
        for f in dataclasses.fields(self.config):
            value = getattr(cfg, f.name, None)
            if value is not None:
                values[f.name] = list(value) if isinstance(value, (list, tuple)) or _is_list_config(value) else value
            elif not _optional(self.config, f.name):
                values[f.name] = _default(f)
        return self.config(**values)

    def check_config(self, cfg, model: nn.Module | None = None, quantize: str = "none") -> None:
        """Raise TunekitError naming the method.* key of a bad value. Without `model`: what needs
        no model (ranges, names). With the base (loaded, or a skeleton on the meta device) and its
        `quantize`: also that what the config names exists in it. Config validation calls this
        before anything loads (through `check_method_config`), and `apply` calls it again."""

    def check_training(self, cfg, model: nn.Module) -> None:
        """Raise TunekitError for what a run cannot train, though an adapter made so could still be
        loaded (an older run's, or peft's): checked before a run, never when loading one. `model`:
        the base's skeleton on the meta device."""

    def check_context(self, cfg, seq_len: int, limit: int, where: str) -> None:
        """Raise TunekitError if `seq_len` positions (data.max_seq_len) plus what the method adds
        exceed the `limit` positions the model in `where` was built for."""

    # ------------------------------------------------------------ the trained part
    def switched_off(self, model: nn.Module):
        """A context in which `model` computes as its frozen base alone (no second copy of the base).
        Methods whose part is forward hooks share one process-wide switch (`trained_part_off`)."""
        if not self.can_switch_off:
            raise TunekitError(f"method {self.name}: its trained part cannot be switched off")
        return trained_part_off()

    def apply(self, model: nn.Module, cfg) -> nn.Module:
        """Freeze the base, add the method's trainable parameters; return the model to train."""
        raise NotImplementedError

    def apply_over_start(self, model: nn.Module, cfg, folder: Path) -> nn.Module:
        """`apply` over a frozen start adapter loaded from `folder` (model.adapter): the LoRA family only."""
        raise TunekitError(f"model.adapter: method {self.name} cannot train over a frozen start adapter; use lora")

    def start(self, model: nn.Module, cfg, model_dir: str, resume_dir: Optional[Path], log=None,
              compute_device: Optional[torch.device] = None) -> None:
        """Training only, after `apply` and before the compute path is chosen: a start computed from
        the base's original weights in `model_dir` (LoRA's LoftQ). resume_dir: the checkpoint's
        adapter folder when resuming (restore, do not recompute). compute_device: where to compute
        it, when not where the base sits (FSDP keeps the base in host memory until it shards: rank
        0's GPU computes the start). Evaluating and exporting never call this: `read` restores what
        they need from the adapter folder. Nothing by default."""

    def resolve_start(self, cfg, facts, plan, steps: int, kept: Optional[str] = None) -> Optional[str]:
        """Training only, before the model loads, once the run's steps are known: resolve the method's
        own `auto` start settings in cfg (the whole training config, not its method node) (LoRA's method.init=auto) from the device facts and the run's
        plan (None where the planner cannot model it); kept: the value a resumed run's first start
        chose. Returns the line to log, or None (nothing to resolve, the default)."""
        return None

    # ------------------------------------------------------------ a start computed once, on rank 0
    # With several ranks a computed start (LoRA's LoftQ, PiSSA, OLoRA: SVDs of every target) runs on
    # rank 0 alone; the others apply the method with compute_start=False (`apply`'s keyword, only
    # passed where `computes_start`), skip `start`, and receive `start_tensors` (bit for bit) and
    # `start_extras` from rank 0 (tunekit.train.start).
    def computes_start(self, cfg) -> bool:
        """Whether `apply` and `start` compute a start worth computing once (nothing by default)."""
        return False

    def start_tensors(self, model: nn.Module) -> dict:
        """{name: tensor} of everything the start may write, in a fixed order, on every rank."""
        return {}

    def start_extras(self, model: nn.Module) -> Any:
        """Rank 0: what else the start left on the model (picklable), for `received_start`."""
        return None

    def received_start(self, model: nn.Module, cfg, extras: Any) -> None:
        """Ranks other than 0, after `start_tensors` arrived: rebuild what the start keeps on the model."""

    def check_new_tokens(self, cfg, why: str) -> None:
        """Refuse (one TunekitError starting with `why`, what adds the tokens) a run whose tokenizer
        gains tokens whose embedding rows this method, so configured, cannot train."""
        if not self.trains_new_tokens:
            raise TunekitError(f"{why}, whose new embedding rows method {self.name} cannot train; use "
                               "method.name=lora, or a base whose tokenizer has them")

    def write(self, model: nn.Module, out_dir: Path) -> None:
        """Write the trained part in its standard (PEFT, or tunekit adapter) format."""
        raise NotImplementedError

    def read(self, model: nn.Module, in_dir: Path) -> None:
        """Load weights written by `write` into a model that went through `apply`."""
        raise NotImplementedError

    def owns(self, param_name: str) -> bool:
        """Whether `param_name` is one of the parameters this method added (and trains)."""
        raise NotImplementedError

    def saved_key(self, param_name: str) -> str:
        """The key under which `write` stores the method's parameter `param_name`."""
        return param_name

    def merge(self, model: nn.Module) -> nn.Module:
        """Fold the trained part into the base: a plain transformers model (no peft wrappers, no
        bitsandbytes layers, no hooks) whose logits equal the trained model's. A 4-bit base comes
        out dequantized in fp32. May reuse `model`'s storage: do not train `model` afterwards."""
        raise cannot_merge(self.name)

    # ------------------------------------------------------------ the optimizer
    def param_groups(self, model: nn.Module, params: list, cfg, lr: float) -> list[dict]:
        """The optimizer's parameter groups over `params` (the tensors it steps, as the strategy hands
        them), each a dict with "params" and optionally its own "lr"; `cfg`: the method config. One
        group at trainer.lr unless the method says otherwise (LoRA+)."""
        return [{"params": list(params), "lr": lr}]

    # ------------------------------------------------------------ a standalone adapter folder
    def config_from_adapter(self, adapter_cfg: dict):
        """The MethodConfig that rebuilds, with `apply`, the structure an adapter folder of this
        method was written from (its adapter_config.json, parsed). KeyError for a missing key."""
        raise TunekitError(f"method {self.name!r} writes no adapter folder of its own")

    def open_adapter(self, base: nn.Module, folder: Path) -> nn.Module:
        """Base + the adapter folder's trained part, frozen, in eval mode."""
        try:
            cfg = self.config_from_adapter(_read_adapter_config(Path(folder)))
        except KeyError as e:
            raise TunekitError(f"{Path(folder) / 'adapter_config.json'}: missing key {e}") from None
        model = self.apply(base, cfg)
        self.load(model, Path(folder))
        model.requires_grad_(False)
        return model.eval()

    # ------------------------------------------------------------ the training plan
    def plan_options(self, cfg) -> Any:
        """The planner's inputs from the method config; TunekitError naming the key the planner
        cannot model."""
        return self.plan_options_type()

    def plan_terms(self, shape: ModelShape, setup: TrainSetup) -> PlanTerms:
        """What the method adds to the plan of `setup` over a base of this shape (tunekit.plan.terms)."""
        raise NotImplementedError

    def plan_setup(self, setup: TrainSetup, shape: ModelShape, cfg, facts, dtype) -> TrainSetup:
        """The setup with what this method's layers decide on this device (a compute path, a cache)."""
        return setup

    def plan_label(self, options) -> str:
        """A few words for `tunekit plan`'s header: what trains."""
        return self.name

    # ------------------------------------------------------------ defined once, for every method
    def expected_tensors(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """{saved key: parameter} for every parameter the method owns (trainable while training;
        export and evaluation freeze them, and must still save and load all of them)."""
        return {self.saved_key(name): p for name, p in model.named_parameters() if self.owns(name)}

    def save(self, model: nn.Module, out_dir: Path) -> None:
        """write(), then prove the folder holds every trainable tensor, equal to the model's."""
        from tunekit.methods.saving import verify_saved

        self.write(model, Path(out_dir))
        verify_saved(Path(out_dir), self.expected_tensors(model))

    def load(self, model: nn.Module, in_dir: Path) -> None:
        """Refuse a folder that lacks any expected tensor (or holds one of another shape), then read()."""
        from tunekit.methods.saving import check_loadable

        check_loadable(Path(in_dir), self.expected_tensors(model))
        self.read(model, Path(in_dir))


_OFF = [0]  # depth of the trained_part_off() contexts open in this process


@contextlib.contextmanager
def trained_part_off():
    """While open, the hook-based methods' hooks (BitFit, (IA)^3, bottleneck adapters) leave their
    module's input and output as the base computes them."""
    _OFF[0] += 1
    try:
        yield
    finally:
        _OFF[0] -= 1


def is_off() -> bool:
    return _OFF[0] > 0


_REGISTRY: Dict[str, Callable[[], Method]] = {}


def register(name: str):
    def deco(cls):
        from tunekit.plan.memory import register_planner

        _REGISTRY[name] = cls
        cls.name = name
        register_planner(name, cls)  # the planner takes its terms from the method, never imports it
        return cls

    return deco


def get_method(name: str) -> Method:
    if name not in _REGISTRY:
        raise TunekitError(f"method.name: unknown method {name!r}; available: {sorted(_REGISTRY)}")
    return _REGISTRY[name]()


def check_method_config(cfg, model: nn.Module | None = None, quantize: str = "none") -> None:
    """cfg: the method config (name, r, ...). The method's own checks, without a branch on its name."""
    get_method(cfg.name).check_config(cfg, model, quantize)


def fill_method_defaults(cfg) -> None:
    """Set the keys of cfg's method that are null (a key several methods declare with different
    defaults is null in the schema) to that method's defaults, in place."""
    method = get_method(cfg.name)
    if method.config is None:
        return
    resolved = method.settings(cfg)
    for f in dataclasses.fields(method.config):
        if getattr(cfg, f.name, None) is None and getattr(resolved, f.name) is not None:
            setattr(cfg, f.name, getattr(resolved, f.name))


def foreign_keys(cfg) -> list[str]:
    """The method.* keys of cfg set to a value the chosen method never reads ("method.r=4" with
    method.name=ia3): keys of other methods that differ from the schema's default."""
    method = get_method(cfg.name)
    own = {f.name for f in dataclasses.fields(method.config)} if method.config is not None else set()
    out = []
    for f in dataclasses.fields(config_schema()):
        if f.name == "name" or f.name in own:
            continue
        value = getattr(cfg, f.name, None)
        value = list(value) if _is_list_config(value) or isinstance(value, tuple) else value
        if value is not None and value != _default(f):
            out.append(f"method.{f.name}={value}")
    return out


def own_keys(name: str) -> list[str]:
    """The method.* keys the method `name` reads (besides `name`)."""
    method = get_method(name)
    return [f.name for f in dataclasses.fields(method.config)] if method.config is not None else []


def check_own_keys(cfg, sweep: tuple = (), given: Optional[set] = None) -> None:
    """A key of another method is refused in one line, not ignored: the run would not be the one
    the command line describes. `sweep`: the method names of every job of a -m sweep; a key one of
    them reads is left to the jobs of that method (`-m recipe=lora,ia3 method.r=8`). `given`: the
    method keys the command line set (None: every key); a recipe's own keys for its method are not
    the user's when method.name switches the method (`recipe=lora method.name=full`)."""
    shared = {k for name in sweep for k in own_keys(name)}
    foreign = [k for k in foreign_keys(cfg) if k.split("=")[0].removeprefix("method.") not in shared
               and (given is None or k.split("=")[0].removeprefix("method.") in given)]
    if foreign:
        raise TunekitError(f"{foreign[0].split('=')[0]}: method {cfg.name!r} has no such key (its keys: "
                           f"{', '.join(own_keys(cfg.name)) or 'none'}); remove it, or choose the method that reads it")


def available_methods() -> list[str]:
    return sorted(_REGISTRY)


def adapter_kinds() -> dict[str, str]:
    """{adapter_config.json "peft_type" or "method": the name of the method that reads it}."""
    return {kind: name for name, cls in _REGISTRY.items() for kind in cls.adapter_kinds}


def method_for_adapter(folder: str | Path) -> Method:
    """The method that reads an adapter folder, recognised by its adapter_config.json: peft's
    "peft_type" (LORA, PROMPT_TUNING, IA3) or tunekit's "method" (bottleneck adapters, BitFit).
    One error line for a folder without one, unreadable, or of a kind no method reads."""
    folder = Path(folder)
    cfg = _read_adapter_config(folder)
    kind = cfg.get("peft_type") or cfg.get("method")
    kinds = adapter_kinds()
    if kind not in kinds:
        raise TunekitError(f"{folder}: holds a {kind} adapter; tunekit loads {', '.join(kinds)}")
    return get_method(kinds[kind])


def _read_adapter_config(folder: Path) -> dict:
    path = folder / "adapter_config.json"
    if not path.is_file():
        raise TunekitError(f"{folder}: no adapter_config.json (not an adapter folder)")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise TunekitError(f"{path}: not readable JSON ({type(e).__name__}: {str(e).splitlines()[0][:120]})") from None
    if not isinstance(data, dict):
        raise TunekitError(f"{path}: expected a JSON object")
    return data


def trainable_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts; 4-bit params count their logical size."""
    trainable = total = 0
    for p in model.parameters():
        n = p.numel()
        # bitsandbytes packs two 4-bit values per uint8 element
        if getattr(p, "quant_state", None) is not None:
            n = p.quant_state.shape.numel() if hasattr(p.quant_state, "shape") else n * 2
        total += n
        if p.requires_grad:
            trainable += n
    return trainable, total


def cannot_merge(name: str) -> TunekitError:
    """The error of a method whose trained part has no equivalent inside the base's weights."""
    return TunekitError(
        f"method {name!r} cannot be merged into the base model (its trained part is not a change to "
        "existing weights); export the adapter instead (--format adapter)"
    )


# ------------------------------------------------------------------ the method.* schema
_SCHEMAS: dict = {}


def config_schema() -> type:
    """The method node's schema: `name`, then the keys of every registered method in the order
    they registered, each once. A key several methods declare must have one type; where their
    defaults differ, the schema's default is null, read as "the chosen method's default"
    (`Method.settings`, and `fill_method_defaults` when a config is validated). Built once per
    process, after every method has registered (tunekit.methods imports them all)."""
    if "method" in _SCHEMAS:
        return _SCHEMAS["method"]
    declared: dict[str, list] = {}  # key -> [type, [defaults], first field]
    for cls in _REGISTRY.values():
        if cls.config is None:
            continue
        hints = typing.get_type_hints(cls.config)
        for f in dataclasses.fields(cls.config):
            entry = declared.setdefault(f.name, [hints[f.name], [], f])
            if entry[0] != hints[f.name]:
                raise TypeError(f"method.{f.name}: {cls.__name__} declares it as {hints[f.name]}, another method as "
                                f"{entry[0]}; a shared key needs one type")
            entry[1].append(_default(f))
    fields = [("name", str, dataclasses.field(default="lora"))]
    for key, (kind, defaults, first) in declared.items():
        if all(d == defaults[0] for d in defaults[1:]):
            fields.append((key, kind, _same_default(first)))
        else:
            fields.append((key, Optional[kind] if not _is_optional(kind) else kind, dataclasses.field(default=None)))
    from tunekit.config import MethodConfig  # the node as the plain schema knows it (its name)

    schema = dataclasses.make_dataclass("MethodConfig", fields, bases=(MethodConfig,))
    schema.__module__ = "tunekit.methods"  # where it is built and exported
    _SCHEMAS["method"] = schema
    return schema


def train_schema() -> type:
    """tunekit.config.TrainConfig with its method node typed by `config_schema`: what Hydra composes
    recipes and command lines against, and what a run's saved config.yaml is read back into."""
    if "train" not in _SCHEMAS:
        from tunekit.config import TrainConfig

        method = config_schema()
        schema = dataclasses.make_dataclass(
            "TrainConfig", [("method", method, dataclasses.field(default_factory=method))], bases=(TrainConfig,))
        schema.__module__ = "tunekit.methods"
        _SCHEMAS["train"] = schema
    return _SCHEMAS["train"]


def in_train_schema(cfg):
    """A TrainConfig (built in Python, its method node any object with the keys) as an instance of
    `train_schema`, so that OmegaConf writes every key of its method node (a run's config.yaml)."""
    method = config_schema()
    node = cfg.method if isinstance(cfg.method, method) else method(
        **{f.name: getattr(cfg.method, f.name) for f in dataclasses.fields(method) if hasattr(cfg.method, f.name)})
    return train_schema()(**{**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}, "method": node})


def _default(f: dataclasses.Field):
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


def _same_default(f: dataclasses.Field) -> dataclasses.Field:
    if f.default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=f.default_factory)
    return dataclasses.field(default=f.default)


def _is_optional(kind) -> bool:
    return typing.get_origin(kind) is typing.Union and type(None) in typing.get_args(kind)


def _optional(config: type, key: str) -> bool:
    return _is_optional(typing.get_type_hints(config)[key])


def _is_list_config(value) -> bool:
    return type(value).__name__ == "ListConfig"  # OmegaConf's list, without importing omegaconf
