"""One exception type for problems the user can fix.

Front ends catch `UserError` and print its message as one line on stderr, with no traceback:
the message names the problem and the fix.
"""


class UserError(Exception):
    """A problem with the user's input or environment, reported as one line."""
