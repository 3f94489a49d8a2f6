"""What a source raises for something the user can fix: a missing, empty or damaged input.

Apart from files.py (which re-exports them) so that a module that only raises
or catches them, such as the Kafka URL parser the configuration imports, loads
no decoder: `stream-ctr --help` stays free of numba.
"""
from __future__ import annotations

from pathlib import Path


class SourceError(ValueError):
    """A source cannot be opened because of something the user can fix."""


class EmptySource(SourceError):
    """The source holds no records: an empty file, an empty gzip, a header alone."""


class DamagedFile(SourceError):
    """A file that cannot be read to its end: a truncated or corrupt gzip, an I/O error.

    Raised only once every complete line before the damage was returned (by
    `FileSource`) or counted (by `count_readable`): `lines` is how many data
    lines that is, which is also the offset where a reader of the repaired file
    resumes. The line the damage cut short is never returned, not even as a
    malformed record (its `cut_bytes` are counted in the message): the repaired
    file holds it whole at offset `lines`, so resuming there loses nothing.
    `cause` says how and where the stream broke off; `summary` is set by a
    training run that trained the lines before it.
    """

    def __init__(self, path: str | Path, lines: int, cause: str, cut_bytes: int = 0,
                 done: str = "were read", then: str = "re-copy it") -> None:
        self.path, self.lines, self.cause, self.cut_bytes = Path(path), lines, cause, cut_bytes
        self.summary = None
        super().__init__(self.describe(done, then))

    def describe(self, done: str, then: str = "re-copy it") -> str:
        """The one-line message: `done` says what became of the lines before the damage."""
        cut = f", the {self.cut_bytes:,} bytes of the line it cut short were dropped" if self.cut_bytes else ""
        return (f"{self.path}: {self.cause}: the {self.lines:,} lines before it {done}{cut}; "
                f"the file is damaged: {then}")
