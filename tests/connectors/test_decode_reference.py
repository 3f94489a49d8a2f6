"""The fast decoder equals the one it replaced (tests/connectors/decode_reference.py) bit for bit.

Batch columns are compared as raw bytes (so -0.0 vs +0.0 or a NaN payload
would show), rejects by partition, offset, reason and raw bytes.  Blocks are
made small in some tests so that many blocks, and the well-formed and the
general path side by side, are exercised on the small samples.
"""
import gzip
import json

import numpy as np
import pytest

from connectors import decode
from connectors.batch import Batch
from connectors.decode import decode_lines
from connectors.files import SAMPLE_PATHS
from connectors.formats import AVAZU, CRITEO
from connectors.kafka_decode import decode_messages
from tests.connectors import decode_reference as reference

CRITEO_BYTES = gzip.decompress(SAMPLE_PATHS["criteo"].read_bytes())
AVAZU_FILE = gzip.decompress(SAMPLE_PATHS["avazu"].read_bytes())
AVAZU_BYTES = AVAZU_FILE[AVAZU_FILE.index(b"\n") + 1:]
SAMPLES = {"criteo": (CRITEO, CRITEO_BYTES), "avazu": (AVAZU, AVAZU_BYTES)}
COLUMNS = ("labels", "dense", "keys", "event_time_ms", "partition", "offset")


def assert_same_batch(got: Batch, want: Batch) -> None:
    for name in COLUMNS:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert a.tobytes() == b.tobytes(), name
    assert got.partitions == want.partitions


def assert_same(got, want) -> None:
    assert_same_batch(got[0], want[0])
    assert got[1] == want[1]                   # Rejected is a frozen dataclass: field by field


@pytest.fixture(params=[decode.BLOCK_BYTES, 1500], ids=["blocks", "tiny-blocks"])
def block_rows(request, monkeypatch):
    """The real block size, and blocks of a few lines (many blocks, both paths)."""
    monkeypatch.setattr(decode, "BLOCK_BYTES", request.param)
    return request.param


@pytest.mark.parametrize("name", SAMPLES)
def test_real_samples_decode_bit_identically(name, block_rows):
    fmt, data = SAMPLES[name]
    for variant in (data, data.replace(b"\n", b"\r\n"), data[:-1], data[:5000]):
        assert_same(decode_lines(variant, fmt, "file:x", 17), reference.decode_lines(variant, fmt, "file:x", 17))


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
    _criteo_line({39: b"tail\r"}),
]

AVAZU_ODD = [
    b"", b"\r", b"," * 22, b"," * 23, b"," * 24, b"1,0,14102100", b"1,2,14102100" + b",x" * 21,
    b"1,,14102100" + b",x" * 21, b"1,1,1410210" + b",x" * 21, b"1,1,14102124" + b",x" * 21,
    b"1,1,16022900" + b",x" * 21, b"1,1,15022900" + b",x" * 21, b"1,1,-4102100" + b",x" * 21,
    b"1,1,14102100" + b"," * 21, b"1,1,14102100" + b",a-token-longer-than-eight-bytes" * 21,
    b"1,0,14102100" + b",x" * 20 + b",y\r",
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
def test_malformed_lines_give_the_same_rows_and_rejects(name, odd, every, block_rows):
    fmt, data = SAMPLES[name]
    mixed = _inject(data, odd, every)
    got, want = decode_lines(mixed, fmt, "p", 1000), reference.decode_lines(mixed, fmt, "p", 1000)
    assert_same(got, want)
    assert len(got[1]) > 0 and len(got[0]) > 0


@pytest.mark.parametrize("name, odd", [("criteo", CRITEO_ODD), ("avazu", AVAZU_ODD)])
def test_every_odd_line_alone(name, odd):
    fmt, _ = SAMPLES[name]
    for line in odd:
        for ending in (b"", b"\n", b"\r\n", b"\r\r\n"):     # only the last CR is the line ending's
            assert_same(decode_lines(line + ending, fmt, "p", 0), reference.decode_lines(line + ending, fmt, "p", 0))


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


@pytest.mark.parametrize("name", SAMPLES)
@pytest.mark.parametrize("sizes", [[1], [1000], [1, 5, 250, 2, 999]], ids=["one", "packed", "mixed"])
def test_decode_messages_equals_the_old_one(name, sizes, block_rows):
    fmt, data = SAMPLES[name]
    odd = CRITEO_ODD if name == "criteo" else AVAZU_ODD
    values = _messages(fmt, _inject(data[:400_000], odd, 37), sizes)
    n = len(values)
    args = (np.array([i % 3 for i in range(n)], np.int32), np.arange(500, 500 + n),
            np.arange(n) * 10 + 7, ("t/0", "t/1", "t/2"), fmt)
    got, want = decode_messages(values, *args), reference.decode_messages(values, *args)
    assert_same_batch(got.batch, want.batch)
    assert got.rejected == want.rejected
    assert np.array_equal(got.rows_per_message, want.rows_per_message)
    assert np.array_equal(got.line_in_message, want.line_in_message)


def test_decode_messages_one_record_per_message_and_json():
    lines = CRITEO_BYTES.split(b"\n")[:300]
    objects = [json.dumps(dict(zip(CRITEO.field_names, line.decode().split("\t")))).encode()
               for line in lines]
    objects[5], objects[9] = b"{not json", b"[1]"
    for values, value_format in ((lines, "text"), (objects, "json"), ([b""] * 3 + lines[:2], "text")):
        n = len(values)
        args = (np.zeros(n, np.int32), np.arange(n), np.full(n, 99), ("t/0",), CRITEO, value_format)
        got, want = decode_messages(values, *args), reference.decode_messages(values, *args)
        assert_same_batch(got.batch, want.batch)
        assert got.rejected == want.rejected
        assert np.array_equal(got.rows_per_message, want.rows_per_message)
        assert np.array_equal(got.line_in_message, want.line_in_message)


def test_packed_kafka_messages_split_across_reads_equal_the_reference(kafka):
    """Through a broker: packed messages (with bad lines) read in pieces that cut
    messages in two give exactly the rows and rejects of the old decoder."""
    from tests.connectors.test_kafka_source import open_source
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
        positions = source.trained_positions
    rows = Batch.concat(got)
    for name in ("labels", "dense", "keys", "offset"):
        assert getattr(rows, name).tobytes() == getattr(want.batch, name).tobytes(), name
    assert [(r.offset, r.reason, r.raw) for r in rejected] == [(r.offset, r.reason, r.raw) for r in want.rejected]
    assert positions == {f"{topic}/0": n}
