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
to change while another thread encodes or decodes with it), through the eager
loader's :class:`~dynabatch.data.tokenization.ParallelTokenizer` with the
loader's arguments: the same call, or the same backend rule, on every core, so
a streamed row is the eager row. The process's worker processes, where it uses
them, end when every chunk is tokenized or the stream is paused.

Memory stays flat in the number of texts: a chunk's tokens are freed once
every one of its rows is consumed (:meth:`TokenStream.consumed`: ``run`` says
so when a batch's rows are finished or already stored; a plain loop over the
loader when it builds a batch, :meth:`TokenStream.collate_and_consume`). What
stays per text is a few numbers (its chunk, its row there, whether it is
consumed). Rows of a freed chunk collated again (a second pass over the same
loader) tokenize it again, and it is freed again when they are all consumed.

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
    >>> stream.consumed([1, 0]); stream.held_chunks  # every row of chunk 0 is consumed: its tokens are freed
    [1]
    >>> stream.input_hashes([0]).dtype  # tokenized again, not held
    dtype('uint64')
"""

from __future__ import annotations

import copy
import logging
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np

from dynabatch._background import Ahead, StopRequested
from dynabatch._digest import row_hashes
from dynabatch._malloc import trim
from dynabatch._validation import bad_value, check_positive_int
from dynabatch.data.collate import Batch, TokenCollator, pad_token_id_of
from dynabatch.data.text_source import TextSource
from dynabatch.data.tokenization import ParallelTokenizer, TokenizedTexts, split_no_token
from dynabatch.data.workers import release_pool

__all__ = ["ChunkFeed", "TokenStream"]

logger = logging.getLogger(__name__)

FIRST_CHUNK = 512
"""Texts of the first chunk (at least four first batches): what is tokenized before the first batch can run."""
CHUNK_SIZE = 4096
"""Texts of the later chunks, at most (each chunk is twice the one before up to this)."""
AHEAD = 2
"""Chunks a feed tokenizes ahead of its consumer, at most: seconds of work for the device, and the tokens of a few
chunks in memory, not of the whole corpus."""


def _row_hashes(tokens: TokenizedTexts) -> np.ndarray:
    """Each row's input hash, as the results store hashes a token store (``token_store_hashes``)."""
    return row_hashes({"input_ids": tokens.input_ids, **tokens.extras}, tokens.offsets)


class TokenStream:
    """A corpus tokenized chunk by chunk, longest by characters first; builds the batches of tokenized rows.

    Args:
        source: the texts (:class:`~dynabatch.data.text_source.TextSource`).
        tokenizer: the tokenizer (copied: the copy runs in the background).
        max_input_token_length: the truncation limit, in tokens.
        skip: input positions to tokenize and plan nowhere (bad inputs skipped).
        on_bad_input: a text of no token once tokenized, a bad input found as its chunk is tokenized: ``"raise"``
            refuses it there (:func:`~dynabatch.data.tokenization.split_no_token`), ``"skip"`` plans it nowhere
            and lists it in :attr:`no_token`.
        first_chunk: texts of the first chunk; later chunks double up to ``chunk_size``.
        chunk_size: texts of a later chunk, at most.
        pad_to_multiple_of: rounds each batch's width up.
        with_texts: give each batch its texts (``batch.texts``).
        tokenize_cores: cores to tokenize on, at most (``None``: every core this process may use; see
            :class:`~dynabatch.data.tokenization.ParallelTokenizer`).
        texts_name: what an error calls the texts (the caller's own argument holding them: ``dynabatch.generate``'s
            ``"prompts"``).
        **tokenizer_kwargs: passed to every tokenizer call.

    It acts as the loader's collator: ``stream(positions)`` builds a batch, and
    ``pad_token_id``, ``padding_side`` and ``pad_to_multiple_of`` are the padding's.
    What a consumer calls besides: :meth:`consumed` (rows finished: their
    chunk's tokens are freed once all its rows are) and :meth:`input_hashes`
    (the rows' input hashes, tokenized as the run tokenizes them).
    """

    def __init__(self, source: TextSource, tokenizer: Any, max_input_token_length: int, *, skip: Any = None,
                 on_bad_input: str = "raise", first_chunk: int = FIRST_CHUNK, chunk_size: int = CHUNK_SIZE,
                 pad_to_multiple_of: int | None = None, with_texts: bool = True, tokenize_cores: int | None = None,
                 texts_name: str = "texts", **tokenizer_kwargs: Any) -> None:
        first_chunk = check_positive_int("first_chunk", first_chunk)
        chunk_size = max(first_chunk, check_positive_int("chunk_size", chunk_size))
        self.source, self.n = source, len(source)
        self.max_input_token_length = max_input_token_length
        self.tokenizer_kwargs = tokenizer_kwargs
        self.with_texts = with_texts
        self.on_bad_input = on_bad_input
        self.texts_name = texts_name
        self.pad_token_id = pad_token_id_of(tokenizer)
        self.padding_side = getattr(tokenizer, "padding_side", "right")
        self.pad_to_multiple_of = pad_to_multiple_of
        self.proxy_misses = 0  # rows longer in tokens than every row its feed handed out before (ChunkFeed)
        self._template = tokenizer
        # A private copy, tokenizing on every core (worker processes, where used, run until pause or the feed's end).
        self._tokenize = ParallelTokenizer(copy.deepcopy(tokenizer), max_input_token_length, tokenizer_kwargs,
                                           cores=tokenize_cores, texts_name=texts_name)
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
        # Where each input is: its chunk (-1: skipped) and its row in the chunk's token store.
        chunk = np.repeat(np.arange(len(sizes), dtype=np.int32), sizes)
        self.chunk_of = np.full(self.n, -1, dtype=np.int32)
        self.chunk_of[self.order] = chunk
        self.local_of = np.zeros(self.n, dtype=np.int32)
        self.local_of[self.order] = np.arange(len(self.order)) - self.starts[chunk]
        self.tokenizations = np.zeros(len(sizes), dtype=np.int32)  # times each chunk was tokenized (and held)
        # Characters per chunk: a chunk's call weighs the chunks still to come (worker processes pay over the stream)
        self._chunk_chars = (np.add.reduceat(chars[self.order], self.starts[:-1]) if len(self.order)
                             else np.zeros(0, dtype=np.int64))
        self._held: dict[int, TokenCollator] = {}  # the chunks whose tokens are held
        self._consumed = np.zeros(self.n, dtype=bool)
        self._no_token = np.zeros(self.n, dtype=bool)  # texts of no token found so far (skipped: planned nowhere)
        self._left = np.asarray(sizes, dtype=np.int64)  # rows of each chunk not consumed yet
        self._freed = np.zeros(len(sizes), dtype=bool)  # every row consumed (since it was last tokenized)
        self._lock = threading.Lock()
        self._feeds: list = []  # weak references to the feeds tokenizing for it, paused together
        # One chunk at a time on the private tokenizer; reentrant: a dropped feed's generator, closed by the garbage
        # collector on whatever thread runs it (one tokenizing for this stream, say), releases the workers under it
        self._tokenizing = threading.RLock()

    @property
    def n_chunks(self) -> int:
        return len(self.starts) - 1

    def __repr__(self) -> str:
        return f"{type(self).__name__}(texts={self.n}, chunks={self.n_chunks}, held={self.held_chunks})"

    @property
    def cores(self) -> int:
        """The cores its chunks are tokenized on, at most: ``tokenize_cores``, capped at the cores this process may
        use (:func:`~dynabatch.data.workers.available_cores`)."""
        return self._tokenize.cores

    @property
    def held_chunks(self) -> list[int]:
        """The chunks whose tokens are held now (tokenized, and not every row consumed yet)."""
        with self._lock:
            return sorted(self._held)

    @property
    def token_bytes(self) -> int:
        """Bytes of the tokens held now (ids and extras of every chunk held)."""
        with self._lock:
            held = list(self._held.values())
        return sum(c.tokenized.input_ids.nbytes + sum(v.nbytes for v in c.tokenized.extras.values()) for c in held)

    def chunk_positions(self, k: int) -> np.ndarray:
        """The input positions of chunk ``k``, longest by characters first."""
        return self.order[self.starts[k] : self.starts[k + 1]]

    def tokenize(self, k: int, *, stop: threading.Event | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Tokenizes chunk ``k`` unless its tokens are held; returns its input positions and their token lengths,
        but those of no token (bad inputs, skipped: planned nowhere). ``stop``: watched between the tokenizer's
        pieces; once set, raises :class:`~dynabatch._background.StopRequested` with nothing of the chunk kept."""
        positions, lengths = self.chunk_positions(k), self._chunk(k, stop).tokenized.lengths
        kept = lengths > 0
        return (positions, lengths) if kept.all() else (positions[kept], lengths[kept])

    @property
    def no_token(self) -> np.ndarray:
        """The input positions of the texts of no token found so far (``on_bad_input="skip"``), sorted."""
        with self._lock:
            return np.flatnonzero(self._no_token)

    def _chunk(self, k: int, stop: threading.Event | None = None) -> TokenCollator:
        """Chunk ``k``'s collator: held, else tokenized now (``stop``: see :meth:`tokenize`) and held (a freed
        chunk's rows count as not consumed again: a new pass over them)."""
        with self._lock:
            collator = self._held.get(k)
        if collator is not None:  # never waits for the chunk the background thread is tokenizing
            return collator
        with self._tokenizing:
            with self._lock:
                collator = self._held.get(k)
            if collator is not None:
                return collator
            positions = self.chunk_positions(k)
            tokens = self._encode(positions, self.later_work(k), stop)
            first_time = not self.tokenizations[k]
            if first_time:  # a text of no token is a bad input, known only now (logged once)
                no_token = split_no_token(tokens.lengths, self.on_bad_input, lambda i: self.source.take([i])[0],
                                          positions=positions, texts_name=self.texts_name)
            collator = TokenCollator.from_tokenizer(tokens, self._template, pad_to_multiple_of=self.pad_to_multiple_of)
            with self._lock:
                if first_time:
                    self._no_token[no_token] = True
                if self._freed[k]:
                    self._consumed[positions] = False
                    self._left[k] = len(positions)
                    self._freed[k] = False
                never_run = positions[self._no_token[positions] & ~self._consumed[positions]]  # planned nowhere: done
                self._consumed[never_run] = True
                self._left[k] -= len(never_run)
                self._held[k] = collator
                self.tokenizations[k] += 1
            trim()  # the chunk's encodings are freed: give their heap back, so memory grows with the tokens only
            return collator

    def later_work(self, k: int) -> float:
        """The chunks never tokenized yet but ``k``, by characters, as a multiple of chunk ``k``."""
        coming = self.tokenizations == 0
        coming[k] = False
        return float(self._chunk_chars[coming].sum()) / max(1.0, float(self._chunk_chars[k]))

    def _encode(self, positions: np.ndarray, later: float = 0.0, stop: threading.Event | None = None) -> TokenizedTexts:
        """The tokens of the texts at ``positions``, as the eager loader tokenizes them (one mechanism:
        :class:`~dynabatch.data.tokenization.ParallelTokenizer`, and its backend rule); ``later``: the work of the
        chunks still to come, as a multiple of this one's (the cost rule weighs it); ``stop``: see :meth:`tokenize`."""
        return self._tokenize(self.source.take(positions), later=later, positions=positions, stop=stop)

    def consumed(self, positions: Any) -> None:
        """Marks the rows at ``positions`` finished (run and stored, or already stored, or failed): once every row
        of a chunk is, its tokens are freed. Rows consumed before, and skipped positions, are ignored.

        ``run`` calls it as batches finish; a plain loop over the loader consumes a
        batch's rows when it is built (:meth:`collate_and_consume`).
        """
        pos = np.unique(np.asarray(positions, dtype=np.int64).reshape(-1))
        freed = []
        with self._lock:
            pos = pos[~self._consumed[pos] & (self.chunk_of[pos] >= 0)]
            if not pos.size:
                return
            self._consumed[pos] = True
            chunks, counts = np.unique(self.chunk_of[pos], return_counts=True)
            self._left[chunks] -= counts
            for k in chunks[self._left[chunks] == 0].tolist():
                self._freed[k] = True
                freed.append(self._held.pop(k, None))
        if any(c is not None for c in freed):
            del freed
            trim()

    def feed(self, claims: Iterator[int], *, ahead: int | None = AHEAD) -> ChunkFeed:
        """Tokenizes the chunks ``claims`` names, in that order, in a background thread (see :class:`ChunkFeed`)."""
        feed = ChunkFeed(self, claims, ahead=ahead)
        self._feeds.append(weakref.ref(feed))
        return feed

    def pause(self) -> None:
        """Stops tokenizing in the background until a chunk is asked for again: no thread or worker process of the
        stream outlives the run that started it (:func:`dynabatch.run` pauses it when it returns or raises)."""
        for ref in self._feeds:
            feed = ref()
            if feed is not None:
                feed.pause()
        self.release_workers()

    def release_workers(self) -> None:
        """Ends the process's tokenizer worker processes, if any and no other call uses them (started again by a
        later chunk that needs them)."""
        with self._tokenizing:
            release_pool()

    def __call__(self, positions: Any) -> Batch:
        return self.collate(positions)

    def collate_and_consume(self, positions: Any) -> Batch:
        """The batch of ``positions`` (:meth:`collate`), its rows then consumed (:meth:`consumed`): the collator of
        a plain loop over the loader, where a row is done once its batch is built."""
        batch = self.collate(positions)
        self.consumed(batch.indices.numpy())
        return batch

    def collate(self, positions: Any) -> Batch:
        """The padded batch of ``positions`` (rows planned into batches: not skipped), as the loader's collator
        builds it; a chunk whose tokens are not held is tokenized (and held until its rows are consumed)."""
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        if not pos.size:
            raise bad_value("positions", "a non-empty sequence of input positions", positions)
        if np.any((pos < 0) | (pos >= self.n)):
            raise bad_value("positions", f"input positions in range({self.n})", positions)
        chunk = self.chunk_of[pos]
        if np.any(chunk < 0):
            raise ValueError(f"positions should be rows planned into batches, but got {np.sum(chunk < 0)} skipped "
                             f"inputs (positions {pos[chunk < 0][:5].tolist()})")
        chunks = np.unique(chunk)
        first = self._chunk(int(chunks[0]))
        if len(chunks) == 1:  # a planned batch: one gather from its chunk's store
            batch = first(self.local_of[pos])
        else:  # rows of several chunks (a batch picked by hand): their tokens gathered first
            batch = TokenCollator(self._gather(pos), pad_token_id=self.pad_token_id, padding_side=self.padding_side,
                                  pad_to_multiple_of=self.pad_to_multiple_of,
                                  pad_values=first.pad_values)(np.arange(len(pos)))
        texts = self.source.take(pos) if self.with_texts else None
        return Batch(dict(batch), indices=batch.indices.new_tensor(pos), texts=texts)

    def _gather(self, pos: np.ndarray) -> TokenizedTexts:
        """The tokens of the rows at ``pos`` (of any chunks, tokenized now if not held), as a store of their own."""
        chunk = self.chunk_of[pos]
        parts = [(np.flatnonzero(chunk == k), self._chunk(int(k)).tokenized) for k in np.unique(chunk)]
        return _in_order(len(pos), [(where, tokens.take(self.local_of[pos[where]])) for where, tokens in parts])

    def input_hashes(self, positions: Any) -> np.ndarray:
        """The input hash of each row at ``positions`` (``uint64``), as the results store hashes a row's tokens.

        Rows of held chunks are hashed from their tokens; the others are
        tokenized for it (through the same call as the run, in pieces of at
        most :data:`CHUNK_SIZE` texts) and not held, so hashing every stored
        position of a rerun up front keeps memory flat. A skipped (bad) input
        hashes as the tokens of ``""``, as the eager loader's store holds it.
        """
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        out = np.zeros(len(pos), dtype=np.uint64)
        chunk = self.chunk_of[pos]
        with self._lock:
            held = {k: c.tokenized for k, c in self._held.items()}
        rest = np.ones(len(pos), dtype=bool)
        for k in np.intersect1d(chunk, list(held)).tolist():
            where = np.flatnonzero(chunk == k)
            out[where] = _row_hashes(held[k].take(self.local_of[pos[where]]))
            rest[where] = False
        rest = np.flatnonzero(rest)
        for start in range(0, len(rest), CHUNK_SIZE):
            where = rest[start : start + CHUNK_SIZE]
            with self._tokenizing:
                tokens = self._encode(pos[where])
            out[where] = _row_hashes(tokens)
        return out

    @property
    def tokenized(self) -> TokenizedTexts:
        """Every text's tokens in input order, in a store of their own (chunks not held are tokenized for it, and
        not held: for code that needs the whole store; a run streams without it). Skipped positions are empty rows."""
        parts = []
        for k in range(self.n_chunks):
            with self._lock:
                collator = self._held.get(k)
            positions = self.chunk_positions(k)
            if collator is not None:
                tokens = collator.tokenized
            else:
                with self._tokenizing:
                    tokens = self._encode(positions)
            parts.append((positions, tokens))
        return _in_order(self.n, parts)


def _in_order(n: int, parts: list[tuple[np.ndarray, TokenizedTexts]]) -> TokenizedTexts:
    """One store of ``n`` rows from ``(rows, tokens)`` parts (row ``rows[i]`` is ``tokens``' row ``i``); rows no part
    names are empty."""
    lengths = np.zeros(n, dtype=np.int64)
    for rows, tokens in parts:
        lengths[rows] = tokens.lengths
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    keys = ["input_ids", *parts[0][1].extras] if parts else ["input_ids"]
    flat = {key: np.zeros(int(offsets[-1]), dtype=np.int32) for key in keys}
    for rows, tokens in parts:
        where = np.repeat(offsets[rows] - tokens.offsets[:-1], tokens.lengths) + np.arange(len(tokens.input_ids))
        for key in keys:
            flat[key][where] = tokens.input_ids if key == "input_ids" else tokens.extras[key]
    return TokenizedTexts(flat.pop("input_ids"), offsets, flat)


def _tokenized(stream: TokenStream, claims: Iterator[int],
               stop: threading.Event) -> Iterator[tuple[np.ndarray, np.ndarray] | object]:
    """The chunks ``claims`` names, tokenized; the process's worker processes released at the end, whether every
    chunk claimed is tokenized, the tokenizer raised, or the feed was dropped part-way (the generator closed, on the
    feed's thread as it ends): no process waits for more.

    A pause (``stop`` set) part-way through chunk ``k`` drops its pieces tokenized so far and yields
    :attr:`Ahead.STOPPED <dynabatch._background.Ahead.STOPPED>`: the claim on ``k`` is kept here, and ``k`` tokenized
    again when the feed goes on, so no claimed chunk is lost or handed out twice (Ctrl-C waits for one piece of
    the tokenizer, not a chunk of thousands of texts)."""
    try:
        for k in claims:
            chunk: Any = Ahead.STOPPED
            while chunk is Ahead.STOPPED:
                try:
                    chunk = stream.tokenize(k, stop=stop)
                except StopRequested:
                    pass  # yielded outside the handler: a generator paused there would keep the error and its frames
                yield chunk
    finally:
        stream.release_workers()


def _abandoned(chunks: Ahead) -> None:
    """A feed's finalizer: its thread stops after the piece in progress, without waiting for it (a finalizer may run
    on the thread that holds the tokenizer the chunk waits for)."""
    chunks.close(wait=False)


class ChunkFeed:
    """Chunks tokenized in a background thread, handed out in the order they were claimed.

    Args:
        stream: the :class:`TokenStream`.
        claims: the chunk numbers to tokenize, in order (``range(n_chunks)``,
            or a counter shared with other ranks that hands each chunk to one rank).
        ahead: chunks tokenized ahead of the consumer, at most (``None``: no bound).

    The thread starts at the first :meth:`next` (or :meth:`start`), which
    blocks until the next chunk is tokenized; an error in the thread is raised
    there (:class:`~dynabatch._background.Ahead`). The stream's ``proxy_misses``
    counts rows longer in tokens than every row of the chunks handed out before theirs.
    """

    NOT_READY = Ahead.NOT_READY

    def __init__(self, stream: TokenStream, claims: Iterator[int], *, ahead: int | None = AHEAD) -> None:
        self.stream = stream
        self._longest = 0
        # The thread pulls from a generator that holds the stream, not this feed: a feed dropped part-way (a plain
        # loop broke out of the loader, then dropped it) is collected, and its finalizer stops the thread, which
        # would otherwise wait for room forever, holding the stream (a tokenizer copy, the chunks' tokens)
        stop = threading.Event()  # the thread's, set by pause and close: the tokenizer stops between its pieces
        self._chunks = Ahead(_tokenized(stream, claims, stop), depth=ahead, name="dynabatch-tokenize", stop=stop)
        finalizer = weakref.finalize(self, _abandoned, self._chunks)
        finalizer.atexit = False  # at exit the thread is a daemon, and release_pool runs anyway

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
            self.stream.proxy_misses += missed
            logger.info("%d texts are longer in tokens than every text tokenized before them (their characters "
                        "ranked them lower): measured mode sizes them by what ran at their width", missed)
        self._longest = max(self._longest, int(lengths.max()) if len(lengths) else 0)
        return got

    def pause(self) -> None:
        """Stops tokenizing after the tokenizer's piece in progress (its thread ends; the chunk in progress is
        tokenized again); the next :meth:`next` goes on."""
        self._chunks.pause()

    def close(self) -> None:
        """Stops tokenizing after the tokenizer's piece in progress."""
        self._chunks.close()
