"""Inference on a model already in memory: decoding, and scoring task rows with it.

Owns: prefill / greedy decoding / continuation log-likelihoods (decode.py), task rows and their
closed answer sets (rows.py), scoring a model on them (score.py), the same scoring through
llama.cpp for GGUF files (gguf.py, llamacpp.py), and the eval report (report.py). Knows nothing
of runs or configs: callers hand it a model, a tokenizer and rows. May import model, data and speed.
"""
