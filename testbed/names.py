"""The rule for names a user gives things: device groups, switches, profiles, a joining device.

Standard library only: the agent (which runs on phones) and the profile loader use it without
pydantic. A name becomes a Mininet host name, an interface prefix and a file stem, so it is
short, lower-case and has no characters a shell or a file system would read otherwise.
"""

from __future__ import annotations

import re

MAX_NAME_CHARS = 24
NAME_RE = re.compile(r"[a-z0-9][a-z0-9-]{0,%d}" % (MAX_NAME_CHARS - 1))
NAME_RULE = (f"lower-case letters, digits and '-', at most {MAX_NAME_CHARS} characters, "
             f"starting with a letter or digit")


def is_name(text: object) -> bool:
    """Whether ``text`` is a valid name: the whole string (``match`` with ``$`` would let a final
    newline through)."""
    return isinstance(text, str) and NAME_RE.fullmatch(text) is not None


def name_problem(text: str, what: str = "name") -> str | None:
    """Why ``text`` cannot be a ``what`` (None when it can)."""
    return None if is_name(text) else f"{text!r} is not a valid {what} ({NAME_RULE})"
