"""The training loop and its state: setup -> train -> save, checkpoint and resume, optimizer, tracking.

Owns: `TrainRecipe` (loop.py), the training objective that turns a micro-batch into a loss sum,
checkpoints and their exact resume, the run lock, the optimizer's saved state, metrics and the
task score taken during training, and the data-parallel / FSDP strategies. May import config,
model, data, losses, methods, speed, plan and infer; never runs, export or commands.
"""
