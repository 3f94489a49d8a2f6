"""`stream-ctr bench decode`: a row per layout and decoder, with a positive rate."""
import json

from stream_ctr.cli import main


def test_bench_decode_measures_every_layout(capsys):
    assert main(["bench", "decode", "--records", "3000", "--chunk", "1000", "--repeats", "1",
                 "--json", "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    layouts = {(r["layout"], r["decoder"].split(",")[0]) for r in out["rows"]}
    assert {("criteo", "fast path"), ("criteo", "schema (built-in)"), ("avazu", "fast path"),
            ("json ad log", "schema")} <= layouts
    assert any(r["decoder"] == "schema, compiled scan" for r in out["rows"])
    assert all(r["records"] == 3000 and r["records_per_s"] > 0 for r in out["rows"])
