"""A trainer restarted after a kill waits for the group to drop its previous member, and says so.

Found on 0.13.0: a restart sat ~30 s (the old member's session timeout) before
its first batch, without a word.  Measured on tansu (kafka.session_timeout_ms =
10 s): a first join 5.3 s (tansu admits a member after half the session
timeout), a restart after a clean stop 5.3 s (the stopped trainer left the
group), a restart after SIGKILL 18 s.
"""
import json
import signal

from stream_ctr.connectors.kafka.replay import replay_file
from stream_ctr.train.checkpoint import load_checkpoint
from tests.stream_ctr.train.test_kafka_faults import train_args, trainer

# Long enough that the killed member outlives the restart's start-up.
SESSION = ["--set", "kafka.session_timeout_ms=12000", "--set", "kafka.dead_letter_topic="]


def test_a_restart_after_a_kill_says_it_waits_for_the_old_member(kafka, tmp_path):
    topic = kafka.topic()
    replay_file("criteo:sample", kafka.url(topic), limit=1280)
    url, run_dir = kafka.url(topic, "rejoin"), tmp_path / "run"
    first = trainer("step", 6, "-", train_args(url, run_dir, "--checkpoint-every", "3", *SESSION))
    _, err = first.communicate(timeout=90)
    assert first.returncode == -signal.SIGKILL, err[-3000:]
    before = load_checkpoint(run_dir).records_trained
    assert before > 0

    again = trainer("none", 0, "-", train_args(url, run_dir, "--resume", str(run_dir), "--stop-when-idle", "3",
                                               *SESSION))
    out, err = again.communicate(timeout=120)
    assert again.returncode == 0, err[-3000:]
    notices = [line for line in err.splitlines() if "waiting for group" in line]
    assert len(notices) == 1, err[-3000:]
    assert f"'rejoin-{topic}'" in notices[0] and "kafka.session_timeout_ms (12 s" in notices[0], notices
    assert "SIGTERM" in notices[0]
    assert json.loads(out.strip().splitlines()[-1])["records_trained_total"] == 1280
