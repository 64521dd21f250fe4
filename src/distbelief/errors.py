"""Errors that are the user's to fix: bad configuration, bad data, rank counts that do not fit.

The command line turns any `UserError` into one message on stderr and exit status 2. Every
rank of an MPI job checks the same inputs before it communicates, so all ranks fail together.
"""


class UserError(Exception):
    """Bad input the user can fix; the command line prints it and exits with status 2."""


class ConfigError(UserError, ValueError):
    """An invalid configuration: unknown key, bad value, inconsistent settings."""


class DataError(UserError, ValueError):
    """A missing, truncated or corrupt data file, or data that does not fit the model."""


EXIT_USER_ERROR = 2
