"""The one exception type a user of reshard sees: its message is a complete, actionable sentence."""


class ReshardError(Exception):
    """A problem with the user's input or environment; the CLI prints it on one line and exits 1."""


class KeepsPartial(ReshardError):
    """A stop after which the partial output is worth keeping (a full disk; another rank that crashed):
    the same command, run again once the cause is fixed, resumes it."""
