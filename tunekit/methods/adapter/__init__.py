"""Bottleneck adapters (Houlsby et al. 2019, arXiv:1902.00751) inside every decoder block.

The method as a folder: how it applies, saves, merges and plans (method.py), its keys (config.py).
Importing it registers the method (no torch at import time).
"""

from tunekit.methods.adapter.config import AdapterConfig  # noqa: F401
from tunekit.methods.adapter.method import AdapterPlan, bottleneck, run_bottleneck, BottleneckAdapter  # noqa: F401
