"""The training recipe: setup() builds everything from the config, train() is one readable loop.

    forward -> token-summed loss -> backward (x grad_accum) -> all-reduce -> clip -> step -> log/eval/save

Gradient accumulation and data parallelism are done by hand rather than through DDP so that
the loss is normalised exactly: every micro-batch's summed loss is divided by the number of
trained tokens in the whole global batch (all micro-batches, all ranks), and the ranks' gradients
are summed. The result is the gradient of the mean token loss over the global batch, which a mean
of per-micro-batch means is not. Only the adapter's parameters are reduced: a few MB.

With trainer.strategy=fsdp (and several ranks) `self.fsdp` shards the model instead
(tunekit.train.fsdp): the same loss normalisation and summed gradients, reduced by FSDP in backward;
the points where the loop differs call `self.fsdp` and say so.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import math
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from omegaconf import OmegaConf
from transformers import AutoConfig

from tunekit import TunekitError
from tunekit.speed import device as dev
from tunekit.speed import torch_compile as compiled, precision, threads
from tunekit.train.checkpoint import (atomic_dir, atomic_write_text, cleanup_leftovers, find_resumable, latest_checkpoint,
                                load_checkpoint, read_state, save_checkpoint)
from tunekit.config import TrainConfig, plain
from tunekit.data import BatchSchedule, IGNORE, collate, collate_packed, count_tokens, eval_micro_batches, load_splits
from tunekit.train.fsdp import quant_storage
from tunekit.speed.lora_path import FusedDecision, agree_on_path, broadcast_from_rank0, choose_lora_path
from tunekit.train.objective import DistillObjective, SFTObjective, check_same_vocabulary, model_inputs
from tunekit.methods import get_method, trainable_parameters
from tunekit.model.student import make_student
from tunekit.model import (decoder_and_head, load_base_model, load_tokenizer, prepare_for_training,
                           quantized_bits_per_param, resolve_model_path)
from tunekit.train.optim import build_optimizer, warmup_cosine
from tunekit.plan.choose import resolve_memory_settings
from tunekit.train.resume import (DATA_FINGERPRINT, check_not_foreign, check_output_dir, check_resumable, check_same_run,
                            fingerprint)
from tunekit.train.runlock import RunLock
from tunekit.train.tracking import NullTracker, Tracker

log = logging.getLogger("tunekit")


class TrainRecipe:
    def __init__(self, cfg: TrainConfig, output_dir: Path):
        self.cfg = cfg
        self.output_dir = Path(output_dir)
        self.lock = None  # rank 0's RunLock on output_dir, from setup() on

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        cfg = self.cfg
        self.acc = Accelerator(kwargs_handlers=[self._process_group_kwargs()])
        # A single process's Accelerator().device is `cuda` without an index (tunekit.speed.device.rank_device).
        self.device = dev.rank_device(self.acc.device, self.acc.local_process_index)
        self.facts = dev.probe(self.device)
        self.main = self.acc.is_main_process
        if not self.main:  # one copy of every info line, from rank 0
            logging.getLogger("tunekit").setLevel(logging.WARNING)
        self._take_output_dir()

        # Same seed on every rank: identical adapter init, identical data schedule.
        set_seed(cfg.seed)
        with self.acc.main_process_first():  # rank 0 converts the default model once
            self.model_path = resolve_model_path(cfg.model.path)
            if cfg.objective == "distill":
                self.teacher_path = resolve_model_path(cfg.distill.teacher, key="distill.teacher")
                if cfg.distill.student_keep_every:
                    self.model_path = str(make_student(self.teacher_path, cfg.distill.student_keep_every,
                                                       self.output_dir / "student_base"))
        self.tokenizer = load_tokenizer(self.model_path)
        self.train_data, self.val_data = load_splits(
            cfg.data.path, cfg.data.val_path, plain(cfg.data.format), self.tokenizer, cfg.data.max_seq_len,
            cfg.data.val_fraction, cfg.data.max_val_examples, cfg.seed,
        )
        self._info(f"data: {len(self.train_data)} train / {len(self.val_data)} held-out examples"
                   + (", packed" if cfg.data.packing else ""))
        self.collate = collate_packed if cfg.data.packing else collate

        # Before the model loads: `auto` settings from the memory plan (every rank choosing from the
        # least free memory of all; a run that cannot fit stops here), then what resume may use.
        least = lambda n: int(self.acc.gather(torch.tensor([n], device=self.device)).min())  # noqa: E731
        self._info(resolve_memory_settings(cfg, self.device, self.acc.num_processes, self.acc.local_process_index,
                                           least, self.output_dir))
        self.planned = self._plan()
        self.fingerprint = fingerprint(cfg, self.acc.num_processes)
        self.resume_from, self.resume_state = self._find_checkpoint() if cfg.trainer.resume else (None, None)

        self.precision = precision.decide(plain(cfg.model.dtype), self.facts)
        precision.apply(self.precision, self.facts)
        self.dtype = self.precision.compute
        self._info(self.precision.describe())
        quantize = plain(cfg.model.quantize)
        self.fsdp = self._fsdp()
        if self.fsdp is None:
            model = load_base_model(self.model_path, quantize, self.dtype, self.device)
        else:  # into host memory, 4-bit codes stored as bf16; sharding moves each rank's part to its device
            model = load_base_model(self.model_path, quantize, self.dtype, self.fsdp.load_device,
                                    quant_storage(quantize, self.dtype))
        bits = quantized_bits_per_param(model)
        where = f"on {self.facts.describe()}"
        if bits is not None:
            self._info(f"base: {self.model_path} in 4-bit NF4 + double quant, {bits:.3f} bits/param, "
                       f"compute {self.dtype}, {where}")
        else:
            self._info(f"base: {self.model_path} in {self.dtype}, {where}")
        self.bits_per_param = bits
        self.threads = threads.on_device(self.device.type, os.environ, torch.get_num_threads(), threads.cores())
        if self.threads:
            self._info(self.threads["line"])
        prepare_for_training(model, quantize, cfg.model.gradient_checkpointing)
        self.offload = dev.offload_activations(cfg.model.offload_activations, self.facts,
                                               bool(cfg.model.gradient_checkpointing), sharded=self.fsdp is not None)
        if self.offload:
            self._info("memory: checkpointed blocks' inputs offloaded to pinned host memory (model.offload_activations)")

        self.objective = self._build_objective(model)

        self.method = get_method(cfg.method.name)
        self.model = self.method.apply(model, cfg.method)
        if self.fsdp is None:
            # every rank takes rank 0's path (its own proof's timings could differ)
            self.lora_path = agree_on_path(choose_lora_path(self.model, plain(cfg.kernels.fused_lora), self.facts,
                                                            self.dtype), broadcast_from_rank0, self.model)
        else:
            self.lora_path = FusedDecision(plain(cfg.kernels.fused_lora), "peft", "trainer.strategy=fsdp")
        if self.lora_path.layers or plain(cfg.kernels.fused_lora) != "auto" or self.lora_path.checks:
            self._info(f"kernels: LoRA layers use {self.lora_path.path} ({self.lora_path.reason})")
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        trains = {n for n, p in self.model.named_parameters() if p.requires_grad}
        saves = {n for n, _ in self.model.named_parameters() if self.method.owns(n)}
        if trains != saves:  # a parameter that trains but is not saved would be lost at the end
            odd = sorted(trains ^ saves)
            raise TunekitError(f"method {cfg.method.name}: trains {len(trains)} tensors but saves {len(saves)} "
                               f"(first differing: {odd[0]})")
        trainable, total = trainable_parameters(self.model)
        self._info(f"method {cfg.method.name}: {trainable:,} trainable of {total:,} parameters ({100 * trainable / total:.3f}%)")
        self.trainable_params = trainable
        self.model.train()
        self.compiled = compiled.CompileDecision(False, "kernels.compile=false")
        if cfg.kernels.compile:  # config checks keep it from FSDP
            self.compiled = compiled.apply(self.model, self.compile_check_inputs(), self.dtype)
            self._info(f"kernels: {self.compiled.reason}")
        if self.fsdp is not None:  # from here on the trained tensors are shards; the optimizer steps them
            if self.resume_from is not None:  # the adapter goes into the whole tensors, before they are split
                self.method.load(self.model, self.resume_from / "adapter")
            self._info(self.fsdp.shard(self.model))
            self.params = self.fsdp.local

        t = cfg.trainer
        self.optimizer = build_optimizer(plain(t.optimizer), self.params, t.lr, t.weight_decay, self.device)
        self.scheduler = warmup_cosine(self.optimizer, t.warmup_steps, t.max_steps)
        self.schedule = BatchSchedule([len(e["input_ids"]) for e in self.train_data], t.micro_batch_size,
                                      t.grad_accum, self.acc.num_processes, self.acc.process_index, cfg.seed,
                                      min_padding=not cfg.data.packing)
        # Dropout masks differ per rank (as in DDP); everything that must agree is already built.
        # A resumed run then restores each rank's own RNG state saved with its checkpoint, so it
        # continues the random stream of an uninterrupted run.
        set_seed(cfg.seed + 1000 * self.acc.process_index)
        self.start_step, self.tokens_seen, self.first_eval = 0, 0, None
        self.attention_seen: dict = {}
        if self.resume_from is not None:
            self._resume()

        if self.main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.output_dir / "config.yaml", OmegaConf.to_yaml(OmegaConf.structured(cfg)))
            # the data files' checksums, beside the config: `tunekit eval RUN` re-splits data.path to find
            # the run's held-out rows, which is only the run's split while the file is unchanged
            atomic_write_text(self.output_dir / DATA_FINGERPRINT, json.dumps(
                {k: v for k, v in self.fingerprint.items() if k.endswith(":sha256")}, indent=2))
        self.tracker = (Tracker(self.output_dir, t.max_steps, self.start_step, cfg.tracker.name, cfg.tracker.project,
                                cfg.tracker.run_name, json.loads(json.dumps(asdict(cfg), default=str)))
                        if self.main else NullTracker())
        self._setup_task_eval()

    def _take_output_dir(self) -> None:
        """Rank 0 locks output_dir (tunekit.train.runlock), then checks what it holds and removes leftovers of
        interrupted saves; every rank gets its verdict. The other ranks never touch the lock: they are
        the same run, and a lock per rank would make rank 1 refuse rank 0's run."""
        cfg, problem = self.cfg, None
        if self.main:
            try:
                # A folder of the user's files is refused before a lock file goes into it; everything else
                # is checked under the lock, where no other run can come between the check and the
                # first write (and a folder in use is refused as such, naming its run).
                check_not_foreign(self.output_dir, cfg.trainer.allow_nonempty_output_dir)
                self.lock = RunLock.acquire(self.output_dir)
                if self.lock.stale:
                    self._info(f"output_dir: took over the lock of a run that ended without releasing it "
                               f"({self.lock.describe_stale()})")
                check_output_dir(self.output_dir, cfg.trainer.resume, cfg.trainer.allow_nonempty_output_dir)
                if cfg.trainer.resume:
                    check_resumable(self.output_dir, cfg.trainer.max_steps)
                for line in cleanup_leftovers(self.output_dir):
                    self._info(f"leftover of an interrupted save: {line}")
            except (TunekitError, OSError) as e:
                self.release()
                problem = str(e) if isinstance(e, TunekitError) else f"output_dir: {self.output_dir}: {e.strerror or e}"
        if self.acc.num_processes > 1:  # all ranks stop together, none left waiting in a collective
            problem = broadcast_from_rank0(problem)
        if problem is not None:
            raise TunekitError(problem)

    def release(self) -> None:
        """Let go of output_dir (rank 0's lock); every way out of a run calls it (tunekit.commands.train._train),
        and the kernel drops the lock anyway if the process dies first."""
        lock, self.lock = self.lock, None
        if lock is not None:
            lock.release()

    def _process_group_kwargs(self):
        """The collectives' timeout, set explicitly (accelerate's NCCL default is 10 minutes, shorter
        than rank 0 may spend alone saving a large checkpoint): tunekit.speed.device.dist_timeout_s of the
        checkpoint the plan predicts (the trained tensors and their optimizer state)."""
        from datetime import timedelta

        from accelerate.utils import InitProcessGroupKwargs

        from tunekit.plan.inputs import planner_inputs
        from tunekit.plan.memory import optimizer_state_bytes, trainable_tensors

        try:
            shape, setup = planner_inputs(self.cfg, dev.DeviceFacts("cpu"))
            tensors = trainable_tensors(shape, setup)
            size = 4 * sum(tensors) + optimizer_state_bytes(tensors, setup.optimizer)
        except TunekitError:  # a model the planner cannot shape: the base timeout alone
            size = None
        self.dist_timeout_s = dev.dist_timeout_s(self.cfg.trainer.dist_timeout_s, size)
        return InitProcessGroupKwargs(timeout=timedelta(seconds=self.dist_timeout_s))

    def _plan(self):
        """The memory plan of the settings just resolved (None where the planner cannot model the run)."""
        from tunekit.plan.choose import plan_for

        cfg = self.cfg
        try:
            return plan_for(cfg, self.facts, self.acc.num_processes, cfg.trainer.micro_batch_size,
                            bool(cfg.model.gradient_checkpointing))
        except TunekitError:
            return None

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
        """This rank's measured peak beside the plan's: torch's peak allocation on a GPU; on a CPU the
        process's peak RSS, which also holds the runtime and the allocator's retention (the plan's
        device total counts both)."""
        out = {"peak_mib": round(dev.peak_memory_mb(self.device), 1),
               "measured_as": dev.peak_memory_kind(self.device)}
        if self.planned is not None:
            out["planned_step_peak_mib"] = round(self.planned.peak / 2**20, 1)
            out["planned_device_total_mib"] = round(self.planned.device_total() / 2**20, 1)
        return out

    def compile_check_inputs(self) -> list[dict]:
        """kernels.compile's check batches: real training rows cut to unequal lengths, the two together
        and the first alone, each collated as a step collates them (padded and masked, or packed), on
        the device."""
        rows = [{k: self.train_data[i][k][:n] for k in ("input_ids", "labels")}
                for i, n in zip(range(len(self.train_data)), compiled.CHECK_LENGTHS)]
        batches = [self.collate(group, self.tokenizer.pad_token_id) for group in (rows, rows[:1])]
        return [{k: v.to(self.device) for k, v in model_inputs(batch).items()} for batch in batches]

    def _setup_task_eval(self) -> None:
        """Rank 0: sample answers / task metric at every evaluation, and keep_best (tunekit.train.task_eval).
        Under FSDP every rank runs the probe (each forward gathers weights from all ranks): the same
        rows through the same gathered weights give every rank the same answers; rank 0 reports them."""
        from tunekit.train.task_eval import BestKeeper, TrainingProbe, resolve_best_metric

        t = self.cfg.trainer
        self.probe = self.best = None
        if not self.main and self.fsdp is None:
            return
        probe = TrainingProbe(self.tokenizer, self.val_data, t.eval_samples, t.eval_task, t.eval_task_rows,
                              t.eval_max_new_tokens, t.micro_batch_size)
        self.probe = probe if probe.active else None
        if t.keep_best and self.main:
            self.best = BestKeeper(self.output_dir, resolve_best_metric(t.best_metric, self.probe), self.start_step)
            self._info(f"keep_best: following {self.best.metric}")

    def _build_objective(self, student):
        if self.cfg.objective == "sft":
            return SFTObjective()
        d = self.cfg.distill
        check_same_vocabulary(self.tokenizer, load_tokenizer(self.teacher_path, key="distill.teacher"), student.config,
                              AutoConfig.from_pretrained(self.teacher_path), self.teacher_path)
        teacher = load_base_model(self.teacher_path, plain(d.teacher_quantize), self.dtype, self.device,
                                  key="distill.teacher")
        self._info(f"distill: teacher {self.teacher_path} ({plain(d.teacher_quantize)}), {plain(d.divergence)}, "
                   f"alpha {d.alpha}, T {d.temperature}")
        return DistillObjective(teacher, d)

    def _find_checkpoint(self) -> tuple[Path | None, dict | None]:
        """The newest intact checkpoint to resume (checked before any model loads), or (None, None).
        check_resumable (in _take_output_dir) has already refused a run with nothing to resume."""
        ckpt, skipped = find_resumable(self.output_dir)
        for note in skipped:
            log.warning("skipping damaged checkpoint %s", note)
        if ckpt is None:
            self._info(f"trainer.resume=true but no checkpoint in {self.output_dir}: starting from step 0")
            return None, None
        state = read_state(ckpt)
        check_same_run(state.get("fingerprint", {}), self.fingerprint, ckpt)
        return ckpt, state

    def _resume(self) -> None:
        ckpt = self.resume_from
        if self.fsdp is None:  # (FSDP loaded it before sharding)
            self.method.load(self.model, ckpt / "adapter")
        optimizer = self.optimizer if self.fsdp is None else self.fsdp.optimizer_to_load(self.optimizer)
        state = load_checkpoint(ckpt, optimizer, self.scheduler)
        dev.set_rng_state(state["rng"][self.acc.process_index], self.device)
        self.start_step, self.tokens_seen = state["step"], state.get("tokens_seen", 0)
        self.first_eval = state.get("first_eval")
        self._info(f"resumed from {ckpt} (step {self.start_step})")

    def _info(self, msg: str) -> None:
        if self.main:
            log.info(msg)

    # ------------------------------------------------------------------ FSDP (tunekit.train.fsdp)
    def _fsdp(self):
        """The FSDP state when trainer.strategy=fsdp runs on several ranks, else None (DDP, or one process)."""
        if plain(self.cfg.trainer.strategy) != "fsdp":
            return None
        if self.acc.num_processes == 1:
            self._info("trainer.strategy=fsdp with one process: nothing to shard, training as a single process")
            return None
        from tunekit.train.fsdp import Sharded

        return Sharded(self.device, self.acc.num_processes, self.acc.process_index)

    def _run(self, fn, *args):
        """fn(*args); under FSDP inside the root unit, which gathers the weights outside the layers."""
        return fn(*args) if self.fsdp is None else self.fsdp.run(fn, *args)

    def _full_trained(self, needed: bool = True):
        """Under FSDP (collective): the full trained tensors in the model on rank 0, for Method.save."""
        return self.fsdp.full_trained(self.model) if self.fsdp is not None and needed else contextlib.nullcontext()

    # ------------------------------------------------------------------ train
    def train(self) -> dict:
        t = self.cfg.trainer
        start = time.perf_counter()
        try:
            if self.start_step == 0:
                self.first_eval = self.evaluate(0)
            last_val = self.first_eval
            for step in range(self.start_step, t.max_steps):
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
        summary = {**{f"first_{k}": v for k, v in (self.first_eval or {}).items()},
                   **{f"last_{k}": v for k, v in (last_val or {}).items()}, "steps": t.max_steps,
                   "resumed_from_step": self.start_step or None,
                   "wall_s": time.perf_counter() - start, "trainable_params": self.trainable_params,
                   "bits_per_param": self.bits_per_param, "world_size": self.acc.num_processes,
                   "device": self.facts.describe(), "compute_dtype": str(self.dtype).removeprefix("torch."),
                   "precision": self._precision_report(), "memory": self._memory_report(),
                   "kernels": self.lora_path.as_dict(),
                   "compile": self.compiled.as_dict(),
                   **({"threads": self.threads["summary"]} if self.threads else {}),
                   "ranks_in_sync": self._ranks_in_sync(),
                   **({"fsdp": self.fsdp.summary(dev.peak_memory_mb(self.device))} if self.fsdp is not None else {}),
                   **(self.best.summary() if self.best else {})}
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
            loss, n_trained, n_input = self._train_step(step)
        if self.fsdp is None:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.trainer.max_grad_norm).item()
        else:
            grad_norm = self.fsdp.clip_grad_norm(self.cfg.trainer.max_grad_norm)
            if step == self.start_step:
                self.fsdp.check_first_step(step, loss, grad_norm)
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self._stop_non_finite(step, f"the training loss is {loss} and the gradient norm {grad_norm}")
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.fsdp is not None:
            self.fsdp.zero_grad()
        finite = (all(bool(p.detach().isfinite().all()) for p in self.params) if self.fsdp is None
                  else self.fsdp.all_finite(self.params))
        if not finite:
            self._stop_non_finite(step, "the optimizer step made trainable weights inf/nan")
        self.tokens_seen += n_input
        dt = time.perf_counter() - start
        return {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": n_input / dt,
                "input_tokens": n_input, "trained_tokens": n_trained, "tokens_seen": self.tokens_seen,
                "step_time_s": dt, "epoch": self.schedule.epoch_of(step + 1), "memory_mb": dev.peak_memory_mb(self.device)}

    def _stop_non_finite(self, step: int, what: str) -> None:
        """Every rank sees the same reduced loss and gradients, so all stop here together."""
        last = latest_checkpoint(self.output_dir)
        kept = (f"the last good checkpoint is {last} (resume from it with trainer.resume=true)" if last
                else "no checkpoint was saved before it")
        raise TunekitError(f"step {step + 1}: {what}; training stopped and nothing more was saved: {kept}. "
                           "Lower trainer.lr, check trainer.max_grad_norm, or look for bad rows in the data")

    def _train_step(self, step: int) -> tuple[float, int, int]:
        micro = [self.collate([self.train_data[i] for i in idx], self.tokenizer.pad_token_id)
                 for idx in self.schedule.micro_batches(step)]
        local_trained = sum(int((b["labels"][:, 1:] != IGNORE).sum()) for b in micro)
        counts = torch.tensor([local_trained, sum(count_tokens(b) for b in micro)], device=self.device)
        n_trained, n_input = self.acc.reduce(counts, reduction="sum").tolist()
        loss_sum = torch.zeros((), device=self.device)
        for batch in micro:
            micro_sum, _ = self._loss(batch)
            (micro_sum / max(n_trained, 1)).backward()
            loss_sum += micro_sum.detach()
        self._all_reduce_grads()
        loss = self.acc.reduce(loss_sum, reduction="sum").item() / max(n_trained, 1)
        return loss, n_trained, n_input

    def _forward(self, batch: dict):
        """Student's last hidden states (batch, seq, dim), its output head, the batch on device."""
        batch = {k: v.to(self.device) for k, v in batch.items()}
        decoder, head = decoder_and_head(self.model)
        # Packed batches carry position_ids instead of attention_mask, from which transformers
        # builds per-example attention, but only when no KV cache is in play.
        with dev.offload_context(self.device) if self.offload else contextlib.nullcontext():
            hidden = decoder(**model_inputs(batch), use_cache=False).last_hidden_state
        return hidden, head, batch

    def _compute(self, fn):
        """fn() under the precision policy's autocast where the method asks for it (`full`: fp32
        master weights computing in bf16); under FSDP inside the root unit."""
        with self.precision.autocast(self.device, self.method.autocast):
            return self._run(fn)

    def _loss(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed loss, trained tokens) of one micro-batch."""
        return self._compute(lambda: self.objective.loss(*self._forward(batch)))

    def _all_reduce_grads(self) -> None:
        if self.fsdp is not None:  # FSDP summed every micro-batch's gradients into the shards in backward
            return self.fsdp.collect_grads()
        if self.acc.num_processes == 1:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        flat = self.acc.reduce(flat, reduction="sum")
        offset = 0
        for p, g in zip(self.params, grads):
            n = g.numel()
            p.grad = flat[offset : offset + n].view_as(p).to(p.dtype)
            offset += n

    def _ranks_in_sync(self) -> bool:
        """Every rank must end with bit-identical trainable weights; a desync is a bug, say so."""
        import hashlib

        from accelerate.utils import gather_object

        if self.fsdp is not None:
            return self.fsdp.in_sync()
        h = hashlib.sha256()
        for p in self.params:
            h.update(p.detach().float().cpu().numpy().tobytes())
        digests = gather_object([h.hexdigest()])
        if len(set(digests)) != 1:
            log.error("ranks disagree on the trained weights: %s", digests)
            return False
        return True

    @torch.no_grad()
    def evaluate(self, step: int) -> dict:
        """Token-weighted held-out metrics (split across ranks, sums reduced): val_loss, plus
        val_ce and val_kl (to the teacher) when distilling."""
        self.model.eval()
        # Every rank reduces the same named sums, even one with no held-out batch (fewer held-out
        # rows than ranks): a rank reducing fewer values would hang NCCL.
        names = list(self.objective.eval_names)
        sums = {name: torch.zeros((), device=self.device, dtype=torch.float64) for name in names}
        tokens = torch.zeros((), device=self.device, dtype=torch.float64)
        lengths = [len(e["input_ids"]) for e in self.val_data]
        batches = eval_micro_batches(lengths, self.cfg.trainer.micro_batch_size, self.acc.num_processes,
                                     self.acc.process_index, min_padding=not self.cfg.data.packing)
        # FSDP: every forward gathers weights from all ranks, so each rank runs as many as the busiest
        # (the extra ones on a held-out row, not counted)
        extra = self.fsdp.missing_forwards(len(batches)) if self.fsdp is not None else 0
        for idx in batches:
            batch = self.collate([self.val_data[i] for i in idx], self.tokenizer.pad_token_id)
            parts, n = self._compute(lambda: self.objective.eval_sums(*self._forward(batch)))
            for name in names:
                sums[name] += parts[name].double()
            tokens += n.double().to(self.device)
        for _ in range(extra):
            filler = self.collate([self.val_data[0]], self.tokenizer.pad_token_id)
            self._compute(lambda: self.objective.eval_sums(*self._forward(filler)))
        self.model.train()
        reduced = self.acc.reduce(torch.stack([sums[k] for k in names] + [tokens]), reduction="sum").tolist()
        metrics = {f"val_{k}": v / max(reduced[-1], 1) for k, v in zip(names, reduced[:-1])}
        metrics["val_ppl"] = math.exp(min(metrics.get("val_ce", metrics["val_loss"]), 50))
        samples = []
        if self.probe is not None:
            task_metrics, samples = self._compute(lambda: self.probe(self.model))
            metrics.update(task_metrics)
        self.tracker.eval({"step": step, **metrics})
        self.tracker.samples(step, samples)
        with self._full_trained(self.cfg.trainer.keep_best):
            if self.best is not None and self.best.update(step, metrics, lambda d: self.method.save(self.model, d)):
                self._info(f"keep_best: new best {self.best.metric} {self.best.value:.4f} at step {step}")
        return metrics

    # ------------------------------------------------------------------ save
    def save_checkpoint(self, step: int) -> None:
        from accelerate.utils import gather_object

        rng = gather_object([dev.rng_state(self.device)])  # every rank's own stream, in rank order
        optimizer = self.optimizer if self.fsdp is None else self.fsdp.optimizer_to_save(self.optimizer)
        with self._full_trained():
            if self.main:
                facts = {"tokens_seen": self.tokens_seen, "first_eval": self.first_eval,
                         "fingerprint": self.fingerprint}
                save_checkpoint(self.output_dir, step, lambda d: self.method.save(self.model, d), optimizer,
                                self.scheduler, facts, rng, self.cfg.trainer.keep_checkpoints)
        self.acc.wait_for_everyone()

    def save_final(self) -> None:
        """output_dir/adapter/: PEFT adapter + tokenizer, loadable by PeftModel.from_pretrained."""
        with self._full_trained():
            self._save_final()
        self.acc.wait_for_everyone()

    def _save_final(self) -> None:
        if self.main:
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

    def cleanup(self) -> None:
        self.release()
        self.acc.end_training()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            # The model, its FSDP state and the optimizer hold tensors and collective handles tied to
            # the group: let them go while the interpreter is whole, then the group, rather than
            # leave both to interpreter teardown (where gloo's threads may still hold them). Once,
            # in a full suite run, rank 1 of a 2-rank FSDP run aborted at exit ("terminate called
            # without an active exception"); not reproduced since, so this is a precaution.
            self.model = self.optimizer = self.scheduler = self.params = self.fsdp = None
            gc.collect()
            torch.distributed.destroy_process_group()
