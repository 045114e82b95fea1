"""How faithful an export is: the artifact, reloaded from disk, vs the trained model on held-out data.

The user's question is "how much of what the fine-tune gained does the export keep?". On the
response tokens of the run's held-out batches (the tokens the run trained on) we measure the mean
loss (nats/token) of three models and report

    gain_kept = (loss_base - loss_exported) / (loss_base - loss_trained)

where base is the model the run trained over (for a 4-bit run: the NF4 base, prepared as in
training). An export that merged the fine-tune into other weights (`--merge-into original`, the
high-precision base) also gets

    adapter_effect = (loss_merge_base - loss_exported) / (loss_base - loss_trained)

the same fraction measured from the base it merged into, so that a better base cannot pass for a
kept fine-tune. Beside them, on every non-padding position (prompt and response alike: a
deployed model sees both), the distributions p (trained) and q (exported) are compared:

    kl_mean              mean over positions of KL(p || q) = sum_v p_v (log p_v - log q_v), nats/token
    max_abs_logit_diff   max |z_p - z_q| over positions and vocabulary
    top1_agreement       fraction of positions where argmax z_p == argmax z_q

The trained model's logits and all three losses come from one load of the base (tunekit's own
loader, so no bitsandbytes CPU repack: see tunekit.model.loader.keep_bnb_layout): the base is measured before the method is
applied, then the adapter is loaded into it. Its logits are kept (only the non-padding positions,
fp32) so that every export candidate is compared against one reference pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from tunekit.data import IGNORE

# The largest fp32 copy of a weight a half linear makes at once (bytes): a 128k-vocabulary head
# of 4096 columns would be 2 GiB as one block.
_FP32_BLOCK_BYTES = 64 << 20


class HalfLinearsInFp32(TorchFunctionMode):
    """Inside this mode, a CPU linear whose input and weight are both one of `dtypes` is computed
    as an fp32 matmul of the same operands, rounded once to that dtype.

    For the CPUs where torch emulates bf16/fp16 matmuls (device.cpu_emulated_dtypes: ~7x slower
    than fp32 there), it gives the same numbers up to the order of summation: a product of two
    bf16 values (8 significant bits each) or two fp16 values (11) is exact in fp32 (24 bits), and
    torch's emulated kernel also adds the exact products in fp32. The two fp32 sums differ only
    by their rounding errors (at most ~K * 2^-24 * sum|x w| for a reduction of length K), so after
    the one rounding to the half dtype they are equal, or one half-dtype ulp apart where a sum lies
    that close to a rounding boundary (measured on 256x576 @ 576x1536: 0.01% of bf16 outputs,
    0.18% of fp16 outputs, each one ulp). Everything else (norms, attention, activations) runs
    in the half dtype as before.

    Through a whole model such one-ulp flips grow as any change of kernel does in half precision.
    On the default model's bf16 merge (2 held-out batches): KL(fp32 merge || bf16 export) was 6.7e-3
    with torch's emulated linears and 7.2e-3 with these, the two bf16 computations 4.7e-3 apart,
    and merely reversing the order of every fp32 sum here moved the logits by 4.2e-3: that is the
    noise floor of bf16 arithmetic on this model, and both kernels sit on it.
    """

    def __init__(self, dtypes: tuple[torch.dtype, ...]):
        super().__init__()
        self.dtypes = dtypes
        self.seen: set[torch.dtype] = set()  # the dtypes of the linears computed this way

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, w, b = _linear_args(*args, **kwargs)
            if x.device.type == "cpu" and x.dtype in self.dtypes and w.dtype == x.dtype:
                self.seen.add(x.dtype)
                return _linear_in_fp32(x, w, b)
        return func(*args, **kwargs)

    def describe(self) -> str:
        names = " and ".join(sorted(str(d).removeprefix("torch.") for d in self.seen))
        return f"{names} linears computed as fp32 matmuls, rounded once to {names} (emulated on this CPU)"


def _linear_args(input, weight, bias=None):  # F.linear's signature
    return input, weight, bias


def _linear_in_fp32(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor]) -> torch.Tensor:
    """x @ w.T + b in fp32, rounded once to x's dtype; w (out, in) is upcast a block of rows at a time."""
    rows = max(1, _FP32_BLOCK_BYTES // (4 * w.shape[1]))
    xf = x.float()
    out = [F.linear(xf, w[i : i + rows].float(), None if b is None else b[i : i + rows].float())
           for i in range(0, w.shape[0], rows)]
    return (out[0] if len(out) == 1 else torch.cat(out, -1)).to(x.dtype)


Logits = Callable[[dict], torch.Tensor]  # batch -> (batch, seq, vocab) fp32


def logits_of(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """(batch, seq, vocab) fp32 logits aligned with batch["input_ids"].

    peft's prompt-learning models return logits for the virtual tokens too (prepended): keep the
    last `seq` positions, which are the real ones.
    """
    seq = batch["input_ids"].shape[1]
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
    return out.logits[:, -seq:].float()


def as_logits(model_or_fn) -> Logits:
    return model_or_fn if not isinstance(model_or_fn, nn.Module) else (lambda b: logits_of(model_or_fn, b))


def response_nll(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """(response tokens,) NLL of each response token, in row-major order; position t predicts labels[t + 1]."""
    labels = batch["labels"][:, 1:]
    resp = labels != IGNORE
    return F.cross_entropy(logits[:, :-1][resp].float(), labels[resp], reduction="none")


@torch.no_grad()
def token_nll(model: nn.Module, batches: list[dict]) -> torch.Tensor:
    """(response tokens,) NLL of every response token of the batches, in the order of response_nll.

    Only the loss is needed here, so the output head (vocab x dim: a fifth of SmolLM2's forward)
    runs on the response positions alone, as in training's own loss.
    """
    from tunekit.model import decoder_and_head

    decoder, head = decoder_and_head(model)
    out = []
    for batch in batches:
        hidden = decoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                         use_cache=False).last_hidden_state  # (batch, seq, dim)
        labels = batch["labels"][:, 1:]
        resp = labels != IGNORE
        logits = head(hidden[:, :-1][resp]).float()  # (response tokens, vocab)
        out.append(F.cross_entropy(logits, labels[resp], reduction="none"))
    return torch.cat(out)


@dataclass
class Reference:
    """The trained model's side of every comparison, measured once.

    logits[i]: (positions_i, vocab) fp32 trained logits at the non-padding positions of batch i;
    nll_base, nll_trained: (response tokens,) per-token losses of the base and the trained model.
    """

    batches: list[dict]
    nll_base: torch.Tensor
    nll_trained: torch.Tensor
    logits: list[torch.Tensor] = field(repr=False)

    @property
    def loss_base(self) -> float:
        return self.nll_base.mean().item()

    @property
    def loss_trained(self) -> float:
        return self.nll_trained.mean().item()

    @property
    def gain(self) -> float:
        """What the fine-tune gained on held-out response tokens, nats/token (> 0 = better)."""
        return self.loss_base - self.loss_trained


@torch.no_grad()
def measure_reference(base: nn.Module, make_trained: Callable[[nn.Module], nn.Module],
                      batches: list[dict]) -> tuple[Reference, nn.Module]:
    """Base loss from `base`, then `make_trained(base)` (method.apply + load: same storage) gives
    the trained model, whose logits and loss are recorded. Returns the reference and the trained model."""
    nll_base = token_nll(base, batches)
    trained = make_trained(base)
    logits, nll = [], []
    for batch in batches:
        z = logits_of(trained, batch)  # (batch, seq, vocab)
        nll.append(response_nll(z, batch))
        logits.append(z[batch["attention_mask"].bool()].contiguous())  # (positions, vocab)
        del z
    return Reference(batches, nll_base, torch.cat(nll), logits), trained


def gain_kept(ref: Reference, nll_exported: torch.Tensor, nll_merge_base: Optional[torch.Tensor] = None
              ) -> tuple[Optional[float], Optional[float]]:
    """(fraction of the fine-tune's held-out gain that the export keeps, its standard error).

    fraction = mean(start - exported) / mean(base - trained), per response token, where start is
    the base the run trained over, or the base the export merged into (nll_merge_base: the
    original high-precision weights). Both means are over the same tokens, so the noise that
    matters is that of the paired differences; the standard error is the delta method's for a
    ratio of means, treating tokens as independent (they are not quite: it is a lower bound).
    (None, None) when the run gained nothing.
    """
    g = ref.nll_base.double() - ref.nll_trained.double()  # (tokens,)
    a = (ref.nll_base if nll_merge_base is None else nll_merge_base).double() - nll_exported.double()
    n, G = g.numel(), g.mean().item()
    if n == 0 or G == 0:
        return None, None
    f = a.mean().item() / G
    if n < 2:
        return f, None
    cov = torch.cov(torch.stack([a, g]))  # (2, 2), sample covariance over tokens
    var = (cov[0, 0] + f * f * cov[1, 1] - 2 * f * cov[0, 1]).clamp_min(0).item() / (n * G * G)
    return f, var ** 0.5


@torch.no_grad()
def compare(ref: Reference, exported, nll_merge_base: Optional[torch.Tensor] = None) -> dict:
    """Fidelity numbers of `exported` (model, or callable batch -> logits) against the reference."""
    f_exp = as_logits(exported)
    max_abs, kl_sum, agree, n_pos, n_seq = 0.0, 0.0, 0, 0, 0
    nll = []
    for batch, p in zip(ref.batches, ref.logits):
        z_q = f_exp(batch).to(p.device)  # (batch, seq, vocab); llama.cpp's come from the CPU
        mask = batch["attention_mask"].bool()  # (batch, seq)
        if z_q.shape[:2] != mask.shape or z_q.shape[-1] != p.shape[-1]:
            raise ValueError(f"logit shapes differ: trained {(*mask.shape, p.shape[-1])}, exported {tuple(z_q.shape)}")
        q = z_q[mask]  # (positions, vocab)
        # In slices of rows: the whole (positions, vocab) temporaries would be 350 MB each on the
        # default run, and allocating and streaming them cost more than the arithmetic.
        for i in range(0, p.shape[0], 32):
            pi, qi = p[i : i + 32], q[i : i + 32]
            logp, logq = F.log_softmax(pi, -1), F.log_softmax(qi, -1)
            max_abs = max(max_abs, (pi - qi).abs().max().item())
            kl_sum += (logp.exp() * (logp - logq)).sum(-1).clamp_min(0).sum().item()  # clamp: fp noise below 0
            agree += (pi.argmax(-1) == qi.argmax(-1)).sum().item()
        n_pos += p.shape[0]
        n_seq += mask.shape[0]
        nll.append(response_nll(z_q, batch))
        del z_q, q
    nll_exp = torch.cat(nll)
    loss_exp = nll_exp.mean().item() if nll_exp.numel() else float("nan")
    kept, kept_se = gain_kept(ref, nll_exp)
    out = {
        "batches": len(ref.batches), "sequences": n_seq, "positions": n_pos, "response_tokens": nll_exp.numel(),
        "loss_base": ref.loss_base, "loss_trained": ref.loss_trained, "loss_exported": loss_exp,
        "ppl_base": _ppl(ref.loss_base), "ppl_trained": _ppl(ref.loss_trained), "ppl_exported": _ppl(loss_exp),
        "gain": ref.gain, "gain_kept": kept, "gain_kept_se": kept_se,
        "kl_mean": kl_sum / max(n_pos, 1), "max_abs_logit_diff": max_abs, "top1_agreement": agree / max(n_pos, 1),
    }
    if nll_merge_base is not None:
        loss_mb = nll_merge_base.mean().item()
        effect, effect_se = gain_kept(ref, nll_exp, nll_merge_base)
        out.update(loss_merge_base=loss_mb, ppl_merge_base=_ppl(loss_mb), adapter_effect=effect,
                   adapter_effect_se=effect_se)
    return out


def _ppl(loss: float) -> float:
    return math.exp(min(loss, 50.0))
