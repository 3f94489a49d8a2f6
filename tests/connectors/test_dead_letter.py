"""Dead-letter JSON lines: content, counts, appends, undecodable bytes."""
import base64
import json

from stream_ctr.connectors.batch import Rejected
from stream_ctr.connectors.dead_letter import DeadLetterFile


def test_dead_letter_writes_json_lines_and_counts(tmp_path):
    path = tmp_path / "a" / "b" / "dead.jsonl"
    with DeadLetterFile(path) as dead:
        dead.write([Rejected("file:x.tsv", 0, "bad_label", b"x\t1"),
                    Rejected("file:x.tsv", 41, "field_count", b"\xff\xfeabc")])
        dead.write([])
        assert json.loads(path.read_text().splitlines()[0])["line"] == 1     # flushed
        dead.write([Rejected("file:x.tsv", 50, "field_count", b"")])
        assert dead.counts == {"bad_label": 1, "field_count": 2} and dead.total == 3
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert records[0] == {"partition": "file:x.tsv", "offset": 0, "line": 1,
                          "reason": "bad_label", "raw": "x\t1"}
    assert records[1]["line"] == 42 and records[1]["raw"] == "\ufffd\ufffdabc"
    assert base64.b64decode(records[1]["raw_b64"]) == b"\xff\xfeabc"     # replayable byte for byte
    assert "raw_b64" not in records[0]
    with DeadLetterFile(path) as again:                     # appends, never truncates
        again.write([Rejected("p", 1, "bad_time", b"1")])
    assert len(path.read_text().splitlines()) == 4


def test_raw_fields_cut_a_record_without_calling_it_not_utf8():
    from stream_ctr.connectors.dead_letter import raw_fields
    valid = b"a" * 9 + "\u00e9".encode()                  # the cut at 10 splits the e-acute
    assert raw_fields(valid, 10) == {"raw": "a" * 9}
    assert raw_fields(valid) == {"raw": "a" * 9 + "\u00e9"}
    bad = b"caf\xe9 au lait"
    cut = raw_fields(bad, 5)
    assert cut["raw"] == "caf\ufffd " and base64.b64decode(cut["raw_b64"]) == bad[:5]
