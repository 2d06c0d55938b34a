"""pwctl: serve Mixture-of-Experts models with expert precision paged at run time.

Kept light on purpose: `import pwctl` (and the CLI's import) loads neither torch nor
transformers; the commands import what they run."""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

try:
    __version__ = _version("pwctl")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "unknown"
