"""PromptFormat: how a prompt row becomes the text (and tokens) the model sees.

Raw text is given as is. A chat row (``messages``), or any row when ``chat=True``, goes through the
tokenizer's chat template (``apply_chat_template``) with an optional system prompt and the generation
prompt (the assistant turn's opening). A prompt too long for ``max_prompt_tokens``, or for the model's
context with ``max_new_tokens`` after it, is never truncated: ``overlong="error"`` stops with the row,
``"drop"`` leaves it out of the data (counted, and each row named in a warning).

Example::

    >>> from lit_parl.prompts.prompt_row import PromptRow
    >>> from lit_parl.models.char_tokenizer import build_char_tokenizer
    >>> PromptFormat().render(PromptRow(index=0, prompt="12="), build_char_tokenizer())
    '12='
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from lit_parl.prompts.prompt_row import PromptRow

OVERLONG_POLICIES = ("error", "drop")


@dataclass(frozen=True)
class PromptFormat:
    """The chat template choice and the prompt length policy.

    Args:
        chat: ``True``: every row through the chat template (a raw prompt becomes one user turn);
            ``False``: raw text (a ``messages`` row is then an error); ``None``: chat for ``messages`` rows only.
        system_prompt: a system turn put first in chat rows that have none.
        add_generation_prompt: end the rendered chat with the assistant turn's opening (what instruct models expect).
        max_prompt_tokens: the longest prompt accepted (``None``: only the model's context bounds it).
        overlong: ``error`` (stop, naming the row) or ``drop`` (leave the row out, with a warning naming it).
    """

    chat: bool | None = None
    system_prompt: str | None = None
    add_generation_prompt: bool = True
    max_prompt_tokens: int | None = None
    overlong: str = "error"

    def __post_init__(self) -> None:
        if self.overlong not in OVERLONG_POLICIES:
            raise ValueError(f"PromptFormat(overlong={self.overlong!r}); choose one of {OVERLONG_POLICIES}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError(f"PromptFormat(max_prompt_tokens={self.max_prompt_tokens}) must be >= 1 or None")
        if self.system_prompt is not None and self.chat is False:
            raise ValueError("PromptFormat(system_prompt=...) needs the chat template: set chat=true (or null)")

    def uses_chat(self, row: PromptRow) -> bool:
        if row.is_chat and self.chat is False:
            raise ValueError(
                f"row {row.index} holds chat messages but the prompt format says chat=false; set chat=true or null"
            )
        return row.is_chat or bool(self.chat)

    def check_tokenizer(self, tokenizer: PreTrainedTokenizerBase, any_chat: bool) -> None:
        """Fail now, not at the first chat row, when the chat template is asked for and the tokenizer has none."""
        if (self.chat or any_chat) and not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"the prompts need a chat template ({'format chat=true' if self.chat else 'the data has messages'}) "
                f"but the tokenizer {type(tokenizer).__name__} "
                f"({getattr(tokenizer, 'name_or_path', '') or 'unnamed'}) has none: use an instruct model's tokenizer, "
                "set tokenizer.chat_template, or give raw prompts with chat=false"
            )

    def render(self, row: PromptRow, tokenizer: PreTrainedTokenizerBase) -> str:
        """The prompt text the model sees."""
        if not self.uses_chat(row):
            return row.prompt
        self.check_tokenizer(tokenizer, any_chat=True)
        return tokenizer.apply_chat_template(
            self.messages(row), tokenize=False, add_generation_prompt=self.add_generation_prompt
        )

    def messages(self, row: PromptRow) -> list[dict]:
        """The chat turns a chat row is rendered from: its messages (a raw prompt as one user turn), the system
        prompt first when configured."""
        messages = [dict(m) for m in row.messages] if row.is_chat else [{"role": "user", "content": row.prompt}]
        if self.system_prompt is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        return messages

    def token_limit(self, context: int | None, max_new_tokens: int) -> int | None:
        """The longest prompt in tokens: ``max_prompt_tokens`` and what the context leaves after ``max_new_tokens``."""
        limits = [self.max_prompt_tokens] if self.max_prompt_tokens is not None else []
        if context is not None:
            limits.append(context - max_new_tokens)
        return min(limits) if limits else None
