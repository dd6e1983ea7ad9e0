"""The bounds every record's fields keep (identifiers, counters, fragments, signatures, contributor lists)
and the checks of the JSON header fields (`wire.frames`' schemas), in one leaf module so that `wire.frames`
and the signed-delta modules it reads (`wire.delta_signature`, `wire.delta_listing`) share them without
importing each other in a cycle.

A check returns None when the value is valid, otherwise what is wrong with it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

MAX_ID_CHARS = 128
MAX_SIGNATURE_BYTES = 2048  # an RSA-2048 public key and signature take 552
MAX_FRAGMENT = 65535
MAX_COUNTER = 2**53 - 1  # exactly representable in every JSON reader
MAX_CONTRIBUTORS = 10_000


# A check returns None when the value is valid, otherwise what is wrong with it.
Check = Callable[[Any], "str | None"]


def identifier(value: Any) -> str | None:
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_ID_CHARS:
        return f"must be a string of 1-{MAX_ID_CHARS} characters"
    ok = _ASCII_ID.fullmatch(value) is not None if value.isascii() else all(_id_char(c) for c in value)
    return None if ok else "may hold only letters, digits, '-', '_', '.', ':'"


# `identifier`'s rule for ASCII values in one regex (a record lists up to MAX_CONTRIBUTORS of them: a check
# per character in Python was most of decoding an update at 256 peers, issue #40); others char by char
_ASCII_ID = re.compile(r"[A-Za-z0-9_.:-]+")


def _id_char(c: str) -> bool:
    return c.isalnum() or c in "-_.:"


def integer(low: int, high: int) -> Check:
    def check(value: Any) -> str | None:
        if type(value) is not int or not low <= value <= high:
            return f"must be an integer in {low}..{high}"
        return None

    return check


def one_of(*choices: str) -> Check:
    def check(value: Any) -> str | None:
        return None if value in choices and isinstance(value, str) else f"must be one of {choices}"

    return check


def contributor_list(value: Any) -> str | None:
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_CONTRIBUTORS:
        return f"must be a list of 1-{MAX_CONTRIBUTORS} [peer, weight] pairs"
    if _plain_contributors(value):
        return None
    peers = set()
    for pair in value:
        if not isinstance(pair, list) or len(pair) != 2:
            return "entries must be [peer, weight] pairs"
        peer, weight = pair
        if identifier(peer) is not None:
            return f"peer {str(peer)[:40]!r} {identifier(peer)}"
        if type(weight) is not float or not math.isfinite(weight) or weight < 0:
            return f"weight of {peer!r} must be a finite float >= 0"
        if peer in peers:
            return f"peer {peer!r} listed twice"
        peers.add(peer)
    return None


# ASCII identifiers, one a line: with no line break inside any of them (counted), a list's identifiers
# are all valid exactly when their lines match
_ASCII_ID_LINES = re.compile(r"[A-Za-z0-9_.:-]+(?:\n[A-Za-z0-9_.:-]+)*")


def _plain_contributors(pairs: list) -> bool:
    """Whether `pairs` are distinct [ASCII identifier, finite float >= 0] pairs, checked in bulk: an update
    lists every contributor, and a check per pair was a tenth of decoding an update at 256 peers (issue
    #40). False sends the list through `contributor_list`'s checks one by one, which name what is wrong."""
    if not all(type(pair) is list and len(pair) == 2 for pair in pairs):
        return False
    peers = [pair[0] for pair in pairs]
    if not all(type(peer) is str and 1 <= len(peer) <= MAX_ID_CHARS for peer in peers):
        return False
    lines = "\n".join(peers)
    if lines.count("\n") != len(peers) - 1 or _ASCII_ID_LINES.fullmatch(lines) is None:
        return False
    weights_ok = all(type(pair[1]) is float and 0.0 <= pair[1] < math.inf for pair in pairs)
    return weights_ok and len(set(peers)) == len(peers)


def seq_list(value: Any) -> str | None:
    if not isinstance(value, list) or len(value) > MAX_CONTRIBUTORS:
        return f"must be a list of at most {MAX_CONTRIBUTORS} delta sequence numbers"
    if any(type(seq) is not int or not 0 <= seq <= MAX_COUNTER for seq in value):
        return f"entries must be integers in [0, {MAX_COUNTER}]"
    return None


def hex_string(max_bytes: int) -> Check:
    def check(value: Any) -> str | None:
        if not isinstance(value, str) or len(value) > 2 * max_bytes or len(value) % 2:
            return f"must be a hex string of at most {max_bytes} bytes"
        if any(c not in "0123456789abcdef" for c in value):
            return "must be lower-case hex"
        return None

    return check
