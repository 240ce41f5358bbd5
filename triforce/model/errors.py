"""One exception type for problems the user can fix.

Front ends catch `UserError` and print its message as one line on stderr, with no traceback:
the message names the problem and the fix.
"""


class UserError(Exception):
    """A problem with the user's input or environment, reported as one line."""


class PeerStopped(UserError):
    """A tensor-parallel worker lost its peers (they stopped responding, or left before the group
    formed). Mostly the consequence of another worker's own error: said only where no worker of the
    launch has said a line (cli.common.say_error)."""

    consequence = True
