"""The one exception type a user of reshard sees: its message is a complete, actionable sentence."""


class ReshardError(Exception):
    """A problem with the user's input or environment; the CLI prints it on one line and exits 1."""
