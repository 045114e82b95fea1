"""The steps of TrainRecipe.setup(), one method each, in the order setup() runs them.

Every rank runs every step (rank 0 alone writes files and logs); what must agree between ranks is
either computed the same everywhere (same seed, same config) or decided by rank 0 and broadcast.
Nothing here asks which strategy runs: the strategy object answers (tunekit.train.strategy).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
from dataclasses import asdict
from pathlib import Path

import torch
from accelerate.utils import set_seed
from omegaconf import OmegaConf
from transformers import AutoConfig

from tunekit import TunekitError
from tunekit.config import AUTO, DEFAULT_MAX_STEPS, STUDENT_DIR, TrainConfig, plain
from tunekit.data import BatchSchedule, collate, collate_packed, load_splits
from tunekit.data.batching import describe_epochs, steps_for_epochs
from tunekit.data.cache import cache_for
from tunekit.data.preference import example_length
from tunekit.methods import get_method, in_train_schema, trainable_parameters
from tunekit.model import (load_base_model, load_tokenizer, prepare_for_training, quantized_bits_per_param,
                           resolve_model_path)
from tunekit.model.student import make_student
from tunekit.plan.choose import resolve_memory_settings
from tunekit.plan.inputs import reference_is_base
from tunekit.device import facts as dev
from tunekit.device import precision, threads
from tunekit.speed import packed_attention
from tunekit.speed import torch_compile as compiled
from tunekit.train.checkpoint import atomic_write_text, find_resumable, load_checkpoint, read_state
from tunekit.train.loss_scale import LossScaler
from tunekit.train.objective import DistillObjective, SFTObjective, check_same_vocabulary, model_inputs
from tunekit.train.optim import build_optimizer, warmup_cosine
from tunekit.train.resume import (DATA_FINGERPRINT, check_not_foreign, check_output_dir, check_resumable, check_same_run,
                                  check_steps_left, fingerprint)
from tunekit.train.runlock import RunLock
from tunekit.train.start import apply_method
from tunekit.train.tracking import NullTracker, Tracker

log = logging.getLogger("tunekit")


class RecipeSetup:
    """What TrainRecipe (tunekit.train.loop) inherits: its setup steps. Each sets the attributes it
    names; later steps read the earlier ones'."""

    cfg: TrainConfig
    output_dir: Path

    def _info(self, msg: str) -> None:
        if self.main:
            log.info(msg)

    def _process_group_kwargs(self):
        """The collectives' timeout, set explicitly (accelerate's NCCL default is 10 minutes, shorter
        than rank 0 may spend alone saving a large checkpoint): tunekit.device.facts.dist_timeout_s of the
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

    # ---------------------------------------------------------------- before the model
    def _lock_output_dir(self) -> None:
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
                    # the fingerprint here too: a changed recipe or seed is named with any other conflict
                    # (rank 0; _find_checkpoint computes it on every rank, with the auto settings resolved)
                    self.fingerprint = fingerprint(cfg, self.strategy.world_size)
                    check_resumable(self.output_dir, cfg.trainer.max_steps, self.fingerprint)
                # what killed runs' saves left, removed; then this run's scratch home, where its saves go
                for line in self.lock.open_scratch():
                    self._info(f"leftover of an interrupted save: {line}")
            except (TunekitError, OSError) as e:
                self.release()
                problem = str(e) if isinstance(e, TunekitError) else f"output_dir: {self.output_dir}: {e.strerror or e}"
        problem = self.strategy.broadcast(problem)  # all ranks stop together, none left waiting in a collective
        if problem is not None:
            raise TunekitError(problem)

    def _resolve_models(self) -> None:
        """model_path (the student: model.path, or distill.student_keep_every's cut of the teacher) and
        teacher_path. Rank 0 first: it converts the default model once, the others find it done."""
        cfg = self.cfg
        self.start_adapter = None
        with self.acc.main_process_first():
            self.model_path = resolve_model_path(cfg.model.path)
            if cfg.objective == "distill":
                self.teacher_path = resolve_model_path(cfg.distill.teacher, key="distill.teacher")
                if cfg.distill.student_keep_every:
                    self.model_path = str(make_student(self.teacher_path, cfg.distill.student_keep_every,
                                                       self.output_dir / STUDENT_DIR))
        if cfg.model.adapter is not None:  # the frozen start (model.adapter): checked again, its hash kept
            from tunekit.model.start_adapter import check_start_base, open_start

            self.start_adapter = open_start(cfg.model.adapter)
            note = check_start_base(self.start_adapter, cfg.model.path)
            if note and self.main:
                log.warning("%s", note)
            self._info(f"model.adapter: {self.start_adapter.folder} loaded frozen under the new adapter "
                       f"(sha256 {self.start_adapter.sha256[:12]}...)")

    def _load_data(self) -> None:
        """The tokenizer, the train / held-out splits, and the collate function (padded or packed)."""
        cfg = self.cfg
        self.tokenizer = load_tokenizer(self.model_path)
        self._use_chat_template()
        if cfg.objective == "preference":
            return self._load_preference_data()
        # one rank per machine writes the tokenized cache; every rank reads it (docs/data.md#tokenized-cache)
        cache = cache_for(cfg.data.cache, cfg.data.cache_dir, write=self.acc.is_local_main_process)
        splits = load_splits(
            cfg.data.path, cfg.data.val_path, plain(cfg.data.format), self.tokenizer, cfg.data.max_seq_len,
            cfg.data.val_fraction, cfg.data.max_val_examples, cfg.seed, cache=cache, num_proc=cfg.data.num_proc,
        )
        self.train_data, self.val_data = splits
        self.val_groups = splits.val_groups  # a list of sources: each one's held-out rows, evaluated apart
        # Rows longer than data.max_seq_len lose their end, replies included: said once here, and in
        # summary.json, so that a cut that costs a share of the training signal is seen.
        train, val = splits.train.truncation(), splits.val.truncation()
        self.data_report = {"max_seq_len": cfg.data.max_seq_len, "train": train.as_dict(), "held_out": val.as_dict(),
                            "dropped_rows": {d.path: len(d.rows) for d in splits.dropped}}
        if splits.sources is not None:  # a list of sources: what each has, gives and holds out
            self.data_report["sources"] = [r.as_dict() for r in splits.sources]
            for r in splits.sources:
                self._info(r.line())
        self._info(f"data: {len(self.train_data)} train / {len(self.val_data)} held-out examples"
                   + (", packed" if cfg.data.packing else "")
                   + f"; data.max_seq_len={cfg.data.max_seq_len}: {train.phrase('training')}, {val.phrase('held-out')}")
        self.collate = collate_packed if cfg.data.packing else collate

    def _use_chat_template(self) -> None:
        """data.chat_template: the tokenizer's template, the special tokens it lacked added
        (`new_token_ids`, whose embedding rows _load_model makes and the method trains)."""
        from tunekit.data.templates import use_template

        self.vocab_before, self.new_token_ids = len(self.tokenizer), ()
        value = self.cfg.data.chat_template
        if value is None:
            return
        setup = use_template(self.tokenizer, value)
        if setup.added:
            self._check_new_tokens(value, setup.added)
            self.new_token_ids = setup.added_ids
        self._info(setup.line(self.vocab_before))

    def _check_new_tokens(self, value: str, added: tuple) -> None:
        """Tokens data.chat_template adds need rows the method trains, one vocabulary (distillation),
        and a model that is not sharded as it loads (FSDP); else one line."""
        tokens = ", ".join(added)
        get_method(self.cfg.method.name).check_new_tokens(self.cfg.method,
                                                          f"data.chat_template={value}: adds {tokens} to the tokenizer")
        if self.cfg.objective == "distill":
            raise TunekitError(f"data.chat_template={value}: adds {tokens} to the student's tokenizer, which the "
                               "teacher's vocabulary lacks; distillation needs one vocabulary")
        loss = plain(self.cfg.preference.loss)
        if reference_is_base(self.cfg):
            raise TunekitError(f"data.chat_template={value}: adds {tokens} to the tokenizer, whose trained rows the "
                               f"reference of preference.loss={loss} would read (it applies the head outside the "
                               "adapter's off-switch); use preference.loss=orpo or simpo, or a base whose tokenizer has them")
        if self.strategy.forwards_are_collective:
            raise TunekitError(f"data.chat_template={value}: adds {tokens} to the tokenizer; training new embedding "
                               "rows under FSDP is not supported: train on one device or with data parallel ranks")

    def _load_preference_data(self) -> None:
        """objective=preference: pairs (or KTO's unpaired rows) as examples, a micro-batch of N pairs
        collated as 2N rows (tunekit.data.preference)."""
        from tunekit.data.preference import collate_preference, load_preference_splits

        d = self.cfg.data
        self.train_data, self.val_data, kind, (train_cut, val_cut) = load_preference_splits(
            d.path, d.val_path, self.tokenizer, d.max_seq_len, d.val_fraction, d.max_val_examples, self.cfg.seed)
        self.data_report = {"max_seq_len": d.max_seq_len, "preference_rows": kind, "train": train_cut.as_dict(),
                            "held_out": val_cut.as_dict() if val_cut is not None else None}
        unit = "pairs" if kind == "pairs" else "unpaired rows"
        self._info(f"data: {len(self.train_data)} train / {len(self.val_data)} held-out {unit}; data.max_seq_len="
                   f"{d.max_seq_len}: {train_cut.phrase('training')}"
                   + (f", {val_cut.phrase('held-out')}" if val_cut is not None else ""))
        if train_cut.dropped:
            log.warning("%d rows dropped: no completion token within data.max_seq_len=%d (first: %s)",
                        len(train_cut.dropped), d.max_seq_len, train_cut.dropped[0])
        self.collate = collate_preference
        if plain(self.cfg.preference.loss) == "kto" and self.cfg.preference.kto_kl == "batch":  # KTO's KL rows
            self.collate = functools.partial(collate_preference, kl_max_len=d.max_seq_len)

    def _plan_memory(self) -> None:
        """Before the model loads: `auto` settings from the memory plan, every rank choosing from the
        least free memory of all (a run that cannot fit stops here); `planned`, the plan of the
        settings resolved (None where the planner cannot model the run)."""
        from tunekit.plan.choose import plan_for

        cfg, world = self.cfg, self.strategy.world_size
        auto_micro = cfg.trainer.micro_batch_size == AUTO
        self._info(resolve_memory_settings(cfg, self.device, world, self.acc.local_process_index,
                                           self.strategy.least, self.output_dir))
        if cfg.objective == "preference":
            from tunekit.train.preference import check_kto_micro_batch

            check_kto_micro_batch(cfg, chosen_by_auto=auto_micro)
        try:
            self.planned = plan_for(cfg, self.facts, world, cfg.trainer.micro_batch_size,
                                    bool(cfg.model.gradient_checkpointing))
        except TunekitError:
            self.planned = None

    def _find_checkpoint(self) -> None:
        """The run's fingerprint, and with trainer.resume the newest intact checkpoint (`resume_from`,
        its `resume_state`), checked against it before any model loads; (None, None) otherwise.
        check_resumable (in _lock_output_dir) has already refused a run with nothing to resume."""
        # again, with the `auto` settings resolved; the data files' hashes of _lock_output_dir reused
        self.fingerprint = fingerprint(self.cfg, self.strategy.world_size, hashes=self.fingerprint)
        self.resume_from, self.resume_state = None, None
        if not self.cfg.trainer.resume:
            return
        ckpt, skipped = find_resumable(self.output_dir)
        for note in skipped:
            log.warning("skipping damaged checkpoint %s", note)
        if ckpt is None:
            self._info(f"trainer.resume=true but no checkpoint in {self.output_dir}: starting from step 0")
            return
        state = read_state(ckpt)
        note = check_same_run(state.get("fingerprint", {}), self.fingerprint, ckpt)
        if note:  # data parallel on another number of ranks: the global batch changes size
            self._info(note)
        self.resume_from, self.resume_state = ckpt, state

    def _choose_start(self) -> None:
        """The method's `auto` start (LoRA's method.init=auto: LoftQ where its cost is small against the
        run), once the run's steps are known and before the model loads; a resumed run keeps its first
        start's choice. Every rank decides from the same plan and steps, so they agree."""
        from tunekit.plan.choose import saved_settings

        kept = saved_settings(self.output_dir).get("method_init") if self.cfg.trainer.resume else None
        note = get_method(self.cfg.method.name).resolve_start(self.cfg, self.facts, self.planned,
                                                              int(self.cfg.trainer.max_steps), kept)
        if note:
            self._info(note)
            if self.planned is not None:  # the plan of what will run (a LoftQ start's own phase)
                from tunekit.plan.choose import plan_for

                self.planned = plan_for(self.cfg, self.facts, self.strategy.world_size,
                                        self.cfg.trainer.micro_batch_size, bool(self.cfg.model.gradient_checkpointing))

    def _resolve_steps(self) -> None:
        """trainer.max_steps from trainer.epochs, once the training rows and the global batch are known
        (the same count on every rank); max_steps=auto without epochs (a config built without the
        command line's checks): DEFAULT_MAX_STEPS. The LR schedule, the eval/save cadence, the progress
        bar and summary.json read the resolved count."""
        t = self.cfg.trainer
        if t.epochs is None:
            if t.max_steps in (None, AUTO):
                t.max_steps = DEFAULT_MAX_STEPS
            return
        world, rows = self.strategy.world_size, len(self.train_data)
        resumed = (0, 0)
        if self.resume_state is not None:
            resumed = self._resumed_position()
        t.max_steps = steps_for_epochs(t.epochs, rows, t.micro_batch_size * t.grad_accum * world, resumed)
        self._info(describe_epochs(t.epochs, rows, t.micro_batch_size, t.grad_accum, world, t.max_steps, resumed))
        if self.resume_from is not None:
            check_steps_left(resumed[0], t.max_steps, t.epochs, self.resume_from)

    def _resumed_position(self) -> tuple[int, int]:
        """(step, position of its first row in the data order) of the checkpoint resumed from."""
        t, state = self.cfg.trainer, self.resume_state
        step = state["step"]
        ranks = state.get("fingerprint", {}).get("world_size") or self.strategy.world_size
        # checkpoints before data_position was saved: every step had the checkpoint's global batch
        return step, state.get("data_position", step * t.micro_batch_size * t.grad_accum * ranks)

    def _choose_precision(self) -> None:
        """The precision policy (tunekit.device.precision) from model.dtype and the device; `dtype` is
        its compute dtype."""
        self.precision = precision.decide(plain(self.cfg.model.dtype), self.facts)
        # every rank computes in rank 0's dtype (ranks on different GPU models could decide otherwise)
        self.precision = precision.agree(self.precision, self.facts, self.strategy.broadcast)
        precision.apply(self.precision, self.facts)
        self.cudnn_attention_before = precision.set_cudnn_attention(self.cfg.kernels.cudnn_attention)
        self.dtype = self.precision.compute
        self._info(self.precision.describe())

    # ---------------------------------------------------------------- the model
    def _load_model(self) -> None:
        """The base, where and as the strategy stores it, prepared for training (gradient
        checkpointing, k-bit preparation); thread settings and activation offload."""
        cfg, quantize = self.cfg, plain(self.cfg.model.quantize)
        self._info(self.strategy.describe())
        stream = self.strategy.stream_base(self.model_path, quantize, self.dtype, cfg.method.name,
                                           get_method(cfg.method.name), cfg.method)
        self.stream = stream
        if stream is not None:  # the structure alone: rank 0 reads the weights into the shards at _wrap_model
            model = stream.skeleton
        else:
            model = load_base_model(self.model_path, quantize, self.dtype, self.strategy.load_device,
                                    self.strategy.storage_dtype(quantize, self.dtype))
        if self.new_token_ids:  # data.chat_template's added tokens: their rows (tunekit.model.vocab)
            from tunekit.model.vocab import grow_embeddings

            self._info(grow_embeddings(model, len(self.tokenizer), self.new_token_ids, self.vocab_before))
        bits = quantized_bits_per_param(model)
        where = f"on {self.facts.describe()}"
        if stream is not None and quantize == "nf4":
            self._info(f"base: {self.model_path} in 4-bit NF4 + double quant (quantized by rank 0 as it streams), "
                       f"compute {self.dtype}, {where}")
        elif bits is not None:
            self._info(f"base: {self.model_path} in 4-bit NF4 + double quant, {bits:.3f} bits/param, "
                       f"compute {self.dtype}, {where}")
        else:
            self._info(f"base: {self.model_path} in {self.dtype}, {where}")
        self.bits_per_param = bits
        self.threads = threads.on_device(self.device.type, os.environ, torch.get_num_threads(), threads.cores())
        if self.threads:
            self._info(self.threads["line"])
        prepare_for_training(model, quantize, cfg.model.gradient_checkpointing)
        self.offload = self.strategy.offload_activations(cfg.model.offload_activations, self.facts,
                                                         bool(cfg.model.gradient_checkpointing))
        if self.offload:
            self._info("memory: checkpointed blocks' inputs offloaded to pinned host memory (model.offload_activations)")
        self.model = model

    def _build_objective(self) -> None:
        """SFT, preference (its reference set in _wrap_model), or distillation from the frozen teacher
        (loaded here, after checking its vocabulary)."""
        if self.cfg.objective == "sft":
            self.objective = SFTObjective()
            return
        if self.cfg.objective == "preference":
            from tunekit.train.preference import PreferenceObjective

            p = self.cfg.preference
            self.objective = PreferenceObjective(p)
            self._info(f"preference: {plain(p.loss)}, beta {p.beta}"
                       + ((", reference: base + the frozen model.adapter, the new adapter switched off"
                           if self.cfg.model.adapter is not None else
                           ", reference: the base with the trained part switched off")
                          if self.objective.needs_reference else ", no reference model"))
            return
        d = self.cfg.distill
        check_same_vocabulary(self.tokenizer, load_tokenizer(self.teacher_path, key="distill.teacher"),
                              self.model.config, AutoConfig.from_pretrained(self.teacher_path), self.teacher_path)
        teacher = load_base_model(self.teacher_path, plain(d.teacher_quantize), self.dtype, self.device,
                                  key="distill.teacher")
        self._info(f"distill: teacher {self.teacher_path} ({plain(d.teacher_quantize)}), {plain(d.divergence)}, "
                   f"alpha {d.alpha}, T {d.temperature}")
        self.objective = DistillObjective(teacher, d)

    def _apply_method(self) -> None:
        """The method (LoRA, adapters...) applied to the base; refuses a trained tensor it would not save."""
        cfg = self.cfg
        self.method = get_method(cfg.method.name)
        resume_dir = self.resume_from / "adapter" if self.resume_from is not None else None
        # a computed start (LoftQ, PiSSA, OLoRA) on rank 0 only, its tensors sent to the others
        # over a streamed base (still on the meta device) the method's new tensors are made in host memory
        stream = getattr(self, "stream", None)
        with stream.applying() if stream is not None else contextlib.nullcontext():
            self.model = apply_method(self.method, self.model, cfg.method, self.model_path, resume_dir,
                                      self.strategy, self._info,
                                      self.start_adapter.folder if self.start_adapter is not None else None)
        trains = {n for n, p in self.model.named_parameters() if p.requires_grad}
        saves = {n for n, _ in self.model.named_parameters() if self.method.owns(n)}
        if trains != saves:  # a parameter that trains but is not saved would be lost at the end
            odd = sorted(trains ^ saves)
            raise TunekitError(f"method {cfg.method.name}: trains {len(trains)} tensors but saves {len(saves)} "
                               f"(first differing: {odd[0]})")
        trainable, total = trainable_parameters(self.model)
        self._info(f"method {cfg.method.name}: {trainable:,} trainable of {total:,} parameters "
                   f"({100 * trainable / total:.3f}%)")
        self.trainable_params = trainable

    def _choose_compute_path(self) -> None:
        """The LoRA layers' path (kernels.fused_lora, the same on every rank), then training mode, in
        which kernels.compile checks and compiles the decoder layers."""
        cfg, setting = self.cfg, plain(self.cfg.kernels.fused_lora)
        self.lora_backend = self.strategy.choose_lora_backend(self.model, setting, self.facts, self.dtype)
        if self.lora_backend.layers or setting != "auto" or self.lora_backend.checks:
            self._info(f"kernels: LoRA layers use {self.lora_backend.path} ({self.lora_backend.reason})")
        if self.lora_backend.layers and self.start_adapter is not None:
            self._info("kernels: a layer with both adapters active (model.adapter) runs peft's forward; "
                       f"{self.lora_backend.path} runs the layers that hold one of them")
        self.model.train()
        self.compiled = compiled.CompileDecision(False, "kernels.compile=false")
        if cfg.kernels.compile:  # config checks keep it from FSDP
            self.compiled = compiled.apply(self.model, self.compile_check_inputs(), self.dtype)
            self._info(f"kernels: {self.compiled.reason}")
        # Packed rows: each example attends within itself through SDPA, no (T x T) mask
        # (tunekit.speed.packed_attention). Not under kernels.compile (a new set of example lengths
        # each step would recompile) nor prompt tuning (its virtual tokens come without positions).
        self.plain_attention = None
        if cfg.data.packing and cfg.kernels.packed_attention and not cfg.kernels.compile \
                and not self.method.prepends_positions:
            self.plain_attention = packed_attention.use(self.model)
            self._info("attention: packed rows attend per example (no dense mask)")

    def compile_check_inputs(self) -> list[dict]:
        """kernels.compile's check batches: real training rows cut to unequal lengths, the two together
        and the first alone, each collated as a step collates them (padded and masked, or packed), on
        the device."""
        rows = [{k: self.train_data[i][k][:n] for k in ("input_ids", "labels")}
                for i, n in zip(range(len(self.train_data)), compiled.CHECK_LENGTHS)]
        batches = [self.collate(group, self.tokenizer.pad_token_id) for group in (rows, rows[:1])]
        return [{k: v.to(self.device) for k, v in model_inputs(batch).items()} for batch in batches]

    def _wrap_model(self) -> None:
        """A resumed run's adapter goes into the whole tensors (before a strategy may shard them), then
        the strategy wraps the model; `params` are the tensors the optimizer steps."""
        if self.resume_from is not None:
            self.method.load(self.model, self.resume_from / "adapter")
        self.params = self.strategy.wrap(self.model)
        if getattr(self.objective, "needs_reference", False):
            self.objective.reference = self.reference_hidden
            self.objective.policy = self.policy_hidden
        if self.bits_per_param is None and plain(self.cfg.model.quantize) == "nf4":  # a streamed base: now loaded
            from tunekit.train.fsdp_load import sharded_bits_per_param

            self.bits_per_param = sharded_bits_per_param(self.model)

    def _precompute_reference(self) -> None:
        """preference.precompute_ref: every training and held-out row's reference log-probs, once, stored
        with the row (its micro-batches then carry them and skip the reference forward) and kept with the
        run (REFERENCE_CACHE: a resumed run reads them back instead of a pass over the data). Every rank
        computes every row in the same order, so collective forwards (FSDP) stay in step."""
        if not (getattr(self.objective, "needs_reference", False) and self.cfg.preference.precompute_ref):
            return
        from tunekit.train.preference import REFERENCE_CACHE, read_reference_cache, write_reference_cache

        path = self.output_dir / REFERENCE_CACHE
        cached, why = read_reference_cache(path, self.train_data, self.val_data) if self.resume_from else (None, None)
        if why:
            log.warning("%s; computing them again", why)
        computed = cached or [self._reference_logps(data) for data in (self.train_data, self.val_data)]
        for data, logps in zip((self.train_data, self.val_data), computed):
            for e, row in zip(data, logps.tolist()):
                e["ref_logps"] = row
        if cached is None and self.strategy.rank == 0:
            write_reference_cache(path, *computed)
        self._info(f"preference: reference log-probs of {len(self.train_data)} + {len(self.val_data)} rows "
                   + (f"read from {path}" if cached else "computed once (preference.precompute_ref)"))

    def _reference_logps(self, data: list) -> torch.Tensor:
        """(rows, sides) fp32 reference log-probs of `data`'s examples, a micro-batch at a time."""
        from tunekit.losses.logps import sequence_logps
        from tunekit.model import decoder_and_head

        size, out = self.cfg.trainer.micro_batch_size, []
        self.model.eval()
        for i in range(0, len(data), size):
            rows = data[i : i + size]
            batch = {k: v.to(self.device) for k, v in self.collate(rows, self.tokenizer.pad_token_id).items()}

            def forward():
                _, head = decoder_and_head(self.model)
                return sequence_logps(self.reference_hidden(batch), head, batch["labels"])[0]

            with torch.no_grad(), self.precision.autocast(self.device, self.method.autocast):
                out.append(self.strategy.run(forward).float().cpu().view(-1, len(rows)).t())  # (rows, sides)
        self.model.train()
        from tunekit.train.preference import sides_of

        return torch.cat(out) if out else torch.zeros(0, sides_of(self.train_data))

    def reference_hidden(self, batch: dict) -> torch.Tensor:
        """The reference model's last hidden states for `batch` (on the device): the same model with the
        method's trained part switched off, under no_grad (preference objectives)."""
        with torch.no_grad(), self.method.switched_off(self.model):
            return self._scored_hidden(batch)

    def policy_hidden(self, batch: dict) -> torch.Tensor:
        """The trained model's last hidden states for `batch` under no_grad, as `reference_hidden` runs
        them (KTO's KL rows: scored, never trained)."""
        with torch.no_grad():
            return self._scored_hidden(batch)

    def _scored_hidden(self, batch: dict) -> torch.Tensor:
        """The decoder's forward for rows that are scored, not trained: its inputs as the training
        forward takes them (under FSDP a frozen untied embedding is looked up in the ranks' slices,
        never gathered whole, as the plan counts it)."""
        from tunekit.model import decoder_and_head

        decoder, _ = decoder_and_head(self.model)
        inputs = self.strategy.decoder_inputs(self.model, decoder, model_inputs(batch))
        return decoder(**inputs, use_cache=False).last_hidden_state

    # ---------------------------------------------------------------- training state
    def _build_optimizer(self) -> None:
        """The optimizer over `params`, its warmup + cosine schedule, and the batch schedule (which
        rows each micro-batch of each step holds, on this rank)."""
        cfg, t = self.cfg, self.cfg.trainer
        groups = self.method.param_groups(self.model, self.params, cfg.method, t.lr)  # LoRA+: B's own rate
        self.optimizer = build_optimizer(plain(t.optimizer), groups, t.lr, t.weight_decay, self.device)
        self.scheduler = warmup_cosine(self.optimizer, t.warmup_steps, t.max_steps)
        # A resume on another number of ranks (data parallel) goes on from the example after the last
        # one the checkpoint's ranks trained: the steps before it had their own global batch.
        resumed = self._resumed_position() if self.resume_state is not None else None
        self.schedule = BatchSchedule([example_length(e) for e in self.train_data], t.micro_batch_size,
                                      t.grad_accum, self.strategy.world_size, self.strategy.rank, cfg.seed,
                                      min_padding=not cfg.data.packing, resumed=resumed)

    def _start_or_resume(self) -> None:
        """Per-rank random streams and the step counters: from step 0, or from `resume_from`.

        Dropout masks differ per rank (as in DDP); everything that must agree is already built. A
        resumed run restores the optimizer and scheduler state and each rank's own RNG state saved
        with the checkpoint, so it continues the random stream of an uninterrupted run."""
        set_seed(self.cfg.seed + 1000 * self.strategy.rank)
        self.start_step, self.tokens_seen, self.first_eval = 0, 0, None
        self.attention_seen: dict = {}
        self.first_checked = False  # the strategy's first-step check, on the first step that updates
        # fp16 (V100, T4, or model.dtype=fp16): dynamic loss scaling (tunekit.train.loss_scale)
        self.scaler = LossScaler(enabled=self.precision.compute == torch.float16)
        ckpt = self.resume_from
        if ckpt is None:
            return
        state = load_checkpoint(ckpt, self.strategy.optimizer_to_load(self.optimizer), self.scheduler)
        if self.strategy.rank < len(state["rng"]):  # a rank the checkpoint's run did not have keeps its seed's
            dev.set_rng_state(state["rng"][self.strategy.rank], self.device)
        self.start_step, self.tokens_seen = state["step"], state.get("tokens_seen", 0)
        self.first_eval = state.get("first_eval")
        if self.scaler.enabled and "loss_scaler" in state:
            try:
                self.scaler.load_state_dict(state["loss_scaler"])
            except (KeyError, TypeError, ValueError) as e:
                raise TunekitError(f"{ckpt}: its loss_scaler state is unreadable ({type(e).__name__}: {e})") from None
        self._info(f"resumed from {ckpt} (step {self.start_step})")

    def _write_run_files(self) -> None:
        """Rank 0: config.yaml, and beside it the data files' checksums: `tunekit eval RUN` re-splits
        data.path to find the run's held-out rows, which is only the run's split while the file is
        unchanged."""
        if not self.main:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.output_dir / "config.yaml", OmegaConf.to_yaml(OmegaConf.structured(in_train_schema(self.cfg))))
        atomic_write_text(self.output_dir / DATA_FINGERPRINT, json.dumps(
            {k: v for k, v in self.fingerprint.items() if k.endswith(":sha256")}, indent=2))

    def _open_tracker(self) -> None:
        """metrics.jsonl and the configured tracker on rank 0; a tracker that records nothing elsewhere."""
        cfg = self.cfg
        if not self.main:
            self.tracker = NullTracker()
            return
        self.tracker = Tracker(self.output_dir, cfg.trainer.max_steps, self.start_step, cfg.tracker.name,
                               cfg.tracker.project, cfg.tracker.run_name, json.loads(json.dumps(asdict(cfg), default=str)),
                               epochs=cfg.trainer.epochs, first_epoch=self.schedule.epoch_of(self.start_step))

    def _setup_task_eval(self) -> None:
        """Rank 0: sample answers / task metric at every evaluation, and keep_best (tunekit.train.task_eval).
        Where forwards are collective (FSDP) every rank runs the probe: the same rows through the same
        gathered weights give every rank the same answers; rank 0 reports them."""
        from tunekit.train.task_eval import BestKeeper, TrainingProbe, resolve_best_metric

        t = self.cfg.trainer
        self.probe = self.best = None
        if not self.main and not self.strategy.forwards_are_collective:
            return
        probe = TrainingProbe(self.tokenizer, self.val_data, t.eval_samples, t.eval_task, t.eval_task_rows,
                              t.eval_max_new_tokens, t.micro_batch_size)
        self.probe = probe if probe.active else None
        if t.keep_best and self.main:
            self.best = BestKeeper(self.output_dir, resolve_best_metric(t.best_metric, self.probe), self.start_step)
            self._info(f"keep_best: following {self.best.metric}")
