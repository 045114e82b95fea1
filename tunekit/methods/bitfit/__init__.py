"""BitFit (Ben Zaken et al. 2021, arXiv:2106.10199): only the bias terms train.

The method as a folder: how it applies, saves, merges and plans (method.py), its keys (config.py).
Importing it registers the method (no torch at import time).
"""

from tunekit.methods.bitfit.config import BitFitConfig  # noqa: F401
from tunekit.methods.bitfit.method import BitFitPlan, BitFit  # noqa: F401
