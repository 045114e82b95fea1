"""The training recipe: setup() builds everything from the config, train() is one readable loop.

    forward -> token-summed loss -> backward (x grad_accum) -> reduce -> clip -> step -> log/eval/save

Gradient accumulation and data parallelism are done by hand rather than through DDP so that
the loss is normalised exactly: every micro-batch's summed loss is divided by the number of
trained tokens in the whole global batch (all micro-batches, all ranks), and the ranks' gradients
are summed. The result is the gradient of the mean token loss over the global batch, which a mean
of per-micro-batch means is not.

How the work spreads over the processes (one process, data parallel, or FSDP2 sharding) is the
strategy's (tunekit.train.strategy), chosen once at the start: the loop asks it to run forwards,
reduce, clip and gather, and never asks which one it is. setup()'s steps are in tunekit.train.build.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import math
import shutil
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

from tunekit import TunekitError
from tunekit.config import TrainConfig, plain
from tunekit.data import count_tokens, eval_micro_batches
from tunekit.data.preference import example_length
from tunekit.model import decoder_and_head
from tunekit.device import facts as dev
from tunekit.device import precision
from tunekit.speed import offload, packed_attention
from tunekit.train.build import RecipeSetup
from tunekit.train.checkpoint import atomic_dir, atomic_write_text, latest_checkpoint, save_checkpoint
from tunekit.train.objective import model_inputs
from tunekit.train.peers import Peers, fail_for_test, group_timeout_s, one_line
from tunekit.train.strategy import choose_strategy

log = logging.getLogger("tunekit")


class TrainRecipe(RecipeSetup):
    def __init__(self, cfg: TrainConfig, output_dir: Path):
        self.cfg = cfg
        self.output_dir = Path(output_dir)
        self.lock = None  # rank 0's RunLock on output_dir, from setup() on
        self.fingerprint = None  # what the run trains (tunekit.train.resume.fingerprint), from setup() on
        self.peers = None  # with several ranks: who failed, if one did (tunekit.train.peers), from setup() on

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        """Everything train() needs, built from the config one step at a time (tunekit.train.build)."""
        self._start_processes()
        self._lock_output_dir()
        set_seed(self.cfg.seed)  # the same on every rank: identical adapter init, identical data schedule
        self._resolve_models()
        self._load_data()
        self._plan_memory()
        self._find_checkpoint()
        self._resolve_steps()
        self._choose_start()
        self._choose_precision()
        # the training peak is measured apart from setup's, and setup's per phase (summary.json)
        self.setup_phases_mb: dict[str, float] = {}
        self._setup_phase("before the model")
        self._load_model()
        self._setup_phase("loading the base")
        self._build_objective()
        self._apply_method()
        self._setup_phase("the method and its start")
        self._choose_compute_path()
        self._setup_phase("the compute path's checks")
        self._wrap_model()
        self._build_optimizer()
        self._start_or_resume()
        self._precompute_reference()
        self._write_run_files()
        self._open_tracker()
        self._setup_task_eval()
        self._setup_phase("the rest of setup")
        self.setup_peak_mb = max(self.setup_phases_mb.values())

    def _setup_phase(self, name: str) -> None:
        """The peak of the setup phase that ends here (the measure of `_memory_report`), then a new peak."""
        self.setup_phases_mb[name] = dev.peak_memory_mb(self.device)
        dev.reset_peak_memory(self.device)

    def _start_processes(self) -> None:
        """The Accelerator (it starts the process group, with an explicit timeout), this rank's device
        and its facts, and the run's strategy (tunekit.train.strategy.choose_strategy)."""
        self.acc = Accelerator(kwargs_handlers=[self._process_group_kwargs()])
        self.peers = Peers.start(self.dist_timeout_s)  # a rank that fails or dies is named to the others
        if self.peers is not None and self.acc.is_main_process:
            waits = group_timeout_s()
            if waits is not None and round(waits) != self.dist_timeout_s:  # a process group started before this run
                log.warning("the collectives wait %.0f s, not trainer.dist_timeout_s=%d s: the process group was "
                            "started before tunekit's (its timeout is fixed then)", waits, self.dist_timeout_s)
            else:
                log.info("collectives time out after %d s (trainer.dist_timeout_s)", self.dist_timeout_s)
        # A single process's Accelerator().device is `cuda` without an index (tunekit.device.facts.rank_device).
        self.device = dev.rank_device(self.acc.device, self.acc.local_process_index)
        self.facts = dev.probe(self.device)
        self.main = self.acc.is_main_process
        if not self.main:  # one copy of every info line, from rank 0
            logging.getLogger("tunekit").setLevel(logging.WARNING)
        self.strategy = choose_strategy(plain(self.cfg.trainer.strategy), self.acc, self.device)

    def release(self) -> None:
        """Let go of output_dir (rank 0's lock); every way out of a run calls it (tunekit.commands.train._train),
        and the kernel drops the lock anyway if the process dies first."""
        lock, self.lock = self.lock, None
        if lock is not None:
            lock.release()

    def stopped_by_peer(self, e) -> "str | None":
        """The line to end this rank with where `e` (an exception, a signal's KeyboardInterrupt) came
        from another rank's failure or death; None where it is this rank's own (tunekit.train.peers)."""
        if self.peers is None or isinstance(e, TunekitError):
            return None
        return self.peers.stopped_by_peer(None if isinstance(e, KeyboardInterrupt) else e)

    def announce(self, e: BaseException) -> None:
        """This rank fails with `e`: the other ranks are told, to name it in their own line."""
        if self.peers is not None and not isinstance(e, KeyboardInterrupt):
            self.peers.announce(one_line(e))

    # ------------------------------------------------------------------ train
    def train(self) -> dict:
        """Evaluate, then step by step: train_step, evaluate every eval_every, checkpoint every
        save_every; the final adapter and summary.json (returned) at the end."""
        t = self.cfg.trainer
        start = time.perf_counter()
        try:
            if self.start_step == 0:
                self.first_eval = self.evaluate(0)
            last_val = self.first_eval
            for step in range(self.start_step, t.max_steps):
                fail_for_test(self.strategy.rank, step + 1)  # TUNEKIT_TEST_FAIL_AT, tests only
                self.tracker.step(self.train_step(step))
                done = step + 1
                if done % t.eval_every == 0 or done == t.max_steps:
                    last_val = self.evaluate(done)
                if done % t.save_every == 0 or done == t.max_steps:
                    self.save_checkpoint(done)
            self.save_final()
        except BaseException:
            self.tracker.abort()
            raise
        summary = self._summary(time.perf_counter() - start, last_val)
        if self.main:
            atomic_write_text(self.output_dir / "summary.json", json.dumps(summary, indent=2))
        self.tracker.close()
        return summary

    def train_step(self, step: int) -> dict:
        """One optimizer step (index `step`, from 0): accumulate, reduce, clip, step. Returns its
        metrics row. Benchmarks time this method, so it is exactly what train() runs."""
        start = time.perf_counter()
        # The first step records what attention actually received and which kernel ran it (summary.json)
        with precision.observe_attention(self.attention_seen) if step == self.start_step else contextlib.nullcontext():
            loss_sum, n_trained, n_input = self._train_step(step)
        self.scaler.unscale_(self.params)  # fp16: the gradients back to the loss's own scale
        norm = self.strategy.clip_grad_norm(self.params, self.cfg.trainer.max_grad_norm)
        # The two values the step must see before it may apply the update, in one device-to-host
        # read; the only other read is the finite check after the update (a test counts them).
        stats = getattr(self, "step_stats", None)
        values = [loss_sum.float(), norm.float().to(loss_sum.device)] + ([] if stats is None else list(stats))
        loss_sum, grad_norm, *stats = torch.stack(values).tolist()
        loss = loss_sum / max(n_trained, 1)
        lr = self.scheduler.get_last_lr()[0]
        self.tokens_seen += n_input
        overflowed = self.scaler.enabled and math.isfinite(loss) and not math.isfinite(grad_norm)
        if overflowed:  # fp16 gradients overflowed: skip the update, lower the scale (loss_scale.py)
            self.strategy.zero_grad(self.optimizer)
            self.scaler.update(overflowed=True)
            if self.scaler.gave_up:
                self._stop_non_finite(step, f"the fp16 gradients overflowed {self.scaler.skipped_in_a_row} steps in a "
                                            "row whatever the loss scale (model.dtype=fp32 avoids fp16)")
        else:
            if not self.first_checked:
                self.strategy.check_first_step(step, loss, grad_norm)
                self.first_checked = True
            if not (math.isfinite(loss) and math.isfinite(grad_norm)):
                self._stop_non_finite(step, f"the training loss is {loss} and the gradient norm {grad_norm}")
            self.optimizer.step()
            self.scheduler.step()
            self.strategy.zero_grad(self.optimizer)
            self.scaler.update(overflowed=False)
            if not self.strategy.all_finite(self.params):
                self._stop_non_finite(step, "the optimizer step made trainable weights inf/nan")
        dt = time.perf_counter() - start
        row = {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": n_input / dt,
               "input_tokens": n_input, "trained_tokens": n_trained, "tokens_seen": self.tokens_seen,
               "step_time_s": dt, "epoch": self.schedule.epoch_of(step + 1), "memory_mb": dev.peak_memory_mb(self.device)}
        if stats:  # preference: rewards/chosen, rewards/rejected, reward accuracy and margin
            row.update(self.objective.finish(dict(zip(self.objective.stat_names, stats)), n_trained))
            row[self.objective.unit] = row.pop("trained_tokens")
        if self.scaler.enabled:
            row.update(loss_scale=self.scaler.scale, **({"skipped": True} if overflowed else {}))
        return row

    def _train_step(self, step: int) -> tuple[float, int, int]:
        """Every micro-batch of the step forward and backward, then the gradients summed over the ranks:
        (the global batch's summed loss, a 0-dim tensor not yet read; trained tokens; input tokens)."""
        micro = [self.collate([self.train_data[i] for i in idx], self.tokenizer.pad_token_id)
                 for idx in self.schedule.micro_batches(step)]
        local_trained = sum(self.objective.count(b) for b in micro)  # trained tokens, or pairs
        n_trained, n_input = self.strategy.sum_counts([local_trained, sum(count_tokens(b) for b in micro)])
        loss_sum = torch.zeros((), device=self.device)
        for batch in micro:
            micro_sum, _ = self._micro_batch(batch, self.objective.loss)
            self.scaler.scaled(micro_sum / max(n_trained, 1)).backward()
            loss_sum += micro_sum.detach()
        self.strategy.reduce_grads(self.params)
        take = getattr(self.objective, "take_stats", None)
        if take is None:
            return self.strategy.sum(loss_sum), n_trained, n_input
        # preference: the rewards' sums ride along in the same all-reduce (train_step reads them with the loss)
        summed = self.strategy.sum(torch.cat([loss_sum.float()[None], take(self.device)]))
        self.step_stats = summed[1:]
        return summed[0], n_trained, n_input

    def _micro_batch(self, batch: dict, objective_fn):
        """objective_fn(hidden, head, batch) of one micro-batch: the student's last hidden states
        (batch, seq, dim) from its decoder, its output head, the batch on the device. objective_fn is
        the objective's `loss` (summed loss, trained tokens) or `eval_sums`. Under the precision
        policy's autocast where the method asks for it while training (`_autocast`), through the strategy's `run` (FSDP: inside the root unit, its outer weights gathered)."""
        # Packed batches carry position_ids instead of attention_mask; with per-example attention the
        # examples' lengths go along, read here from the host tensor (tunekit.speed.packed_attention)
        packed = {"packed_lengths": packed_attention.lengths_of(batch["position_ids"][0].tolist())} \
            if self.plain_attention is not None and "position_ids" in batch else {}
        batch = {k: v.to(self.device) for k, v in batch.items()}
        decoder, head = decoder_and_head(self.model)

        def forward():
            with offload.offload_context(self.device) if self.offload else contextlib.nullcontext():
                inputs = self.strategy.decoder_inputs(self.model, decoder, model_inputs(batch))
                hidden = decoder(**inputs, **packed, use_cache=False).last_hidden_state
            return objective_fn(hidden, head, batch)

        with self.precision.autocast(self.device, self._autocast()):
            return self.strategy.run(forward)

    def _autocast(self) -> bool:
        """Whether this forward runs under the policy's autocast: where the method asks for it, and
        only while training. Held-out forwards of a method whose trained weights are the model's own
        (`full`) compute in those fp32 weights, as `tunekit eval` and the export read them: their
        bf16 copies differ from the weights by up to half of bf16's resolution, enough to move a
        short fine-tune's held-out loss (tunekit.methods.full.rounding)."""
        return self.method.autocast and self.model.training

    def _stop_non_finite(self, step: int, what: str) -> None:
        """Every rank sees the same reduced loss and gradients, so all stop here together."""
        last = latest_checkpoint(self.output_dir)
        kept = (f"the last good checkpoint is {last} (resume from it with trainer.resume=true)" if last
                else "no checkpoint was saved before it")
        raise TunekitError(f"step {step + 1}: {what}; training stopped and nothing more was saved: {kept}. "
                           "Lower trainer.lr, check trainer.max_grad_norm, or look for bad rows in the data")

    def _held_out_sums(self, names: list[str]) -> list[list[float]]:
        """Per held-out group (each source of a list of sources, else the whole set), the sums of the
        objective's eval `names` and the trained tokens, over every rank: [[sum per name..., tokens]]."""
        # Every rank reduces the same named sums, even one with no held-out batch (fewer held-out
        # rows than ranks): a rank reducing fewer values would hang NCCL.
        groups = getattr(self, "val_groups", None) or [(None, list(range(len(self.val_data))))]
        sums = torch.zeros((len(groups), len(names) + 1), device=self.device, dtype=torch.float64)
        batches = []  # (group, rows): each group's rows split over the ranks and grouped by length apart
        for g, (_, rows) in enumerate(groups):
            lengths = [example_length(self.val_data[i]) for i in rows]
            batches += [(g, [rows[j] for j in idx]) for idx in eval_micro_batches(
                lengths, self.cfg.trainer.micro_batch_size, self.strategy.world_size, self.strategy.rank,
                min_padding=not self.cfg.data.packing)]
        # Where forwards are collective (FSDP: each gathers weights from every rank), each rank runs as
        # many as the busiest: the extra ones on a held-out row, not counted
        extra = self.strategy.missing_forwards(len(batches))
        for g, idx in batches:
            batch = self.collate([self.val_data[i] for i in idx], self.tokenizer.pad_token_id)
            parts, n = self._micro_batch(batch, self.objective.eval_sums)
            sums[g] += torch.stack([parts[name].double() for name in names] + [n.double().to(self.device)])
        for _ in range(extra):
            self._micro_batch(self.collate([self.val_data[0]], self.tokenizer.pad_token_id), self.objective.eval_sums)
        reduced = self.strategy.sum(sums.flatten()).view(len(groups), len(names) + 1).tolist()
        return reduced

    @torch.no_grad()
    def evaluate(self, step: int) -> dict:
        """Token-weighted held-out metrics (split across ranks, sums reduced): val_loss, plus
        val_ce and val_kl (to the teacher) when distilling; with a list of sources, each source's
        own too (eval/<name>/loss, ...)."""
        self.model.eval()
        names = list(self.objective.eval_names)
        per_group = self._held_out_sums(names)
        self.model.train()
        reduced = [sum(col) for col in zip(*per_group)]
        # means over the trained tokens (preference: over the pairs, and KTO's rewards over their rows)
        finish = getattr(self.objective, "finish", None) or _per_unit
        metrics = {f"val_{k}": v for k, v in finish(dict(zip(names, reduced[:-1])), reduced[-1]).items()}
        for (source, _), sums in zip(getattr(self, "val_groups", None) or [], per_group):
            metrics.update({f"eval/{source}/{k}": v for k, v in finish(dict(zip(names, sums[:-1])), sums[-1]).items()})
        if not hasattr(self.objective, "finish"):  # preference: a loss per pair, no perplexity
            metrics["val_ppl"] = math.exp(min(metrics.get("val_ce", metrics["val_loss"]), 50))
        samples = []
        if self.probe is not None:
            # generation pads its prompts and keeps a KV cache: the model's own attention; no autocast,
            # as every held-out forward (_autocast)
            with packed_attention.plain(self.model, self.plain_attention):
                task_metrics, samples = self.strategy.run(self.probe, self.model)
            metrics.update(task_metrics)
        self.tracker.eval({"step": step, **metrics})
        self.tracker.samples(step, samples)
        if self.cfg.trainer.keep_best:  # every rank: gathering the trained tensors may be collective
            with self.strategy.full_trained(self.model):
                if self.best is not None and self.best.update(step, metrics, lambda d: self.method.save(self.model, d)):
                    self._info(f"keep_best: new best {self.best.metric} {self.best.value:.4f} at step {step}")
        return metrics

    # ------------------------------------------------------------------ save
    def save_checkpoint(self, step: int) -> None:
        """checkpoints/step-N/ (tunekit.train.checkpoint): adapter, optimizer and scheduler state, every
        rank's RNG state. Every rank takes part; rank 0 writes."""
        rng = self.strategy.gather(dev.rng_state(self.device))  # every rank's own stream, in rank order
        optimizer = self.strategy.optimizer_to_save(self.optimizer)
        with self.strategy.full_trained(self.model):
            if self.main:
                facts = {"tokens_seen": self.tokens_seen, "first_eval": self.first_eval,
                         "data_position": self.schedule.start(step),  # where the next step's examples start
                         "fingerprint": self.fingerprint,
                         **({"loss_scaler": self.scaler.state_dict()} if self.scaler.enabled else {})}
                save_checkpoint(self.output_dir, step, lambda d: self.method.save(self.model, d), optimizer,
                                self.scheduler, facts, rng, self.cfg.trainer.keep_checkpoints)
        self.strategy.barrier()

    def save_final(self) -> None:
        """output_dir/adapter/: PEFT adapter + tokenizer, loadable by PeftModel.from_pretrained."""
        with self.strategy.full_trained(self.model):
            if self.main:
                self._save_final()
        self.strategy.barrier()

    def _save_final(self) -> None:
        best = self.best.adapter_dir if self.best is not None else None

        def write(d: Path) -> None:
            if best is not None:  # keep_best: the best evaluation's adapter; the last is in checkpoints/
                shutil.copytree(best, d, dirs_exist_ok=True)
            else:
                self.method.save(self.model, d)
            self.tokenizer.save_pretrained(d)

        atomic_dir(self.output_dir / "adapter", write)
        self._info(f"adapter saved to {self.output_dir / 'adapter'}"
                   + (f" (keep_best: step {self.best.step}, {self.best.metric} {self.best.value:.4f})" if best else ""))

    # ------------------------------------------------------------------ the end
    def _summary(self, wall_s: float, last_val) -> dict:
        """summary.json: first and last evaluation, what ran and how (collective: every rank builds it)."""
        return {**{f"first_{k}": v for k, v in (self.first_eval or {}).items()},
                **{f"last_{k}": v for k, v in (last_val or {}).items()}, "steps": self.cfg.trainer.max_steps,
                "epochs": self.cfg.trainer.epochs, "epochs_trained": self.schedule.epoch_of(self.cfg.trainer.max_steps),
                "resumed_from_step": self.start_step or None,
                "wall_s": wall_s, "trainable_params": self.trainable_params,
                **({"start_adapter": self.start_adapter.record()} if self.start_adapter is not None else {}),
                "bits_per_param": self.bits_per_param, "world_size": self.strategy.world_size,
                "device": self.facts.describe(), "compute_dtype": str(self.dtype).removeprefix("torch."),
                "precision": self._precision_report(), "memory": self._memory_report(), "data": self.data_report,
                "kernels": self.lora_backend.as_dict(),
                **({"loss_scaling": {**self.scaler.state_dict(), "skipped_steps": self.scaler.skipped}}
                   if self.scaler.enabled else {}),
                "compile": self.compiled.as_dict(),
                **({"threads": self.threads["summary"]} if self.threads else {}),
                "ranks_in_sync": self.strategy.in_sync(self.params),
                **self.strategy.summary(dev.peak_memory_mb(self.device)),
                **(self.best.summary() if self.best else {})}

    def _precision_report(self) -> dict:
        """The policy, and what the run's tensors and first step actually had."""
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        _, head = decoder_and_head(self.model)
        return {**self.precision.as_dict(), "observed": {
            "embeddings": dev.dtype_name(base.get_input_embeddings().weight.dtype),
            "head": dev.dtype_name(head.weight.dtype),
            "trained": sorted({dev.dtype_name(p.dtype) for p in self.params}),
            "attention": dict(self.attention_seen)}}

    def _memory_report(self) -> dict:
        """This rank's measured training peak beside the plan's: torch's peak allocation on a GPU; on a
        CPU the process's peak RSS, which also holds the runtime and the allocator's retention (the
        plan's device total counts both). `setup_peak_mib`: the same measure over setup (loading and
        quantizing the base, the kernel proofs), which the step plan does not cover; `setup_phases_mib`
        splits it by phase (each phase's own peak: where a setup transient comes from).
        `offloaded_activations`: whether checkpointed blocks' inputs went to host memory."""
        out = {"peak_mib": round(dev.peak_memory_mb(self.device), 1),
               "setup_peak_mib": round(self.setup_peak_mb, 1),
               "setup_phases_mib": {k: round(v, 1) for k, v in self.setup_phases_mb.items()},
               "measured_as": dev.peak_memory_kind(self.device), "offloaded_activations": bool(self.offload)}
        if self.planned is not None:
            out["planned_step_peak_mib"] = round(self.planned.peak / 2**20, 1)
            out["planned_device_total_mib"] = round(self.planned.device_total() / 2**20, 1)
        return out

    def cleanup(self) -> None:
        self.release()
        if getattr(self, "cudnn_attention_before", None) is not None:
            precision.set_cudnn_attention(self.cudnn_attention_before)
        if self.peers is not None:
            # every rank stops watching before any may exit: one that ends first is not one that died
            self.peers.close()
            self.strategy.barrier()
        self.acc.end_training()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            # The model, its sharded state and the optimizer hold tensors and collective handles tied
            # to the group: let them go while the interpreter is whole, then the group, rather than
            # leave both to interpreter teardown, where gloo's threads may still hold them.
            self.model = self.optimizer = self.scheduler = self.params = self.strategy = None
            gc.collect()
            torch.distributed.destroy_process_group()


def _per_unit(sums: dict[str, float], n: float) -> dict[str, float]:
    """Held-out sums as means over the `n` units they were summed over (trained tokens)."""
    return {k: v / max(n, 1) for k, v in sums.items()}
