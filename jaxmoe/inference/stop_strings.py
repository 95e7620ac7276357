"""Stop strings inside the decode loop: a text automaton stepped one token at a time.

Stop strings are text, the loop sees token ids. Every token's text (as it reads after
another token) is fed, on the host and once per set of strings, through an Aho-Corasick
automaton of the strings; the result is a table `next_SV[state, token]` (the automaton's
state after the token), `completes_SV[state, token]` (a bit per string that ended inside
the token) and `pending_S[state]` (a bit per string one of whose proper prefixes ends the
text). The loop gathers from them per token, so no tokenization of a string is ever
enumerated and the host is not consulted per token.

A row stops once some string has occurred and no string that has not yet occurred could
still be completing across the end of the text. Then cutting the text at the strings as
lm-eval does (`split(s)[0]` for each string in turn) gives the same result on the text so
far as on the text a full-length generation would have produced: the cut-after method's
output, exactly. The host checks that claim on the real decoded text of every row that
stopped early, and regenerates the batch without early stops if it fails (a tokenizer
whose decoding is not the concatenation of its tokens' texts).

Limits: at most 31 strings (a bit each in int32; with more, rows stop at EOS only); with a
stop string that is not ASCII, a token that decodes to U+FFFD on its own (a byte piece of
a longer character) ends early stopping for that row, since its character is unknown.
"""

import collections
import functools

import numpy as np

MAX_STRINGS = 31
_UNKNOWN = "\ufffd"


@functools.lru_cache(maxsize=4)  # one vocabulary pass per tokenizer, not per request group
def token_texts(tokenizer, vocab_size: int) -> tuple[str, ...]:
    """Each id's text as it reads after an ordinary token (SentencePiece drops the space
    of a first piece only); U+FFFD where it has none of its own (a byte piece)."""
    anchor = tokenizer.encode("a")[-1:]
    head = tokenizer.decode(anchor)
    texts = []
    for token in range(vocab_size):
        text = tokenizer.decode([*anchor, token])
        texts.append(text[len(head) :] if text.startswith(head) else _UNKNOWN)
    return tuple(texts)


class _Automaton:
    """Aho-Corasick over characters: goto/fail folded into a full transition table."""

    def __init__(self, strings: list[str]):
        children: list[dict] = [{}]
        prefix_of = [0]  # bit i: the node is a proper, non-empty prefix of string i
        ends = [0]  # bit i: string i ends at the node
        for i, string in enumerate(strings):
            node = 0
            for depth, char in enumerate(string):
                if node and depth < len(string):
                    prefix_of[node] |= 1 << i
                if char not in children[node]:
                    children[node][char] = len(children)
                    children.append({})
                    prefix_of.append(0)
                    ends.append(0)
                node = children[node][char]
            ends[node] |= 1 << i
        self.chars = {c: k + 1 for k, c in enumerate(sorted({c for s in strings for c in s}))}
        n, width = len(children), len(self.chars) + 1  # class 0: any other character
        self.delta = np.zeros((n, width), np.int32)
        self.out = np.array(ends, np.int64)
        self.pending = np.array(prefix_of, np.int64)
        fail = [0] * n
        queue = collections.deque()
        for char, child in children[0].items():
            self.delta[0, self.chars[char]] = child
            queue.append(child)
        while queue:  # breadth first: a node's fail target is finished before the node
            node = queue.popleft()
            self.out[node] |= self.out[fail[node]]
            self.pending[node] |= self.pending[fail[node]]
            self.delta[node] = self.delta[fail[node]]
            for char, child in children[node].items():
                self.delta[node, self.chars[char]] = child
                fail[child] = self.delta[fail[node], self.chars[char]] if node else 0
                queue.append(child)
        self.size = n


class StopStrings:
    """The device tables for one list of stop strings (lm-eval's `until`) and a tokenizer.

    `tables` is None when the loop cannot stop on them (none, or more than 31 strings).
    """

    def __init__(self, strings, tokenizer, vocab_size: int):
        self.strings = [s for s in dict.fromkeys(strings) if s]  # lm-eval skips ''
        self.tokenizer = tokenizer
        self.tables = None
        if not self.strings or len(self.strings) > MAX_STRINGS:
            return
        texts = token_texts(tokenizer, vocab_size)
        auto = _Automaton(self.strings)
        ascii_only = all(s.isascii() for s in self.strings)
        lengths = np.array([len(t) for t in texts])
        classes = np.zeros((vocab_size, max(int(lengths.max()), 1)), np.int32)
        for token, text in enumerate(texts):
            classes[token, : len(text)] = [auto.chars.get(c, 0) for c in text]
        # One extra state that never stops (an unknown character), padding to a bucket
        # keeps the compiled decode program for other lists of strings of similar size.
        poison, size = auto.size, max(16, 1 << auto.size.bit_length())  # > auto.size
        state_SV = np.broadcast_to(np.arange(auto.size)[:, None], (auto.size, vocab_size))
        done_SV = np.zeros(state_SV.shape, np.int64)
        for pos in range(classes.shape[1]):  # every state and token at once, a char a step
            valid_V = pos < lengths
            moved_SV = auto.delta[state_SV, classes[None, :, pos]]
            state_SV = np.where(valid_V, moved_SV, state_SV)
            done_SV |= np.where(valid_V, auto.out[state_SV], 0)
        next_SV = np.full((size, vocab_size), poison, np.int32)
        completes_SV = np.zeros((size, vocab_size), np.int32)
        next_SV[: auto.size], completes_SV[: auto.size] = state_SV, done_SV
        if not ascii_only:
            unknown = np.array([_UNKNOWN in t for t in texts])
            next_SV[:, unknown], completes_SV[:, unknown] = poison, 0
        pending_S = np.full((size,), (1 << len(self.strings)) - 1, np.int32)
        pending_S[: auto.size] = auto.pending
        self.tables = {"stop_next_SV": next_SV, "stop_completes_SV": completes_SV,
                       "stop_pending_S": pending_S}  # fmt: skip

    def stop_index(self, row: list[int]) -> int | None:
        """Where the loop stopped this row (the index of its last token), replayed on the
        host with the same tables; None if it never stopped on a string."""
        if self.tables is None:
            return None
        t = self.tables
        state, completed = 0, 0
        for i, token in enumerate(row):
            completed |= int(t["stop_completes_SV"][state, token])
            state = int(t["stop_next_SV"][state, token])
            if completed and not int(t["stop_pending_S"][state]) & ~completed:
                return i
        return None

    def cut_rows(self, rows: list[list[int]]) -> list[list[int]] | None:
        """Each row up to the token where the loop stopped it on a string (the padding
        after it dropped), or None when a row's real decoded text does not allow that."""
        out = []
        for row in rows:
            end = self.stop_index(row)
            if end is not None:
                row = row[: end + 1]
                if not self.safe_to_stop(self.tokenizer.decode(row)):
                    return None
            out.append(row)
        return out

    def safe_to_stop(self, text: str) -> bool:
        """The stopping rule on the real decoded text: some string occurred, and no string
        that did not occur has a proper prefix ending the text."""
        if not any(s in text for s in self.strings) or text.endswith(_UNKNOWN):
            return False
        return not any(
            s not in text and any(text.endswith(s[:k]) for k in range(1, len(s)))
            for s in self.strings
        )


def cut_at_strings(text: str, strings) -> str:
    """lm-eval's cut-after method: the text before each stop string in turn."""
    for string in strings:
        if string:
            text = text.split(string)[0]
    return text
