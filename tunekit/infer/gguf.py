"""Score task rows with a GGUF file in llama.cpp: the figures of tunekit.infer.score, computed
by llama.cpp instead of torch.

The rows stay as the run's (or the folder's) tokenizer made them: llama.cpp is fed those token
ids, never text, so it scores exactly the sequences the torch scorer scores. Per row the figures
are the same sums over the same positions (tunekit.infer.score):

  response loss   -log p of the reference answer's tokens given the prompt, plus the trained tokens
                  of earlier replies inside the prompt (their logits come from the prompt pass)
  accuracy        the class answer with the highest summed log-probability (ties: the first class)
  exact match     the greedy answer, stopped at the same stop tokens and within the same budget

How llama.cpp's KV cache is used, per batch of rows (one llama.cpp context with a unified cache,
one sequence id per row):

  prompts         the batch's prompts form a prefix tree (rows sorted by their token ids, so the
                  chat template's system prompt and instruction run once): every tree node is one
                  token evaluated once, tagged with the sequence ids of all rows through it.
                  Logits are kept only where a figure reads them.
  continuations   for each row and each distinct answer scored (the reference, every class), the
                  row's sequence is copied in the cache (llama_memory_seq_cp tags the same cells,
                  nothing is recomputed) and only the answer's tokens run; the copies are then
                  dropped, leaving the prompt's cache as it was.
  greedy          each row's own sequence is extended one token per step, all unfinished rows in
                  one llama_decode.

The cache holds K and V in f32, not llama.cpp's default f16: the figures measure the file's
weights, not a rounding of the activations. On the test suite's scaled tiny model (logits up to
~40) an f16 cache moved per-row log-likelihoods by up to 5e-2 against the torch scorer, an f32
cache by 6e-5. Attention is llama.cpp's plain (non-flash) path, as in the export's logit check.

`score_rows_gguf(model, tokenizer, rows, classes)` takes a GGUF path or an already loaded
tunekit.infer.llamacpp.LlamaCppModel and returns the TaskResult `score_rows` returns.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from tunekit import TunekitError
from tunekit.infer.rows import ClassSet, TaskRow, normalize
from tunekit.infer.score import RowResult, TaskResult

IGNORE = -100
GGML_TYPE_F32 = 0
# llama.cpp keeps at most llama_max_parallel_sequences() (256) sequences in one context: a batch's
# rows take one each and the continuations being scored as many again, so rows per batch are capped.
MAX_BATCH_ROWS = 128
# Logits come back as n_vocab floats per kept position (~200 KB at a 49k vocabulary): one
# llama_decode keeps at most this many, and they are reduced to log-probabilities at once.
MAX_OUTPUTS = 256
N_UBATCH = 512  # tokens per forward inside llama.cpp (its compute buffer grows with it)


# ------------------------------------------------------------------ loading
def load_gguf(path: str | Path, threads: Optional[int] = None):
    """A GGUF file loaded by llama.cpp (tunekit.infer.llamacpp.LlamaCppModel), or one TunekitError
    line: llama.cpp missing, or a file it cannot load (truncated, not GGUF, an architecture it lacks)."""
    from tunekit.device.facts import cpuinfo_text
    from tunekit.infer import llamacpp

    why = llamacpp.unavailable()
    if why:
        raise TunekitError(f"{path}: a GGUF file is scored by llama.cpp, and {why}; bash scripts/setup.sh builds it")
    repack, _ = llamacpp.weight_repacking(cpuinfo_text())
    try:
        # n_ctx: the Llama object's own context is unused here; scoring makes contexts of its own
        return llamacpp.LlamaCppModel(Path(path), 8, threads or _threads(), repack)
    except (ValueError, RuntimeError, OSError):
        # llama-cpp-python's exception only says "Failed to load model" (llama.cpp's reason went to
        # its silenced log): name the usual causes instead
        raise TunekitError(f"{path}: llama.cpp cannot load this GGUF file (truncated or damaged, or a model "
                           f"architecture llama-cpp-python {llamacpp.version_of()} does not know)") from None


def _threads() -> int:
    return max(1, torch.get_num_threads())


def _meta_int(model_ptr, key: str) -> Optional[int]:
    """An integer field of the GGUF's metadata, as written in the file (None when absent)."""
    import llama_cpp

    buf = ctypes.create_string_buffer(64)
    n = llama_cpp.llama_model_meta_val_str(model_ptr, key.encode(), buf, len(buf))
    if n < 0:
        return None
    try:
        return int(buf.value.decode())
    except ValueError:
        return None


def gguf_stop_ids(model_ptr) -> list[int]:
    """The end tokens the GGUF declares (tokenizer.ggml.eos_token_id, .eot_token_id): what a
    transformers model's generation config adds to the tokenizer's EOS. Only the declared fields:
    llama.cpp also guesses an end-of-turn token from token texts when none is declared, and its
    guess is not something the torch scorer would stop on."""
    ids = [_meta_int(model_ptr, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot")]
    return sorted({i for i in ids if i is not None and i >= 0})


# ------------------------------------------------------------------ one llama.cpp context
class _Context:
    """A llama.cpp context over a loaded model: unified f32 KV cache of n_ctx cells, n_seq sequences."""

    def __init__(self, model_ptr, n_ctx: int, n_seq: int, n_batch: int, threads: int, lora=None):
        """lora: (llama_adapter_lora pointer, scale) to apply, as the Llama object that loaded it does
        to its own context (an adapter is set per context in llama.cpp, not per model)."""
        import llama_cpp

        from tunekit.infer.llamacpp import _quiet_stderr

        self.C = llama_cpp
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = n_batch
        params.n_ubatch = min(n_batch, N_UBATCH)
        params.n_seq_max = n_seq
        params.n_threads = params.n_threads_batch = threads
        params.type_k = params.type_v = GGML_TYPE_F32
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        params.kv_unified = True  # sequences share cells: a copied prompt costs no memory and no compute
        params.no_perf = True
        with _quiet_stderr():
            self.ctx = llama_cpp.llama_init_from_model(model_ptr, params)
        if not self.ctx:
            raise TunekitError(f"llama.cpp could not make a context of {n_ctx} cells for scoring "
                               "(out of memory? a smaller --batch-size needs fewer)")
        if lora is not None:
            adapters = (llama_cpp.llama_adapter_lora_p_ctypes * 1)(lora[0])
            scales = (ctypes.c_float * 1)(lora[1])
            if llama_cpp.llama_set_adapters_lora(self.ctx, adapters, 1, scales):
                llama_cpp.llama_free(self.ctx)
                raise TunekitError("llama.cpp could not apply the GGUF's LoRA adapter to the scoring context")
        self.mem = llama_cpp.llama_get_memory(self.ctx)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model_ptr))
        self.n_batch, self.n_seq = n_batch, n_seq
        self.batch = llama_cpp.llama_batch_init(n_batch, 0, n_seq)

    def close(self) -> None:
        if self.ctx:
            self.C.llama_batch_free(self.batch)
            self.C.llama_free(self.ctx)
            self.ctx = None

    def clear(self) -> None:
        self.C.llama_memory_clear(self.mem, False)

    def copy_seq(self, src: int, dst: int) -> None:
        self.C.llama_memory_seq_cp(self.mem, src, dst, -1, -1)

    def drop_seq(self, seq: int) -> None:
        self.C.llama_memory_seq_rm(self.mem, seq, -1, -1)

    def decode(self, tokens: Sequence["_Tok"]) -> dict[int, tuple[dict[int, float], int]]:
        """Evaluate `tokens` (in order: every token after those it attends to) and return, for
        each token that asks for it (by its position in `tokens`): (log p of each of its targets,
        argmax of its logits)."""
        out: dict[int, tuple[dict[int, float], int]] = {}
        start = 0
        while start < len(tokens):
            end, n_out = start, 0
            while end < len(tokens) and end - start < self.n_batch and n_out + tokens[end].wants < MAX_OUTPUTS + 1:
                n_out += tokens[end].wants
                end += 1
            self._decode_chunk(tokens, start, end, out)
            start = end
        return out

    def _decode_chunk(self, tokens, start: int, end: int, out: dict) -> None:
        b = self.batch
        kept = []
        for k, t in enumerate(tokens[start:end]):
            b.token[k] = t.token
            b.pos[k] = t.pos
            b.n_seq_id[k] = len(t.seqs)
            for j, s in enumerate(t.seqs):
                b.seq_id[k][j] = s
            b.logits[k] = 1 if t.wants else 0
            if t.wants:
                kept.append(k)
        b.n_tokens = end - start
        rc = self.C.llama_decode(self.ctx, b)
        if rc != 0:
            raise TunekitError(f"llama.cpp's llama_decode failed (return code {rc}) while scoring")
        if not kept:
            return
        logits = np.empty((len(kept), self.n_vocab), dtype=np.float32)
        for row, k in enumerate(kept):
            ptr = self.C.llama_get_logits_ith(self.ctx, k)
            logits[row] = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
        z = torch.from_numpy(logits)
        # the torch scorer's own reductions, in fp32: log_softmax, then the targets' entries
        logp = F.log_softmax(z, dim=-1)
        best = z.argmax(-1).tolist()
        for row, k in enumerate(kept):
            t = tokens[start + k]
            out[start + k] = ({tgt: float(logp[row, tgt]) for tgt in t.targets}, best[row])


@dataclass
class _Tok:
    token: int
    pos: int
    seqs: list[int]
    targets: set[int] = field(default_factory=set)  # tokens whose log-probability is read here
    argmax: bool = False  # the greedy choice is read here

    @property
    def wants(self) -> int:
        return 1 if (self.targets or self.argmax) else 0


# ------------------------------------------------------------------ planning a batch
@dataclass
class _Plan:
    """One batch of rows: its prompt tree, and the continuations to score from each row."""

    rows: list[int]  # indices into the caller's rows
    nodes: list[_Tok]  # the prompt tree, parents before children
    path: list[list[int]]  # per batch row: the node of each prompt position
    jobs: list[tuple[int, tuple[int, ...]]]  # (batch row, continuation of >= 2 tokens) to run
    conts: list[list[tuple[int, ...]]]  # per batch row: [reference answer, class answers...]

    def cells(self, group: int, budget: int) -> int:
        """KV cells held at the peak: the prompts plus a group of continuations, or plus the greedy answers."""
        cont = [len(c) - 1 for _, c in self.jobs]
        peak = max((sum(cont[i:i + group]) for i in range(0, len(cont), group)), default=0)
        return len(self.nodes) + max(peak, len(self.rows) * budget)


def _plan(rows: list[TaskRow], idx: list[int], classes: Optional[ClassSet]) -> _Plan:
    nodes: list[_Tok] = []
    path: list[list[int]] = []
    prev: list[int] = []
    for b, i in enumerate(idx):  # idx is sorted by prompt tokens: a shared prefix is shared with the row before
        prompt = rows[i].prompt
        shared = 0
        if b:
            limit = min(len(prompt), len(rows[idx[b - 1]].prompt))
            while shared < limit and prompt[shared] == rows[idx[b - 1]].prompt[shared]:
                shared += 1
        mine = prev[:shared]
        for pos in range(shared, len(prompt)):
            nodes.append(_Tok(prompt[pos], pos, []))
            mine.append(len(nodes) - 1)
        for n in mine:
            nodes[n].seqs.append(b)
        path.append(mine)
        prev = mine
    jobs, conts = [], []
    for b, i in enumerate(idx):
        r = rows[i]
        mine = [tuple(r.answer)] + [tuple(a) for a in (classes.answers if classes is not None else [])]
        conts.append(mine)
        last = nodes[path[b][-1]]
        last.argmax = True
        for c in dict.fromkeys(mine):  # each distinct answer once (the reference is usually a class's)
            last.targets.add(c[0])
            if len(c) > 1:
                jobs.append((b, c))
        for j in range(len(r.prompt) - 1):  # trained tokens inside the prompt: read at the position before
            if r.prompt_labels[j + 1] != IGNORE:
                nodes[path[b][j]].targets.add(r.prompt[j + 1])
    return _Plan(list(idx), nodes, path, jobs, conts)


# ------------------------------------------------------------------ scoring
def _model_ptr(model) -> object:
    return model.llm._model.model


def _check_ids(rows: list[TaskRow], classes: Optional[ClassSet], n_vocab: int) -> None:
    top = max(max(r.prompt + r.answer) for r in rows)
    if classes is not None:
        top = max([top, *(max(a) for a in classes.answers)])
    if top >= n_vocab:
        raise TunekitError(f"token id {top} of the rows is outside the GGUF's vocabulary of {n_vocab}: the "
                           "tokenizer used is not this model's (pass --model DIR naming the model's own tokenizer)")


@torch.no_grad()
def score_rows_gguf(model, tokenizer, rows: list[TaskRow], classes: Optional[ClassSet] = None, batch_size: int = 16,
                    max_new_tokens: Optional[int] = None, generate: bool = True,
                    threads: Optional[int] = None) -> TaskResult:
    """Score a GGUF model on `rows` as tunekit.infer.score.score_rows scores a torch model.

    model: a GGUF path or a loaded tunekit.infer.llamacpp.LlamaCppModel (left loaded).
    tokenizer: the tokenizer that made the rows (decodes the greedy answers; its EOS ends them);
    None decodes with llama.cpp's own vocabulary (special tokens dropped) and stops at the GGUF's
    declared end tokens only. threads: llama.cpp's CPU threads (default: a loaded model's own,
    else torch's intra-op count). A LoRA adapter the LlamaCppModel loaded is applied here too.
    """
    if not rows:
        raise TunekitError("score: no rows to score")
    owned = not hasattr(model, "llm")
    lm = load_gguf(model, threads) if owned else model
    try:
        threads = threads or getattr(lm.llm, "n_threads", None) or _threads()
        return _score(lm, tokenizer, rows, classes, batch_size, max_new_tokens, generate, threads)
    finally:
        if owned:
            lm.close()


def _score(lm, tokenizer, rows, classes, batch_size, max_new_tokens, generate, threads) -> TaskResult:
    import llama_cpp

    ptr = _model_ptr(lm)
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(ptr))
    _check_ids(rows, classes, n_vocab)
    stop = set(gguf_stop_ids(ptr))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        stop.add(tokenizer.eos_token_id)
    budget = max_new_tokens or (max((len(r.answer) for r in rows), default=1) + 4)
    # a sequence per row, and as many for the continuations being scored at once
    per = max(1, min(batch_size, MAX_BATCH_ROWS, llama_cpp.llama_max_parallel_sequences() // 2))
    n_seq, group = 2 * per, per
    order = sorted(range(len(rows)), key=lambda i: rows[i].prompt)  # neighbours share the longest prefixes
    plans = [_plan(rows, order[s:s + per], classes) for s in range(0, len(order), per)]
    longest = max(len(r.prompt) + max(len(r.answer), budget) for r in rows)
    n_ctx = max([p.cells(group, budget) for p in plans] + [longest]) + 1
    n_batch = max(1, min(2048, n_ctx))
    adapter = getattr(lm.llm, "_lora_adapter", None)
    lora = (adapter, float(getattr(lm.llm, "lora_scale", 1.0))) if adapter is not None else None
    ctx = _Context(ptr, n_ctx, n_seq, n_batch, threads, lora)

    def decode_text(ids: list[int]) -> str:
        if tokenizer is not None:
            return tokenizer.decode(ids, skip_special_tokens=True).strip()
        return lm.llm.detokenize(ids, special=False).decode("utf-8", errors="replace").strip()

    results: dict[int, RowResult] = {}
    try:
        for plan in plans:
            ctx.clear()
            prompt_out = ctx.decode(plan.nodes)
            scores = _continuations(ctx, plan, prompt_out, rows, group)
            answers = _greedy(ctx, plan, prompt_out, rows, budget, stop) if generate else [[] for _ in plan.rows]
            for b, i in enumerate(plan.rows):
                r = rows[i]
                inner = [prompt_out[plan.path[b][j]][0][r.prompt[j + 1]] for j in range(len(r.prompt) - 1)
                         if r.prompt_labels[j + 1] != IGNORE]
                s = torch.tensor(scores[b], dtype=torch.float32)
                text = decode_text(answers[b]) if generate else ""
                truth = classes.index(r.reference) if classes is not None else None
                predicted = int(s[1:].argmax()) if classes is not None else None
                results[i] = RowResult(text, generate and normalize(text) == normalize(r.reference), predicted, truth,
                                       -float(s[0]) - sum(inner), len(r.answer) + len(inner))
    finally:
        ctx.close()
    result = TaskResult([results[i] for i in range(len(rows))], classes, generate)
    result.summarize()
    return result


def _continuations(ctx: _Context, plan: _Plan, prompt_out, rows, group: int) -> list[list[float]]:
    """Per batch row: log p(continuation | prompt) of [reference, class answers...]."""
    n_rows = len(plan.rows)
    logp: dict[tuple[int, tuple[int, ...]], float] = {}
    for start in range(0, len(plan.jobs), group):
        jobs = plan.jobs[start:start + group]
        toks, owner = [], []
        for k, (b, c) in enumerate(jobs):
            seq = n_rows + k
            ctx.copy_seq(b, seq)
            n = len(rows[plan.rows[b]].prompt)
            for j, t in enumerate(c[:-1]):  # token j predicts token j + 1; the last one predicts nothing read
                toks.append(_Tok(t, n + j, [seq], {c[j + 1]}))
                owner.append((k, c[j + 1]))
        out = ctx.decode(toks)
        for k, (b, c) in enumerate(jobs):
            logp[(b, c)] = 0.0
        for pos, (k, tgt) in enumerate(owner):
            b, c = jobs[k]
            logp[(b, c)] += out[pos][0][tgt]
        for k in range(len(jobs)):
            ctx.drop_seq(n_rows + k)
    scores = []
    for b in range(n_rows):
        last = prompt_out[plan.path[b][-1]][0]
        scores.append([last[c[0]] + logp.get((b, c), 0.0) for c in plan.conts[b]])
    return scores


def _greedy(ctx: _Context, plan: _Plan, prompt_out, rows, budget: int, stop: set[int]) -> list[list[int]]:
    """Each row's greedy answer up to and including its first stop token, at most `budget` tokens."""
    n_rows = len(plan.rows)
    new = [[prompt_out[plan.path[b][-1]][1]] for b in range(n_rows)]
    for step in range(1, budget):
        live = [b for b in range(n_rows) if new[b][-1] not in stop]
        if not live:
            break
        toks = [_Tok(new[b][-1], len(rows[plan.rows[b]].prompt) + step - 1, [b], argmax=True) for b in live]
        out = ctx.decode(toks)
        for k, b in enumerate(live):
            new[b].append(out[k][1])
    return new
