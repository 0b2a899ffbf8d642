"""The built-in model's training text: short children's stories, facts and chats.

Written for pdserve and generated here, deterministically, from the word banks and
facts in `pdserve.builtin.story_words` (no outside text; Apache-2.0 like the rest of the
project). Every document comes from its own seeded `random.Random`, so the corpus is
the same on every machine and Python version:

- `documents("train")`: about 1.2 MB of text, seeds 0, 1, 2, ...
- `documents("heldout")`: about 150 kB from seeds 1,000,000 and up, which the
  training never sees; `bench/quality.py` and the perplexity tests read it.

A document is a plain story or fact passage (rendered `BOS text END_OF_TEXT`) or a
chat (rendered with the built-in chat template, so the model learns to answer after
the assistant header and to end its turn with `<|eot_id|>`).
"""

from __future__ import annotations

import functools
import random
import re
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.builtin import story_words as w
from pdserve.builtin.tokenizer import (
    BOS_TOKEN,
    END_HEADER_TOKEN,
    END_OF_TEXT_TOKEN,
    EOT_TOKEN,
    START_HEADER_TOKEN,
)

SPLITS = {"train": (0, 1_200_000), "heldout": (1_000_000, 150_000)}  # first seed, chars


@dataclass(frozen=True)
class Document:
    """A story/fact text (`messages` empty) or a chat (`text` empty)."""

    text: str = ""
    messages: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class _Hero:
    name: str
    kind: str  # "girl", "boy" or an animal
    he: str
    him: str
    his: str

    @property
    def He(self) -> str:
        return self.he.capitalize()

    @property
    def His(self) -> str:
        return self.his.capitalize()


def _hero(rng: random.Random, animal: bool | None = None) -> _Hero:
    girl = rng.random() < 0.5
    name = rng.choice(w.GIRLS if girl else w.BOYS)
    pron = ("she", "her", "her") if girl else ("he", "him", "his")
    if animal is None:
        animal = rng.random() < 0.4
    kind = rng.choice(w.ANIMALS) if animal else ("girl" if girl else "boy")
    return _Hero(name, kind, *pron)


def _friend(rng: random.Random, hero: _Hero) -> _Hero:
    while True:
        f = _hero(rng, animal=hero.kind not in ("girl", "boy"))
        if f.name != hero.name:
            return f


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def _opening(r: random.Random, h: _Hero) -> list[str]:
    adj, place = r.choice(w.ADJECTIVES), r.choice(w.PLACES)
    return r.choice([
        [f"Once upon a time, there was {_a(adj)} {h.kind} named {h.name}."],
        [f"Once upon a time, {_a(h.kind)} named {h.name} lived near a {place}."],
        [f"There was once {_a(adj)} {h.kind} called {h.name}.", f"{h.He} lived in a {adj} house near the {place}."],
        [f"{r.choice(w.TIMES)}, {_a(h.kind)} named {h.name} went to the {place}."],
        [f"{h.name} was {_a(adj)} {h.kind} who loved to {r.choice(w.ACTIVITIES)}."],
    ])


def _setup(r: random.Random, h: _Hero, toy: str) -> list[str]:
    out = [f"{h.He} liked to {r.choice(w.ACTIVITIES)}."]
    out.append(r.choice([
        f"{h.He} had {_a(r.choice(w.COLORS))} {toy} that {h.he} loved very much.",
        f"{h.His} favorite toy was {_a(r.choice(w.COLORS))} {toy}.",
        f"Every day, {h.he} played with {h.his} {toy}.",
    ]))
    return out


def _plot_lost(r: random.Random, h: _Hero, toy: str) -> list[str]:
    place, helper = r.choice(w.PLACES), r.choice(w.HELPERS)
    return [
        f"{r.choice(w.TIMES)}, {h.name} could not find {h.his} {toy}.",
        f"{h.He} looked under the bed and behind the door, but it was not there.",
        f"{h.name} felt {r.choice(w.BAD_FEELINGS)}.",
        f'"Where is my {toy}?" {h.he} asked {h.his} {helper}.',
        f'"Let us look in the {place}," said {h.his} {helper}.',
        f"They went to the {place} and looked everywhere.",
        f"At last, {h.name} saw the {toy} next to {_a(r.choice(w.ADJECTIVES))} {r.choice(w.THINGS)}.",
        f'"I found it!" {h.he} shouted. {h.He} was very {r.choice(w.GOOD_FEELINGS)}.',
    ]


def _plot_friend(r: random.Random, h: _Hero, toy: str) -> list[str]:
    f, place = _friend(r, h), r.choice(w.PLACES)
    return [
        f"{r.choice(w.TIMES)}, {h.name} went to the {place} to play with {h.his} {toy}.",
        f"There {h.he} met {_a(f.kind)} named {f.name}. {f.name} looked {r.choice(w.BAD_FEELINGS)}.",
        f'"Why are you {r.choice(w.BAD_FEELINGS)}?" asked {h.name}.',
        f'"I have no one to play with," said {f.name}.',
        f'"You can play with me," said {h.name}. "We can share my {toy}."',
        f"{f.name} smiled. They played together until the sun went down.",
        f"From that day on, {h.name} and {f.name} were best friends.",
    ]


def _plot_share(r: random.Random, h: _Hero, toy: str) -> list[str]:
    f = _friend(r, h)
    return [
        f"One day, {f.name} came to visit. {f.name} saw the {toy} and wanted to play with it.",
        f'"Can I play with your {toy}?" asked {f.name}.',
        f'"No, it is mine!" said {h.name}. {f.name} was sad and sat down.',
        f"{h.name} looked at {f.name} and felt bad.",
        f'"I am sorry," {h.he} said. "Here, you can have a turn."',
        f"{f.name} was so {r.choice(w.GOOD_FEELINGS)}. They took turns and laughed a lot.",
    ]


def _plot_help(r: random.Random, h: _Hero, toy: str) -> list[str]:
    animal, place = r.choice(w.ANIMALS), r.choice(w.PLACES)
    sound = w.ANIMAL_SOUNDS.get(animal, "help")
    return [
        f"{r.choice(w.TIMES)}, {h.name} was walking in the {place}.",
        f'{h.He} heard a small sound. "{sound.capitalize()}, {sound}!"',
        f"It was a little {animal}. The {animal} was stuck in a bush and could not get out.",
        f'"Do not be {r.choice(w.BAD_FEELINGS)}," said {h.name}. "I will help you."',
        f"{h.He} moved the branches very slowly, and the {animal} was free.",
        f"The {animal} jumped up and down. It was very {r.choice(w.GOOD_FEELINGS)}.",
        f"After that, the {animal} came to see {h.name} every day.",
    ]


def _plot_weather(r: random.Random, h: _Hero, toy: str) -> list[str]:
    helper = r.choice(w.HELPERS)
    return [
        f"One morning, {h.name} wanted to go to the {r.choice(w.PLACES)} with {h.his} {toy}.",
        f"But when {h.he} looked out the window, it was raining.",
        f"{h.name} was {r.choice(w.BAD_FEELINGS)}. \"Now I cannot go out,\" {h.he} said.",
        f'{h.His} {helper} said, "We can have fun inside. Let us bake some {r.choice(w.FOODS)}."',
        "They mixed and stirred, and soon the house smelled sweet.",
        f"When the rain stopped, a big rainbow came out. {h.name} ran outside with {h.his} {toy}.",
    ]


def _plot_brave(r: random.Random, h: _Hero, toy: str) -> list[str]:
    place, f = r.choice(("hill", "forest", "river", "woods", "lake")), _friend(r, h)
    return [
        f"Near {h.his} home there was a big {place}. {h.name} was scared to go there.",
        f"One day, {h.his} {toy} rolled all the way to the {place}.",
        f"{h.name} wanted to cry. Then {f.name} the {f.kind} came by.",
        f'"I will go with you," said {f.name}. "We can be brave together."',
        f"They held hands and walked to the {place}. It was not so scary after all.",
        f"{h.name} got {h.his} {toy} back and felt very {r.choice(w.GOOD_FEELINGS)}.",
    ]


_PLOTS: tuple[Callable[[random.Random, _Hero, str], list[str]], ...] = (
    _plot_lost, _plot_friend, _plot_share, _plot_help, _plot_weather, _plot_brave)


def _ending(r: random.Random, h: _Hero) -> list[str]:
    return r.choice([
        [f"{h.name} learned that {r.choice(w.LESSONS)}."],
        [f"That night, {h.name} went to bed with a big smile."],
        [f"{h.name} would always remember that day.", "The end."],
        [f"From then on, {h.name} knew that {r.choice(w.LESSONS)}."],
        [f"It was the best day ever, and {h.name} was very {r.choice(w.GOOD_FEELINGS)}."],
    ])


def story(r: random.Random, hero: _Hero | None = None) -> str:
    """One short story in paragraphs."""
    h = hero or _hero(r)
    toy = r.choice(w.TOYS)
    head = _opening(r, h) + _setup(r, h, toy)
    body = r.choice(_PLOTS)(r, h, toy)
    cut = r.randint(2, len(body) - 2)
    return "\n\n".join(" ".join(p) for p in (head, body[:cut], body[cut:], _ending(r, h)))


def _facts(r: random.Random, topic: str, k: int) -> str:
    first, rest = w.FACTS[topic]
    return " ".join([first, *r.sample(rest, min(k, len(rest)))])


_ASK_TOPIC = ("Tell me about {t}.", "What do you know about {t}?", "Can you tell me about {t}?",
              "Tell me something about {t}.", "I want to learn about {t}.", "Please tell me about {t}.")
_GREETINGS = (("Hello!", "Hello! How can I help you today?"),
              ("Hi!", "Hi there! What would you like to talk about?"),
              ("Good morning!", "Good morning! I hope you have a lovely day."),
              ("How are you?", "I am doing well, thank you! How are you?"),
              ("Who are you?", "I am a small helper. I know simple facts and I like to tell short stories."),
              ("Thank you!", "You are welcome! I am happy I could help."))


def _turn(r: random.Random) -> tuple[str, str]:
    kind = r.random()
    if kind < 0.55:
        topic = r.choice(sorted(w.FACTS))
        return r.choice(_ASK_TOPIC).format(t=topic), _facts(r, topic, r.randint(2, 4))
    if kind < 0.8:
        h = _hero(r)
        ask = r.choice((f"Tell me a story about {_a(h.kind)}.", f"Tell me a story about {h.name}.",
                        "Can you tell me a short story?", "Tell me a story."))
        return ask, story(r, h)
    if kind < 0.9:
        animal = r.choice(sorted(w.ANIMAL_SOUNDS))
        return f"What sound does {_a(animal)} make?", f"{_a(animal).capitalize()} says {w.ANIMAL_SOUNDS[animal]}."
    return r.choice(_GREETINGS)


def _document(seed: int) -> Document:
    r = random.Random(seed)
    kind = r.random()
    if kind < 0.5:
        return Document(text=story(r))
    if kind < 0.6:
        topic = r.choice(sorted(w.FACTS))
        return Document(text=f"Facts about {topic}. " + _facts(r, topic, 5))
    turns = [_turn(r) for _ in range(1 if r.random() < 0.75 else 2)]
    messages = [("user", q) if i % 2 == 0 else ("assistant", a) for q, a in turns for i in (0, 1)]
    if r.random() < 0.1:
        messages.insert(0, ("system", "You are a helpful assistant."))
    return Document(messages=tuple(messages))


def render(doc: Document) -> str:
    """The document as the model sees it, special tokens included."""
    if not doc.messages:
        return f"{BOS_TOKEN}{doc.text}{END_OF_TEXT_TOKEN}"
    turns = "".join(f"{START_HEADER_TOKEN}{role}{END_HEADER_TOKEN}\n\n{content.strip()}{EOT_TOKEN}"
                    for role, content in doc.messages)
    return BOS_TOKEN + turns


@functools.cache
def documents(split: str) -> tuple[Document, ...]:
    """Every document of `split` ("train" or "heldout"), in seed order."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {sorted(SPLITS)}")
    seed, target = SPLITS[split]
    docs: list[Document] = []
    size = 0
    while size < target:
        docs.append(_document(seed + len(docs)))
        size += len(docs[-1].text) + sum(len(c) for _, c in docs[-1].messages)
    return tuple(docs)


def plain_text(split: str) -> str:
    """The split's words without special tokens (stories, facts and chat turns)."""
    parts = [d.text or "\n".join(c for _, c in d.messages) for d in documents(split)]
    return "\n\n".join(parts) + "\n"


@functools.cache
def vocabulary(split: str = "train") -> frozenset[str]:
    """The lower-cased words of `split` (letters and apostrophes)."""
    return frozenset(m.lower() for m in re.findall(r"[A-Za-z']+", plain_text(split)))
