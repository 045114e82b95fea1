"""objective=preference: DPO, IPO, ORPO, SimPO and KTO over the trained part of a frozen base.

A micro-batch of N pairs is 2N rows, chosen sides first (tunekit.data.preference.collate_preference),
and goes through the model in ONE forward. Each row's summed log-probability of its completion comes
from the head in chunks (tunekit.losses.logps). The reference log-probabilities come from the same model
with its trained part switched off (the method's `switched_off`: peft's disable_adapter for the LoRA
family, a process-wide switch of the hooks for BitFit, (IA)^3 and bottleneck adapters), under no_grad:
there is never a second copy of the base. At step 0 the trained part is the identity (LoRA's B = 0,
(IA)^3's ones, zero biases, zero-initialised adapter outputs), so the reference is the model the run
started from. ORPO and SimPO need no reference and skip that pass.

KTO's reference point (preference.kto_kl=batch, TRL's `kto`): each training micro-batch also carries
its mismatched rows (each prompt with the previous row's completion, collate_preference), scored
under no_grad by the trained model (`policy`) and the reference; the mean of their log-ratios,
clamped at 0, is that micro-batch's KL estimate. It stays the micro-batch's own (TRL averages it
over the ranks), so N ranks train exactly as one process accumulating N micro-batches. Held-out
figures use a reference point of 0 (the trainer's and `tunekit eval`'s alike: they do not depend on
how the rows are grouped).

The trainer divides the summed loss by the pairs (KTO: rows) of the whole global batch, as TRL means
per-pair losses. `count` gives that unit; `stats` and `finish` give the rewards TRL logs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn as nn

from tunekit import TunekitError
from tunekit.checks import number, one_of
from tunekit.config import PreferenceLoss, plain
from tunekit.losses.logps import sequence_logps
from tunekit.losses.preference import has_reference, kto_kl_estimate, kto_loss, pair_losses

PAIR_STATS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")
KTO_STATS = ("rewards/chosen", "rewards/rejected", "desirable", "undesirable")


def check_preference_config(cfg) -> None:
    """The preference.* keys, and what objective=preference cannot run with; one line each."""
    p = cfg.preference
    kind = plain(p.loss)
    one_of("preference.loss", kind, [x.value for x in PreferenceLoss])
    number("preference.beta", p.beta, gt=0)
    number("preference.label_smoothing", p.label_smoothing, ge=0, lt=0.5)
    if p.label_smoothing and kind not in ("dpo", "simpo"):
        raise TunekitError(f"preference.label_smoothing: {p.label_smoothing} applies to preference.loss=dpo and simpo "
                           f"only, not {kind}; set it to 0")
    number("preference.gamma", p.gamma, ge=0)
    number("preference.desirable_weight", p.desirable_weight, gt=0)
    number("preference.undesirable_weight", p.undesirable_weight, gt=0)
    one_of("preference.kto_kl", p.kto_kl, ["batch", "zero"])
    if p.kto_kl != "batch" and kind != "kto":
        raise TunekitError(f"preference.kto_kl: {p.kto_kl} applies to preference.loss=kto only, not {kind}; leave it "
                           "at batch")
    if cfg.objective != "preference":
        return
    if cfg.data.packing:
        raise TunekitError("data.packing: not with objective=preference (the chosen and rejected sides of a pair "
                           "are scored as rows of their own); set data.packing=false")
    check_kto_micro_batch(cfg)
    if plain(cfg.data.format) != "auto":
        raise TunekitError(f"data.format: {plain(cfg.data.format)} is an SFT format; objective=preference reads "
                           "preference rows (prompt/chosen/rejected or prompt/completion/label): set data.format=auto")
    from tunekit.data.mixture import is_mixture

    if is_mixture(cfg.data.path):
        raise TunekitError("data.path: a list of sources is not read with objective=preference yet; give one file "
                           "of preference rows")
    if cfg.data.path is None:
        raise TunekitError("data.path: objective=preference needs a file of preference rows (the default data is "
                           "SFT rows); give data.path=pairs.jsonl")
    if has_reference(kind):
        from tunekit.methods import get_method

        if not get_method(cfg.method.name).can_switch_off:
            raise TunekitError(f"method.name: preference.loss={kind} scores against the base with the trained part "
                               f"switched off, which method {cfg.method.name} cannot do (it has no separate trained "
                               "part); use a LoRA-family method, ia3, adapter or bitfit, or preference.loss=orpo or "
                               "simpo (no reference)")
        init = getattr(cfg.method, "init", None)
        if init not in (None, "default", "auto"):  # auto resolves to the plain start here
            raise TunekitError(f"method.init: {init} starts the adapter away from zero and rewrites the base, so the "
                               f"base with the adapter off is not the model the run starts from (the reference of "
                               f"preference.loss={kind}); use method.init=default, or preference.loss=orpo or simpo")


def check_kto_micro_batch(cfg, chosen_by_auto: bool = False) -> None:
    """KTO's KL estimate pairs each prompt with another row's completion of the same micro-batch: a
    micro-batch of one row is refused, as set or as `auto` chose it (once resolved, before the model loads)."""
    p, mbs = cfg.preference, cfg.trainer.micro_batch_size
    if plain(p.loss) != "kto" or p.kto_kl != "batch" or not isinstance(mbs, int) or mbs >= 2:
        return
    why = "KTO's KL estimate pairs each prompt with another row's completion of the same micro-batch"
    if chosen_by_auto:
        raise TunekitError(f"trainer.micro_batch_size=auto: only {mbs} row a micro-batch fits this device's memory, "
                           f"and {why}; set preference.kto_kl=zero, or shorten data.max_seq_len")
    raise TunekitError(f"trainer.micro_batch_size: {mbs} with preference.loss=kto: {why}; use "
                       "trainer.micro_batch_size=2 or more, or preference.kto_kl=zero")


# preference.precompute_ref's log-probabilities, kept with the run for a resume: tensors "train" and
# "val", (rows, sides) fp32 in the data's order (sides: chosen and rejected, or KTO's one row)
REFERENCE_CACHE = "reference_logps.safetensors"


def sides_of(rows: list) -> int:
    """Rows a preference example runs as: 2 for a pair (chosen and rejected), 1 for KTO's unpaired row."""
    return 2 if rows and "rejected_input_ids" in rows[0] else 1


def write_reference_cache(path: Path, train: torch.Tensor, val: torch.Tensor) -> None:
    from safetensors.torch import save_file

    from tunekit.owned import atomic_write

    atomic_write(path, lambda tmp: save_file({"train": train.contiguous(), "val": val.contiguous()}, str(tmp)))


def read_reference_cache(path: Path, train: list, val: list) -> tuple[Optional[list], Optional[str]]:
    """([train, val] tensors, None) when `path` holds what this run's rows need: one finite fp32 row
    of the right width per example, in order (the run's resume check has already matched its data,
    model and settings); (None, why not) otherwise, (None, None) when there is no file."""
    if not path.is_file():
        return None, None
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        return None, f"{path}: unreadable ({type(e).__name__}: {e})"
    out = []
    for name, rows in (("train", train), ("val", val)):
        t, sides = tensors.get(name), sides_of(train)
        if t is None or t.dtype != torch.float32 or tuple(t.shape) != (len(rows), sides) or not torch.isfinite(t).all():
            got = "missing" if t is None else f"{tuple(t.shape)} {t.dtype}"
            return None, f"{path}: its {name!r} log-probs are {got}, not ({len(rows)}, {sides}) finite float32"
        out.append(t)
    return out, None


class PreferenceObjective:
    """loss(hidden, head, batch) -> (sum of per-pair losses, pairs); eval_sums -> named sums (module
    docstring). `reference(batch)` -> the reference's last hidden states (no_grad, trained part off),
    set by the trainer once the method is applied; None for ORPO and SimPO. `policy(batch)`: the
    trained model's, also no_grad (KTO's KL rows)."""

    def __init__(self, cfg, reference: Optional[Callable[[dict], torch.Tensor]] = None):
        self.kind = plain(cfg.loss)
        self.beta, self.label_smoothing, self.gamma = cfg.beta, cfg.label_smoothing, cfg.gamma
        self.weights = (cfg.desirable_weight, cfg.undesirable_weight)
        self.reference = reference
        self.policy: Optional[Callable[[dict], torch.Tensor]] = None
        self.paired = self.kind != "kto"
        self.batch_kl = not self.paired and cfg.kto_kl == "batch"
        self.unit = "pairs" if self.paired else "rows"
        self.eval_names = ("loss",) + (PAIR_STATS if self.paired else KTO_STATS)
        self.stat_names = self.eval_names[1:] + (("kl",) if self.batch_kl else ())
        self.stats: dict[str, torch.Tensor] = {}

    @property
    def needs_reference(self) -> bool:
        return has_reference(self.kind)

    def count(self, batch: dict) -> int:
        """Pairs (KTO: rows) of a collated micro-batch: what the loss is averaged over."""
        rows = batch["input_ids"].shape[0]
        return rows // 2 if self.paired else rows

    def _reference_logps(self, head: nn.Module, batch: dict) -> Optional[torch.Tensor]:
        if not self.needs_reference:
            return None
        if "ref_logps" in batch:  # computed once before training (preference.precompute_ref)
            return batch["ref_logps"].float()
        with torch.no_grad():
            logps, _ = sequence_logps(self.reference(batch), head, batch["labels"])
        return logps

    def _kl(self, head: nn.Module, batch: dict) -> torch.Tensor:
        """KTO's reference point for a training micro-batch: its mismatched rows' mean log-ratio, >= 0."""
        rows = {"input_ids": batch["kl_input_ids"], "attention_mask": batch["kl_attention_mask"]}
        with torch.no_grad():
            logps, _ = sequence_logps(self.policy(rows), head, batch["kl_labels"])
            ref, _ = sequence_logps(self.reference(rows), head, batch["kl_labels"])
        return kto_kl_estimate(logps, ref)

    def _losses(self, hidden: torch.Tensor, head: nn.Module, batch: dict, training: bool = False):
        logps, tokens = sequence_logps(hidden, head, batch["labels"])
        ref = self._reference_logps(head, batch)
        if not self.paired:
            kl = self._kl(head, batch) if training and self.batch_kl else None
            out = kto_loss(logps, ref, batch["desirable"].bool(), self.beta, kl, *self.weights)
            good = batch["desirable"].bool()
            stats = {"rewards/chosen": out.chosen_rewards.sum(), "rewards/rejected": out.rejected_rewards.sum(),
                     "desirable": good.sum().float(), "undesirable": (~good).sum().float()}
            if kl is not None:  # weighted by the rows, so that finish() gives the mean over the step's
                stats["kl"] = kl * logps.shape[0]
            return out, stats
        n = logps.shape[0] // 2
        c, r = logps[:n], logps[n:]
        rc, rr = (None, None) if ref is None else (ref[:n], ref[n:])
        out = pair_losses(self.kind, c, r, rc, rr, tokens[:n], tokens[n:], self.beta, self.label_smoothing, self.gamma)
        margin = out.chosen_rewards - out.rejected_rewards
        return out, {"rewards/chosen": out.chosen_rewards.sum(), "rewards/rejected": out.rejected_rewards.sum(),
                     "rewards/accuracies": (margin > 0).float().sum(), "rewards/margins": margin.sum()}

    def loss(self, hidden: torch.Tensor, head: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        out, stats = self._losses(hidden, head, batch, training=True)
        for k, v in stats.items():  # summed over the step's micro-batches; the trainer takes them
            self.stats[k] = self.stats.get(k, 0) + v.detach().float()
        return out.per_pair.sum(), torch.tensor(self.count(batch))

    def take_stats(self, device) -> torch.Tensor:
        """The step's stat sums in `stat_names` order (0-dim each, stacked), and a fresh start."""
        stats, self.stats = self.stats, {}
        return torch.stack([torch.as_tensor(stats.get(k, 0.0), dtype=torch.float32, device=device).reshape(())
                            for k in self.stat_names])

    @torch.no_grad()
    def eval_sums(self, hidden, head, batch) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        out, stats = self._losses(hidden, head, batch)
        return {"loss": out.per_pair.sum(), **stats}, torch.tensor(self.count(batch))

    def finish(self, sums: dict[str, float], n: float) -> dict[str, float]:
        """Means from the global sums: per pair (KTO: the rewards per desirable / undesirable row)."""
        if self.paired:
            return {k: v / max(n, 1) for k, v in sums.items()}
        out = {k: v / max(n, 1) for k, v in sums.items() if k not in ("desirable", "undesirable") + KTO_STATS[:2]}
        out["rewards/chosen"] = sums["rewards/chosen"] / max(sums["desirable"], 1)
        out["rewards/rejected"] = sums["rewards/rejected"] / max(sums["undesirable"], 1)
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
        return out
