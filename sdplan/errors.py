"""The one exception family sdplan raises.

Library code raises a subclass of :class:`SdplanError` with a message that says what is wrong and how to
fix it. Only the CLI edge (``sdplan.cli``) turns it into one printed line and an exit code.
"""

from __future__ import annotations

# Exit codes shared by the trainer and `sdplan train` (which retries smaller after EXIT_OOM).
EXIT_OOM = 75  # out of GPU memory; {output.dir}/oom.json says where
EXIT_INTERRUPTED = 130  # SIGINT/SIGTERM; a checkpoint was written


class SdplanError(Exception):
    """Base class: a problem the user can fix. ``str(err)`` is the one line shown to the user."""

    exit_code = 1
    reported = False  # True: already printed (by the trainer sdplan launched); the CLI adds no line

    def __init__(self, message: str, *, fix: str | None = None):
        super().__init__(message)
        self.message = message
        self.fix = fix

    def __str__(self) -> str:
        return f"{self.message} ({self.fix})" if self.fix else self.message


class UsageError(SdplanError):
    """Bad command-line input: an unknown name, a number out of range, a missing path."""

    exit_code = 2


class ConfigError(SdplanError):
    """A config, profile or snapshot file that does not validate. Carries every error found."""

    exit_code = 2

    def __init__(self, source: str, errors: list[str], *, fix: str | None = None):
        self.source = source
        self.errors = list(errors)
        shown = "; ".join(self.errors[:8])
        more = f"; and {len(self.errors) - 8} more" if len(self.errors) > 8 else ""
        super().__init__(f"{source}: {shown}{more}", fix=fix)


class DatasetError(SdplanError):
    """A dataset folder that is missing, empty, or holds no readable image."""

    exit_code = 2


class OutputExistsError(SdplanError):
    """Refusing to write into a folder or over a file the user owns."""

    exit_code = 3


class NoGPUError(SdplanError):
    """Training asked for a GPU that this machine does not have."""

    exit_code = 4
