"""The bucket hash: MurmurHash3 x86 32-bit, seed 0, unsigned, over the key's UTF-8 bytes.

Fixed so that producers in other languages (Java's Guava murmur3_32_fixed, Go's
spaolacci/murmur3 Sum32) land a key in the same bucket as this SDK.
"""

from __future__ import annotations

import mmh3

HASH_SEED = 0


def murmur3_32(data: bytes) -> int:
    """Unsigned 32-bit MurmurHash3 (x86 variant) of ``data`` with seed 0."""
    return int(mmh3.hash(data, HASH_SEED, signed=False))


def bucket_of(key: str, buckets: int) -> int:
    """The bucket a key belongs to: ``murmur3_32(utf8(key)) mod buckets``."""
    if buckets < 1:
        raise ValueError("buckets must be at least 1")
    return murmur3_32(key.encode("utf-8")) % buckets
