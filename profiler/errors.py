"""Errors that reach the user as one line on stderr (no traceback unless --debug)."""


class DpprofError(Exception):
    """A runtime problem: exit status 1."""

    exit_code = 1


class UsageError(DpprofError):
    """Bad input on the command line: exit status 2."""

    exit_code = 2


class WorkloadError(UsageError):
    """A workload that cannot be found, loaded or used."""
