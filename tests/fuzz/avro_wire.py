"""Avro wire pieces for building corrupt records by hand."""

from __future__ import annotations


def varint(value: int) -> bytes:
    """Avro's zig-zag varint of a long; values beyond 64 bits wrap as a writer's would."""
    encoded = ((value << 1) ^ (value >> 63)) & (2**64 - 1)
    out = bytearray()
    while encoded > 0x7F:
        out.append((encoded & 0x7F) | 0x80)
        encoded >>= 7
    out.append(encoded)
    return bytes(out)
