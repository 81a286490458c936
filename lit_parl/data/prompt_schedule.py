"""PromptSchedule: which prompts an iteration draws, their text and tokens, and their per-sample seeds.

``prompt_id`` is the run's global draw index, never reused: results are paired with requests by it, and
sample seeds derive from it. The row it draws travels beside it: from a finite source (a dataset) draw
``i`` is row ``order(epoch)[i % rows]`` of a shuffled order per data epoch (``epoch = i // rows``, the
shuffle seeded by the run's seed and the epoch), so a dataset smaller than an iteration, or several
data epochs, never collide; a procedural source (``num_rows=None``) gives row ``i``. The cursor (the
next draw) is the schedule's state: a resumed run draws exactly the prompts it had not trained.

A finite source is prepared once, at construction: every row is validated, rendered (``PromptFormat``)
and measured, so a bad row stops the run before any engine starts and an overlong one is dropped or
refused by the format's policy.

Example::

    >>> from lit_parl.tasks import CopyTask
    >>> from lit_parl.models.char_tokenizer import build_char_tokenizer
    >>> schedule = PromptSchedule(CopyTask(seed=0), build_char_tokenizer(), group_size=2, seed=0)
    >>> drawn = schedule.draw([0, 1], version=3)
    >>> sorted(drawn), drawn[0].request.version, len(drawn[0].request.seeds), drawn[0].text == drawn[0].row.prompt
    ([0, 1], 3, 2, True)
    >>> schedule.advance(2); schedule.state_dict()["cursor"]
    2
"""

from __future__ import annotations

import hashlib
import random
import threading
import warnings
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from lit_parl.prompts.prompt_format import PromptFormat
from lit_parl.prompts.prompt_row import PromptRow, PromptSource
from lit_parl.rollout.records import GroupRequest, sample_seed

PREPARE_BATCH = 1024  # rows rendered and tokenized per call while preparing a finite source
PROCEDURAL_SAMPLE = 8  # rows of a procedural source checked (and fingerprinted) at construction


@dataclass(frozen=True)
class DrawnPrompt:
    """One draw: the request the pool gets, and what only the trainer's side needs (the row, its text)."""

    request: GroupRequest
    row: PromptRow
    text: str  # the prompt as the model sees it
    answer_ids: tuple[int, ...]  # the answer tokenized (empty without an answer)


class PromptSchedule:
    """The run's prompt order, rendering and tokenization (cached ahead), and sample seeds.

    Args:
        source: a ``lit_parl.prompts.prompt_row.PromptSource`` (a dataset, or a procedural task).
        tokenizer: renders chat rows and encodes prompts and answers (no special tokens added).
        group_size: samples per prompt, hence seeds per request.
        seed: the run's seed: the data order of each epoch, and sample ``k`` of prompt ``i`` under policy
            version ``v`` draws from ``sample_seed(seed, v, i, k)`` (independent of what shared its batch).
        prompt_format: chat template use and the prompt length policy.
        token_limit: the longest prompt in tokens (the format's limit and the model's context left after
            ``max_new_tokens``; ``lit_parl.prompts.prompt_format.PromptFormat.token_limit``), ``None``: unbounded.
    """

    def __init__(
        self,
        source: PromptSource,
        tokenizer: PreTrainedTokenizerBase,
        group_size: int,
        seed: int = 0,
        prompt_format: PromptFormat | None = None,
        token_limit: int | None = None,
    ) -> None:
        if not isinstance(source, PromptSource):
            raise TypeError(
                f"PromptSchedule(source={type(source).__name__}): a prompt source has num_rows and row(index) "
                "(lit_parl.prompts.prompt_row.PromptSource)"
            )
        self.source, self.tokenizer, self.group_size, self.seed = source, tokenizer, group_size, seed
        self.format = prompt_format or PromptFormat()
        self.token_limit = token_limit
        self.cursor = 0  # the next prompt to draw
        self.dropped_rows: list[int] = []  # rows left out as too long (overlong="drop")
        self._usable: list[int] | None = None  # a finite source's usable row indices
        self._orders: dict[int, list[int]] = {}  # data epoch -> shuffled positions in _usable (the last two kept)
        self._cache: dict[int, DrawnPrompt] = {}  # prompt_id -> drawn (tokenized ahead), version-free request
        self._lock = threading.RLock()  # a prefetch thread tokenizes ahead while the trainer's thread draws
        self._fingerprint = hashlib.blake2b(f"lit_parl-data/{seed}".encode(), digest_size=16)
        if source.num_rows is not None:
            self._prepare(source.num_rows)
        else:
            self._check_procedural()
        self.fingerprint = self._fingerprint.hexdigest()  # the data, its rendering and its order, for resumes

    def _check_procedural(self) -> None:
        """A procedural source's rows are made as drawn: check the tokenizer and the first rows now."""
        if self.format.overlong == "drop":
            raise ValueError(
                f"prompt_format.overlong=drop needs a finite source; {type(self.source).__name__} makes its rows "
                "as they are drawn, and skipping one would change which draw reads which row: use overlong=error"
            )
        rows = [self.source.row(i) for i in range(PROCEDURAL_SAMPLE)]
        self.format.check_tokenizer(self.tokenizer, any_chat=any(r.is_chat for r in rows))
        texts = [self.format.render(r, self.tokenizer) for r in rows]
        for row, ids in zip(rows, self.tokenizer(texts, add_special_tokens=False).input_ids):
            self._fits(row, len(ids))
        for text, row in zip(texts, rows):
            self._fingerprint.update(f"{text}\0{row.answer}\0".encode())

    # -- the order ---------------------------------------------------------------------------------
    def row_index(self, prompt_id: int) -> int:
        """The source row that draw ``prompt_id`` reads."""
        if self._usable is None:
            return prompt_id
        epoch, position = divmod(prompt_id, len(self._usable))
        order = self._orders.get(epoch)
        if order is None:
            order = list(range(len(self._usable)))
            random.Random(f"lit_parl-data-order/{self.seed}/{epoch}").shuffle(order)
            self._orders = {e: o for e, o in self._orders.items() if e == epoch - 1} | {epoch: order}
        return self._usable[order[position]]

    def _prepare(self, rows: int) -> None:
        """Validate, render and measure every row once; keep the usable ones (in source order)."""
        if rows < 1:
            raise ValueError(f"the prompt source {type(self.source).__name__} has no rows")
        usable = []
        for start in range(0, rows, PREPARE_BATCH):
            positions = range(start, min(rows, start + PREPARE_BATCH))
            batch = [self.source.row(i) for i in positions]  # a bad row raises here, naming itself
            if start == 0:
                self.format.check_tokenizer(self.tokenizer, any_chat=any(r.is_chat for r in batch))
            texts = [self.format.render(r, self.tokenizer) for r in batch]
            lengths = [len(ids) for ids in self.tokenizer(texts, add_special_tokens=False).input_ids]
            for i, row, text, length in zip(positions, batch, texts, lengths):
                if self._fits(row, length):
                    usable.append(i)
                    self._fingerprint.update(f"{text}\0{row.answer}\0{sorted(row.metadata.items())!r}\0".encode())
        if self.dropped_rows:
            shown = ", ".join(map(str, self.dropped_rows[:10])) + (" ..." if len(self.dropped_rows) > 10 else "")
            warnings.warn(
                f"dropped {len(self.dropped_rows)} of {rows} prompts longer than {self.token_limit} tokens "
                f"(rows {shown}); to keep them raise prompt_format.max_prompt_tokens, "
                "or lower sampling.max_new_tokens (the context holds both)",
                stacklevel=2,
            )
        if not usable:
            raise ValueError(
                f"every one of the {rows} prompts is longer than {self.token_limit} tokens: nothing to train on"
            )
        self._usable = usable

    def _fits(self, row: PromptRow, length: int) -> bool:
        if length == 0:
            raise ValueError(f"row {row.index}: the prompt renders to no tokens")
        if self.token_limit is None or length <= self.token_limit:
            return True
        if self.format.overlong == "drop":
            self.dropped_rows.append(row.index)
            return False
        raise ValueError(
            f"row {row.index}: the prompt has {length} tokens, more than the limit of {self.token_limit} "
            "(prompt_format.max_prompt_tokens, or the model's context minus sampling.max_new_tokens); "
            "set prompt_format.overlong=drop to leave such rows out, or raise the limit"
        )

    @property
    def usable_rows(self) -> int | None:
        """How many rows a data epoch has (``None``: a procedural source)."""
        return None if self._usable is None else len(self._usable)

    # -- drawing -------------------------------------------------------------------------------------
    def advance(self, drawn: int) -> None:
        """Move the cursor past an iteration's ``drawn`` prompts (called once the iteration is complete)."""
        self.cursor += drawn

    def tokenize_ahead(self, prompt_ids: list[int]) -> None:
        """Render and tokenize these draws now, in one batched call; ``draw`` takes them from here."""
        with self._lock:  # held throughout: a concurrent ``draw`` waits for this work instead of redoing it
            missing = [prompt_id for prompt_id in prompt_ids if prompt_id not in self._cache]
            if not missing:
                return
            rows = [self.source.row(self.row_index(prompt_id)) for prompt_id in missing]
            texts = [self.format.render(row, self.tokenizer) for row in rows]
            answers = [row.answer or "" for row in rows]
            encoded = self.tokenizer(texts + answers, add_special_tokens=False).input_ids
            for i, (prompt_id, row, text) in enumerate(zip(missing, rows, texts)):
                tokens = tuple(encoded[i])
                # a procedural row is measured here (a finite source's were at start); too long raises
                if self._usable is None:
                    self._fits(row, len(tokens))
                request = GroupRequest(prompt_id=prompt_id, prompt_tokens=tokens, version=-1, seeds=())
                self._cache[prompt_id] = DrawnPrompt(request, row, text, tuple(encoded[len(rows) + i]))

    def draw(self, prompt_ids: list[int], version: int) -> dict[int, DrawnPrompt]:
        """These draws under policy ``version``: requests with their seeds, rows and texts, by prompt_id."""
        with self._lock:
            self.tokenize_ahead(prompt_ids)
            cached = {prompt_id: self._cache.pop(prompt_id) for prompt_id in prompt_ids}
        return {
            prompt_id: DrawnPrompt(
                GroupRequest(
                    prompt_id=prompt_id,
                    prompt_tokens=drawn.request.prompt_tokens,
                    version=version,
                    seeds=tuple(sample_seed(self.seed, version, prompt_id, k) for k in range(self.group_size)),
                ),
                drawn.row,
                drawn.text,
                drawn.answer_ids,
            )
            for prompt_id, drawn in cached.items()
        }

    def requests(self, prompt_ids: list[int], version: int) -> dict[int, GroupRequest]:
        """Only the requests of ``draw``."""
        return {prompt_id: drawn.request for prompt_id, drawn in self.draw(prompt_ids, version).items()}

    def state_dict(self) -> dict:
        return {"cursor": self.cursor, "usable_rows": self.usable_rows, "data_fingerprint": self.fingerprint}

    def load_state_dict(self, state_dict: dict) -> None:
        saved, fingerprint = state_dict.get("usable_rows"), state_dict.get("data_fingerprint")
        if saved != self.usable_rows or (fingerprint is not None and fingerprint != self.fingerprint):
            what = (
                f"{saved} usable prompt rows, this run's has {self.usable_rows}"
                if saved != self.usable_rows
                else "other prompt rows"
            )
            raise ValueError(
                f"the checkpoint's data had {what} (or another seed or prompt format): resuming would not continue the "
                "same data order; resume with the same data, seed and prompt format"
            )
        with self._lock:
            self.cursor = state_dict["cursor"]
            self._cache.clear()  # drawn for the old cursor: may never be requested
