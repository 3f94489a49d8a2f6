"""File sources: Criteo TSV / Avazu CSV files, or JSON lines / delimited text under a
declared schema (connectors/schema.py), plain or gzip, read in decoded chunks.

A file is one source partition named ``"file:" + basename``.  A record's
offset is its 0-based *data-line number*: the header line (Avazu) is not
counted, blank and malformed lines are (they are rejected, never dropped
silently).  `FileSource.snapshot()` is the resume position; reopening the file
with ``start_offset`` set to it yields exactly the records that follow.

A damaged file (a truncated or corrupt gzip, a failed read) reads as the
complete lines before the damage, then raises `DamagedFile`; the line the
damage cut short is not a line of it (the error counts its bytes), so the
repaired file resumes at the offset where the damaged one stopped.
"""
from __future__ import annotations

import csv
import dataclasses
import hashlib
import io
import os
import zlib
from importlib import resources
from pathlib import Path
from typing import BinaryIO

import numpy as np

from stream_ctr.connectors.batch import Batch, Positions, Rejected
from stream_ctr.connectors.decode import decode_lines
# defined apart, so that modules which only raise them load no decoder (numba)
from stream_ctr.connectors.errors import DamagedFile, EmptySource, SourceError  # noqa: F401
from stream_ctr.connectors.formats import FORMATS, RecordFormat
from stream_ctr.connectors.schema import Schema, SchemaError, parse_schema, schema_to_toml
from stream_ctr.connectors.schema_decode import decode_records

# A source's layout: a hand-written format, or a declared schema (which reads like one here).
Layout = RecordFormat | Schema
SCHEMA_ENCODINGS = ("json", "csv")

# The real samples bundled with the package (stream_ctr/data/, SOURCES.md), found the same
# way in a checkout, an editable install and a wheel.
SAMPLE_DIR = Path(str(resources.files("stream_ctr") / "data"))
SAMPLE_PATHS: dict[str, Path] = {
    "criteo": SAMPLE_DIR / "criteo_kaggle_sample_14493.tsv.gz",
    "avazu": SAMPLE_DIR / "avazu_sample_9999.csv.gz",
}
READ_BYTES = 8 << 20          # bytes read from the (decompressed) stream at a time
# A damaged gzip ends in GzipDamage (an OSError; gzip.GzipFile raises EOFError, BadGzipFile
# or zlib.error), a failed read in OSError.
READ_ERRORS = (OSError, EOFError, zlib.error)
GZIP_MAGIC = b"\x1f\x8b"


class GzipDamage(OSError):
    """Where and how a gzip stream breaks off: `kind` is "truncated" (the file ends
    inside a member) or "corrupt" (bytes that do not inflate, a failed checksum, bytes
    after a member that are not gzip); `at` is the compressed byte offset where it was
    found and `size` the file's size."""

    def __init__(self, kind: str, at: int, size: int, detail: str = "") -> None:
        self.kind, self.at, self.size, self.detail = kind, at, size, detail
        super().__init__(f"gzip stream {kind} at byte {at:,} of {size:,}" + (f": {detail}" if detail else ""))


GZIP_IN_BYTES = 1 << 20       # compressed bytes read from the file at a time


class GzipStream(io.RawIOBase):
    """The decompressed bytes of a gzip file (one member or several concatenated),
    every byte before any damage included.

    ``read(n)`` returns up to `n` bytes, fewer only at the end of the stream or
    just before damage; once nothing before the damage is left it raises the
    damage (`GzipDamage`, or the OSError of a failed file read), on every later
    call too. gzip.GzipFile instead raises in the read that meets the damage,
    losing what that read had already inflated (up to a whole read's worth of
    lines). Zero bytes between members are skipped, as gzip does.
    """

    def __init__(self, path: str | Path) -> None:
        self.name = str(path)
        self._file = open(path, "rb", buffering=0)
        self._in = memoryview(b"")       # compressed bytes read and not yet inflated
        self._at = 0                     # file offset of self._in[0]
        self._member: zlib._Decompress | None = None   # None between members
        self._feed = GZIP_IN_BYTES      # compressed bytes inflated per call
        self._failure: OSError | None = None
        self._ended = False

    def readable(self) -> bool:
        return True

    def read(self, size: int | None = -1) -> bytes:
        if size is None or size < 0:
            return self.readall()
        parts, have = [], 0
        while have < size and self._failure is None and not self._ended:
            out = self._inflate(size - have)
            if out:
                parts.append(out)
                have += len(out)
        if not parts and size and self._failure is not None:
            raise self._failure
        return b"".join(parts)

    def readall(self) -> bytes:
        parts = []
        while chunk := self.read(8 * GZIP_IN_BYTES):
            parts.append(chunk)
        return b"".join(parts)

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)

    def close(self) -> None:
        self._file.close()
        super().close()

    def _inflate(self, limit: int) -> bytes:
        """At most `limit` bytes inflated from the next piece of input (maybe none)."""
        if not self._in and self._member is not None:
            # zlib may hold output back at a call's limit with all of its input taken in:
            # return that before reading on (the file may end right there, truncated).
            try:
                held = self._member.decompress(b"", limit)
            except zlib.error as exc:           # (a trailer it had taken in, failing its check)
                self._fail("corrupt", _inflate_error(exc))
                return b""
            if held:
                if self._member.eof:
                    self._member = None
                return held
        if not self._in and not self._read_more():
            return b""
        if self._member is None and not self._start_member():
            return b""
        piece = self._in[:self._feed]
        before = self._member.copy()
        try:
            out = self._member.decompress(piece, limit)
        except zlib.error as exc:
            # zlib keeps nothing of a call that fails: inflate the piece again from the
            # state before it, in smaller pieces, down to the byte that fails, so every
            # byte ahead of the damage is returned and its offset is exact.
            if len(piece) > 1:
                self._member, self._feed = before, max(1, len(piece) // 64)
            else:
                self._fail("corrupt", _inflate_error(exc))
            return b""
        # (at a member's end, input past it is in unused_data; unconsumed_tail may still
        # hold it too, from before)
        member = self._member
        used = len(piece) - len(member.unused_data if member.eof else member.unconsumed_tail)
        self._in, self._at = self._in[used:], self._at + used
        if member.eof:
            self._member = None
        return out

    def _read_more(self) -> bool:
        """Append the file's next bytes to the input; False at its end or on a failed read."""
        try:
            data = self._file.read(GZIP_IN_BYTES)
        except OSError as exc:
            self._failure = exc
            return False
        if not data:
            # (input left here is one byte after a member: a member's start, or not gzip)
            if self._member is not None or (self._in and GZIP_MAGIC.startswith(bytes(self._in))):
                self._at += len(self._in)       # where the file ends
                self._fail("truncated")
            elif self._in:
                self._fail("corrupt", "the bytes after a gzip member are not gzip data")
            else:
                self._ended = True
            return False
        self._in = memoryview(bytes(self._in) + data) if self._in else memoryview(data)
        return True

    def _start_member(self) -> bool:
        """Begin the next member at the input: past zero padding, at gzip's magic bytes."""
        if self._in[0] == 0:
            head = bytes(self._in)
            zeros = len(head) - len(head.lstrip(b"\0"))
            self._in, self._at = self._in[zeros:], self._at + zeros
            return False                # (more input first, if the padding took it all)
        if len(self._in) < len(GZIP_MAGIC):
            self._read_more()
            return False
        if self._in[:len(GZIP_MAGIC)] != GZIP_MAGIC:
            self._fail("corrupt", "the bytes after a gzip member are not gzip data")
            return False
        self._member = zlib.decompressobj(wbits=31)     # 31: a gzip header and trailer, checked
        return True

    def _fail(self, kind: str, detail: str = "") -> None:
        self._failure = GzipDamage(kind, self._at, max(os.fstat(self._file.fileno()).st_size, self._at),
                                   detail)


def _inflate_error(exc: zlib.error) -> str:
    """zlib's complaint as what it means for the data."""
    what = str(exc).rpartition(": ")[2]          # "Error -3 while decompressing data: ..."
    if what in ("incorrect data check", "incorrect length check"):
        # deflate has no check of its own: a changed byte mostly inflates to changed
        # bytes, found only here, by the checksum at the end of the member
        return (f"{what}: the member's checksum does not match its data, so bytes were changed "
                "somewhere in it and lines read before this point may be garbled")
    return f"bytes that do not inflate: {what}"


def damage_cause(exc: BaseException, lines: int) -> str:
    """How a read broke off after `lines` data lines, for `DamagedFile.cause`."""
    if isinstance(exc, GzipDamage):
        detail = f": {exc.detail}" if exc.detail else ""
        return f"gzip stream {exc.kind} after {lines:,} lines (byte {exc.at:,} of {exc.size:,}{detail})"
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc) or type(exc).__name__
    return f"read failed after {lines:,} lines ({reason})"


def open_raw(path: str | Path) -> BinaryIO:
    """`path` for reading in large chunks: its bytes, decompressed (`GzipStream`) if it
    starts with the gzip magic bytes. A read returns what is there before any damage
    first; only then does it raise."""
    path = Path(path)
    if not path.is_file():
        raise SourceError(f"no such file: {path} (check the path; 'criteo:sample' and "
                          "'avazu:sample' name the bundled samples)")
    try:
        with open(path, "rb") as probe:
            is_gzip = probe.read(2) == GZIP_MAGIC
        return GzipStream(path) if is_gzip else open(path, "rb", buffering=0)
    except OSError as exc:
        raise SourceError(f"cannot open {path}: {exc.strerror or exc}") from exc


def open_binary(path: str | Path) -> BinaryIO:
    """Open `path` for binary reading (lines, peek), decompressing if it starts with the
    gzip magic bytes."""
    raw = open_raw(path)
    return io.BufferedReader(raw, 1 << 20 if isinstance(raw, GzipStream) else io.DEFAULT_BUFFER_SIZE)


class _LineReader:
    """Whole lines from a binary stream, taken by count.

    Newline positions of each chunk are found once (`np.flatnonzero`) and
    consumed by index, so reading n lines costs O(bytes), however small n is.
    At the end of the stream a last line without LF counts as a line.

    A read that fails (a damaged gzip, an I/O error) ends the stream early:
    every complete line read before it is still handed out, the line it cut
    short is dropped, and only then do `take`, `skip` and `at_end` raise
    `DamagedFile`, counting the lines after the first `header_lines`.
    """

    def __init__(self, stream: BinaryIO, read_bytes: int = READ_BYTES, name: str = "stream",
                 header_lines: int = 0) -> None:
        self._stream = stream
        self._name = name
        self._read_bytes = read_bytes
        self._header_lines = header_lines
        self._lines_read = 0                            # LF-terminated lines buffered so far
        self._failure: BaseException | None = None     # the read error that ended the stream
        self._cut = 0                                   # bytes of the line the failure cut short
        self._buf = b""
        self._pos = 0                                   # first unconsumed byte of _buf
        self._ends = np.zeros(0, dtype=np.int64)        # LF positions in _buf (or len at EOF)
        self._next = 0                                  # index in _ends of the next line
        self._eof = False

    def available(self) -> int:
        return len(self._ends) - self._next

    def at_end(self) -> bool:
        """True when no line is left (reads ahead if needed)."""
        while not self.available() and not self._eof:
            self._refill()
        self._raise_failure()
        return not self.available()

    def take(self, n: int) -> tuple[bytes, int]:
        """Up to `n` whole lines (fewer only at the end of the stream) and their count."""
        if self.available() < n and not self._eof:
            self._refill(n - self.available())
        k = min(n, self.available())
        if k == 0:
            self._raise_failure()
            return b"", 0
        end = int(self._ends[self._next + k - 1]) + 1
        data = self._buf[self._pos:end]
        self._pos, self._next = end, self._next + k
        return data, k

    def skip(self, n: int) -> int:
        """Skip up to `n` lines, counting newlines of whole chunks in bulk; returns the count."""
        skipped = 0
        while skipped < n:
            if not self.available():
                if self._eof:
                    self._raise_failure()
                    break
                skipped += self._skip_chunk(n - skipped)
                continue
            k = min(n - skipped, self.available())
            self._pos = int(self._ends[self._next + k - 1]) + 1
            self._next += k
            skipped += k
        return skipped

    def _skip_chunk(self, limit: int) -> int:
        """Read one chunk; if it ends no more than `limit` lines, drop them unparsed."""
        chunk = self._read()
        n_lf = chunk.count(b"\n")
        if not chunk or n_lf > limit:
            self._append(chunk)
            return 0
        tail = self._buf[self._pos:] + chunk
        cut = tail.rfind(b"\n") + 1
        self._buf, self._pos = tail[cut:], 0
        self._ends, self._next = np.zeros(0, dtype=np.int64), 0
        self._lines_read += n_lf
        return n_lf

    def _refill(self, n_lines: int = 1) -> None:
        """Read chunks until `n_lines` more newlines (or EOF) are buffered; join once."""
        chunks, n_lf = [], 0
        while n_lf < n_lines:
            chunk = self._read()
            if not chunk:
                break
            chunks.append(chunk)
            n_lf += chunk.count(b"\n")
        if chunks:
            self._append(b"".join(chunks))
        if n_lf < n_lines:
            self._append(b"")                            # end of stream

    def _read(self) -> bytes:
        """The next chunk; b"" at the end of the stream, or once a read failed (kept in
        _failure, raised when the lines before it are consumed: chunks read before it
        in the same refill are kept)."""
        if self._failure is not None:
            return b""
        try:
            return self._stream.read(self._read_bytes)
        except READ_ERRORS as exc:              # truncated or corrupt gzip, I/O error
            self._failure = exc
            return b""

    def _raise_failure(self) -> None:
        """Raise the read failure once every line before it was handed out."""
        if self._failure is None or self.available() or not self._eof:
            return
        lines = max(self._lines_read - self._header_lines, 0)
        raise DamagedFile(self._name, lines, damage_cause(self._failure, lines), self._cut) from self._failure

    def _append(self, chunk: bytes) -> None:
        tail = self._buf[self._pos:]
        old = self._ends[self._next:] - self._pos
        if chunk:
            new = np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8) == 10) + len(tail)
            self._lines_read += len(new)
        else:
            self._eof = True
            last = old[-1] + 1 if len(old) else 0
            if self._failure is None:
                new = np.array([len(tail)] if len(tail) > last else [], dtype=np.int64)
            else:                               # cut short by the failure: not a line
                new, self._cut = np.zeros(0, dtype=np.int64), len(tail) - last
        self._buf, self._pos = tail + chunk, 0
        self._ends, self._next = np.concatenate([old, new]).astype(np.int64), 0


@dataclasses.dataclass(frozen=True)
class RawChunk:
    """Data lines read from a file and not yet decoded: `n_lines` LF-terminated lines
    whose first is data line `first_offset`."""
    data: bytes
    first_offset: int
    n_lines: int


@dataclasses.dataclass(frozen=True)
class FilePosition:
    """Where a pass over a file stands: `line`, the data-line offset of the next record
    to train in file `file` (a basename: a file moved to another directory resumes),
    and `fingerprint`, what that file's data was when the run counted it (None from a
    checkpoint of an older version, which resumes unchecked).

    A checkpoint stores `to_checkpoint()`, {"file:NAME": line} ({} at a pass's start),
    among its positions, and `file_record()`, the file's name and fingerprint, beside
    them (a checkpoint's positions are offsets only: `Positions`)."""
    file: str
    line: int = 0
    fingerprint: "FileFingerprint | None" = None

    def to_checkpoint(self) -> dict[str, int]:
        return {f"file:{self.file}": self.line} if self.line else {}

    def file_record(self) -> dict[str, object]:
        """The file's name and fingerprint, as a checkpoint stores them."""
        return {"name": self.file, **(self.fingerprint.as_dict() if self.fingerprint else {})}

    @classmethod
    def from_checkpoint(cls, positions: dict[str, int], file: str,
                        record: dict | None = None) -> "FilePosition":
        """The position in `file` of a checkpoint's positions and `file_record()` (the
        fingerprint only when the record is of a file of that name)."""
        named = isinstance(record, dict) and record.get("name") == file
        return cls(file, int(positions.get(f"file:{file}", 0)),
                   FileFingerprint.from_dict(record) if named else None)


class FileSource:
    """Decoded chunks of one Criteo/Avazu file (plain or gzip), with resumable offsets.

    The source contract shared with the Kafka source:

    - ``read(max_records=None)`` returns ``(Batch, rejected)`` for the next at
      most `max_records` (default `chunk_records`) data lines; both together
      cover every line read.  At the end it returns an empty Batch; it never
      blocks indefinitely.
    - ``exhausted`` is True once nothing is left (end of file or `stop_offset`).
    - ``snapshot()`` is the resume position ``{partition: next offset}``: the
      data-line number just after the last line returned (decoded or rejected).
      ``FileSource(path, fmt, start_offset=snapshot()[partition])`` continues there.

    Offsets are 0-based data-line numbers (the Avazu header is not a data
    line).  `start_offset` lines are skipped on open; reading stops before
    data line `stop_offset` if given (e.g. to hold out the end of a file).
    """

    def __init__(self, path: str | Path, fmt: Layout, start_offset: int = 0,
                 chunk_records: int = 65536, stop_offset: int | None = None,
                 read_bytes: int = READ_BYTES) -> None:
        if start_offset < 0 or chunk_records < 1:
            raise ValueError(f"FileSource needs start_offset >= 0 and chunk_records >= 1, "
                             f"got {start_offset} and {chunk_records}")
        if stop_offset is not None and stop_offset < start_offset:
            raise ValueError(f"FileSource stop_offset {stop_offset} is before start_offset {start_offset}")
        self.path = Path(path)
        self.fmt = fmt
        self.partition = "file:" + self.path.name
        self.chunk_records = chunk_records
        self.stop_offset = stop_offset
        self._stream = open_raw(self.path)
        self._lines = _LineReader(self._stream, read_bytes, name=str(self.path),
                                  header_lines=int(bool(fmt.has_header)))
        try:
            if isinstance(fmt, Schema) and fmt.has_header:
                self.fmt = _schema_header(self._lines, self.path, fmt)
            elif fmt.has_header:
                _check_header(self._lines, self.path, fmt)
            self._next_offset = self._lines.skip(start_offset)
        except BaseException:           # a wrong header, a resume past the damage
            self.close()
            raise

    def read(self, max_records: int | None = None) -> tuple[Batch, list[Rejected]]:
        """Decode the next at most `max_records` data lines (default: chunk_records)."""
        return self.decode_raw(self.read_raw(max_records))

    def read_raw(self, max_records: int | None = None) -> RawChunk:
        """The next at most `max_records` data lines (default: chunk_records), not yet
        decoded. Advances the offset as `read` does; `decode_raw` turns the chunk into
        what `read` returns. The split lets `ReadAhead` read in order on one thread and
        decode chunks on several."""
        n = self.chunk_records if max_records is None else max_records
        if self.stop_offset is not None:
            n = min(n, self.stop_offset - self._next_offset)
        data, k = self._lines.take(n) if n > 0 and self._stream is not None else (b"", 0)
        raw = RawChunk(data, self._next_offset, k)
        self._next_offset += k
        return raw

    def decode_raw(self, raw: RawChunk) -> tuple[Batch, list[Rejected]]:
        """`read`'s (Batch, rejected) of a chunk from `read_raw`. Touches no state of the
        source: chunks may be decoded on several threads at once."""
        if raw.n_lines == 0:
            return Batch.empty(self.fmt.n_keys, self.fmt.n_dense, (self.partition,), self.fmt.pooling), []
        if isinstance(self.fmt, Schema):
            return decode_records(raw.data, self.fmt, self.partition, raw.first_offset)
        return decode_lines(raw.data, self.fmt, self.partition, raw.first_offset)

    @property
    def next_offset(self) -> int:
        """Offset (data-line number) of the next line `read` will return."""
        return self._next_offset

    @property
    def exhausted(self) -> bool:
        if self.stop_offset is not None and self._next_offset >= self.stop_offset:
            return True
        return self._stream is None or self._lines.at_end()

    def snapshot(self) -> Positions:
        """Resume position: ``{partition: offset of the next data line}``."""
        return {self.partition: self._next_offset}

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def __enter__(self) -> "FileSource":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_header(lines: _LineReader, path: Path, fmt: RecordFormat) -> None:
    """Consume the header line, insisting it names fmt's fields (a missing header would eat a record)."""
    data, k = lines.take(1)
    if k == 0:
        return
    header = data.rstrip(b"\r\n").decode("utf-8", errors="replace")
    if header.split(fmt.delimiter) != list(fmt.field_names):
        raise SourceError(f"{path}: first line is not the {fmt.name} header "
                          f"({fmt.delimiter.join(fmt.field_names[:4])}...); got {header[:60]!r}. "
                          f"Add the header line or pick the right format")


def _schema_header(lines: _LineReader, path: Path, schema: Schema) -> Schema:
    """Consume a csv header line: the schema with its column names (checked against
    `columns` when the schema lists them too)."""
    data, k = lines.take(1)
    if k == 0:
        return schema
    # utf-8-sig: a byte-order mark (spreadsheet exports write one) is not part of the first name.
    text = data.rstrip(b"\r\n").decode("utf-8-sig", errors="replace")
    header = (next(csv.reader([text], delimiter=schema.delimiter, quotechar=schema.quote))
              if schema.quote else text.split(schema.delimiter))
    others = [d for d in (",", ";", "\t", "|") if d != schema.delimiter and d in text]
    if len(header) == 1 and others:
        raise SourceError(f"{path}: the header is one column under the schema's delimiter "
                          f"{schema.delimiter!r}, and it holds {others[0]!r}: set delimiter = "
                          f"{others[0]!r} in [schema] if that separates the columns")
    if schema.columns and tuple(header) != schema.columns:
        raise SourceError(f"{path}: the header ({', '.join(header[:6])}...) is not the schema's columns "
                          f"({', '.join(schema.columns[:6])}...); fix the schema's columns or the file")
    if schema.columns:
        return schema
    try:               # validated again: every field's column must be in the header
        return parse_schema(schema_to_toml(dataclasses.replace(schema, columns=tuple(header))), str(path))
    except SchemaError as exc:
        raise SourceError(f"{path}: with the columns of its header: {exc}") from None


def count_records(path: str | Path, fmt: Layout, read_bytes: int = READ_BYTES) -> int:
    """Number of data lines in the file (header excluded), by a bulk newline count; of a
    damaged file, the lines before the damage (`count_readable`)."""
    return count_readable(path, fmt, read_bytes)[0]


def count_readable(path: str | Path, fmt: Layout,
                   read_bytes: int = READ_BYTES) -> tuple[int, DamagedFile | None]:
    """(data lines, damage): the number of data lines in the file (header excluded),
    by a bulk newline count, and None; of a damaged file (a truncated or corrupt gzip,
    an I/O error), the number of complete lines before the damage -- exactly those a
    `FileSource` returns before it raises -- and the `DamagedFile` it raises then.
    A holdout taken from the end of a damaged file is the tail of its readable lines."""
    lines, damage, _ = survey_file(path, fmt, read_bytes)
    return lines, damage


FINGERPRINT_HEAD_BYTES = 64 << 10      # of a file's data, hashed to recognise it on resume


@dataclasses.dataclass(frozen=True)
class FileFingerprint:
    """What recognises a file's data when a run resumes on it: the SHA-256
    (`head_sha256`) of its first `head_bytes` bytes of data (FINGERPRINT_HEAD_BYTES,
    or all of a smaller file's) and `size`, its bytes of data when the run counted its
    lines. Data is what the reader sees: a gzip file's decompressed bytes (recompressing
    it changes nothing here), the readable bytes before any damage.

    A file that only grew (lines appended, a repaired copy of a damaged one) holds the
    same first bytes and at least `size`: it is the same file. Anything else is another
    file under the same name, or this one truncated (`changed_in`)."""
    head_sha256: str
    head_bytes: int
    size: int

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: object) -> "FileFingerprint | None":
        """A checkpoint's fingerprint; None when it has none (written by an older version)."""
        try:
            return cls(str(raw["head_sha256"]), int(raw["head_bytes"]), int(raw["size"]))
        except (TypeError, KeyError, ValueError):
            return None

    def changed_in(self, path: str | Path, now: "FileFingerprint") -> str:
        """Why the file at `path`, whose fingerprint is now `now`, is not the one this
        fingerprint was taken of ("" when it is, maybe grown): its first bytes differ,
        or it holds fewer bytes of data."""
        # The same head length: `now` already hashed it; a file that was under 64 KiB and grew
        # is hashed again over the checkpoint's shorter head.
        head = now.head_sha256 if now.head_bytes == self.head_bytes else head_sha256(path, self.head_bytes)
        if now.size < self.head_bytes or head != self.head_sha256:
            return f"its first {_kib(self.head_bytes)} differ"
        if now.size < self.size:
            return (f"it holds {now.size:,} bytes of data, fewer than the {self.size:,} the run "
                    "counted: it was truncated or changed")
        return ""


def _kib(n: int) -> str:
    return f"{n // 1024:,} KiB" if n % 1024 == 0 else f"{n:,} bytes"


def head_sha256(path: str | Path, n: int) -> str:
    """The SHA-256 of the first `n` bytes of the file's data (fewer if it holds fewer;
    those before any damage)."""
    digest, left = hashlib.sha256(), n
    with open_raw(path) as stream:
        while left > 0:
            try:
                chunk = stream.read(min(left, READ_BYTES))
            except READ_ERRORS:
                break
            if not chunk:
                break
            digest.update(chunk)
            left -= len(chunk)
    return digest.hexdigest()


def survey_file(path: str | Path, fmt: Layout,
                read_bytes: int = READ_BYTES) -> tuple[int, DamagedFile | None, FileFingerprint | None]:
    """`count_readable`'s (data lines, damage), and the file's `FileFingerprint`, in one
    read of the file. No fingerprint (None) for a gzip whose checksum failed: the bytes
    before the failure may be garbled, so the repaired file, which a resume of it goes
    on with, may differ from them."""
    n_lines, tail, failure = 0, 0, None       # tail: bytes after the last LF
    size, head = 0, hashlib.sha256()
    with open_raw(path) as stream:
        while True:
            try:
                chunk = stream.read(read_bytes)
            except READ_ERRORS as exc:
                failure = exc
                break
            if not chunk:
                break
            if size < FINGERPRINT_HEAD_BYTES:
                head.update(chunk[:FINGERPRINT_HEAD_BYTES - size])
            size += len(chunk)
            n_lf = chunk.count(b"\n")
            n_lines += n_lf
            tail = len(chunk) - 1 - chunk.rfind(b"\n") if n_lf else tail + len(chunk)
    fingerprint = FileFingerprint(head.hexdigest(), min(size, FINGERPRINT_HEAD_BYTES), size)
    if isinstance(failure, GzipDamage) and failure.kind == "corrupt":
        fingerprint = None
    if failure is None:
        return max(n_lines + (tail > 0) - int(bool(fmt.has_header)), 0), None, fingerprint
    lines = max(n_lines - int(bool(fmt.has_header)), 0)
    return lines, DamagedFile(path, lines, damage_cause(failure, lines), tail), fingerprint


def detect_format(spec: str, schema: Schema | str | None = None) -> tuple[Layout, Path]:
    """Parse a source spec: ``criteo:PATH``, ``avazu:PATH``, ``criteo:sample``, ``json:PATH``,
    ``csv:PATH``, or a bare PATH.

    `schema` (a Schema or its TOML text; empty = none) is the declared layout
    of ``json:``/``csv:`` sources, which need one; with a schema a bare path is
    read under it.  A bare path's format otherwise comes from its name:
    containing "criteo" or "avazu", else a .tsv (-> criteo) or .csv (-> avazu)
    extension, optionally followed by .gz.  The file must exist.  Raises
    SourceError otherwise.
    """
    declared = _as_schema(schema)
    prefix, colon, rest = spec.partition(":")
    if colon and prefix.lower() in SCHEMA_ENCODINGS:
        if declared is None:
            raise SourceError(f"source {spec!r} needs a schema: pass --schema FILE (write one with "
                              f"`stream-ctr schema infer {spec}`) or put a [schema] table in the config")
        if declared.encoding != prefix.lower():
            raise SourceError(f"source {spec!r} is {prefix.lower()}, the schema's encoding is "
                              f"{declared.encoding!r}; use {declared.encoding}:{rest} or fix the schema")
        fmt: Layout = declared
        path = Path(rest).expanduser()
    elif colon and prefix.lower() in FORMATS:
        if declared is not None:
            raise SourceError(f"source {spec!r}: {prefix.lower()} records have a built-in layout, but "
                              "a schema applies here (--schema, [schema], or the one a run trained "
                              "with, from its checkpoint or bundle); a schema is for json:PATH and "
                              "csv:PATH sources")
        fmt = FORMATS[prefix.lower()]
        path = SAMPLE_PATHS[fmt.name] if rest == "sample" else Path(rest).expanduser()
    elif colon and len(prefix) > 1 and prefix.isidentifier() and not Path(spec).exists():
        raise SourceError(f"unknown record format {prefix!r} in {spec!r}; known formats: "
                          f"{', '.join(sorted(FORMATS) + list(SCHEMA_ENCODINGS))} "
                          "(write FORMAT:PATH, e.g. criteo:day_0.gz or json:clicks.jsonl)")
    else:
        path = Path(spec).expanduser()
        fmt = declared if declared is not None else _guess_format(path)
    if not path.is_file():
        raise SourceError(f"no such file: {path} (from source {spec!r}; check the path, or use "
                          "criteo:sample / avazu:sample for the bundled samples)")
    return fmt, path


def source_file_name(spec: str) -> str:
    """The basename of the file a source spec names (as `detect_format` reads it, the
    bundled samples' included), without looking at the file: what a checkpoint's
    position is keyed by."""
    prefix, colon, rest = spec.partition(":")
    if colon and prefix.lower() in FORMATS:
        return SAMPLE_PATHS[FORMATS[prefix.lower()].name].name if rest == "sample" else Path(rest).name
    if colon and prefix.lower() in SCHEMA_ENCODINGS:
        return Path(rest).name
    return Path(spec).name


def _as_schema(schema: Schema | str | None) -> Schema | None:
    if schema is None or isinstance(schema, Schema):
        return schema
    if not schema.strip():
        return None
    try:
        return parse_schema(schema)
    except SchemaError as exc:
        raise SourceError(str(exc)) from None


def _guess_format(path: Path) -> RecordFormat:
    name = path.name.lower()
    for fmt_name in sorted(FORMATS):
        if fmt_name in name:
            return FORMATS[fmt_name]
    stem = name[:-3] if name.endswith(".gz") else name
    if stem.endswith(".tsv"):
        return FORMATS["criteo"]
    if stem.endswith(".csv"):
        return FORMATS["avazu"]
    if stem.endswith((".json", ".jsonl", ".ndjson")):
        raise SourceError(f"{path} looks like JSON lines: pass its schema with --schema FILE "
                          f"(`stream-ctr schema infer json:{path}` writes one)")
    raise SourceError(f"cannot tell the record format of {path}; write criteo:{path} or avazu:{path}")
