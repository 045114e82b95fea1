"""Open what training wrote: a run folder, an adapter folder, a merged model folder, a GGUF file.

Owns: reading a run's config and checking its inputs are unchanged, loading its base the way it
was trained (dtype, 4-bit, device) and its trained part on top, and the memory check before an
inference load. Used by eval, generate, chat and export. May import config, model, data, methods,
speed, plan and train's checkpoint/resume readers; never commands.
"""
