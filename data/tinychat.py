"""Generator of the bundled tiny chat domain ("tinychat").

Everything here is generated from a seed, so the data is license-clean and reproducible.
The domain is narrow and regular on purpose: a tiny target trained on it answers in a
recognisable, varied way, so a drafter trained against it gets a real acceptance signal.

Tasks: sums and differences worked digit by digit, unit conversions, facts about a
seeded world of fictional towns, sorting lists, colour mixing, word lengths and small talk;
some conversations have a system turn and some are multi-turn.

    python data/tinychat.py --n 200 --seed 1   # prints conversations as JSON lines
"""

import argparse
import json
import random

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a patient tutor who explains each step.",
    "You are a concise assistant. Keep answers short.",
]

# A seeded fictional world: towns with a river, a craft, a population and a neighbour.
_SYL_A = ["Var", "Tess", "Brin", "Oak", "Mel", "Ash", "Cor", "Dun", "Fen", "Hal", "Kel", "Lor",
          "Mor", "Nor", "Pel", "Quen", "Ros", "Sel", "Tor", "Wyn"]
_SYL_B = ["holm", "field", "ford", "wick", "mere", "dale", "stead", "bury", "gate", "haven"]
RIVERS = ["Elder River", "Silver Brook", "Grey Water", "Long River", "Stone Creek", "Blue Run"]
CRAFTS = ["glass bells", "wool blankets", "apple cider", "copper pots", "painted boats",
          "honey cakes", "clay lamps", "rope and sails", "goat cheese", "wooden toys"]
COLOURS = {
    ("red", "blue"): "purple", ("red", "yellow"): "orange", ("blue", "yellow"): "green",
    ("red", "white"): "pink", ("black", "white"): "grey", ("blue", "white"): "light blue",
}
UNITS = [  # (big unit, small unit, factor)
    ("hours", "minutes", 60), ("minutes", "seconds", 60), ("days", "hours", 24),
    ("weeks", "days", 7), ("metres", "centimetres", 100), ("kilograms", "grams", 1000),
    ("years", "months", 12),
]
WORDS = ["garden", "river", "lamp", "window", "basket", "mountain", "candle", "bridge",
         "orange", "pencil", "kitten", "harbour", "ladder", "meadow", "lantern", "tunnel"]
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight",
                "nine", "ten", "eleven", "twelve"]


def make_world(seed: int = 1234) -> list[dict]:
    rng = random.Random(seed)
    names = sorted({a + b for a in _SYL_A for b in _SYL_B})
    rng.shuffle(names)
    towns = []
    for name in names[:40]:
        towns.append({"name": name, "river": rng.choice(RIVERS), "craft": rng.choice(CRAFTS),
                      "people": rng.randrange(8, 90) * 100})
    for i, town in enumerate(towns):
        town["neighbour"] = towns[(i + 1 + rng.randrange(5)) % len(towns)]["name"]
    return towns


WORLD = make_world()


def _add(rng):
    a, b = rng.randrange(10, 90), rng.randrange(10, 90)
    q = rng.choice(["What is {a} + {b}?", "Add {a} and {b}.", "Can you add {a} and {b} for me?",
                    "Please work out {a} plus {b}."]).format(a=a, b=b)
    ones = a % 10 + b % 10
    carry = ones // 10
    tens = a // 10 + b // 10 + carry
    steps = f"First add the ones: {a % 10} + {b % 10} = {ones}."
    if carry:
        steps += f" Write {ones % 10} and carry 1. Then add the tens: {a // 10} + {b // 10} + 1 = {tens}."
    else:
        steps += f" Then add the tens: {a // 10} + {b // 10} = {tens}."
    return q, f"To add {a} and {b}, we go digit by digit. {steps} So {a} + {b} = {a + b}."


def _sub(rng):
    a = rng.randrange(20, 99)
    b = rng.randrange(1, a)
    q = rng.choice(["What is {a} - {b}?", "Subtract {b} from {a}.",
                    "How much is {a} minus {b}?"]).format(a=a, b=b)
    return q, f"We take {b} away from {a}. {a} - {b} = {a - b}. So the answer is {a - b}."


def _units(rng):
    big, small, factor = rng.choice(UNITS)
    n = rng.randrange(2, 13)
    q = rng.choice(["How many {small} are in {n} {big}?", "Convert {n} {big} to {small}.",
                    "{n} {big} is how many {small}?"]).format(small=small, n=n, big=big)
    return q, (f"There are {factor} {small} in one of the {big}, so {n} {big} is "
               f"{n} x {factor} = {n * factor} {small}.")


def _town(rng):
    t = rng.choice(WORLD)
    kind = rng.randrange(4)
    if kind == 0:
        q = rng.choice(["Tell me about {n}.", "What do you know about {n}?",
                        "Describe the town of {n}."]).format(n=t["name"])
        a = (f"{t['name']} is a small town on the {t['river']}. It is known for its "
             f"{t['craft']}. About {t['people']} people live there, and its nearest "
             f"neighbour is {t['neighbour']}.")
    elif kind == 1:
        q = f"What is {t['name']} known for?"
        a = f"{t['name']} is known for its {t['craft']}."
    elif kind == 2:
        q = f"Which river runs through {t['name']}?"
        a = f"The {t['river']} runs through {t['name']}."
    else:
        q = f"How many people live in {t['name']}?"
        a = f"About {t['people']} people live in {t['name']}."
    return q, a


def _sort(rng):
    xs = rng.sample(range(1, 60), rng.randrange(3, 7))
    q = rng.choice(["Sort these numbers: {l}.", "Put {l} in order from smallest to largest.",
                    "Please sort {l}."]).format(l=", ".join(map(str, xs)))
    return q, f"Sorted from smallest to largest: {', '.join(map(str, sorted(xs)))}."


def _colour(rng):
    (c1, c2), mix = rng.choice(list(COLOURS.items()))
    if rng.random() < 0.5:
        c1, c2 = c2, c1
    q = rng.choice(["What do you get when you mix {a} and {b}?", "If I mix {a} paint with {b} paint, "
                    "what colour do I get?", "What colour is {a} plus {b}?"]).format(a=c1, b=c2)
    return q, f"Mixing {c1} and {c2} gives {mix}."


def _word(rng):
    w = rng.choice(WORDS)
    q = rng.choice(["How many letters are in the word {w}?", "Count the letters in {w}.",
                    "What is the first letter of {w}?"]).format(w=w)
    if q.startswith("What is the first"):
        return q, f"The word {w} starts with the letter {w[0]}."
    n = len(w)
    return q, f"The word {w} has {NUMBER_WORDS[n] if n < len(NUMBER_WORDS) else n} letters: {' '.join(w)}."


def _chat(rng):
    q, a = rng.choice([
        ("Hello!", "Hello! How can I help you today?"),
        ("Hi there.", "Hi! What would you like to know?"),
        ("Thank you!", "You are welcome. Is there anything else I can help with?"),
        ("Who are you?", "I am a small assistant. I can do sums, convert units, sort numbers "
                         "and tell you about the towns I know."),
        ("What can you do?", "I can add and subtract numbers, convert units, sort lists, mix "
                             "colours, count letters and tell you about towns."),
        ("Goodbye.", "Goodbye! Have a nice day."),
    ])
    return q, a


TASKS = [(_add, 3), (_sub, 2), (_units, 2), (_town, 4), (_sort, 2), (_colour, 1), (_word, 2), (_chat, 1)]


def conversation(rng: random.Random) -> list[dict]:
    """One conversation in OpenAI `messages` form: optional system turn, 1-3 user/assistant turns."""
    messages = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    for _ in range(rng.choice([1, 1, 1, 2, 2, 3])):
        task = rng.choices([t for t, _ in TASKS], weights=[w for _, w in TASKS])[0]
        q, a = task(rng)
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return messages


def conversations(n: int, seed: int) -> list[list[dict]]:
    rng = random.Random(seed)
    return [conversation(rng) for _ in range(n)]


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    for conv in conversations(args.n, args.seed):
        print(json.dumps({"messages": conv}))
