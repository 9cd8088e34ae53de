"""The one shape of a bad-input error: every problem of one input, each with where it is.

Topology files, churn traces and the like are checked whole and fail once, listing every problem
with its place (a YAML path, a line number); the CLI prints the message and exits 2.

The exit codes every command shares, and the errors that are the machine's, not the code's or
the input's (:func:`out_of_room`).
"""

from __future__ import annotations

import errno

# Every command's exit codes (README, "Commands"): done, failed while running, bad input (nothing
# started), interrupted (Ctrl-C or SIGTERM; 128 + SIGINT, as a shell reports it).
EXIT_OK, EXIT_FAILURE, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130

OUT_OF_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)  # a full disk or quota, read-only


def out_of_room(exc: BaseException) -> bool:
    """A write failed for want of room (a full disk, a quota, a read-only file system): said in
    one line, never with a traceback."""
    return isinstance(exc, OSError) and exc.errno in OUT_OF_ROOM


# problems an input's message lists; the rest are counted. A wrong file given as a trace
# (`--churn /etc/passwd`) listed a problem per line of it, however long it was
SHOWN_PROBLEMS = 20


class InputError(ValueError):
    """Every problem found in one input (``source``), each already saying where it is
    (``problems``: all of them; the message lists the first ``SHOWN_PROBLEMS``)."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = problems
        lines = [f"  - {p}" for p in problems[:SHOWN_PROBLEMS]]
        if len(problems) > SHOWN_PROBLEMS:
            lines.append(f"  - ... and {len(problems) - SHOWN_PROBLEMS} more")
        super().__init__(f"{source}: {len(problems)} problem(s):\n" + "\n".join(lines))
