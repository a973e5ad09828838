"""Deterministic, real-looking English text without downloading a corpus.

Benchmarks need prompts that tokenize like real prose (common words, punctuation,
varied sentence shapes), because a tokenizer fed random characters produces unrealistic
token counts and a model fed them produces unrealistic outputs. A small grammar over
word lists is enough for that, and a seed makes every prompt reproducible.
"""

from __future__ import annotations

import random

_NAMES = (
    "Alice", "Bruno", "Chen", "Dara", "Elena", "Farid", "Grace", "Hugo", "Ines", "Jonas",
    "Keiko", "Liam", "Maya", "Nikolai", "Olga", "Pedro", "Quinn", "Rosa", "Samir", "Tara",
)
_PLACES = (
    "the harbour", "the old library", "the market square", "the mountain village",
    "the research station", "the train station", "the river bank", "the city council",
    "the small bakery", "the county hospital", "the school garden", "the museum",
    "the factory floor", "the observatory", "the farmers' cooperative", "the island ferry",
)
_NOUNS = (
    "report", "budget", "garden", "bridge", "engine", "recipe", "festival", "machine",
    "letter", "storm", "harvest", "painting", "journey", "experiment", "contract", "song",
    "map", "window", "question", "lesson", "meeting", "network", "river", "forest",
    "telescope", "bicycle", "kitchen", "theory", "schedule", "proposal", "museum", "island",
)
_ADJECTIVES = (
    "quiet", "careful", "bright", "ancient", "unusual", "modest", "heavy", "curious",
    "generous", "narrow", "patient", "sudden", "familiar", "distant", "simple", "crowded",
    "reliable", "fragile", "honest", "clever", "gentle", "steady", "remarkable", "busy",
)
_VERBS_PAST = (
    "repaired", "described", "discovered", "planned", "questioned", "measured", "painted",
    "delivered", "studied", "organised", "explained", "protected", "improved", "visited",
    "recorded", "shared", "tested", "finished", "borrowed", "announced", "designed",
)
_VERBS_BASE = (
    "repair", "describe", "discover", "plan", "measure", "paint", "deliver", "study",
    "organise", "explain", "protect", "improve", "visit", "record", "share", "test",
)
_ADVERBS = (
    "slowly", "carefully", "quickly", "quietly", "eventually", "happily", "patiently",
    "suddenly", "proudly", "reluctantly", "gladly", "cheerfully", "secretly", "openly",
)
_TIMES = (
    "on Monday morning", "after the long winter", "before sunrise", "late in the evening",
    "during the holidays", "last spring", "at the end of the month", "in the afternoon",
    "every other week", "three years ago", "just before lunch", "after the meeting",
)
_CONNECTIVES = ("Meanwhile", "However", "Later", "As a result", "In the end", "Still",
                "At first", "Afterwards", "For that reason", "Even so")


class TextGenerator:
    """Sentences, paragraphs and questions from one seeded random stream.

    Two generators with the same seed produce the same text in the same order; that is
    the whole reproducibility contract of the workloads built on it.
    """

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    @property
    def rng(self) -> random.Random:
        """The stream itself, for callers that must draw other choices in the same order."""
        return self._rng

    def _pick(self, words: tuple[str, ...]) -> str:
        return self._rng.choice(words)

    def _noun_phrase(self) -> str:
        if self._rng.random() < 0.5:
            return f"the {self._pick(_ADJECTIVES)} {self._pick(_NOUNS)}"
        return f"the {self._pick(_NOUNS)}"

    def sentence(self) -> str:
        """One declarative sentence, in one of several shapes."""
        name, other = self._rng.sample(_NAMES, 2)
        shape = self._rng.randrange(6)
        if shape == 0:
            text = (f"{name} {self._pick(_VERBS_PAST)} {self._noun_phrase()} at "
                    f"{self._pick(_PLACES)} {self._pick(_TIMES)}")
        elif shape == 1:
            text = (f"{self._pick(_CONNECTIVES)}, {name} and {other} "
                    f"{self._pick(_ADVERBS)} {self._pick(_VERBS_PAST)} {self._noun_phrase()}")
        elif shape == 2:
            text = (f"Nobody at {self._pick(_PLACES)} expected {self._noun_phrase()} to be so "
                    f"{self._pick(_ADJECTIVES)}")
        elif shape == 3:
            count = self._rng.randint(2, 97)
            text = (f"{name} counted {count} {self._pick(_NOUNS)}s and wrote the number in "
                    f"a {self._pick(_ADJECTIVES)} notebook")
        elif shape == 4:
            text = (f"Because {self._noun_phrase()} was {self._pick(_ADJECTIVES)}, {name} "
                    f"decided to {self._pick(_VERBS_BASE)} it {self._pick(_ADVERBS)}")
        else:
            text = (f"{name} told {other} that {self._noun_phrase()} near "
                    f"{self._pick(_PLACES)} had been {self._pick(_VERBS_PAST)}")
        return text[0].upper() + text[1:] + "."

    def paragraph(self, sentences: int = 5) -> str:
        return " ".join(self.sentence() for _ in range(sentences))

    def question(self) -> str:
        """A question about the kind of facts that `sentence` states."""
        name = self._pick(_NAMES)
        shape = self._rng.randrange(3)
        if shape == 0:
            return f"Why did {name} {self._pick(_VERBS_BASE)} {self._noun_phrase()}?"
        if shape == 1:
            return f"Where would {name} find {self._noun_phrase()} {self._pick(_TIMES)}?"
        return (f"How many {self._pick(_NOUNS)}s did {name} count at "
                f"{self._pick(_PLACES)}, and why?")

    def answer(self) -> str:
        """A short answer in the style of a worked example."""
        return f"{self.sentence()} {self.sentence()}"
