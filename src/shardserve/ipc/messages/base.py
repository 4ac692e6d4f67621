"""The base of every message: a msgspec struct whose class name is its wire tag."""

from __future__ import annotations

import msgspec


class Msg(msgspec.Struct, tag=True, kw_only=True):
    """Base: the class name is the wire tag."""
