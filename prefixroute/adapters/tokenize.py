"""Route text prompts: tokenize them with the model's own tokenizer file, then route the token ids.

The router must see the token ids the engine will see, so use the model's ``tokenizer.json`` (Hugging Face
``tokenizers`` format) and apply the chat template before calling :meth:`TextRouter.route`. The file is read from a
local path: prefixroute never downloads anything.

Prompts rendered from chat templates repeat long pieces between special tokens (a system prompt, earlier turns), so
:class:`PromptTokenizer` keeps the ids of recent pieces and encodes only the new ones, as SGLang's gateway does.

>>> from prefixroute import Router
>>> text_router = TextRouter(Router(), PromptTokenizer.from_file("path/to/tokenizer.json"))  # doctest: +SKIP
>>> text_router.route("You are a helpful assistant. ...", ["gpu0", "gpu1"]).backend  # doctest: +SKIP
'gpu1'
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import cachetools
from tokenizers import Encoding, Tokenizer

from prefixroute._numbers import as_int, check_flag, shown
from prefixroute.errors import ConfigurationError, InvalidPromptError, InvalidTypeError
from prefixroute.router import Decision, Router

__all__ = ["PromptTokenizer", "TextRouter"]


class PromptTokenizer:
    """Text to token ids with a ``tokenizers.Tokenizer`` (thread-safe; encoding releases the GIL in Rust).

    Texts are cut into pieces whose ids are cached, so a long prefix that many texts share (a system prompt, earlier
    turns, few-shot examples) is encoded once: at the tokenizer's special tokens (``<|im_start|>``, ``[INST]``, ...),
    and, in a text or piece longer than 512 characters, at the first space between two ASCII letters after every 512
    characters (so texts that share a prefix are cut at the same places within it). The ids of each piece come from
    an LRU of up to ``cache_tokens`` ids when it was seen before (a piece of fewer ids than one per 64 characters,
    such as whitespace that the pre-tokenizer drops, is not cached), the other pieces are encoded, and the
    special tokens' own ids go between. The result is exactly what one ``encode`` of the whole text gives: the
    ``tokenizers`` library itself cuts a text at its added tokens and encodes the pieces apart, and a tokenizer whose
    pre-tokenizer splits words at spaces encodes the words on either side of one apart too.

    Where that does not hold, the text is not cut there. Not at special tokens nor between words: a tokenizer with a
    custom (Python) normalizer or pre-tokenizer, whose configuration cannot be read, a ``Metaspace``
    pre-tokenizer that marks only the text's first word (``prepend_scheme="first"``), an added token matched as a
    single word, truncation or padding, special tokens encoded as text (``encode_special_tokens``, as set when the
    tokenizer is given), or a post-processor whose added ids are not the same around every text. Not at a special
    token that strips the spaces around it, overlaps another added token, or is over 256 characters. Not between
    words: a normalizer that is not per character (``Prepend``, ``Replace``, ``Strip``, ...; Unicode normal forms,
    lower case and BERT's are), no pre-tokenizer that ends words at spaces (a ``Split`` that keeps a space with the
    word before does not), an added token that strips spaces or holds whitespace, or a tokenizer whose pre-tokenizer
    keeps two words together (SuperBPE's) or that gives other ids for any of a few probe texts cut between their words
    (checked once, here).
    ``cache_tokens=0`` turns the cache off.

    Raises:
        ConfigurationError: ``cache_tokens`` is not a non-negative int, ``add_special_tokens`` not a bool, or the
            tokenizer cannot encode a short probe text (e.g. its unknown token is missing from its vocabulary).
        TypeError: ``tokenizer`` is not a ``tokenizers.Tokenizer``.
    """

    def __init__(self, tokenizer: Tokenizer, *, add_special_tokens: bool = True, cache_tokens: int = 262_144) -> None:
        if not isinstance(tokenizer, Tokenizer):
            raise InvalidTypeError(f"tokenizer must be a tokenizers.Tokenizer, not {type(tokenizer).__name__}")
        cache_size = as_int(cache_tokens)
        if cache_size is None or cache_size < 0:
            raise ConfigurationError(
                f"cache_tokens must be a non-negative int number of ids, not {shown(cache_tokens)}"
            )
        cache_tokens = cache_size
        self._tokenizer = tokenizer
        self._add_special_tokens = check_flag(add_special_tokens, "add_special_tokens")
        config: dict[str, Any] = {}
        # A custom (Python) pre-tokenizer or normalizer has no config to read (the library raises a bare Exception):
        # whole texts are encoded.
        with contextlib.suppress(Exception):
            config = json.loads(tokenizer.to_str()) if cache_tokens else {}
        try:
            around = _added_around(tokenizer, add_special_tokens) if config and _cuttable(tokenizer, config) else None
            self._words = around is not None and _splits_between_words(tokenizer, config)
        except Exception as exc:  # tokenizers raises a bare Exception, e.g. for an unknown token not in its vocabulary
            raise ConfigurationError(f"the tokenizer cannot encode a short probe text: {exc}") from exc
        self._cuts = _cut_tokens(tokenizer) if around is not None else {}
        self._before, self._after = around or ([], [])
        self._splitter = re.compile("|".join(map(re.escape, self._cuts))) if self._cuts else None
        self._pieces: cachetools.LRUCache[str, list[int]] = cachetools.LRUCache(max(cache_tokens, 1), getsizeof=len)
        self._lock = threading.Lock()  # cachetools caches are not thread-safe

    @classmethod
    def from_file(
        cls, path: str | os.PathLike[str], *, add_special_tokens: bool = True, cache_tokens: int = 262_144
    ) -> PromptTokenizer:
        """Load a local ``tokenizer.json``.

        Raises:
            ConfigurationError: ``path`` is empty or blank, or the file is missing, is no regular file (a folder, a
                pipe, a device: none is opened), is not a tokenizer file or holds a tokenizer that cannot encode a
                short probe text (each named with the file).
            TypeError: ``path`` is not a str or path (nor is a path object whose ``os.fspath()`` is bytes).
        """
        file = tokenizer_path(path)
        if not _looked_up(file.is_file):
            problem = "is not a regular file" if _looked_up(file.exists) else "not found"
            raise ConfigurationError(
                f"tokenizer file {str(file)!r} {problem}: pass the path of the model's local tokenizer.json "
                "(prefixroute never downloads tokenizers)"
            )
        try:
            tokenizer = Tokenizer.from_file(str(file))
        except Exception as exc:  # tokenizers raises a bare Exception for malformed files
            raise ConfigurationError(f"{str(file)!r} is not a valid tokenizer.json: {exc}") from exc
        try:
            return cls(tokenizer, add_special_tokens=add_special_tokens, cache_tokens=cache_tokens)
        except ConfigurationError as exc:
            if exc.__cause__ is None:  # an option refused, not the file
                raise
            raise ConfigurationError(f"tokenizer file {str(file)!r}: {exc}") from exc.__cause__

    @property
    def caches_pieces(self) -> bool:
        """Whether texts are cut at special tokens or between words and their pieces cached (see the class
        docstring)."""
        return self._splitter is not None or self._words

    def encode(self, text: str) -> list[int]:
        """Return the token ids of ``text``. O(len(text)); the encoding itself O(the pieces not cached)."""
        if not isinstance(text, str):
            raise InvalidTypeError(f"text must be a str, not {type(text).__name__}")
        cuts = self._splitter.findall(text) if self._splitter is not None else []
        if cuts or (self._words and len(text) > _CHUNK_CHARS):
            try:
                pieces = self._splitter.split(text) if self._splitter is not None and cuts else [text]
                return self._encode_pieces(pieces, cuts)
            except InvalidPromptError:  # name the position in the whole text, not in its piece
                raise _surrogate_error(text) or InvalidPromptError("the text is not valid Unicode") from None
        # encode_batch_fast skips the character offsets that encode computes: ~40 % less time, the same ids.
        encoding = self._encode([text], add_special_tokens=self._add_special_tokens)[0]
        ids: list[int] = encoding.ids
        return ids

    def _encode_pieces(self, pieces: list[str], cuts: list[str]) -> list[int]:
        """The ids of ``pieces[0] cuts[0] pieces[1] ... pieces[-1]``: each piece cut between words when it is long,
        the cached parts looked up, the others encoded."""
        parts = [_between_words(piece) if self._words else [piece] for piece in pieces]
        flat = [part for each in parts for part in each if part]
        with self._lock:
            known = {part: ids for part in flat if (ids := self._pieces.get(part)) is not None}
        missing = list(dict.fromkeys(part for part in flat if part not in known))
        if missing:
            # One call a part: a batch of several would fan out over the library's thread pool, whose threads spin
            # while they wait (~40 % more CPU for two parts of 1K characters than one call for both).
            fresh = {part: self._encode([part], add_special_tokens=False)[0].ids for part in missing}
            with self._lock:
                for part, ids in fresh.items():
                    # Not a piece of few ids for its length (whitespace between two special tokens, which some
                    # pre-tokenizers drop): weighed by its ids, it would hold its text for nothing, never evicted.
                    # Nor one over the size, which cachetools refuses (raises for).
                    if len(part) <= _CHARS_PER_CACHED_ID * len(ids) and len(ids) <= self._pieces.maxsize:
                        self._pieces[part] = ids
            known.update(fresh)
        out = list(self._before)
        for i, each in enumerate(parts):
            if i:
                out.append(self._cuts[cuts[i - 1]])
            for part in each:
                if part:
                    out += known[part]
        out += self._after
        return out

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Return the token ids of each text, encoded in parallel by the Rust library (no piece cache). O(total length).

        Raises:
            TypeError: ``texts`` is not a list or tuple (or other sequence) of str: a str, bytes or an iterator is
                refused, and the message names the first item that is not a str (``texts[1]``).
            InvalidPromptError: a text holds a lone surrogate; the message names which text and where.
        """
        if isinstance(texts, (str, bytes)) or not isinstance(texts, Sequence):
            raise InvalidTypeError(f"texts must be a sequence of str (a list or tuple), not {type(texts).__name__}")
        batch = list(texts)
        for position, text in enumerate(batch):
            if not isinstance(text, str):
                raise InvalidTypeError(f"texts[{position}] must be a str, not {type(text).__name__}")
        encodings = self._encode(batch, add_special_tokens=self._add_special_tokens, named=True)
        return [encoding.ids for encoding in encodings]

    def _encode(self, texts: list[str], *, add_special_tokens: bool, named: bool = False) -> list[Encoding]:
        """``encode_batch_fast``, with a clear error for text that is not valid Unicode (a lone surrogate, which
        JSON's ``\\ud800`` escapes can carry) instead of the library's ``TypeError`` about input types; ``named``:
        the error names the text as ``texts[i]``."""
        try:
            encodings: list[Encoding] = self._tokenizer.encode_batch_fast(texts, add_special_tokens=add_special_tokens)
        except TypeError:
            for position, text in enumerate(texts):
                if (error := _surrogate_error(text, f"texts[{position}]" if named else "the text")) is not None:
                    raise error from None
            raise
        return encodings


def tokenizer_path(path: object) -> Path:
    """``path`` as a Path, else InvalidTypeError (a str or an ``os.PathLike`` giving a str is one, bytes are not);
    ConfigurationError for an empty or blank str, which names no file (an unset ``"$TOKENIZER"``: ``Path("")`` is
    the current folder)."""
    if not isinstance(path, (str, os.PathLike)):
        raise InvalidTypeError(f"a tokenizer path is a str or a path, not {type(path).__name__}")
    if isinstance(path, str) and not path.strip():
        raise ConfigurationError(f"a tokenizer path must name a tokenizer.json or a model folder, not {path!r}")
    try:
        return Path(path)
    except TypeError:  # an os.PathLike whose __fspath__() gives bytes
        raise InvalidTypeError(
            f"a tokenizer path is a str or a path, not {type(path).__name__} (its os.fspath() is bytes)"
        ) from None


def is_folder(path: Path) -> bool:
    """``path.is_dir()``, False for a path the OS cannot even look up (a name too long, a NUL byte)."""
    return _looked_up(path.is_dir)


def _looked_up(test: Callable[[], bool]) -> bool:
    try:
        return test()
    except (OSError, ValueError):  # Path.is_file() and is_dir() raise these for a name too long or a NUL byte
        return False


def _surrogate_error(text: str, name: str = "the text") -> InvalidPromptError | None:
    """The error for a text holding a lone surrogate (which cannot be UTF-8), or None when it has none. O(n)."""
    position = next((i for i, c in enumerate(text) if "\ud800" <= c <= "\udfff"), None)
    if position is None:
        return None
    return InvalidPromptError(
        f"{name} has a lone surrogate (U+{ord(text[position]):04X}) at character {position}: send valid Unicode text"
    )


_LONG_TOKEN = 256
"""Added tokens longer than this (no real special token is) are never cuts."""
_CHUNK_CHARS = 512
"""A text or piece longer than this is cut between words after about every this many characters."""
_CHARS_PER_CACHED_ID = 64
"""A piece is cached only with at least one id for every this many of its characters, so the cache's memory is
bounded by ``cache_tokens`` (a token is 3 to 5 characters of text; no real one is 64)."""
_WORD_GAP = re.compile(r"(?<=[A-Za-z]) (?=[A-Za-z])")
"""Where a text is cut between words: at a space between two ASCII letters, which ends a word in every pre-tokenizer
that splits words at spaces (the space goes with the next word or on its own, never with the word before)."""
_WORD_PROBES = (
    "The quick brown Fox jumps over the lazy DOG, doesn't it? It's 12:30 and they'll say NO to x y z.",
    "SELECT name FROM orders WHERE id IN (1, 2) AND total IS NULL; def f(a b): return a b",
    "naive cafe na\u00efve caf\u00e9 Zurich \u65e5\u672c\u8a9e text  two\tspaces\nnew line ok OK oK Ok",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z A B C I am I'm you're we've",
)
"""Texts that a tokenizer must encode to the same ids whole and cut at each of their word gaps."""


def _between_words(piece: str) -> list[str]:
    """``piece`` cut at the first word gap at or after every ``_CHUNK_CHARS`` characters (one part when short).
    O(len(piece))."""
    if len(piece) <= _CHUNK_CHARS:
        return [piece]
    parts = []
    start = 0
    while (gap := _WORD_GAP.search(piece, start + _CHUNK_CHARS)) is not None:
        parts.append(piece[start : gap.start()])
        start = gap.start()
    parts.append(piece[start:])
    return parts


def _cuttable(tokenizer: Tokenizer, config: dict[str, Any]) -> bool:
    """Whether a text can be cut anywhere without changing its ids (see PromptTokenizer's docstring)."""
    if tokenizer.truncation is not None or tokenizer.padding is not None:
        return False
    if getattr(tokenizer, "encode_special_tokens", False):  # special tokens read as text: no cut is where it seems
        return False
    if _any_node(config.get("pre_tokenizer"), _first_only_metaspace):
        return False
    return not any(token.single_word for token in tokenizer.get_added_tokens_decoder().values())


def _splits_between_words(tokenizer: Tokenizer, config: dict[str, Any]) -> bool:
    """Whether a text can be cut at a word gap without changing its ids. O(the probes), once per tokenizer."""
    if not _any_node(config.get("pre_tokenizer"), _splits_at_spaces) or not _per_character(config.get("normalizer")):
        return False
    for token in tokenizer.get_added_tokens_decoder().values():
        if token.lstrip or token.rstrip or any(c.isspace() for c in token.content):
            return False
    for probe in _WORD_PROBES:
        gaps = [gap.start() for gap in _WORD_GAP.finditer(probe)]
        texts = [probe] + [side for gap in gaps for side in (probe[:gap], probe[gap:])]
        # The model encodes each pre-token apart, so the pre-tokens decide for any vocabulary; the ids alone would
        # pass a pre-tokenizer that keeps words together (SuperBPE's) when no merge across these probes' gaps exists.
        words = [_pre_tokens(tokenizer, text) for text in texts]
        ids = [encoding.ids for encoding in tokenizer.encode_batch_fast(texts, add_special_tokens=False)]
        if any(
            words[1 + 2 * i] + words[2 + 2 * i] != words[0] or ids[1 + 2 * i] + ids[2 + 2 * i] != ids[0]
            for i in range(len(gaps))
        ):
            return False
    return True


def _pre_tokens(tokenizer: Tokenizer, text: str) -> list[str]:
    """The pre-tokens the tokenizer's model sees for ``text`` (a text without added tokens)."""
    if tokenizer.normalizer is not None:
        text = tokenizer.normalizer.normalize_str(text)
    return [word for word, _ in tokenizer.pre_tokenizer.pre_tokenize_str(text)]


_PER_CHARACTER = frozenset({"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "StripAccents", "BertNormalizer"})


def _per_character(normalizer: object) -> bool:
    """Whether a normalizer's config (tokenizer.json's ``normalizer``) maps a text piece by piece: none, Unicode
    normal forms, lower case, BERT's, or a sequence of those. ``Prepend``, ``Strip``, ``Replace``, ``Precompiled``
    (SentencePiece's, which can fold whitespace) ... are not."""
    if normalizer is None:
        return True
    if not isinstance(normalizer, dict):
        return False
    if normalizer.get("type") == "Sequence":
        members = normalizer.get("normalizers")
        return isinstance(members, list) and all(_per_character(member) for member in members)
    return normalizer.get("type") in _PER_CHARACTER


def _cut_tokens(tokenizer: Tokenizer) -> dict[str, int]:
    """The special tokens a text can be cut at without changing its ids ({content: id}), for a tokenizer that is
    :func:`_cuttable`; empty when none can."""
    added = tokenizer.get_added_tokens_decoder()
    cuts = {
        token.content: token_id
        for token_id, token in added.items()
        if token.special and token.content and not (token.lstrip or token.rstrip or token.normalized)
    }
    # The library matches added tokens leftmost-longest; a cut that another added token contains or overlaps could
    # be matched differently there, so it is not a cut.
    overlapping = _overlapping(cuts, [token.content for token in added.values() if token.content])
    return {cut: token_id for cut, token_id in cuts.items() if cut not in overlapping}


def _overlapping(cuts: Iterable[str], contents: Iterable[str]) -> set[str]:
    """The ``cuts`` that another of the added tokens' ``contents`` contains, lies inside, or can overlap in a text (an
    end of one the start of the other). O(sum of each short content's length cubed, plus the long ones' lengths times
    the cuts'), once per tokenizer: a token over ``_LONG_TOKEN`` characters is never a cut, and is checked against
    each cut directly rather than through all its substrings."""
    contents = list(contents)
    tokens = {token for token in contents if len(token) <= _LONG_TOKEN}
    long = [token for token in contents if len(token) > _LONG_TOKEN]
    inner: set[str] = set()  # every substring of a token but the token itself
    starts: set[str] = set()  # proper prefixes
    ends: set[str] = set()  # proper suffixes
    for token in tokens:
        length = len(token)
        for i in range(length):
            inner.update(token[i:j] for j in range(i + 1, length + 1) if j - i < length)
        starts.update(token[:n] for n in range(1, length))
        ends.update(token[-n:] for n in range(1, length))
    found = set()
    for cut in cuts:
        length = len(cut)
        if length > _LONG_TOKEN or any(
            cut in token or any(token.startswith(cut[-n:]) or token.endswith(cut[:n]) for n in range(1, length))
            for token in long
        ):
            found.add(cut)
            continue
        parts = (cut[i:j] for i in range(length) for j in range(i + 1, length + 1) if j - i < length)
        # The cut's own borders count too (an end that is also its start), which only makes a token with a border
        # (none of the usual special tokens has one) not a cut.
        if (
            cut in inner
            or any(part in tokens for part in parts)
            or any(cut[-n:] in starts or cut[:n] in ends for n in range(1, length))
        ):
            found.add(cut)
    return found


def _any_node(node: object, test: Callable[[dict[str, Any]], bool]) -> bool:
    """Whether ``test`` holds for an object anywhere in ``node``, a part of a tokenizer.json."""
    if isinstance(node, dict):
        return test(node) or any(_any_node(value, test) for value in node.values())
    if isinstance(node, list):
        return any(_any_node(value, test) for value in node)
    return False


def _first_only_metaspace(node: dict[str, Any]) -> bool:
    return node.get("type") == "Metaspace" and node.get("prepend_scheme", "always") == "first"


def _splits_at_spaces(node: dict[str, Any]) -> bool:
    """Whether a pre-tokenizer ends words at spaces (a ``Split`` with its own pattern: the probes tell)."""
    kind = node.get("type")
    return (
        kind in ("Whitespace", "WhitespaceSplit", "BertPreTokenizer")
        or (kind == "Split" and node.get("behavior") != "MergedWithPrevious")  # not a space kept with the word before
        or (kind == "ByteLevel" and node.get("use_regex", True) is True)
        or (kind == "Metaspace" and node.get("split", True) is True)
    )


def _added_around(tokenizer: Tokenizer, add_special_tokens: bool) -> tuple[list[int], list[int]] | None:
    """The ids the post-processor puts before and after a text's own, or None when they differ between texts."""
    if not add_special_tokens:
        return [], []
    found: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
    for probe in ("a", "b c", "1 2 3", "x y"):
        bare = tokenizer.encode(probe, add_special_tokens=False).ids
        full = tokenizer.encode(probe, add_special_tokens=True).ids
        starts = [i for i in range(len(full) - len(bare) + 1) if full[i : i + len(bare)] == bare]
        if len(starts) != 1 or not bare:
            return None
        found.add((tuple(full[: starts[0]]), tuple(full[starts[0] + len(bare) :])))
    if len(found) != 1:
        return None
    before, after = found.pop()
    return list(before), list(after)


def serialise_chat(messages: Sequence[Mapping[str, Any]]) -> str:
    """Messages as ``<|role|>\\ncontent\\n`` blocks then ``<|assistant|>\\n``, for models without a chat template.

    A list content is joined from its parts' string ``text``; any other non-string content, and a non-string role
    (JSON ``null``, a number: the engine refuses such a request), count as empty.
    Conversations that share their first messages then share a text prefix (not the engine's exact tokens).
    O(total length).

    Raises:
        TypeError: ``messages`` is not a sequence (a str is not one).
        InvalidPromptError: a message is not an object (a mapping).
    """
    check_chat(messages)
    parts = [f"<|{_role(message.get('role'))}|>\n{_content(message.get('content'))}\n" for message in messages]
    parts.append("<|assistant|>\n")
    return "".join(parts)


def check_chat(messages: object) -> None:
    """Raise unless ``messages`` is a sequence of mappings (each message an object), as chat rendering reads them.

    Raises:
        TypeError: ``messages`` is not a sequence (a str is not one).
        InvalidPromptError: a message is not an object (a mapping).
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise InvalidTypeError(
            f'chat messages must be a list of {{"role", "content"}} objects, not {type(messages).__name__}'
        )
    for position, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidPromptError(
                f"chat message {position} is a {type(message).__name__}, not an object with a 'role' and a 'content'"
            )


def _role(role: object) -> str:
    return role if isinstance(role, str) else ""


def _content(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = (part.get("text") for part in content if isinstance(part, Mapping))
        return "".join(text for text in texts if isinstance(text, str))
    return ""


class TextRouter:
    """A :class:`~prefixroute.Router` for gateways that hold text: tokenize, then route the token ids.

    Raises:
        TypeError: ``router`` is not a :class:`~prefixroute.Router`, or ``tokenizer`` not a :class:`PromptTokenizer`
            (a bare ``tokenizers.Tokenizer`` is refused: wrap it, ``PromptTokenizer(tokenizer)``).
    """

    def __init__(self, router: Router, tokenizer: PromptTokenizer) -> None:
        if not isinstance(router, Router):
            raise InvalidTypeError(f"router must be a prefixroute.Router, not {type(router).__name__}")
        if not isinstance(tokenizer, PromptTokenizer):
            hint = (
                " (wrap a tokenizers.Tokenizer: PromptTokenizer(tokenizer))" if isinstance(tokenizer, Tokenizer) else ""
            )
            raise InvalidTypeError(f"tokenizer must be a PromptTokenizer, not {type(tokenizer).__name__}{hint}")
        self.router = router
        self.tokenizer = tokenizer

    def route(self, text: str, backends: Sequence[str], *, namespace: str | bytes | None = None) -> Decision:
        """Tokenize ``text`` and route it; raises what :meth:`Router.route` raises, and ``TypeError`` for non-str."""
        return self.router.route(self.tokenizer.encode(text), backends, namespace=namespace)
