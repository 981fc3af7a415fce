"""The one exception class for errors a user can cause.

The command line turns an HrmError into one line on stderr and exit status 2 (docs/architecture.md,
Conventions); anything else is a bug and keeps its traceback.
"""


class HrmError(Exception):
    """A problem with the user's input: the message names what is wrong and what to do."""
