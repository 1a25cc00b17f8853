"""The JSONL results file of ``run(..., output_path=...)``, which lets a killed run resume.

Line 1 is a header: the format, the number of inputs and a sha256 of the
inputs and plan. Every later line is one finished batch,
``{"positions": [...], "results": [...]}``, appended, flushed and fsynced. A
file from other inputs is refused; a last line cut off mid-write is dropped.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from dynabatch.inference._rows import json_line, to_json_value

logger = logging.getLogger(__name__)

FORMAT = "dynabatch.run/1"


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
        elif self.done:
            logger.info(
                "resuming from output_path=%r: %d of %d inputs already done", path, len(self.done), header["n_inputs"]
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
                f"output_path should be a new file or the results file of these same inputs and plan "
                f"({header['n_inputs']} inputs, fingerprint {header['fingerprint'][:16]}...), but got "
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
