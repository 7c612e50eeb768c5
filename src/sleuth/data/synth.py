"""A synthetic multi-hop world: fictional entities, one encyclopedic document each, and 1-4 hop questions.

Size: one module on purpose (about 1,200 lines): the world, its question templates and the corpus writer are one
seeded generator; split, what a seed produces would be spread over several files.

No model can know the answers from pre-training: every name is invented from syllables, every fact is drawn at
random. Each entity (person, city, country, organisation, river) gets one document whose title is its name and
whose text states its relations (``born_in``, ``located_in``, ``founded_by``, ...) and numeric attributes (birth
year, founding year, population, length) in template sentences. Questions are

* **bridge** chains of 1-4 hops: "In which country was the founder of Velmo Guild born?" decomposes into
  ``### Q1: Who founded Velmo Guild?`` / ``### Q2: Where was #1 born?`` / ``### Q3: In which country is #2
  located?``;
* **comparisons** of two parallel chains: "Who was born first, the founder of Velmo Guild or the founder of Dask
  Press?" -> Q1/Q2 for the first side, Q3/Q4 for the second, then ``### Q5: Who was born first, #1 (#2) or #3
  (#4)?``.

Every question carries its gold decomposition (questions with AceSearcher ``#k`` references, gold intermediate
answers, the document that states each step), its supporting document ids and distractor documents: entities whose
names share a stem with the chain's entities ("Velmo Guild" / "Velmo Society" / "Velmoria"), or that state the same
relation for someone else. The generator checks that no question can be answered from its distractors alone.
:func:`follow_decomposition` answers a decomposition by parsing the template sentences of the documents it is given;
the tests use it to show that every question is answerable from its supporting documents.

The train, dev and test splits use disjoint entity sets; the corpus holds every document. The same
:class:`SynthConfig` gives byte-identical files (:func:`write_world`). Difficulty knobs and the default counts are
documented in ``docs/synthetic-world.md``.

>>> world = generate_world(SynthConfig(seed=1, train_entities=60, dev_entities=30, test_entities=30,
...                                    train_questions=20, dev_questions=5, test_questions=5))
>>> ex = world.splits["train"][0]
>>> follow_decomposition(ex.decomposition, [world.passage(i) for i in ex.supporting_ids]) in ex.answers
True
"""

from __future__ import annotations

import json
import math
import os
import random
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields
from functools import lru_cache
from typing import Any

from sleuth.data._rows import PathLike, read_records
from sleuth.records import Example, Passage

__all__ = [
    "RELATIONS",
    "SPLITS",
    "TYPES",
    "Entity",
    "Relation",
    "SynthConfig",
    "World",
    "decomposition_text",
    "follow_decomposition",
    "generate_world",
    "load_synth",
    "mentioned_titles",
    "parse_subquestion",
    "read_facts",
    "synthesize",
    "write_world",
]

SPLITS: tuple[str, ...] = ("train", "dev", "test")
TYPES: tuple[str, ...] = ("person", "city", "country", "organisation", "river")
MAX_PARAPHRASE = 2
MAX_HOPS = 4

# ------------------------------------------------------------------------------------------------------ relations


@dataclass(frozen=True)
class Relation:
    """A relation (``target`` is an entity type) or a numeric attribute (``target`` is None) and its templates.

    ``facts`` are document sentences (``{s}`` the subject's name, ``{o}`` the object); ``questions`` sub-questions
    about ``{x}``; ``phrases`` noun phrases ("the founder of {x}") used to nest a relation inside a composed
    question; ``comparisons`` (attributes only) compare ``{a}`` and ``{b}``, ``larger`` saying which value wins.
    Paraphrase level ``L`` uses the first ``L + 1`` templates of each list; the first is the canonical one.
    """

    name: str
    subjects: tuple[str, ...]
    target: str | None
    facts: tuple[str, ...]
    questions: tuple[str, ...]
    phrases: tuple[str, ...] = ()
    comparisons: tuple[str, ...] = ()
    larger: bool = False


def _rel(*args: Any, **kwargs: Any) -> tuple[str, Relation]:
    r = Relation(*args, **kwargs)
    return r.name, r


RELATIONS: dict[str, Relation] = dict(
    [
        _rel(
            "born_in",
            ("person",),
            "city",
            ("{s} was born in the city of {o}.", "{s} is a native of {o}.", "The birthplace of {s} is {o}."),
            ("Where was {x} born?", "In which city was {x} born?", "What is the birthplace of {x}?"),
            ("the birthplace of {x}", "the city where {x} was born", "the home town of {x}"),
        ),
        _rel(
            "employer",
            ("person",),
            "organisation",
            ("{s} works for {o}.", "{s} is employed by {o}.", "The employer of {s} is {o}."),
            ("Who employs {x}?", "Which organisation does {x} work for?", "Who is the employer of {x}?"),
            ("the employer of {x}", "the organisation that employs {x}", "the organisation {x} works for"),
        ),
        _rel(
            "spouse",
            ("person",),
            "person",
            ("{s} is married to {o}.", "The spouse of {s} is {o}.", "{s} and {o} are married."),
            ("Who is {x} married to?", "Who is the spouse of {x}?", "Whom did {x} marry?"),
            ("the spouse of {x}", "the person married to {x}", "the husband or wife of {x}"),
        ),
        _rel(
            "located_in",
            ("city",),
            "country",
            ("{s} is located in the country of {o}.", "{s} lies in {o}.", "{s} is a city in {o}."),
            ("In which country is {x} located?", "Which country is {x} in?", "In what country does {x} lie?"),
            ("the country where {x} is located", "the country of {x}", "the country in which {x} lies"),
        ),
        _rel(
            "river",
            ("city",),
            "river",
            ("The {o} flows through {s}.", "{s} lies on the banks of the {o}.", "{s} is built along the {o}."),
            ("Which river flows through {x}?", "On which river does {x} lie?", "What river runs through {x}?"),
            ("the river flowing through {x}", "the river that runs through {x}", "the river on which {x} lies"),
        ),
        _rel(
            "capital",
            ("country",),
            "city",
            ("The capital of {s} is {o}.", "{o} is the capital of {s}.", "{s} has its capital at {o}."),
            ("What is the capital of {x}?", "Which city is the capital of {x}?", "What is the capital city of {x}?"),
            ("the capital of {x}", "the capital city of {x}", "the city that is the capital of {x}"),
        ),
        _rel(
            "leader",
            ("country",),
            "person",
            ("The head of state of {s} is {o}.", "{s} is led by {o}.", "{o} is the head of state of {s}."),
            ("Who is the head of state of {x}?", "Who leads {x}?", "Who is the leader of {x}?"),
            ("the head of state of {x}", "the leader of {x}", "the person who leads {x}"),
        ),
        _rel(
            "founded_by",
            ("organisation",),
            "person",
            ("{s} was founded by {o}.", "The founder of {s} is {o}.", "{o} founded {s}."),
            ("Who founded {x}?", "Who is the founder of {x}?", "Who established {x}?"),
            ("the founder of {x}", "the person who founded {x}", "the person who established {x}"),
        ),
        _rel(
            "headquarters",
            ("organisation",),
            "city",
            ("{s} is headquartered in {o}.", "The headquarters of {s} are in {o}.", "{s} has its head office in {o}."),
            (
                "Where is {x} headquartered?",
                "In which city is {x} headquartered?",
                "Where are the headquarters of {x}?",
            ),
            ("the city where {x} is headquartered", "the headquarters city of {x}", "the home city of {x}"),
        ),
        _rel(
            "source",
            ("river",),
            "country",
            ("The {s} rises in {o}.", "The source of the {s} is in {o}.", "The {s} has its source in {o}."),
            (
                "In which country does {x} rise?",
                "Where is the source of {x}?",
                "In which country is the source of {x}?",
            ),
            ("the country where {x} rises", "the country in which {x} has its source", "the source country of {x}"),
        ),
        _rel(
            "birth_year",
            ("person",),
            None,
            ("{s} was born in the year {o}.", "The year of birth of {s} is {o}.", "{s} came into the world in {o}."),
            ("When was {x} born?", "In what year was {x} born?", "What is the birth year of {x}?"),
            comparisons=(
                "Who was born first, {a} or {b}?",
                "Who was born earlier, {a} or {b}?",
                "Which person is older, {a} or {b}?",
            ),
        ),
        _rel(
            "founded",
            ("city", "organisation"),
            None,
            ("{s} was founded in {o}.", "{s} dates from the year {o}.", "The founding year of {s} is {o}."),
            ("When was {x} founded?", "In what year was {x} founded?", "What is the founding year of {x}?"),
            comparisons=(
                "Which was founded earlier, {a} or {b}?",
                "Which was founded first, {a} or {b}?",
                "Which is older, {a} or {b}?",
            ),
        ),
        _rel(
            "population",
            ("city",),
            None,
            ("{s} has a population of {o}.", "About {o} people live in {s}.", "{s} is home to {o} inhabitants."),
            ("What is the population of {x}?", "How many people live in {x}?", "How many inhabitants does {x} have?"),
            comparisons=(
                "Which city has more inhabitants, {a} or {b}?",
                "Which is more populous, {a} or {b}?",
                "Which city has the larger population, {a} or {b}?",
            ),
            larger=True,
        ),
        _rel(
            "independence",
            ("country",),
            None,
            (
                "{s} became independent in {o}.",
                "{s} gained its independence in {o}.",
                "The independence of {s} dates to {o}.",
            ),
            (
                "When did {x} become independent?",
                "In what year did {x} gain independence?",
                "When did {x} gain its independence?",
            ),
            comparisons=(
                "Which country became independent first, {a} or {b}?",
                "Which country gained independence earlier, {a} or {b}?",
                "Which became independent earlier, {a} or {b}?",
            ),
        ),
        _rel(
            "length",
            ("river",),
            None,
            (
                "The {s} is {o} kilometres long.",
                "The {s} has a length of {o} kilometres.",
                "The {s} runs for {o} kilometres.",
            ),
            ("How long is {x}?", "What is the length of {x}?", "How many kilometres long is {x}?"),
            comparisons=(
                "Which river is longer, {a} or {b}?",
                "Which is the longer river, {a} or {b}?",
                "Which river has the greater length, {a} or {b}?",
            ),
            larger=True,
        ),
    ]
)

# The relations each type states, in document order.
TYPE_RELATIONS: dict[str, tuple[str, ...]] = {
    "person": ("born_in", "birth_year", "employer", "spouse"),
    "city": ("located_in", "river", "founded", "population"),
    "country": ("capital", "leader", "independence"),
    "organisation": ("founded_by", "headquarters", "founded"),
    "river": ("source", "length"),
}

LEADS: dict[str, tuple[str, ...]] = {
    "person": ("{s} is {job}.", "{s} is known as {job}.", "By profession, {s} is {job}."),
    "city": ("{s} is a city.", "{s} is an old city.", "{s} is a town of some size."),
    "country": ("{s} is a country.", "{s} is a sovereign state.", "{s} is a small nation."),
    "organisation": ("{s} is an organisation.", "{s} is a private organisation.", "{s} is a well-known institution."),
    "river": ("The {s} is a river.", "The {s} is a long river.", "The {s} is a river with many tributaries."),
}

# Sentences that state nothing; some share words with the relations ("born", "founded", "capital", "river").
FILLERS: tuple[str, ...] = (
    "Several regional chronicles mention {m}.",
    "Little is recorded about the early history of {m}.",
    "Travellers often describe {m} in their letters.",
    "An old survey of the region lists {m} among its landmarks.",
    "Local archives hold many documents about {m}.",
    "Historians disagree about who founded the first market near {m}.",
    "Several people born in the region have written about {m}.",
    "Envoys from a distant capital once wrote about {m}.",
    "Old maps show a small river close to {m}.",
    "A short account of {m} was printed in a provincial gazette.",
)

JOBS: tuple[str, ...] = ("painter", "engineer", "cartographer", "merchant", "physician", "poet", "architect",
                         "astronomer", "botanist", "sculptor", "composer", "jurist")  # fmt: skip
ORG_KINDS: tuple[str, ...] = ("Guild", "Company", "Institute", "Society", "Works", "Trust", "Academy", "Foundry",
                              "Press", "Union")  # fmt: skip
TYPE_SHARE: dict[str, float] = {"person": 0.36, "city": 0.2, "organisation": 0.2, "river": 0.12, "country": 0.12}
PRONOUNS: tuple[str, ...] = ("He", "She", "It")

# --------------------------------------------------------------------------------------------------------- config


@dataclass(frozen=True)
class SynthConfig:
    """What to generate and how hard to make it (see ``docs/synthetic-world.md``).

    * ``*_entities``: entities per split (disjoint sets; 36 % people, 20 % cities, 20 % organisations, 12 % rivers,
      12 % countries); ``*_questions``: questions per split.
    * ``min_hops``/``max_hops`` (1-4): documents a bridge question needs; comparisons have 2 (two attributes) or 4
      (two 2-hop chains) and are made only when that count is in range.
    * ``comparison_fraction``: share of comparison questions; ``numeric_fraction``: share of bridge questions
      whose last hop asks for a number (a year, a population, a length) instead of an entity.
    * ``distractors``: distractor documents listed per question (and put in the context with ``context=True``).
    * ``lookalike_rate``: probability that a new entity's name reuses or mutates the stem of an entity already in
      its split ("Velmo", "Velmo Guild", "Velmoria", "Velma Press"), so lexical retrieval can be misled.
    * ``paraphrase`` (0-2): 0 = one template per fact sentence, sub-question and phrase, facts in a fixed order;
      1 = two templates each, facts shuffled; 2 = three templates each, plus pronouns for the subject.
    * ``filler_sentences``: sentences per document that state nothing (some share words with the relations).
    * ``context``: put the supporting and distractor documents into ``Example.context`` (ARENA-style readers);
      by default the context is empty and the documents are found by retrieval over the corpus.
    """

    seed: int = 0
    train_entities: int = 1000
    dev_entities: int = 250
    test_entities: int = 250
    train_questions: int = 5000
    dev_questions: int = 500
    test_questions: int = 500
    min_hops: int = 2
    max_hops: int = 4
    comparison_fraction: float = 0.25
    numeric_fraction: float = 0.2
    distractors: int = 6
    lookalike_rate: float = 0.5
    paraphrase: int = 1
    filler_sentences: int = 1
    context: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.min_hops <= self.max_hops <= MAX_HOPS:
            raise ValueError(f"need 1 <= min_hops <= max_hops <= {MAX_HOPS}, got {self.min_hops}..{self.max_hops}")
        for name in ("comparison_fraction", "numeric_fraction", "lookalike_rate"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value}")
        if not 0 <= self.paraphrase <= MAX_PARAPHRASE:
            raise ValueError(f"paraphrase must be 0..{MAX_PARAPHRASE}, got {self.paraphrase}")
        if not 0 <= self.filler_sentences <= len(FILLERS):
            raise ValueError(f"filler_sentences must be 0..{len(FILLERS)}, got {self.filler_sentences}")
        if self.distractors < 0:
            raise ValueError(f"distractors must be >= 0, got {self.distractors}")
        for split in SPLITS:
            n, q = self.entities(split), self.questions(split)
            if n < 20:
                raise ValueError(f"{split}_entities must be >= 20, got {n}")
            if q < 0:
                raise ValueError(f"{split}_questions must be >= 0, got {q}")
        if self.comparison_fraction > 0 and not self.comparison_depths():
            raise ValueError(
                "comparison questions need 2 or 4 hops in range; "
                f"min_hops..max_hops is {self.min_hops}..{self.max_hops} (set comparison_fraction=0)"
            )

    def entities(self, split: str) -> int:
        """Entities of one split."""
        return int(getattr(self, f"{split}_entities"))

    def questions(self, split: str) -> int:
        """Questions of one split."""
        return int(getattr(self, f"{split}_questions"))

    def comparison_depths(self) -> list[int]:
        """Bridge depths of comparison chains whose hop count 2 * (depth + 1) is within the hop range."""
        return [d for d in (0, 1) if self.min_hops <= 2 * (d + 1) <= self.max_hops]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SynthConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"SynthConfig: unknown field(s) {sorted(unknown)}")
        return cls(**data)


# ------------------------------------------------------------------------------------------------------- entities


@dataclass(eq=False)
class Entity:
    """One fictional entity: its document is ``World.passage(entity.id)``.

    ``links`` maps a relation to the index of its object entity, ``values`` an attribute to its number; ``family``
    groups entities whose names share a stem or a mutation of it (lookalikes), ``stem`` is the invented word the
    name is built on.
    """

    index: int
    id: str
    name: str
    type: str
    split: str
    family: int
    stem: str = ""
    gender: str = ""
    job: str = ""
    links: dict[str, int] = field(default_factory=dict)
    values: dict[str, int] = field(default_factory=dict)

    @property
    def mention(self) -> str:
        """The name as it reads inside a sentence: rivers take "the" ("the Velmo River")."""
        return f"the {self.name}" if self.type == "river" else self.name


def format_value(relation: str, value: int) -> str:
    """A number as the documents state it: populations with thousands separators, years and lengths plain."""
    return f"{value:,}" if relation == "population" else str(value)


def value_answers(relation: str, value: int) -> list[str]:
    """The accepted answers for a number: the stated form first, then simple aliases."""
    if relation == "population":
        return [f"{value:,}", str(value)]
    if relation == "length":
        return [f"{value} kilometres", f"{value} km", str(value)]
    return [str(value)]


def entity_answers(entity: Entity) -> list[str]:
    """The accepted answers for an entity: its name, plus "the NAME" for organisations and rivers."""
    if entity.type in ("organisation", "river"):
        return [entity.name, f"the {entity.name}"]
    return [entity.name]


# ---------------------------------------------------------------------------------------------------------- names

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "gr", "kr", "tr", "th",
           "sk", "st", "vr", "zh", "kh", "sh")  # fmt: skip
_NUCLEI = ("a", "e", "i", "o", "u", "a", "e", "o", "ae", "ei", "ou", "y")
_CODAS = ("n", "r", "l", "s", "th", "k", "sk", "m", "v", "x", "nd", "rn")
_COUNTRY_AFTER_VOWEL = ("ria", "nia", "vary", "sh")
_COUNTRY_AFTER_CONSONANT = ("ia", "ar", "esh", "und", "ova")

# Real words and names that the syllables can spell; a stem equal to one of them is redrawn.
_REAL_WORDS_TEXT = """
    abel adam alba asia baron basel bata bella berlin bern bora bosnia bruno buda cairo capri carlo china cuba
    dakota dallas dana delta demon derby dora doha duma ella elba gaza gela ghana gina golan goth kenya kira koran
    korea lara laos lena lima linda lisa lola lora luna malta mara maria mars maya melon mona nato nepal nika nina
    nora oman panda paris pasta pata pizza polo rena riga rita roma rosa sara sasha shasta sofia solar sudan sumo
    syria tara tiber tina tokyo tonga tora trina tula vera vienna volga zara zebra zulu sera lotus bonus venus
    minus virus status gusto brio drama gamma karma lama sauna stella sonar tenor manor polar lunar molar radar
    rotor tutor vapor salon talon lemon baton canon gallon kansas texas fargo dubai kabul delhi milan turin naples
    genoa tirana kosovo belarus grupo krabi mesti thupa saeta dashi khufu nasal kebra taegu sakha vodou limes
    tidra sadra greta keita sheba pedro tripi mesto vapour rastas nesta rebel galen stoma mikra kodak banal khani
    basha testa salar kishi brunei besan libri ravel zizou deity dadra negro shima stupa libra pyrus basil shogi
    metro rishi raman travel shaka kutha rashi gabra fabri sutra khanos vesta beidou tethys khetra tetra setae
    veran pashas zhuge salix pavel madre staten paran dopa mesas louvre petrou tokyo sushi kimono sumatra java
    bali samurai ninja koala kiwi mango papaya tapas salsa shoki tatra sidra getae nithi sousa grazie suzhou solon
    keiko delos gravy tenon patron razor sebum given fetal bravo petra luzon legend petal thorax pasha renal
"""
_REAL_WORDS = frozenset(_REAL_WORDS_TEXT.split())


def _word_ok(stem: str) -> bool:
    """5-9 letters, no English-looking ending ("Stone", "Ropes", "Taper", "Shady"), not a listed real word."""
    low = stem.lower()
    english = low.endswith(("es", "er", "ly", "dy", "ry")) or (low.endswith("e") and low[-2] not in "aeiouy")
    return 5 <= len(low) <= 9 and not english and low not in _REAL_WORDS


class _Namer:
    """Invents unique names from syllables, and lookalike names from the stems of earlier ones."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.names: set[str] = set()
        self.stems: set[str] = set()

    def syllable(self, last: bool) -> str:
        s = self.rng.choice(_ONSETS) + self.rng.choice(_NUCLEI)
        if last and self.rng.random() < 0.35:
            s += self.rng.choice(_CODAS)
        return s

    def fresh_stem(self) -> str:
        """A new stem of 2 (or 3) syllables that passes :func:`_word_ok` and was never returned before."""
        while True:
            n = 3 if self.rng.random() < 0.25 else 2
            stem = "".join(self.syllable(i == n - 1) for i in range(n)).capitalize()
            if _word_ok(stem) and stem not in self.stems:
                self.stems.add(stem)
                return stem

    def mutate(self, stem: str) -> str:
        """A new stem one vowel or one leading consonant away from ``stem`` ("Velmo" -> "Velma", "Vilmo", "Belmo")."""
        low = stem.lower()
        for _ in range(50):
            spots = [i for i, c in enumerate(low) if c in "aeiouy"]
            if low[1] in "aeiouy":
                spots.append(0)  # a single leading consonant may change too
            i = self.rng.choice(spots)
            letter = self.rng.choice("aeiou" if low[i] in "aeiouy" else "bdgklmnprstvz")
            new = (low[:i] + letter + low[i + 1 :]).capitalize()
            if new != stem and new not in self.stems and _word_ok(new):
                self.stems.add(new)
                return new
        return self.fresh_stem()

    def take(self, name: str) -> bool:
        """Claim ``name`` if no entity has it yet."""
        if name in self.names:
            return False
        self.names.add(name)
        return True


def _country_name(stem: str, rng: random.Random) -> str:
    ends = _COUNTRY_AFTER_VOWEL if stem[-1] in "aeiouy" else _COUNTRY_AFTER_CONSONANT
    return stem + rng.choice(ends)


def _type_counts(n: int) -> dict[str, int]:
    """How many entities of each type a split of ``n`` gets (largest remainder; at least 2 of each)."""
    raw = {t: n * TYPE_SHARE[t] for t in TYPES}
    counts = {t: max(2, math.floor(v)) for t, v in raw.items()}
    order = sorted(TYPES, key=lambda t: (-(raw[t] - math.floor(raw[t])), TYPES.index(t)))
    i = 0
    while sum(counts.values()) < n:
        counts[order[i % len(order)]] += 1
        i += 1
    counts["city"] = max(counts["city"], counts["country"])
    counts["person"] = max(counts["person"], counts["country"] + 2)
    return counts


# ---------------------------------------------------------------------------------------------------------- world


@dataclass
class World:
    """A generated world: entities, one document per entity (``corpus``) and the questions of each split."""

    config: SynthConfig
    entities: list[Entity]
    corpus: list[Passage]
    splits: dict[str, list[Example]]
    _by_id: dict[str, Passage] = field(default_factory=dict, repr=False, compare=False)

    def passage(self, pid: str) -> Passage:
        """The document with id ``pid``."""
        if len(self._by_id) != len(self.corpus):
            self._by_id = {p.id: p for p in self.corpus}
        return self._by_id[pid]

    def entity(self, pid: str) -> Entity:
        """The entity whose document has id ``pid``."""
        return self.entities[int(pid.rsplit("-e", 1)[1])]

    def counts(self) -> dict[str, Any]:
        """Documents, entities per split and type, and questions per split by type and hop count."""
        entities: dict[str, dict[str, int]] = {}
        for e in self.entities:
            per = entities.setdefault(e.split, {t: 0 for t in TYPES})
            per[e.type] += 1
        questions: dict[str, Any] = {}
        for split, examples in self.splits.items():
            by_type = {"bridge": 0, "comparison": 0}
            hops: dict[str, int] = {}
            numeric = 0
            for ex in examples:
                by_type[ex.metadata["type"]] += 1
                key = str(ex.metadata["hops"])
                hops[key] = hops.get(key, 0) + 1
                numeric += ex.metadata["answer_type"] == "number"
            questions[split] = {
                "total": len(examples),
                **by_type,
                "numeric_answers": numeric,
                "hops": dict(sorted(hops.items())),
                "distractors": sum(len(ex.metadata["distractor_ids"]) for ex in examples),
            }
        return {
            "documents": len(self.corpus),
            "sentences": sum(len(_sentences(p.text)) for p in self.corpus),
            "entities": entities,
            "questions": questions,
        }


def generate_world(config: SynthConfig | None = None) -> World:
    """Generate the world that ``config`` describes; the same config always gives the same world."""
    config = config or SynthConfig()
    return _Builder(config).build()


class _Builder:
    def __init__(self, config: SynthConfig) -> None:
        self.config = config
        self.seed = config.seed
        self.entities: list[Entity] = []
        self.namer = _Namer(self._rng("names"))
        self.families = 0
        self.by_id: dict[str, Passage] = {}
        self.by_family: dict[tuple[str, int], list[Entity]] = {}
        self.by_type: dict[tuple[str, str], list[Entity]] = {}

    def _rng(self, *parts: object) -> random.Random:
        """An independent random stream per purpose (string seeds hash with SHA-512: stable across processes)."""
        return random.Random(":".join(["sleuth-synth", str(self.seed), *map(str, parts)]))

    # -- entities and facts

    def build(self) -> World:
        for split in SPLITS:
            self._make_entities(split)
        for split in SPLITS:
            self._link(split)
        for e in self.entities:
            self.by_family.setdefault((e.split, e.family), []).append(e)
            self.by_type.setdefault((e.split, e.type), []).append(e)
        corpus = [self._document(e) for e in self.entities]
        self.by_id = {p.id: p for p in corpus}
        splits = {split: self._questions(split) for split in SPLITS}
        return World(self.config, self.entities, corpus, splits)

    def _new_family(self) -> int:
        self.families += 1
        return self.families

    def _make_entities(self, split: str) -> None:
        rng = self._rng("entities", split)
        counts = _type_counts(self.config.entities(split))
        types = [t for t in TYPES for _ in range(counts[t])]
        rng.shuffle(types)
        mine: list[Entity] = []
        for etype in types:
            name, family, stem = self._name(etype, mine, rng)
            index = len(self.entities)
            entity = Entity(index, f"synth-{self.seed}-e{index}", name, etype, split, family, stem)
            if etype == "person":
                entity.gender = rng.choice(("he", "she"))
                job = rng.choice(JOBS)
                entity.job = ("an " if job[0] in "aeiou" else "a ") + job
            self.entities.append(entity)
            mine.append(entity)

    def _name(self, etype: str, mine: list[Entity], rng: random.Random) -> tuple[str, int, str]:
        """A new unique name: from a fresh stem, or (lookalike) from the stem of an entity of the same split."""
        namer = self.namer
        while True:
            base = rng.choice(mine) if mine and rng.random() < self.config.lookalike_rate else None
            if base is None:
                stem, family = namer.fresh_stem(), self._new_family()
            else:
                stem, family = base.stem, base.family
                if rng.random() < 0.5:
                    stem = namer.mutate(stem)
            if etype == "person":
                if base is not None and base.type == "person" and rng.random() < 0.3:
                    name = f"{base.name.split()[0]} {namer.fresh_stem()}"  # same given name, another family
                else:
                    name = f"{namer.fresh_stem()} {stem}"
            elif etype == "city":
                name = stem
            elif etype == "country":
                name = _country_name(stem, rng)
            elif etype == "organisation":
                name = f"{stem} {rng.choice(ORG_KINDS)}"
            else:
                name = f"{stem} River"
            if all(w.lower() not in _REAL_WORDS for w in name.split()) and namer.take(name):
                return name, family, stem

    def _link(self, split: str) -> None:
        rng = self._rng("facts", split)
        of: dict[str, list[Entity]] = {
            t: [e for e in self.entities if e.split == split and e.type == t] for t in TYPES
        }
        countries, cities, people = of["country"], of["city"], of["person"]
        for i, city in enumerate(cities):
            country = countries[i] if i < len(countries) else rng.choice(countries)
            city.links["located_in"] = country.index
            city.links["river"] = rng.choice(of["river"]).index
            city.values["founded"] = rng.randint(600, 1900)
            city.values["population"] = int(10 ** rng.uniform(3.5, 6.5))
        leaders = rng.sample(people, len(countries))
        for country, leader in zip(countries, leaders, strict=True):
            own = [c for c in cities if c.links["located_in"] == country.index]
            country.links["capital"] = rng.choice(own).index
            country.links["leader"] = leader.index
            country.values["independence"] = rng.randint(1500, 1990)
        for river in of["river"]:
            river.links["source"] = rng.choice(countries).index
            river.values["length"] = rng.randint(40, 3500)
        for person in people:
            person.links["born_in"] = rng.choice(cities).index
            person.values["birth_year"] = rng.randint(1700, 1960)
            person.links["employer"] = rng.choice(of["organisation"]).index
        married = rng.sample(people, 2 * int(0.3 * len(people)))
        for a, b in zip(married[::2], married[1::2], strict=True):
            a.links["spouse"], b.links["spouse"] = b.index, a.index
        for org in of["organisation"]:
            founder = rng.choice(people)
            org.links["founded_by"] = founder.index
            org.links["headquarters"] = rng.choice(cities).index
            org.values["founded"] = founder.values["birth_year"] + rng.randint(25, 60)
        for e in self.entities:  # keep each type's relations in document order
            if e.split == split:
                order = TYPE_RELATIONS[e.type]
                e.links = {r: e.links[r] for r in order if r in e.links}
                e.values = {r: e.values[r] for r in order if r in e.values}

    def _object_text(self, relation: str, entity: Entity) -> str:
        if relation in entity.links:
            return self.entities[entity.links[relation]].name
        return format_value(relation, entity.values[relation])

    def _document(self, e: Entity) -> Passage:
        rng = self._rng("doc", e.index)
        k = self.config.paraphrase + 1
        lead = rng.choice(LEADS[e.type][:k]).format(s=e.name, job=e.job)
        facts = []
        for relation in TYPE_RELATIONS[e.type]:
            if relation in e.links or relation in e.values:
                template = rng.choice(RELATIONS[relation].facts[:k])
                sentence = template.format(s=e.name, o=self._object_text(relation, e))
                if self.config.paraphrase >= 2 and rng.random() < 0.5:
                    sentence = _with_pronoun(template, sentence, e)
                facts.append(sentence)
        fillers = [f.format(m=e.mention) for f in rng.sample(FILLERS, self.config.filler_sentences)]
        body = facts + fillers
        if self.config.paraphrase >= 1:
            rng.shuffle(body)
        return Passage(id=e.id, title=e.name, text=" ".join([lead, *body]), meta={"type": e.type, "split": e.split})

    # -- questions

    def _questions(self, split: str) -> list[Example]:
        config = self.config
        rng = self._rng("questions", split)
        pool = [e for e in self.entities if e.split == split]
        n = config.questions(split)
        n_cmp = round(n * config.comparison_fraction)
        kinds = ["comparison"] * n_cmp + ["bridge"] * (n - n_cmp)
        rng.shuffle(kinds)
        seen: set[tuple[Any, ...]] = set()
        out: list[Example] = []
        for i, kind in enumerate(kinds):
            for _ in range(2000):
                made = self._comparison(pool, rng) if kind == "comparison" else self._bridge(pool, rng)
                if made is not None and made[0] not in seen:
                    seen.add(made[0])
                    out.append(self._example(split, i, kind, made[1], rng))
                    break
            else:
                raise ValueError(
                    f"could not make {n} distinct {split} questions from {len(pool)} entities "
                    f"(made {len(out)}); raise {split}_entities or lower {split}_questions"
                )
        return out

    def _walk(self, start: Entity, relations: Sequence[str]) -> list[Entity] | None:
        chain = [start]
        for r in relations:
            if r not in chain[-1].links:
                return None
            nxt = self.entities[chain[-1].links[r]]
            if nxt in chain:
                return None
            chain.append(nxt)
        return chain

    def _bridge(self, pool: list[Entity], rng: random.Random) -> tuple[tuple[Any, ...], _Draft] | None:
        hops = rng.randint(self.config.min_hops, self.config.max_hops)
        start = rng.choice(pool)
        chain, relations = [start], []
        for h in range(hops):
            here = chain[-1]
            last = h == hops - 1
            if last and rng.random() < self.config.numeric_fraction:
                relations.append(rng.choice(list(here.values)))
                break
            options = list(here.links)
            r = rng.choice(options)
            nxt = self.entities[here.links[r]]
            if nxt in chain:
                return None
            relations.append(r)
            chain.append(nxt)
        if _leaks([start], chain[1:]):
            return None
        draft = _Draft("bridge", [(start, relations)])
        return ("bridge", start.index, tuple(relations)), draft

    def _comparison(self, pool: list[Entity], rng: random.Random) -> tuple[tuple[Any, ...], _Draft] | None:
        depth = rng.choice(self.config.comparison_depths())
        if depth == 0:
            attribute = rng.choice([r for r in RELATIONS.values() if r.target is None]).name
            bridges: list[str] = []
            starts = [e for e in pool if attribute in e.values]
        else:
            source = rng.choice(pool)
            r = rng.choice(list(source.links))
            target = self.entities[source.links[r]]
            attribute = rng.choice(list(target.values))
            bridges = [r]
            starts = [e for e in pool if e.type == source.type and r in e.links]
        if len(starts) < 2:
            return None
        a, b = rng.sample(starts, 2)
        ca, cb = self._walk(a, bridges), self._walk(b, bridges)
        if ca is None or cb is None or set(ca) & set(cb):
            return None
        if ca[-1].values[attribute] == cb[-1].values[attribute] or _leaks([a, b], ca[1:] + cb[1:]):
            return None
        relations = [*bridges, attribute]
        key = ("comparison", tuple(sorted((a.index, b.index))), tuple(relations))
        return key, _Draft("comparison", [(a, relations), (b, relations)])

    def _example(self, split: str, i: int, kind: str, draft: _Draft, rng: random.Random) -> Example:
        k = self.config.paraphrase + 1
        steps: list[dict[str, Any]] = []
        phrases: list[str] = []
        hops: list[tuple[Entity, Entity | None]] = []
        chains: list[list[Entity]] = []
        refs: list[tuple[str, int, Entity, str]] = []  # per side: reference to the compared entity, its value step
        for start, relations in draft.sides:
            chain = self._walk(start, [r for r in relations if r in RELATIONS and RELATIONS[r].target])
            assert chain is not None
            chains.append(chain)
            phrase = start.mention
            first = len(steps) + 1
            for j, r in enumerate(relations):
                rel = RELATIONS[r]
                x = start.mention if j == 0 else f"#{first + j - 1}"
                subject = chain[j]
                if rel.target:
                    obj: Entity | None = chain[j + 1]
                    answer = obj.name
                else:
                    obj = None
                    answer = format_value(r, subject.values[r])
                steps.append({"question": rng.choice(rel.questions[:k]).format(x=x), "answer": answer,
                              "supporting_ids": [subject.id]})  # fmt: skip
                hops.append((subject, obj))
                if j < len(relations) - 1:
                    phrase = rng.choice(rel.phrases[:k]).format(x=phrase)
            phrases.append(phrase)
            compared = chain[-1]
            ref = compared.mention if len(chain) == 1 else f"#{first + len(chain) - 2}"
            refs.append((ref, len(steps), compared, relations[-1]))
        final = RELATIONS[draft.sides[0][1][-1]]
        if kind == "bridge":
            question = rng.choice(final.questions[:k]).format(x=phrases[0])
            last = chains[0][-1]
            answers = (
                value_answers(final.name, last.values[final.name]) if final.target is None else entity_answers(last)
            )
            answer_type = "number" if final.target is None else "entity"
        else:
            template = rng.choice(final.comparisons[:k])
            question = template.format(a=phrases[0], b=phrases[1])
            (ra, sa, ea, attr), (rb, sb, eb, _) = refs
            va, vb = ea.values[attr], eb.values[attr]
            winner = ea if (va > vb) == final.larger else eb
            step = template.format(a=f"{ra} (#{sa})", b=f"{rb} (#{sb})")
            steps.append({"question": step, "answer": winner.name, "supporting_ids": []})
            answers = entity_answers(winner)
            answer_type = "entity"
        question = question[0].upper() + question[1:]
        touched = [e for chain in chains for e in chain]
        supporting = list(dict.fromkeys(s["supporting_ids"][0] for s in steps if s["supporting_ids"]))
        relations = [r for _, rs in draft.sides for r in rs]
        distractors = self._distractors(touched, hops, relations, rng)
        context: list[Passage] = []
        if self.config.context:
            context = [self.by_id[pid] for pid in supporting + distractors]
            rng.shuffle(context)
        return Example(
            id=f"synth-{self.seed}-{split}-{i}",
            question=question,
            answers=answers,
            kind="qa",
            context=context,
            supporting_ids=supporting,
            decomposition=steps,
            metadata={
                "type": kind,
                "hops": len(hops),
                "relations": relations,
                "answer_type": answer_type,
                "decomposition_text": decomposition_text(steps),
                "entity_ids": [e.id for e in touched],
                "distractor_ids": distractors,
                "split": split,
                "format": "synth",
            },
        )

    def _distractors(
        self, touched: list[Entity], hops: list[tuple[Entity, Entity | None]], relations: list[str], rng: random.Random
    ) -> list[str]:
        """Documents that look relevant to a hop (lookalike names first, then same relation) but answer nothing.

        Each hop in turn takes its next candidate: an entity of the subject's or the object's name family, then an
        entity of the subject's type (its document states the same relations for someone else). A candidate is
        rejected when it is one of the chain's entities, mentions both the subject and the object of an entity hop
        (it might state or imply that fact), or mentions the subject of a number hop and states the same number.
        """
        want = self.config.distractors
        if want == 0:
            return []
        split = touched[0].split
        banned = {e.index for e in touched}
        pairs = [(s.index, o.index) for s, o in hops if o is not None]
        numbers = [(s.index, s.values[r]) for (s, o), r in zip(hops, relations, strict=True) if o is None]
        queues: list[Iterator[Entity]] = []
        for subject, obj in hops:
            looks = list(self.by_family[(split, subject.family)])
            if obj is not None and obj.family != subject.family:
                looks += self.by_family[(split, obj.family)]
            rng.shuffle(looks)
            same = self.by_type[(split, subject.type)]
            same = rng.sample(same, min(len(same), 4 * want + 8))
            queues.append(iter(looks + same))
        chosen: list[str] = []
        taken: set[int] = set()

        def fits(e: Entity) -> bool:
            if e.index in banned or e.index in taken:
                return False
            mentions = {e.index, *e.links.values()}
            if any(s in mentions and o in mentions for s, o in pairs):
                return False
            return not any(s in mentions and v in e.values.values() for s, v in numbers)

        while len(chosen) < want and queues:
            for q in list(queues):
                if len(chosen) >= want:
                    break
                e = next((e for e in q if fits(e)), None)
                if e is None:
                    queues.remove(q)
                else:
                    chosen.append(e.id)
                    taken.add(e.index)
        if len(chosen) < want:  # a small split: fill up with any entity of the split
            rest = [e for t in TYPES for e in self.by_type[(split, t)]]
            for e in rng.sample(rest, len(rest)):
                if len(chosen) < want and fits(e):
                    chosen.append(e.id)
                    taken.add(e.index)
        return chosen


def _leaks(named: Sequence[Entity], hidden: Sequence[Entity]) -> bool:
    """Whether the name of a hidden entity (a bridge or the answer) is spelled inside a name the question shows.

    "Where was the founder of Velmo Guild born?" must not have the answer "Velmo".
    """
    return any(re.search(rf"\b{re.escape(h.name)}\b", n.name) for h in hidden for n in named)


@dataclass
class _Draft:
    kind: str
    sides: list[tuple[Entity, list[str]]]


def decomposition_text(steps: Sequence[dict[str, Any]]) -> str:
    """The AceSearcher decomposer's output form: one ``### Q<k>: <question>`` line per step."""
    return "\n".join(f"### Q{k}: {s['question']}" for k, s in enumerate(steps, 1))


def _with_pronoun(template: str, sentence: str, e: Entity) -> str:
    """The sentence with its leading subject replaced by a pronoun (only for templates that start with it)."""
    pronoun = {"he": "He", "she": "She"}.get(e.gender, "It")
    for head in ("{s} ", "The {s} "):
        if template.startswith(head):
            lead = head.replace("{s}", e.name)
            return pronoun + " " + sentence[len(lead) :]
    return sentence


# ------------------------------------------------------------------------------------------------- reading back

_SENTENCE_END = re.compile(r"(?<=[.?!])\s+")


def _sentences(text: str) -> list[str]:
    return [s for s in _SENTENCE_END.split(text.strip()) if s]


@lru_cache(maxsize=4096)
def _fact_pattern(template: str, subject: str, own_doc: bool) -> re.Pattern[str]:
    """A regex for a fact template with ``subject`` filled in (or a pronoun in the subject's own document)."""
    prefix, body = "", template
    if own_doc:
        for head in ("{s} ", "The {s} "):
            if template.startswith(head):
                alternatives = [re.escape(head.replace("{s}", subject).rstrip()), *PRONOUNS]
                prefix, body = "(?:" + "|".join(alternatives) + ") ", template[len(head) :]
                break
    out = [prefix]
    for piece in re.split(r"(\{s\}|\{o\})", body):
        if piece == "{s}":
            out.append(re.escape(subject))
        elif piece == "{o}":
            out.append("(?P<o>.+?)")
        else:
            out.append(re.escape(piece))
    return re.compile("".join(out))


def read_facts(passages: Iterable[Passage], relation: str, subject: str) -> list[str]:
    """Every object that the passages state for ``relation`` of ``subject``, by parsing the fact templates.

    A leading "the" of ``subject`` is ignored; pronouns count only in the subject's own document (its title).
    """
    subject = _strip_the(subject)
    templates = RELATIONS[relation].facts
    found: list[str] = []
    for p in passages:
        own = p.title == subject
        if not own and subject not in p.text:
            continue
        for sentence in _sentences(p.text):
            for t in templates:
                m = _fact_pattern(t, subject, own).fullmatch(sentence)
                if m:
                    found.append(m.group("o"))
    return list(dict.fromkeys(found))


def _strip_the(text: str) -> str:
    return text[4:] if text[:4].lower() == "the " else text


@lru_cache(maxsize=1)
def _question_patterns() -> list[tuple[str, re.Pattern[str]]]:
    out = []
    for r in RELATIONS.values():
        for t in r.questions:
            head, tail = t.split("{x}")
            out.append((r.name, re.compile(re.escape(head) + "(?P<x>.+?)" + re.escape(tail))))
    return out


@lru_cache(maxsize=1)
def _comparison_patterns() -> list[tuple[str, re.Pattern[str]]]:
    side = r"(?P<{0}>.+?) \((?P<v{0}>[^()]+)\)"
    out = []
    for r in RELATIONS.values():
        for t in r.comparisons:
            pieces = re.split(r"(\{a\}|\{b\})", t)
            regex = "".join(side.format(p[1]) if p in ("{a}", "{b}") else re.escape(p) for p in pieces)
            out.append((r.name, re.compile(regex)))
    return out


def parse_subquestion(question: str) -> list[tuple[str, str]]:
    """The ``(relation, subject)`` readings of a single-fact sub-question (one, for the generator's templates)."""
    return list(dict.fromkeys((r, m.group("x")) for r, p in _question_patterns() if (m := p.fullmatch(question))))


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").split()[0])
    except (ValueError, IndexError):
        return None


def follow_decomposition(steps: Sequence[dict[str, Any]], passages: Sequence[Passage]) -> str | None:
    """Answer a gold decomposition using only ``passages``; None when a step cannot be answered unambiguously.

    Each step's ``#k`` references are replaced by the answers found so far. A fact step is parsed into a relation
    and a subject (:func:`parse_subquestion`) and answered by :func:`read_facts`, which must find exactly one
    object. A comparison step ("Who was born first, A (1843) or B (1851)?") is answered by comparing the numbers.
    """
    answers: dict[int, str] = {}
    last: str | None = None
    for k, step in enumerate(steps, 1):
        q = str(step["question"])
        for j in sorted(answers, reverse=True):  # #12 before #1
            q = q.replace(f"#{j}", answers[j])
        if re.search(r"#\d", q):
            return None
        compared = [(r, m) for r, p in _comparison_patterns() if (m := p.fullmatch(q))]
        if compared:
            r, m = compared[0]
            va, vb = _number(m.group("va")), _number(m.group("vb"))
            if va is None or vb is None or va == vb:
                return None
            a_wins = (va > vb) == RELATIONS[r].larger
            last = _strip_the(m.group("a") if a_wins else m.group("b"))
        else:
            readings = parse_subquestion(q)
            if len(readings) != 1:
                return None
            relation, subject = readings[0]
            found = read_facts(passages, relation, subject)
            if len(found) != 1:
                return None
            last = found[0]
        answers[k] = last
    return last


_NAME_RUN = re.compile(r"[A-Z][\w'-]*(?: [A-Z][\w'-]*)*")


def mentioned_titles(text: str, titles: Iterable[str]) -> set[str]:
    """The titles that ``text`` names as a whole (a run of capitalised words, maybe after a leading "The", "By")."""
    known = set(titles)
    out = set()
    for run in _NAME_RUN.findall(text):
        if run in known:
            out.add(run)
        elif " " in run and run.split(" ", 1)[1] in known:
            out.add(run.split(" ", 1)[1])
    return out


# ------------------------------------------------------------------------------------------------------- writing


def _json_line(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False) + "\n"


def write_world(world: World, out_dir: PathLike) -> dict[str, Any]:
    """Write ``corpus.jsonl`` (Search-R1 ``{"id", "contents"}``), ``train/dev/test.jsonl`` (one
    :meth:`Example.to_dict` per line) and ``world.json`` (the config and :meth:`World.counts`) into ``out_dir``.

    Returns the ``world.json`` content. The same world gives byte-identical files.
    """
    out = os.fspath(out_dir)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "corpus.jsonl"), "w", encoding="utf-8", newline="\n") as f:
        for p in world.corpus:
            f.write(_json_line({"id": p.id, "contents": p.contents}))
    for split, examples in world.splits.items():
        with open(os.path.join(out, f"{split}.jsonl"), "w", encoding="utf-8", newline="\n") as f:
            for ex in examples:
                f.write(_json_line(ex.to_dict()))
    info = {
        "format": "sleuth-synth-1",
        "config": world.config.to_dict(),
        "files": {"corpus": "corpus.jsonl", **{s: f"{s}.jsonl" for s in world.splits}},
        "counts": world.counts(),
    }
    with open(os.path.join(out, "world.json"), "w", encoding="utf-8", newline="\n") as f:
        f.write(json.dumps(info, ensure_ascii=False, indent=2) + "\n")
    return info


def synthesize(out_dir: PathLike, config: SynthConfig | None = None, **knobs: Any) -> dict[str, Any]:
    """Generate a world and write it to ``out_dir`` (what ``sleuth data synth --seed S --out DIR`` does).

    ``knobs`` override fields of ``config`` (or of the default config): ``synthesize("w", seed=3, max_hops=3)``.
    Returns the ``world.json`` content (config and counts).
    """
    base = (config or SynthConfig()).to_dict()
    base.update(knobs)
    return write_world(generate_world(SynthConfig.from_dict(base)), out_dir)


def load_synth(path: PathLike) -> Iterator[Example]:
    """A split file written by :func:`write_world`: one :meth:`Example.to_dict` per line (``Example.from_dict``)."""
    for row in read_records(path):
        try:
            yield Example.from_dict(row.data)
        except (TypeError, ValueError) as e:
            raise row.error(f"not an Example record: {e}") from None
