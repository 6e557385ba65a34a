"""The one family of user errors, and what the `shiftlm` command exits with.

Every error a user can cause (a flag, a config value, a layout, a file, a checkpoint, a data source, a
run that cannot fit) is a `ConfigError` or a subclass; its message says what is wrong and how to fix
it, and its `exit_code` is what the command exits with after printing that message as one line
(`error_line`), without a traceback (`EXIT_CODES`). The codes a supervisor acts on follow sysexits.h.
"""

from __future__ import annotations

EXIT_TEMPFAIL = 75  # EX_TEMPFAIL: a rank died or hung, or a peer vanished: worth a restart
EXIT_EXCLUDED = 76  # a rank was persistently slow and `--elastic` relaunches without it
EXIT_INTERRUPTED = 130  # 128 + SIGINT


class ConfigError(ValueError):
    """A flag, configuration value or layout that cannot work, with the fix in the message."""

    exit_code = 2

    def __init__(self, message: str, exit_code: int | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class CheckpointError(ConfigError):
    """A checkpoint or model file that is missing, truncated, corrupt or does not fit the model."""

    exit_code = 3


class DataError(ConfigError):
    """A data source that cannot be trained on."""

    exit_code = 4


class DoesNotFitError(ConfigError):
    """A run whose estimated memory exceeds the device's."""

    exit_code = 5


class RunDirError(ConfigError):
    """A run directory that holds another run (a fresh start without --overwrite, changed data shaping)."""

    exit_code = 6


def check_writable_dir(path, flag: str) -> None:
    """Make the directory `path` (a flag's output directory) and write a file in it now, before any
    long work: a path under a file, or one this user cannot write, is one line naming `flag`."""
    import os
    from pathlib import Path

    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".shiftlm-write-test-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as err:
        reason = "it is a file" if path.is_file() else err.strerror or str(err)
        raise ConfigError(
            f"{flag} {path} cannot be written ({reason}): choose a directory you can write"
        ) from None


# What the `shiftlm` command exits with (documented in docs/training.md, "Errors and exit codes").
def error_line(command: str, message: str) -> str:
    """Every command's user error, one line: `shiftlm COMMAND: error: <what is wrong>: <the fix>`."""
    text = "; ".join(part.strip() for part in str(message).splitlines() if part.strip())
    return f"{command if command.startswith('shiftlm') else f'shiftlm {command}'}: error: {text}"


EXIT_CODES = {
    0: "success (including a training run that was already complete)",
    1: "an internal error: a bug, printed with its traceback",
    2: "usage: an unknown or malformed flag, a bad configuration value or layout",
    CheckpointError.exit_code: "a checkpoint or model file is missing, truncated or corrupt",
    DataError.exit_code: "the data source cannot be trained on",
    DoesNotFitError.exit_code: "the run does not fit in this device's memory (the estimate is printed)",
    RunDirError.exit_code: "the run directory holds another run (use --overwrite or another log.dir)",
    EXIT_TEMPFAIL: "a hung or dead rank was detected: restart (torchrun --max-restarts) resumes from the last checkpoint",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C); training first saves a checkpoint at the next step and names it",
    143: "terminated (SIGTERM); training first saves a checkpoint at the next step and names it",
}
