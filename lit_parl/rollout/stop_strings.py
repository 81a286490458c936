"""Stop strings for the ``hf`` sampler: which samples' decoded completions now contain one.

A sample ends at the token whose text completes a stop string, and keeps that token (nothing after
it), as vLLM and SGLang return it. Only the completion's text counts, not the prompt's. It is decoded
with special tokens skipped (vLLM's default): a stop string is text the model writes; control tokens
end samples through ``stop_token_ids``.

Each token is decoded once: with a fast tokenizer, one ``tokenizers`` ``DecodeStream`` per sample turns
each new token into its new text (a character split over several tokens comes out whole, once
complete), and only the last ``len(longest stop string) - 1`` characters of earlier text are kept, all
that a new match can reach back into. A tokenizer without a Rust backend decodes each sample's whole
completion at every step instead (slower, the same matches).

Example::

    >>> from lit_parl.models import tiny_qwen2
    >>> _, tokenizer = tiny_qwen2()
    >>> matcher = StopStrings(tokenizer, ("b c", "zz"), rows=2)
    >>> ids = tokenizer(["ab c", "xyzz"], add_special_tokens=False).input_ids
    >>> [matcher.update([ids[0][t], ids[1][t]], rows=[0, 1]) for t in range(4)]
    [[], [], [], [0, 1]]
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(model_dir: str | Path, stop: Sequence[str]) -> PreTrainedTokenizerBase:
    """The tokenizer saved in the pool's model directory, which stop strings need to read completions."""
    # transformers builds an empty tokenizer from config.json alone, which would never match: ask for its files
    if not any((Path(model_dir) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise ValueError(
            f"sampling.stop={tuple(stop)!r} is matched in the decoded completions, "
            f"but the model directory {str(model_dir)!r} "
            "holds no tokenizer (tokenizer.json or tokenizer_config.json). Save it there (tokenizer.save_pretrained), "
            "or drop sampling.stop."
        )
    return AutoTokenizer.from_pretrained(model_dir)


class StopStrings:
    """The stop-string state of a batch of samples, one row per sample.

    Args:
        tokenizer: the policy's tokenizer (the model directory's).
        stop: the stop strings (non-empty).
        rows: samples in the batch.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: Sequence[str], rows: int) -> None:
        if not stop:
            raise ValueError("StopStrings needs at least one stop string")
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.reach = max(map(len, self.stop)) - 1  # earlier characters a match completed now can start in
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        if self.backend is not None:
            from tokenizers.decoders import DecodeStream

            self.streams = [DecodeStream(skip_special_tokens=True) for _ in range(rows)]
            self.tails = [""] * rows
        else:
            self.completions: list[list[int]] = [[] for _ in range(rows)]

    def update(self, tokens: Sequence[int], rows: Sequence[int]) -> list[int]:
        """Append ``tokens[i]`` to row ``rows[i]``; return the rows whose completion now contains a stop string."""
        matched = []
        for token, row in zip(tokens, rows):
            if self.backend is not None:
                text = self.tails[row] + (self.streams[row].step(self.backend, token) or "")
                self.tails[row] = text[-self.reach :] if self.reach else ""
            else:
                self.completions[row].append(token)
                text = self.tokenizer.decode(self.completions[row], skip_special_tokens=True)
            if any(s in text for s in self.stop):
                matched.append(row)
        return matched

    def select(self, rows: Sequence[int]) -> None:
        """Keep only ``rows`` (in this order), as the batch drops finished samples."""
        if self.backend is not None:
            self.streams = [self.streams[r] for r in rows]
            self.tails = [self.tails[r] for r in rows]
        else:
            self.completions = [self.completions[r] for r in rows]
