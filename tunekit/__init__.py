"""tunekit: parameter-efficient fine-tuning (LoRA, QLoRA, ...) of causal language models."""

__version__ = "0.1.0"


class TunekitError(Exception):
    """A user-facing error: bad config, missing file, malformed data row.

    The CLI prints its message as one line and exits non-zero; no traceback. The message must
    name the culprit (the config key, the file, the row).
    """
