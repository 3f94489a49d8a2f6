"""Rotation of RUN_DIR/timeseries.jsonl and a report that reads the segments in bounded memory."""
from __future__ import annotations

import json
import os

import pytest

from stream_ctr.config import ConfigError, load_config, validate
from stream_ctr.telemetry.report import MAX_POINTS, find_run_dir, load_series, write_report
from stream_ctr.telemetry.timeseries import (TimeSeriesLog, history_path, read_timeseries, segment_paths,
                                             timeseries_files, timeseries_path)


class StepClock:
    """A clock the test advances: each interval is one second later."""

    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def open_log(path, clock, max_bytes, keep_segments=8, records_before=0) -> TimeSeriesLog:
    return TimeSeriesLog(path, every_s=1.0, records_before=records_before, clock=clock,
                         max_bytes=max_bytes, keep_segments=keep_segments)


def start(log: TimeSeriesLog, clock: StepClock, records_before: int = 0) -> None:
    """The start record, as `RunMonitor` writes it."""
    log.append({"kind": "start", "t": clock.t, "rank": 0, "model": "deepfm", "source": "criteo:x",
                "batch_size": 64, "records": records_before})


def write_intervals(log: TimeSeriesLog, clock: StepClock, n: int, batch: int = 100) -> None:
    """`n` interval records, `batch` more records trained in each."""
    for _ in range(n):
        clock.t += 1.0
        trained = log.last_records + batch
        lookups = trained * 26
        log.append_interval({"t": clock.t, "records": trained, "auc": 0.75, "logloss": 0.45,
                             "calibration": 1.01, "lag_records": 1000.0, "freshness_s": 2.5,
                             "tiers": {"device": {"lookups": lookups, "hits": lookups // 2, "rows": 500}},
                             "rejected": 0, "skipped_batches": 0})


def lines(path) -> list[str]:
    return path.read_text().splitlines()


def records_of(paths) -> list[int]:
    return [r["records"] for p in paths for r in read_timeseries(p) if r["kind"] == "interval"]


def test_rotation_happens_at_the_size_bound_and_keeps_at_most_n_segments(tmp_path):
    path, clock = timeseries_path(tmp_path), StepClock(1000.0)
    log = open_log(path, clock, max_bytes=2000, keep_segments=3)
    start(log, clock)
    write_intervals(log, clock, 200)
    log.close()
    segments = segment_paths(path)
    assert len(segments) == 3
    longest_line = max(len(line) + 1 for p in segments + [path] for line in lines(p))
    for p in segments:      # each renamed once it passed the bound, not before
        assert 2000 <= p.stat().st_size < 2000 + longest_line, p
    assert path.stat().st_size < 2000
    # the oldest were deleted: the kept numbers are the newest, and no line is missing between them
    numbers = [int(p.name.rsplit(".", 1)[1]) for p in segments]
    assert numbers[0] > 1 and numbers == list(range(numbers[0], numbers[0] + 3))
    kept = records_of(segments + [path])
    assert kept == list(range(kept[0], 200 * 100 + 1, 100))
    # every new file begins with the invocation's start record
    first_start = lines(segments[0])[0]
    for p in segments + [path]:
        assert lines(p)[0] == first_start
    assert json.loads(first_start)["kind"] == "start"


def test_deleted_segments_live_on_thinned_in_the_history(tmp_path):
    """A run far longer than the segments kept: the report's files still begin at the
    run's first interval (the history, read first), each line once and in time order,
    the history within max_bytes; the newest segments are whole."""
    path, clock = timeseries_path(tmp_path), StepClock(1000.0)
    log = open_log(path, clock, max_bytes=20_000, keep_segments=2)
    start(log, clock)
    write_intervals(log, clock, 3000)
    log.append({"kind": "checkpoint", "t": clock.t, "path": "ckpt", "records": 300_000})
    log.close()
    files = timeseries_files(tmp_path)[0]
    assert files[0].name == "timeseries.jsonl.0" and files[1:-1] == segment_paths(path)
    records = [r for p in files for r in read_timeseries(p)]
    times = [r["t"] for r in records if r["kind"] == "interval"]
    assert times[0] == 1001.0 and times[-1] == 4000.0
    assert times == sorted(set(times))                      # once each, in order
    assert 40 < len(times) < 3000                           # the old part thinned
    assert [r["kind"] for r in read_timeseries(files[0])][0] == "start"
    assert sum(r["kind"] == "start" and r["t"] == 1000.0 for r in read_timeseries(files[0])) == 1
    assert files[0].stat().st_size <= 20_000
    kept = records_of(segment_paths(path) + [path])         # the kept segments are whole
    assert kept == list(range(kept[0], 3000 * 100 + 1, 100))


def test_a_fold_repeated_after_a_crash_adds_nothing_twice(tmp_path):
    """A crash between the new history's rename and the segment's deletion folds the same
    segment again at the next rotation."""
    path, clock = timeseries_path(tmp_path), StepClock(1000.0)
    log = open_log(path, clock, max_bytes=2000, keep_segments=3)
    start(log, clock)
    write_intervals(log, clock, 60)
    oldest = segment_paths(path)[0]
    log._fold(oldest)
    once = history_path(path).read_text()
    log._fold(oldest)
    assert history_path(path).read_text() == once
    log.close()


def test_zero_max_bytes_never_rotates(tmp_path):
    path, clock = timeseries_path(tmp_path), StepClock(0.0)
    log = open_log(path, clock, max_bytes=0)
    write_intervals(log, clock, 100)
    log.close()
    assert segment_paths(path) == [] and len(lines(path)) == 100


def test_a_resumed_writer_appends_to_the_current_file_and_continues_the_numbering(tmp_path):
    path, clock = timeseries_path(tmp_path), StepClock(1000.0)
    log = open_log(path, clock, max_bytes=2000)
    start(log, clock)
    write_intervals(log, clock, 20)
    log.close()
    before_segments = segment_paths(path)
    before_current = lines(path)
    assert len(before_segments) >= 1 and len(before_current) >= 2

    clock.t += 60.0
    resumed = open_log(path, clock, max_bytes=2000, records_before=2000)
    start(resumed, clock, records_before=2000)
    write_intervals(resumed, clock, 1)
    # the resumed invocation continues the file it found, after the last line
    assert lines(path)[:len(before_current)] == before_current
    assert json.loads(lines(path)[len(before_current)])["t"] == clock.t - 1.0
    write_intervals(resumed, clock, 20)
    resumed.close()
    after = segment_paths(path)
    assert after[:len(before_segments)] == before_segments
    last_number = int(before_segments[-1].name.rsplit(".", 1)[1])
    assert int(after[len(before_segments)].name.rsplit(".", 1)[1]) == last_number + 1
    # the file started after the resume carries the resumed invocation's start, not the first one's
    carried = json.loads(lines(after[-1])[0])
    assert carried["kind"] == "start" and carried["records"] == 2000
    (series,) = load_series(tmp_path)
    assert [s["records"] for s in series.starts] == [0, 2000]
    assert series.column("records") == [100 * i for i in range(1, 21)] + [2000 + 100 * i for i in range(1, 22)]


def test_a_writer_resumed_into_a_full_file_rotates_it_first(tmp_path):
    """E.g. a run resumed with a smaller metrics.timeseries_max_bytes."""
    path, clock = timeseries_path(tmp_path), StepClock(1000.0)
    log = open_log(path, clock, max_bytes=0)
    start(log, clock)
    write_intervals(log, clock, 30)
    log.close()
    old = path.read_text()
    resumed = open_log(path, clock, max_bytes=2000)
    start(resumed, clock, records_before=3000)
    resumed.close()
    assert [p.name for p in segment_paths(path)] == ["timeseries.jsonl.1"]
    assert segment_paths(path)[0].read_text() == old
    assert [json.loads(line)["records"] for line in lines(path)] == [3000]


def test_a_crash_after_the_rename_and_a_torn_line_lose_nothing(tmp_path):
    path, clock = timeseries_path(tmp_path), StepClock(1000.0)
    log = open_log(path, clock, max_bytes=2000)
    start(log, clock)
    write_intervals(log, clock, 20)
    log.close()
    # a crash mid-write leaves half a line; one mid-rotation leaves no current file
    with open(path, "a") as f:
        f.write('{"kind":"interval","t":99')
    number = int(segment_paths(path)[-1].name.rsplit(".", 1)[1]) + 1
    os.rename(path, path.with_name(f"{path.name}.{number}"))
    assert not path.exists() and find_run_dir(tmp_path) == tmp_path
    (series,) = load_series(tmp_path)
    assert series.intervals_read == 20 and series.end is None

    resumed = open_log(path, clock, max_bytes=2000, records_before=2000)
    start(resumed, clock, records_before=2000)
    write_intervals(resumed, clock, 20)
    resumed.close()
    numbers = [int(p.name.rsplit(".", 1)[1]) for p in segment_paths(path)]
    assert number in numbers and numbers[-1] > number       # the resumed writer numbers after it
    (series,) = load_series(tmp_path)
    assert len(series.starts) == 2
    assert series.column("records")[-1] == 4000 and series.intervals_read == 40


def test_a_torn_current_file_gets_its_line_ended_before_the_resumed_start(tmp_path):
    path, clock = timeseries_path(tmp_path), StepClock(1000.0)
    path.write_text('{"kind":"start","t":1,"records":0}\n{"kind":"interval","t":2,"rec')
    resumed = open_log(path, clock, max_bytes=0)
    start(resumed, clock, records_before=0)
    resumed.close()
    assert [r["kind"] for r in read_timeseries(path)] == ["start", "start"]


def test_ranks_above_zero_rotate_their_own_files(tmp_path):
    clock0, clock1 = StepClock(1000.0), StepClock(1000.0)
    rank0 = open_log(timeseries_path(tmp_path, 0), clock0, max_bytes=2000, keep_segments=2)
    rank1 = open_log(timeseries_path(tmp_path, 1), clock1, max_bytes=2000, keep_segments=2)
    start(rank0, clock0)
    start(rank1, clock1)
    write_intervals(rank0, clock0, 30)
    write_intervals(rank1, clock1, 60)
    rank0.close()
    rank1.close()
    files = timeseries_files(tmp_path)
    assert sorted(files) == [0, 1]
    # rank 1 deleted a segment: its history comes first
    assert [p.name.split(".")[0] for p in files[1]] == ["timeseries-rank1"] * 4
    assert files[1][0].name == "timeseries-rank1.jsonl.0"
    assert len(files[0]) == 4 and files[0][-1].name == "timeseries.jsonl"
    assert files[1][-1].name == "timeseries-rank1.jsonl"
    series = load_series(tmp_path)
    assert [s.rank for s in series] == [0, 1]
    assert series[0].last["records"] == 3000 and series[1].last["records"] == 6000


def write_two_invocations(run_dir, max_bytes: int) -> None:
    """The same records each time: an invocation that ends, then a resumed one that ends."""
    clock = StepClock(5000.0)
    log = open_log(timeseries_path(run_dir), clock, max_bytes=max_bytes, keep_segments=1000)
    start(log, clock)
    write_intervals(log, clock, 120)
    log.append({"kind": "end", "t": clock.t, "records_trained": 12000, "records_trained_total": 12000})
    log.close()
    clock.t += 30.0
    log = open_log(timeseries_path(run_dir), clock, max_bytes=max_bytes, keep_segments=1000,
                   records_before=12000)
    start(log, clock, records_before=12000)
    write_intervals(log, clock, 80)
    log.append({"kind": "end", "t": clock.t, "records_trained": 8000, "records_trained_total": 20000})
    log.close()


def test_report_over_segments_matches_the_report_over_one_file(tmp_path):
    one, rotated = tmp_path / "one" / "run", tmp_path / "rotated" / "run"
    write_two_invocations(one, max_bytes=0)
    write_two_invocations(rotated, max_bytes=2000)
    assert segment_paths(timeseries_path(one)) == []
    assert len(segment_paths(timeseries_path(rotated))) > 10
    (a,), (b,) = load_series(one), load_series(rotated)
    assert a.starts == b.starts and len(a.starts) == 2
    assert a.end == b.end and a.end["records_trained_total"] == 20000
    assert a.intervals == b.intervals and len(a.intervals) == 200
    ra, rb = write_report(one), write_report(rotated)
    assert ra.records == rb.records == 20000
    assert ra.html.read_text().replace(str(one), "RUN") == rb.html.read_text().replace(str(rotated), "RUN")


def write_long_run(run_dir, n: int, per_file: int) -> None:
    """`n` interval lines, as the writer formats them, in segments of `per_file` lines
    (``timeseries.jsonl.1`` ...) and the current file."""
    path = timeseries_path(run_dir)
    head = {"kind": "start", "t": 0, "rank": 0, "model": "deepfm", "source": "kafka://b:9092/t",
            "batch_size": 4096, "records": 0}
    out = [json.dumps(head, separators=(",", ":"))]
    for i in range(1, n + 1):
        out.append(f'{{"kind":"interval","t":{i},"records":{10 * i},"samples_per_s":10.0,"auc":0.75,'
                   f'"logloss":0.45,"calibration":1.01,"lag_records":{i % 977}.0,"freshness_s":2.5,'
                   f'"hit_ratio":{{"device":0.5}},"rows":{{"device":500}},"rejected":0,"skipped_batches":0}}')
    out.append(json.dumps({"kind": "end", "t": n, "records_trained": 10 * n, "records_trained_total": 10 * n}))
    chunks = [out[i:i + per_file] for i in range(0, len(out), per_file)]
    for number, chunk in enumerate(chunks[:-1], start=1):
        path.with_name(f"{path.name}.{number}").write_text("\n".join(chunk) + "\n")
    path.write_text("\n".join(chunks[-1]) + "\n")


def test_report_on_a_long_series_keeps_a_bounded_evenly_spaced_sample(tmp_path):
    """200k intervals (about 55 hours at 1 s) in five files: the report keeps at most MAX_POINTS."""
    n = 200_000
    write_long_run(tmp_path, n, per_file=50_000)
    assert len(segment_paths(timeseries_path(tmp_path))) == 4

    (series,) = load_series(tmp_path)
    assert series.intervals_read == n
    assert MAX_POINTS // 2 <= len(series.intervals) <= MAX_POINTS + 1
    on_stride = series.column("records")[:-1]         # the last is appended whatever its number
    steps = {b - a for a, b in zip(on_stride, on_stride[1:])}
    assert steps == {10 * series.stride}            # evenly spaced ...
    assert series.intervals[0]["records"] == 10 and series.intervals[-1]["records"] == 10 * n   # ... end to end
    assert series.tiers == {"device"} and series.end["records_trained_total"] == 10 * n

    out = write_report(tmp_path)
    assert out.records == 10 * n
    assert "2,000,000" in out.html.read_text()


@pytest.mark.parametrize("option, bad", [("timeseries_max_bytes", "-1"), ("timeseries_max_bytes", "1000"),
                                         ("timeseries_keep_segments", "0"),
                                         ("timeseries_keep_segments", "-3")])
def test_rotation_options_are_validated(option, bad):
    cfg = load_config(None, [f"metrics.{option}={bad}"])
    with pytest.raises(ConfigError, match=f"metrics.{option} must be"):
        validate(cfg)


def test_rotation_options_parse_byte_sizes():
    cfg = validate(load_config(None, ["metrics.timeseries_max_bytes=16MiB",
                                      "metrics.timeseries_keep_segments=4"]))
    assert cfg.metrics.timeseries_max_bytes == 16 << 20 and cfg.metrics.timeseries_keep_segments == 4
    assert validate(load_config(None, ["metrics.timeseries_max_bytes=0"])).metrics.timeseries_max_bytes == 0
    with pytest.raises(ConfigError, match="metrics.timeseries_max_bytes"):
        load_config(None, ["metrics.timeseries_max_bytes=64XB"])


def test_the_run_monitor_rotates_with_the_configured_knobs(tmp_path):
    """The trainer's writer (RunMonitor) uses metrics.timeseries_max_bytes / _keep_segments."""
    from prometheus_client import CollectorRegistry
    from stream_ctr.telemetry.monitor import RunMonitor
    cfg = validate(load_config(None, ["metrics.port=0", "metrics.timeseries_every_s=1",
                                      "metrics.timeseries_max_bytes=64KiB",
                                      "metrics.timeseries_keep_segments=2"]))
    monitor = RunMonitor(cfg, tmp_path / "run", registry=CollectorRegistry())
    series = monitor.series
    assert series.max_bytes == 64 << 10 and series.keep_segments == 2
    for i in range(2000):            # ~500 KB of intervals: several rotations
        series.append({"kind": "interval", "t": 1000.0 + i, "records": i, "pad": "x" * 200})
    series.close()
    assert len(segment_paths(tmp_path / "run" / "timeseries.jsonl")) == 2
