"""String ops. Strings are numpy object arrays of Python str.

RegexFullMatch's pattern comes from the model file, so it runs on RE2 (google-re2), the engine
the ONNX spec names: matching takes time linear in the text whatever the pattern, where
Python's backtracking `re` spends exponential time on a pattern like `(a+)+$`. RE2's syntax
has no backreferences or lookaround; a pattern using them fails at load time. Without
google-re2 installed (it is a dependency; a broken install) only patterns without regex
metacharacters are accepted, as for the Tokenizer's patterns (ops/microsoft/text.py).
"""
from __future__ import annotations

import numpy as np

from ember import limits
from ember.ops.microsoft.text import _METACHARS, _re2
from ember.ops.registry import OpImpl, register


def _object_array(values, shape) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out.reshape(shape)


@register("StringConcat", versions=[20])
class StringConcat(OpImpl):
    def run(self, x, y):
        shape = np.broadcast_shapes(x.shape, y.shape)
        a = np.broadcast_to(x, shape).reshape(-1)
        b = np.broadcast_to(y, shape).reshape(-1)
        return _object_array([str(p) + str(q) for p, q in zip(a, b)], shape)


@register("RegexFullMatch", versions=[20])
class RegexFullMatch(OpImpl):
    def setup(self):
        if self.pattern is None:
            raise self.fail("the 'pattern' attribute is required")
        self.fullmatch = _compile_full_match(self, str(self.pattern))

    def run(self, x):
        match = self.fullmatch
        flat = [match(s) for s in x.reshape(-1)]
        return np.array(flat, dtype=bool).reshape(x.shape)


def _compile_full_match(op: OpImpl, pattern: str):
    """str -> bool: whether the whole string matches `pattern` (RE2 syntax)."""
    if not _is_utf8(pattern):  # invalid UTF-8 in the model, kept as surrogates
        raise op.fail(f"pattern {pattern!r} is not valid UTF-8")
    if _re2 is None:
        if _METACHARS.intersection(pattern):
            raise op.fail(f"pattern {pattern!r} is a regular expression, which needs the "
                          f"google-re2 package (pip install google-re2); ember does not run "
                          f"patterns from a model with Python's backtracking re")
        return lambda text: text == pattern
    options = _re2.Options()
    options.log_errors = False  # the error comes back as an exception, not on stderr
    try:
        regex = _re2.compile(pattern, options=options)
    except Exception as exc:  # re2.error, whose message may be bytes
        msg = exc.args[0] if exc.args else exc
        msg = msg.decode("utf-8", "replace") if isinstance(msg, bytes) else str(msg)
        raise op.fail(f"cannot compile pattern {pattern!r} with RE2 (no backreferences or "
                      f"lookaround): {msg}") from None
    return lambda text: regex.fullmatch(text) is not None


def _is_utf8(text: str) -> bool:
    """Whether `text` encodes to UTF-8 (no lone surrogates). A predicate, so the error about
    it is raised outside an `except` and is not chained to the UnicodeEncodeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@register("StringSplit", versions=[20])
class StringSplit(OpImpl):
    def run(self, x):
        delim = self.delimiter or None  # unset or "": split on runs of whitespace
        maxsplit = -1 if self.maxsplit is None else self.maxsplit
        parts = [s.split(delim, maxsplit) if (delim is not None or s.strip()) else []
                 for s in x.reshape(-1)]
        counts = np.array([len(p) for p in parts], dtype=np.int64).reshape(x.shape)
        width = max((len(p) for p in parts), default=0)
        padded = [p + [""] * (width - len(p)) for p in parts]
        flat = [s for p in padded for s in p]
        return _object_array(flat, x.shape + (width,)), counts


@register("StringNormalizer", versions=[10])
class StringNormalizer(OpImpl):
    def setup(self):
        if self.case_change_action not in ("LOWER", "UPPER", "NONE"):
            raise self.fail(f"unknown case_change_action {self.case_change_action!r}")
        words = self.stopwords or []
        self.stop = set(words) if self.is_case_sensitive else {w.lower() for w in words}

    def run(self, x):
        # the loader refuses a numeric input the graph declares; one computed at run time
        # (a Cast's output, an If's branch) is refused here, before str methods meet it
        if getattr(x, "dtype", None) != object:
            raise self.fail(f"input X must be a string tensor, got "
                            f"{getattr(x, 'dtype', type(x).__name__)}")
        if x.ndim == 1:
            row, two_d = x, False
        elif x.ndim == 2 and x.shape[0] == 1:
            row, two_d = x[0], True
        else:
            raise self.fail(f"input must have shape [C] or [1, C], got {list(x.shape)}")
        if self.is_case_sensitive:
            kept = [s for s in row if s not in self.stop]
        else:
            kept = [s for s in row if s.lower() not in self.stop]
        if self.case_change_action == "LOWER":
            kept = [s.lower() for s in kept]
        elif self.case_change_action == "UPPER":
            kept = [s.upper() for s in kept]
        if not kept:
            kept = [""]
        out = _object_array(kept, (len(kept),))
        return out.reshape(1, -1) if two_d else out


@register("TfIdfVectorizer", versions=[9])
class TfIdfVectorizer(OpImpl):
    def setup(self):
        if self.mode not in ("TF", "IDF", "TFIDF"):
            raise self.fail(f"unknown mode {self.mode!r}")
        if (self.pool_strings is None) == (self.pool_int64s is None):
            raise self.fail("exactly one of pool_strings and pool_int64s must be set")
        pool = list(self.pool_strings if self.pool_strings is not None else self.pool_int64s)
        self.strings = self.pool_strings is not None
        counts = list(self.ngram_counts or [0])
        indexes = list(self.ngram_indexes or [])
        if not 1 <= self.min_gram_length <= self.max_gram_length:
            raise self.fail("need 1 <= min_gram_length <= max_gram_length")
        # any count is meaningful (run clamps it to the row's length), but not a negative one
        if self.max_skip_count < 0:
            raise self.fail(f"max_skip_count must be >= 0, got {self.max_skip_count}")
        # n-gram key (tuple) -> position in the pool's n-gram list
        self.table: dict[tuple, int] = {}
        k = 0
        for g, start in enumerate(counts):
            n = g + 1
            end = counts[g + 1] if g + 1 < len(counts) else len(pool)
            if (end - start) % n:
                raise self.fail(f"pool segment for {n}-grams has {end - start} entries, "
                                f"not a multiple of {n}")
            for p in range(start, end, n):
                self.table.setdefault(tuple(pool[p:p + n]), k)
                k += 1
        if len(indexes) != k:
            raise self.fail(f"ngram_indexes has {len(indexes)} entries, the pool {k} n-grams")
        if any(i < 0 for i in indexes):
            raise self.fail(f"ngram_indexes must be >= 0, got {min(indexes)}")
        self.indexes = np.asarray(indexes, dtype=np.int64)
        self.size = int(self.indexes.max()) + 1 if k else 0
        weights = self.weights
        self.w = np.ones(k, dtype=np.float32) if not weights else \
            np.asarray(weights, dtype=np.float32)
        if len(self.w) != k:
            raise self.fail(f"weights has {len(self.w)} entries, expected {k}")
        self.max_n = max(1, len(counts))

    def _row_counts(self, tokens: list) -> np.ndarray:
        found = np.zeros(len(self.indexes), dtype=np.float32)
        c = len(tokens)
        table = self.table
        # a skip of c or more leaves no n-gram (n >= 2) inside a row of c tokens: clamped, a
        # max_skip_count of 2**62 costs what c does
        max_skip = min(self.max_skip_count, c)
        for n in range(self.min_gram_length, min(self.max_gram_length, self.max_n) + 1):
            skips = range(max_skip + 1) if n > 1 else (0,)
            for skip in skips:
                step = skip + 1
                span = (n - 1) * step
                for start in range(c - span):
                    key = tuple(tokens[start:start + span + 1:step])
                    hit = table.get(key)
                    if hit is not None:
                        found[hit] += 1
        return found

    def run(self, x):
        if x.ndim not in (1, 2):
            raise self.fail(f"input must be 1-D or 2-D, got rank {x.ndim}")
        rows = x.reshape(1, -1) if x.ndim == 1 else x
        if self.strings:
            token_rows = [[str(t) for t in r] for r in rows]
        else:
            token_rows = [[int(t) for t in r] for r in rows.astype(np.int64)]
        limits.check_shape((len(token_rows), self.size), np.float32)  # size: from attributes
        out = np.zeros((len(token_rows), self.size), dtype=np.float32)
        for i, tokens in enumerate(token_rows):
            counts = self._row_counts(tokens)
            if self.mode == "IDF":
                counts = np.minimum(counts, 1) * self.w
            elif self.mode == "TFIDF":
                counts = counts * self.w
            np.add.at(out[i], self.indexes, counts)
        return out[0] if x.ndim == 1 else out
