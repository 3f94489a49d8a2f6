"""The numba line decoder (connectors/decode_jit.py) against the numpy one, bit for bit.

Every test decodes the same bytes twice, once through each path of
`decode_buffer` (switched by `stream_ctr.connectors.decode._JIT`), and compares every
Batch column byte for byte plus the rejected lines.
"""
import contextlib
import gzip
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("numba")

from stream_ctr.connectors import decode as decode_mod            # noqa: E402
from stream_ctr.connectors import decode_jit                      # noqa: E402
from stream_ctr.connectors.decode import decode_buffer, decode_lines, line_buffer   # noqa: E402
from stream_ctr.connectors.files import SAMPLE_PATHS              # noqa: E402
from stream_ctr.connectors.formats import AVAZU, CRITEO           # noqa: E402
from stream_ctr.connectors.hashing import field_salt, hash_strings  # noqa: E402
from stream_ctr.connectors.kafka.decode import decode_messages    # noqa: E402

CRITEO_BYTES = gzip.decompress(SAMPLE_PATHS["criteo"].read_bytes())
_AVAZU_FILE = gzip.decompress(SAMPLE_PATHS["avazu"].read_bytes())
AVAZU_BYTES = _AVAZU_FILE[_AVAZU_FILE.index(b"\n") + 1:]          # without the header
SAMPLES = {"criteo": (CRITEO, CRITEO_BYTES), "avazu": (AVAZU, AVAZU_BYTES)}
COLUMNS = ("labels", "dense", "keys", "event_time_ms", "partition", "offset")


@contextlib.contextmanager
def decoder(jit: bool):
    """decode_buffer through the compiled kernels (jit) or the numpy path."""
    saved, decode_mod._JIT = decode_mod._JIT, (decode_jit if jit else None)
    try:
        yield
    finally:
        decode_mod._JIT = saved


def both(fn):
    """(fn() through the JIT path, fn() through the numpy path)."""
    with decoder(jit=True):
        fast = fn()
    with decoder(jit=False):
        slow = fn()
    return fast, slow


def assert_same_batch(a, b):
    for name in COLUMNS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert x.tobytes() == y.tobytes(), name                   # bit-identical (NaN-safe)
    assert a.partitions == b.partitions


def assert_same_lines(data: bytes, fmt, first_offset: int = 7):
    (fb, fr), (sb, sr) = both(lambda: decode_lines(data, fmt, "p", first_offset))
    assert_same_batch(fb, sb)
    assert fr == sr
    return fb, fr


# ------------------------------------------------------------ building blocks

@pytest.mark.parametrize("length", list(range(0, 26)) + [63, 64, 65])
def test_hash_span_equals_numpy_hash(length):
    rng = random.Random(length)
    token = bytes(rng.randrange(256) for _ in range(length))
    buf = np.frombuffer(b"xx" + token + bytes(8), np.uint8)
    for field in (0, 13, 38):
        salt = field_salt(np.array([field]))[0]
        assert decode_jit.hash_span(buf, 2, length, salt) == hash_strings([token], field)[0]


@pytest.mark.parametrize("text", [b"", b"0", b"-0", b"7", b"-7", b"12345678", b"-1234567",
                                  b"123456789", b"-123456789012345678", b"999999999999999999",
                                  b"1" * 19, b"-", b"--1", b"+5", b"1.5", b"1e3", b" 1", b"12a"])
def test_parse_int_equals_numpy(text):
    buf = np.frombuffer(text + b"\t" + bytes(8), np.uint8)
    starts, ends = np.array([0]), np.array([len(text)])
    values, ok, _ = decode_mod.parse_ints(buf, starts, ends)
    for parse in (decode_jit.parse_int, decode_jit.parse_short_int):
        value, jit_ok = parse(buf, 0, len(text))
        assert jit_ok == ok[0]
        if ok[0]:
            assert value == values[0]


def test_short_int_parse_equals_numpy_on_random_spans():
    """The 8-bytes-at-once parse against the numpy one: every length up to 9 (the
    longer ones take the byte loop), digits mixed with every other byte value at
    every position, with and without a sign."""
    rng = random.Random(5)
    digits = b"0123456789"
    texts = []
    for _ in range(6000):
        length = rng.randrange(0, 10)
        text = bytearray(rng.choice(digits) for _ in range(length))
        if text and rng.random() < 0.3:
            text[0] = ord("-")
        if text and rng.random() < 0.5:
            text[rng.randrange(length)] = rng.randrange(256)
        texts.append(bytes(text))
    buf = np.frombuffer(b"\t".join(texts) + b"\t" + bytes(8), np.uint8)
    lengths = np.array([len(t) for t in texts])
    ends = np.cumsum(lengths + 1) - 1
    starts = ends - lengths
    values, ok, _ = decode_mod.parse_ints(buf, starts, ends)
    for i, (s, e) in enumerate(zip(starts.tolist(), ends.tolist())):
        value, jit_ok = decode_jit.parse_short_int(buf, s, e)
        assert jit_ok == ok[i], texts[i]
        if jit_ok:
            assert value == values[i], texts[i]


# ------------------------------------------------------------ real samples

@pytest.mark.parametrize("name", ["criteo", "avazu"])
def test_real_sample(name):
    fmt, data = SAMPLES[name]
    batch, rejected = assert_same_lines(data, fmt, 0)
    assert len(batch) == data.count(b"\n") and rejected == []


@pytest.mark.parametrize("name", ["criteo", "avazu"])
def test_crlf_missing_final_newline_and_empty_lines(name):
    fmt, data = SAMPLES[name]
    data = data[:200_000]
    data = data[:data.rindex(b"\n") + 1]
    assert_same_lines(data.replace(b"\n", b"\r\n"), fmt)
    assert_same_lines(data[:-1], fmt)                              # no final LF
    assert_same_lines(data[:-2] + b"\r", fmt)                      # ... but a final CR
    assert_same_lines(b"\n" + data.replace(b"\n", b"\n\n", 50) + b"\r\n\n", fmt)
    for empty in (b"", b"\n", b"\r\n", b"\n\n\n"):
        assert_same_lines(empty, fmt)


def _criteo_line(label=b"0", ints=None, cats=None) -> bytes:
    ints = ints if ints is not None else [b"1"] * 13
    cats = cats if cats is not None else [b"abcd1234"] * 26
    return b"\t".join([label] + ints + cats)


def _avazu_line(click=b"0", hour=b"14102100", cats=None) -> bytes:
    return b",".join([b"123", click, hour] + (cats if cats is not None else [b"ab"] * 21))


def _with_int(j, text):
    ints = [b"1"] * 13
    ints[j] = text
    return _criteo_line(ints=ints)


CRITEO_ODD = [
    b"", b"\r", b"\t" * 39, b"\t" * 38, b"\t" * 40, b"\t".join([b"0"] * 39),
    _criteo_line() + b"\textra", _criteo_line() + b"\t", _criteo_line()[:-1],
    _criteo_line(label=b"x"), _criteo_line(label=b"2"), _criteo_line(label=b""),
    _criteo_line(label=b"00"), _criteo_line(label=b"-1"), _criteo_line(label=b"1\r"),
    _criteo_line(ints=[b""] * 13), _criteo_line(cats=[b""] * 26), _criteo_line(b"1", [b""] * 13, [b""] * 26),
    *[_with_int(j, t) for j in (0, 5, 12) for t in (
        b"1.5", b"abc", b"-", b"+5", b"--1", b"1-", b" 1", b"1e3", b"1" * 19, b"-" + b"1" * 19,
        b"0", b"-0", b"-1", b"-16", b"-17", b"-99999", b"16383", b"16384", b"123456789",
        b"-123456789", b"999999999999999999", b"-999999999999999999", b"000000000000000001",
        b"4294967296", b"9007199254740993")],
    _criteo_line(cats=[b"x" * n for n in range(26)]),                  # tokens of 0..25 bytes
    _criteo_line(cats=[b"\xff\x00\x80" * 7] * 26),                     # any bytes hash
    _criteo_line(label=b"1", ints=[str(v).encode() for v in range(-6, 7)]),
    _criteo_line() + b"\r\r",                                          # a CR stays in C26
]


def _interleave(good: list[bytes], odd: list[bytes]) -> bytes:
    lines = []
    for i, line in enumerate(odd):
        lines += good[3 * i:3 * i + 3] + [line]
    return b"\n".join(lines + good[3 * len(odd):]) + b"\n"


def test_many_malformed_criteo_lines():
    good = CRITEO_BYTES.splitlines()[:400]
    for data in (_interleave(good, CRITEO_ODD), b"\n".join(CRITEO_ODD),
                 _interleave(good, CRITEO_ODD).replace(b"\n", b"\r\n")):
        batch, rejected = assert_same_lines(data, CRITEO)
        assert len(rejected) > 30


AVAZU_ODD = [
    b"", b"\r", b"," * 23, b"," * 22, b"," * 24, _avazu_line() + b",x", _avazu_line()[:-3],
    _avazu_line(click=b"yes"), _avazu_line(click=b""), _avazu_line(click=b"1", hour=b"x"),
    *[_avazu_line(hour=h) for h in (
        b"14102100", b"14102123", b"16022900", b"00010100", b"99123123", b"15022900", b"14132100",
        b"14003100", b"14103200", b"14102124", b"1410210", b"141021000", b"1410210x", b"-4102100",
        b"", b"14100000", b"14000100", b"20022900", b"00022900")],
    _avazu_line(cats=[b"y" * n for n in range(21)]),
    _avazu_line(cats=[b""] * 21),
]


def test_many_malformed_avazu_lines():
    good = AVAZU_BYTES.splitlines()[:300]
    for data in (_interleave(good, AVAZU_ODD), b"\n".join(AVAZU_ODD)):
        batch, rejected = assert_same_lines(data, AVAZU)
        assert len(rejected) > 15


@pytest.mark.parametrize("name, seed", [("criteo", 1), ("criteo", 2), ("avazu", 3)])
def test_randomly_damaged_lines(name, seed):
    """Random edits with the bytes that matter (separators, signs, digits, CR, LF)."""
    fmt, data = SAMPLES[name]
    rng = random.Random(seed)
    lines = data.splitlines()[:1500]
    alphabet = [fmt.delimiter.encode(), b"-", b"+", b"0", b"1", b"9", b"a", b"\r", b"\n", b"",
                b"12345678901234567890", b"-99999", b"\t", b","]
    damaged = []
    for line in lines:
        if rng.random() < 0.3:
            at = rng.randrange(len(line) + 1)
            cut = rng.choice([0, 0, 1, 2])
            line = line[:at] + rng.choice(alphabet) + line[at + cut:]
        damaged.append(line)
    batch, rejected = assert_same_lines(b"\n".join(damaged), fmt)
    assert len(rejected) > 50


def test_decode_buffer_skip_empty_lines_and_line_positions():
    data = _interleave(CRITEO_BYTES.splitlines()[:200], CRITEO_ODD) + b"\n\r\n"
    buf, n = line_buffer(data)
    fast, slow = both(lambda: decode_buffer(buf, n, CRITEO, "q", 3, skip_empty_lines=True))
    assert_same_batch(fast.batch, slow.batch)
    assert fast.rejected == slow.rejected
    assert np.array_equal(fast.line_start, slow.line_start)
    assert np.array_equal(fast.line_lf, slow.line_lf)


# ------------------------------------------------------------ Kafka messages

def _decode_messages(values, fmt):
    n = len(values)
    parts = np.arange(n, dtype=np.int32) % 2
    return decode_messages(values, parts, np.arange(100, 100 + n), np.arange(n) * 1000 + 5,
                           ("t/0", "t/1"), fmt)


@pytest.mark.parametrize("name", ["criteo", "avazu"])
def test_packed_messages(name):
    fmt, data = SAMPLES[name]
    odd = CRITEO_ODD if name == "criteo" else AVAZU_ODD
    lines = data.splitlines()[:3000]
    packed = [b"\n".join(lines[i:i + 250]) for i in range(0, len(lines), 250)]
    packed[3] += b"\n"                                           # a trailing LF
    packed[5] = packed[5].replace(b"\n", b"\r\n") + b"\r\n"      # CRLF
    packed.insert(2, b"")                                        # an empty message
    packed.insert(4, b"\n".join(odd))                            # a message of bad lines
    single = lines[:300] + odd
    for values in (packed, single):
        fast, slow = both(lambda: _decode_messages(values, fmt))
        assert_same_batch(fast.batch, slow.batch)
        assert fast.rejected == slow.rejected
        assert np.array_equal(fast.rows_per_message, slow.rows_per_message)
        assert np.array_equal(fast.line_in_message, slow.line_in_message)


# ------------------------------------------------------------ dispatch

def test_dispatch_uses_jit_by_default_and_env_var_disables_it():
    assert decode_mod._JIT is decode_jit or os.environ.get("STREAM_CTR_NO_JIT") == "1"
    root = Path(__file__).resolve().parents[2]
    code = "import stream_ctr.connectors.decode as d; print(d._JIT is None)"
    env = dict(os.environ, STREAM_CTR_NO_JIT="1")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "True"
