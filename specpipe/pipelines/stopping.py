"""When to stop: EOS, an exact token budget, stop strings."""
from __future__ import annotations

from dataclasses import dataclass, field

from transformers.tokenization_utils_base import PreTrainedTokenizerBase


@dataclass
class StopCondition:
    """Cuts a step's emitted tokens at the first stop and says whether decoding is over.

    A step may accept several tokens at once, so every check runs token by token: the
    output never overshoots `max_new_tokens` and never runs past an EOS or a stop string
    (both are kept, as in `transformers`' `generate`).
    """

    max_new_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    tokenizer: PreTrainedTokenizerBase | None = None
    generated: int = 0
    reason: str | None = None  # once finished: "eos", "stop_string" or "length"
    _tail: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        # Enough trailing tokens to contain any stop string (a token is at least one byte, not one character).
        self._window = max((len(s.encode("utf-8")) for s in self.stop_strings), default=0) + 1

    def cut(self, emitted: list[int]) -> tuple[list[int], bool]:
        """Returns the tokens to keep and whether generation is finished after them."""
        kept: list[int] = []
        for token in emitted:
            kept.append(token)
            self.generated += 1
            if token in self.eos_token_ids:
                self.reason = "eos"
            elif self._hits_stop_string(token):
                self.reason = "stop_string"
            elif self.generated >= self.max_new_tokens:
                self.reason = "length"
            else:
                continue
            return kept, True
        return kept, False

    def _hits_stop_string(self, token: int) -> bool:
        if not self.stop_strings:
            return False
        self._tail.append(token)
        del self._tail[: -self._window]
        text = self.tokenizer.decode(self._tail, skip_special_tokens=False)
        last = self.tokenizer.decode(self._tail[:-1], skip_special_tokens=False)
        # Only a stop string that ends in the newest token counts; earlier ones were checked before.
        return any(s in text and s not in last for s in self.stop_strings)
