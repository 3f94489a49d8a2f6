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
