"""The disk tier: every row that was ever demoted or checkpointed, in LMDB.

One LMDB environment in `store_dir` holds named databases:

    rows            8-byte big-endian key -> packed row (layout.py)
    meta            generation, undo_from, store_id, layout, nonce.<gen>
    undo.<gen>      8-byte big-endian sequence number -> key + the row's value
                    before its first change in generation <gen> (key alone: absent)

**Generations.** A checkpoint commits generation G: it writes the dirty
resident rows like any other write (below), then the new generation number in
one LMDB transaction of its own (`commit_checkpoint`). Rows demoted between
checkpoints, and those of a checkpoint's flush, are written straight into
`rows`, each write transaction also appending to `undo.<G+1>` the previous value of every
key it changes for the first time in that generation. So at any moment
`rows` + the undo logs of the generations after g give back the exact table
of checkpoint g:

* crash in the middle of any write, the checkpoint flush included: LMDB
  commits are atomic, the transaction is lost, `rows` is at its last commit,
  and `rollback(G)` undoes what generation G+1 had written since (the flush's
  committed transactions included);
* crash after the checkpoint's LMDB commit but before its manifest was
  written: the manifest still names G-1, and `rollback(G-1)` applies
  undo.<G+1> then undo.<G>.

Undo logs of the last `keep` + 1 generations are kept (older ones are dropped
at commit), so any of the `keep` newest checkpoints can be resumed. Until the
first checkpoint (G = 0) nothing is logged: going back to generation 0 means
an empty table. A random nonce per generation, stored in the checkpoint,
tells generations of an abandoned timeline apart from the current ones.

**I/O.** Reads are one `getmulti` per batch over sorted keys; writes one
`putmulti` of sorted keys per transaction (at most `chunk_rows` rows, which
bounds LMDB's dirty-page memory); undo entries are appended in sequence order.
The pages of the memory map that reads and writes touched are unmapped from
the process whenever they pass `mapped_bytes` (`mapped_pages.py`), checked
every `MAP_TRIM_KEYS` keys, so RSS stays bounded on tables far larger than RAM.
The map starts small and doubles when full, up to `cap_bytes`, then raises
StoreError. Commits fsync their data pages but not the meta page
(MDB_NOMETASYNC): LMDB keeps its integrity, and a system crash may undo the
newest write-behind commits, which a resume rolls back past anyway; checkpoint
commits and rollbacks then `env.sync(True)`, so a power loss leaves the last
checkpoint intact. The meta page's own fsync per write-behind commit was most of
the I/O thread's time (BENCHMARKS, "Embedding store"). Not thread-safe: one
thread at a time.
"""
from __future__ import annotations

import errno
import gc
import itertools
import secrets
import shutil
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import lmdb
import numpy as np

from stream_ctr.store.errors import StoreError
from stream_ctr.store.key_filter import KeyFilter
from stream_ctr.store.layout import RowLayout, decode_keys, encode_keys, items
from stream_ctr.store.mapped_pages import MappedPages

MAX_DBS = 256
# Keys per getmulti/putmulti call between map trims. A random read faults in about a
# page per key, but the kernel maps every cached page around it too (fault-around,
# large folios): 20-45 pages per key measured here, so ~1,024 keys map up to ~180 MiB.
MAP_TRIM_KEYS = 1024
_UNDO = b"undo."
NONE, ABSENT, READ = 0, 1, 2     # how to log the old value of a written key
_WRITE_FAILED = ("No space left", "Input/output error", "File too large", "quota")
_WRITE_ERRNOS = (errno.ENOSPC, errno.EIO, errno.EFBIG, errno.EDQUOT)
# A store holding more rows than this at open gets no key filter: building it reads
# every leaf page of the table, which would hold up the start of a resumed run.
FILTER_SCAN_MAX_ROWS = 32 << 20


@contextmanager
def gc_paused():
    """Pause Python's cyclic GC around a bulk LMDB call: getmulti/putmulti make a tuple
    per row, and the GC would rescan the whole heap many times over them (measured:
    up to 2x the LMDB time). The tuples form no cycles; the GC resumes right after."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _i64(a: np.ndarray | None) -> np.ndarray:
    return np.zeros(0, np.int64) if a is None else np.ascontiguousarray(a, dtype=np.int64)


@dataclass
class WriteBatch:
    """Changes to `rows`, with how to log each key's old value in the open generation.

    put_old / del_old per key: NONE (already logged in this generation),
    ABSENT (the key is not on disk), READ (read the value on disk and log it).
    undo_keys / undo_rows: old values the caller already holds, logged as given.
    """
    put_keys: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    put_rows: np.ndarray | None = None
    put_old: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int8))
    del_keys: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    del_old: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int8))
    undo_keys: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    undo_rows: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.put_keys) + len(self.del_keys) + len(self.undo_keys)


class LmdbTier:
    def __init__(self, path: str | Path, layout: RowLayout, cap_bytes: int, keep: int,
                 read_only: bool = False, chunk_rows: int = 65536,
                 initial_map_bytes: int = 64 << 20, mapped_bytes: int = 256 << 20,
                 filter_bits_log2: int | None = None) -> None:
        """`filter_bits_log2`: the size of the key filter that lets `get` skip keys never
        written (key_filter.py); None: none."""
        self.path, self.layout, self.cap_bytes = Path(path), layout, cap_bytes
        self.keep, self.read_only, self.chunk_rows = max(1, keep), read_only, chunk_rows
        if read_only and not (self.path / "data.mdb").exists():
            raise StoreError(f"no LMDB store at {self.path} (store.store_dir of the checkpoint)")
        try:
            if not read_only:
                self.path.mkdir(parents=True, exist_ok=True)
            existing = (self.path / "data.mdb").stat().st_size if (self.path / "data.mdb").exists() else 0
            self.env = lmdb.open(str(self.path), map_size=max(min(cap_bytes, initial_map_bytes), existing),
                                 max_dbs=MAX_DBS, readahead=False, readonly=read_only,
                                 sync=True, metasync=False, writemap=False)
        except (OSError, lmdb.Error) as e:
            raise StoreError(f"cannot open the LMDB store at {self.path}: {e}") from None
        self.rows_db = self.env.open_db(b"rows", create=not read_only)
        self.meta_db = self.env.open_db(b"meta", create=not read_only)
        if self._meta(b"layout") is None and not read_only:
            with self._write_txn() as txn:
                for k, v in ((b"layout", layout.fingerprint()), (b"store_id", secrets.token_hex(8)),
                             (b"generation", "0"), (b"undo_from", "2")):
                    txn.put(k, v.encode(), db=self.meta_db)
        if self._meta(b"layout") != layout.fingerprint():
            raise StoreError(f"the LMDB store at {self.path} holds rows '{self._meta(b'layout')}', "
                             f"this model needs '{layout.fingerprint()}' (another model.embed_dim?); "
                             "use another store.store_dir")
        self.store_id = self._meta(b"store_id")
        self.generation = int(self._meta(b"generation"))
        self.undo_from = int(self._meta(b"undo_from"))
        self._seq = self._next_seq(self.generation + 1)
        self.view = None        # a generations.GenerationView when reading an old checkpoint
        self.mapped = MappedPages(self.path / "data.mdb", mapped_bytes)
        self._filter_bits = None if read_only else filter_bits_log2
        self._filter: KeyFilter | None = None       # built at the first `get` (`key_filter`)

    # ---- the key filter ------------------------------------------------------------
    def key_filter(self) -> KeyFilter | None:
        """The filter of every key in `rows` (and of some deleted since), built from a scan
        of the keys when first asked for; None without one, or when the table held more
        than FILTER_SCAN_MAX_ROWS rows at the first ask (then every key is looked up)."""
        if self._filter is None and self._filter_bits is not None:
            if self.entries() > FILTER_SCAN_MAX_ROWS:
                self._filter_bits = None
                return None
            f = KeyFilter(self._filter_bits)
            with self.env.begin(db=self.rows_db) as txn, gc_paused():
                keys = txn.cursor().iternext(keys=True, values=False)
                while chunk := b"".join(itertools.islice(keys, 1 << 18)):
                    f.add(decode_keys(chunk))
                    self.mapped.trim_if_over()
            self._filter = f
        return self._filter

    def note_put(self, keys: np.ndarray) -> None:
        """Keys put into `rows` by a writer other than `apply` (a benchmark's raw writes)."""
        if self._filter is not None:
            self._filter.add(_i64(keys))

    def forget_key_filter(self) -> None:
        """After a change that did not go through `apply` (a rollback restores deleted rows):
        the next `get` builds the filter again from the table."""
        self._filter = None

    # ---- metadata -----------------------------------------------------------------
    def _meta(self, key: bytes) -> str | None:
        with self.env.begin(db=self.meta_db) as txn:
            v = txn.get(key)
        return None if v is None else bytes(v).decode()

    def nonce(self, gen: int) -> str | None:
        return self._meta(b"nonce.%016x" % gen)

    @property
    def open_generation(self) -> int:
        return self.generation + 1

    @property
    def logs_undo(self) -> bool:
        """No undo before the first checkpoint: generation 0 is the empty table."""
        return self.generation >= 1

    def undo_generations(self) -> list[int]:
        with self.env.begin() as txn:
            return self._undo_generations(txn)

    @staticmethod
    def _undo_generations(txn: lmdb.Transaction) -> list[int]:
        cur = txn.cursor()
        names = [bytes(k) for k in cur.iternext(values=False)] if cur.set_range(_UNDO) else []
        return sorted(int(n[len(_UNDO):], 16) for n in names if n.startswith(_UNDO))

    def _undo_db(self, txn: lmdb.Transaction, gen: int, create: bool = False):
        return self.env.open_db(_UNDO + b"%016x" % gen, txn=txn, create=create)

    def _next_seq(self, gen: int) -> int:
        if gen not in self.undo_generations():
            return 0
        with self.env.begin() as txn:
            cur = txn.cursor(db=self._undo_db(txn, gen))
            return int.from_bytes(cur.key(), "big") + 1 if cur.last() else 0

    def entries(self) -> int:
        with self.env.begin() as txn:
            return txn.stat(self.rows_db)["entries"]

    def file_bytes(self) -> int:
        """Bytes of data.mdb in use up to its highest page: a high-water mark, since LMDB
        reuses freed pages but never shrinks the file."""
        info, stat = self.env.info(), self.env.stat()
        return (info["last_pgno"] + 1) * stat["psize"]

    def used_bytes(self) -> int:
        """Bytes of the pages the databases hold now (rows, metadata, undo logs and the
        catalogue): what the tier occupies, falling again when rows are deleted."""
        with self.env.begin() as txn:
            stats = [self.env.stat(), txn.stat(self.rows_db), txn.stat(self.meta_db)]
            stats += [txn.stat(self._undo_db(txn, gen)) for gen in self._undo_generations(txn)]
        return sum(st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"] for st in stats) \
            * stats[0]["psize"]

    def map_bytes(self) -> int:
        return self.env.info()["map_size"]

    # ---- reads ---------------------------------------------------------------------
    def get(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(found [n] bool, rows [n_found, row_bytes]) for sorted unique int64 keys."""
        keys = _i64(keys)
        found = np.zeros(len(keys), dtype=bool)
        if len(keys) == 0:
            return found, np.zeros((0, self.layout.row_bytes), np.uint8)
        if self.view is not None:
            return self.view.get(keys)
        look = keys
        key_filter = self.key_filter()
        if key_filter is not None:
            look = keys[key_filter.maybe(keys)]
            if len(look) == 0:
                return found, np.zeros((0, self.layout.row_bytes), np.uint8)
        with self.env.begin(db=self.rows_db) as txn:
            fk, rows = self._getmulti(txn, look)
        found[np.searchsorted(keys, fk)] = True
        return found, rows

    def _getmulti(self, txn: lmdb.Transaction, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(found keys, their rows) for sorted keys, in calls of `MAP_TRIM_KEYS` keys with the
        map's resident pages trimmed between them (see `MappedPages`)."""
        if len(keys) <= MAP_TRIM_KEYS:
            return self._getmulti_once(txn, keys)
        parts = []
        for lo in range(0, len(keys), MAP_TRIM_KEYS):
            parts.append(self._getmulti_once(txn, keys[lo:lo + MAP_TRIM_KEYS]))
            self.mapped.trim_if_over()
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    def putmulti(self, txn: lmdb.Transaction, keys: np.ndarray, rows: np.ndarray) -> None:
        """Put rows for sorted keys into `rows`, in calls of `MAP_TRIM_KEYS` keys with the
        map's resident pages trimmed between them (writes read their leaf pages through it)."""
        cur = txn.cursor(db=self.rows_db)
        for lo in range(0, len(keys), MAP_TRIM_KEYS):
            cur.putmulti(items(keys[lo:lo + MAP_TRIM_KEYS], rows[lo:lo + MAP_TRIM_KEYS]))
            self.mapped.trim_if_over()

    def _getmulti_once(self, txn: lmdb.Transaction, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        with gc_paused():
            res = txn.cursor(db=self.rows_db).getmulti(encode_keys(keys))
            # getmulti keeps the query order and skips absent keys: all found is the common case.
            fk = keys if len(res) == len(keys) else decode_keys(b"".join([k for k, _ in res]))
            blob = bytearray().join([v for _, v in res])   # writable: callers update metadata in place
            del res
        w = self.layout.row_bytes
        if len(blob) != w * len(fk):
            raise StoreError(f"the LMDB store at {self.path} has rows of the wrong size (corrupt?)")
        return fk, np.frombuffer(blob, dtype=np.uint8).reshape(-1, w)

    def scan(self, start: int, max_rows: int) -> tuple[np.ndarray, np.ndarray, int]:
        """Up to `max_rows` rows with keys >= start, in key order; and the key to
        continue from (0 once the end was reached: the next scan wraps around)."""
        keys, vals = [], []
        with self.env.begin(db=self.rows_db) as txn, gc_paused():
            cur = txn.cursor()
            more = cur.set_range(encode_keys(np.array([start]))[0])
            while more and len(keys) < max_rows:
                keys.append(cur.key())
                vals.append(cur.value())
                more = cur.next()
            nxt = int(decode_keys(cur.key())[0]) if more else 0
        k = decode_keys(b"".join(keys))
        rows = np.frombuffer(bytearray().join(vals), np.uint8).reshape(len(k), self.layout.row_bytes)
        self.mapped.trim_if_over()
        return k, rows, nxt

    # ---- writes --------------------------------------------------------------------
    def _write_txn(self) -> lmdb.Transaction:
        return self.env.begin(write=True)

    def _retry(self, fn) -> None:
        """Run a write transaction, growing the map and retrying when it is full."""
        while True:
            try:
                fn()
                return
            except lmdb.MapFullError:
                self._grow()
            except lmdb.Error as e:
                raise self._error(e) from None

    def _grow(self) -> None:
        size = self.map_bytes()
        if size >= self.cap_bytes:
            raise StoreError(
                f"the LMDB store at {self.path} is full: it reached its cap of {size:,} bytes "
                f"(store.disk_bytes / --disk-bytes) with {self.entries():,} rows; raise --disk-bytes, "
                "checkpoint more often (undo logs shrink) or lower store.ttl_steps")
        self.env.set_mapsize(min(self.cap_bytes, 2 * size))

    def _space_note(self) -> str:
        """How big the store is and what its disk has left (what a user who must free space asks)."""
        try:
            used_mib = (Path(self.path) / "data.mdb").stat().st_size / 2**20
            free_mib = shutil.disk_usage(self.path).free / 2**20
        except OSError:
            return "its size is unknown"
        return (f"data.mdb takes {used_mib:,.1f} MiB, grows in steps of up to its size, and the "
                f"disk has {free_mib:,.1f} MiB free")

    def _error(self, e: Exception) -> StoreError:
        text = str(e)
        # LMDB reports a short write (disk full, file size limit) as EIO.
        if any(t in text for t in _WRITE_FAILED) or getattr(e, "errno", None) in _WRITE_ERRNOS:
            return StoreError(f"cannot write the LMDB store at {self.path} ({text}): the disk is "
                              f"probably full ({self._space_note()}); free space or move "
                              "store.store_dir to a larger disk, then --resume the run: its "
                              "last checkpoint, if any, is intact")
        return StoreError(f"LMDB error in the store at {self.path}: {text}")

    def apply(self, batch: WriteBatch) -> None:
        """Apply a batch in transactions of at most `chunk_rows` keys; each one is
        atomic and carries the undo entries of its own changes."""
        n = max(len(batch.put_keys), len(batch.del_keys), len(batch.undo_keys))
        for lo in range(0, max(n, 1), self.chunk_rows):
            part = _slice(batch, lo, lo + self.chunk_rows)
            if len(part):
                self._retry(lambda: self._commit(part))
                self.mapped.trim_if_over()

    def _commit(self, batch: WriteBatch, extra=None) -> None:
        seq = self._seq
        with self._write_txn() as txn, gc_paused():
            seq = self._write(txn, batch, seq)
            if extra is not None:
                seq = extra(txn, seq)
        self._seq = seq

    def _write(self, txn: lmdb.Transaction, b: WriteBatch, seq: int) -> int:
        gen, w = self.open_generation, self.layout.row_bytes
        if self.logs_undo:
            old_keys = [_i64(b.undo_keys)]
            old_rows = [b.undo_rows if b.undo_rows is not None else np.zeros((0, w), np.uint8)]
            absent = [b.put_keys[b.put_old == ABSENT]]
            read = np.concatenate([b.put_keys[b.put_old == READ], b.del_keys[b.del_old == READ]])
            if len(read):
                read = np.sort(read)
                fk, rows = self._getmulti(txn, read)
                old_keys.append(fk)
                old_rows.append(rows)
                absent.append(np.setdiff1d(read, fk, assume_unique=True))
            seq = self.log_undo(txn, gen, seq, np.concatenate(old_keys), np.concatenate(old_rows),
                                np.concatenate(absent))
        if len(b.put_keys):
            rows = np.array(b.put_rows, dtype=np.uint8, copy=True)
            rows[:, self.layout.meta_off + 24:].view(np.int64)[:, 0] = gen   # write_gen
            self.putmulti(txn, b.put_keys, rows)
            self.note_put(b.put_keys)       # (an aborted transaction only adds false positives)
        # LMDB has no batched delete; deletions (TTL, disk budget) are the rare path.
        for k in encode_keys(b.del_keys):
            txn.delete(k, db=self.rows_db)
        return seq

    def log_undo(self, txn: lmdb.Transaction, gen: int, seq: int, keys: np.ndarray,
                 rows: np.ndarray, absent: np.ndarray) -> int:
        """Append old values (key + row) and absences (key) to undo.<gen>; returns the next seq."""
        if len(keys) + len(absent) == 0:
            return seq
        db = self._undo_db(txn, gen, create=True)
        cur = txn.cursor(db=db)
        kb = np.ascontiguousarray(keys, dtype=np.int64).astype(">u8").view(np.uint8).reshape(-1, 8)
        vals = np.concatenate([kb, rows], axis=1)
        cur.putmulti(items(np.arange(seq, seq + len(keys)), vals), append=True)
        seq += len(keys)
        if len(absent):
            ab = np.ascontiguousarray(absent, dtype=np.int64).astype(">u8").view(np.uint8).reshape(-1, 8)
            cur.putmulti(items(np.arange(seq, seq + len(absent)), ab), append=True)
            seq += len(absent)
        return seq

    def bulk_load(self, keys: np.ndarray, rows: np.ndarray) -> None:
        """Append rows with keys above every stored key (an empty store filled in
        key order, before its first checkpoint): the fast path for imports."""
        if self.generation != 0:
            raise StoreError(f"bulk load needs a store without checkpoints; {self.path} has some")
        rows = np.array(rows, dtype=np.uint8, copy=True)
        rows[:, self.layout.meta_off + 24:].view(np.int64)[:, 0] = self.open_generation

        def put(lo: int) -> None:
            with self._write_txn() as txn, gc_paused():
                txn.cursor(db=self.rows_db).putmulti(
                    items(keys[lo:lo + 4 * self.chunk_rows], rows[lo:lo + 4 * self.chunk_rows]),
                    append=True)
        for lo in range(0, len(keys), 4 * self.chunk_rows):
            self._retry(lambda: put(lo))
            self.mapped.trim_if_over()
        self.note_put(keys)

    def close(self) -> None:
        if self.view is not None:
            self.view.close()
            self.view = None
        self.env.close()


def _slice(b: WriteBatch, lo: int, hi: int) -> WriteBatch:
    return WriteBatch(b.put_keys[lo:hi], None if b.put_rows is None else b.put_rows[lo:hi],
                      b.put_old[lo:hi], b.del_keys[lo:hi], b.del_old[lo:hi], b.undo_keys[lo:hi],
                      None if b.undo_rows is None else b.undo_rows[lo:hi])

