"""The text corpus of the example language model, and how it was made.

The character-level ``lm`` trains on ``qbits/_experiments/data/corpus.txt``,
which ships with qbits (no download at run time). The file is the output of
:func:`generate`: English-like sentences from a small probabilistic grammar,
interleaved with short arithmetic facts, drawn with ``random.Random(seed)``
(whose ``random()``-based draws are the same on every platform and Python
version since 3.2). It is licence-clean: every word list below was written
for qbits. ``tests/experiments`` checks that the shipped file equals
``generate()``, so its origin can be verified.

Regenerate it with ``python -m qbits._experiments.corpus``.
"""

from __future__ import annotations

import pathlib
import random

__all__ = ["CORPUS_PATH", "generate", "read"]

CORPUS_PATH = pathlib.Path(__file__).with_name("data") / "corpus.txt"

_NOUNS = [
    "model",
    "river",
    "garden",
    "engine",
    "teacher",
    "student",
    "lantern",
    "harbour",
    "compiler",
    "matrix",
    "farmer",
    "painter",
    "kernel",
    "signal",
    "forest",
    "window",
    "scale",
    "gradient",
    "library",
    "sailor",
    "tensor",
    "village",
    "baker",
    "clock",
    "mountain",
    "letter",
]
_ADJECTIVES = [
    "quiet",
    "bright",
    "small",
    "careful",
    "ancient",
    "narrow",
    "heavy",
    "patient",
    "quick",
    "golden",
    "sparse",
    "dense",
    "crooked",
    "gentle",
    "noisy",
]
_VERBS = [
    "follows",
    "watches",
    "rounds",
    "carries",
    "measures",
    "builds",
    "finds",
    "quantizes",
    "remembers",
    "crosses",
    "paints",
    "trains",
    "shares",
    "sorts",
]
_ADVERBS = [
    "slowly",
    "twice",
    "again",
    "carefully",
    "today",
    "at",
    "night",
    "without",
    "rest",
]
_PLACES = [
    "near the river",
    "under the old bridge",
    "in the workshop",
    "on the hill",
    "behind the library",
    "across the valley",
    "inside the kernel",
]
_CONNECTIVES = ("and then", "but", "because", "while", "so")


def _noun_phrase(rng: random.Random) -> str:
    article = rng.choice(("the", "the", "a", "every", "one"))
    if rng.random() < 0.6:
        return f"{article} {rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)}"
    return f"{article} {rng.choice(_NOUNS)}"


def _clause(rng: random.Random) -> str:
    clause = f"{_noun_phrase(rng)} {rng.choice(_VERBS)} {_noun_phrase(rng)}"
    if rng.random() < 0.4:
        clause += " " + rng.choice(_PLACES)
    if rng.random() < 0.3:
        clause += " " + rng.choice(_ADVERBS)
    return clause


def _sentence(rng: random.Random) -> str:
    text = _clause(rng)
    if rng.random() < 0.35:
        text += f" {rng.choice(_CONNECTIVES)} {_clause(rng)}"
    return text[0].upper() + text[1:] + "."


def _arithmetic(rng: random.Random) -> str:
    a, b = rng.randrange(100), rng.randrange(100)
    if rng.random() < 0.5:
        return f"{a} + {b} = {a + b}."
    a, b = max(a, b), min(a, b)
    return f"{a} - {b} = {a - b}."


def generate(n_chars: int = 300_000, seed: int = 0) -> str:
    """The corpus: paragraphs of generated sentences and arithmetic facts.

    Args:
      n_chars: Stop after the first paragraph that reaches this length.
      seed: Seed of the ``random.Random`` that draws every choice.

    Returns:
      The text, ASCII, paragraphs separated by blank lines.

    Example:
      >>> from qbits._experiments import _corpus as corpus
      >>> corpus.generate(40) == corpus.generate(40)
      True
    """
    rng = random.Random(seed)
    paragraphs: list[str] = []
    size = 0
    while size < n_chars:
        parts = []
        for _ in range(rng.randrange(3, 8)):
            parts.append(_arithmetic(rng) if rng.random() < 0.2 else _sentence(rng))
        paragraph = " ".join(parts)
        paragraphs.append(paragraph)
        size += len(paragraph) + 2
    return "\n\n".join(paragraphs) + "\n"


def read() -> str:
    """The shipped corpus file.

    Example:
      >>> from qbits._experiments import _corpus as corpus
      >>> corpus.read()[:5]
      'Every'
    """
    return CORPUS_PATH.read_text(encoding="ascii")


if __name__ == "__main__":
    CORPUS_PATH.write_text(generate(), encoding="ascii")
    print(f"wrote {CORPUS_PATH}")
