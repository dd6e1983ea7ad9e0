"""Exception types the project raises; each message says what is wrong and how to fix it."""


class ConfigError(ValueError):
    """A configuration or manifest value is invalid."""


class DecodeError(ValueError):
    """Bytes from the wire could not be decoded; `reason` is a short machine-readable tag."""

    def __init__(self, reason: str, detail: str = ""):
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}" if detail else reason)
