"""JudgeReward: an LLM judge's verdict as a reward: a rubric in, a number out.

For each sample the rubric (a ``str.format`` template) is filled with the exchange and sent as one user turn (after
an optional system turn) to an OpenAI-compatible endpoint (``lit_parl.rewards.judge_endpoint``: a SGLang or vLLM
server, or a hosted API). The answer's score is read by ``pattern`` (a regular expression whose first group is the
number; its last match counts), must lie in ``score_range``, and is scaled to [0, 1] from it. An answer without a
score, or with one out of range, fails that sample's call, and the run's scoring policy decides: stop, naming the
answer, or score ``error_score`` and count it (``reward/<name>/failures``).

The rubric's fields: ``{prompt}`` (the user's request: a raw prompt, or the row's last user message), ``{completion}``
(the model's last turn), ``{answer}`` (the row's reference answer, ``""`` without one) and ``{conversation}`` (every
turn, one ``role: text`` paragraph each: an episode's whole exchange). Write a literal brace as ``{{`` or ``}}``.

Verdicts are cached by the exact request (model, messages, tokens, temperature): a text judged before, or judged at
the same moment by another sample (a group's identical completions), costs one request. Keep ``temperature=0`` with
the cache on: the cache would otherwise fix one draw of a random verdict.

Example (the rubric and the parser, without a server)::

    >>> judge = JudgeReward("http://127.0.0.1:30000", model="judge", probe=False, score_range=(0, 10))
    >>> judge.parse("The answer is right. Score: 8")
    0.8
    >>> judge.parse("I cannot tell.")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    lit_parl.rewards.judge.JudgeParseError: the judge's answer holds no score matching ...: 'I cannot tell.'
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

from lit_parl.rewards.judge_endpoint import JudgeEndpoint
from lit_parl.rewards.reward import Reward

DEFAULT_RUBRIC = (
    "You are grading an assistant's reply.\n\n"
    "Request:\n{prompt}\n\nReply:\n{completion}\n\nReference answer (may be empty):\n{answer}\n\n"
    "Judge whether the reply fulfils the request correctly and concisely. End with a line 'Score: N', N an integer "
    "from 0 (useless) to 10 (perfect)."
)
DEFAULT_PATTERN = r"(?i)score[^\w-]*(-?\d+(?:\.\d+)?)"
RUBRIC_FIELDS = ("prompt", "completion", "answer", "conversation")


class ServerLaunch(Protocol):
    """What the judge needs of a server the run starts (``lit_parl.rollout.sglang.judge_server.JudgeLaunch``)."""

    url: str

    def start(self) -> Callable[[], None]:
        """Start the server, wait until it answers, and return what stops it."""


class JudgeParseError(ValueError):
    """The judge's answer holds no score the parser can read, or one outside the score range."""


class JudgeReward(Reward):
    """An LLM judge behind an OpenAI-compatible endpoint, as a reward (async, cached).

    Args:
        url: the address of a judge server one runs (``http://host:port``); or, instead:
        launch: a server the run starts and stops (``lit_parl.rollout.sglang.judge_server.JudgeLaunch``: an SGLang
            server; the config builds it from ``reward.<name>.launch``).
        name: the metric name (``reward/<name>``).
        weight: its factor in the total reward.
        model: the model the server serves (``None``: the first it lists).
        rubric: the prompt template (fields above); ``None``: a general correctness rubric with a 0-10 score.
        system: an optional system turn before the rubric.
        pattern: the regular expression whose first group is the score (its last match in the answer counts).
        score_range: the scores the rubric asks for, ``(low, high)``; the reward is scaled to [0, 1] from it.
        max_tokens: the most tokens of the judge's answer (room for a short reason and the score).
        temperature: the judge's sampling temperature (0: greedy, what the cache assumes).
        cache_size: verdicts kept (0: no cache).
        concurrent_groups: groups the scorer keeps in flight for it (their requests overlap).
        **endpoint: the endpoint's settings (``lit_parl.rewards.judge_endpoint.JudgeEndpoint``): ``concurrency``,
            ``request_timeout_s``, ``retries``, ``retry_backoff_s``, ``api_key_env``, ``probe``, ``probe_timeout_s``.
    """

    def __init__(
        self,
        url: str | None = None,
        name: str = "judge",
        weight: float = 1.0,
        model: str | None = None,
        rubric: str | None = None,
        system: str | None = None,
        pattern: str = DEFAULT_PATTERN,
        score_range: tuple[float, float] | list[float] = (0.0, 10.0),
        max_tokens: int = 64,
        temperature: float = 0.0,
        cache_size: int = 100_000,
        concurrent_groups: int = 4,
        launch: ServerLaunch | None = None,
        **endpoint,
    ) -> None:
        if (url is None) == (launch is None):
            raise ValueError(
                "the judge needs a server: give reward.<name>.url (one you run) or reward.<name>.launch.model_path "
                "(one the run starts), not both"
            )
        self.rubric = DEFAULT_RUBRIC if rubric is None else rubric
        try:
            self.rubric.format(**{field: "" for field in RUBRIC_FIELDS})
        except (KeyError, IndexError, ValueError) as error:
            raise ValueError(
                f"judge rubric: {type(error).__name__} {error}; its fields are {{{'}, {'.join(RUBRIC_FIELDS)}}} "
                "(write a literal brace as {{ or }})"
            ) from None
        try:
            self.pattern = re.compile(pattern)
        except re.error as error:
            raise ValueError(f"judge pattern {pattern!r} is not a regular expression: {error}") from None
        if self.pattern.groups < 1:
            raise ValueError(f"judge pattern {pattern!r} needs a group that captures the score, e.g. 'Score: (\\d+)'")
        low, high = (float(v) for v in score_range)
        if not high > low:
            raise ValueError(f"judge score_range={list(score_range)} must be (low, high) with high > low")
        self.score_range = (low, high)
        if cache_size < 0:
            raise ValueError(f"judge cache_size={cache_size} must be >= 0 (0: no cache)")
        self.system, self.max_tokens, self.temperature = system, max_tokens, temperature
        self.cache_size, self.cache_hits = cache_size, 0
        self._cache: OrderedDict[str, asyncio.Future] = OrderedDict()
        self.concurrent_groups = concurrent_groups
        self.launch, self._stop_server = launch, None
        if launch is not None:
            self._stop_server, url = launch.start(), launch.url
        try:
            self.endpoint = JudgeEndpoint(url, model, **endpoint)
        except BaseException:
            self.close()
            raise
        super().__init__(self.judge, name=name, weight=weight, batched=False)

    def messages(self, prompt: str, conversation: list[dict], answer: str | None) -> list[dict]:
        """The request's messages for one sample."""
        users = [turn["content"] for turn in conversation if turn["role"] == "user"]
        replies = [turn["content"] for turn in conversation if turn["role"] == "assistant"]
        text = self.rubric.format(
            prompt=users[-1] if users else prompt,
            completion=replies[-1] if replies else "",
            answer=answer or "",
            conversation="\n\n".join(f"{turn['role']}: {turn['content']}" for turn in conversation),
        )
        head = [] if self.system is None else [{"role": "system", "content": self.system}]
        return [*head, {"role": "user", "content": text}]

    def parse(self, text: str) -> float:
        """The answer's score scaled to [0, 1]; ``JudgeParseError`` when it holds none in range."""
        found = self.pattern.findall(text)
        if not found:
            raise JudgeParseError(f"the judge's answer holds no score matching {self.pattern.pattern!r}: {text!r:.300}")
        last = found[-1][0] if isinstance(found[-1], tuple) else found[-1]
        low, high = self.score_range
        try:
            value = float(last)
        except ValueError:
            raise JudgeParseError(f"the judge's score {last!r} is not a number (answer: {text!r:.300})") from None
        if not low <= value <= high:
            raise JudgeParseError(f"the judge's score {value} is outside score_range {[low, high]}: {text!r:.300}")
        return (value - low) / (high - low)

    async def judge(self, prompt: str, conversation: list[dict], answer: str | None) -> float:
        """One sample's verdict (the reward's call): from the cache, or asked of the endpoint."""
        messages = self.messages(prompt, conversation, answer)
        key = hashlib.sha256(
            json.dumps([self.endpoint.model, messages, self.max_tokens, self.temperature]).encode()
        ).hexdigest()
        if self.cache_size:
            cached = self._cache.get(key)
            if cached is not None:
                self.cache_hits += 1
                self._cache.move_to_end(key)
                return await asyncio.shield(cached)  # a timed-out sample does not cancel the others' request
            verdict = asyncio.ensure_future(self._ask(messages))
            self._cache[key] = verdict
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            verdict.add_done_callback(lambda done: self._forget_failed(key, done))
            return await asyncio.shield(verdict)
        return await self._ask(messages)

    async def _ask(self, messages: list[dict]) -> float:
        return self.parse(await self.endpoint.complete(messages, self.max_tokens, self.temperature))

    def _forget_failed(self, key: str, done: asyncio.Future) -> None:
        if (done.cancelled() or done.exception() is not None) and self._cache.get(key) is done:
            del self._cache[key]  # a failure is asked again next time, not remembered

    def close(self) -> None:
        if hasattr(self, "endpoint"):
            self.endpoint.close()
        if self._stop_server is not None:
            self._stop_server()  # the server the run launched
