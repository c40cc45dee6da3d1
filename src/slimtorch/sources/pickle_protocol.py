"""Protocol 4 and 5 pickles rewritten into the protocol-2 opcodes torch's weights-only unpickler reads.

torch's weights-only unpickler (and :mod:`slimtorch.sources.pickle_budget` before it) knows the opcodes
torch.save writes, protocol 2. Some files we must read are pickled with Python's default protocol, 4: the
``.metadata`` of a ``torch.distributed.checkpoint`` folder. Protocol 4 adds framing, a memo index the
unpickler counts itself, short strings and ``STACK_GLOBAL`` (a global named by two strings on the stack).
Each has a protocol-2 twin, so :func:`downgrade_pickle` rewrites the stream opcode by opcode, and the
result goes through the same budget and allow-list as every other pickle: nothing here runs or builds
anything but bytes.

- ``FRAME`` is dropped (framing only groups opcodes for buffered reads);
- ``SHORT_BINUNICODE`` and ``BINUNICODE8`` become ``BINUNICODE``;
- ``MEMOIZE`` becomes ``BINPUT`` / ``LONG_BINPUT`` with the index the unpickler would give it;
- ``STACK_GLOBAL`` whose module and name are the two string pushes just before it (literal, or memo
  fetches of strings) becomes ``GLOBAL "module\\nname"``, the two pushes removed. A string memoised on the
  way is put in the memo only if a later opcode fetches it as data (written out then, once).

Any other opcode (bytes, sets built by ``ADDITEMS``, out-of-band buffers, ``NEWOBJ_EX``, ``STACK_GLOBAL``
of computed strings) is refused with one line naming the file, the opcode and its offset.

Example:
    >>> data = pickle.dumps({"step": 3}, protocol=4)
    >>> pickle.loads(downgrade_pickle(data, "x.pkl"))
    {'step': 3}
"""

from __future__ import annotations

import pickletools
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

from slimtorch.errors import FormatError
from slimtorch.format.untrusted import untrusted
from slimtorch.sources.pickle_budget import MAX_OPCODES, MAX_PICKLE_BYTES

_KEPT = frozenset(
    {
        *("NONE", "NEWTRUE", "NEWFALSE", "BININT", "BININT1", "BININT2", "LONG1", "BINFLOAT", "BINUNICODE"),
        *("SHORT_BINSTRING", "EMPTY_TUPLE", "EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET", "MARK", "TUPLE"),
        *("TUPLE1", "TUPLE2", "TUPLE3", "APPEND", "APPENDS", "SETITEM", "SETITEMS", "GLOBAL", "REDUCE"),
        *("NEWOBJ", "BUILD", "BINPERSID", "STOP"),
    }
)
"""Opcodes copied as they are: the protocol-2 opcodes the weights-only unpickler reads (memo opcodes are
handled on their own)."""
_STRINGS = frozenset({"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8"})
_PUTS = frozenset({"MEMOIZE", "BINPUT", "LONG_BINPUT"})
_GETS = frozenset({"BINGET", "LONG_BINGET"})
_GLOBAL_PART = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
"""What a module or attribute name in a rewritten GLOBAL may be: a newline would end the name early and
turn the rest into opcodes."""


@dataclass
class _Push:
    """A string pushed but not written yet: it may be one of the two names of a ``STACK_GLOBAL``."""

    text: str
    fetched: int | None = None  # the memo index it was fetched from (None: a literal in the stream)
    puts: list[int] = field(default_factory=list)  # memo indexes it is stored under right after


class _Rewrite:
    """One pass over the opcodes, writing the protocol-2 stream; holds at most two strings back."""

    def __init__(self, path: str | Path, limit: int) -> None:
        self.path = path
        self.limit = limit
        self.out: list[bytes] = []
        self.size = 0
        self.memo: set[int] = set()  # indexes the unpickler's memo holds (MEMOIZE takes len(memo))
        self.strings: dict[int, str] = {}  # memo index -> its string, for STACK_GLOBAL names fetched again
        self.unwritten: set[int] = set()  # memo indexes of strings a STACK_GLOBAL took, never written
        self.pending: list[_Push] = []

    def refuse(self, problem: str, position: int) -> FormatError:
        return FormatError(self.path, f"refused pickle: {problem} (at byte {position})")

    def write(self, data: bytes) -> None:
        self.size += len(data)
        if self.size > self.limit:
            raise FormatError(self.path, f"refused pickle: rewritten, it takes over {self.limit:,} bytes")
        self.out.append(data)

    def opcode(self, name: str, arg: object, raw: bytes, position: int) -> None:
        if name in _STRINGS:
            self.hold(_Push(str(arg)))
        elif name in _GETS and arg in self.strings:
            self.hold(_Push(self.strings[arg], fetched=arg))
        elif name in _PUTS:
            self.put(name, arg, position)
        elif name == "STACK_GLOBAL":
            self.stack_global(position)
        elif name == "FRAME":
            return
        elif name == "PROTO":
            if not isinstance(arg, int) or not 2 <= arg <= 5 or self.size:
                raise self.refuse(f"protocol {arg}", position)
            self.write(b"\x80\x02")
        elif name in _KEPT or name in _GETS:
            self.flush()
            self.write(raw)
        else:
            raise self.refuse(f"opcode {name}, which has no protocol-2 twin slimtorch reads", position)

    def hold(self, push: _Push) -> None:
        if len(self.pending) == 2:
            self.flush(keep=1)
        self.pending.append(push)

    def put(self, name: str, arg: object, position: int) -> None:
        index = len(self.memo) if name == "MEMOIZE" else int(arg)  # type: ignore[call-overload]
        self.memo.add(index)
        self.unwritten.discard(index)
        if self.pending:
            self.strings[index] = self.pending[-1].text
            self.pending[-1].puts.append(index)
            return
        if not self.size:
            raise self.refuse(f"{name} before anything is pushed", position)
        self.strings.pop(index, None)
        self.write(_put(index))

    def stack_global(self, position: int) -> None:
        if len(self.pending) < 2:
            raise self.refuse("STACK_GLOBAL of names that are not two strings just before it", position)
        module, attr = self.pending[-2], self.pending[-1]
        for part in (module.text, attr.text):
            if not _GLOBAL_PART.fullmatch(part):
                raise self.refuse(f"STACK_GLOBAL of a name that is not one: {part[:80]!r}", position)
        self.flush(keep=2)
        self.pending.clear()
        for push in (module, attr):
            self.unwritten.update(push.puts)
        self.write(b"c" + f"{module.text}\n{attr.text}\n".encode())

    def flush(self, keep: int = 0) -> None:
        """Write the held strings but the last ``keep``, as plain pushes and puts."""
        while len(self.pending) > keep:
            push = self.pending.pop(0)
            if push.fetched is not None and push.fetched not in self.unwritten:
                self.write(_get(push.fetched))
            else:
                text = push.text.encode("utf-8", "surrogatepass")
                self.write(b"X" + struct.pack("<I", len(text)) + text)
                if push.fetched is not None:  # written now for the first time: stored for later fetches
                    self.unwritten.discard(push.fetched)
                    push.puts.insert(0, push.fetched)
            for index in push.puts:
                self.write(_put(index))


def _put(index: int) -> bytes:
    return b"q" + bytes([index]) if index < 256 else b"r" + struct.pack("<I", index)


def _get(index: int) -> bytes:
    return b"h" + bytes([index]) if index < 256 else b"j" + struct.pack("<I", index)


def downgrade_pickle(data: bytes, path: str | Path) -> bytes:
    """``data``, a pickle of protocol 2 to 5, as a protocol-2 pickle of the same object (see the module's
    docstring); a :class:`FormatError` on ``path`` for anything without a protocol-2 twin.

    The input is bounded by :data:`~slimtorch.sources.pickle_budget.MAX_PICKLE_BYTES` and
    :data:`~slimtorch.sources.pickle_budget.MAX_OPCODES` (counted as it is read, never listed), and so is
    the output, so the rewrite holds no more than the budget whatever the file claims.
    """
    if len(data) > MAX_PICKLE_BYTES:
        raise FormatError(path, f"refused pickle: more than {MAX_PICKLE_BYTES:,} bytes")
    rewrite = _Rewrite(path, MAX_PICKLE_BYTES)
    previous: tuple[str, object, int] | None = None
    with untrusted(path, "pickle"):
        for count, (opcode, arg, position) in enumerate(pickletools.genops(data)):
            if count >= MAX_OPCODES:
                raise FormatError(path, f"refused pickle: more than {MAX_OPCODES:,} opcodes")
            assert position is not None  # genops reads bytes through a BytesIO: every opcode has its offset
            if previous is not None:  # an opcode's bytes end where the next one starts
                rewrite.opcode(*previous[:2], data[previous[2] : position], previous[2])
            previous = (opcode.name, arg, position)
    if previous is None or previous[0] != "STOP":
        raise FormatError(path, "refused pickle: it does not end with STOP (truncated)")
    rewrite.opcode("STOP", None, b".", previous[2])
    return b"".join(rewrite.out)
