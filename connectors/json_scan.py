"""Compiled (numba) scan of JSON lines: where each declared path's value is, without Python objects.

`scan_lines` walks the bytes of a block of JSON lines once and, for every
line and every declared dotted path, notes the value's type tag, its byte
span (a string's without the quotes, an array's or object's with its brackets)
and, for a number, its float64 value.
The schema decoder hashes and parses those spans vectorized, as it does csv
columns, instead of building a dict per record: the per-record parse into
Python objects was most of the JSON decode time.

The scan only takes what it is sure of.  A line is handed back as `SLOW`,
and decoded by the per-line parser (orjson) that is the reference, when it
holds anything this scanner does not check to the letter: a backslash
(escapes), a control character in a string, text that is not valid UTF-8, or
any deviation from the JSON grammar (which includes every
invalid line: the per-line parser names its reject).  A line that is not an
object (e.g. ``[1, 2]``) is slow too.  So the two paths give the same result
on every line (tests/connectors/test_json_scan.py compares them).

A number's value is exact (correctly rounded) when its digits fit in 2**53
and its decimal exponent in +-22 (Clinger's fast path: one exactly
representable integer divided or multiplied by an exact power of ten); the
others are marked inexact and parsed by Python's float().
"""
from __future__ import annotations

import numpy as np
from numba import njit

# Type tags of a value (ABSENT: the path is not in the record).
ABSENT, NULL, FALSE, TRUE, NUMBER, STRING, OBJECT, ARRAY = range(8)
# Line status.
FAST, SLOW, EMPTY = 0, 1, 2

_POW10 = np.array([10.0 ** k for k in range(23)], dtype=np.float64)
_MAX_EXACT = 1 << 53
_MAX_DEPTH = 64


class PathTrie:
    """Declared dotted paths as a trie the kernel walks: node 0 is the record."""

    def __init__(self, paths: list[str]) -> None:
        children: list[dict[bytes, int]] = [{}]
        leaf: list[int] = [-1]
        for index, path in enumerate(paths):
            node = 0
            for part in path.split("."):
                key = part.encode()
                if key not in children[node]:
                    children[node][key] = len(children)
                    children.append({})
                    leaf.append(-1)
                node = children[node][key]
            leaf[node] = index
        keys = b"".join(k for c in children for k in c)
        self.key_bytes = np.frombuffer(keys + b"\0", dtype=np.uint8).copy()
        starts, ends, child, first, last = [], [], [], [], []
        at = 0
        for c in children:
            first.append(len(child))
            for k, node in c.items():
                starts.append(at)
                ends.append(at + len(k))
                child.append(node)
                at += len(k)
            last.append(len(child))
        self.key_start = np.array(starts, dtype=np.int64)
        self.key_end = np.array(ends, dtype=np.int64)
        self.child = np.array(child, dtype=np.int64)
        self.first = np.array(first, dtype=np.int64)
        self.last = np.array(last, dtype=np.int64)
        self.leaf = np.array(leaf, dtype=np.int64)
        self.n_paths = len(paths)


def scan_lines(buf: np.ndarray, line_start: np.ndarray, line_end: np.ndarray, trie: PathTrie):
    """(status int8 [n], tag int8 [n, P], start, end int64 [n, P], value float64 [n, P],
    exact bool [n, P], is_int bool [n, P]) of the lines ``buf[line_start[i]:line_end[i]]``
    (no LF). `is_int`: a number written without a fraction or exponent."""
    n, p = len(line_start), trie.n_paths
    status = np.zeros(n, np.int8)
    tag = np.zeros((n, p), np.int8)
    start = np.zeros((n, p), np.int64)
    end = np.zeros((n, p), np.int64)
    value = np.zeros((n, p), np.float64)
    exact = np.ones((n, p), np.bool_)
    is_int = np.zeros((n, p), np.bool_)
    _scan(buf, line_start, line_end, trie.key_bytes, trie.key_start, trie.key_end, trie.child,
          trie.first, trie.last, trie.leaf, status, tag, start, end, value, exact, is_int)
    return status, tag, start, end, value, exact, is_int


@njit(cache=True, nogil=True, inline="always")
def _space(c):
    return c == 32 or c == 9 or c == 13 or c == 10


@njit(cache=True, nogil=True, inline="always")
def _skip_space(buf, i, stop):
    while i < stop and _space(buf[i]):
        i += 1
    return i


@njit(cache=True, nogil=True, inline="always")
def _string_end(buf, i, stop):
    """Index of the closing quote of the string whose content starts at i; -1 if it has a
    backslash or a control character (the slow path checks those), is not valid UTF-8
    (no overlong forms, no surrogates, at most U+10FFFF), or has no end."""
    while i < stop:
        c = buf[i]
        if c == 34:
            return i
        if c == 92 or c < 32:
            return -1
        if c < 128:
            i += 1
            continue
        if 0xC2 <= c <= 0xDF:
            n, lo, hi = 1, 0x80, 0xBF
        elif 0xE0 <= c <= 0xEF:
            n = 2
            lo = 0xA0 if c == 0xE0 else 0x80
            hi = 0x9F if c == 0xED else 0xBF
        elif 0xF0 <= c <= 0xF4:
            n = 3
            lo = 0x90 if c == 0xF0 else 0x80
            hi = 0x8F if c == 0xF4 else 0xBF
        else:
            return -1
        if i + n >= stop or buf[i + 1] < lo or buf[i + 1] > hi:
            return -1
        for k in range(2, n + 1):
            if buf[i + k] < 0x80 or buf[i + k] > 0xBF:
                return -1
        i += n + 1
    return -1


@njit(cache=True, nogil=True, inline="always")
def _number(buf, i, stop, pow10):
    """(end, value, exact, is_int) of the JSON number at i; end -1 if it is not one (or an
    integer of 19 digits or more, which the per-line parser may refuse)."""
    negative = False
    if i < stop and buf[i] == 45:
        negative = True
        i += 1
    if i >= stop or buf[i] < 48 or buf[i] > 57:
        return -1, 0.0, False, False
    mantissa = 0
    digits = 0
    exact = True
    if buf[i] == 48:
        i += 1
        if i < stop and 48 <= buf[i] <= 57:
            return -1, 0.0, False, False      # a leading zero
    else:
        while i < stop and 48 <= buf[i] <= 57:
            if digits < 18:
                mantissa = mantissa * 10 + (buf[i] - 48)
            else:
                exact = False
            digits += 1
            i += 1
        if digits >= 19:
            return -1, 0.0, False, False
    is_int = True
    scale = 0
    if i < stop and buf[i] == 46:
        is_int = False
        i += 1
        if i >= stop or buf[i] < 48 or buf[i] > 57:
            return -1, 0.0, False, False
        while i < stop and 48 <= buf[i] <= 57:
            if digits < 18:
                mantissa = mantissa * 10 + (buf[i] - 48)
                scale -= 1
            elif buf[i] != 48:
                exact = False
            digits += 1
            i += 1
    if i < stop and (buf[i] == 101 or buf[i] == 69):
        is_int = False
        i += 1
        sign = 1
        if i < stop and (buf[i] == 43 or buf[i] == 45):
            sign = -1 if buf[i] == 45 else 1
            i += 1
        if i >= stop or buf[i] < 48 or buf[i] > 57:
            return -1, 0.0, False, False
        e = 0
        while i < stop and 48 <= buf[i] <= 57:
            if e < 10000:
                e = e * 10 + (buf[i] - 48)
            i += 1
        scale += sign * e
    if scale + digits > 300 or scale < -300:
        return -1, 0.0, False, False          # near float64's range: the parser's rule decides
    if mantissa >= 9007199254740992 or scale > 22 or scale < -22:
        exact = False
    v = float(mantissa)
    if scale < 0:
        v = v / pow10[-scale] if -scale <= 22 else 0.0
    elif scale > 0:
        v = v * pow10[scale] if scale <= 22 else 0.0
    if negative and not (is_int and mantissa == 0):     # the integer -0 is 0
        v = -v
    return i, v, exact, is_int


@njit(cache=True, nogil=True, inline="always")
def _find_child(buf, kstart, kend, node, key_bytes, key_start, key_end, child, first, last):
    n = kend - kstart
    for j in range(first[node], last[node]):
        if key_end[j] - key_start[j] != n:
            continue
        same = True
        for k in range(n):
            if key_bytes[key_start[j] + k] != buf[kstart + k]:
                same = False
                break
        if same:
            return child[j]
    return -1


@njit(cache=True, nogil=True)
def _scan(buf, line_start, line_end, key_bytes, key_start, key_end, child, first, last, leaf,
          status, tag, start, end, value, exact, is_int):
    kind = np.zeros(_MAX_DEPTH, np.int8)          # 1 object, 2 array
    node_of = np.zeros(_MAX_DEPTH, np.int64)      # trie node of an object level (-1: not followed)
    seen = np.full(len(leaf), -1, np.int64)       # line on which a trie node's key last came
    path_of = np.full(_MAX_DEPTH, -1, np.int64)   # the declared path a container level is the value of
    for line in range(len(line_start)):
        i = line_start[line]
        stop = line_end[line]
        i = _skip_space(buf, i, stop)
        if i == stop:
            status[line] = EMPTY
            continue
        if buf[i] != 123:
            status[line] = SLOW
            continue
        ok = True
        depth = 0
        kind[0] = 1
        node_of[0] = 0
        path_of[0] = -1
        i += 1
        expect_member = True                      # after '{' or ',': a key (or '}' right after '{')
        first_member = True
        while ok:
            i = _skip_space(buf, i, stop)
            if i >= stop:
                ok = False
                break
            c = buf[i]
            target = -1                           # the trie node the coming value belongs to
            if kind[depth] == 1:
                if c == 125 and first_member:     # '{}'
                    i += 1
                    if path_of[depth] >= 0:
                        end[line, path_of[depth]] = i
                    depth -= 1
                elif c != 34:
                    ok = False
                    break
                else:
                    kend = _string_end(buf, i + 1, stop)
                    if kend < 0:
                        ok = False
                        break
                    if node_of[depth] >= 0:
                        target = _find_child(buf, i + 1, kend, node_of[depth], key_bytes, key_start,
                                             key_end, child, first, last)
                        if target >= 0:
                            if seen[target] == line:      # a duplicate key: the parser's rule decides
                                ok = False
                                break
                            seen[target] = line
                    i = _skip_space(buf, kend + 1, stop)
                    if i >= stop or buf[i] != 58:
                        ok = False
                        break
                    i = _skip_space(buf, i + 1, stop)
                    if i >= stop:
                        ok = False
                        break
                    c = buf[i]
                    # the value; a parent of declared paths that is not an object (or null)
                    # makes them bad values, which the slow path words
                    path = leaf[target] if target >= 0 else -1
                    if target >= 0 and first[target] < last[target] and c != 123 and c != 110:
                        ok = False
                        break
                    if c == 123 or c == 91:
                        if depth + 1 >= _MAX_DEPTH:
                            ok = False
                            break
                        if path >= 0:
                            tag[line, path] = OBJECT if c == 123 else ARRAY
                            start[line, path] = i
                        depth += 1
                        kind[depth] = 1 if c == 123 else 2
                        node_of[depth] = target if c == 123 else -1
                        path_of[depth] = path
                        first_member = True
                        i += 1
                        continue
                    i = _scalar(buf, i, stop, line, path, tag, start, end, value, exact, is_int)
                    if i < 0:
                        ok = False
                        break
            else:                                 # an array element (never a declared path)
                if c == 93 and first_member:      # '[]'
                    i += 1
                    if path_of[depth] >= 0:
                        end[line, path_of[depth]] = i
                    depth -= 1
                elif c == 123 or c == 91:
                    if depth + 1 >= _MAX_DEPTH:
                        ok = False
                        break
                    depth += 1
                    kind[depth] = 1 if c == 123 else 2
                    node_of[depth] = -1
                    path_of[depth] = -1
                    first_member = True
                    i += 1
                    continue
                else:
                    i = _scalar(buf, i, stop, line, -1, tag, start, end, value, exact, is_int)
                    if i < 0:
                        ok = False
                        break
            # after a value (or a closed container): ',' or the close of the enclosing ones
            while True:
                if depth < 0:
                    break
                i = _skip_space(buf, i, stop)
                if i >= stop:
                    ok = False
                    break
                c = buf[i]
                if c == 44:
                    i += 1
                    first_member = False
                    break
                if (c == 125 and kind[depth] == 1) or (c == 93 and kind[depth] == 2):
                    i += 1
                    if path_of[depth] >= 0:
                        end[line, path_of[depth]] = i
                    depth -= 1
                    continue
                ok = False
                break
            if depth < 0:
                break
        if ok:
            i = _skip_space(buf, i, stop)
            ok = i == stop
        if not ok:
            status[line] = SLOW


@njit(cache=True, nogil=True, inline="always")
def _scalar(buf, i, stop, line, path, tag, start, end, value, exact, is_int):
    """Read the scalar at i (noting it if `path` >= 0); the index after it, or -1."""
    c = buf[i]
    if c == 34:
        e = _string_end(buf, i + 1, stop)
        if e < 0:
            return -1
        if path >= 0:
            tag[line, path] = STRING
            start[line, path] = i + 1
            end[line, path] = e
        return e + 1
    if c == 116 or c == 102 or c == 110:          # true, false, null
        word_tag = TRUE if c == 116 else (FALSE if c == 102 else NULL)
        n = 5 if c == 102 else 4
        if i + n > stop:
            return -1
        if c == 116 and not (buf[i + 1] == 114 and buf[i + 2] == 117 and buf[i + 3] == 101):
            return -1
        if c == 102 and not (buf[i + 1] == 97 and buf[i + 2] == 108 and buf[i + 3] == 115
                             and buf[i + 4] == 101):
            return -1
        if c == 110 and not (buf[i + 1] == 117 and buf[i + 2] == 108 and buf[i + 3] == 108):
            return -1
        if path >= 0:
            tag[line, path] = word_tag
            start[line, path] = i
            end[line, path] = i + n
        return i + n
    e, v, ex, integer = _number(buf, i, stop, _POW10)
    if e < 0:
        return -1
    if path >= 0:
        tag[line, path] = NUMBER
        start[line, path] = i
        end[line, path] = e
        value[line, path] = v
        exact[line, path] = ex
        is_int[line, path] = integer
    return e


@njit(cache=True, nogil=True)
def int_list_tokens(buf, starts, ends, max_len):
    """The arrays ``buf[starts[i]:ends[i]]`` (brackets included, valid JSON from `scan_lines`):
    whether each holds only non-negative integers (`ints`), and for those its first
    `max_len` elements' digit spans: (ints bool [n], count int64 [n], token row, rank,
    start, end int64 [k]).  An integer's text is its token, so it hashes as the parser's
    value would; any other element (a '-', '.', 'e', quote, letter or bracket) sends the
    array to the per-value path."""
    n = len(starts)
    total = 0
    for i in range(n):
        total += ends[i] - starts[i]
    cap = total // 2 + n + 1
    ints = np.ones(n, np.bool_)
    count = np.zeros(n, np.int64)
    tok_row = np.empty(cap, np.int64)
    tok_rank = np.empty(cap, np.int64)
    tok_start = np.empty(cap, np.int64)
    tok_end = np.empty(cap, np.int64)
    k = 0
    for i in range(n):
        k0 = k
        elements = 0
        run = -1
        j = starts[i] + 1
        stop = ends[i] - 1
        while j <= stop:
            c = buf[j] if j < stop else 44          # the closing bracket ends a run like a comma
            if 48 <= c <= 57:
                if run < 0:
                    run = j
            elif c == 44 or c == 32 or c == 9 or c == 10 or c == 13:
                if run >= 0:
                    if elements < max_len:
                        tok_row[k] = i
                        tok_rank[k] = elements
                        tok_start[k] = run
                        tok_end[k] = j
                        k += 1
                    elements += 1
                    run = -1
            else:
                ints[i] = False
                break
            j += 1
        if ints[i]:
            count[i] = min(elements, max_len)
        else:
            k = k0
    return ints, count, tok_row[:k], tok_rank[:k], tok_start[:k], tok_end[:k]


def numbers_in_spans(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(value float64, exact, is_int, ok bool) of each span ``buf[starts[i]:ends[i]]`` read
    as one JSON number, by the scanner's own grammar (so a csv token and a JSON value read
    alike): `ok` where the whole span is a number (not ``007``, ``+3``, ``3.`` or ``abc``),
    `exact` where its value is correctly rounded, `is_int` where it has no fraction or
    exponent."""
    return _numbers_in_spans(buf, np.asarray(starts, np.int64), np.asarray(ends, np.int64), _POW10)


@njit(cache=True, nogil=True)
def _numbers_in_spans(buf, starts, ends, pow10):
    n = len(starts)
    value = np.zeros(n, np.float64)
    exact = np.zeros(n, np.bool_)
    is_int = np.zeros(n, np.bool_)
    ok = np.zeros(n, np.bool_)
    for r in range(n):
        if starts[r] >= ends[r]:
            continue
        end, v, ex, integer = _number(buf, starts[r], ends[r], pow10)
        if end == ends[r]:
            ok[r] = True
            value[r] = v
            exact[r] = ex
            is_int[r] = integer
    return value, exact, is_int, ok
