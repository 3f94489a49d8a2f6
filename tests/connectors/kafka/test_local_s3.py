"""The durable broker's storage server (s3rver on 127.0.0.1): listings past 1,000 objects,
and a PUT cut short by a killed client.

A tansu partition on s3:// storage is one object per produced batch; past
1,000 of them every listing pages with a continuation token, which s3rver
3.7.1 signs with DES: refused by Node 17+ unless the legacy OpenSSL provider
is on (it used to answer 500, and the broker then served nothing).
"""
from __future__ import annotations

import socket
import time
import urllib.request

from stream_ctr.connectors.kafka.local_s3 import BUCKET, LocalS3


def test_listing_pages_past_a_thousand_objects(tmp_path):
    with LocalS3(tmp_path / "data") as s3:
        for i in range(1001):
            put = urllib.request.Request(f"{s3.endpoint}/{BUCKET}/p/{i:06d}", data=b"x", method="PUT")
            urllib.request.urlopen(put, timeout=10).read()
        with urllib.request.urlopen(f"{s3.endpoint}/{BUCKET}?list-type=2&prefix=p%2F", timeout=10) as answer:
            assert answer.status == 200
            body = answer.read()
        assert b"<KeyCount>1000</KeyCount>" in body and b"<NextContinuationToken>" in body


def _get(s3: LocalS3, key: str) -> bytes:
    with urllib.request.urlopen(f"{s3.endpoint}/{BUCKET}/{key}", timeout=10) as answer:
        return answer.read()


def test_a_put_cut_short_keeps_the_previous_object(tmp_path):
    """The chaos harness SIGKILLs the broker; a metadata object it was writing was left
    truncated by s3rver's in-place write, and the broker's next start never served."""
    with LocalS3(tmp_path / "data") as s3:
        old = b'{"generation": 1, "leaders": [0, 0, 0]}'
        urllib.request.urlopen(urllib.request.Request(
            f"{s3.endpoint}/{BUCKET}/meta.json", data=old, method="PUT"), timeout=10).read()
        new = b'{"generation": 2, "leaders": [0, 0, 0]}'
        with socket.create_connection(("127.0.0.1", s3.port), timeout=10) as client:
            client.sendall(f"PUT /{BUCKET}/meta.json HTTP/1.1\r\nHost: 127.0.0.1:{s3.port}\r\n"
                           f"Content-Length: {len(new)}\r\n\r\n".encode() + new[:10])
            time.sleep(0.3)  # the server has the first bytes when the client dies
        time.sleep(0.3)
        assert _get(s3, "meta.json") == old
        leftovers = [p.name for p in (tmp_path / "data").rglob("*") if "partial" in p.name]
        assert leftovers == []
        urllib.request.urlopen(urllib.request.Request(
            f"{s3.endpoint}/{BUCKET}/meta.json", data=new, method="PUT"), timeout=10).read()
        assert _get(s3, "meta.json") == new
