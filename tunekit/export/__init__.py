"""Export a trained run as an adapter, a merged model, a GGUF file or a GGUF LoRA adapter.

Owns: writing each artifact, reloading it as its consumer would (peft, transformers, llama.cpp),
and judging it against the trained model: logits (fidelity.py), the task the rows define (task.py)
and the gate that refuses what loses too much (gate.py). A LoRA merge streams from the base's files
(stream.py, shards.py) within a memory plan (memory.py); job.py runs the steps of one export. The
command itself lives in tunekit.commands.export. May import runs, infer, methods, model, data, plan and speed.
"""
