"""The fast decoder against an independent per-line reference (tests/connectors/decode_reference.py).

The reference decodes one line at a time straight from the format rules and
computes keys from the hash spec with Python ints, so agreement shows the
output is right, not only unchanged.  Keys, labels, event times, partitions
and offsets are compared as raw bytes; dense features must be within 1 ulp of
the correctly rounded float32 of sign(x)*log1p(|x|) (numpy's float32 log1p is
not always correctly rounded), with the same sign bit and the same zeros.
Rejects are compared field by field, in order.  Blocks are made small in some
tests so that many blocks, and the well-formed and the general path side by
side, are exercised on the small samples.
"""
import functools
import gzip
import json

import numpy as np
import pytest

from stream_ctr.connectors import decode
from stream_ctr.connectors.batch import Batch
from stream_ctr.connectors.decode import decode_lines
from stream_ctr.connectors.files import SAMPLE_PATHS
from stream_ctr.connectors.formats import AVAZU, CRITEO
from stream_ctr.connectors.kafka.decode import decode_messages
from tests.connectors import decode_reference as reference

CRITEO_BYTES = gzip.decompress(SAMPLE_PATHS["criteo"].read_bytes())
AVAZU_FILE = gzip.decompress(SAMPLE_PATHS["avazu"].read_bytes())
AVAZU_BYTES = AVAZU_FILE[AVAZU_FILE.index(b"\n") + 1:]
SAMPLES = {"criteo": (CRITEO, CRITEO_BYTES), "avazu": (AVAZU, AVAZU_BYTES)}
EXACT = ("labels", "keys", "event_time_ms", "partition", "offset")


@functools.lru_cache(maxsize=None)
def reference_lines(data: bytes, fmt, partition: str, first_offset: int):
    """The reference's (batch, rejects), once per input (tests decode it at several block sizes)."""
    return reference.decode_lines(data, fmt, partition, first_offset)


def assert_same_dense(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype == np.float32 and got.shape == want.shape
    assert (np.signbit(got) == np.signbit(want)).all() and ((got == 0) == (want == 0)).all()
    np.testing.assert_array_max_ulp(got, want, maxulp=1)


def assert_same_batch(got: Batch, want: Batch, columns=EXACT) -> None:
    for name in columns:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert a.tobytes() == b.tobytes(), name
    assert_same_dense(got.dense, want.dense)
    assert got.partitions == want.partitions


def assert_same(got, want) -> None:
    assert_same_batch(got[0], want[0])
    assert got[1] == want[1]                   # Rejected is a frozen dataclass: field by field


def assert_same_messages(got, want) -> None:
    assert_same_batch(got.batch, want.batch)
    assert got.rejected == want.rejected
    assert np.array_equal(got.rows_per_message, want.rows_per_message)
    assert np.array_equal(got.line_in_message, want.line_in_message)


@pytest.fixture(params=[decode.BLOCK_BYTES, 1500], ids=["blocks", "tiny-blocks"])
def block_rows(request, monkeypatch):
    """The real block size, and blocks of a few lines (many blocks, both paths)."""
    monkeypatch.setattr(decode, "BLOCK_BYTES", request.param)
    return request.param


def test_reference_keys_are_the_stable_keys():
    # tests/connectors/test_hashing.py's golden keys: the reference's hash is the product's spec.
    assert reference.token_key(13, b"68fd1e64") == 6394534319991127428
    assert reference.int_key(0, 2) == 6466938159527144685


@pytest.mark.parametrize("name", SAMPLES)
def test_real_samples_decode_like_the_reference(name, block_rows):
    fmt, data = SAMPLES[name]
    for variant in (data, data.replace(b"\n", b"\r\n"), data[:-1], data[:5000]):
        assert_same(decode_lines(variant, fmt, "file:x", 17), reference_lines(variant, fmt, "file:x", 17))


def _criteo_line(fields: dict[int, bytes]) -> bytes:
    row = CRITEO_BYTES.split(b"\n", 1)[0].split(b"\t")
    for i, v in fields.items():
        row[i] = v
    return b"\t".join(row)


CRITEO_ODD = [
    b"", b"\r", b"\t" * 38, b"\t" * 39, b"\t" * 40, b"0" + b"\t" * 39, b"1\t2", b"x\ty\r\n"[:-1],
    _criteo_line({0: b"2"}), _criteo_line({0: b""}), _criteo_line({0: b"01"}), _criteo_line({0: b"-1"}),
    _criteo_line({1: b"-"}), _criteo_line({1: b"+5"}), _criteo_line({1: b"1.5"}), _criteo_line({1: b" 7"}),
    _criteo_line({2: b"-1"}), _criteo_line({2: b"-12345678"}), _criteo_line({2: b"-123456789"}),
    _criteo_line({3: b"12345678"}), _criteo_line({3: b"123456789"}), _criteo_line({3: b"9" * 18}),
    _criteo_line({3: b"9" * 19}), _criteo_line({3: b"-" + b"9" * 18}), _criteo_line({3: b"0" * 30}),
    _criteo_line({4: b"-17"}), _criteo_line({4: b"-16"}), _criteo_line({4: b"-15"}), _criteo_line({4: b"2"}),
    _criteo_line({4: b"3"}), _criteo_line({4: b"16383"}), _criteo_line({4: b"16384"}),
    _criteo_line({4: b"4294967296"}), _criteo_line({4: b"-99999999999"}), _criteo_line({5: b"00"}),
    _criteo_line({5: b"12a"}), _criteo_line({5: b"-0"}), _criteo_line({13: b"\x80\xff"}),
    _criteo_line({14: b""}), _criteo_line({14: b"a-token-longer-than-eight-bytes"}),
    _criteo_line({39: b""}), _criteo_line({39: b"0123456789abcdefg"}), _criteo_line({20: b"a\rb"}),
    _criteo_line({39: b"tail\r"}), _criteo_line({0: b"x", 1: b"y"}), _criteo_line({6: b"1_000"}),
]

AVAZU_ODD = [
    b"", b"\r", b"," * 22, b"," * 23, b"," * 24, b"1,0,14102100", b"1,2,14102100" + b",x" * 21,
    b"1,,14102100" + b",x" * 21, b"1,1,1410210" + b",x" * 21, b"1,1,14102124" + b",x" * 21,
    b"1,1,16022900" + b",x" * 21, b"1,1,15022900" + b",x" * 21, b"1,1,-4102100" + b",x" * 21,
    b"1,1,14102100" + b"," * 21, b"1,1,14102100" + b",a-token-longer-than-eight-bytes" * 21,
    b"1,0,14102100" + b",x" * 20 + b",y\r", AVAZU_FILE[:AVAZU_FILE.index(b"\n")],   # the header
    b",1,00010100" + b",x" * 21, b"1,1,+4102100" + b",x" * 21, b"1,x,1410210x" + b",x" * 21,
]


def _inject(data: bytes, odd: list[bytes], every: int) -> bytes:
    lines = data.split(b"\n")[:-1]
    out = []
    for i, line in enumerate(lines):
        out.append(line)
        if i % every == 0:
            out.append(odd[(i // every) % len(odd)])
    return b"\n".join(out) + b"\n"


@pytest.mark.parametrize("name, odd", [("criteo", CRITEO_ODD), ("avazu", AVAZU_ODD)])
@pytest.mark.parametrize("every", [3, 50, 997])
def test_malformed_lines_give_the_reference_rows_and_rejects(name, odd, every, block_rows):
    fmt, data = SAMPLES[name]
    mixed = _inject(data, odd, every)
    got, want = decode_lines(mixed, fmt, "p", 1000), reference_lines(mixed, fmt, "p", 1000)
    assert_same(got, want)
    assert len(got[1]) > 0 and len(got[0]) > 0


@pytest.mark.parametrize("name, odd", [("criteo", CRITEO_ODD), ("avazu", AVAZU_ODD)])
def test_every_odd_line_alone(name, odd):
    fmt, _ = SAMPLES[name]
    for line in odd:
        for ending in (b"", b"\n", b"\r\n", b"\r\r\n"):     # only the last CR is the line ending's
            assert_same(decode_lines(line + ending, fmt, "p", 0), reference.decode_lines(line + ending, fmt, "p", 0))


def test_criteo_integer_values_around_the_key_table_and_beyond():
    """Every integer from -40 to 17000 (the product reads most keys from a table
    for [-16, 16384)) and large ones, in every integer column."""
    big = [2**31 - 1, 2**31, 2**32, 10**12 + 7, 10**17 - 1, 999_999_999_999_999_999, -10**17]
    values = list(range(-40, 17000)) + big + [-v for v in big]
    tokens = [str(v).encode() for v in values]
    lines = []
    for i in range(0, len(tokens), 7):
        ints = (tokens[i:i + 13] + [b""] * 13)[:13]      # overlapping runs: a value in ~2 columns
        lines.append(_criteo_line(dict(enumerate(ints, start=1))))
    data = b"\n".join(lines)
    assert_same(decode_lines(data, CRITEO, "p", 0), reference.decode_lines(data, CRITEO, "p", 0))


def test_avazu_hours_across_the_calendar():
    """YYMMDDHH over leap and common years, every month and day number, valid and not."""
    tail = b",x" * 21
    lines = [b"%d,1,%02d%02d%02d%02d%s" % (i, yy, mm, dd, hh, tail)
             for i, (yy, mm, dd, hh) in enumerate(
                 (yy, mm, dd, hh) for yy in (0, 4, 14, 15, 16, 99) for mm in range(14)
                 for dd in range(33) for hh in (0, 5, 23, 24))]
    data = b"\n".join(lines)
    got, want = decode_lines(data, AVAZU, "p", 0), reference.decode_lines(data, AVAZU, "p", 0)
    assert_same(got, want)
    assert len(got[0]) > 1000 and len(got[1]) > 1000


def _messages(fmt, data: bytes, sizes: list[int]) -> list[bytes]:
    """The lines of `data` packed into messages of the given sizes (cycled), with
    some trailing LFs, CRLFs, blank lines and empty messages mixed in."""
    lines, values, i, k = data.split(b"\n")[:-1], [], 0, 0
    while i < len(lines):
        n = sizes[k % len(sizes)]
        value = b"\n".join(lines[i:i + n])
        if k % 7 == 3:
            value += b"\n"
        if k % 11 == 5:
            value = value.replace(b"\n", b"\r\n", 1)
        if k % 13 == 6:
            value = b"\n" + value
        values.append(value)
        if k % 17 == 8:
            values.append(b"")
        i, k = i + n, k + 1
    return values


def _message_args(n: int, fmt, value_format="text"):
    return (np.array([i % 3 for i in range(n)], np.int32), np.arange(500, 500 + n),
            np.arange(n) * 10 + 7, ("t/0", "t/1", "t/2"), fmt, value_format)


@pytest.mark.parametrize("name", SAMPLES)
@pytest.mark.parametrize("sizes", [[1], [1000], [1, 5, 250, 2, 999]], ids=["one", "packed", "mixed"])
def test_decode_messages_equals_the_reference(name, sizes, block_rows):
    fmt, data = SAMPLES[name]
    odd = CRITEO_ODD if name == "criteo" else AVAZU_ODD
    values = _messages(fmt, _inject(data[:400_000], odd, 37), sizes)
    args = _message_args(len(values), fmt)
    assert_same_messages(decode_messages(values, *args), reference.decode_messages(values, *args))


def test_decode_messages_one_record_per_message_and_json():
    lines = CRITEO_BYTES.split(b"\n")[:300]
    objects = [json.dumps(dict(zip(CRITEO.field_names, line.decode().split("\t")))).encode()
               for line in lines]
    objects[5], objects[9] = b"{not json", b"[1]"
    objects[11], objects[12] = b'{"label": 1, "C1": "a\\nb"}', b'{"label": 1, "C1": "a\\tb"}'
    objects[14], objects[15] = b'{"label": true, "I1": 3}', b'{"I1": 3.5, "C1": null, "label": 0}'
    for values, value_format in ((lines, "text"), (objects, "json"), ([b""] * 3 + lines[:2], "text")):
        args = _message_args(len(values), CRITEO, value_format)
        assert_same_messages(decode_messages(values, *args), reference.decode_messages(values, *args))


def _one_line_messages(name: str) -> list[bytes]:
    fmt, data = SAMPLES[name]
    odd = [line for line in (CRITEO_ODD if name == "criteo" else AVAZU_ODD) if line]
    return _inject(data[:100_000], odd, 5).split(b"\n")[:-1]


# Regression (found by this reference): with one record per message, a rejected
# line's index was mapped through the array of good rows, so a bad record's
# Rejected named another message, or the call raised IndexError.
@pytest.mark.parametrize("name", SAMPLES)
def test_one_record_per_message_with_bad_records(name):
    values = _one_line_messages(name)
    args = _message_args(len(values), SAMPLES[name][0])
    assert_same_messages(decode_messages(values, *args), reference.decode_messages(values, *args))


# Regression: the fetch is parsed as one JSON array of the values joined by ",",
# so a value such as b'1, 2' parsed as several items and shifted every later
# message; a lone surrogate ("\ud800") raised UnicodeEncodeError for the whole
# fetch.  Each such message is one bad_json reject.
@pytest.mark.parametrize("bad", [b"1, 2", b'{"label": 1}, {"label": 0}', b'{"label": "\\ud800"}'])
def test_json_messages_that_are_not_one_object(bad):
    line = CRITEO_BYTES.split(b"\n", 1)[0]
    good = json.dumps(dict(zip(CRITEO.field_names, line.decode().split("\t")))).encode()
    values = [good, bad, good]
    args = _message_args(len(values), CRITEO, "json")
    assert_same_messages(decode_messages(values, *args), reference.decode_messages(values, *args))


def test_packed_kafka_messages_split_across_reads_equal_the_reference(kafka):
    """Through a broker: packed messages (with bad lines) read in pieces that cut
    messages in two give exactly the rows and rejects of the reference."""
    from tests.connectors.kafka.test_source import open_source
    fmt, data = SAMPLES["criteo"]
    lines = _inject(data[:600_000], CRITEO_ODD, 29).split(b"\n")[:-1]
    values = [b"\n".join(lines[i:i + 250]) for i in range(0, len(lines), 250)]
    topic = kafka.topic()
    kafka.produce(topic, values)
    n = len(values)
    want = reference.decode_messages(values, np.zeros(n, np.int32), np.arange(n), np.zeros(n, np.int64),
                                     (f"{topic}/0",), fmt)
    with open_source(kafka, topic, "g-ref") as source:
        rejected = []
        got = []
        while not source.exhausted:
            batch, bad = source.read(333)
            rejected += bad
            if len(batch):
                got.append(batch)
                source.trained(batch)
        positions = source.trained_positions.to_checkpoint()
    rows = Batch.concat(got)
    for name in ("labels", "keys", "offset"):
        assert getattr(rows, name).tobytes() == getattr(want.batch, name).tobytes(), name
    assert_same_dense(rows.dense, want.batch.dense)
    assert [(r.offset, r.reason, r.raw) for r in rejected] == [(r.offset, r.reason, r.raw) for r in want.rejected]
    assert positions == {f"{topic}/0": n}
