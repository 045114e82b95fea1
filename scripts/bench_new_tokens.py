#!/usr/bin/env python
"""Peak memory of a LoRA step that also trains added tokens' rows (data.chat_template), against the
same step without them, and against peft's own computation of them.

A 1-layer Llama (hidden 512, bf16) with a large vocabulary, its embeddings resized by 2 rows, LoRA
r=8 on q_proj and v_proj; one step = the decoder under bf16 autocast, tunekit's SFT loss on 4 x 256
positions, backward. `lora`: the rows exist but do not train; `tokens`: peft's trainable tokens
train them, computed as tunekit trains them (tunekit.model.vocab: the frozen matrix and the trained
rows apart); `peft`: the same, computed as peft computes them (the whole matrix rebuilt around the
trained rows on every read, a full-size gradient in the backward). Each configuration runs in a fresh subprocess; the figure is its
peak RSS (ru_maxrss) over the second step, after a first step warmed the allocator. CPU only.

    python scripts/bench_new_tokens.py --out benchmarks/training/new-tokens-memory-2026-11-27
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = r'''
import gc, json, resource, sys
import torch
torch.set_num_threads(1)
from transformers import LlamaConfig, LlamaForCausalLM
from tunekit.losses.sft import sft_loss_from_hidden
from tunekit.methods import MethodConfig, get_method
from tunekit.model import decoder_and_head
from tunekit.model.vocab import grow_embeddings

mode, vocab, hidden, head = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=head == "tied")
torch.manual_seed(0)
model = LlamaForCausalLM(cfg).to(torch.bfloat16).requires_grad_(False)
if mode in ("tokens", "peft"):
    grow_embeddings(model, vocab + 2, (vocab, vocab + 1), vocab)
else:
    model.resize_token_embeddings(vocab + 2, mean_resizing=False)
model = get_method("lora").apply(model, MethodConfig(name="lora", r=8, alpha=16.0, dropout=0.0,
                                                     target_modules=["q_proj", "v_proj"]))
if mode == "peft":  # peft's own lookup and head (tunekit.model.vocab's left out)
    import tunekit.model.vocab as vocab_room
    for m in model.modules():
        m.__dict__.pop("forward_adapters", None)
    vocab_room.token_rows = lambda module: None
ids = torch.randint(0, vocab + 2, (4, 256))

def step():
    decoder, out = decoder_and_head(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden_states = decoder(input_ids=ids).last_hidden_state
    loss, _ = sft_loss_from_hidden(hidden_states, out, ids)
    loss.backward()

step()
gc.collect()
warm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
step()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"peak_rss_mib": round(peak / 1024, 1), "rss_high_water_after_first_step_mib": round(warm / 1024, 1)}))
'''


def measure(mode: str, vocab: int, hidden: int, head: str) -> dict:
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-c", CHILD, mode, str(vocab), str(hidden), head], capture_output=True,
                       text=True, env=env, check=True)
    line = next(x for x in r.stdout.splitlines() if x.startswith("{"))
    return {"mode": mode, "vocab": vocab + 2, "hidden": hidden, "head": head,
            "matrix_mib": round((vocab + 2) * hidden * 2 / 2**20, 1), **json.loads(line)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, nargs="+", default=[65536, 131072])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--out", type=Path, default=None, help="path stem: writes STEM.json")
    args = p.parse_args(argv)
    rows = []
    for vocab in args.vocab:
        for head in ("tied", "untied"):
            base = measure("lora", vocab, args.hidden, head)
            rows.append(base)
            print(json.dumps(base), flush=True)
            for mode in ("tokens", "peft"):
                r = measure(mode, vocab, args.hidden, head)
                extra = r["peak_rss_mib"] - base["peak_rss_mib"]
                rows.append({**r, "extra_mib": round(extra, 1), "extra_in_matrices": round(extra / r["matrix_mib"], 2)})
                print(json.dumps(rows[-1]), flush=True)
    import peft
    import torch
    import transformers

    result = {"machine": platform.processor() or platform.machine(), "versions": {
        "torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__},
        "rows": rows}
    if args.out is not None:
        args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
