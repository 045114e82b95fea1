"""(IA)^3 (Liu et al. 2022, arXiv:2205.05638): learned vectors rescale keys, values and the MLP's inner activation.

The method as a folder: how it applies, saves, merges and plans (method.py), its keys (config.py).
Importing it registers the method (no torch at import time).
"""

from tunekit.methods.ia3.config import IA3Config  # noqa: F401
from tunekit.methods.ia3.method import IA3Plan, IA3  # noqa: F401
