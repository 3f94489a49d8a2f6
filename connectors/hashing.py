"""Feature signs: a 63-bit hash of (field id, raw token), computed vectorized.

A token is a byte span of a decode buffer (or an integer, see `hash_ints`).
The key of a token in field ``f`` is::

    state = salt(f) + tag * GOLDEN            # tag = byte length, or INT_TAG
    for each 8-byte little-endian chunk w of the token (one zero chunk if empty):
        state = mix64(state ^ w)
    key = state & (2**63 - 1)                 # never negative as int64

``salt(f) = mix64(f * GOLDEN ^ SEED)`` and ``mix64`` is the splitmix64
finalizer (a bijection of uint64).  Within one field, tokens of the same length
up to 8 bytes therefore never collide before the top bit is cleared; across
fields the salt separates the same token.  An empty span (a missing value) is a
token like any other, so every field has its own "missing" sign.

All arithmetic is uint64 numpy arithmetic, which wraps modulo 2**64.  The only
Python loop runs over 8-byte chunk positions (one pass for tokens <= 8 bytes),
never over tokens.
"""
from __future__ import annotations

import numpy as np

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
SEED = np.uint64(0x5C7A_11E5_D00D_F00D)
INT_TAG = np.uint64(1 << 62)          # "length" tag of integer tokens; no byte span is this long
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_SIGN_MASK = np.uint64(0x7FFF_FFFF_FFFF_FFFF)
_INT_TAG_GOLDEN = np.uint64((int(INT_TAG) * int(GOLDEN)) % (1 << 64))
# _LEN_MASK[k] keeps the low k bytes of a little-endian word (k = 0..8).
_LEN_MASK = np.array([(1 << (8 * k)) - 1 for k in range(9)], dtype=np.uint64)


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer, in place on a uint64 array; returns it."""
    x ^= x >> np.uint64(30)
    x *= _M1
    x ^= x >> np.uint64(27)
    x *= _M2
    x ^= x >> np.uint64(31)
    return x


def field_salt(field_ids: np.ndarray) -> np.ndarray:
    """Per-field salt (uint64), same shape as `field_ids`."""
    shape = np.shape(field_ids)
    f = np.atleast_1d(np.asarray(field_ids, dtype=np.int64)).astype(np.uint64)
    return mix64(f * GOLDEN ^ SEED).reshape(shape)


def padded_buffer(data: bytes | bytearray | memoryview | np.ndarray) -> np.ndarray:
    """A uint8 copy of `data` followed by 8 zero bytes, ready for `word_view`."""
    raw = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
    out = np.zeros(len(raw) + 8, dtype=np.uint8)
    out[: len(raw)] = raw
    return out


def word_view(buf: np.ndarray) -> np.ndarray:
    """Overlapping little-endian uint64 windows: ``word_view(buf)[i]`` = bytes i..i+7.

    Valid for i <= len(buf) - 8; use `padded_buffer` so every span start has a window.
    """
    buf = np.ascontiguousarray(buf, dtype=np.uint8)
    n = max(len(buf) - 7, 0)
    return np.ndarray(shape=(n,), dtype="<u8", buffer=buf, strides=(1,))


def hash_tokens(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray,
                field_ids: np.ndarray) -> np.ndarray:
    """63-bit keys of the byte spans ``buf[starts:ends]`` salted by field id.

    `starts` and `ends` are int64 arrays of any equal shape; `field_ids` must
    broadcast against them (e.g. shape [F] for spans of shape [B, F]).  Returns
    int64 keys of the broadcast shape, all >= 0.  `buf` is a uint8 array; it is
    copied once if it lacks 8 bytes of slack after the last span start.
    """
    starts = np.asarray(starts, dtype=np.int64)
    ends = np.asarray(ends, dtype=np.int64)
    if starts.size and starts.max() + 8 > len(buf):
        buf = padded_buffer(buf)
    return hash_spans(word_view(buf), starts, ends - starts, field_salt(field_ids))


def hash_spans(words: np.ndarray, starts: np.ndarray, length: np.ndarray, salt: np.ndarray,
               out: np.ndarray | None = None) -> np.ndarray:
    """`hash_tokens` for callers that already hold the pieces (the decoder's hot path).

    `words` is `word_view` of a buffer with slack, `length` the span lengths
    (``ends - starts``), `salt` the `field_salt` of the fields (broadcast
    against `starts`).  With `out` (int64, the broadcast shape, may be a
    strided view such as some columns of a key matrix) the keys are written
    there and no result array is allocated.  Returns the int64 keys.
    """
    state = length.view(np.uint64) * GOLDEN
    state += salt
    chunk = words[starts]
    chunk &= np.take(_LEN_MASK, length, mode="clip")
    state ^= chunk
    mix64(state)
    if length.size and length.max() > 8:
        _hash_long_tail(state, words, starts, length)
    if out is None:
        state &= _SIGN_MASK
        return state.view(np.int64)
    np.bitwise_and(state, _SIGN_MASK, out=out.view(np.uint64))
    return out


def _hash_long_tail(state: np.ndarray, words: np.ndarray, starts: np.ndarray,
                    length: np.ndarray) -> None:
    """Fold chunks 1.. of tokens longer than 8 bytes into `state`, in place."""
    flat_state = state.reshape(-1)
    flat_starts = np.broadcast_to(starts, state.shape).reshape(-1)
    flat_len = np.broadcast_to(length, state.shape).reshape(-1)
    idx = np.flatnonzero(flat_len > 8)
    chunk = 1
    while idx.size:
        remaining = flat_len[idx] - 8 * chunk
        w = words[flat_starts[idx] + 8 * chunk] & _LEN_MASK[np.minimum(remaining, 8)]
        flat_state[idx] = mix64(flat_state[idx] ^ w)
        chunk += 1
        idx = idx[flat_len[idx] > 8 * chunk]


def hash_ints(values: np.ndarray, field_ids: np.ndarray,
              missing: np.ndarray | None = None) -> np.ndarray:
    """63-bit keys of integer tokens (e.g. buckets) salted by field id.

    An integer token never equals a byte token (its length tag is INT_TAG).
    Where `missing` is True the key is the field's missing sign, the same as
    an empty span in `hash_tokens`.  `field_ids` and `missing` broadcast
    against `values`, which sets the shape of the result.
    """
    values = np.asarray(values, dtype=np.int64)
    if values.ndim == 0:
        return hash_ints(values[None], field_ids, missing)[0]
    word = values.view(np.uint64)                   # two's complement
    salt = field_salt(field_ids)
    int_salt = salt + _INT_TAG_GOLDEN
    if missing is None:
        state = word ^ int_salt
    else:
        state = np.where(missing, salt, int_salt)
        state ^= np.where(missing, np.uint64(0), word)
    mix64(state)
    state &= _SIGN_MASK
    return state.view(np.int64)


def hash_strings(tokens: list[bytes | str], field_id: int) -> np.ndarray:
    """Keys of a list of tokens in one field; equal to `hash_tokens` on the same bytes.

    For tests and JSON-shaped records (str tokens are encoded as UTF-8).
    """
    raw = [t.encode("utf-8") if isinstance(t, str) else bytes(t) for t in tokens]
    lengths = np.array([len(t) for t in raw], dtype=np.int64)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    buf = padded_buffer(b"".join(raw))
    return hash_tokens(buf, starts, ends, np.full(len(raw), field_id, dtype=np.int64))
