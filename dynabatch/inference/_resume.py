"""The JSONL results file of ``run(..., output_path=...)``, which lets a killed run resume.

:func:`inputs_digest` identifies the inputs; :class:`ResultsFile` is the
file; :func:`to_json_value` and :func:`json_line` are how results are stored.

Line 1 is a header: the format, the number of inputs and a digest of the
inputs (not of the plan: results are stored per input position). Every later line is one finished batch,
``{"positions": [...], "results": [...]}``, appended, flushed and fsynced. A
file from other inputs is refused; a last line cut off mid-write is dropped.
"""

from __future__ import annotations

import json
import logging
import numbers
import os
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from dynabatch._digest import fingerprint as digest
from dynabatch._validation import bad_type
from dynabatch.inference._queue import positions_of

logger = logging.getLogger(__name__)

FORMAT = "dynabatch.run/1"


def to_json_value(value: Any, name: str = "result") -> Any:
    """``value`` as ``json`` stores it: tensors and arrays as nested lists, tuples as lists.

    Raises:
        TypeError: a value ``json`` cannot store (the type is named).
    """
    if value is None or isinstance(value, (str, bool)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)  # NaN and Infinity too: json writes and reads them
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (list, tuple)):
        return [to_json_value(item, f"{name}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise bad_type(f"{name} keys", "str (JSON object keys)", key)
            out[key] = to_json_value(item, f"{name}[{key!r}]")
        return out
    raise TypeError(
        f"{name} should be JSON-storable with output_path set (a tensor, numpy array, number, str, None, "
        f"or a list or dict of those), but got a {name} of type {type(value).__name__}"
    )


def json_line(record: dict[str, Any]) -> str:
    """One compact JSON line (NaN and Infinity allowed, as ``json`` reads them back)."""
    return json.dumps(record, separators=(",", ":"))


class ResultsFile:
    """The JSONL file of ``output_path``: a header line, then one line per finished batch."""

    def __init__(self, path: str, header: dict[str, Any]) -> None:
        self.path = path
        self.done: dict[int, Any] = {}
        data = b""
        if os.path.exists(path):
            with open(path, "rb") as f:
                data = f.read()
        complete = data.rfind(b"\n") + 1  # anything after the last newline was cut off mid-write
        lines = data[:complete].splitlines()
        if complete < len(data):
            logger.warning(
                "output_path=%r ends with a line cut off mid-write (%d bytes); ignoring it", path, len(data) - complete
            )
        if lines:
            self._check_header(lines[0], header)
            for number, line in enumerate(lines[1:], start=2):
                self._load_line(number, line, header["n_inputs"])
        with open(path, "r+b" if data else "wb") as f:
            f.truncate(complete if lines else 0)
        self.file = open(path, "ab")  # noqa: SIM115 (closed by close())
        if not lines:
            self.append(json_line(header))
        else:  # a warning, so that it shows by default: results come from a file, not from this run
            n = header["n_inputs"]
            logger.warning(
                "resuming from output_path=%r: found %d of %d inputs already done; running the other %d "
                "(delete the file to start over)", path, len(self.done), n, n - len(self.done)
            )

    def _check_header(self, line: bytes, header: dict[str, Any]) -> None:
        try:
            found = json.loads(line)
        except ValueError:
            found = None
        keys = ("format", "n_inputs", "fingerprint")
        if not isinstance(found, dict) or any(found.get(k) != header[k] for k in keys):
            what = {k: found.get(k) for k in keys} if isinstance(found, dict) else "no dynabatch header"
            raise ValueError(
                f"output_path should be a new file or the results file of these same inputs "
                f"({header['n_inputs']} inputs, fingerprint {header['fingerprint']}), but got "
                f"output_path={self.path!r} holding {what}: use another output_path, or delete the file to start over"
            )

    def _load_line(self, number: int, line: bytes, n_inputs: int) -> None:
        try:
            record = json.loads(line)
            positions, results = record["positions"], record["results"]
            ok = isinstance(positions, list) and isinstance(results, list) and len(positions) == len(results)
            ok = ok and all(isinstance(p, int) and 0 <= p < n_inputs for p in positions)
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            raise ValueError(
                f"output_path should hold dynabatch results lines, but got output_path={self.path!r} whose line "
                f"{number} is not one ({line[:80]!r}); use another output_path, or delete the file to start over"
            )
        self.done.update(zip(positions, results))

    def append(self, line: str) -> None:
        self.file.write(line.encode() + b"\n")
        self.file.flush()
        os.fsync(self.file.fileno())

    def write(self, positions: list[int], results: list[Any]) -> list[Any]:
        """Appends one finished batch; returns the results as read back from JSON."""
        values = [to_json_value(r, "result") for r in results]
        line = json_line({"positions": positions, "results": values})
        self.append(line)
        return json.loads(line)["results"]

    def close(self) -> None:
        self.file.close()


def rank_path(path: str, rank: int, world_size: int) -> str:
    """Each rank's own results file under ``torch.distributed``: ``out.jsonl`` -> ``out.rank0-of-2.jsonl``."""
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}-of-{world_size}{ext}"


def inputs_digest(queue: Any) -> str:
    """A digest identifying the inputs of a :class:`~dynabatch.inference._queue.BatchQueue`, not its plan.

    For a dynabatch loader: the token store (every row's tokens and extras),
    the collator's padding and the pad id token-id results are stripped of;
    results are stored per input position, so a rerun with another plan (a
    lower ``batch_size`` after running out of memory, another classifier, a
    memory model) resumes the same file. Another iterable's batches are read
    once more (whole when it is a one-shot iterator) and digested with their
    positions and tensors, in any order.
    """
    collator = queue.collator
    if collator is not None:
        tokenized = collator.tokenized
        extras = {key: np.asarray(value) for key, value in tokenized.extras.items()}  # the digest sorts the keys
        settings = [collator.pad_token_id, collator.padding_side, collator.pad_to_multiple_of, collator.pad_values]
        return digest(FORMAT, queue.pad_token_id, np.asarray(tokenized.offsets, dtype=np.int64),
                      np.asarray(tokenized.input_ids), extras, settings)
    # Another iterable: the digest of its batches (their positions and tensors), in any order.
    if queue.stream is not None and isinstance(queue.loader, Iterator):
        queue.materialize()  # a one-shot iterator can be read only once
    batches = (i.batch for i in queue.pending) if queue.stream is None else iter(queue.loader)
    parts, n = [], 0
    for batch in batches:
        positions = positions_of(batch, queue.loader)
        tensors = {key: value for key, value in batch.items() if isinstance(value, torch.Tensor)}
        parts.append(digest(positions, tensors))
        n = max(n, int(positions.max()) + 1 if positions.size else 0)
    if queue.n_inputs is None:
        queue.n_inputs = n
    return digest(FORMAT, queue.pad_token_id, sorted(parts))
