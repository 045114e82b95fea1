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

    kl_mean              mean over positions of KL(p || q) = sum_v p_v (log p_v - log q_v), nats/token,
                         estimated from p's top-k tokens (kl_topk; kl_tail_mass: the mass it leaves out)
    max_abs_logit_diff   max |z_p - z_q| over positions and p's top-k tokens
    top1_agreement       fraction of positions where argmax z_p == argmax z_q

The trained model's figures and all three losses come from one load of the base (tunekit's own
loader, so no bitsandbytes CPU repack: see tunekit.model.loader.keep_bnb_layout): the base is measured before the method is
applied, then the adapter is loaded into it. Of its logits only a compact summary is kept (the
Reference): per position the TOP_K largest logits, their token ids and the log-partition, per
response token the loss. For an 8B model with a 128k vocabulary the full fp32 logits of the
held-out positions are gigabytes, and the export must free the trained model before the merged
candidate loads; the summary is ~0.5 KB per position. So KL is an estimate (kl_topk below) and
max_abs_logit_diff is over the trained model's top-k tokens; losses and top-1 agreement stay exact.
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


class UpcastHalfWeights(TorchFunctionMode):
    """Inside this mode, a model whose weights are stored in bf16/fp16 computes in fp32: a linear
    with an fp32 input and a half weight is an fp32 matmul of the upcast weight (a block of rows at
    a time), and an embedding lookup of a half table returns fp32. Every later op then sees fp32
    activations (an RMSNorm's half weight times fp32 is fp32 by type promotion).

    A 16-bit value is exact in fp32, so the model computes what the same weights loaded in fp32
    compute, up to the order of summation, holding them in half the memory: the trained model
    of a run over a 16-bit base is measured this way before a streamed merge (tunekit.export.stream),
    whose budget is one 16-bit copy of the model.
    """

    HALF = (torch.bfloat16, torch.float16)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, w, b = _linear_args(*args, **kwargs)
            if x.dtype == torch.float32 and w.dtype in self.HALF:
                return _linear_in_fp32(x, w, b)
        out = func(*args, **kwargs)
        if func is F.embedding and out.dtype in self.HALF:
            return out.float()
        return out


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


# Tokens per position of the trained model's summary. At 64 the summary is 64 * (8 + 4) + 4 bytes
# a position (4 MB for 8k held-out positions, where a 128k vocabulary's fp32 logits are 4 GB), and
# a fine-tuned LM puts nearly all of a position's mass there (the report gives what it leaves out).
TOP_K = 64


@dataclass
class Reference:
    """The trained model's side of every comparison, measured once and kept compact.

    Per batch i, over its positions_i non-padding positions, with k = min(TOP_K, vocab):
      top_ids[i]: (positions_i, k) int64, the ids of the k largest trained logits, largest first;
      top_logits[i]: (positions_i, k) fp32, those logits;
      lse[i]: (positions_i,) fp32, logsumexp of the position's trained logits (log p = z - lse).
    nll_base, nll_trained: (response tokens,) per-token losses of the base and the trained model.
    """

    batches: list[dict]
    nll_base: torch.Tensor
    nll_trained: torch.Tensor
    vocab: int
    top_ids: list[torch.Tensor] = field(repr=False)
    top_logits: list[torch.Tensor] = field(repr=False)
    lse: list[torch.Tensor] = field(repr=False)

    @property
    def k(self) -> int:
        return self.top_ids[0].shape[1] if self.top_ids else 0

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


def summarize(z: torch.Tensor, k: int = TOP_K) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(positions, vocab) fp32 logits -> (top ids (positions, k), top logits (positions, k), lse (positions,))."""
    top = z.topk(min(k, z.shape[-1]), dim=-1)  # sorted, largest first
    return top.indices, top.values.contiguous(), torch.logsumexp(z, -1)


@torch.no_grad()
def measure_reference(base: nn.Module, make_trained: Callable[[nn.Module], nn.Module],
                      batches: list[dict]) -> tuple[Reference, nn.Module]:
    """Base loss from `base`, then `make_trained(base)` (method.apply + load: same storage) gives
    the trained model, whose losses and logit summary are recorded. Returns the reference and the
    trained model."""
    nll_base = token_nll(base, batches)
    trained = make_trained(base)
    nll, ids, vals, lse, vocab = [], [], [], [], 0
    for batch in batches:
        z = logits_of(trained, batch)  # (batch, seq, vocab)
        nll.append(response_nll(z, batch))
        vocab = z.shape[-1]
        for out, t in zip((ids, vals, lse), summarize(z[batch["attention_mask"].bool()])):
            out.append(t)
        del z
    return Reference(batches, nll_base, torch.cat(nll), vocab, ids, vals, lse), trained


def kl_topk(top_ids: torch.Tensor, top_logits: torch.Tensor, lse: torch.Tensor,
            q_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(KL(p || q) estimate, p's tail mass), each (positions,), from p's summary and q's full logits.

    top_ids, top_logits: (positions, k); lse: (positions,); q_logits: (positions, vocab) fp32.

    Error analysis. Split the vocabulary into p's top-k tokens T and the tail; R = p(tail),
    Q = q(tail). The chain rule of KL gives, exactly,

        KL(p || q) = sum_{v in T} p_v log(p_v / q_v) + R log(R / Q) + R KL(p_tail || q_tail)

    with p_tail, q_tail the two distributions restricted to the tail and renormalised. The summary
    gives the first two terms exactly (q is whole): by the log-sum inequality they are a lower
    bound of the KL, exact when R = 0. The third is estimated by R KL(p_T || q_T), the same
    divergence over the top-k tokens (restricted, renormalised). Its error is
    R (KL(p_tail || q_tail) - KL(p_T || q_T)): for a small change d_v of the logits,
    KL(p_S || q_S) ~ Var_{p_S}(d) / 2 over a set S, so the estimate is right where the change
    varies as much over the tail as over the top tokens (rounding weights perturbs every logit
    through the same hidden state), and reads high where it moves the top tokens most (a lost
    fine-tune update moves the answers it had raised): the side on which a gate may err. Its
    size is at most R times the larger of the two divergences, so for a trained LM (R small) the
    estimate is within a fraction R of the exact KL, and it never reads below the lower bound.
    On a near-uniform distribution (a random test model: R ~ 1) it is the top-k divergence alone.
    Identical logits give exactly 0: both sides are the same arithmetic on the same numbers.
    """
    log_p = top_logits - lse[:, None]  # (positions, k)
    log_q = q_logits.gather(1, top_ids) - torch.logsumexp(q_logits, -1, keepdim=True)
    # log of the top-k mass, then the tail's mass 1 - exp(.) without cancellation (clamped: rounding
    # can put the top-k mass a hair above 1)
    log_pt, log_qt = torch.logsumexp(log_p, -1), torch.logsumexp(log_q, -1)  # (positions,)
    R, Q = (-torch.expm1(log_pt)).clamp_min(0), (-torch.expm1(log_qt)).clamp_min(0)
    head = (log_p.exp() * (log_p - log_q)).sum(-1)
    tiny = torch.finfo(torch.float32).tiny
    bucket = torch.where(R > 0, R * (R.clamp_min(tiny).log() - Q.clamp_min(tiny).log()), torch.zeros_like(R))
    # KL(p_T || q_T) = sum_T p_v/(1-R) (log p_v - log q_v - log(1-R) + log(1-Q))
    within = head / log_pt.exp() - log_pt + log_qt
    return (head + bucket + R * within.clamp_min(0)).clamp_min(0), R  # clamp: fp noise below 0


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
    max_abs, kl_sum, tail_sum, agree, n_pos, n_seq = 0.0, 0.0, 0.0, 0, 0, 0
    nll = []
    for batch, ids, vals, lse in zip(ref.batches, ref.top_ids, ref.top_logits, ref.lse):
        z_q = f_exp(batch).to(vals.device)  # (batch, seq, vocab); llama.cpp's come from the CPU
        mask = batch["attention_mask"].bool()  # (batch, seq)
        if z_q.shape[:2] != mask.shape or z_q.shape[-1] != ref.vocab:
            raise ValueError(f"logit shapes differ: trained {(*mask.shape, ref.vocab)}, exported {tuple(z_q.shape)}")
        q = z_q[mask]  # (positions, vocab)
        # In slices of rows: whole (positions, vocab) temporaries would be 350 MB each on the
        # default run, and allocating and streaming them cost more than the arithmetic.
        for i in range(0, q.shape[0], 32):
            qi, idi = q[i : i + 32].float(), ids[i : i + 32]
            kl, tail = kl_topk(idi, vals[i : i + 32], lse[i : i + 32], qi)
            kl_sum += kl.sum().item()
            tail_sum += tail.sum().item()
            max_abs = max(max_abs, (vals[i : i + 32] - qi.gather(1, idi)).abs().max().item())
            agree += (qi.argmax(-1) == idi[:, 0]).sum().item()
        n_pos += q.shape[0]
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
        # what the two figures above are over: the trained model's top-k tokens (kl_topk), and
        # the mass of the distribution they leave out, on average (the KL estimate's error scales with it)
        "kl_estimate": f"top-{ref.k} (tunekit.export.fidelity.kl_topk)", "kl_tail_mass": tail_sum / max(n_pos, 1),
    }
    if nll_merge_base is not None:
        loss_mb = nll_merge_base.mean().item()
        effect, effect_se = gain_kept(ref, nll_exp, nll_merge_base)
        out.update(loss_merge_base=loss_mb, ppl_merge_base=_ppl(loss_mb), adapter_effect=effect,
                   adapter_effect_se=effect_se)
    return out


def _ppl(loss: float) -> float:
    return math.exp(min(loss, 50.0))
