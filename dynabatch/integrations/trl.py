"""TRL integration: a dataset pre-packed by dynabatch's packer, in the format TRL's padding-free collation reads.

TRL 1.x packs with ``trl.pack_dataset(dataset, seq_length, strategy="bfd")``:
best-fit decreasing per ``Dataset.map`` batch of 1,000 rows, with no cap on
sequences per row. :func:`pack_dataset` here takes the same tokenized
``datasets.Dataset`` and returns the same format, packed by
:func:`dynabatch.sampling.ffd.pack_arrays` (per group of ``group_size``
sequences, first fit in a seeded shuffled order or longest first, whichever
needs fewer rows; like TRL, no cap on sequences per row unless ``bin_size``
asks for one): every list column
(``input_ids``, and ``labels`` / ``attention_mask`` / ... when present) is
concatenated per row, and a ``seq_lengths`` column lists the lengths of the
row's sequences, from which TRL's ``DataCollatorForLanguageModeling(padding_free=True)``
builds ``position_ids`` that restart at 0 for every sequence (and sets the
label of each sequence's first token to -100).

Pass it to ``SFTTrainer`` with TRL's packing turned off and padding-free on::

    from trl import SFTConfig, SFTTrainer
    from dynabatch.integrations.trl import pack_dataset

    packed = pack_dataset(tokenized, seq_length=4096)   # columns: input_ids (, labels, ...), seq_lengths
    args = SFTConfig(
        output_dir="out",
        padding_free=True,            # the collator flattens rows and reads seq_lengths for position_ids
        max_length=None,              # TRL refuses padding_free with max_length when it does not pack
        dataset_kwargs={"skip_prepare_dataset": True},  # TRL neither re-tokenizes, truncates nor re-packs
        per_device_train_batch_size=1,  # packed rows per step (any number: a batch is flattened into one row)
    )
    trainer = SFTTrainer(model=model, args=args, train_dataset=packed, processing_class=tokenizer)

``packing=False`` (the default) leaves the rows as packed here. The trainer's
shuffled sampler visits every packed row, hence every sample, once per
epoch. With flash-attention the model reads TRL's ``cu_seq_lens``; with sdpa or
eager, transformers derives the block-diagonal mask from the restarting
``position_ids`` (no ``attention_mask`` is passed in padding-free mode) for
models whose mask reads them (Llama, Qwen2, Mistral, GPT-2, given
``use_cache=False`` as ``SFTTrainer`` passes; not OPT or Bloom: use
flash-attention for those), so the sequences of a row never attend to each
other on CPU either
(``tests/integrations/test_trl.py`` checks a packed row's loss against its sequences run one
by one).

``trl`` and ``datasets`` are imported when a function runs: importing this
module needs neither.

Example:
    >>> from datasets import Dataset
    >>> from dynabatch.integrations.trl import pack_dataset
    >>> data = Dataset.from_dict({"input_ids": [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10], [11]]})
    >>> packed = pack_dataset(data, seq_length=5, algorithm="ffd")
    >>> packed[:]
    {'input_ids': [[1, 2, 3, 4, 5], [8, 9, 10, 6, 7], [11]], 'seq_lengths': [[5], [3, 2], [1]]}
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from dynabatch._distribution import import_extra
from dynabatch._validation import bad_type, bad_value, check_non_negative_int, check_positive_int
from dynabatch.sampling.ffd import NO_LIMIT, check_algorithm, pack_arrays

__all__ = ["pack_dataset"]

LOG = logging.getLogger(__name__)


def pack_dataset(
    dataset: Any,
    seq_length: int,
    *,
    bin_size: int | None = None,
    group_size: int = 100000,
    algorithm: str = "auto",
    seed: int = 0,
    oversized: str = "error",
) -> Any:
    """Packs a tokenized dataset into rows of at most ``seq_length`` tokens, in TRL's packed format.

    A drop-in for ``trl.pack_dataset(dataset, seq_length, strategy="bfd")``:
    same input (every column a list column, equally long per example), same
    output (those columns concatenated per packed row, plus ``seq_lengths``),
    same format restored on the result; the rows come from dynabatch's packer
    instead of TRL's best-fit decreasing per 1,000 rows. Every example ends up
    in exactly one row, whole.

    Args:
        dataset: a ``datasets.Dataset`` (or a ``DatasetDict``: each split is
            packed) whose columns are all list columns, e.g. ``input_ids`` and
            ``labels``; select the columns to keep first
            (``dataset.select_columns([...])``).
        seq_length: tokens per packed row at most.
        bin_size: sequences per packed row at most (axolotl's ``bin_size``,
            200 there); ``None``: no cap, as in TRL.
        group_size: examples packed together (each group on its own, in dataset order).
        algorithm: ``"auto"``, ``"ffd"`` or ``"shuffled"``, as in
            :func:`dynabatch.sampling.ffd.pack_arrays`.
        seed: seeds the shuffled order (the same seed gives the same rows).
        oversized: ``"error"`` (a ``ValueError`` naming the first example
            longer than ``seq_length``) or ``"truncate"`` (keep its first
            ``seq_length`` tokens, as TRL's ``"bfd"`` does).

    Returns:
        The packed dataset (a ``DatasetDict`` for a ``DatasetDict``), in the
        input's format, with a ``seq_lengths`` column.

    Raises:
        TypeError: ``dataset`` is not a Dataset, or a column is not a list column.
        ValueError: an empty example, columns of different lengths in one
            example, an example longer than ``seq_length`` (``oversized="error"``),
            a ``seq_lengths`` column (an already packed dataset), or a bad argument.

    Example:
        >>> from datasets import Dataset
        >>> data = Dataset.from_dict({"input_ids": [[1, 2], [3], [4, 5, 6]], "labels": [[-100, 2], [3], [4, 5, 6]]})
        >>> packed = pack_dataset(data, seq_length=4, algorithm="ffd")
        >>> packed[:]
        {'input_ids': [[4, 5, 6, 3], [1, 2]], 'labels': [[4, 5, 6, 3], [-100, 2]], 'seq_lengths': [[3, 1], [2]]}
    """
    datasets = import_extra("datasets", "trl", "dynabatch.integrations.trl.pack_dataset")

    if isinstance(dataset, datasets.DatasetDict):
        return datasets.DatasetDict({name: pack_dataset(split, seq_length, bin_size=bin_size, group_size=group_size,
                                                        algorithm=algorithm, seed=seed, oversized=oversized)
                                     for name, split in dataset.items()})
    if not isinstance(dataset, datasets.Dataset):
        raise bad_type("dataset", "a datasets.Dataset or DatasetDict of list columns", dataset)
    seq_length = check_positive_int("seq_length", seq_length)
    bin_size = NO_LIMIT if bin_size is None else check_positive_int("bin_size", bin_size)
    group_size = check_positive_int("group_size", group_size)
    algorithm = check_algorithm(algorithm)
    seed = check_non_negative_int("seed", seed)
    if oversized not in ("error", "truncate"):
        raise bad_value("oversized", "'error' or 'truncate'", oversized)
    if not dataset.column_names:
        raise bad_value("dataset", "a dataset with at least one list column", dataset)
    if "seq_lengths" in dataset.column_names:  # the output's column: packing it as tokens would mix the two
        raise bad_value("dataset.column_names", "without 'seq_lengths' (a packed dataset's column: "
                        "dataset.remove_columns(['seq_lengths']) packs its rows again as whole examples)",
                        dataset.column_names)
    form = dict(dataset.format)
    form.update(form.pop("format_kwargs", {}))
    options = {"seq_length": seq_length, "bin_size": bin_size, "group_size": group_size, "algorithm": algorithm,
               "seed": seed, "oversized": oversized}
    if dataset.num_rows == 0:  # map calls no function on no rows: the result would lack seq_lengths
        packed = datasets.Dataset(_pack_table(dataset.with_format("arrow")[:], **options))
    else:
        packed = dataset.with_format("arrow").map(_pack_table, batched=True, batch_size=None, fn_kwargs=options,
                                                  desc=f"Packing into rows of {seq_length} tokens")
    if form.get("columns") is not None:
        form["columns"] = [*form["columns"], "seq_lengths"]
    return packed.with_format(**form)


def _pack_table(table: Any, seq_length: int, bin_size: int, group_size: int, algorithm: str, seed: int,
                oversized: str) -> Any:
    """The packed ``pyarrow.Table`` of a whole dataset (one ``map`` batch)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    table = table.combine_chunks()
    columns = []
    for name, column in zip(table.column_names, table.columns):
        column = column.chunk(0) if column.num_chunks else pa.array([], column.type)
        if not (pa.types.is_list(column.type) or pa.types.is_large_list(column.type)):
            raise TypeError(f"dataset['{name}'] should be a list column (packing concatenates each example's "
                            f"values), but got dataset['{name}'] of type {column.type}: select the list columns first")
        if column.null_count:
            at = column.is_null().to_numpy(zero_copy_only=False).argmax()
            raise bad_value(f"dataset['{name}'][{at}]", "a list of tokens", None)
        columns.append(column)
    lengths = pc.list_value_length(columns[0]).to_numpy(zero_copy_only=False).astype(np.int64)
    for name, column in zip(table.column_names[1:], columns[1:]):
        other = pc.list_value_length(column).to_numpy(zero_copy_only=False)
        if not np.array_equal(other, lengths):
            at = int(np.argmax(other != lengths))
            raise bad_value(f"len(dataset['{name}'][{at}])",
                            f"len(dataset['{table.column_names[0]}'][{at}]) = {lengths[at]}", int(other[at]))
    if lengths.size and lengths.min() < 1:
        at = int(np.argmin(lengths))
        raise bad_value(f"len(dataset['{table.column_names[0]}'][{at}])", "a positive sequence length (filter out "
                        "empty examples first)", 0)
    if oversized == "error" and lengths.size and lengths.max() > seq_length:
        at = int(np.argmax(lengths > seq_length))
        raise bad_value(f"len(dataset['{table.column_names[0]}'][{at}])", f"at most seq_length={seq_length} tokens "
                        "(pass oversized='truncate' to cut it)", int(lengths[at]))
    if lengths.size and lengths.max() > seq_length:
        LOG.info("pack_dataset truncates %d examples to seq_length=%d tokens", int((lengths > seq_length).sum()),
                 seq_length)
        columns = [pc.list_slice(column, 0, seq_length) for column in columns]
        lengths = np.minimum(lengths, seq_length)
    flat, offsets = pack_arrays(lengths, seq_length, group_size, bin_size, 1, None, algorithm=algorithm, seed=seed)
    sizes = lengths[flat]
    token_ends = np.concatenate([[0], np.cumsum(sizes)])[offsets]  # each row's token boundaries
    packed = []
    for column in columns:  # the examples' values in packed order: one slice each (arrow's take on lists is ~10x slower)
        starts = column.offsets.to_numpy()[flat].tolist()
        values = pa.concat_arrays([column.values.slice(a, b) for a, b in zip(starts, sizes.tolist())] or
                                  [column.values.slice(0, 0)])
        offset_type = np.int64 if pa.types.is_large_list(column.type) else np.int32
        packed.append(type(column).from_arrays(pa.array(token_ends.astype(offset_type)), values))
    seq_lengths = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(sizes.astype(np.int32)))
    LOG.debug("pack_dataset: %d examples, %d tokens into %d rows of %d (efficiency %.4f)", lengths.size,
              int(sizes.sum()), offsets.size - 1, seq_length, sizes.sum() / max(1, (offsets.size - 1) * seq_length))
    return pa.Table.from_arrays([*packed, seq_lengths], names=[*table.column_names, "seq_lengths"])
