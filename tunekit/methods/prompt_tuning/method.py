"""Prompt tuning (Lester et al. 2021, arXiv:2104.08691): a trained soft prompt, the base untouched.

N virtual tokens P: (N, dim) are prepended to every sequence's input embeddings; only P trains
(in fp32; cast to the embedding dtype on the way in). P starts as the embeddings of a text
(method.prompt_init_text, tokenized and repeated/truncated to N tokens, Lester's "class label"
style init) or, when that is null, of N vocabulary rows drawn from the global RNG the trainer
seeded (Lester's "sampled vocabulary" init).

Position ids are the default 0..N+L-1, the soft prompt first, exactly as peft's
PeftModelForCausalLM does it, so the saved folder is a standard peft PROMPT_TUNING adapter
(adapter_config.json + adapter_model.safetensors with `prompt_embeddings`: (N, dim)) that
`peft.PeftModel.from_pretrained` loads and runs to the same logits. The model it trains is
tunekit.methods.prompt_tuning.soft_prompt.SoftPromptLM.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from tunekit import TunekitError
from tunekit.checks import number
from tunekit.methods.registry import Method, register
from tunekit.methods.prompt_tuning.config import PromptTuningConfig
from tunekit.plan.terms import PlanTerms

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

    from tunekit.methods.prompt_tuning.soft_prompt import SoftPromptLM


@dataclass(frozen=True)
class PromptTuningPlan:
    num_virtual_tokens: int = 20


def init_token_ids(tokenizer, text: str, n: int) -> list[int]:
    """The text's token ids repeated and truncated to exactly n (as peft's TEXT init does)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise TunekitError("method.prompt_init_text: tokenizes to no tokens; give some text or null")
    return (ids * math.ceil(n / len(ids)))[:n]


def _model_path(model: nn.Module) -> str | None:
    return getattr(model.config, "_name_or_path", None) or getattr(model, "name_or_path", None) or None


def load_soft_prompt(in_dir: Path | str, hidden_size: int) -> torch.Tensor:
    """The soft prompt (N, hidden_size) fp32 of a peft PROMPT_TUNING folder; one clear error otherwise."""
    from safetensors.torch import load_file

    in_dir = Path(in_dir)
    if not in_dir.is_dir():
        raise TunekitError(f"adapter {in_dir}: no such folder")
    cfg_path, weights = in_dir / "adapter_config.json", in_dir / "adapter_model.safetensors"
    if not cfg_path.is_file() or not weights.is_file():
        raise TunekitError(f"adapter {in_dir}: needs adapter_config.json and adapter_model.safetensors (not an adapter folder)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise TunekitError(f"adapter {in_dir}: adapter_config.json is not valid JSON ({e})") from None
    kind = cfg.get("peft_type") or cfg.get("method")
    if kind != "PROMPT_TUNING":
        raise TunekitError(f"adapter {in_dir}: a {kind} adapter, not a prompt-tuning (soft prompt) one")
    if cfg.get("num_transformer_submodules", 1) != 1:
        raise TunekitError(f"adapter {in_dir}: num_transformer_submodules={cfg['num_transformer_submodules']}; "
                           "only decoder-only (1) soft prompts are supported")
    prompt = load_file(str(weights)).get("prompt_embeddings")
    if prompt is None or prompt.dim() != 2:
        raise TunekitError(f"adapter {in_dir}: adapter_model.safetensors has no (N, dim) 'prompt_embeddings'")
    if prompt.shape[1] != hidden_size:
        raise TunekitError(f"adapter {in_dir}: soft prompt has hidden size {prompt.shape[1]}, the model has "
                           f"{hidden_size} (trained for another base model?)")
    return prompt.float()


@register("prompt_tuning")
class PromptTuning(Method):
    can_merge = False
    prepends_positions = True
    config = PromptTuningConfig
    adapter_kinds = ("PROMPT_TUNING",)
    plan_options_type = PromptTuningPlan
    plan_aliases = {"num_virtual_tokens": "num_virtual_tokens"}

    def check_config(self, cfg, model: nn.Module | None = None, quantize: str = "none") -> None:
        c = self.settings(cfg)
        number("method.num_virtual_tokens", c.num_virtual_tokens, ge=1, integer=True)
        text = c.prompt_init_text
        if text is not None and (not isinstance(text, str) or not text):
            raise TunekitError(f"method.prompt_init_text: must be non-empty text, or null for random vocabulary "
                               f"rows; got {text!r}")

    def check_context(self, cfg, seq_len: int, limit: int, where: str) -> None:
        # the soft prompt goes in front of every row: its positions come out of the same budget, and
        # past the last one a rotary/learned position table would be read out of its range
        n = self.settings(cfg).num_virtual_tokens
        if n + seq_len > limit:
            raise TunekitError(f"method.num_virtual_tokens: {n} virtual tokens + data.max_seq_len {seq_len} = "
                               f"{n + seq_len} positions, more than the {limit} the model in {where} was built "
                               f"for; lower method.num_virtual_tokens or data.max_seq_len so that they add up to "
                               f"{limit} or less")

    def apply(self, model: nn.Module, cfg) -> SoftPromptLM:
        import torch

        from tunekit.methods.prompt_tuning.soft_prompt import SoftPromptLM

        self.check_config(cfg, model)
        c = self.settings(cfg)
        n = c.num_virtual_tokens
        model.requires_grad_(False)
        table = model.get_input_embeddings().weight  # (vocab, dim)
        if c.prompt_init_text is not None:
            from tunekit.model.loader import load_tokenizer

            path = _model_path(model)
            if path is None:
                raise TunekitError("method.prompt_init_text: the model has no path to load its tokenizer from")
            ids = init_token_ids(load_tokenizer(path), c.prompt_init_text, n)
            init = {"prompt_tuning_init": "TEXT", "prompt_tuning_init_text": c.prompt_init_text,
                    "tokenizer_name_or_path": path}
        else:
            # the global RNG: seeded by the trainer (cfg.seed) before apply, like every other init
            ids = torch.randint(0, table.shape[0], (n,)).tolist()
            init = {"prompt_tuning_init": "SAMPLE_VOCAB"}
        prompt = table.detach()[torch.tensor(ids, device=table.device)].float().clone()
        return SoftPromptLM(model, prompt, init)

    def owns(self, param_name: str) -> bool:
        return param_name == "prompt_embeddings"

    def write(self, model: SoftPromptLM, out_dir: Path) -> None:
        from peft import PromptTuningConfig as PeftPromptTuningConfig
        from safetensors.torch import save_file

        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        c = model.config
        PeftPromptTuningConfig(
            task_type="CAUSAL_LM", num_virtual_tokens=model.num_virtual_tokens, token_dim=c.hidden_size,
            num_transformer_submodules=1, num_attention_heads=c.num_attention_heads, num_layers=c.num_hidden_layers,
            base_model_name_or_path=_model_path(model.base), **model.init_info,
        ).save_pretrained(str(out_dir))
        save_file({"prompt_embeddings": model.prompt_embeddings.detach().float().contiguous().cpu()},
                  str(out_dir / "adapter_model.safetensors"))

    def read(self, model: SoftPromptLM, in_dir: Path) -> None:
        import torch

        prompt = load_soft_prompt(in_dir, model.config.hidden_size)
        if prompt.shape != model.prompt_embeddings.shape:
            raise TunekitError(f"adapter {in_dir}: {prompt.shape[0]} virtual tokens, this run has "
                               f"method.num_virtual_tokens={model.num_virtual_tokens}")
        with torch.no_grad():
            model.prompt_embeddings.copy_(prompt)

    def config_from_adapter(self, adapter_cfg: dict):
        from tunekit.methods import MethodConfig

        return MethodConfig(name="prompt_tuning", num_virtual_tokens=int(adapter_cfg["num_virtual_tokens"]))

    # ------------------------------------------------------------ the training plan
    def plan_options(self, cfg) -> PromptTuningPlan:
        return PromptTuningPlan(num_virtual_tokens=self.settings(cfg).num_virtual_tokens)

    def plan_label(self, o: PromptTuningPlan) -> str:
        return f"prompt tuning ({o.num_virtual_tokens} virtual tokens)"

    def plan_terms(self, shape, setup) -> PlanTerms:
        """P: (N, dim) trains; the decoder runs N more positions per row, from a first block whose
        input needs a gradient (the prompt's)."""
        n = setup.options.num_virtual_tokens
        return PlanTerms(trainable=(n * shape.hidden_size,), decoder_input_grad=True, extra_positions=n)
