"""A synthetic, structured text corpus generated from a seed (no downloads).

The tiny target is trained on this text, and the tiny drafts are later trained to predict the
target, so the text is deliberately regular: an English-like grammar of short stories, simple
arithmetic, counting and well-known sequences (days, months, letters), and question/answer
pairs. A small model learns its local structure within a minute of CPU training, and many
continuations are fully determined by the context (counting, sequences, repeated answers),
which is what speculative decoding profits from.

Everything is drawn from one ``random.Random(seed)``: the same seed gives the same documents.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

NAMES = ("Anna", "Ben", "Cleo", "Dan", "Eva", "Finn", "Gus", "Hana", "Ivo", "Juno", "Kai", "Lena")
ANIMALS = ("cat", "dog", "bird", "fox", "horse", "mouse", "rabbit", "duck", "goat", "sheep", "frog")
THINGS = (
    "ball",
    "box",
    "book",
    "cup",
    "hat",
    "key",
    "lamp",
    "map",
    "apple",
    "basket",
    "chair",
    "table",
    "window",
    "garden",
    "river",
    "house",
    "boat",
    "tree",
    "stone",
    "letter",
    "bread",
)
PLACES = ("garden", "kitchen", "forest", "market", "school", "park", "village", "library", "farm")
COLORS = ("red", "blue", "green", "yellow", "white", "black", "brown", "orange", "purple")
SIZES = ("small", "big", "little", "tall", "old", "young", "quiet", "happy", "tired", "clever")
VERBS_T = (
    "sees",
    "finds",
    "takes",
    "carries",
    "likes",
    "opens",
    "paints",
    "wants",
    "hides",
    "drops",
    "watches",
    "follows",
)
VERBS_T_PAST = (
    "saw",
    "found",
    "took",
    "carried",
    "liked",
    "opened",
    "painted",
    "wanted",
    "hid",
    "dropped",
    "watched",
    "followed",
)
VERBS_I = ("sleeps", "runs", "sings", "waits", "jumps", "walks", "smiles", "rests", "plays")
VERBS_I_PAST = ("slept", "ran", "sang", "waited", "jumped", "walked", "smiled", "rested", "played")
PREPS = ("in", "on", "near", "under", "behind", "beside")
ADVERBS = ("slowly", "quickly", "quietly", "happily", "again", "today", "every morning", "at night")
TIMES = ("In the morning", "At night", "After lunch", "One day", "Later", "Then", "In the evening")
DAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")
MONTHS = (
    "january",
    "february",
    "march",
    "april",
    "may",
    "june",
    "july",
    "august",
    "september",
    "october",
    "november",
    "december",
)
NUMBER_WORDS = (
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
)
LETTERS = "abcdefghijklmnopqrstuvwxyz"

DOC_KINDS = ("story", "arithmetic", "counting", "sequence", "qa", "list")
DOC_WEIGHTS = (40, 12, 14, 12, 14, 8)


@dataclass(frozen=True)
class CorpusParams:
    """Size of the generated corpus (part of the builder parameters, so part of the cache key)."""

    num_docs: int = 24000


class _Gen:
    def __init__(self, rng: random.Random):
        self.r = rng

    def c(self, seq):
        return self.r.choice(seq)

    # --- grammar -------------------------------------------------------------------------
    def noun_phrase(self, nouns=None, article=None) -> str:
        nouns = nouns or (ANIMALS if self.r.random() < 0.5 else THINGS)
        art = article or self.c(("the", "the", "a"))
        noun = self.c(nouns)
        if art == "a" and noun[0] in "aeiou":
            art = "an"
        adj = ""
        roll = self.r.random()
        if roll < 0.35:
            adj = self.c(COLORS) + " "
        elif roll < 0.6:
            adj = self.c(SIZES) + " "
        if art == "a" and adj and adj[0] in "aeiou":
            art = "an"
        elif art == "an" and adj and adj[0] not in "aeiou":
            art = "a"
        return f"{art} {adj}{noun}"

    def subject(self) -> str:
        if self.r.random() < 0.4:
            return self.c(NAMES)
        return self.noun_phrase(ANIMALS, article="the")

    def sentence(self, past: bool) -> str:
        subj = self.subject()
        kind = self.r.random()
        if kind < 0.55:
            verb = self.c(VERBS_T_PAST if past else VERBS_T)
            s = f"{subj} {verb} {self.noun_phrase()}"
            if self.r.random() < 0.4:
                s += f" {self.c(PREPS)} the {self.c(PLACES)}"
        elif kind < 0.8:
            verb = self.c(VERBS_I_PAST if past else VERBS_I)
            s = f"{subj} {verb}"
            if self.r.random() < 0.5:
                s += f" {self.c(ADVERBS)}"
            else:
                s += f" {self.c(PREPS)} the {self.c(PLACES)}"
        else:
            be = "was" if past else "is"
            s = f"{subj} {be} {self.c(COLORS + SIZES)}"
        if self.r.random() < 0.2:
            s = f"{self.c(TIMES)}, {s[0].lower() + s[1:] if s.split()[0] == 'The' else s}"
        return s[0].upper() + s[1:] + "."

    def story(self) -> str:
        past = self.r.random() < 0.6
        return " ".join(self.sentence(past) for _ in range(self.r.randint(2, 5)))

    # --- numbers ---------------------------------------------------------------------------
    def arithmetic(self) -> str:
        items = []
        for _ in range(self.r.randint(3, 6)):
            op = self.c("+-*")
            if op == "*":
                a, b = self.r.randint(0, 12), self.r.randint(0, 12)
                items.append(f"{a} * {b} = {a * b}")
            elif op == "+":
                a, b = self.r.randint(0, 50), self.r.randint(0, 50)
                items.append(f"{a} + {b} = {a + b}")
            else:
                a = self.r.randint(0, 50)
                b = self.r.randint(0, a)
                items.append(f"{a} - {b} = {a - b}")
        return "; ".join(items) + "."

    def counting(self) -> str:
        step = self.c((1, 1, 1, 2, 5, 10))
        start = self.r.randint(0, 60) * step
        n = self.r.randint(5, 12)
        nums = [str(start + i * step) for i in range(n)]
        if step == 1:
            head = self.c(("Count", "Count up", "Numbers"))
            return f"{head} from {nums[0]}: " + ", ".join(nums) + "."
        return f"Count by {step} from {nums[0]}: " + ", ".join(nums) + "."

    def sequence(self) -> str:
        kind = self.r.random()
        if kind < 0.3:
            i, n = self.r.randrange(7), self.r.randint(4, 9)
            return "Days: " + ", ".join(DAYS[(i + k) % 7] for k in range(n)) + "."
        if kind < 0.6:
            i, n = self.r.randrange(12), self.r.randint(4, 12)
            return "Months: " + ", ".join(MONTHS[(i + k) % 12] for k in range(n)) + "."
        if kind < 0.8:
            i = self.r.randrange(20)
            n = self.r.randint(5, 26 - i)
            return "Letters: " + " ".join(LETTERS[i : i + n]) + "."
        i = self.r.randrange(6)
        n = self.r.randint(4, 13 - i)
        return "Words: " + ", ".join(NUMBER_WORDS[i : i + n]) + "."

    def qa(self) -> str:
        kind = self.r.random()
        if kind < 0.4:
            name, animal, color = self.c(NAMES), self.c(ANIMALS), self.c(COLORS)
            return (
                f"{name} has a {color} {animal}. Q: What color is the {animal}? "
                f"A: The {animal} is {color}."
            )
        if kind < 0.7:
            name, place = self.c(NAMES), self.c(PLACES)
            return f"{name} is in the {place}. Q: Where is {name}? A: {name} is in the {place}."
        a, b = self.r.randint(0, 20), self.r.randint(0, 20)
        return f"Q: What is {a} plus {b}? A: {a} plus {b} is {a + b}."

    def listing(self) -> str:
        kind = self.r.random()
        if kind < 0.4:
            items = self.r.sample(COLORS, self.r.randint(3, 6))
            return "Colors: " + ", ".join(items) + "."
        if kind < 0.7:
            items = self.r.sample(ANIMALS, self.r.randint(3, 6))
            return "Animals: " + ", ".join(items) + "."
        items = self.r.sample(THINGS, self.r.randint(3, 6))
        return f"{self.c(NAMES)} packs " + ", ".join(items[:-1]) + f" and {items[-1]}."

    def document(self) -> str:
        kind = self.r.choices(DOC_KINDS, weights=DOC_WEIGHTS)[0]
        return {
            "story": self.story,
            "arithmetic": self.arithmetic,
            "counting": self.counting,
            "sequence": self.sequence,
            "qa": self.qa,
            "list": self.listing,
        }[kind]()


def generate_documents(seed: int, num_docs: int) -> list[str]:
    """``num_docs`` one-line documents drawn deterministically from ``seed``."""
    if num_docs < 1:
        raise ValueError(f"num_docs must be >= 1, got {num_docs}")
    gen = _Gen(random.Random(f"vllm-nemotron-spec-corpus-{seed}"))
    return [gen.document() for _ in range(num_docs)]


def sample_prompts() -> list[str]:
    """Fixed prompts in the corpus' style (for demos and tests); not drawn from any seed."""
    return [
        "The small cat",
        "Count from 3: 3, 4,",
        "Days: monday, tuesday,",
        "Anna has a red dog. Q: What color is the dog? A:",
        "12 + 7 = 19; 3 * 4 =",
        "One day, Ben found a blue box in the garden. The old horse",
    ]


def document_windows(tokenizer, seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    """Token windows of unseen corpus documents (``<s> doc </s> <s> doc ...``), one per length,
    disjoint, each starting at a document's ``<s>``: long prompts for engine tests."""
    from vllm_nemotron_spec.tiny.tokenizer import BOS_ID, EOS_ID

    stream: list[int] = []
    for enc in tokenizer.encode_batch(generate_documents(seed, 300)):
        stream += enc.ids + [EOS_ID]
    out, end = [], 0
    for length in lengths:
        start = stream.index(BOS_ID, end)
        end = start + length
        out.append(stream[start:end])
    return out
