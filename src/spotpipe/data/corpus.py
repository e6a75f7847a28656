"""A small, deterministic English corpus for the examples, generated instead of downloaded.

The machines that run examples and checks may have no network, so the demo corpus is made
from a tiny grammar with a fixed seed: the same bytes everywhere, regular enough (agreement,
articles, recurring phrases) that a small byte-level GPT visibly learns it within minutes.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

_SEED = 20240601
_TARGET_BYTES = 300_000

_NAMES = ["Anna", "Ben", "Clara", "David", "Elena", "Felix", "Grace", "Hugo", "Iris", "Jonas"]
_ANIMALS = ["cat", "dog", "fox", "bird", "horse", "rabbit", "owl", "goat", "mouse", "bear"]
_THINGS = ["book", "lamp", "letter", "garden", "boat", "song", "river", "window", "bridge", "map"]
_ADJS = ["small", "old", "quiet", "bright", "green", "tired", "happy", "cold", "gentle", "brave"]
_PLACES = ["in the forest", "near the river", "on the hill", "by the sea", "in the village",
           "under the old tree", "at the market", "behind the house"]
_TIMES = ["In the morning", "At night", "Every day", "Last summer", "After the rain",
          "Before dinner", "On Sunday", "Later that week"]
_VERBS = [("sees", "saw"), ("finds", "found"), ("likes", "liked"), ("watches", "watched"),
          ("carries", "carried"), ("follows", "followed"), ("paints", "painted"),
          ("reads", "read")]
_INTRANS = [("sleeps", "slept"), ("runs", "ran"), ("sings", "sang"), ("waits", "waited"),
            ("walks", "walked"), ("laughs", "laughed")]
_ADVS = ["slowly", "quietly", "happily", "again", "together", "for a long time"]


def _noun_phrase(rng: random.Random) -> str:
    noun = rng.choice(_ANIMALS + _THINGS)
    if rng.random() < 0.5:
        noun = f"{rng.choice(_ADJS)} {noun}"
    article = "an" if noun[0] in "aeiou" else "a"
    return rng.choice(["the", article]) + " " + noun


def _subject(rng: random.Random) -> str:
    return rng.choice(_NAMES) if rng.random() < 0.5 else _noun_phrase(rng)


def _sentence(rng: random.Random) -> str:
    past = rng.random() < 0.5
    tense = 1 if past else 0
    kind = rng.random()
    if kind < 0.45:
        body = f"{_subject(rng)} {rng.choice(_VERBS)[tense]} {_noun_phrase(rng)}"
    elif kind < 0.7:
        body = f"{_subject(rng)} {rng.choice(_INTRANS)[tense]} {rng.choice(_ADVS)}"
    elif kind < 0.85:
        subj = _subject(rng)
        body = f"{subj} {'was' if past else 'is'} {rng.choice(_ADJS)}"
    else:
        body = (f"{_subject(rng)} {rng.choice(_VERBS)[tense]} {_noun_phrase(rng)} and "
                f"{rng.choice(_INTRANS)[tense]}")
    if rng.random() < 0.4:
        body += " " + rng.choice(_PLACES)
    if rng.random() < 0.25:  # "In the morning, the fox ..." but "In the morning, Anna ..."
        if not body.startswith(tuple(_NAMES)):
            body = body[0].lower() + body[1:]
        body = rng.choice(_TIMES) + ", " + body
    body = body[0].upper() + body[1:]
    return body + ("?" if rng.random() < 0.05 else ".")


def demo_corpus_text(target_bytes: int = _TARGET_BYTES) -> str:
    """The corpus text: paragraphs of 3-7 sentences, about ``target_bytes`` long."""
    rng = random.Random(_SEED)
    paragraphs: list[str] = []
    size = 0
    while size < target_bytes:
        para = " ".join(_sentence(rng) for _ in range(rng.randint(3, 7)))
        paragraphs.append(para)
        size += len(para) + 2
    return "\n\n".join(paragraphs) + "\n"


def ensure_demo_corpus(path: str | os.PathLike) -> Path:
    """Write the demo corpus to ``path`` unless a non-empty file is already there.

    Written to a temporary file and renamed, so concurrent workers never read a half-written
    corpus.
    """
    p = Path(path)
    if p.is_file() and p.stat().st_size > 0:
        return p
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + f".tmp{os.getpid()}")
    tmp.write_text(demo_corpus_text(), encoding="utf-8")
    os.replace(tmp, p)
    return p
