"""ObservationTokens: an environment's answer as the tokens appended to an episode, never re-tokenizing it.

The episode's tokens are the prompt's, then each model turn exactly as sampled, then each observation's
tokens: only the new text is ever tokenized. Raw text (no chat template) appends the observation's
tokens as they are. With a chat template, the appended text is the template's delta: what rendering the
conversation with the new turn adds to rendering it without, plus the closing of the model's turn that
the model did not sample itself (the template's line break after its end token, or the whole closing
after a stop string). That delta is only correct for a template that renders a conversation append-only
(a longer conversation's text starts with the shorter one's); a template that rewrites earlier turns
(one that drops past reasoning, say) is refused with ``TemplateNotAppendOnly`` rather than trained on
tokens the model never saw.

Example::

    >>> from lit_parl.models.char_tokenizer import build_char_tokenizer
    >>> tokenizer = build_char_tokenizer()
    >>> encode = ObservationTokens(tokenizer, role="user")
    >>> tokenizer.decode(encode.delta(None, tokenizer("?3*4").input_ids, "=12"))
    '=12'
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

_PROBE = "\u2063lit_parl\u2063"  # a model turn no template rewrites: finds where the template closes a turn


class TemplateNotAppendOnly(ValueError):
    """The chat template renders a longer conversation as something other than the shorter one plus new text."""


class ObservationTokens:
    """Tokens of an observation, appended after a model turn.

    Args:
        tokenizer: the policy's tokenizer (its chat template, for chat episodes).
        role: the role of the environment's turns in a chat template (``"user"``, or ``"tool"`` where the
            template knows it).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, role: str = "user") -> None:
        self.tokenizer, self.role = tokenizer, role

    def delta(self, messages: list[dict] | None, turn_ids: list[int], observation: str) -> list[int]:
        """The tokens to append after the model's turn ``turn_ids``: the observation's for raw text
        (``messages`` None); for chat, the template's delta of the observation's turn after the conversation
        ``messages`` (which ends with the model's turn as an ``assistant`` message), with the turn's closing."""
        if messages is None:
            return self.tokenizer(observation, add_special_tokens=False).input_ids
        closing = self._closing(turn_ids)
        added = self._added(messages, {"role": self.role, "content": observation})
        return self.tokenizer(closing + added, add_special_tokens=False).input_ids

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def _added(self, messages: list[dict], new: dict) -> str:
        """What the template adds for ``new`` (and the next assistant opening) after ``messages``."""
        before = self._render(messages, False)
        after = self._render([*messages, new], True)
        if not after.startswith(before):
            raise TemplateNotAppendOnly(
                "the chat template renders the conversation differently once a turn is added (the earlier text is "
                f"changed, not extended: {_first_difference(before, after)}); a multi-turn episode keeps the tokens "
                "the model sampled, so it needs an append-only template: set tokenizer.chat_template to one that "
                "renders earlier turns unchanged (e.g. without the rule that drops past reasoning)"
            )
        return after[len(before) :]

    def _closing(self, turn_ids: list[int]) -> str:
        """The text the template puts after an assistant turn's content that the sampled turn lacks."""
        opened = self._render([{"role": "user", "content": "x"}], True)
        closed = self._render([{"role": "user", "content": "x"}, {"role": "assistant", "content": _PROBE}], False)
        if not closed.startswith(opened) or _PROBE not in closed[len(opened) :]:
            raise TemplateNotAppendOnly(
                "the chat template does not render an assistant turn as its generation prompt followed by its "
                "content, so the tokens the model sampled cannot be placed in a rendered conversation"
            )
        closing = closed[len(opened) :].split(_PROBE, 1)[1]  # e.g. "<|im_end|>\n"
        sampled_end = self.tokenizer.decode(turn_ids[-1:], skip_special_tokens=False) if turn_ids else ""
        if sampled_end and closing.startswith(sampled_end):  # the turn ended with the template's end token
            return closing[len(sampled_end) :]
        return closing  # ended by a stop string: the whole closing is the template's, not the model's


def _first_difference(before: str, after: str) -> str:
    at = next((i for i, (a, b) in enumerate(zip(before, after)) if a != b), min(len(before), len(after)))
    return f"at character {at}, {before[at : at + 30]!r} became {after[at : at + 30]!r}"
