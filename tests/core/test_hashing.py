from __future__ import annotations

import array
import copy
import pickle
import random
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from prefixroute import BlockHasher, ConfigurationError, InvalidPromptError, InvalidTypeError, encode_tokens
from prefixroute.hashing import MAX_BLOCK_SIZE, _decode_tokens

token_lists = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=200)
block_sizes = st.integers(min_value=1, max_value=32)


def test_one_hash_per_full_block_only() -> None:
    hasher = BlockHasher(block_size=16)
    assert hasher.hash(list(range(15))) == []
    assert len(hasher.hash(list(range(16)))) == 1
    assert len(hasher.hash(list(range(47)))) == 2
    assert hasher.hash([]) == []


def test_first_block_is_xxh3_of_little_endian_uint32_bytes_seeded_with_zero() -> None:
    tokens = list(range(100, 116))
    data = b"".join(t.to_bytes(4, "little") for t in tokens)
    assert BlockHasher(16).hash(tokens) == [xxhash.xxh3_64_intdigest(data, 0)]


@given(
    blocks=st.integers(min_value=0, max_value=200),
    partial=st.integers(min_value=0, max_value=3),
    block_size=st.integers(min_value=4, max_value=16),
    seed=st.integers(min_value=0),
    namespace=st.none() | st.text(max_size=8),
)
def test_hashes_follow_the_definition_across_every_split(
    blocks: int, partial: int, block_size: int, seed: int, namespace: str | None
) -> None:
    """Block i is xxh3_64(its uint32 bytes, seed=hash of block i-1): also past the 64-block runs the hasher cuts."""
    rng = random.Random(seed)
    tokens = [rng.randrange(2**32) for _ in range(blocks * block_size + partial)]
    hasher = BlockHasher(block_size, namespace=namespace)
    expected, h = [], hasher.seed
    for start in range(0, blocks * block_size, block_size):
        block = b"".join(t.to_bytes(4, "little") for t in tokens[start : start + block_size])
        h = xxhash.xxh3_64_intdigest(block, h)
        expected.append(h)
    assert hasher.hash(tokens) == expected


@given(tokens=token_lists, extra=token_lists, block_size=block_sizes)
def test_hash_of_a_prefix_is_a_prefix_of_the_hashes(tokens: list[int], extra: list[int], block_size: int) -> None:
    hasher = BlockHasher(block_size)
    assert hasher.hash(tokens + extra)[: len(tokens) // block_size] == hasher.hash(tokens)


@given(tokens=token_lists.filter(lambda t: len(t) >= 1), block_size=block_sizes, data=st.data())
def test_changing_one_token_changes_its_block_and_every_later_one(
    tokens: list[int], block_size: int, data: st.DataObject
) -> None:
    position = data.draw(st.integers(min_value=0, max_value=len(tokens) - 1))
    changed = list(tokens)
    changed[position] = (changed[position] + 1) % 2**32
    hasher = BlockHasher(block_size)
    before, after = hasher.hash(tokens), hasher.hash(changed)
    first_changed = position // block_size
    assert before[:first_changed] == after[:first_changed]
    # Chained: every block from the changed one on differs (64-bit collisions are not expected in a test run).
    assert all(b != a for b, a in zip(before[first_changed:], after[first_changed:], strict=True))


@given(tokens=token_lists, block_size=block_sizes)
def test_every_input_type_hashes_the_same(tokens: list[int], block_size: int) -> None:
    hasher = BlockHasher(block_size)
    expected = hasher.hash(tokens)
    packed = array.array("I", tokens)
    assert hasher.hash(tuple(tokens)) == expected
    assert hasher.hash(packed) == expected
    assert hasher.hash(array.array("q", tokens)) == expected
    assert hasher.hash(np.array(tokens, dtype=np.uint32)) == expected
    assert hasher.hash(np.array(tokens, dtype=np.int64)) == expected
    assert hasher.hash(packed.tobytes()) == expected
    assert hasher.hash(memoryview(packed)) == expected
    assert hasher.hash(bytearray(packed.tobytes())) == expected


@given(head=token_lists, tail=token_lists, block_size=block_sizes)
def test_parent_continues_a_chain(head: list[int], tail: list[int], block_size: int) -> None:
    hasher = BlockHasher(block_size)
    head = head[: len(head) // block_size * block_size]
    whole = hasher.hash(head + tail)
    if head:
        assert hasher.hash(tail, parent=whole[len(head) // block_size - 1]) == whole[len(head) // block_size :]


def test_namespaces_never_share_hashes() -> None:
    tokens = list(range(64))
    plain = BlockHasher(16).hash(tokens)
    llama = BlockHasher(16, namespace="llama-3-8b").hash(tokens)
    lora = BlockHasher(16, namespace=b"llama-3-8b/sql-lora").hash(tokens)
    assert len({*plain, *llama, *lora}) == 12
    assert BlockHasher(16, namespace="llama-3-8b").hash(tokens) == llama


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        ([1, 2, -3], "position 2 is -3"),
        ([1, 2**32], "position 1 is 4294967296"),
        ([0, 2**32], "position 1 is 4294967296"),  # 0 is a token id: the first bad one is named, not token 0
        ([1, 2.5], "position 1 is 2.5"),
        ([None], "position 0 is None"),
        (np.array([4, -1]), "position 1 is -1"),
        (np.array([4, 2**40]), "position 1 is 1099511627776"),
        (np.array([4, 2**32]), "position 1 is 4294967296"),  # the first id past uint32, not wrapped to 0
        (np.array([4, 2**64 - 1], dtype=np.uint64), "position 1 is 18446744073709551615;"),  # as given, an int
        (np.array([1.0, 2.0]), "integer dtype"),
        (b"\x00\x00\x00", "multiple of 4"),
    ],
)
def test_bad_tokens_name_the_position(tokens: object, message: str) -> None:
    with pytest.raises(InvalidPromptError, match=message):
        BlockHasher(16).hash(tokens)  # type: ignore[arg-type]


@pytest.mark.parametrize("tokens", ["hello", 42, {1, 2}, None])
def test_non_sequences_are_type_errors(tokens: object) -> None:
    with pytest.raises(TypeError):
        encode_tokens(tokens)  # type: ignore[arg-type]


@pytest.mark.parametrize("block_size", [0, -16, 1.5, True, "16"])
def test_block_size_must_be_a_positive_int(block_size: object) -> None:
    with pytest.raises(ConfigurationError, match="block_size"):
        BlockHasher(block_size)  # type: ignore[arg-type]


@pytest.mark.parametrize("parent", [-1, 2**64, "x", 1.0])
def test_parent_must_be_a_64_bit_hash(parent: object) -> None:
    with pytest.raises(ValueError, match="parent"):
        BlockHasher(4).hash([1, 2, 3, 4], parent=parent)  # type: ignore[arg-type]


# -- edges and messages (each test was written against a mutant of prefixroute/hashing.py that the suite let through) --


@given(tokens=token_lists)
def test_decode_tokens_gives_back_the_ids_encode_tokens_packed(tokens: list[int]) -> None:
    assert _decode_tokens(encode_tokens(tokens)) == tokens


def test_the_default_block_size_is_vllms_16_and_the_largest_accepted_is_max_block_size() -> None:
    assert BlockHasher().block_size == 16
    assert BlockHasher(MAX_BLOCK_SIZE).block_size == MAX_BLOCK_SIZE == 65536
    with pytest.raises(ConfigurationError, match=r"^block_size must be an int in \[1, 65536\] .*, not 65537$"):
        BlockHasher(MAX_BLOCK_SIZE + 1)


def test_parent_zero_is_the_root_of_a_chain_without_namespace() -> None:
    # seed: "The chain's root seed (0 without a namespace)"; so 0 is a block hash a chain may continue from.
    tokens = list(range(32))
    assert BlockHasher(16).hash(tokens, parent=0) == BlockHasher(16).hash(tokens)
    assert BlockHasher(16).hash(tokens, parent=2**64 - 1) != BlockHasher(16).hash(tokens)
    with pytest.raises(InvalidPromptError, match=r"^parent must be a block hash, an int in \[0, 2\*\*64\), not -1$"):
        BlockHasher(16).hash(tokens, parent=-1)


def test_a_namespace_may_be_any_str_even_a_lone_surrogate_and_nothing_else() -> None:
    tokens = list(range(16))
    lone = BlockHasher(16, namespace="model\ud800")
    assert lone.namespace == "model\ud800"
    assert lone.hash(tokens) != BlockHasher(16, namespace="model").hash(tokens)
    assert lone.seed == BlockHasher(16, namespace="model\ud800".encode("utf-8", "surrogatepass")).seed
    with pytest.raises(InvalidTypeError, match=r"^namespace must be a str, bytes or None, not int$"):
        BlockHasher(16, namespace=7)  # type: ignore[arg-type]


class _NamedHasher(BlockHasher):
    __slots__ = ()


@pytest.mark.parametrize("how", [copy.copy, copy.deepcopy, lambda h: pickle.loads(pickle.dumps(h))])
def test_a_hasher_copies_and_pickles_as_its_class_block_size_and_namespace(how: Callable[[Any], Any]) -> None:
    original = _NamedHasher(8, namespace="llama-3-8b")
    again = how(original)
    assert type(again) is _NamedHasher
    assert (again.block_size, again.namespace, again.seed) == (8, "llama-3-8b", original.seed)
    assert again.hash(list(range(24))) == original.hash(list(range(24)))


# format '>I'; through Any: numpy's stubs before 2.5 give ndarray the buffer protocol only on Python 3.12+ (mypy
# checks as 3.10), numpy 2.5's always, so an ignore comment fails one or the other
_BIG_ENDIAN_VIEW = memoryview(cast(Any, np.array([1], dtype=">u4")))


@pytest.mark.parametrize(
    ("tokens", "error", "message"),
    [
        ("hello", InvalidTypeError, r"^prompt_tokens must be token ids, not a str: tokenize the prompt first$"),
        ({1, 2}, InvalidTypeError, r"^prompt_tokens must be a list, tuple, array.array, numpy array or bytes of "
         r"token ids, not set$"),
        (b"\x00" * 5, InvalidPromptError, r"^a bytes prompt must hold little-endian uint32 token ids, but its "
         r"length 5 is not a multiple of 4$"),
        (_BIG_ENDIAN_VIEW, InvalidPromptError, r"^a memoryview prompt of format '>I' cannot be "
         r"read: pass a list, or bytes of little-endian uint32 token ids$"),
        (np.int64(3), InvalidTypeError, r"^prompt_tokens must be a sequence of token ids, not a numpy scalar or 0-d "
         r"array: wrap it in a list$"),
        (np.zeros((2, 4), dtype=np.int64), InvalidPromptError, r"^a numpy prompt must be 1-D \(one prompt's token "
         r"ids\), not of shape \(2, 4\): pass one row, such as tokens\[0\]$"),
    ],
)  # fmt: skip
def test_a_prompt_that_is_not_token_ids_says_what_to_pass(tokens: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        encode_tokens(tokens)  # type: ignore[arg-type]


class _ArrayLike:
    """An array with numpy's dtype and astype() but no shape: what encode_tokens' _IntegerArray protocol requires."""

    def __init__(self, values: list[int], dtype: Any) -> None:
        self._values, self.dtype = values, dtype

    def astype(self, dtype: str) -> Any:
        return np.array(self._values, dtype=dtype)


def test_an_integer_array_needs_only_dtype_and_astype() -> None:
    tokens = list(range(16))
    assert encode_tokens(_ArrayLike(tokens, np.dtype("int32"))) == encode_tokens(tokens)
    with pytest.raises(InvalidPromptError, match="must have an integer dtype, not int32"):
        encode_tokens(_ArrayLike(tokens, "int32"))  # a dtype without a kind is no integer dtype
