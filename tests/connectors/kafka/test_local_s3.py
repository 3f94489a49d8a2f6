"""The durable broker's storage server (s3rver on 127.0.0.1) lists more than 1,000 objects.

A tansu partition on s3:// storage is one object per produced batch; past
1,000 of them every listing pages with a continuation token, which s3rver
3.7.1 signs with DES: refused by Node 17+ unless the legacy OpenSSL provider
is on (it used to answer 500, and the broker then served nothing).
"""
from __future__ import annotations

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
