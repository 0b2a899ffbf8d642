"""A worker's role: one enum for every package that compares roles.

A `str` enum, so a role travels on the wire (and in metrics labels, logs and JSON)
as its plain name; it is turned back into a `Role` where it arrives
(`pdserve.common.codec` checks the name against the members).
"""

from __future__ import annotations

from enum import Enum


class Role(str, Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"

    def __str__(self) -> str:  # "prefill" in messages and labels, not "Role.PREFILL"
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


ROLES = tuple(Role)
FLIP_ROLES = (Role.PREFILL, Role.DECODE)  # the roles a live role flip moves between
