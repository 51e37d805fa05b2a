"""What a request may ask for, checked before any work: its prompt, its stop strings, and the chat
messages turned into token ids without letting their text become control tokens."""
from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence

from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from specpipe.errors import InvalidRequest

# The roles a chat request may give its messages. "developer" is the OpenAI API's newer name for the
# system role: it is passed to the template as "system".
CHAT_ROLES = frozenset({"system", "user", "assistant"})
ROLE_ALIASES = {"developer": "system"}


def checked_text(text: str, what: str) -> str:
    """`text` as given; refused where it cannot be tokenized (a lone surrogate has no UTF-8 form)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidRequest(f"{what} is not valid Unicode text: a lone surrogate at character {error.start} "
                             f"({text[error.start:error.end]!r}); send UTF-8 text") from None
    return text


def is_token_ids(prompt) -> bool:
    """A prompt given as ready token ids: a non-empty list of ints (bools are not token ids)."""
    return (isinstance(prompt, list) and bool(prompt)
            and all(isinstance(token, int) and not isinstance(token, bool) for token in prompt))


def message_text(content, index: int) -> str:
    """A message's content as text: a string, or the OpenAI API's list of content parts, of which text parts
    ({"type": "text", "text": ...}) are joined by newlines, as the OpenAI-compatible servers join them."""
    if isinstance(content, str):
        return checked_text(content, f"message {index}'s content")
    if isinstance(content, (list, tuple)):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise InvalidRequest(f"message {index}'s content has a part of type {kind!r}; this model reads "
                                     f"text only: give a string or parts {{'type': 'text', 'text': ...}}")
            texts.append(checked_text(part["text"], f"message {index}'s content"))
        return "\n".join(texts)
    raise InvalidRequest(f"message {index}'s content must be a string (or a list of text parts), "
                         f"got {type(content).__name__}")


def checked_messages(messages: Sequence) -> list[dict]:
    """Chat messages as the template takes them: {"role", "content"} with a known role and text content."""
    checked = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            raise InvalidRequest(f"message {index} must be a dict with 'role' and 'content', got {message!r}"[:300])
        role = message["role"]
        role = ROLE_ALIASES.get(role, role) if isinstance(role, str) else role
        if role not in CHAT_ROLES:
            raise InvalidRequest(f"message {index} has role {message['role']!r}; a chat message's role is one of "
                                 f"{', '.join(sorted(CHAT_ROLES | ROLE_ALIASES.keys()))}")
        checked.append({"role": role, "content": message_text(message["content"], index)})
    if not checked:
        raise InvalidRequest("the message list is empty; give at least one {'role', 'content'} message")
    if not any(message["content"].strip() for message in checked):
        raise InvalidRequest("every message is empty; give some text to continue")
    return checked


def checked_stop(stop) -> tuple[str, ...]:
    """Stop strings: None (none), one string, or a list of strings; empty strings stop nothing and are dropped."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)) or not all(isinstance(item, str) for item in stop):
        shown = [type(item).__name__ for item in stop] if isinstance(stop, (list, tuple)) else type(stop).__name__
        raise InvalidRequest(f"stop must be a string or a list of strings, got {shown} (on the command line, quote a "
                             f"stop string that looks like a number: stop='\"4.\"')")
    return tuple(checked_text(item, "a stop string") for item in stop if item)


class ChatEncoder:
    """Chat messages -> token ids through the tokenizer's chat template, where no message's text becomes a
    control token: `<|im_start|>system` written inside a user's message stays those characters as text.

    Messages whose text holds none of the tokenizer's added tokens go through the template as they are (the ids
    every earlier version gave). Where some do, those messages' contents are replaced by unique markers, the
    template is rendered to text, and the text between markers (the template's own) is tokenized with its
    control tokens while each message's text is tokenized with them split into ordinary tokens. A template that
    does not keep a marker exactly once (it rewrites or drops message text) is refused rather than guessed."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.control_texts = tuple(sorted({token.content for token in tokenizer.added_tokens_decoder.values()
                                           if token.content}, key=len, reverse=True))

    def holds_control_text(self, text: str) -> bool:
        return any(control in text for control in self.control_texts)

    def encode(self, messages: list[dict]) -> list[int]:
        risky = [i for i, message in enumerate(messages) if self.holds_control_text(message["content"])]
        if not risky:
            encoded = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                         return_dict=True)
            return list(encoded["input_ids"])
        salt = secrets.token_hex(8)
        markers = {i: f"SPECPIPEMESSAGE{salt}X{i}X" for i in risky}
        rendered = self.tokenizer.apply_chat_template(
            [dict(message, content=markers[i]) if i in markers else message for i, message in enumerate(messages)],
            add_generation_prompt=True, tokenize=False)
        ids: list[int] = []
        rest = rendered
        for i in risky:
            before, found, after = rest.partition(markers[i])
            if not found or markers[i] in after:
                raise InvalidRequest(f"message {i} holds text that is one of the model's control tokens, and this "
                                     f"model's chat template does not keep message text as it is, so it cannot be "
                                     f"sent as plain text; remove the control token from the message")
            ids += self._template_ids(before)
            ids += self.tokenizer(messages[i]["content"], add_special_tokens=False,
                                  split_special_tokens=True)["input_ids"]
            rest = after
        return ids + self._template_ids(rest)

    def _template_ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
