"""The live progress line: records, rate, and with a known total the share done and the time left."""
import io

from stream_ctr.telemetry.progress import Progress, _duration


def test_a_known_total_shows_the_share_done_and_the_time_left():
    out = io.StringIO()                     # not a terminal: one line per update
    p = Progress("train", 0.0, stream=out, total=1000)
    p.start -= 10.0                         # 10 s in
    p.update(250, 4, 0.71, 0.45, force=True)
    line = out.getvalue()
    assert line.startswith("train: 250 of 1,000 records (25%, 30 s left) | 25 rec/s | 4 batches | AUC 0.7100")


def test_without_a_total_the_line_has_no_estimate():
    out = io.StringIO()
    Progress("train", 0.0, stream=out).update(250, 4, float("nan"), 0.45, force=True)
    assert out.getvalue().startswith("train: 250 records | ") and "left" not in out.getvalue()
    assert "AUC -" in out.getvalue()


def test_durations_read_as_a_person_writes_them():
    assert [_duration(s) for s in (42.4, 185, 7620)] == ["42 s", "3 min 05 s", "2 h 07 min"]
