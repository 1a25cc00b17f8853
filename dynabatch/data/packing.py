"""Packed collation: each bin of sequences becomes one row, exact on every attention backend.

A bin (from :class:`dynabatch.sampling.multipack.MultipackBatchSampler`) is
concatenated into one row, as transformers' ``DataCollatorWithFlattening``
does for a whole batch, with the same fields:

* ``position_ids`` restart at 0 for every sequence;
* ``labels`` are ``-100`` (``separator_id``) at each sequence's first token, so
  the causal shift never asks the last token of one sequence to predict the
  first of the next;
* ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (int32 cumulative lengths over the
  flattened ``rows x width`` tokens) and ``max_length_q`` / ``max_length_k``
  (python ints), what flash-attention's variable-length kernels read;
* optionally ``attention_mask``, a 4D block-diagonal causal mask of shape
  ``(rows, 1, width, width)``: ``"float"`` (0 where a token may attend,
  the dtype's minimum elsewhere: what eager attention adds to its scores and
  sdpa accepts) or ``"bool"`` (True where it may attend: sdpa only; eager adds it to
  its scores as 0 and 1, masking nothing). transformers
  5.x passes a 4D mask through unchanged, so a packed row then gives exactly
  the logits of its sequences run one by one, on CPU too.

Rows shorter than the widest are padded with ``pad_token_id``; the padding is
its own "sequence" (positions from 0, labels -100, attending only to itself),
so it never touches real tokens. Without ``block_mask`` the sequences of a row
are kept apart only by what the model reads of the other fields: flash-attention
reads ``cu_seq_lens``, and transformers splits the causal mask at restarting
``position_ids`` for some models (when no cache is built), not for others, which
then read a row as one long causal sequence (the logits of its later sequences
change). :meth:`PackedCollator.check_sequences_apart` runs a model on a tiny
packed row to tell which it does, and refuses it if it does not.

Example:
    >>> from dynabatch.data.packing import PackedCollator
    >>> collate = PackedCollator(pad_token_id=0)
    >>> batch = collate([[{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}], [{"input_ids": [6, 7]}]])
    >>> batch["input_ids"].tolist(), batch["labels"].tolist()
    ([[1, 2, 3, 4, 5], [6, 7, 0, 0, 0]], [[-100, 2, 3, -100, 5], [-100, 7, -100, -100, -100]])
    >>> batch["position_ids"].tolist(), batch["cu_seq_lens_q"].tolist(), batch["max_length_q"]
    ([[0, 1, 2, 0, 1], [0, 1, 0, 1, 2]], [0, 3, 5, 7, 10], 3)
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from dynabatch._validation import bad_type, bad_value, check_bool, check_positive_int

__all__ = ["PackedCollator", "PackedDataset", "packed_dataloader"]

logger = logging.getLogger(__name__)

_PROBE_LENGTH = 8  # tokens of each sequence of check_sequences_apart's row: two forwards of 16 tokens


class PackedDataset(Dataset):
    """``dataset[bin]`` for a bin (a list of indices) gives the list of its examples.

    A ``DataLoader`` with ``batch_sampler=MultipackBatchSampler(...)`` asks its
    dataset for each bin of a batch; this wrapper answers with the examples, for
    :class:`PackedCollator`. An integer index gives the example itself.

    Example:
        >>> PackedDataset(["a", "b", "c"])[[2, 0]]
        ['c', 'a']
    """

    def __init__(self, dataset: Any) -> None:
        if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
            raise bad_type("dataset", "an indexable dataset with a length", dataset)
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, (int, torch.Tensor)) and not (isinstance(index, torch.Tensor) and index.ndim):
            return self.dataset[int(index)]
        return [self.dataset[int(i)] for i in index]


def _ids(value: Any, name: str) -> list[int]:
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise bad_type(name, "a sequence of token ids", value)
    return [int(v) for v in value]


def _is_example(item: Any) -> bool:
    """One example (``input_ids`` a list of ints), not a bin given as a dict of lists."""
    if not isinstance(item, Mapping) or "input_ids" not in item:
        return False
    ids = item["input_ids"]
    return len(ids) == 0 or not hasattr(ids[0], "__len__")


def _examples(row: Any, r: int) -> list[Mapping[str, Any]]:
    """A bin as a list of examples: a list of dicts, or a dict of lists (a HF ``Dataset[list]``)."""
    if isinstance(row, Mapping):
        if "input_ids" not in row:
            raise bad_value(f"features[{r}]", "a bin with 'input_ids'", sorted(row))
        columns = [k for k in ("input_ids", "labels", "attention_mask") if k in row]
        return [dict(zip(columns, values)) for values in zip(*(row[k] for k in columns))]
    if isinstance(row, Sequence) and not isinstance(row, (str, bytes)):
        for i, example in enumerate(row):
            if not isinstance(example, Mapping) or "input_ids" not in example:
                raise bad_type(f"features[{r}][{i}]", "an example dict with 'input_ids'", example)
        return list(row)
    raise bad_type(f"features[{r}]", "a bin: a list of example dicts, or a dict of lists", row)


class PackedCollator:
    """Collates bins of tokenized examples into packed rows (see the module docs).

    Args:
        pad_token_id: fills rows shorter than the widest.
        separator_id: the label at each sequence's first token (-100: ignored by the loss).
        block_mask: ``None`` (no ``attention_mask``), ``"float"`` or ``"bool"``:
            the 4D block-diagonal causal mask, for eager / sdpa attention.
        mask_dtype: dtype of the ``"float"`` mask (the model's dtype).
        return_position_ids: add ``position_ids``.
        return_flash_attn_kwargs: add ``cu_seq_lens_q/k`` and ``max_length_q/k``.
        max_length: cut each sequence to this many tokens (use the sampler's
            ``batch_max_len`` with ``oversized="truncate"``); ``None``: no cut.
        pad_to_multiple_of: round the row width up to a multiple of this.

    Called with a list of bins (each a list of example dicts with
    ``input_ids`` and optionally ``labels``, or a dict of lists). A plain list
    of example dicts is one bin, as ``DataCollatorWithFlattening`` takes it.
    An example's own ``attention_mask`` must be all ones (a padded example is
    refused: its padding would be trained on); other fields are not read.
    """

    def __init__(
        self,
        pad_token_id: int = 0,
        *,
        separator_id: int = -100,
        block_mask: str | None = None,
        mask_dtype: torch.dtype = torch.float32,
        return_position_ids: bool = True,
        return_flash_attn_kwargs: bool = True,
        max_length: int | None = None,
        pad_to_multiple_of: int | None = None,
    ) -> None:
        for name, value in (("pad_token_id", pad_token_id), ("separator_id", separator_id)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise bad_type(name, "an int", value)
        if block_mask not in (None, "float", "bool"):
            raise bad_value("block_mask", "None, 'float' or 'bool'", block_mask)
        if not isinstance(mask_dtype, torch.dtype) or not mask_dtype.is_floating_point:
            raise bad_type("mask_dtype", "a floating torch.dtype", mask_dtype)
        for name, value in (("return_position_ids", return_position_ids),
                            ("return_flash_attn_kwargs", return_flash_attn_kwargs)):
            check_bool(name, value)
        self.pad_token_id = pad_token_id
        self.separator_id = separator_id
        self.block_mask = block_mask
        self.mask_dtype = mask_dtype
        self.return_position_ids = return_position_ids
        self.return_flash_attn_kwargs = return_flash_attn_kwargs
        self.max_length = None if max_length is None else check_positive_int("max_length", max_length)
        self.pad_to_multiple_of = (None if pad_to_multiple_of is None
                                   else check_positive_int("pad_to_multiple_of", pad_to_multiple_of))

    def _row(self, examples: list[Mapping[str, Any]], r: int) -> tuple[list[int], list[int], list[int]]:
        ids, labels, lengths = [], [], []
        for i, example in enumerate(examples):
            tokens = _ids(example["input_ids"], f"features[{r}][{i}]['input_ids']")
            targets = (tokens if example.get("labels") is None
                       else _ids(example["labels"], f"features[{r}][{i}]['labels']"))
            if len(targets) != len(tokens):
                raise bad_value(f"features[{r}][{i}]['labels']", f"as long as its input_ids ({len(tokens)})",
                                f"{len(targets)} labels")
            self._check_unpadded(example, f"features[{r}][{i}]['attention_mask']")
            if self.max_length is not None:
                tokens, targets = tokens[: self.max_length], targets[: self.max_length]
            if not tokens:
                continue
            ids += tokens
            labels += [self.separator_id, *targets[1:]]
            lengths.append(len(tokens))
        return ids, labels, lengths

    @staticmethod
    def _check_unpadded(example: Mapping[str, Any], name: str) -> None:
        """Refuses an example whose own ``attention_mask`` hides tokens: packed, they would be trained on."""
        mask = example.get("attention_mask")
        if mask is not None and 0 in _ids(mask, name):
            raise bad_value(name, "all ones (a packed row attends to every token of its sequences: tokenize "
                            "without padding, or strip it)", f"{_ids(mask, name).count(0)} zeros")

    def __call__(self, features: Sequence[Any]) -> dict[str, Any]:
        if isinstance(features, (str, bytes)) or not isinstance(features, Sequence) or not features:
            raise bad_type("features", "a non-empty list of bins", features)
        if _is_example(features[0]):
            features = [features]  # a flat list of examples: one bin, as DataCollatorWithFlattening takes it
        rows = [self._row(_examples(row, r), r) for r, row in enumerate(features)]
        width = max(len(ids) for ids, _, _ in rows)
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        width = max(width, 1)
        segments = []  # per row: lengths of its sequences, then of its padding
        for ids, _, lengths in rows:
            pad = width - len(ids)
            segments.append(lengths + ([pad] if pad else []))
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(rows), width), -100, dtype=torch.long)
        for r, (ids, targets, _) in enumerate(rows):
            input_ids[r, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            labels[r, : len(ids)] = torch.tensor(targets, dtype=torch.long)
        batch: dict[str, Any] = {"input_ids": input_ids, "labels": labels}
        if self.return_position_ids:
            batch["position_ids"] = torch.cat(
                [torch.cat([torch.arange(n) for n in row]).unsqueeze(0) for row in segments]).long()
        if self.return_flash_attn_kwargs:
            flat = [n for row in segments for n in row]
            cu = torch.cumsum(torch.tensor([0, *flat], dtype=torch.int64), 0).to(torch.int32)
            batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = cu
            batch["max_length_q"] = batch["max_length_k"] = max(flat)
        if self.block_mask is not None:
            batch["attention_mask"] = self._mask(segments, width)
        return batch

    def one_per_row(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """Collates a list of examples one per row, unpacked: what evaluation and prediction need.

        A plain list of examples given to the collator is one bin, packed into one row; an evaluation batch so
        packed gives one prediction for the whole batch, not one per example, in a row as wide as its examples
        together. Here each example is a bin of its own (its row padded to the widest, the padding its own
        segment), so ``labels``, logits and the loss are those of the examples run one by one.

        Example:
            >>> batch = PackedCollator(pad_token_id=0).one_per_row([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}])
            >>> batch["input_ids"].tolist(), batch["labels"].tolist()
            ([[1, 2, 3], [4, 5, 0]], [[-100, 2, 3], [-100, 5, -100]])
        """
        return self([[example] for example in features])

    def check_sequences_apart(self, model: Any) -> None:
        """Refuses a model that would let the sequences of one of this collator's rows attend to each other.

        With ``block_mask`` the mask keeps them apart and nothing is run. Without it, whether the model reads the
        row's ``position_ids`` (or flash-attention's ``cu_seq_lens``) as sequence boundaries is seen, not looked
        up: one row of two sequences ``[A, B]`` is collated and run, then ``[A', B]`` (``A'`` other tokens, as
        many), and ``B``'s logits must be the same. They are compared exactly: on a model that keeps them apart
        ``A`` reaches ``B`` only through attention weights that are exactly 0, and the same kernels run on the
        same shapes, so ``B``'s logits came out bit for bit equal on every random-weight Llama, Qwen2, Mistral,
        GPT-2 and GPT-NeoX tried on the CPU (fp32 and bf16, eager and sdpa), while a model that does not keep
        them apart moved them by as little as 1.4e-3 in fp32 and one rounding step in bf16 (a one-layer
        random-weight Bloom), which a tolerance of a rounding step would pass. The forwards run as
        ``model(**row)`` (no labels) under ``torch.no_grad`` on the device of the model's first parameter, in
        eval mode (no dropout; each module's mode is restored after).

        Args:
            model: the model to train on this collator's rows, with ``get_input_embeddings()`` or
                ``config.vocab_size`` (the probe's tokens are drawn below it).

        Raises:
            ValueError: ``B``'s logits depend on ``A``; the message says what to do.
            TypeError: the model's vocabulary size cannot be found.
        """
        if self.block_mask is not None:
            return
        name = type(model).__name__
        moved = self._probe(model)
        if moved == 0.0:
            logger.info("%s keeps the sequences of a packed row apart without a block mask", name)
            return
        # A model that splits a row at its position_ids only without a cache (Llama, GPT-2, ... in transformers
        # 5.x) builds one when its config says use_cache=True: the message says so only where that is the cause.
        cache = (getattr(getattr(model, "config", None), "use_cache", None) is True
                 and self._probe(model, use_cache=False) == 0.0)
        raise bad_value(
            "block_mask", f"'float' (eager or sdpa attention) or 'bool' (sdpa) for {name}: without a block mask "
            "the sequences packed into one row would attend to each other (the logits of a packed sequence moved "
            f"by {moved:.3g} when the sequence before it in the row changed"
            + ("; its config has use_cache=True, and transformers splits a row at its restarting position_ids "
               "only when no cache is built: set model.config.use_cache = False, as the HF Trainer does by "
               "default" if cache else "")
            + "). Pass PackedCollator(block_mask='float') if the model takes a 4D attention_mask, load it with "
            "attn_implementation='flash_attention_2' if it supports that, or do not pack", self.block_mask)

    def _probe(self, model: Any, **forward: Any) -> float:
        """How far ``B``'s logits in the row ``[A, B]`` move when ``A`` changes: 0.0 where they are bit for bit equal.

        Run under ``torch.no_grad`` in eval mode (each module's mode is restored after), on the device of the
        model's first parameter, with ``forward`` added to the row's fields.
        """
        vocab = _vocab_size(model)
        n = min(_PROBE_LENGTH, self.max_length or _PROBE_LENGTH)
        first, shared = torch.randint(vocab, (2, n), generator=torch.Generator().manual_seed(0)).tolist()
        other = [(token + max(1, vocab // 2)) % vocab for token in first]  # a different token at every place
        parameter = next(iter(model.parameters()), None)
        device = parameter.device if parameter is not None else torch.device("cpu")
        modes = [(module, module.training) for module in model.modules()]  # a submodule kept in eval stays so
        model.eval()
        try:
            with torch.no_grad():
                seen = [self._probe_logits(model, [before, shared], device, forward)[n: 2 * n]
                        for before in (first, other)]
        finally:
            for module, training in modes:
                module.training = training
        if torch.equal(seen[0], seen[1]):
            return 0.0
        return float((seen[0].float() - seen[1].float()).abs().max().nan_to_num(float("inf")))

    def _probe_logits(self, model: Any, sequences: list[list[int]], device: torch.device,
                      forward: dict[str, Any]) -> torch.Tensor:
        """The logits of one row of ``sequences`` as this collator packs it (labels left out)."""
        row = self([[{"input_ids": ids} for ids in sequences]])
        row.pop("labels")
        out = model(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in row.items()}, **forward)
        logits = getattr(out, "logits", None)
        return (out[0] if logits is None else logits)[0]

    def _mask(self, segments: list[list[int]], width: int) -> torch.Tensor:
        seq = torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in segments])
        causal = torch.ones(width, width, dtype=torch.bool).tril()
        allowed = (seq[:, :, None] == seq[:, None, :]) & causal  # same sequence, not in the future
        allowed = allowed.unsqueeze(1)
        if self.block_mask == "bool":
            return allowed
        mask = torch.zeros(allowed.shape, dtype=self.mask_dtype)
        return mask.masked_fill_(~allowed, torch.finfo(self.mask_dtype).min)


def _vocab_size(model: Any) -> int:
    """The number of token ids ``model`` takes: its input embeddings' rows, else ``config.vocab_size``."""
    get = getattr(model, "get_input_embeddings", None)
    try:
        embeddings = get() if callable(get) else None
    except NotImplementedError:  # transformers' default for a model that does not say
        embeddings = None
    size = getattr(embeddings, "num_embeddings", None) or getattr(getattr(model, "config", None), "vocab_size", None)
    if not isinstance(size, int) or size < 2:
        raise bad_type("model", "a model with get_input_embeddings() or config.vocab_size (the packing check draws "
                       "its tokens below it; or pass the collator a block_mask)", model)
    return size


def packed_dataloader(dataset: Any, batch_sampler: Any, collator: PackedCollator, **kwargs: Any) -> DataLoader:
    """A ``DataLoader`` yielding packed batches: ``batch_sampler``'s bins of ``dataset``, collated.

    Args:
        dataset: indexable examples (dicts with ``input_ids``, maybe ``labels``).
        batch_sampler: yields batches of bins, e.g. a ``MultipackBatchSampler``.
        collator: a :class:`PackedCollator`.
        **kwargs: more ``DataLoader`` arguments (``num_workers``, ``pin_memory``...).

    Example:
        >>> data = [{"input_ids": list(range(1, n + 1))} for n in (3, 2, 4)]
        >>> batches = [[[0, 1]], [[2]]]  # what MultipackBatchSampler(..., batch_size=1) yields
        >>> [b["input_ids"].tolist() for b in packed_dataloader(data, batches, PackedCollator())]
        [[[1, 2, 3, 1, 2]], [[1, 2, 3, 4]]]
    """
    if not isinstance(collator, PackedCollator):
        raise bad_type("collator", "a PackedCollator", collator)
    return DataLoader(PackedDataset(dataset), batch_sampler=batch_sampler, collate_fn=collator, **kwargs)
