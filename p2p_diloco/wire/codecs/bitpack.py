"""Packing small integers into bytes for sparse bodies, and unpacking them strictly.

Two layouts, both little-endian, both with every unused bit of the last byte zero:

- 12-bit values (`pack12`): two values in three bytes: the first's low 8 bits; its high 4 bits in the low
  nibble and the second's low 4 bits in the high nibble; the second's high 8 bits. An odd count ends with
  one value in two bytes, the high nibble of the second 0. ceil(3n / 2) bytes for n values.
- 2- and 4-bit codes (`pack_codes`): 8 / bits codes a byte, the first in the lowest bits.

The unpackers read from a view at an offset a `ByteReader` already claimed (so the bytes exist) and raise
`DecodeError(BAD_PADDING)` when a padding bit is set: one set of values has exactly one encoding.
"""

from __future__ import annotations

from enum import StrEnum

import numpy as np

from p2p_diloco.errors import DecodeError


class PackReason(StrEnum):
    """DecodeError reason tags of packed fields."""

    BAD_PADDING = "bad padding"  # an unused bit of a packed field's last byte is set


def packed12_size(count: int) -> int:
    return (3 * count + 1) // 2


def pack12(values: np.ndarray) -> bytes:
    """`values` (integers in [0, 4096)) packed at 12 bits each."""
    v = np.asarray(values, dtype=np.int64).reshape(-1)
    if v.size and (int(v.min()) < 0 or int(v.max()) >= 4096):
        raise ValueError("12-bit values must lie in [0, 4096)")
    pairs = v.size // 2
    out = np.zeros(packed12_size(v.size), dtype=np.uint8)
    first, second = v[0 : 2 * pairs : 2], v[1 : 2 * pairs : 2]
    out[0 : 3 * pairs : 3] = first & 0xFF
    out[1 : 3 * pairs : 3] = (first >> 8) | ((second & 0x0F) << 4)
    out[2 : 3 * pairs : 3] = second >> 4
    if v.size % 2:
        out[3 * pairs] = v[-1] & 0xFF
        out[3 * pairs + 1] = v[-1] >> 8
    return out.tobytes()


def unpack12(view: memoryview, at: int, count: int, what: str) -> np.ndarray:
    """`count` 12-bit values (int64) packed at `at`; DecodeError if the padding nibble is set."""
    raw = np.frombuffer(view, np.uint8, packed12_size(count), at).astype(np.int64)
    pairs = count // 2
    out = np.empty(count, dtype=np.int64)
    b0, b1, b2 = raw[0 : 3 * pairs : 3], raw[1 : 3 * pairs : 3], raw[2 : 3 * pairs : 3]
    out[0 : 2 * pairs : 2] = b0 | ((b1 & 0x0F) << 8)
    out[1 : 2 * pairs : 2] = (b1 >> 4) | (b2 << 4)
    if count % 2:
        low, high = int(raw[3 * pairs]), int(raw[3 * pairs + 1])
        if high >> 4:
            raise DecodeError(PackReason.BAD_PADDING, f"{what}: odd 12-bit count, last high nibble not 0")
        out[-1] = low | (high << 8)
    return out


def packed_codes_size(count: int, bits: int) -> int:
    per_byte = 8 // bits
    return -(-count // per_byte)


def pack_codes(codes: np.ndarray, bits: int) -> bytes:
    """uint8 `codes` (each below 2**bits) packed `8 // bits` a byte, lowest bits first; bits 2, 4 or 8."""
    c = np.asarray(codes, dtype=np.uint8).reshape(-1)
    if bits == 8:
        return c.tobytes()
    per_byte = 8 // bits
    padded = np.zeros(packed_codes_size(c.size, bits) * per_byte, dtype=np.uint8)
    padded[: c.size] = c
    lanes = padded.reshape(-1, per_byte)
    out = np.zeros(lanes.shape[0], dtype=np.uint8)
    for lane in range(per_byte):
        out |= lanes[:, lane] << (lane * bits)
    return out.tobytes()


def unpack_codes(view: memoryview, at: int, count: int, bits: int, what: str) -> np.ndarray:
    """`count` codes of `bits` bits (int64) packed at `at`; DecodeError if a padding bit is set."""
    per_byte = 8 // bits
    raw = np.frombuffer(view, np.uint8, packed_codes_size(count, bits), at)
    if bits == 8:
        return raw.astype(np.int64)
    used = count % per_byte
    if used and int(raw[-1]) >> (used * bits):
        raise DecodeError(PackReason.BAD_PADDING, f"{what}: unused bits of the last code byte not 0")
    mask = (1 << bits) - 1
    lanes = np.empty((raw.size, per_byte), dtype=np.int64)
    for lane in range(per_byte):
        lanes[:, lane] = (raw >> (lane * bits)) & mask
    return lanes.reshape(-1)[:count]
