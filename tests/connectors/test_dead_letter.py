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


def test_a_huge_bad_line_is_stored_capped_with_its_size_and_hash(tmp_path):
    """A 5 MB bad line under a 4 KiB cap: its first 4 KiB, and the whole line's size and
    SHA-256, so it can be found in its source and checked; the file does not copy it whole."""
    import hashlib
    raw = b"0\t" + b"7" * 5_000_000
    path = tmp_path / "dead.jsonl"
    with DeadLetterFile(path, max_raw_bytes=4096) as dead:
        dead.write([Rejected("file:x.tsv", 3, "field_count", raw, "d" * 10_000),
                    Rejected("file:x.tsv", 4, "bad_label", b"x\t1")])
    assert path.stat().st_size < 20_000
    big, small = (json.loads(line) for line in path.read_text().splitlines())
    assert big["raw"] == raw[:4096].decode() and big["raw_truncated"] is True
    assert big["raw_bytes"] == len(raw) and big["raw_sha256"] == hashlib.sha256(raw).hexdigest()
    assert len(big["detail"]) == 1024
    assert small == {"partition": "file:x.tsv", "offset": 4, "line": 5, "reason": "bad_label", "raw": "x\t1"}


def rejects(partition: str, offsets: list[int], reason: str = "field_count") -> list[Rejected]:
    return [Rejected(partition, o, reason, f"bad {o}".encode()) for o in offsets]


def stored(path) -> list[tuple[str, int, int]]:
    out = []
    for line in path.read_text().splitlines():
        d = json.loads(line)
        out.append((d["partition"], d["offset"], d.get("epoch", 0)))
    return out


def test_a_resumed_run_writes_no_record_twice(tmp_path):
    """The life of a file run: rejects written ahead of the checkpoint (read ahead of
    training), a checkpoint, more rejects, a kill; the resumed run reads everything
    after the checkpoint's position again and rejects the same records again."""
    from stream_ctr.connectors.dead_letter import DeadLetterMark, ExactlyOnceDeadLetter
    path, p = tmp_path / "dead.jsonl", "file:day.tsv"
    first = ExactlyOnceDeadLetter(DeadLetterFile(path))
    first.write(rejects(p, [3, 9]))
    first.write(rejects(p, [14, 17]))                 # ahead of the checkpoint at line 12
    mark = DeadLetterMark.from_dict(first.mark({p: 12}, 0).as_dict())    # through the checkpoint's JSON
    assert sorted(mark.ahead) == [(p, 14, 0), (p, 17, 0)]
    first.write(rejects(p, [21, 30]))                 # after the checkpoint, then killed
    first.sink._file.flush()                          # (what a kill leaves: no close)
    second = ExactlyOnceDeadLetter(DeadLetterFile(path), mark)
    second.write(rejects(p, [14, 17, 21]))            # read again from line 12
    second.write(rejects(p, [30, 33]))
    assert second.already == 4 and second.total == 5
    mark2 = second.mark({p: 25}, 0)
    second.close()
    third = ExactlyOnceDeadLetter(DeadLetterFile(path), mark2)     # killed again, resumed at 25
    third.write(rejects(p, [30, 33, 40]))
    third.close()
    assert sorted(stored(path)) == [(p, o, 0) for o in (3, 9, 14, 17, 21, 30, 33, 40)]


def test_a_line_torn_by_a_kill_is_cut_and_written_again(tmp_path):
    from stream_ctr.connectors.dead_letter import ExactlyOnceDeadLetter
    path, p = tmp_path / "dead.jsonl", "file:day.tsv"
    first = ExactlyOnceDeadLetter(DeadLetterFile(path))
    first.write(rejects(p, [1]))
    mark = first.mark({p: 2}, 0)
    first.write(rejects(p, [5]))
    first.close()
    with open(path, "ab") as f:                       # a kill in the middle of a write
        f.write(b'{"partition": "file:day.tsv", "offset": 8, "li')
    second = ExactlyOnceDeadLetter(DeadLetterFile(path), mark)
    second.write(rejects(p, [5, 8]))
    second.close()
    assert stored(path) == [(p, 1, 0), (p, 5, 0), (p, 8, 0)]


def test_each_pass_over_a_file_dead_letters_its_bad_lines_once(tmp_path):
    """Epochs: the second pass rejects the same lines again, and stores them once more
    (marked with the pass); a kill in the second pass, resumed from a checkpoint of the
    first, rewrites neither pass's lines."""
    from stream_ctr.connectors.dead_letter import ExactlyOnceDeadLetter
    path, p = tmp_path / "dead.jsonl", "file:day.tsv"
    first = ExactlyOnceDeadLetter(DeadLetterFile(path))
    first.write(rejects(p, [2, 6]))
    mark = first.mark({p: 4}, 0)                     # in pass 0, at line 4
    first.epoch = 1                                  # pass 0 ended, pass 1 began: no checkpoint yet
    first.write(rejects(p, [2]))
    first.close()
    second = ExactlyOnceDeadLetter(DeadLetterFile(path), mark, epoch=0)
    second.write(rejects(p, [6]))                    # the rest of pass 0
    second.epoch = 1
    second.write(rejects(p, [2, 6]))                 # pass 1
    second.close()
    assert sorted(stored(path)) == [(p, 2, 0), (p, 2, 1), (p, 6, 0), (p, 6, 1)]


def test_resume_points_of_kafka_positions():
    """A position inside a packed message (#rows_done) resumes without that message's
    rejects (its source skips them); a given-up partition counts where it was left."""
    from stream_ctr.connectors.dead_letter import resume_points
    positions = {"t/0": 40, "t/1": 7, "t/1#rows_done": 3, "t/2": 9, "t/2#given_up": 1, "file:x.tsv": 5}
    assert resume_points(positions) == {"t/0": 40, "t/1": 8, "t/2": 9, "file:x.tsv": 5}


def test_a_run_killed_before_its_first_checkpoint_starts_at_its_start_mark(tmp_path):
    from stream_ctr.connectors.dead_letter import ExactlyOnceDeadLetter, start_mark
    path, p = tmp_path / "dead.jsonl", "file:day.tsv"
    with DeadLetterFile(path) as earlier:            # another run's letters, before this one started
        earlier.write(rejects(p, [1]))
    sink = DeadLetterFile(path)
    first = ExactlyOnceDeadLetter(sink, start_mark(tmp_path / "run", sink))
    first.write(rejects(p, [3, 4]))
    first.close()                                    # killed: no checkpoint
    sink = DeadLetterFile(path)
    second = ExactlyOnceDeadLetter(sink, start_mark(tmp_path / "run", sink))
    second.write(rejects(p, [1, 3, 4, 7]))
    second.close()
    assert stored(path) == [(p, o, 0) for o in (1, 3, 4, 1, 7)]     # the second 1 is this run's own


def test_a_re_read_in_the_same_process_writes_nothing_twice(tmp_path):
    """A rebalance hands a partition back at its trained position: the records read after
    it come again. The lines of a packed message share its offset: two bad lines in one
    message are two entries, and a re-read of the message adds none."""
    from stream_ctr.connectors.dead_letter import ExactlyOnceDeadLetter
    path = tmp_path / "dead.jsonl"
    with ExactlyOnceDeadLetter(DeadLetterFile(path)) as dead:
        dead.write(rejects("t/0", [5, 7, 7]))
        dead.write(rejects("t/0", [5, 7, 7, 9]))          # read again from offset 5, and one more
        dead.write(rejects("t/0", [7, 7]))
        assert dead.already == 5 and dead.total == 9
        assert sorted(dead.mark({"t/0": 7}, 0).ahead) == [("t/0", 7, 0), ("t/0", 7, 0), ("t/0", 9, 0)]
    assert stored(path) == [("t/0", 5, 0), ("t/0", 7, 0), ("t/0", 7, 0), ("t/0", 9, 0)]
