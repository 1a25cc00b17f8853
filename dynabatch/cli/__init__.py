"""The command line: ``dynabatch COMMAND`` (the console script) or ``python -m dynabatch COMMAND``.

* ``embed``: a corpus in (Parquet, JSONL, text lines, a ``datasets`` folder),
  a Parquet store of embeddings out, on every GPU (:mod:`dynabatch.cli.embed`);
* ``generate``: prompts or chat conversations in, replies out into a store
  (:mod:`dynabatch.cli.generate`);
* ``calibrate``: a model measured on probe batches, its memory model saved as
  JSON (:mod:`dynabatch.cli.calibrate`).

The corpus jobs resume: the same command again runs only the rows the store
does not hold. Every option is checked before a model loads, and a bad one is
one line on stderr with exit status 2.

Example:
    >>> from dynabatch.cli import parser
    >>> args = parser().parse_args(["embed", "corpus/", "embeddings/", "--id-column", "id"])
    >>> args.command.__name__, args.input, args.pooling
    ('embed_command', 'corpus/', 'auto')
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from dynabatch.cli import calibrate, embed, generate
from dynabatch.cli._checks import Parser, stop_on_sigterm, stopped_by

__all__ = ["main", "parser"]


def parser() -> Parser:
    """The command line's parser: one subcommand per job."""
    from dynabatch import __version__
    from dynabatch._distribution import DISTRIBUTION

    from dynabatch.cli.job import EXIT_STATUSES

    top = Parser(prog="dynabatch", description="dynabatch: memory-safe dynamic batches, from the command line",
                 epilog=f"dynabatch COMMAND --help tells a command's options and examples.\n\n{EXIT_STATUSES}",
                 formatter_class=argparse.RawDescriptionHelpFormatter)
    top.add_argument("--version", action="version", version=f"dynabatch {__version__} ({DISTRIBUTION})")
    sub = top.add_subparsers(title="commands", required=True, metavar="COMMAND", parser_class=Parser)
    embed.add_parser(sub)
    generate.add_parser(sub)
    calibrate.add_parser(sub)
    return top


def main(argv: list[str] | None = None) -> int:
    """Runs the command line; returns the exit status (130 after Ctrl-C, 143 after SIGTERM, with one line on stderr: a
    run already under way says itself what its store kept)."""
    args = parser().parse_args(argv)
    # one progress display, the command's own: not transformers' "Loading weights" bar as well (read when
    # transformers is imported, which the commands do after this)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        with stop_on_sigterm():
            return args.command(args, args.parser)
    except KeyboardInterrupt as stop:
        name, status = stopped_by(stop)
        sys.stderr.write(f"{args.parser.prog}: stopped ({name})\n")
        return status


if __name__ == "__main__":
    sys.exit(main())
