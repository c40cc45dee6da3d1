"""A budget for a pickle, checked by reading its opcodes before anything is unpickled.

torch's weights_only unpickler refuses globals off its list, but what it does allow is enough for a small
file to take the machine down: ``bytearray(400_000_000)`` is one allowed call, ``set(x)`` repeated through
memo references of one big ``x`` is quadratic, and a tuple nested a million deep crashes the process when
it is hashed. :func:`check_pickle` walks the opcodes once with :func:`pickletools.genops` (linear, no object
built), keeping only a token per stack item (its kind, size and nesting depth), and refuses the pickle
before the unpickler allocates anything for it.

Example:
    >>> check_pickle("model.pt", pickle.dumps({"epoch": 3}, protocol=2))  # doctest: +SKIP
"""

from __future__ import annotations

import io
import pickletools
from collections.abc import Callable, Collection
from pathlib import Path
from typing import BinaryIO

from torch import _weights_only_unpickler as weights_only
from torch._utils import IMPORT_MAPPING, NAME_MAPPING

from slimtorch.errors import FormatError, UnsafeCheckpointError
from slimtorch.format.untrusted import untrusted

MAX_PICKLE_BYTES = 256 * 2**20
"""The largest pickle read: the data.pkl of a torch.save file holds only the structure around the tensors
(a few MB for the largest optimizer checkpoints we know), never their data."""
MAX_OPCODES = 10_000_000
"""Opcodes in one pickle; each makes at most one object. Real checkpoints take 2,000-20,000 (chgnet's
training checkpoint 18,362); a tensor takes about 20, so 10 million leave room for 500,000 tensors."""
MAX_NESTING = 100
"""How deep containers may nest (MARK frames, tuples in tuples, lists in dicts). Real checkpoints nest
fewer than 10 levels; 100 keeps every recursive walk (hash, repr, ==) far below the C stack and Python's
recursion limit."""
MAX_SHARED_ITEMS = 20_000_000
"""Items fetched again through memo references, summed over every fetch: a container referenced twice is
walked twice by whatever reads it, so a big list fetched a million times makes a quadratic hang. Real
checkpoints fetch small things (a storage type, "cpu", a key) a few hundred thousand times."""
MAX_TENSOR_DIMS = 64
"""Sizes and strides a tensor rebuild may pass; real tensors have at most 8 dimensions."""
MAX_ALLOWLIST_WORK = 50_000_000
"""Objects built from allow-listed globals times the globals the caller adds to torch's list: torch's
unpickler rebuilds and searches that list for each such object (GLOBAL, NEWOBJ, BUILD, REDUCE), so 10,000
TorchScript classes with a million objects would take hours. silero_vad: 40 classes x 300 objects."""
_KEPT_ITEMS = 16
"""Tuples up to this length keep their items' tokens: call arguments are read from them."""

_TENSOR_REBUILDS = frozenset(
    {f"torch._utils.{f.__name__}" for f in weights_only._tensor_rebuild_functions()}
    | {"torch.nn.parameter.Parameter"}
)
_SCALARS = frozenset({"scalar", "str"})


class _Token:
    """What the scan knows of one object on the unpickler's stack: its kind, size and nesting depth."""

    __slots__ = ("depth", "items", "kind", "negative", "size", "text", "widest")

    def __init__(self, kind: str, size: int = 0, depth: int = 0, items=None, text: str = "") -> None:
        self.kind = kind  # scalar, str, bytes, global, tuple, list, dict, set, tensor, storage, object
        self.size = size  # items of a container, characters of a string
        self.depth = depth
        self.items = items  # the tokens of a short tuple
        self.text = text  # a global's dotted name, a short string's value
        self.widest = size if kind in ("tuple", "list") else 0  # longest tuple or list inside
        self.negative = False  # a negative integer, or a tuple holding one


_SCALAR = _Token("scalar")
_NEGATIVE = _Token("scalar")
_NEGATIVE.negative = True


def _tuple(items: list[_Token]) -> _Token:
    depth = widest = 0
    negative = False
    for item in items:  # a loop, not max() over generators: a checkpoint has a tuple per tensor and more
        depth = item.depth if item.depth > depth else depth
        widest = item.widest if item.widest > widest else widest
        negative = negative or item.negative
    token = _Token("tuple", len(items), depth + 1, items if len(items) <= _KEPT_ITEMS else None)
    token.widest = widest if widest > len(items) else len(items)
    token.negative = negative
    return token


# -- which calls a checkpoint may make, and with what ------------------------------------------------------
def _one_container(args: list[_Token]) -> bool:
    return not args or (len(args) == 1 and args[0].kind in ("list", "tuple", "dict"))


def _check_dims(args: list[_Token]) -> str | None:
    if any(arg.widest > MAX_TENSOR_DIMS for arg in args):
        return f"a tensor with more than {MAX_TENSOR_DIMS} dimensions"
    return None


def _check_rebuild(args: list[_Token]) -> str | None:
    if any(arg.negative for arg in args):
        # torch.load refuses them; a meta tensor would silently make the strides contiguous instead
        return "a negative size, stride or offset"
    return _check_dims(args)


def _check_rebuild_from_type(args: list[_Token]) -> str | None:
    # torch calls args[0](*args[2]) here: anything but a tensor rebuild would be a call the scan never saw
    if not args or args[0].kind != "global" or args[0].text not in _TENSOR_REBUILDS:
        return "a function that is not a tensor rebuild"
    return _check_rebuild(args)


def _check_containers(args: list[_Token]) -> str | None:
    return None if _one_container(args) else "arguments that are not one list, tuple or dict"


def _check_scalars(args: list[_Token]) -> str | None:
    return None if all(arg.kind in _SCALARS for arg in args) else "arguments that are not numbers or strings"


def _check_bytearray(args: list[_Token]) -> str | None:
    # pickle writes bytearray(_codecs.encode(text, "latin1")): its size is the text's; bytearray(N) is a bomb
    if not args or (len(args) == 1 and args[0].kind == "bytes"):
        return None
    return "a size or something other than the bytes pickle writes (a memory bomb?)"


def _check_encode(args: list[_Token]) -> str | None:
    # pickle writes bytes as _codecs.encode(text, "latin1"); other codecs expand text (utf-32, unicode_escape)
    # or take quadratic time (punycode)
    if len(args) == 2 and args[0].kind == "str" and args[1].text in ("latin1", "latin-1"):
        return None
    return "something other than text and 'latin1'"


_CALLS: dict[str, tuple[Callable[[list[_Token]], str | None], str]] = {
    **{name: (_check_rebuild, "tensor") for name in _TENSOR_REBUILDS},
    "torch._utils._rebuild_qtensor": (_check_dims, "tensor"),  # a zero point may be negative
    "torch._tensor._rebuild_from_type_v2": (_check_rebuild_from_type, "tensor"),
    "torch.Size": (_check_containers, "tuple"),
    "torch.device": (_check_scalars, "scalar"),
    "torch.serialization._get_layout": (_check_scalars, "scalar"),
    "builtins.complex": (_check_scalars, "scalar"),
    "collections.OrderedDict": (_check_containers, "dict"),
    "collections.Counter": (_check_containers, "dict"),
    "builtins.set": (_check_containers, "set"),
    "builtins.bytearray": (_check_bytearray, "bytes"),
    "_codecs.encode": (_check_encode, "bytes"),
}
"""Every call (REDUCE) torch.save writes: tensor and storage rebuilds and the containers pickle writes as
calls, each with the only arguments pickle gives it, and the kind of token its result is. Tensor and storage
classes are on torch's list too but never called by torch.save: ``torch.storage.UntypedStorage(N)`` and
``torch.FloatTensor(N)`` are memory bombs."""
_NEW_OBJECTS = frozenset({"torch.nn.parameter.Parameter", "collections.OrderedDict", "collections.Counter"})
"""Classes NEWOBJ may create besides trusted ones (their ``__new__`` ignores its arguments)."""


def global_name(module: str, name: str) -> str:
    """The dotted name torch's unpickler gives a GLOBAL, Python 2 names mapped as it maps them."""
    if (module, name) in NAME_MAPPING:
        module, name = NAME_MAPPING[(module, name)]
    elif module in IMPORT_MAPPING:
        module = IMPORT_MAPPING[module]
    return f"{module}.{name}"


class _Scan:
    """One pass over a pickle's opcodes, with a token per object the unpickler would make."""

    def __init__(self, path: str | Path, trusted: Collection[str], allowable: Callable[[str], bool]) -> None:
        self.path = path
        self.trusted = trusted
        self.allowable = allowable
        self.allowed = set(weights_only._get_allowed_globals()) | set(
            weights_only._get_user_allowed_globals()
        )
        self.stack: list[_Token] = []
        self.frames: list[list[_Token]] = []
        self.memo: dict[object, _Token] = {}  # keyed by the index BINPUT gives
        self.shared = 0
        self.extra_globals = len(trusted) + len(weights_only._get_user_allowed_globals())
        self.lookups = 0

    def refuse(self, problem: str) -> FormatError:
        return FormatError(self.path, f"refused pickle: {problem}")

    def run(self, stream: BinaryIO, start: int) -> None:
        handlers, limit, end = self._handlers(), MAX_OPCODES, start + MAX_PICKLE_BYTES
        for count, (opcode, arg, position) in enumerate(pickletools.genops(stream)):
            if count >= limit:
                raise self.refuse(f"more than {limit:,} opcodes")
            assert position is not None  # genops gives each opcode's position in a stream (tell())
            if position > end:
                raise self.refuse(f"more than {MAX_PICKLE_BYTES:,} bytes")
            handler = handlers.get(opcode.name)
            if handler is None:
                raise self.refuse(f"opcode {opcode.name}, which torch.save never writes")
            handler(arg)

    def _handlers(self) -> dict[str, Callable[[object], None]]:
        push_scalar = lambda arg: self.stack.append(_SCALAR)  # noqa: E731
        push_int = lambda arg: self.stack.append(_NEGATIVE if arg < 0 else _SCALAR)  # noqa: E731
        handlers = {name: push_scalar for name in ("NONE", "NEWTRUE", "NEWFALSE", "BININT1", "BININT2")}
        handlers.update(BINFLOAT=push_scalar, BININT=push_int, LONG1=push_int)
        handlers.update(
            PROTO=lambda arg: None,
            STOP=self._stop,
            BINUNICODE=self._string,
            SHORT_BINSTRING=self._string,
            EMPTY_TUPLE=lambda arg: self.stack.append(_tuple([])),
            EMPTY_LIST=lambda arg: self.stack.append(_Token("list", depth=1)),
            EMPTY_DICT=lambda arg: self.stack.append(_Token("dict", depth=1)),
            EMPTY_SET=lambda arg: self.stack.append(_Token("set", depth=1)),
            MARK=self._mark,
            TUPLE=lambda arg: self._push_tuple(self._pop_mark()),
            TUPLE1=lambda arg: self._push_tuple(self._pop(1)),
            TUPLE2=lambda arg: self._push_tuple(self._pop(2)),
            TUPLE3=lambda arg: self._push_tuple(self._pop(3)),
            APPEND=lambda arg: self._add("list", self._pop(1)),
            APPENDS=lambda arg: self._add("list", self._pop_mark()),
            SETITEM=lambda arg: self._add("dict", self._pop(2)),
            SETITEMS=lambda arg: self._add("dict", self._pop_mark()),
            BINPUT=self._put,
            LONG_BINPUT=self._put,
            BINGET=self._get,
            LONG_BINGET=self._get,
            GLOBAL=self._global,
            REDUCE=self._reduce,
            NEWOBJ=self._newobj,
            BUILD=self._build,
            BINPERSID=lambda arg: self.stack.__setitem__(-1, _Token("storage")),
        )
        return handlers

    def _stop(self, arg: object) -> None:
        self.stack.pop()

    def _string(self, arg: object) -> None:
        text = str(arg)  # pickletools decodes both string opcodes to str
        self.stack.append(_Token("str", len(text), text=text if len(text) <= 16 else ""))

    def _pop(self, count: int) -> list[_Token]:
        if len(self.stack) < count:
            raise self.refuse("the stack runs out (corrupt pickle)")
        items = self.stack[-count:]
        del self.stack[-count:]
        return items

    def _mark(self, arg: object) -> None:
        if len(self.frames) >= MAX_NESTING:
            raise self.refuse(f"containers nested more than {MAX_NESTING} deep")
        self.frames.append(self.stack)
        self.stack = []

    def _pop_mark(self) -> list[_Token]:
        if not self.frames:
            raise self.refuse("no MARK to close (corrupt pickle)")
        items, self.stack = self.stack, self.frames.pop()
        return items

    def _push_tuple(self, items: list[_Token]) -> None:
        token = _tuple(items)
        self._check_depth(token.depth)
        self.stack.append(token)

    def _check_depth(self, depth: int) -> None:
        if depth > MAX_NESTING:
            raise self.refuse(f"containers nested more than {MAX_NESTING} deep (a crash bomb?)")

    def _add(self, kind: str, items: list[_Token]) -> None:
        target = self._top()
        if target.kind != kind:
            raise self.refuse(f"adds items to a {target.kind}, not a {kind}")
        target.size += len(items) // (2 if kind == "dict" else 1)
        if kind == "list":
            target.widest = max([target.widest, target.size, *(item.widest for item in items)])
        target.depth = max([target.depth, *(1 + item.depth for item in items)])
        self._check_depth(target.depth)

    def _top(self) -> _Token:
        if not self.stack:
            raise self.refuse("the stack runs out (corrupt pickle)")
        return self.stack[-1]

    def _put(self, index: object) -> None:
        self.memo[index] = self._top()

    def _get(self, index: object) -> None:
        token = self.memo.get(index)
        if token is None:
            raise self.refuse(f"memo entry {index} is used before it is set (corrupt pickle)")
        self.shared += token.size
        if self.shared > MAX_SHARED_ITEMS:
            raise self.refuse(
                f"fetches more than {MAX_SHARED_ITEMS:,} items again through memo references (a hang bomb?)"
            )
        self.stack.append(token)

    def _global(self, arg: object) -> None:
        module, _, name = str(arg).partition(" ")
        full = global_name(module, name)
        if full not in self.allowed and full not in self.trusted:
            if len(full) > 200:  # a GLOBAL line can be as long as the file: the message stays one short line
                raise UnsafeCheckpointError(self.path, full[:200] + "...")
            raise UnsafeCheckpointError(self.path, full, allowable=self.allowable(full))
        self._look_up()
        self.stack.append(_Token("global", text=full))

    def _look_up(self) -> None:
        self.lookups += 1
        if self.lookups * self.extra_globals > MAX_ALLOWLIST_WORK:
            raise self.refuse(
                f"{self.lookups:,} objects each searched among {self.extra_globals:,} allowed globals "
                "(a hang bomb?)"
            )

    def _reduce(self, arg: object) -> None:
        args, function = self._pop(1)[0], self._top()
        name = function.text if function.kind == "global" else f"a {function.kind}"
        self._charge(args)
        self._look_up()
        if name in self.trusted:
            self.stack[-1] = _Token("object", depth=args.depth + 1, text=name)
            return
        rule = _CALLS.get(name)
        if rule is None:
            raise self.refuse(f"it calls {name}, which torch.save never calls")
        if args.kind != "tuple" or args.items is None:
            raise self.refuse(f"it calls {name} with {args.size} arguments")
        problem = rule[0](args.items)
        if problem:
            raise self.refuse(f"it calls {name} with {problem}")
        result = _Token(rule[1], args.size + sum(item.size for item in args.items), args.depth, text=name)
        result.widest = args.widest
        result.negative = rule[1] == "tuple" and args.negative  # torch.Size((-1,)) as a size
        self.stack[-1] = result

    def _newobj(self, arg: object) -> None:
        args, cls = self._pop(1)[0], self._top()
        name = cls.text if cls.kind == "global" else f"a {cls.kind}"
        if name not in self.trusted and name not in _NEW_OBJECTS:
            raise self.refuse(f"it creates a {name}, which torch.save never creates")
        self._charge(args)
        self._look_up()
        self.stack[-1] = _Token("object", depth=args.depth + 1, text=name)

    def _build(self, arg: object) -> None:
        state = self._pop(1)[0]
        self._charge(state)
        self._look_up()
        target = self._top()
        target.depth = max(target.depth, state.depth + 1)
        self._check_depth(target.depth)

    def _charge(self, args: _Token) -> None:
        # A call walks its arguments: charge their sizes to the same budget as memo fetches.
        self.shared += args.size + sum(item.size for item in args.items or ())
        if self.shared > MAX_SHARED_ITEMS:
            raise self.refuse(f"its calls walk more than {MAX_SHARED_ITEMS:,} items (a hang bomb?)")


def check_pickle(
    path: str | Path,
    pickle: bytes | BinaryIO,
    trusted: Collection[str] = (),
    allowable: Callable[[str], bool] = lambda name: False,
) -> None:
    """Refuse a pickle that exceeds the budget, before any of it is unpickled; a stream is read from its
    position and put back there.

    ``trusted`` are the dotted names of globals the caller adds to torch's allow-list; ``allowable(name)``
    tells whether a refused global could be allowed with ``--allow-global`` (the error says so).
    """
    if isinstance(pickle, bytes):
        if len(pickle) > MAX_PICKLE_BYTES:
            raise FormatError(path, f"refused pickle: more than {MAX_PICKLE_BYTES:,} bytes")
        pickle = io.BytesIO(pickle)
    start = pickle.tell()
    try:
        with untrusted(path, "pickle"):
            _Scan(path, frozenset(trusted), allowable).run(pickle, start)
    finally:
        pickle.seek(start)
