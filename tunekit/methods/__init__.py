"""PEFT methods: each one decides which small part of a frozen base trains.

A method is one file here with a `Method` subclass registered under its name (registry.py); the
recipe looks it up with `get_method(cfg.method.name)` and never branches on the name. Adding a
method means: one file here, one yaml in recipes/recipe/, one row in the shared method test table.
"""

from tunekit.methods.registry import (Method, available_methods, cannot_merge, check_method_config, get_method,
                                      register, trainable_parameters)

# Each module registers itself on import; they import from registry/saving, never from here.
from tunekit.methods import adapter, bitfit, full, lora, prompt_tuning  # noqa: E402,F401

__all__ = ["Method", "available_methods", "cannot_merge", "check_method_config", "get_method", "register",
           "trainable_parameters"]
