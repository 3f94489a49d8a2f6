"""Dead-letter sink: rejected records appended to a JSON-lines file.

Each line is one rejected record::

    {"partition": "file:day_0.gz", "offset": 41, "line": 42,
     "reason": "bad_integer", "raw": "0\\t1\\tx\\t..."}

Schema decoders add a "detail" (e.g. "price = 'abc': expected a number").

`offset` is the record's offset in its partition (for a file, the 0-based
data-line number); `line` is ``offset + 1``, the 1-based data-line number a
person would look up (for a file with a header, the file line is ``line + 1``).
`raw` is the record decoded as UTF-8 with undecodable bytes replaced; a record
that is not valid UTF-8 also gets `raw_b64`, its exact bytes in base64.
"""
from __future__ import annotations

import base64
import json
from collections import Counter
from pathlib import Path

from stream_ctr.connectors.batch import Rejected


def raw_fields(raw: bytes, limit_bytes: int | None = None) -> dict[str, str]:
    """`raw` as text; a record that is not UTF-8 also as base64 (`raw_b64`), so it can be
    replayed byte for byte (the text shows its bad bytes as U+FFFD).  With `limit_bytes`,
    only the record's first bytes are kept (a UTF-8 character the cut splits is dropped
    from the text; it does not make the record look like one that is not UTF-8)."""
    kept = raw if limit_bytes is None else raw[:limit_bytes]
    try:
        raw.decode("utf-8")
        return {"raw": kept.decode("utf-8", errors="ignore")}
    except UnicodeDecodeError:
        return {"raw": kept.decode("utf-8", errors="replace"), "raw_b64": base64.b64encode(kept).decode()}


class DeadLetterFile:
    """Append-only JSON-lines file of rejected records, flushed after every write."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")
        self.counts: Counter[str] = Counter()      # reason -> records written by this sink

    def write(self, rejected: list[Rejected], stop=None) -> None:
        """Append the records and flush; counts them by reason.  (`stop`: as the
        dead-letter topic's; a file write does not wait on anyone.)"""
        if not rejected:
            return
        if self._file is None:
            raise ValueError(f"dead-letter file {self.path} is closed")
        lines = [json.dumps({"partition": r.partition, "offset": r.offset, "line": r.offset + 1,
                             "reason": r.reason, **({"detail": r.detail} if r.detail else {}),
                             **raw_fields(r.raw)}, ensure_ascii=False)
                 for r in rejected]
        self._file.write("\n".join(lines) + "\n")
        self._file.flush()
        self.counts.update(r.reason for r in rejected)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "DeadLetterFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
