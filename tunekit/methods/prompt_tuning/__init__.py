"""Prompt tuning (Lester et al. 2021, arXiv:2104.08691): a trained soft prompt, the base untouched.

The method as a folder: how it applies, saves, merges and plans (method.py), its keys (config.py), the model it trains (soft_prompt.py).
Importing it registers the method (no torch at import time).
"""

from tunekit.methods.prompt_tuning.config import PromptTuningConfig  # noqa: F401
from tunekit.methods.prompt_tuning.method import PromptTuningPlan, init_token_ids, load_soft_prompt, PromptTuning  # noqa: F401
