"""The region's integrity sums: the ``record_sum`` of its metadata records and the data checksums.

A record sum covers what ``region_format``'s docstring says (a namespace record's fields; an
entry record's fields but ``state`` and ``tick``, its page chain and its namespace's identity);
it detects damage and stale records, and is no keyed MAC. A data checksum is the xxh64 of a
shard's bytes (writers send it with commit; recovery and ``kvtierctl check --checksums``
recompute it), combined per entry by ``entry_checksum``.
"""

from __future__ import annotations

import numpy as np
import xxhash

from .region_format import ENTRY_DTYPE, NS_DTYPE


# A sum of one bijective mix per 64-bit word and position (multiply by an odd constant of the
# position, xor-shift, multiply): changing any one word (a byte, a field, a page number) always
# changes the sum; several changes cancel with odds of ~2^-64. It detects damage and stale
# records, for a whole job's records (or a whole table at recovery) in a few NumPy passes (a
# store job's entries: ~10 passes, a few µs); it is no keyed MAC. uint64 arrays wrap silently.
_MIX = np.uint64(0x94D049BB133111EB)
_S32 = np.uint64(32)
_positions = np.zeros(0, dtype=np.uint64)


def _position_constants(end: int) -> np.ndarray:
    """Distinct odd multipliers for word positions 0..end-1 (golden-ratio steps, forced odd)."""
    global _positions
    if len(_positions) < end:
        _positions = (np.arange(1, max(end, 1024) + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)) \
            | np.uint64(1)
    return _positions[:end]


def _mix_sum(words: np.ndarray) -> np.ndarray:
    """Σ_i mix_i(words[:, i]) mod 2^64 per row of uint64 words, never 0 (0 means "no valid
    record"). ``words`` is overwritten."""
    words *= _position_constants(words.shape[1])
    words ^= words >> _S32
    words *= _MIX
    return np.maximum(words.sum(axis=1, dtype=np.uint64), np.uint64(1))


def _word_mask(dtype: np.dtype, fields: tuple[str, ...]) -> np.ndarray:
    """uint64 words over a record of ``dtype``: all ones but the bytes of ``fields``."""
    mask = np.full(dtype.itemsize, 0xFF, dtype=np.uint8)
    for name in fields:
        field_dtype, offset = dtype.fields[name][:2]
        mask[offset:offset + field_dtype.itemsize] = 0
    return mask.view("<u8")


def _words(records: np.ndarray, mask: np.ndarray, extra: int = 0) -> np.ndarray:
    """The records (structured, or one row of bytes each) as rows of uint64 words ANDed with
    ``mask``, followed by ``extra`` words for the caller to fill."""
    n, width = len(records), len(mask)
    words = np.empty((n, width + extra), dtype=np.uint64)
    np.bitwise_and(np.ascontiguousarray(records).view("<u8").reshape(n, width), mask, out=words[:, :width])
    return words


_NS_SUMMED = _word_mask(NS_DTYPE, ("record_sum",))
_NS_IDENTITY = _word_mask(NS_DTYPE, ("in_use", "record_sum", "flags"))
# An entry record's sum leaves out the bytes that change without the entry changing: state (written
# last, after the sum) and tick (every access).
ENTRY_SUMMED = _word_mask(ENTRY_DTYPE, ("state", "tick", "record_sum"))
_ENTRY_WORDS = len(ENTRY_SUMMED)


def namespace_record_sums(records: np.ndarray) -> np.ndarray:
    """The record_sum of NS_DTYPE records: over every byte but record_sum's."""
    return _mix_sum(_words(records, _NS_SUMMED))


def namespace_identities(records: np.ndarray) -> np.ndarray:
    """A digest of each NS_DTYPE record's identity fields (not in_use, flags, record_sum), which
    every entry's record_sum covers: swapping namespace records moves no entry."""
    return _mix_sum(_words(records, _NS_IDENTITY))


def entry_record_sums(records: np.ndarray, chains: np.ndarray, counts: np.ndarray | None,
                      ns_identities: np.ndarray | int) -> np.ndarray:
    """The record_sum of ENTRY_DTYPE records (or their bytes, one 128-byte row each): every field
    but state, tick and record_sum; the identity of the entry's namespace
    (``namespace_identities``); and the first ``counts[i]`` pages of ``chains[i]`` (a uint32 row
    per record; None: the whole row)."""
    width = chains.shape[1]
    words = _words(records, ENTRY_SUMMED, 1 + width)
    words[:, _ENTRY_WORDS] = ns_identities
    pages = words[:, _ENTRY_WORDS + 1:]
    np.add(chains, 1, out=pages, casting="unsafe")       # + 1: page 0 must count too
    if counts is not None:
        pages[np.arange(width)[None, :] >= np.asarray(counts)[:, None]] = 0   # past the chain: nothing
    return _mix_sum(words)


def shard_checksum(data: np.ndarray, pages: np.ndarray, page_size: int, nbytes: int) -> int:
    """xxh64 of one shard's logical bytes: the first ``nbytes`` bytes of ``pages`` in order.

    ``data`` is the region's data area as uint8. Writers compute it after their copy; recovery
    and ``kvtierctl check --checksums`` recompute it from the pages.
    """
    h = xxhash.xxh64()
    for i, page in enumerate(pages.tolist()):
        n = min(page_size, nbytes - i * page_size)
        if n <= 0:
            break
        start = page * page_size
        h.update(data[start:start + n])
    return h.intdigest()


def entry_checksum(shard_sums: list[int]) -> int:
    """One entry's checksum from its shards' (rank order); never 0, which means "none"."""
    if len(shard_sums) == 1:
        value = shard_sums[0]
    else:
        value = xxhash.xxh64_intdigest(np.asarray(shard_sums, dtype="<u8").tobytes())
    return value or 1
