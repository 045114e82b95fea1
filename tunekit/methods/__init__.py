"""PEFT methods: each one decides which small part of a frozen base trains.

A method is a folder here (lora/, adapter/, bitfit/, ia3/, prompt_tuning/, full/) with a `Method`
subclass registered under its name (registry.py): its config keys (config.py), how it applies,
saves, merges and plans (method.py), and its variants. The recipe looks it up with
`get_method(cfg.method.name)`, a saved adapter folder with `method_for_adapter(folder)`, and
nothing branches on a method's name. Adding a method means: one folder here, one yaml in
recipes/recipe/, one row in the shared method test table; until it has planning hooks of its own,
the planner states that its figure leaves the method's part out.
"""

from tunekit.methods.registry import (Method, adapter_kinds, available_methods, cannot_merge, check_method_config,
                                      check_own_keys, config_schema, fill_method_defaults, foreign_keys, get_method, in_train_schema,
                                      method_for_adapter, own_keys, register, train_schema, trainable_parameters)

# Each module registers itself on import (in this order: the order of their keys in the method.*
# schema); they import from registry/saving, never from here. None imports torch at import time.
from tunekit.methods import lora, adapter, bitfit, prompt_tuning, full, ia3  # noqa: E402,F401,I001

# The method node's schema, every registered method's keys (what `method.*` overrides are typed by).
MethodConfig = config_schema()

__all__ = ["Method", "MethodConfig", "adapter_kinds", "available_methods", "cannot_merge", "check_method_config",
           "check_own_keys", "config_schema", "fill_method_defaults", "foreign_keys", "get_method", "in_train_schema", "method_for_adapter",
           "own_keys", "register", "train_schema", "trainable_parameters"]
