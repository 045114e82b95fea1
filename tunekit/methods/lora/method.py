"""LoRA (Hu et al. 2021, arXiv:2106.09685) through peft, on a bf16 or 4-bit NF4 base.

W x + (alpha / r) * B A dropout(x), with A: (r, in) Kaiming-initialised and B: (out, r) zero, so
the model is unchanged at step 0. peft keeps the frozen layer as `base_layer` and names the
adapter weights `lora_A` / `lora_B`, so what we save is a standard PEFT adapter folder that
`peft.PeftModel.from_pretrained` loads. Over a 4-bit base this is QLoRA (Dettmers et al. 2023).

Merging folds B A into W: peft's merge_and_unload on a bf16 base; on a 4-bit base each Linear4bit
is dequantized to fp32 from its packed codes and the fp32 delta added, so no 4-bit rounding of
the sum (tunekit.methods.merging, shared with the other merging methods).

A variant of LoRA is a key in `LoRAConfig`, its range check in `check_config`, its argument in
`peft_config`, and what it adds to the plan in `plan_terms`. The variants compose, except DoRA with a
PiSSA/OLoRA start (tunekit.methods.lora.variants says why, and does their saving and LoRA+'s groups):

* method.use_dora: DoRA (Liu et al. 2024, arXiv:2402.09353): W' = m * (W + s B A) / ||W + s B A||
  (row norms), m: (out,) trained; peft's layers only (the fused and compute-dtype 4-bit paths do
  not compute it: tunekit.methods.lora.backend keeps peft's). Over a 4-bit base: QDoRA.
* method.use_rslora: rsLoRA (Kalajdzievski 2023, arXiv:2312.03732): s = alpha / sqrt(r) instead of
  alpha / r. Whatever computes LoRA's output reads peft's `layer.scaling`, never alpha / r.
* method.init: default | pissa (Meng et al. 2024, arXiv:2404.02948) | olora (Buyukakyuz 2024,
  arXiv:2406.01775): B A starts at W's principal part and the base becomes W - s B A; bf16 bases only.
* method.loraplus_lr_ratio: LoRA+ (Hayou et al. 2024, arXiv:2402.12354): B trains at ratio x lr.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional

from tunekit import TunekitError
from tunekit.checks import names, number, one_of
from tunekit.methods.merging import dequantized_linear, replace_module, to_plain_model  # noqa: F401 (shared)
from tunekit.methods.lora import variants
from tunekit.methods.lora.config import LoRAConfig
from tunekit.methods.registry import Method, register
from tunekit.plan.shape import PROJECTIONS
from tunekit.plan.terms import PlanTerms, Site, planned_projections

if TYPE_CHECKING:
    import torch.nn as nn
    from peft import PeftModel


@dataclass(frozen=True)
class LoRAPlan:
    """What the planner needs of a LoRA setup (defaults: the planner's, dropout off)."""

    r: int = 16
    targets: tuple = PROJECTIONS
    dropout: float = 0.0
    dora: bool = False
    loftq_iters: int = 0  # method.init=loftq's alternations; 0: no LoftQ start


def check_targets(targets: list[str], model: nn.Module | None) -> list[str]:
    """method.target_modules: [all-linear] alone, or names that each match a module (peft matches a
    name or a dotted suffix of a module's path)."""
    targets = names("method.target_modules", targets)
    if "all-linear" in targets and len(targets) > 1:
        raise TunekitError(f"method.target_modules: all-linear stands alone, got {targets}")
    if model is None or targets == ["all-linear"]:
        return targets
    import torch.nn as nn

    modules = [n for n, _ in model.named_modules()]
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in modules)]
    if missing:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise TunekitError(f"method.target_modules: no module named {missing[0]!r} in {type(model).__name__}; "
                           f"its linear layers are {linear}, or use [all-linear]")
    # peft matches a name against every module, containers included: a ModuleList (layers), an
    # attention block (self_attn) or the embeddings would fail deep inside peft with an error that
    # blames something else (or wrap layers LoRA is not meant for). LoRA here wraps Linear layers.
    by_name = dict(model.named_modules())
    for t in targets:
        hits = [n for n in by_name if n == t or n.endswith("." + t)]
        if not any(isinstance(by_name[n], nn.Linear) for n in hits):
            linear = sorted({n.rsplit(".", 1)[-1] for n, m in by_name.items() if isinstance(m, nn.Linear)})
            raise TunekitError(f"method.target_modules: {t!r} names {type(by_name[hits[0]]).__name__} modules "
                               f"({hits[0]}), not Linear projections; LoRA wraps Linear layers: choose from "
                               f"{linear}, or use [all-linear]")
    return targets


def check_not_head(targets: list[str], model: nn.Module) -> None:
    """No LoRA on the output head (lm_head) in training. tunekit's loss applies the head as its weight
    matrix, in chunks over the trained positions (tunekit.losses.sft), never through the module peft
    would wrap: a LoRA there gets no gradient, and the first backward pass fails ("element 0 of
    tensors does not require grad") after the model has loaded and the run folder has been started
    (or, beside other targets, it silently stays at its start). Where the head is tied to the input
    embeddings (tie_word_embeddings), it is one tensor with them besides: a merge would change the
    embeddings too. Both are refused before a run loads anything; loading an adapter that has one
    (an older run's, peft's) is export's and eval's business, not refused here."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        return
    name = next((n for n, m in model.named_modules() if m is head), None)
    hit = next((t for t in targets if name is not None and (name == t or name.endswith("." + t))), None)
    if hit is None:
        return
    todo = f"drop {hit!r} from method.target_modules (to train the head, use method.name=full)"
    inputs = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if getattr(model.config, "tie_word_embeddings", False) and inputs is not None and head.weight is inputs.weight:
        where = Path(getattr(model.config, "name_or_path", "") or ".") / "config.json"
        raise TunekitError(f"method.target_modules: {hit!r} is the output head of {type(model).__name__}, and its "
                           f"weight is the input embeddings' (tie_word_embeddings is true for {where}): a LoRA on it "
                           f"would not train (tunekit's loss reads the head's weight, not a layer wrapped around it), "
                           f"and merging it would change the embeddings too; {todo}")
    raise TunekitError(f"method.target_modules: {hit!r} is the output head of {type(model).__name__}: a LoRA on it "
                       f"would not train (tunekit's loss reads the head's weight, not a layer wrapped around it); {todo}")


def peft_config(c: LoRAConfig, token_indices=None):
    """peft's LoraConfig of tunekit's LoRA keys; token_indices: the rows of tokens the run added
    (tunekit.model.vocab.peft_token_indices), trained as peft's trainable tokens."""
    from peft import LoraConfig

    targets = list(c.target_modules)
    return LoraConfig(r=c.r, lora_alpha=c.alpha, lora_dropout=c.dropout, bias="none", task_type="CAUSAL_LM",
                      # peft's own shorthand: every Linear but the output head
                      target_modules="all-linear" if targets == ["all-linear"] else targets,
                      use_dora=bool(c.use_dora), use_rslora=bool(c.use_rslora),
                      init_lora_weights=variants.PEFT_INIT[c.init], trainable_token_indices=token_indices)


TOKEN_ROWS = ".token_adapter.trainable_tokens_delta"  # peft's trained rows of added tokens


@register("lora")
class LoRA(Method):
    can_merge = True
    can_switch_off = True
    trains_new_tokens = True
    config = LoRAConfig
    adapter_kinds = ("LORA",)
    plan_options_type = LoRAPlan
    plan_aliases = {"lora_r": "r", "lora_targets": "targets", "lora_dropout": "dropout"}

    def switched_off(self, model: nn.Module):
        """peft's own switch: every LoRA layer (peft's and the fused kernel's) computes the base alone;
        over a frozen start adapter (model.adapter), base + start (tunekit.methods.lora.stacked)."""
        from tunekit.methods.lora import stacked

        return stacked.start_only(model) if stacked.has_start(model) else model.disable_adapter()

    def check_config(self, cfg, model: nn.Module | None = None, quantize: str = "none") -> None:
        c = self.settings(cfg)
        number("method.r", c.r, ge=1, integer=True)
        number("method.alpha", c.alpha, gt=0)  # the update is scaled by alpha / r: < 0 flips it, 0 removes it
        number("method.dropout", c.dropout, ge=0, lt=1)
        check_targets(c.target_modules, model)
        for key in ("use_dora", "use_rslora"):
            if not isinstance(getattr(c, key), bool):
                raise TunekitError(f"method.{key}: must be true or false, got {getattr(c, key)!r}")
        one_of("method.init", c.init, list(variants.PEFT_INIT))
        number("method.loftq_iters", c.loftq_iters, ge=1, le=variants.LOFTQ_MAX_ITERS, integer=True)
        if c.loraplus_lr_ratio is not None:
            number("method.loraplus_lr_ratio", c.loraplus_lr_ratio, gt=0)
        # With a model, the structure is being built: a LoftQ run's over the original weights is how
        # its merge into them works, so the base LoftQ needs is checked where it trains (config
        # validation, model None, and `start`).
        variants.check_combination(c, quantize if model is None else _quantize_of(model, quantize),
                                   training=model is None)

    def check_new_tokens(self, cfg, why: str) -> None:
        """peft saves a PiSSA/OLoRA adapter by converting it against its start, a LoRA without the new
        tokens' rows, which it then fails to load (a KeyError on the rows): refused before training."""
        init = self.settings(cfg).init
        if init in variants.REWRITES_BASE:
            raise TunekitError(f"{why}, whose new embedding rows peft cannot save beside a method.init={init} "
                               "start; use method.init=default, or a base whose tokenizer has them")

    def check_training(self, cfg, model: nn.Module) -> None:
        check_not_head(list(self.settings(cfg).target_modules), model)

    def apply(self, model: nn.Module, cfg, compute_start: bool = True) -> nn.Module:
        """compute_start=False (a rank other than 0, which receives rank 0's start): PiSSA/OLoRA layers
        built with peft's plain start, no SVD; their A, B and base weights are overwritten."""
        from peft import get_peft_model

        from tunekit.model.vocab import lean_embeddings, peft_token_indices

        self.check_config(cfg, model)
        c = self.settings(cfg)
        built = c if compute_start or c.init not in variants.REWRITES_BASE else replace(c, init="default")
        try:
            with variants.seeded(c.init in variants.REWRITES_BASE):  # PiSSA's randomized SVD: the same start on resume
                peft_model = get_peft_model(model, peft_config(built, peft_token_indices(model)))
        except ValueError as e:  # what check_config cannot see (a module type peft does not wrap)
            raise TunekitError(f"method: peft refuses this LoRA config: {str(e).splitlines()[0]}") from None
        for name, p in peft_model.named_parameters():  # the added tokens' rows train in fp32, as LoRA's A and B
            if TOKEN_ROWS in name:
                p.data = p.data.float()
        lean_embeddings(peft_model)  # their lookup without a copy of the matrix (tunekit.model.vocab)
        if c.init in variants.REWRITES_BASE:
            variants.keep_start(peft_model, self.saved_key)
        return peft_model

    def resolve_start(self, cfg, facts, plan, steps: int, kept: Optional[str] = None) -> Optional[str]:
        """method.init=auto -> loftq or default (tunekit.methods.lora.start_choice), in place (cfg: the
        whole training config; the other hooks take its method node)."""
        c = self.settings(cfg.method)
        if c.init != "auto":
            return None
        if kept in variants.PEFT_INIT and kept != "auto":
            cfg.method.init = kept
            return f"method.init=auto -> {kept} (the start this run's first start chose)"
        from tunekit.config import plain
        from tunekit.methods.lora.start_choice import choose_init
        from tunekit.plan.inputs import reference_is_base, runs_sharded

        if c.use_dora:
            init, why = "default", "DoRA sets its magnitude from the layer, which a LoftQ start would move"
        elif getattr(cfg.model, "adapter", None) is not None:
            init, why = "default", "model.adapter: the new adapter trains over a frozen start, and starts at zero"
        elif plan is not None and runs_sharded(cfg, plan.ranks):
            init, why = "default", ("under FSDP the base streams from one process to every rank's shards, which a "
                                    "LoftQ start (computed from the whole original weights) would stop")
        else:
            init, why = choose_init(plan.shape if plan else None, planned_projections(c.target_modules), c.loftq_iters,
                                    facts.type, plan.flops["total"] if plan else None, steps, plain(cfg.model.quantize),
                                    reference_is_base(cfg))
        cfg.method.init = init
        return f"method.init=auto -> {init}: {why}"

    def apply_over_start(self, model: nn.Module, cfg, folder: Path) -> nn.Module:
        """model.adapter: the LoRA in `folder` frozen under a new LoRA of `cfg` (tunekit.methods.lora.stacked)."""
        from tunekit.methods.lora import stacked

        self.check_config(cfg, model)
        return stacked.stack(model, peft_config(self.settings(cfg)), Path(folder))

    def start(self, model: nn.Module, cfg, model_dir: str, resume_dir: Optional[Path], log=None,
              compute_device=None) -> None:
        """method.init=loftq: the LoftQ start, computed layer by layer from model_dir's original weights
        (tunekit.methods.lora.loftq_io.start_loftq), on compute_device where given; resuming, the base
        the checkpoint trained over."""
        c = self.settings(cfg)
        if c.init != "loftq":
            return
        from tunekit.methods.lora import loftq_io

        if resume_dir is None:
            loftq_io.start_loftq(model, model_dir, c.loftq_iters, log, compute_device)
        else:
            loftq_io.after_load(model, resume_dir, log)

    def computes_start(self, cfg) -> bool:
        return self.settings(cfg).init in ("loftq", *variants.REWRITES_BASE)

    def start_tensors(self, model: nn.Module) -> dict:
        return variants.start_tensors(model)

    def start_extras(self, model: nn.Module):
        from tunekit.methods.lora import loftq_io

        return getattr(model, loftq_io.INIT_ATTR, None)  # the LoftQ start, saved beside the adapter

    def received_start(self, model: nn.Module, cfg, extras) -> None:
        from tunekit.methods.lora import loftq_io

        if extras is not None:
            object.__setattr__(model, loftq_io.INIT_ATTR, extras)
        if self.settings(cfg).init in variants.REWRITES_BASE:
            variants.keep_start(model, self.saved_key)  # A0, B0 as rank 0 kept them

    def owns(self, param_name: str) -> bool:
        if ".start." in param_name:  # a frozen start adapter's (tunekit.methods.lora.stacked.START)
            return False
        return (".lora_A." in param_name or ".lora_B." in param_name or ".lora_magnitude_vector." in param_name
                or TOKEN_ROWS + "." in param_name)

    def saved_key(self, param_name: str) -> str:
        """peft's file keys drop the adapter name: ...lora_A.default.weight -> ...lora_A.weight, and
        DoRA's ...lora_magnitude_vector.default.weight -> ...lora_magnitude_vector."""
        return (param_name.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")
                .replace(".lora_magnitude_vector.default.weight", ".lora_magnitude_vector")
                .replace(TOKEN_ROWS + ".default", TOKEN_ROWS))

    def expected_tensors(self, model: nn.Module) -> dict:
        """A PiSSA/OLoRA model saves the standard LoRA of rank 2r its training amounts to over the
        original base ([A; A0], [B, -B0]: lora_variants.converted)."""
        return variants.converted(super().expected_tensors(model), model)

    def write(self, model: PeftModel, out_dir: Path) -> None:
        from tunekit.methods.lora import stacked

        variants.save_peft(model, Path(out_dir))
        stacked.write_record(model, Path(out_dir))  # over a frozen start (model.adapter): which one
        from tunekit.methods.lora import loftq_io  # torch is loaded already: there is a model

        loftq_io.save_attached(model, Path(out_dir))  # a LoftQ start, for the merge into the original weights

    def read(self, model: PeftModel, in_dir: Path) -> None:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        state = variants.unconverted(load_file(str(Path(in_dir) / "adapter_model.safetensors")), model)
        result = set_peft_model_state_dict(model, state)
        unexpected = [k for k in result.unexpected_keys if "lora_" in k]
        if unexpected:
            raise TunekitError(f"{in_dir}: adapter does not fit this model (unexpected keys {unexpected[:3]})")
        _after_load(model, Path(in_dir))

    def merge(self, model: PeftModel) -> nn.Module:
        """W + s B A in every LoRA layer (s = layer.scaling: alpha / r, or alpha / sqrt(r) under rsLoRA;
        DoRA: m * (W + s B A) / ||W + s B A||, row norms); fp32 over a 4-bit base, the base dtype otherwise."""
        import torch
        from peft.tuners.lora import LoraLayer

        from tunekit.model.layers import is_4bit

        lora_layers = [(name, m) for name, m in model.named_modules() if isinstance(m, LoraLayer)]
        if not any(is_4bit(m.get_base_layer()) for _, m in lora_layers):
            return to_plain_model(model.merge_and_unload())
        base = model.get_base_model()
        prefix = "base_model.model."  # peft's path to the wrapped model
        for name, layer in lora_layers:
            merged = dequantized_linear(layer.get_base_layer()) if is_4bit(layer.get_base_layer()) else None
            if merged is None:  # a high-precision layer in a 4-bit model: peft merges it in place
                layer.merge()
                merged = layer.get_base_layer()
            else:
                with torch.no_grad():
                    for adapter in [a for a in layer.active_adapters if a in layer.lora_A]:  # a start, the new
                        merged.weight += layer.get_delta_weight(adapter).float()  # (out, in)
                        if layer.use_dora.get(adapter):  # DoRA: m * (W + s B A) / ||W + s B A|| (rows)
                            m = layer.lora_magnitude_vector[adapter].weight.float()  # (out,)
                            merged.weight *= (m / torch.linalg.norm(merged.weight, dim=1)).view(-1, 1)
            replace_module(base, name.removeprefix(prefix), merged)
        _merge_token_rows(base)
        return to_plain_model(base)

    # ------------------------------------------------------------ adapter folders
    def config_from_adapter(self, adapter_cfg: dict):
        from tunekit.methods import MethodConfig

        targets = adapter_cfg["target_modules"]
        targets = [targets] if isinstance(targets, str) else sorted(targets)
        return MethodConfig(name="lora", r=int(adapter_cfg["r"]), alpha=float(adapter_cfg["lora_alpha"]),
                            dropout=float(adapter_cfg.get("lora_dropout") or 0.0), target_modules=targets,
                            use_dora=bool(adapter_cfg.get("use_dora", False)),
                            use_rslora=bool(adapter_cfg.get("use_rslora", False)))

    def open_adapter(self, base: nn.Module, folder: Path) -> nn.Module:
        """Any peft LoRA folder (tunekit's, TRL's, ...) through peft's own loader."""
        from peft import PeftModel

        try:
            model = PeftModel.from_pretrained(base, str(folder))
        except (ValueError, KeyError, RuntimeError) as e:
            raise TunekitError(f"{folder}: this LoRA adapter does not fit the base model "
                               f"({str(e).splitlines()[0][:160]})") from None
        _after_load(model, Path(folder))
        model.requires_grad_(False)
        return model.eval()

    # ------------------------------------------------------------ the optimizer
    def param_groups(self, model: nn.Module, params: list, cfg, lr: float) -> list[dict]:
        """LoRA+ (method.loraplus_lr_ratio): B at ratio x lr; one group otherwise."""
        ratio = self.settings(cfg).loraplus_lr_ratio
        if ratio is None:
            return super().param_groups(model, params, cfg, lr)
        return variants.loraplus_groups(model, params, lr, ratio)

    # ------------------------------------------------------------ the training plan
    def plan_options(self, cfg) -> LoRAPlan:
        c = self.settings(cfg)
        return LoRAPlan(r=c.r, targets=planned_projections(c.target_modules), dropout=c.dropout,
                        dora=bool(c.use_dora), loftq_iters=c.loftq_iters if c.init == "loftq" else 0)

    def plan_label(self, o: LoRAPlan) -> str:
        start = f", LoftQ start ({o.loftq_iters} iteration{'s' if o.loftq_iters > 1 else ''})" if o.loftq_iters else ""
        return f"{'DoRA' if o.dora else 'LoRA'} r={o.r} on {len(o.targets)} projections{start}"

    def plan_setup(self, setup, shape, cfg, facts, dtype):
        """tunekit.methods.lora.backend's rules over a 4-bit base: the LoRA matmuls in bf16 (the CPU's torch
        path, the GPU's fused kernel or, where that is not trusted, the same torch path), never peft's
        fp32 branch; on a CPU with fused_lora=auto, the base kept dequantized in its compute dtype."""
        import torch

        from tunekit.device.facts import dense_cache_fits

        fused = getattr(cfg.kernels.fused_lora, "value", cfg.kernels.fused_lora)
        if setup.options.dora:  # peft's DoRA layers only: neither the kernel nor the compute-dtype path
            if fused == "on" and setup.quantize == "nf4":
                raise TunekitError(variants.DORA_NOT_FUSED)
            return setup
        if setup.quantize == "nf4" and dtype == torch.bfloat16 and fused != "off":
            setup = replace(setup, lora_compute=True, fused_kernel=facts.type == "cuda")
        if facts.type == "cpu" and setup.quantize == "nf4" and dtype in (torch.bfloat16, torch.float32) \
                and fused == "auto":
            weights = sum(i * o for p in setup.options.targets for i, o in [shape.projection(p)])
            dense = setup.compute_bytes * shape.num_layers * weights
            if dense_cache_fits(dense, facts):
                setup = replace(setup, dense_cache_bytes=dense)
        return setup

    def plan_terms(self, shape, setup) -> PlanTerms:
        o: LoRAPlan = setup.options
        per_layer = [n for p in o.targets for i, out in [shape.projection(p)] for n in (o.r * i, out * o.r)]
        flops = 2 * shape.num_layers * sum(o.r * (i + out) for p in o.targets for i, out in [shape.projection(p)])
        # The torch path (tunekit.methods.lora.compute_dtype) through a recomputed block: measured on the CPU
        # (tests/plan/test_plan_measured.py, qlora with checkpointing) its step peaks ~3 (T, m) buffers
        # above the rest of the walk, which tensors exactly is not pinned down; counted so that the
        # plan does not fall short (it read -18% without them).
        torch_path = setup.lora_compute and not setup.fused_kernel
        if o.dora:  # one magnitude (out,) per target; its per-position rescaling (variants.dora_flops)
            per_layer += [shape.projection(p)[1] for p in o.targets]
            flops += shape.num_layers * variants.dora_flops(o, shape)
        return PlanTerms(
            trainable=tuple(per_layer * shape.num_layers),
            saves=lambda site: _saves(o, setup, site, shape) + variants.dora_saves(o, site, shape),
            grad_outputs=frozenset(o.targets), forward_flops_per_token=flops,
            backward_flops_per_token=2 * flops,  # the input's gradient and the weights' through A and B
            block_backward_per_token=3 * shape.intermediate_size * setup.compute_bytes if torch_path else 0,
            block_transient_bytes=variants.dora_transient_bytes(o, shape),
            start_bytes=max((variants.loftq_start_bytes(*shape.projection(p), o.r, o.loftq_iters) for p in o.targets),
                            default=0) if o.loftq_iters else 0)


def _after_load(model: nn.Module, folder: Path) -> None:
    """A folder that trained from a LoftQ start (it holds the start file): the base it trained over,
    or the original weights minus the start (tunekit.methods.lora.loftq_io.after_load); nothing otherwise."""
    from tunekit.methods.lora import loftq_io  # torch is loaded already: there is a model

    loftq_io.after_load(model, folder)


def _merge_token_rows(base: nn.Module) -> None:
    """The added tokens' trained rows written into the embeddings (and an untied head), their
    wrappers removed (what peft's merge_and_unload does on a high-precision base)."""
    from peft.utils.other import TrainableTokensWrapper

    wrapped = [name for name, m in base.named_modules() if isinstance(m, TrainableTokensWrapper)]
    for name in wrapped:
        module = base.get_submodule(name)
        replace_module(base, name, module.unload_and_optionally_merge_module(merge=True, safe_merge=False,
                                                                            adapter_names=None))


def _quantize_of(model: nn.Module, quantize: str) -> str:
    """"nf4" where the model holds a 4-bit layer, else `quantize` as given."""
    from tunekit.model.layers import is_4bit

    return "nf4" if any(is_4bit(m) for m in model.modules()) else quantize


def _saves(o: LoRAPlan, setup, site: Site, shape) -> int:
    """Bytes the LoRA branches of the site's projections (sharing one input) keep.

    peft casts the input to the adapter's fp32, lora_A keeps that input and lora_B keeps
    A's (r,) output. A bf16 input is cast anew in every branch; an fp32 input is the same tensor
    for all branches (and costs nothing when another op already keeps it). With dropout each
    branch keeps its own dropped fp32 copy, and, when the input needs a gradient, the dropout
    mask (a bool per element on CUDA; on a CPU torch keeps the fp32 scaled noise).
    """
    branches = len([p for p in site.projections if p in o.targets])
    if not branches:
        return 0
    in_dim, e = site.in_dim(shape), site.dtype_bytes
    if setup.lora_compute:
        return site.tokens * _compute_path_saves(o, branches, in_dim, e, site.input_saved)
    r_part = 4 * o.r * branches
    if o.dropout > 0:
        per_token = r_part + (4 + (setup.dropout_mask_bytes if site.input_grad else 0)) * in_dim * branches
    elif e == 4:
        per_token = r_part + (0 if site.input_saved else 4 * in_dim)
    else:
        per_token = r_part + 4 * in_dim * branches
    return site.tokens * per_token


def _compute_path_saves(o: LoRAPlan, branches: int, in_dim: int, e: int, input_saved: bool) -> int:
    """The same for LoRA computed in the compute dtype (tunekit.methods.lora.compute_dtype on any device, or the
    fused Triton kernel on CUDA): each branch keeps its input as it came (the projections that share
    an input share that tensor) and A's (r,) output in the compute dtype; with dropout, each branch's
    keep-mask and dropped copy instead of the input (the CPU path's, in the compute dtype; the kernel
    keeps a bool mask and the input)."""
    r_part = e * o.r * branches
    if o.dropout > 0:
        return r_part + 2 * e * in_dim * branches
    return r_part + (0 if input_saved else e * in_dim)
