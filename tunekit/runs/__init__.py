"""Open what training wrote: a run folder, an adapter folder, a merged model folder, a GGUF file.

One way in, used by eval, generate, chat and export: `open.open_source(path) -> Source` recognises
the path and reads its configs (a run's config.yaml strictly); `load` builds the models and the
tokenizer of a Source; `memory` is the planner's check that they fit before anything loads;
`heldout` checks a run's data files are unchanged and re-makes its held-out batches. May import
config, model, data, methods, speed, plan, infer's llama.cpp probe and train's checkpoint/resume
readers; never commands.
"""
