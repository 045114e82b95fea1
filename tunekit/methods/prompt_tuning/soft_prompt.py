"""The model prompt tuning trains (tunekit.methods.prompt_tuning): a frozen causal LM behind a soft prompt.

N virtual tokens P: (N, dim) are prepended to every sequence's input embeddings; only P trains
(in fp32; cast to the embedding dtype on the way in). Position ids are the default 0..N+L-1, the
soft prompt first, exactly as peft's PeftModelForCausalLM does it.

The trainer sees the usual contract through `decoder_and_head`: `SoftPromptLM.tunekit_decoder_and_head`
returns a decoder that prepends P, extends the attention mask, and returns hidden states for the
real positions only: (batch, seq, dim) aligned with input_ids. A module of its own so that the
method's module imports no torch.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from transformers.modeling_outputs import CausalLMOutput

from tunekit import TunekitError


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

