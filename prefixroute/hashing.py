"""Token ids to chained 64-bit block hashes, as vLLM's prefix cache names its KV blocks.

Block *i*'s hash is ``xxh3_64(bytes of block i, seed=hash of block i-1)``, so one hash names the whole prefix up to
the end of its block, and two prompts share block *i*'s hash only if they share every token up to it. Only **full**
blocks are hashed: vLLM never caches a partial last block.
"""

from __future__ import annotations

import array
import operator
import struct
import sys
from collections.abc import Sequence
from itertools import chain
from typing import Any, NewType, Protocol, TypeAlias, cast, runtime_checkable

import xxhash

from prefixroute._numbers import as_int, shown
from prefixroute.errors import ConfigurationError, InvalidPromptError, InvalidTypeError

__all__ = ["BlockHash", "BlockHasher", "Tokens", "encode_tokens"]

BlockHash = NewType("BlockHash", int)
"""A chained 64-bit block hash: it names a prompt prefix that ends at a block boundary."""

_RUN = 64  # blocks cut out per Struct call in BlockHasher.hash_encoded
_TOKEN_LIMIT = 2**32
_HASH_LIMIT = 2**64
_UINT32 = "I" if array.array("I").itemsize == 4 else "L"
_BIG_ENDIAN = sys.byteorder == "big"


def _decode_tokens(data: bytes) -> list[int]:
    """The token ids :func:`encode_tokens` packed into ``data``, as Python ints. O(n), in C."""
    packed = array.array(_UINT32, data)
    if _BIG_ENDIAN:  # pragma: no cover - every supported platform is little-endian
        packed.byteswap()
    return packed.tolist()


@runtime_checkable
class _IntegerArray(Protocol):
    """The part of numpy's ndarray interface that :func:`encode_tokens` uses (numpy is not a dependency)."""

    @property
    def dtype(self) -> Any: ...

    def astype(self, dtype: str) -> Any: ...


Tokens: TypeAlias = "Sequence[int] | array.array[int] | bytes | bytearray | memoryview | _IntegerArray"
"""Everything :meth:`BlockHasher.hash` accepts as a prompt."""


def encode_tokens(tokens: Tokens) -> bytes:
    """Return ``tokens`` as little-endian uint32 bytes, checking every id is an int in ``[0, 2**32)``.

    Accepts ``list``/``tuple`` of ints, ``array.array`` of an integer type, 1-D numpy integer arrays, ``bytes``/
    ``bytearray`` (and a ``memoryview`` of bytes, format ``'B'``) already holding little-endian uint32 ids, and a
    1-D ``memoryview`` of another integer format (``'I'``, ``'Q'``, ``'i'``...), read item by item. O(n).
    Python's ``bool`` is an ``int``, so ``True`` and ``False`` in a list pass as ids 1 and 0 (telling them apart
    would double the cost of a route); a numpy ``bool`` array is refused, and the gateways refuse JSON booleans.

    Raises:
        InvalidPromptError: a token id is negative, too large or not an int (the message names its position), a
            bytes-like prompt's length is not a multiple of 4, an array or memoryview holds no integers, or a numpy
            array or memoryview is not 1-D (a batch of prompts: pass one row).
        TypeError: ``tokens`` is a ``str``, a scalar (a numpy scalar or 0-d array too) or another type that is not
            a token sequence.
    """
    if isinstance(tokens, (bytes, bytearray, memoryview)):
        if isinstance(tokens, bytes):
            data = tokens
        elif isinstance(tokens, memoryview) and tokens.ndim != 1:
            return _encode_view(tokens)  # refused there, whatever its format: a batch of prompts, or a scalar
        elif isinstance(tokens, bytearray) or tokens.format in _BYTE_FORMATS:
            data = bytes(tokens) if isinstance(tokens, bytearray) else tokens.tobytes()  # strided views too
        else:
            return _encode_view(tokens)
        if len(data) % 4:
            raise InvalidPromptError(
                f"a bytes prompt must hold little-endian uint32 token ids, but its length {len(data)} "
                "is not a multiple of 4"
            )
        return data
    # A list or tuple skips every check below: the Protocol check alone costs as much as encoding 1,500 tokens.
    if not isinstance(tokens, (list, tuple)):
        if isinstance(tokens, array.array):
            if tokens.typecode not in _INTEGER_TYPECODES:
                raise InvalidPromptError(
                    f"an array.array prompt must have an integer typecode, not {tokens.typecode!r}"
                )
        elif isinstance(tokens, str):
            raise InvalidTypeError("prompt_tokens must be token ids, not a str: tokenize the prompt first")
        elif isinstance(tokens, _IntegerArray):
            return _encode_numpy(tokens)
        elif not isinstance(tokens, Sequence):
            raise InvalidTypeError(
                f"prompt_tokens must be a list, tuple, array.array, numpy array or bytes of token ids, "
                f"not {type(tokens).__name__}"
            )
    try:
        packed = array.array(_UINT32, tokens)
    except (TypeError, OverflowError, ValueError):
        raise _bad_token(tokens) from None
    if _BIG_ENDIAN:  # pragma: no cover - every supported platform is little-endian
        packed.byteswap()
    return packed.tobytes()


_BYTE_FORMATS = frozenset({"B", "c"})  # what a memoryview of bytes, a bytearray or an mmap shows
_NATIVE_UINT32 = frozenset({"I", "@I", "=I", "<I", "L", "@L", "=L", "<L"})
_INTEGER_TYPECODES = frozenset("bBhHiIlLqQ")


def _encode_view(view: memoryview) -> bytes:
    """A memoryview of integers (not bytes), read by item: a 'Q' view of [1, 2] is two tokens, not four."""
    if view.ndim != 1:
        raise InvalidPromptError(
            f"a memoryview prompt must be 1-D (one prompt's token ids), not of shape {view.shape}: pass one row"
        )
    if view.format in _NATIVE_UINT32 and view.itemsize == 4 and not _BIG_ENDIAN:
        return view.tobytes()  # already uint32, little-endian
    try:
        items = view.tolist()
    except NotImplementedError:  # a non-native format such as '>I' or 'e'
        raise InvalidPromptError(
            f"a memoryview prompt of format {view.format!r} cannot be read: pass a list, or bytes of "
            "little-endian uint32 token ids"
        ) from None
    return encode_tokens(items)


def _encode_numpy(tokens: _IntegerArray) -> bytes:
    shape = getattr(tokens, "shape", None)
    if shape == ():
        raise InvalidTypeError(
            "prompt_tokens must be a sequence of token ids, not a numpy scalar or 0-d array: wrap it in a list"
        )
    if isinstance(shape, tuple) and len(shape) != 1:
        raise InvalidPromptError(
            f"a numpy prompt must be 1-D (one prompt's token ids), not of shape {shape}: pass one row, "
            "such as tokens[0]"
        )
    kind = getattr(tokens.dtype, "kind", "")
    if kind not in ("i", "u"):
        raise InvalidPromptError(f"a numpy prompt must have an integer dtype, not {tokens.dtype}")
    flat: Any = tokens.astype("int64").ravel() if kind == "i" else tokens.astype("uint64").ravel()
    if len(flat) and (flat.min() < 0 or flat.max() >= _TOKEN_LIMIT):
        raise _bad_token(flat.tolist())
    data: bytes = tokens.astype("<u4").tobytes()
    return data


def _bad_token(tokens: Any) -> InvalidPromptError:
    """Build the error for the first token id that is not an int in range (only called on failure)."""
    for position, token in enumerate(tokens):
        try:
            value = operator.index(token)  # an int, or what an int stands in for (numpy's), not an array of them
        except TypeError:
            return InvalidPromptError(
                f"token id at position {position} is {shown(token)} ({type(token).__name__}); token ids must be ints"
            )
        if not 0 <= value < _TOKEN_LIMIT:
            return InvalidPromptError(
                f"token id at position {position} is {shown(value)}; token ids must be in [0, 2**32)"
            )
    return InvalidPromptError("prompt_tokens could not be read as uint32 token ids")  # pragma: no cover


class BlockHasher:
    """Hash prompts into one chained 64-bit xxh3 hash per full block of ``block_size`` tokens.

    ``namespace`` (a model name, LoRA adapter name or cache salt) seeds the chain, so prompts under different
    namespaces never share a hash. Hashes are deterministic across processes and machines, and a hasher copies and
    pickles as its block size and namespace.

    >>> hasher = BlockHasher(block_size=4)
    >>> a = hasher.hash([1, 2, 3, 4, 5, 6, 7, 8, 9])
    >>> len(a)                      # the partial third block is not hashed
    2
    >>> hasher.hash([1, 2, 3, 4, 0, 0, 0, 0])[0] == a[0]
    True
    >>> hasher.hash([5, 6, 7, 8], parent=a[0]) == a[1:]   # continue a chain
    True
    """

    __slots__ = ("_block_bytes", "_block_size", "_namespace", "_seed", "_split_one", "_split_run")

    def __init__(self, block_size: int = 16, *, namespace: str | bytes | None = None) -> None:
        block_size = check_block_size(block_size)
        self._block_size = block_size
        self._block_bytes = 4 * block_size
        # Structs cut the blocks out in C, _RUN blocks per step and then one at a time: a sixth faster than one
        # at a time throughout, twice as fast as slicing in Python (benchmarks/bench_route.py times route()).
        code = f"{4 * block_size}s"
        self._split_run = struct.Struct(code * _RUN).iter_unpack
        self._split_one = struct.Struct(code).iter_unpack
        self._namespace = namespace
        self._seed = namespace_seed(namespace)

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self._block_size

    @property
    def namespace(self) -> str | bytes | None:
        """The namespace that seeds the chain, or None."""
        return self._namespace

    @property
    def seed(self) -> int:
        """The chain's root seed (0 without a namespace)."""
        return self._seed

    def hash(self, tokens: Tokens, *, parent: int | None = None) -> list[BlockHash]:
        """Return one chained hash per full block of ``tokens``; O(n).

        ``parent`` continues a chain: the first block of ``tokens`` is hashed as the block after the block whose
        hash is ``parent``. Raises :class:`InvalidPromptError` for bad token ids (see :func:`encode_tokens`) or a
        ``parent`` that is not a block hash.
        """
        seed = self._seed
        if parent is not None:
            start = as_int(parent)
            if start is None or not 0 <= start < _HASH_LIMIT:
                raise InvalidPromptError(f"parent must be a block hash, an int in [0, 2**64), not {shown(parent)}")
            seed = start
        return self.hash_encoded(encode_tokens(tokens), seed)

    def hash_encoded(self, data: bytes, seed: int) -> list[BlockHash]:
        """Hash already-encoded uint32 bytes from ``seed``; the hot path of :meth:`hash`, without checks."""
        view = memoryview(data)
        size = self._block_bytes
        full = len(data) // size * size
        runs = full - full % (size * _RUN)
        blocks = chain.from_iterable(chain(self._split_run(view[:runs]), self._split_one(view[runs:full])))
        digest = xxhash.xxh3_64_intdigest
        h = seed
        return cast("list[BlockHash]", [h := digest(block, h) for block in blocks])

    def __repr__(self) -> str:
        return f"BlockHasher(block_size={self._block_size}, namespace={self._namespace!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        """Copy and pickle as what it is made of, its block size and namespace (its C structs cannot be pickled)."""
        return _rebuild_hasher, (type(self), self._block_size, self._namespace)


def _rebuild_hasher(cls: type[BlockHasher], block_size: int, namespace: str | bytes | None) -> BlockHasher:
    return cls(block_size, namespace=namespace)


MAX_BLOCK_SIZE = 65536
"""The largest block size accepted, far above any vLLM attention backend's (they use 1 to a few hundred tokens)."""


def check_block_size(block_size: object) -> int:
    """Return ``block_size`` if it is an int in [1, :data:`MAX_BLOCK_SIZE`], else raise ConfigurationError."""
    size = as_int(block_size)
    if size is None or not 1 <= size <= MAX_BLOCK_SIZE:
        raise ConfigurationError(
            f"block_size must be an int in [1, {MAX_BLOCK_SIZE}] (vLLM's default is 16), not {shown(block_size)}"
        )
    return size


def namespace_seed(namespace: str | bytes | None) -> int:
    """Return the root seed of a namespace's hash chains: 0 for None, else a 64-bit hash of its UTF-8 bytes."""
    if namespace is None:
        return 0
    if isinstance(namespace, str):
        namespace = namespace.encode("utf-8", "surrogatepass")  # any str, even one with lone surrogates
    if not isinstance(namespace, bytes):
        raise InvalidTypeError(f"namespace must be a str, bytes or None, not {type(namespace).__name__}")
    return xxhash.xxh3_64_intdigest(b"prefixroute.namespace:" + namespace)
