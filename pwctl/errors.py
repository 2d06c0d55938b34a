"""The one exception type the CLI turns into a clean one-line error and a non-zero exit."""


class PwctlError(Exception):
    """A user-facing error: bad path, unsupported architecture, corrupt file, bad option."""
