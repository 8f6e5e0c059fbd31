"""One signature for a batch of records: a Merkle tree over what each record's signature covers.

A producer that writes several records at once (a transaction, a flush) signs the
root of a binary hash tree whose leaves are the records' signed contents
(:func:`streams._signing.signed_bytes`), once; each record then carries the
signature and its own *inclusion proof* (header ``saga.proof``), so a reader
checks any one record alone, without the others: it hashes the record's content
into a leaf, folds the proof's sibling hashes up to the root, and verifies the
signature over that root (once per batch and process: the verdict is kept).

Shape (fixed by the leaf count ``n`` alone): the leaves are level 0; each level
pairs its nodes left to right, and a last node without a partner is carried up
unchanged. Hashes are SHA-256, with a prefix byte that keeps leaves and inner
nodes apart (``0x00`` leaf, ``0x01`` node, as RFC 9162), so no inner node can be
passed off as a record. The signed message binds the count::

    b"saga-batch-signature-v1\\x00" || uint16 n || root

``saga.proof`` is ``uint16 index || uint16 n || sibling hashes`` (32 bytes each,
bottom up; exactly as many as the record's path has pairs), big-endian. A
record's proof that is too short, too long, or has ``index >= n`` fails.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Final

HASH_BYTES: Final = 32
BATCH_DOMAIN: Final = b"saga-batch-signature-v1\x00"
MAX_LEAVES: Final = 4096
"""The largest batch a reader accepts (a writer signs far fewer: ``SignedLog``'s batch)."""
_LEAF: Final = b"\x00"
_NODE: Final = b"\x01"
_HEAD: Final = struct.Struct(">HH")
_sha256 = hashlib.sha256


def leaf_hash(content: bytes) -> bytes:
    """The leaf of a record whose signed content is ``content``."""
    return _sha256(_LEAF + content).digest()


def batch_message(count: int, root: bytes) -> bytes:
    """What the batch's Ed25519 signature covers."""
    return BATCH_DOMAIN + count.to_bytes(2, "big") + root


def tree(leaves: Sequence[bytes]) -> tuple[bytes, list[bytes]]:
    """The root of ``leaves`` (2 to :data:`MAX_LEAVES`) and each leaf's proof, in order."""
    count = len(leaves)
    if not 2 <= count <= MAX_LEAVES:
        raise ValueError(f"a batch signs 2 to {MAX_LEAVES} records, not {count}")
    paths: list[list[bytes]] = [[] for _ in range(count)]
    level = list(leaves)
    under = [[i] for i in range(count)]  # the leaves under each node of the level
    while len(level) > 1:
        above: list[bytes] = []
        under_above: list[list[int]] = []
        for j in range(0, len(level) - 1, 2):
            left, right = level[j], level[j + 1]
            for i in under[j]:
                paths[i].append(right)
            for i in under[j + 1]:
                paths[i].append(left)
            above.append(_sha256(_NODE + left + right).digest())
            under_above.append(under[j] + under[j + 1])
        if len(level) % 2:  # the last node has no partner: carried up as it is
            above.append(level[-1])
            under_above.append(under[-1])
        level, under = above, under_above
    proofs = [_HEAD.pack(i, count) + b"".join(path) for i, path in enumerate(paths)]
    return level[0], proofs


def root_of(leaf: bytes, proof: bytes, memo: dict[bytes, bytes] | None = None) -> tuple[int, bytes]:
    """``(n, root)`` of the batch that ``proof`` places ``leaf`` in; ValueError if malformed.

    ``memo`` (node hash inputs -> node hashes, filled here) spares the hashing that the
    records of one batch share: their paths meet, so once one record's path is
    folded, most of the next one's nodes are already known. The result is the same
    with or without it.
    """
    if len(proof) < _HEAD.size:
        raise ValueError("the batch proof is too short")
    index, count = _HEAD.unpack_from(proof)
    if not index < count <= MAX_LEAVES:
        raise ValueError("the batch proof's position is out of range")
    node, at, width = leaf, _HEAD.size, count
    while width > 1:
        if index & 1 or index + 1 < width:
            sibling = proof[at : at + HASH_BYTES]
            if len(sibling) != HASH_BYTES:
                raise ValueError("the batch proof is too short")
            at += HASH_BYTES
            pair = _NODE + sibling + node if index & 1 else _NODE + node + sibling
            if memo is None:
                node = _sha256(pair).digest()
            elif (known := memo.get(pair)) is not None:
                node = known
            else:
                node = memo[pair] = _sha256(pair).digest()
        index >>= 1
        width = (width + 1) >> 1
    if at != len(proof):
        raise ValueError("the batch proof is too long")
    return count, node
