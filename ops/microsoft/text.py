"""Text contrib ops of the com.microsoft domain (run on the host: string tensors never reach a
device).

Tokenizer patterns come from the model file, so they are matched with RE2 (google-re2), whose
search time is linear in the text whatever the pattern, as in onnxruntime (the scan makes one
search per token or skipped character, as onnxruntime's does, so a string costs at worst
quadratic time in its length, never exponential). Without google-re2
only patterns that are plain literals are accepted (matched with bytes.find); any other pattern
fails at load time rather than going to Python's backtracking `re`, which a hostile pattern
could keep busy for exponential time (and whose leftmost-first matching differs from RE2's
leftmost-longest mode that onnxruntime uses).
"""
from __future__ import annotations

import numpy as np

from ember.ops.registry import OpImpl, register

try:  # google-re2 on PyPI (other packages also install a module `re2`, without Options)
    import re2 as _re2

    if not hasattr(_re2, "Options"):  # pragma: no cover - depends on the environment
        _re2 = None
except ImportError:  # pragma: no cover - depends on the environment
    _re2 = None

MS = "com.microsoft"

_START, _END = "\x02", "\x03"
_METACHARS = frozenset("\\.^$|?*+()[]{}")


def _char_bytes(lead: int) -> int:
    """Bytes of the UTF-8 character whose first byte is `lead`."""
    if lead < 0xC0:
        return 1
    if lead < 0xE0:
        return 2
    if lead < 0xF0:
        return 3
    return 4


class _Literal:
    """A pattern without regex metacharacters: its matches are its occurrences."""

    def __init__(self, text: bytes):
        self.text = text

    def search(self, buf: bytes, start: int, end: int):
        if not self.text:
            return (start, start) if start <= end else None
        i = buf.find(self.text, start, end)
        return None if i < 0 else (i, i + len(self.text))


class _RE2:
    """An RE2 pattern in leftmost-longest mode over UTF-8 bytes (onnxruntime's settings)."""

    def __init__(self, pattern: bytes):
        options = _re2.Options()
        options.longest_match = True
        options.log_errors = False
        self.regex = _re2.compile(pattern, options=options)

    def search(self, buf: bytes, start: int, end: int):
        # bytes in, byte offsets out; text before `start` is context (^, \b), as in RE2::Match
        m = self.regex.search(buf, start, end)
        return None if m is None else m.span()


def compile_pattern(op: OpImpl, pattern: str, what: str):
    """A matcher for a model-provided pattern: RE2, or a literal matcher without google-re2."""
    try:
        raw = pattern.encode("utf-8")
    except UnicodeEncodeError as exc:  # invalid UTF-8 in the model, kept as surrogates
        raise op.fail(f"{what} {pattern!r} is not valid UTF-8") from exc
    if _re2 is not None:
        try:
            return _RE2(raw)
        except Exception as exc:  # re2.error, whose message may be bytes
            msg = exc.args[0] if exc.args else exc
            msg = msg.decode("utf-8", "replace") if isinstance(msg, bytes) else str(msg)
            raise op.fail(f"cannot compile {what} {pattern!r}: {msg}") from exc
    if not _METACHARS.intersection(pattern):
        return _Literal(raw)
    raise op.fail(f"{what} {pattern!r} is a regular expression, which needs the google-re2 "
                  f"package (pip install google-re2); ember does not run patterns from a model "
                  f"with Python's backtracking re")


def _chars(piece: bytes, op: OpImpl) -> int:
    try:
        return len(piece.decode("utf-8"))
    except UnicodeDecodeError as exc:  # a \C match splitting a character
        raise op.fail("a match splits a UTF-8 character") from exc


@register("Tokenizer", versions=[1], domain=MS)
class Tokenizer(OpImpl):
    """Splits strings into tokens by separator patterns or extracts the matches of a token
    pattern; [C] -> [C, T] and [N, C] -> [N, C, T], T the most tokens of any string (plus two
    markers with `mark`), short rows padded with `pad_value` after the end marker."""

    defaults = {"mark": None, "mincharnum": None, "pad_value": None, "separators": None,
                "tokenexp": None}

    def setup(self):
        for name in ("mark", "mincharnum", "pad_value"):
            if getattr(self, name) is None:
                raise self.fail(f"required attribute '{name}' is missing")
        self.mark = bool(self.mark)
        self.mincharnum = int(self.mincharnum)
        if self.mincharnum <= 0:
            raise self.fail(f"mincharnum must be positive, got {self.mincharnum}")
        self.pad_value = str(self.pad_value)
        self.char_mode = False
        self.seps, self.regex = [], None
        if self.separators is not None:  # as in onnxruntime, separators win over tokenexp
            seps = [str(s) for s in self.separators]
            if not seps:
                raise self.fail("separators must not be empty")
            self.char_mode = seps == [""]
            if not self.char_mode:
                self.seps = [compile_pattern(self, s, "separator") for s in seps]
        else:
            if not self.tokenexp:
                raise self.fail("one of separators, tokenexp must be set (tokenexp non-empty)")
            self.char_mode = self.tokenexp == "."
            if not self.char_mode:
                self.regex = compile_pattern(self, str(self.tokenexp), "tokenexp")
        if self.char_mode and self.mincharnum >= 2:
            raise self.fail("mincharnum must be 1 for character tokenization")

    # -------------------------------------------------------------- per-string tokenization

    def _split(self, text: bytes) -> list[bytes]:
        """Separator mode: each separator in turn splits every piece left by the previous one;
        pieces shorter than mincharnum characters are dropped. An empty separator match drops
        the character it stands on (onnxruntime's way of making progress)."""
        pieces = [text]
        for sep in self.seps:
            out = []
            for piece in pieces:
                end, start = len(piece), 0
                while True:
                    m = sep.search(piece, start, end)
                    if m is None:
                        if start < end and _chars(piece[start:end], self) >= self.mincharnum:
                            out.append(piece[start:end])
                        break
                    ms, me = m
                    if ms > start and _chars(piece[start:ms], self) >= self.mincharnum:
                        out.append(piece[start:ms])
                    if me > ms:
                        start = me
                    elif ms < end:
                        start = ms + _char_bytes(piece[ms])
                    else:  # an empty match at the end: nothing is left
                        break
            if not out:  # everything was separators: no tokens at all
                return []
            pieces = out
        return pieces

    def _extract(self, text: bytes) -> list[bytes]:
        """Token mode: the successive leftmost-longest matches with at least mincharnum
        characters; a shorter match only moves the search on by one character."""
        if _chars(text, self) < self.mincharnum:
            return []
        out, start, end = [], 0, len(text)
        while start <= end:
            m = self.regex.search(text, start, end)
            if m is None:
                break
            ms, me = m
            if me > ms and _chars(text[ms:me], self) >= self.mincharnum:
                out.append(text[ms:me])
                start = me
            elif ms < end:
                start = ms + _char_bytes(text[ms])
            else:
                break
        return out

    def run(self, x):
        x = np.asarray(x)
        if x.dtype != object and x.dtype.kind not in "US":
            raise self.fail(f"input must be a string tensor, got {x.dtype}")
        if x.ndim not in (1, 2):
            raise self.fail(f"input must have shape [C] or [N, C], got {list(x.shape)}")
        if x.size == 0:
            shape = (x.shape[0], 0) if x.ndim == 2 else (0,)
            return np.empty(shape, dtype=object)
        try:
            encoded = [s.encode("utf-8") if isinstance(s, str) else
                       bytes(s) if isinstance(s, bytes) else str(s).encode("utf-8")
                       for s in x.reshape(-1)]
            if self.char_mode:
                rows = [list(b.decode("utf-8")) for b in encoded]
            else:
                tok = self._split if self.seps else self._extract
                rows = [[t.decode("utf-8") for t in tok(b)] for b in encoded]
        except UnicodeError as exc:  # surrogates (undecodable bytes) or split characters
            raise self.fail(f"input string is not valid UTF-8: {exc}") from exc
        width = max(len(r) for r in rows)
        if width == 0:
            return np.empty(x.shape + (0,), dtype=object)
        if self.mark:
            rows = [[_START, *r, _END] for r in rows]
            width += 2
        out = np.full((len(rows), width), self.pad_value, dtype=object)
        lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
        filled = np.arange(width)[None, :] < lengths[:, None]
        tokens = np.empty(int(lengths.sum()), dtype=object)
        tokens[:] = [t for r in rows for t in r]  # row-major, the order the mask is read in
        out[filled] = tokens
        return out.reshape(x.shape + (width,))
