"""Typed positions round-trip through the checkpoint's flat dict, packed and given-up marks included."""
from stream_ctr.connectors.files import FilePosition
from stream_ctr.connectors.kafka.positions import GIVEN_UP, ROWS_DONE, KafkaPositions


def test_kafka_positions_round_trip_with_packed_and_given_up_partitions():
    stored = {"t/0": 120, "t/1": 77, "t/1" + ROWS_DONE: 3, "t/2": 5, "t/2" + GIVEN_UP: 1}
    typed = KafkaPositions.from_checkpoint(stored)
    assert typed.partitions == {"t/0": (120, 0), "t/1": (77, 3), "t/2": (5, 0)}
    assert typed.given_up == frozenset({"t/2"})
    assert typed.to_checkpoint() == stored
    assert typed.describe(most=2) == "offsets t/0 120, t/1 77 and 1 more partitions"
    assert KafkaPositions({}).describe() == "the group's committed offsets"


def test_a_file_position_is_its_next_line_and_nothing_at_a_pass_start():
    assert FilePosition("day_0.gz", 1500).to_checkpoint() == {"file:day_0.gz": 1500}
    assert FilePosition("day_0.gz", 0).to_checkpoint() == {}
    assert FilePosition.from_checkpoint({"file:day_0.gz": 1500, "t/0": 3}, "day_0.gz").line == 1500
    assert FilePosition.from_checkpoint({}, "day_0.gz") == FilePosition("day_0.gz", 0)


def test_a_file_fingerprint_goes_beside_the_positions_and_recognises_the_file(tmp_path):
    """The positions stay offsets only; the fingerprint is the file record's, read back
    only for a file of its name. A file that grew is the same; other first bytes, or
    fewer bytes of data, are not."""
    import gzip
    from stream_ctr.connectors.files import FORMATS, survey_file
    path = tmp_path / "day_0.tsv"
    path.write_bytes(b"1\t2\n" * 30_000)                  # 120,000 bytes: more than the head
    lines, damage, fp = survey_file(path, FORMATS["criteo"])
    assert (lines, damage, fp.head_bytes, fp.size) == (30_000, None, 64 << 10, 120_000)
    at = FilePosition("day_0.tsv", 1500, fp)
    assert at.to_checkpoint() == {"file:day_0.tsv": 1500}
    record = at.file_record()
    assert record["name"] == "day_0.tsv" and FilePosition.from_checkpoint(at.to_checkpoint(), "day_0.tsv",
                                                                          record) == at
    assert FilePosition.from_checkpoint({}, "day_1.tsv", record).fingerprint is None
    assert FilePosition.from_checkpoint({"file:day_0.tsv": 7}, "day_0.tsv", {"name": "day_0.tsv"}).fingerprint is None
    with open(path, "ab") as f:                             # grew: the same file
        f.write(b"3\t4\n")
    assert fp.changed_in(path, survey_file(path, FORMATS["criteo"])[2]) == ""
    path.write_bytes(b"1\t2\n" * 20_000)                  # the same head, cut short
    assert "truncated" in fp.changed_in(path, survey_file(path, FORMATS["criteo"])[2])
    path.write_bytes(b"9\t2\n" + b"1\t2\n" * 29_999)    # another first line
    assert fp.changed_in(path, survey_file(path, FORMATS["criteo"])[2]) == "its first 64 KiB differ"
    gz = tmp_path / "day_0.tsv.gz"                          # a gzip: its data, not its bytes
    gz.write_bytes(gzip.compress(b"1\t2\n" * 30_000, mtime=5))
    assert survey_file(gz, FORMATS["criteo"])[2] == fp


def test_typed_positions_write_exactly_the_old_flat_dict_and_read_it_back():
    from stream_ctr.connectors.kafka.positions import PartitionPosition
    typed = KafkaPositions({"t/1": PartitionPosition(77, 3), "t/0": PartitionPosition(120),
                            "u/2": PartitionPosition(5)}, frozenset({"u/2"}))
    stored = typed.to_checkpoint()
    assert stored == {"t/0": 120, "t/1": 77, "t/1#rows_done": 3, "u/2": 5, "u/2#given_up": 1}
    assert list(stored) == ["t/0", "t/1", "t/1#rows_done", "u/2", "u/2#given_up"]     # sorted, as written
    again = KafkaPositions.from_checkpoint(stored)
    assert again == typed
    assert again.partitions["t/1"].offset == 77 and again.partitions["t/1"].rows_done == 3
    assert again.owned() == {"t/0": (120, 0), "t/1": (77, 3)}
    assert again.given_up_partitions() == {"u/2": (5, 0)}


def test_an_old_checkpoints_positions_load_beside_a_files_and_round_trip_to_the_same_json():
    import json
    text = ('{"file:day_0.gz": 40, "clicks/0": 1500, "clicks/1": 12, "clicks/1#rows_done": 7, '
            '"clicks/2": 9, "clicks/2#given_up": 1}')
    stored = json.loads(text)
    typed = KafkaPositions.from_checkpoint(stored)
    assert typed.partitions == {"clicks/0": (1500, 0), "clicks/1": (12, 7), "clicks/2": (9, 0)}
    assert typed.given_up == frozenset({"clicks/2"})
    kafka_keys = {k: v for k, v in stored.items() if not k.startswith("file:")}
    assert json.dumps(typed.to_checkpoint(), sort_keys=True) == json.dumps(kafka_keys, sort_keys=True)
    assert FilePosition.from_checkpoint(stored, "day_0.gz").line == 40


def test_the_position_book_and_a_jobs_merge_keep_the_types():
    from pathlib import Path

    from stream_ctr.connectors.kafka.positions import PartitionPosition, PositionBook
    from stream_ctr.distributed.job_checkpoint import Job, merged_stream_positions
    book = PositionBook()
    book.own("t/0", (3, 0))
    book.own("t/1", (7, 2))
    book.release(["t/1"])
    positions = book.checkpoint_positions()
    assert isinstance(positions, KafkaPositions) and positions.given_up == frozenset({"t/1"})
    assert all(type(p) is PartitionPosition for p in positions.partitions.values())
    ranks = [{"positions": {"t/0": 3, "t/1": 7, "t/1#rows_done": 2, "t/1#given_up": 1}},
             {"positions": {"t/0": 2, "t/1": 7, "t/1#rows_done": 5}}]
    assert merged_stream_positions(Job(Path("."), {"ranks": ranks})) == {"t/0": 3, "t/1": 7, "t/1#rows_done": 5}
    assert KafkaPositions.furthest([KafkaPositions({"t/0": (4, 0)}), positions]).partitions == {
        "t/0": (4, 0), "t/1": (7, 2)}
