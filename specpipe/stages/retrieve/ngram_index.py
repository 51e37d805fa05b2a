"""An incremental n-gram index over the committed tokens (prompt + output so far)."""
from __future__ import annotations


class NgramIndex:
    """Maps every n-gram (min_n <= n <= max_n) of the text to where its continuations start.

    Extending by k tokens costs O(k * (max_n - min_n + 1)); a lookup is a dict access.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._starts: dict[tuple[int, ...], list[int]] = {}

    def reset(self, tokens: list[int]) -> None:
        self.tokens = []
        self._starts = {}
        self.extend(tokens)

    def extend(self, new_tokens: list[int]) -> None:
        tokens = self.tokens
        for token in new_tokens:
            tokens.append(token)
            end = len(tokens)
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._starts.setdefault(tuple(tokens[end - n:]), []).append(end)

    def continuations(self, max_matches: int, max_length: int) -> list[tuple[int, list[int]]]:
        """Up to `max_matches` (match length, continuation) pairs for the current suffix.

        Longer suffix matches come first, most recent occurrence first within a length;
        each continuation start is used once.
        """
        tokens = self.tokens
        end = len(tokens)
        found: list[tuple[int, list[int]]] = []
        used: set[int] = set()
        for n in range(min(self.max_n, end), self.min_n - 1, -1):
            for start in reversed(self._starts.get(tuple(tokens[end - n:]), ())):
                if start >= end or start in used:
                    continue  # the suffix itself has nothing after it
                used.add(start)
                found.append((n, self._continuation(start, max_length)))
                if len(found) >= max_matches:
                    return found
        return found

    def _continuation(self, start: int, max_length: int) -> list[int]:
        """What followed the match; a match that overlaps the suffix is a period of repeating
        text, so its continuation repeats that period instead of stopping at the end."""
        tokens = self.tokens
        period = len(tokens) - start
        return [tokens[start + i % period] for i in range(max_length)] if period < max_length \
            else tokens[start:start + max_length]
