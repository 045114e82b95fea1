"""Task evaluation: what a fine-tune learned, measured on held-out rows.

rows.py      held-out examples -> (prompt, reference answer); closed answer sets (classification)
score.py     batched scoring of one model: response loss, greedy exact match, log-likelihood accuracy
report.py    the table a person reads and the eval.json a script reads
cli.py       `tunekit eval RUN [--data FILE] [--base]`
training.py  what the trainer shows at every evaluation (sample answers, task metric) and keep_best
"""
