"""Open-ended names and values for the demo model's facts: nothing repeats often enough to learn by heart.

Entities ("the Hollow mill", "the Vorkesta relay"), attributes ("gate code",
"billing contact") and values (codes, numbers, money, dates, people, places,
e-mail addresses) are built from random syllable words and word lists. Every
word of a name, generated or listed, belongs to one pool by a hash of its spelling,
so a `Names("heldout")` stream only ever uses names that training never saw. Only
the head nouns of attributes ("code", "owner"), which say what kind a value is,
are shared.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Iterable

ONSETS = ("b", "br", "c", "ch", "d", "dr", "f", "fl", "g", "gr", "h", "j", "k", "kr", "l", "m", "n", "p",
          "pr", "qu", "r", "s", "sh", "sk", "st", "t", "th", "tr", "v", "w", "y", "z", "", "", "")
VOWELS = ("a", "e", "i", "o", "u", "a", "e", "o", "ai", "ea", "ou", "ie", "y")
CODAS = ("", "", "", "n", "r", "l", "s", "th", "m", "x", "nd", "rk", "st", "k", "sh", "t", "ll")
# Plain English words for place-like names ("the Hollow mill") and for attribute modifiers.
NAME_WORDS = (
    "Hollow", "North", "South", "East", "West", "Old", "New", "Upper", "Lower", "Stone", "River", "Oak",
    "Ash", "Elm", "Pine", "Iron", "Silver", "Copper", "Golden", "Red", "Blue", "Green", "Black", "White",
    "Grey", "High", "Low", "Long", "Broad", "Deep", "Cold", "Bright", "Quiet", "Little", "Great",
    "Middle", "Harbour", "Market", "Bridge", "Castle", "Church", "Mill", "Meadow", "Forest", "Lake",
    "Hill", "Valley", "Marsh", "Moor", "Brook", "Spring", "Winter", "Summer", "Autumn", "Morning",
    "Evening", "Star", "Sun", "Moon", "Cloud", "Storm", "Thunder", "Willow", "Birch", "Cedar", "Maple",
    "Rowan", "Hazel", "Thorn", "Rose", "Lantern", "Anchor", "Compass", "Beacon", "Falcon", "Heron",
    "Raven", "Wren", "Fox", "Badger", "Otter", "Crown", "King", "Queen", "Prince", "Saint", "Abbey",
    "Garden", "Orchard", "Kettle", "Copperfield", "Granite", "Marble", "Amber", "Ivory", "Pearl",
    "Coral", "Jade", "Ember", "Frost", "Tide", "Harvest",
)
KINDS = (
    "mill", "vault", "station", "archive", "lab", "depot", "tower", "bridge", "garden", "museum",
    "library", "clinic", "school", "factory", "harbour", "observatory", "warehouse", "theatre", "relay",
    "farm", "chapel", "workshop", "office", "hall", "market", "bakery", "forge", "pier", "lighthouse",
    "quarry", "mine", "hotel", "inn", "hospital", "studio", "gallery", "court", "yard", "cabin", "camp",
    "reservoir", "dam", "tunnel", "ferry", "railway", "airfield", "printing house", "data centre",
    "control room", "greenhouse", "boathouse", "cellar", "pavilion", "academy", "college", "brewery",
    "pharmacy", "bank", "garage", "project", "expedition", "committee", "team", "account", "contract",
    "server", "cluster", "repository", "newsletter", "festival", "conference", "workshop series",
    "shipment", "order", "ticket", "case",
)
MADE_UP_KINDS = 0.3  # share of training entities whose kind is a made-up word (Names.entity)
MODIFIERS = (
    "gate", "access", "main", "backup", "night", "spare", "billing", "emergency", "service", "door", "alarm",
    "safe", "entry", "staff", "visitor", "guest", "admin", "delivery", "shipping", "support", "booking",
    "tracking", "licence", "membership", "locker", "parking", "radio", "wifi", "vault", "master", "reserve",
    "annual", "monthly", "weekly", "current", "original", "official", "internal", "first", "last", "next",
    "founding", "opening", "closing", "renewal", "inspection", "maintenance", "purchase", "insurance",
    "project", "technical", "legal", "press", "finance", "safety", "security", "fire", "water", "power",
)
# head word of an attribute -> kind of value
HEADS = {
    "code": "code", "password": "code", "PIN": "digits", "key": "code", "reference": "code",
    "serial number": "code", "number": "number", "count": "number", "capacity": "number",
    "extension": "digits", "room number": "digits",
    "phone number": "phone", "email": "email", "e-mail address": "email", "address": "place",
    "budget": "money", "price": "money", "fee": "money", "cost": "money", "deposit": "money",
    "year": "year", "date": "date", "deadline": "date", "day": "date",
    "director": "person", "contact": "person", "owner": "person", "manager": "person", "caretaker": "person",
    "keeper": "person", "chair": "person", "author": "person", "engineer": "person",
    "city": "place", "location": "place", "town": "place", "destination": "place", "port": "place",
    "supplier": "company", "vendor": "company", "partner": "company", "sponsor": "company",
    "colour": "colour", "color": "colour", "flag": "colour",
    "nickname": "word", "codename": "word", "password hint": "word", "motto word": "word",
    "weight": "measure", "height": "measure", "distance": "measure", "temperature": "measure",
}
COLOURS = ("red", "blue", "green", "amber", "violet", "orange", "white", "black", "silver", "gold", "teal",
           "crimson", "indigo", "yellow", "olive", "navy", "maroon", "turquoise", "beige", "magenta", "brown")
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December")
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
TITLES = ("Dr.", "Prof.", "Ms.", "Mr.", "Mrs.", "Captain", "Sister", "Judge")
PLACE_FORMS = ("{a}", "{a}", "Port {a}", "North {a}", "{a}-on-{b}", "Lake {a}", "{a} Bay", "Saint {a}",
               "{a} Heights", "New {a}", "{a}ton", "{a}by")
COMPANY_FORMS = ("{a} Ltd", "{a} Inc.", "{a} & {b}", "{a} Labs", "{a} Works", "{a} Group", "{a}{b} GmbH",
                 "{a} and Sons", "{a} Trading", "{a} Systems")
UNITS = ("kg", "m", "km", "cm", "tonnes", "metres", "degrees", "litres", "miles", "feet")
LETTERS = "ABCDEFGHJKLMNPQRSTUVWXYZ"


def pool_of_word(word: str) -> str:
    return "heldout" if zlib.crc32(word.lower().encode()) % 4 == 0 else "train"


def _ending(name: str, words: Iterable[str], default: str = "") -> str:
    """The longest of `words` that `name` ends with as whole words ("room number", not "number"),
    or `default` if none."""
    return max((w for w in words if name == w or name.endswith(" " + w)), key=len, default=default)


def kind_of(attribute: str) -> str:
    """The kind of value an attribute takes, from its head noun: "gate code" -> code."""
    return HEADS[_ending(attribute, HEADS)]


class Names:
    """Random names and values whose every word lies in one pool ("train" or "heldout")."""

    def __init__(self, pool: str, rng: random.Random):
        self.pool, self.rng = pool, rng

    def _pick(self, words: tuple[str, ...]) -> str:
        while True:
            w = self.rng.choice(words)
            if pool_of_word(w) == self.pool:
                return w

    def word(self, capital: bool = True) -> str:
        """A pronounceable made-up word of 1 to 3 syllables ("Vorkesta")."""
        rng = self.rng
        while True:
            n = rng.choice((1, 2, 2, 2, 3, 3))
            w = "".join(rng.choice(ONSETS) + rng.choice(VOWELS) + (rng.choice(CODAS) if i == n - 1 or
                                                                      rng.random() < 0.3 else "")
                        for i in range(n))
            if len(w) >= 3 and pool_of_word(w) == self.pool:
                return w.capitalize() if capital else w

    def entity(self, like: str | None = None) -> str:
        """An entity as it follows "the": "Hollow mill", "Vorkesta relay", "Old Tarn Brook archive".
        With `like`, another of the same kind ("Iron mill" for "Hollow mill").

        A share of training entities have a made-up kind ("the Iron drelk"): the listed kinds of the
        training pool are few enough to learn by heart, while a held-out entity's kind is a word
        training never saw, which the model must copy piece by piece ("forge" is " for" "ge").
        Held-out entities keep listed kinds (the stream, and so the evaluation, is unchanged).
        """
        rng = self.rng
        if like:
            kind = _ending(like, KINDS, default=like.rpartition(" ")[2])
        elif self.pool == "train" and rng.random() < MADE_UP_KINDS:
            kind = self.word(capital=False)
        else:
            kind = self._pick(KINDS)
        while True:
            r = rng.random()
            if r < 0.35:
                name = self.word()
            elif r < 0.6:
                name = self._pick(NAME_WORDS)
            elif r < 0.8:
                name = f"{self._pick(NAME_WORDS)} {self.word()}"
            elif r < 0.9:
                name = f"{self.word()} {self.word()}"
            else:
                name = f"{self.word()}-{rng.randint(1, 99)}"
            if f"{name} {kind}" != like:
                return f"{name} {kind}"

    def attribute(self, like: str | None = None) -> tuple[str, str]:
        """(attribute name, kind of value): "gate code" -> code. With `like`, another with the same
        head noun ("backup code" for "gate code"), which only the modifier tells apart, or a third
        of the time another head of the same kind ("password" for "access code")."""
        rng = self.rng
        head = _ending(like, HEADS) if like else rng.choice(tuple(HEADS))  # shared by both pools
        if like and rng.random() < 1 / 3:
            head = rng.choice([h for h in HEADS if HEADS[h] == HEADS[head]])
        while True:
            r = rng.random()
            if r < 0.35:
                name = head
            elif r < 0.85:
                name = f"{self._pick(MODIFIERS)} {head}"
            else:
                name = f"{self.word(capital=False)} {head}"
            if name != like:
                return name, HEADS[head]

    def person(self) -> str:
        rng = self.rng
        first, last = self.word(), self.word()
        return rng.choice((
            f"{first} {last}", f"{first} {last}", f"{rng.choice(TITLES)} {first} {last}", f"{last}, {first}",
            f"{first[0]}. {last}", f"{first} {rng.choice(LETTERS)}. {last}", f"{first} van {last}",
            f"{first} {last}-{self.word()}",
        ))

    def value(self, kind: str) -> str:
        rng = self.rng
        if kind == "code":
            digits = "".join(rng.choice("0123456789") for _ in range(rng.choice((2, 3, 4, 4, 5, 6))))
            letters = "".join(rng.choice(LETTERS) for _ in range(rng.choice((1, 2, 2, 3))))
            return rng.choice((f"{digits}-{letters}", f"{letters}-{digits}", f"{letters}{digits}",
                               f"#{digits}", f"{letters}-{digits[:2]}/{rng.randint(1, 9)}",
                               f"{self.word(capital=False)}-{digits}"))
        if kind == "digits":
            return str(rng.randint(1, 99999))
        if kind == "number":
            n = rng.randint(1, 999999)
            return rng.choice((str(n), f"{n:,}", f"{rng.randint(0, 999)}.{rng.randint(0, 99):02d}"))
        if kind == "phone":
            return rng.choice((f"+{rng.randint(1, 99)} {rng.randint(10, 999)} {rng.randint(1000, 9999999)}",
                               f"{rng.randint(100, 999)}-{rng.randint(100, 999)}-{rng.randint(1000, 9999)}",
                               f"0{rng.randint(100, 9999)} {rng.randint(10000, 999999)}"))
        if kind == "email":
            return f"{self.word(capital=False)}.{self.word(capital=False)}@{self.word(capital=False)}." + \
                rng.choice(("org", "com", "net", "io", "eu"))
        if kind == "money":
            n = rng.randint(1, 999999)
            return rng.choice((f"${n:,}", f"{n:,} euros", f"£{n:,}", f"EUR {n:,}", f"{n:,} dollars",
                               f"${rng.randint(1, 999)}.{rng.randint(0, 99):02d}"))
        if kind == "year":
            return str(rng.randint(1700, 2040))
        if kind == "date":
            y, m, d = rng.randint(1900, 2040), rng.randint(1, 12), rng.randint(1, 28)
            month = MONTHS[m - 1]
            return rng.choice((f"{month} {d}, {y}", f"{d} {month} {y}", f"{y}-{m:02d}-{d:02d}",
                               f"{d:02d}/{m:02d}/{y}", f"{rng.choice(DAYS)}, {d} {month}", f"{month} {d}"))
        if kind == "person":
            return self.person()
        if kind == "place":
            return rng.choice(PLACE_FORMS).format(a=self.word(), b=self.word())
        if kind == "company":
            return rng.choice(COMPANY_FORMS).format(a=self.word(), b=self.word())
        if kind == "colour":
            return rng.choice(COLOURS) if rng.random() < 0.7 else \
                f"{rng.choice(('dark', 'light', 'pale', 'bright'))} {rng.choice(COLOURS)}"
        if kind == "word":
            return self.word(capital=rng.random() < 0.5)
        if kind == "measure":
            amount = rng.choice((rng.randint(1, 9999), round(rng.uniform(0.1, 999), 1)))
            return f"{amount} {rng.choice(UNITS)}"
        raise ValueError(kind)
