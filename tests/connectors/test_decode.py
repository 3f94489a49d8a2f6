"""decode_lines on the real Criteo/Avazu samples, on injected bad lines, and on edge cases."""
import gzip
import math
from datetime import datetime, timezone

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from stream_ctr.connectors.decode import criteo_buckets, decode_lines, parse_ints
from stream_ctr.connectors.files import SAMPLE_PATHS
from stream_ctr.connectors.formats import AVAZU, CRITEO
from stream_ctr.connectors.hashing import hash_ints, hash_strings, padded_buffer

CRITEO_BYTES = gzip.decompress(SAMPLE_PATHS["criteo"].read_bytes())
AVAZU_FILE = gzip.decompress(SAMPLE_PATHS["avazu"].read_bytes())
AVAZU_BYTES = AVAZU_FILE[AVAZU_FILE.index(b"\n") + 1:]          # without the header
CRITEO_ROWS = [line.split(b"\t") for line in CRITEO_BYTES.splitlines()]
AVAZU_ROWS = [line.split(b",") for line in AVAZU_BYTES.splitlines()]


@pytest.fixture(scope="module")
def criteo():
    return decode_lines(CRITEO_BYTES, CRITEO, "file:criteo", 0)


@pytest.fixture(scope="module")
def avazu():
    return decode_lines(AVAZU_BYTES, AVAZU, "file:avazu", 0)


def test_criteo_sample_decodes_completely(criteo):
    batch, rejected = criteo
    assert (len(batch), len(rejected)) == (14493, 0)
    assert batch.labels.sum() == 3291
    assert batch.keys.shape == (14493, 39) and batch.dense.shape == (14493, 13)
    assert batch.keys.dtype == np.int64 and (batch.keys >= 0).all()
    assert batch.offset.tolist() == list(range(14493))
    assert batch.partitions == ("file:criteo",) and (batch.partition == 0).all()
    assert (batch.event_time_ms == -1).all()


def test_criteo_missing_integer_has_the_missing_sign_exactly_where_empty(criteo):
    batch, _ = criteo
    empty_i1 = np.array([row[1] == b"" for row in CRITEO_ROWS])
    assert round(empty_i1.mean() * 100, 1) == 44.3                      # SOURCES.md
    missing_key = hash_strings([b""], 0)[0]
    assert ((batch.keys[:, 0] == missing_key) == empty_i1).all()
    assert (batch.dense[empty_i1, 0] == 0).all()


@pytest.mark.parametrize("c, share", [(1, 0.0), (3, 3.5), (6, 13.5), (19, 44.8), (22, 79.8)])
def test_criteo_categorical_missing_shares_match_sources(criteo, c, share):
    batch, _ = criteo
    field = 12 + c
    missing = batch.keys[:, field] == hash_strings([b""], field)[0]
    assert round(missing.mean() * 100, 1) == share


def test_criteo_values_match_a_plain_python_reference(criteo):
    batch, _ = criteo
    for i in range(0, 14493, 97):
        row = CRITEO_ROWS[i]
        assert batch.labels[i] == int(row[0])
        for j in range(13):
            v = int(row[1 + j]) if row[1 + j] else None
            dense = 0.0 if v is None else math.copysign(math.log1p(abs(v)), v)
            assert batch.dense[i, j] == pytest.approx(dense, rel=1e-6)
            bucket = None if v is None else (v if v <= 2 else int(math.log(v) ** 2))
            expect = hash_strings([b""], j)[0] if v is None else hash_ints(bucket, j)
            assert batch.keys[i, j] == expect
        for j in range(26):
            assert batch.keys[i, 13 + j] == hash_strings([row[14 + j]], 13 + j)[0]


def test_avazu_sample_decodes_completely(avazu):
    batch, rejected = avazu
    assert (len(batch), len(rejected)) == (9999, 0)
    assert batch.labels.sum() == 1706
    assert batch.keys.shape == (9999, 23) and batch.dense.shape == (9999, 0)
    hour = datetime(2014, 10, 21, tzinfo=timezone.utc).timestamp() * 1000
    assert (batch.event_time_ms == int(hour)).all()
    assert (batch.keys[:, 21] == hash_ints(0, 21)).all()               # 00:00 UTC
    assert (batch.keys[:, 22] == hash_ints(1, 22)).all()               # a Tuesday
    distinct = {"site_id": 381, "app_id": 313, "device_id": 1075, "device_ip": 7302,
                "device_model": 1168, "C14": 271}
    for name, n in distinct.items():
        assert len(np.unique(batch.keys[:, AVAZU.key_fields.index(name)])) == n
    i = 1234
    assert batch.keys[i, 0] == hash_strings([AVAZU_ROWS[i][3]], 0)[0]


def test_crlf_and_missing_final_newline_decode_the_same(criteo):
    batch, _ = criteo
    crlf, _ = decode_lines(CRITEO_BYTES.replace(b"\n", b"\r\n"), CRITEO, "file:criteo", 0)
    no_lf, _ = decode_lines(CRITEO_BYTES[:-1], CRITEO, "file:criteo", 0)
    for other in (crlf, no_lf):
        assert (other.keys == batch.keys).all() and (other.dense == batch.dense).all()
        assert (other.labels == batch.labels).all() and (other.offset == batch.offset).all()


def test_empty_input_gives_an_empty_batch():
    batch, rejected = decode_lines(b"", CRITEO, "p", 5)
    assert len(batch) == 0 and rejected == [] and batch.keys.shape == (0, 39)


def _criteo_line(label=b"0", i1=b"3", c1=b"68fd1e64") -> bytes:
    return b"\t".join([label, i1] + [b"1"] * 12 + [c1] + [b"abcd1234"] * 25)


CRITEO_BAD = {
    3: (b"\t".join([b"0"] * 39), "field_count"),
    5: (_criteo_line(label=b"x"), "bad_label"),
    6: (_criteo_line(label=b"2"), "bad_label"),
    8: (_criteo_line(i1=b"1.5"), "bad_integer"),
    9: (_criteo_line(i1=b"abc"), "bad_integer"),
    10: (b"", "field_count"),
    11: (_criteo_line(i1=b"-"), "bad_integer"),
    12: (_criteo_line(i1=b"1" * 19), "bad_integer"),
    13: (_criteo_line(i1=b"+5"), "bad_integer"),
    14: (_criteo_line() + b"\textra", "field_count"),
}


def _inject(good_lines: list[bytes], bad: dict[int, tuple[bytes, str]], total: int) -> tuple[bytes, list[int]]:
    lines, good_at, it = [], [], iter(good_lines)
    for i in range(total):
        if i in bad:
            lines.append(bad[i][0])
        else:
            lines.append(next(it))
            good_at.append(i)
    return b"\n".join(lines) + b"\n", good_at


def test_bad_criteo_lines_are_rejected_by_reason_and_nothing_else_is_lost():
    good_lines = CRITEO_BYTES.splitlines()[:40]
    data, good_at = _inject(good_lines, CRITEO_BAD, 50)
    batch, rejected = decode_lines(data, CRITEO, "p", 1000)
    assert len(batch) + len(rejected) == 50
    assert [(r.offset, r.reason) for r in rejected] == [(1000 + i, CRITEO_BAD[i][1]) for i in sorted(CRITEO_BAD)]
    assert [r.raw for r in rejected] == [CRITEO_BAD[i][0] for i in sorted(CRITEO_BAD)]
    assert batch.offset.tolist() == [1000 + i for i in good_at]
    clean, _ = decode_lines(b"\n".join(good_lines), CRITEO, "p", 0)
    assert (batch.keys == clean.keys).all() and (batch.dense == clean.dense).all()


def _avazu_line(hour=b"14102100", click=b"0") -> bytes:
    return b",".join([b"123", click, hour] + [b"ab"] * 21)


@pytest.mark.parametrize("hour, ok", [
    (b"14102100", True), (b"14102123", True), (b"16022900", True), (b"00010100", True),
    (b"15022900", False), (b"14132100", False), (b"14003100", False), (b"14103200", False),
    (b"14102124", False), (b"1410210", False), (b"141021000", False), (b"1410210x", False),
    (b"-4102100", False), (b"", False),
])
def test_avazu_hour_validation(hour, ok):
    batch, rejected = decode_lines(_avazu_line(hour) + b"\n", AVAZU, "p", 0)
    assert (len(batch), len(rejected)) == ((1, 0) if ok else (0, 1))
    if ok:
        h = hour.decode()
        when = datetime(2000 + int(h[:2]), int(h[2:4]), int(h[4:6]), int(h[6:]), tzinfo=timezone.utc)
        assert batch.event_time_ms[0] == int(when.timestamp()) * 1000
        assert batch.keys[0, 21] == hash_ints(when.hour, 21)
        assert batch.keys[0, 22] == hash_ints(when.weekday(), 22)
    else:
        assert rejected[0].reason == "bad_time"


def test_bad_avazu_lines_are_rejected_with_their_offsets():
    good = AVAZU_BYTES.splitlines()[:20]
    bad = {0: (_avazu_line(click=b"yes"), "bad_label"), 4: (b"1,0,14102100", "field_count"),
           7: (_avazu_line(hour=b"14102199"), "bad_time"), 9: (b"", "field_count")}
    data, good_at = _inject(good, bad, 24)
    batch, rejected = decode_lines(data, AVAZU, "p", 0)
    assert [(r.offset, r.reason) for r in rejected] == [(i, bad[i][1]) for i in sorted(bad)]
    assert batch.offset.tolist() == good_at and len(batch) + len(rejected) == 24


@pytest.mark.parametrize("text, value", [
    (b"0", 0), (b"-0", 0), (b"007", 7), (b"-1", -1), (b"12345678", 12345678),
    (b"123456789", 123456789), (b"-999999999999999999", -999999999999999999),
    (b"4294967296", 2**32),
])
def test_parse_ints_edge_cases(text, value):
    values, ok, missing = _parse([text])
    assert ok[0] and not missing[0] and values[0] == value


def _parse(tokens: list[bytes]):
    lengths = np.array([len(t) for t in tokens], dtype=np.int64)
    ends = np.cumsum(lengths) + np.arange(len(tokens))          # tokens separated by a tab
    buf = padded_buffer(b"\t".join(tokens))
    return parse_ints(buf, ends - lengths, ends)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.one_of(st.integers(-10**18 + 1, 10**18 - 1).map(lambda v: str(v).encode()),
                          st.binary(max_size=12).filter(lambda b: b"\t" not in b)),
                min_size=1, max_size=40))
def test_parse_ints_agrees_with_python(tokens):
    values, ok, missing = _parse(tokens)
    for t, v, good, miss in zip(tokens, values.tolist(), ok.tolist(), missing.tolist()):
        expect_ok = t == b"" or _is_int(t)
        assert good == expect_ok and miss == (t == b"")
        if t and expect_ok:
            assert v == int(t)


def _is_int(t: bytes) -> bool:
    digits = t[1:] if t.startswith(b"-") else t
    return 1 <= len(digits) <= 18 and all(48 <= c <= 57 for c in digits)


def test_criteo_buckets_follow_the_winners_transform():
    v = np.array([-5, -1, 0, 1, 2, 3, 20, 1000, 10**12])
    expect = [x if x <= 2 else int(math.log(x) ** 2) for x in v.tolist()]
    assert criteo_buckets(v).tolist() == expect
