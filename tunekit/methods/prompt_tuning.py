"""Prompt tuning (Lester et al. 2021, arXiv:2104.08691): a trained soft prompt, the base untouched.

N virtual tokens P: (N, dim) are prepended to every sequence's input embeddings; only P trains
(in fp32; cast to the embedding dtype on the way in). P starts as the embeddings of a text
(method.prompt_init_text, tokenized and repeated/truncated to N tokens, Lester's "class label"
style init) or, when that is null, of N vocabulary rows drawn from the global RNG the trainer
seeded (Lester's "sampled vocabulary" init).

Position ids are the default 0..N+L-1, the soft prompt first, exactly as peft's
PeftModelForCausalLM does it, so the saved folder is a standard peft PROMPT_TUNING adapter
(adapter_config.json + adapter_model.safetensors with `prompt_embeddings`: (N, dim)) that
`peft.PeftModel.from_pretrained` loads and runs to the same logits.

The trainer sees the usual contract through `decoder_and_head`: `SoftPromptLM.tunekit_decoder_and_head`
returns a decoder that prepends P, extends the attention mask, and returns hidden states for the
real positions only: (batch, seq, dim) aligned with input_ids.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file
from transformers.modeling_outputs import CausalLMOutput

from tunekit import TunekitError
from tunekit.checks import number
from tunekit.methods.registry import Method, register


class SoftPromptLM(nn.Module):
    """A frozen causal LM `base` with a trainable soft prompt `prompt_embeddings`: (N, dim) fp32."""

    def __init__(self, base: nn.Module, prompt: torch.Tensor, init: dict):
        super().__init__()
        self.base = base
        self.prompt_embeddings = nn.Parameter(prompt.float())
        self.init_info = init  # how the prompt was initialised, recorded in the peft config

    @property
    def config(self):
        return self.base.config

    @property
    def num_virtual_tokens(self) -> int:
        return self.prompt_embeddings.shape[0]

    def get_base_model(self) -> nn.Module:
        return self.base

    def decode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
               position_ids: torch.Tensor | None = None, **kwargs):
        """input_ids: (batch, seq) -> output whose last_hidden_state is (batch, seq, dim).

        Padded batches (attention_mask (batch, seq)): the decoder runs on (batch, N + seq) with
        the soft prompt always attended to, and the N prompt positions are dropped. Packed rows
        (position_ids (1, seq) restarting at 0 per example, no mask): the prompt goes in front of
        every example, so each one sees exactly what it would see alone.
        """
        decoder = self.base.get_decoder()
        embeds = self.base.get_input_embeddings()(input_ids)  # (batch, seq, dim)
        batch, seq, n = input_ids.shape[0], input_ids.shape[1], self.num_virtual_tokens
        prompt = self.prompt_embeddings.to(embeds.dtype)  # (N, dim)
        if position_ids is None:
            if attention_mask is not None:
                attention_mask = torch.cat([attention_mask.new_ones(batch, n), attention_mask], dim=1)
            x = torch.cat([prompt.unsqueeze(0).expand(batch, -1, -1), embeds], dim=1)
            out = decoder(inputs_embeds=x, attention_mask=attention_mask, **kwargs)
            out.last_hidden_state = out.last_hidden_state[:, n:]
            return out
        if batch != 1 or attention_mask is not None:
            raise TunekitError("prompt tuning: explicit position_ids are supported for packed rows only "
                               "(batch of 1, no attention_mask)")
        starts = (position_ids[0] == 0).nonzero().flatten().tolist()
        if not starts or starts[0] != 0:
            raise TunekitError("prompt tuning: packed position_ids must start every example at 0")
        pieces, positions, real = [], [], []
        prompt_pos = torch.arange(n, device=input_ids.device)
        for a, b in zip(starts, starts[1:] + [seq]):
            pieces += [prompt, embeds[0, a:b]]
            positions += [prompt_pos, position_ids[0, a:b] + n]
            offset = sum(p.shape[0] for p in pieces) - (b - a)
            real.append(torch.arange(offset, offset + b - a, device=input_ids.device))
        out = decoder(inputs_embeds=torch.cat(pieces)[None], position_ids=torch.cat(positions)[None], **kwargs)
        out.last_hidden_state = out.last_hidden_state[:, torch.cat(real)]
        return out

    def tunekit_decoder_and_head(self):
        """Used by tunekit.model.decoder_and_head instead of the base's own decoder."""
        return self.decode, self.base.get_output_embeddings()

    def tunekit_generation_view(self):
        """Used by tunekit.infer.decode: (the plain base, the soft prompt (N, dim)). Generation prepends
        the prompt per row itself (left padding, per-row positions), so one base serves many prompts."""
        return self.base, self.prompt_embeddings.detach()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs) -> CausalLMOutput:
        """logits: (batch, seq, vocab) on the real positions."""
        hidden = self.decode(input_ids, attention_mask, **kwargs).last_hidden_state
        head = self.base.get_output_embeddings()
        return CausalLMOutput(logits=head(hidden.to(head.weight.dtype)))


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

    @staticmethod
    def check_config(cfg, model: nn.Module | None = None, quantize: str = "none") -> None:
        number("method.num_virtual_tokens", cfg.num_virtual_tokens, ge=1, integer=True)
        text = cfg.prompt_init_text
        if text is not None and (not isinstance(text, str) or not text):
            raise TunekitError(f"method.prompt_init_text: must be non-empty text, or null for random vocabulary "
                               f"rows; got {text!r}")

    def apply(self, model: nn.Module, cfg) -> SoftPromptLM:
        self.check_config(cfg, model)
        n = cfg.num_virtual_tokens
        model.requires_grad_(False)
        table = model.get_input_embeddings().weight  # (vocab, dim)
        if cfg.prompt_init_text is not None:
            from tunekit.model.loader import load_tokenizer

            path = _model_path(model)
            if path is None:
                raise TunekitError("method.prompt_init_text: the model has no path to load its tokenizer from")
            ids = init_token_ids(load_tokenizer(path), cfg.prompt_init_text, n)
            init = {"prompt_tuning_init": "TEXT", "prompt_tuning_init_text": cfg.prompt_init_text,
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
        from peft import PromptTuningConfig

        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        c = model.config
        PromptTuningConfig(
            task_type="CAUSAL_LM", num_virtual_tokens=model.num_virtual_tokens, token_dim=c.hidden_size,
            num_transformer_submodules=1, num_attention_heads=c.num_attention_heads, num_layers=c.num_hidden_layers,
            base_model_name_or_path=_model_path(model.base), **model.init_info,
        ).save_pretrained(str(out_dir))
        save_file({"prompt_embeddings": model.prompt_embeddings.detach().float().contiguous().cpu()},
                  str(out_dir / "adapter_model.safetensors"))

    def read(self, model: SoftPromptLM, in_dir: Path) -> None:
        prompt = load_soft_prompt(in_dir, model.config.hidden_size)
        if prompt.shape != model.prompt_embeddings.shape:
            raise TunekitError(f"adapter {in_dir}: {prompt.shape[0]} virtual tokens, this run has "
                               f"method.num_virtual_tokens={model.num_virtual_tokens}")
        with torch.no_grad():
            model.prompt_embeddings.copy_(prompt)
