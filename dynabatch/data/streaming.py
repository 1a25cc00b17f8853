"""The tokenize stage, streamed: :class:`TokenStream` tokenizes a corpus chunk by chunk, longest first, behind the run.

Tokenizing a whole corpus before the first batch keeps the device idle for
minutes at ten million texts. A :class:`TokenStream` orders the texts by their
length in characters (free to read, and close to their order in tokens),
cuts that order into chunks (a small first one, then larger ones) and
tokenizes them in a background thread (:meth:`TokenStream.feed`), so the
longest texts run while the rest are still being tokenized. Each chunk is
then sorted by its real token lengths by the planner
(:class:`~dynabatch.sampling.chunked_planner.ChunkedPlanner`): the characters
only decide which texts are tokenized first, the tokenizer decides the batches.

The rule where the proxy errs: a text longer in tokens than every text of the
chunks before its own (a row of symbols, code, another script) is counted
(:attr:`ChunkFeed.proxy_misses`, logged) and, in ``run``'s measured mode, runs
in a batch sized by what was measured at its width or above: with nothing
measured as wide, one row, measured, so the bound covers it from then on.

The tokenizer runs on a private copy (a fast tokenizer's settings are not safe
to change while another thread encodes or decodes with it), with the loader's
arguments, exactly as :func:`~dynabatch.data.tokenization.tokenize_texts` calls it.

Example:
    >>> from transformers import AutoTokenizer
    >>> from dynabatch.demo import minilm_path
    >>> from dynabatch.data.streaming import TokenStream
    >>> from dynabatch.data.text_source import TextSource
    >>> tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    >>> stream = TokenStream(TextSource(["a b", "a b c d", "a"]), tokenizer, 16, first_chunk=2, chunk_size=2)
    >>> stream.n_chunks, stream.chunk_positions(0).tolist()  # longest by characters first
    (2, [1, 0])
    >>> feed = stream.feed(iter(range(stream.n_chunks)))
    >>> [(p.tolist(), n.tolist()) for p, n in iter(feed.next, None)]
    [([1, 0], [6, 4]), ([2], [3])]
    >>> stream.collate([2, 0])["input_ids"].tolist()
    [[101, 1037, 102, 0], [101, 1037, 1038, 102]]
"""

from __future__ import annotations

import copy
import itertools
import logging
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from dynabatch._background import Ahead
from dynabatch._malloc import trim
from dynabatch._validation import bad_value, check_positive_int
from dynabatch.data.collate import Batch, TokenCollator, pad_token_id_of
from dynabatch.data.text_source import TextSource
from dynabatch.data.tokenization import TokenizedTexts, tokenize_texts

__all__ = ["ChunkFeed", "TokenStream"]

logger = logging.getLogger(__name__)

FIRST_CHUNK = 512
"""Texts of the first chunk (at least four first batches): what is tokenized before the first batch can run."""
CHUNK_SIZE = 8192
"""Texts of the later chunks, at most (each chunk is twice the one before up to this)."""


class TokenStream:
    """A corpus tokenized chunk by chunk, longest by characters first; builds the batches of tokenized rows.

    Args:
        source: the texts (:class:`~dynabatch.data.text_source.TextSource`).
        tokenizer: the tokenizer (copied: the copy runs in the background).
        max_input_token_length: the truncation limit, in tokens.
        skip: input positions to tokenize and plan nowhere (bad inputs skipped).
        first_chunk: texts of the first chunk; later chunks double up to ``chunk_size``.
        chunk_size: texts of a later chunk, at most.
        pad_to_multiple_of: rounds each batch's width up.
        with_texts: give each batch its texts (``batch.texts``).
        **tokenizer_kwargs: passed to every tokenizer call.

    It acts as the loader's collator: ``stream(positions)`` builds a batch, and
    ``pad_token_id``, ``padding_side`` and ``pad_to_multiple_of`` are the padding's.
    """

    def __init__(self, source: TextSource, tokenizer: Any, max_input_token_length: int, *, skip: Any = None,
                 first_chunk: int = FIRST_CHUNK, chunk_size: int = CHUNK_SIZE, pad_to_multiple_of: int | None = None,
                 with_texts: bool = True, **tokenizer_kwargs: Any) -> None:
        first_chunk = check_positive_int("first_chunk", first_chunk)
        chunk_size = max(first_chunk, check_positive_int("chunk_size", chunk_size))
        self.source, self.n = source, len(source)
        self.max_input_token_length = max_input_token_length
        self.tokenizer_kwargs = tokenizer_kwargs
        self.with_texts = with_texts
        self.pad_token_id = pad_token_id_of(tokenizer)
        self.padding_side = getattr(tokenizer, "padding_side", "right")
        self.pad_to_multiple_of = pad_to_multiple_of
        self._template = tokenizer
        self._tokenizer = copy.deepcopy(tokenizer)
        chars = source.char_lengths()
        if skip is not None and len(skip):
            chars = chars.copy()
            chars[np.asarray(skip, dtype=np.int64)] = -1
        order = np.argsort(-chars, kind="stable")
        self.order = order[chars[order] >= 0]
        sizes, total = [], 0
        while total < len(self.order):
            sizes.append(min(first_chunk * 2 ** len(sizes), chunk_size, len(self.order) - total))
            total += sizes[-1]
        self.starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        self.chunk_of = np.full(self.n, -1, dtype=np.int32)
        self.local_of = np.zeros(self.n, dtype=np.int64)
        self._collators: dict[int, TokenCollator] = {}
        self._lock = threading.Lock()
        self._tokenizing = threading.Lock()  # one chunk at a time on the private tokenizer
        self._direct: bool | None = None  # whether the backend gives the tokenizer's tokens (None: not checked)

    @property
    def n_chunks(self) -> int:
        return len(self.starts) - 1

    def __repr__(self) -> str:
        return f"{type(self).__name__}(texts={self.n}, chunks={self.n_chunks}, tokenized={len(self._collators)})"

    @property
    def token_bytes(self) -> int:
        """Bytes of the tokens held so far (ids and extras of every chunk tokenized)."""
        return sum(c.tokenized.input_ids.nbytes + sum(v.nbytes for v in c.tokenized.extras.values())
                   for c in list(self._collators.values()))

    def chunk_positions(self, k: int) -> np.ndarray:
        """The input positions of chunk ``k``, longest by characters first."""
        return self.order[self.starts[k] : self.starts[k + 1]]

    def tokenize(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokenizes chunk ``k`` (once); returns its input positions and their token lengths."""
        positions = self.chunk_positions(k)
        with self._tokenizing:
            collator = self._collators.get(k)
            if collator is None:
                tokens = self._encode(self.source.take(positions))
                collator = TokenCollator.from_tokenizer(tokens, self._template,
                                                        pad_to_multiple_of=self.pad_to_multiple_of)
                with self._lock:
                    self.local_of[positions] = np.arange(len(positions))
                    self.chunk_of[positions] = k
                    self._collators[k] = collator
                trim()  # the chunk's encodings are freed: give their heap back, so memory grows with the tokens only
        return positions, collator.tokenized.lengths

    def _encode(self, texts: list[str]) -> TokenizedTexts:
        """The chunk's tokens, as :func:`~dynabatch.data.tokenization.tokenize_texts` gives them.

        A fast tokenizer's Rust backend is called directly when it gives the
        same tokens (checked on the first chunk against the tokenizer's own
        call; else every chunk takes the tokenizer's call): it skips the
        Python-side conversion, which holds the GIL while the device waits.
        """
        if self._direct is None:
            tokens = tokenize_texts(texts, self._tokenizer, self.max_input_token_length, progress=False,
                                    **self.tokenizer_kwargs)
            direct = self._backend_tokens(texts)
            self._direct = direct is not None and _same_tokens(direct, tokens)
            logger.debug("stream: tokenizing through the fast tokenizer's backend: %s", self._direct)
            return tokens
        if self._direct:
            return self._backend_tokens(texts)
        return tokenize_texts(texts, self._tokenizer, self.max_input_token_length, progress=False,
                              **self.tokenizer_kwargs)

    def _backend_tokens(self, texts: list[str]) -> TokenizedTexts | None:
        """The texts through the private tokenizer's Rust backend, truncated as the tokenizer's call truncates;
        ``None`` when there is no backend or the loader passes arguments only the call knows."""
        backend = getattr(self._tokenizer, "_tokenizer", None)
        if backend is None or not hasattr(backend, "encode_batch") or set(self.tokenizer_kwargs) - {"add_special_tokens"}:
            return None
        backend.no_padding()
        backend.enable_truncation(self.max_input_token_length, strategy="longest_first",
                                  direction=getattr(self._tokenizer, "truncation_side", "right"))
        encodings = backend.encode_batch(texts, add_special_tokens=self.tokenizer_kwargs.get("add_special_tokens", True))
        lengths = np.fromiter((len(e) for e in encodings), dtype=np.int64, count=len(encodings))
        offsets = np.zeros(len(texts) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        total = int(offsets[-1])
        ids = np.fromiter(itertools.chain.from_iterable(e.ids for e in encodings), dtype=np.int32, count=total)
        extras = {}
        if "token_type_ids" in getattr(self._tokenizer, "model_input_names", ()):
            extras["token_type_ids"] = np.fromiter(itertools.chain.from_iterable(e.type_ids for e in encodings),
                                                   dtype=np.int32, count=total)
        return TokenizedTexts(ids, offsets, extras)

    def input_hashes(self, positions: Any) -> np.ndarray:
        """TEMPORARY (the data branch replaces it): the input hashes of the rows at ``positions``."""
        from dynabatch.data.input_hashes import token_store_hashes

        with self._tokenizing:
            return token_store_hashes(self._encode(self.source.take(np.asarray(positions, dtype=np.int64))))

    def consumed(self, positions: Any) -> None:
        """TEMPORARY (the data branch replaces it): rows finished."""

    def feed(self, claims: Iterator[int], *, ahead: int | None = None) -> ChunkFeed:
        """Tokenizes the chunks ``claims`` names, in that order, in a background thread (see :class:`ChunkFeed`)."""
        return ChunkFeed(self, claims, ahead=ahead)

    def __call__(self, positions: Any) -> Batch:
        return self.collate(positions)

    def collate(self, positions: Any) -> Batch:
        """The padded batch of ``positions`` (rows of one tokenized chunk), as the loader's collator builds it."""
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        if not pos.size:
            raise bad_value("positions", "a non-empty sequence of input positions", positions)
        chunks = np.unique(self.chunk_of[pos])
        if chunks[0] < 0:
            raise ValueError(f"positions should be rows of tokenized chunks, but got {np.sum(self.chunk_of[pos] < 0)} "
                             f"rows not tokenized yet (positions {pos[self.chunk_of[pos] < 0][:5].tolist()})")
        first = self._collators[int(chunks[0])]
        if len(chunks) == 1:  # a planned batch: one gather from its chunk's store
            batch = first(self.local_of[pos])
        else:  # rows of several chunks (a batch picked by hand): their tokens gathered first
            batch = TokenCollator(self._gather(pos), pad_token_id=self.pad_token_id, padding_side=self.padding_side,
                                  pad_to_multiple_of=self.pad_to_multiple_of,
                                  pad_values=first.pad_values)(np.arange(len(pos)))
        texts = self.source.take(pos) if self.with_texts else None
        return Batch(dict(batch), indices=batch.indices.new_tensor(pos), texts=texts)

    def _gather(self, pos: np.ndarray) -> TokenizedTexts:
        """The tokens of the rows at ``pos`` (tokenized, of any chunks), as a store of their own."""
        stores = [self._collators[int(k)].tokenized for k in self.chunk_of[pos]]
        rows = [store.row(int(i)) for store, i in zip(stores, self.local_of[pos])]
        offsets = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int64)
        extras = {key: np.concatenate([store.extras[key][store.offsets[i]: store.offsets[i + 1]]
                                       for store, i in zip(stores, self.local_of[pos])])
                  for key in stores[0].extras}
        return TokenizedTexts(np.concatenate(rows), offsets, extras)

    @property
    def tokenized(self) -> TokenizedTexts:
        """Every text's tokens in input order (tokenizes what is left, and copies: for code that needs the whole
        store; a run streams without it). Skipped positions are empty rows."""
        for k in range(self.n_chunks):
            self.tokenize(k)
        lengths = np.zeros(self.n, dtype=np.int64)
        parts = {}
        for k, collator in sorted(self._collators.items()):
            positions = self.chunk_positions(k)
            lengths[positions] = collator.tokenized.lengths
            parts[k] = (positions, collator.tokenized)
        offsets = np.zeros(self.n + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        keys = ["input_ids", *next(iter(parts.values()))[1].extras] if parts else ["input_ids"]
        flat = {key: np.zeros(int(offsets[-1]), dtype=np.int32) for key in keys}
        for positions, tokens in parts.values():
            starts = np.repeat(offsets[positions] - tokens.offsets[:-1], tokens.lengths)
            where = starts + np.arange(len(tokens.input_ids))
            for key in keys:
                flat[key][where] = tokens.input_ids if key == "input_ids" else tokens.extras[key]
        return TokenizedTexts(flat.pop("input_ids"), offsets, flat)


def _same_tokens(a: TokenizedTexts, b: TokenizedTexts) -> bool:
    return (np.array_equal(a.offsets, b.offsets) and np.array_equal(a.input_ids, b.input_ids)
            and a.extras.keys() == b.extras.keys() and all(np.array_equal(a.extras[k], b.extras[k]) for k in a.extras))


class ChunkFeed:
    """Chunks tokenized in a background thread, handed out in the order they were claimed.

    Args:
        stream: the :class:`TokenStream`.
        claims: the chunk numbers to tokenize, in order (``range(n_chunks)``,
            or a counter shared with other ranks that hands each chunk to one rank).
        ahead: chunks tokenized ahead of the consumer, at most (``None``: no bound).

    The thread starts at the first :meth:`next` (or :meth:`start`), which
    blocks until the next chunk is tokenized; an error in the thread is raised
    there (:class:`~dynabatch._background.Ahead`). :attr:`proxy_misses` counts
    rows longer in tokens than every row of the chunks handed out before theirs.
    """

    NOT_READY = Ahead.NOT_READY

    def __init__(self, stream: TokenStream, claims: Iterator[int], *, ahead: int | None = None) -> None:
        self.stream = stream
        self.proxy_misses = 0
        self._longest = 0
        self._chunks = Ahead((stream.tokenize(k) for k in claims), depth=ahead, name="dynabatch-tokenize")

    def start(self) -> None:
        """Starts tokenizing (the first :meth:`next` does, so a feed no one reads tokenizes nothing)."""
        self._chunks.start()

    def next(self, block: bool = True) -> tuple[np.ndarray, np.ndarray] | None | object:
        """``(positions, token lengths)`` of the next chunk, ``None`` at the end; without ``block``,
        :attr:`NOT_READY` when it is not tokenized yet."""
        got = self._chunks.next(block)
        if got is None or got is self.NOT_READY:
            return got
        lengths = got[1]
        if self._longest and len(lengths) and lengths.max() > self._longest:
            missed = int(np.count_nonzero(lengths > self._longest))
            self.proxy_misses += missed
            logger.info("%d texts are longer in tokens than every text tokenized before them (their characters "
                        "ranked them lower): measured mode sizes them by what ran at their width", missed)
        self._longest = max(self._longest, int(lengths.max()) if len(lengths) else 0)
        return got

    def close(self) -> None:
        """Stops tokenizing after the chunk in progress."""
        self._chunks.close()
