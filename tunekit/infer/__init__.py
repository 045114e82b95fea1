"""Inference on a model already in memory: decoding, and scoring task rows with it.

Owns: prefill / greedy decoding / continuation log-likelihoods (decode.py), task rows and their
closed answer sets (rows.py), scoring a model on them (score.py), the same scoring through
llama.cpp for GGUF files (gguf.py, llamacpp.py), the eval report (report.py: with each source of a
mixture apart), and preference rows scored by a run's preference loss (preference.py). Knows nothing
of runs: callers hand it a model, a tokenizer and rows (preference.py reads the `preference` node it is
given). May import model, data, speed and losses (the preference figures are the training loss's own).
"""
