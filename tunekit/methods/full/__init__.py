"""Full fine-tuning: every weight of the model trains. Meant for small students (recipe=distill

The method as a folder: how it applies, saves, merges and plans (method.py), its keys (config.py),
how its weights reach bf16 matmuls (rounding.py).
Importing it registers the method (no torch at import time).
"""

from tunekit.methods.full.config import FullConfig  # noqa: F401
from tunekit.methods.full.method import FullFineTune  # noqa: F401
