"""Real text for measuring draft quality: Python code, a chat exchange and English prose.

Written for these tests (not taken from anywhere), in the shapes a draft meets in use: code a coding
assistant writes, a multi-turn chat rendered with the checkpoint's own template, and plain prose. Each
piece is a few hundred characters, so that all of them come to 500-900 tokens with either zoo tokenizer.
"""

CODE = (
    '''def merge_intervals(intervals):
    """Merge overlapping [start, end] intervals and return them sorted by start."""
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


if __name__ == "__main__":
    print(merge_intervals([[1, 3], [2, 6], [8, 10], [15, 18]]))
''',
    '''import collections


class LRUCache:
    """A fixed-size cache that evicts the least recently used key."""

    def __init__(self, capacity: int):
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.items = collections.OrderedDict()

    def get(self, key, default=None):
        if key not in self.items:
            return default
        self.items.move_to_end(key)
        return self.items[key]

    def put(self, key, value):
        self.items[key] = value
        self.items.move_to_end(key)
        if len(self.items) > self.capacity:
            self.items.popitem(last=False)
''',
    '''from pathlib import Path


def count_words(path):
    counts = {}
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        for word in line.lower().split():
            word = word.strip(".,;:!?\\"'()")
            if word:
                counts[word] = counts.get(word, 0) + 1
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
''',
)

# Rendered with each model's chat template (add_generation_prompt=False: the assistant turns are part of
# the text, so the model is teacher-forced through its own answers too).
CHAT = (
    {"role": "system", "content": "You are a concise assistant who answers programming questions."},
    {"role": "user", "content": "How do I read a CSV file in Python without pandas?"},
    {"role": "assistant", "content": "Use the csv module from the standard library:\n\n"
                                     "```python\nimport csv\n\nwith open(\"data.csv\", newline=\"\") as f:\n"
                                     "    for row in csv.DictReader(f):\n        print(row[\"name\"])\n```\n\n"
                                     "DictReader takes the column names from the first line, so each row is a "
                                     "dictionary."},
    {"role": "user", "content": "And if the file uses semicolons instead of commas?"},
    {"role": "assistant", "content": "Pass the delimiter explicitly: csv.DictReader(f, delimiter=\";\"). "
                                     "Everything else stays the same."},
)

PROSE = (
    "The lighthouse stood at the end of a narrow spit of rock, and for most of the year the keeper saw no one "
    "but the supply boat that came on the first Monday of each month. He kept a logbook of the weather, the "
    "ships that passed and the birds that rested on the gallery rail. In winter the storms came from the west "
    "and the whole tower hummed like a plucked string; in summer the sea was so calm that he could hear the "
    "seals calling to each other across the bay.",
    "Bread needs only flour, water, salt and yeast, but the way they are combined changes everything. A wet "
    "dough left to rise slowly overnight in a cool kitchen develops more flavour than one hurried along in a "
    "warm oven, because the yeast and bacteria have time to break the starches down into sugars and acids. "
    "Bakers often say that time is the fifth ingredient.",
)
