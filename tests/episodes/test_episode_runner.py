"""The episode driver on its own: tokens kept as sampled, observations appended, limits, faults, chat deltas."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from helpers.episode_envs import (
    DIGIT_STOPS,
    AsyncTurnTaker,
    Endless,
    FailsOnReset,
    FailsOnSecondStep,
    HangsOnStep,
    LongAnswer,
    ReturnsText,
    TurnTaker,
)
from helpers.pools import InProcessPool, WrappedPool
from helpers.sglang_pools import save_spec
from lit_parl.data.prompt_schedule import PromptSchedule
from lit_parl.episodes import EpisodeError, EpisodeRunner, EpisodeSettings, ObservationTokens, TemplateNotAppendOnly
from lit_parl.episodes.episode import turn_seed
from lit_parl.errors import OffPolicyError
from lit_parl.models import tiny_qwen2
from lit_parl.prompts.prompt_format import PromptFormat
from lit_parl.prompts.prompt_row import PromptRow
from lit_parl.rewards import ScoringPolicy
from lit_parl.rollout.records import GroupCompletions, SamplingParams
from lit_parl.tasks import CopyTask

SAMPLING = SamplingParams(max_new_tokens=6, stop_token_ids=DIGIT_STOPS)


class Recording(WrappedPool):
    """Keeps every call's requests and groups."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.calls = []

    def _generate(self, requests, sampling):
        returned = []
        self.calls.append((list(requests), sampling, returned))
        for group in self.inner._generate(requests, sampling):
            returned.append(group)
            yield group


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    model, tokenizer = tiny_qwen2(seed=0)
    pool = Recording(InProcessPool())
    pool.start(save_spec(model, tokenizer, tmp_path_factory.mktemp("episodes") / "model"))
    pool.sync_weights([list(model.named_parameters())], version=0)
    yield pool
    pool.close()


def _play(pool, tok, environment, prompts=4, group_size=3, sampling=SAMPLING, policy=None, **limits):
    pool.calls.clear()
    drawn = PromptSchedule(CopyTask(seed=0), tok, group_size=group_size).draw(list(range(prompts)), version=0)
    settings = EpisodeSettings(environment, **{"max_turns": 4, "max_episode_tokens": 40, **limits})
    runner = EpisodeRunner(settings, tok, policy)
    groups = list(runner.generate(pool, [d.request for d in drawn.values()], sampling, drawn))
    return drawn, groups


def test_an_episode_is_the_sampled_turns_and_the_appended_observations_never_retokenized(pool, tok):
    drawn, groups = _play(pool, tok, TurnTaker)
    assert sorted(g.prompt_id for g in groups) == list(range(4))
    turns_of = {}  # (prompt, sample) -> the tokens and log-probs of each model turn, from the pool's own groups
    context_of = {}
    for requests, _, returned in pool.calls:
        by_id = {r.prompt_id: r for r in requests}
        for group in returned:
            request = by_id[group.prompt_id]
            for sample, tokens, logprobs in zip(group.sample_indices, group.completions, group.logprobs):
                key = (group.prompt_id, sample) if request.group_size > 1 else divmod(group.prompt_id, 3)
                turns_of.setdefault(key, []).append((tokens, logprobs))
                context_of.setdefault(key, []).append(request.prompt_tokens)
    lengths = set()
    for group in groups:
        prompt = list(drawn[group.prompt_id].request.prompt_tokens)
        for sample, tokens, logprobs, episode in zip(
            group.sample_indices, group.completions, group.logprobs, group.episodes
        ):
            turns = turns_of[(group.prompt_id, sample)]
            model_tokens = [t for t, m in zip(tokens, episode.loss_mask) if m]
            assert model_tokens == [t for turn, _ in turns for t in turn]
            assert [lp for lp, m in zip(logprobs, episode.loss_mask) if m] == [lp for _, lps in turns for lp in lps]
            assert all(lp == 0.0 for lp, m in zip(logprobs, episode.loss_mask) if not m)
            # each continuation carried exactly the prompt and the episode's tokens so far
            at = 0
            for context, (turn, _) in zip(context_of[(group.prompt_id, sample)], turns):
                assert list(context) == prompt + tokens[:at]
                at += len(turn)
                at += next((i for i, m in enumerate(episode.loss_mask[at:]) if m), len(tokens) - at)
            environment_text = tok.decode([t for t, m in zip(tokens, episode.loss_mask) if not m])
            assert environment_text == "".join(text for role, text in episode.turns if role == "user")
            lengths.add(len(turns))
    assert lengths == {1, 2, 3}, "the episodes were not of uneven length"


def test_turn_seeds_are_per_version_prompt_sample_and_turn_and_an_episode_replays_identically(pool, tok):
    first = [(g.prompt_id, g.completions) for g in sorted(_play(pool, tok, TurnTaker)[1], key=lambda g: g.prompt_id)]
    seeds = [r.seeds for requests, _, _ in pool.calls[1:] for r in requests]
    again = [(g.prompt_id, g.completions) for g in sorted(_play(pool, tok, TurnTaker)[1], key=lambda g: g.prompt_id)]
    assert first == again
    assert len({s for pair in seeds for s in pair}) == len(seeds), "two continuations shared a seed"
    assert turn_seed(11, 0) == 11 and len({turn_seed(11, t) for t in range(4)}) == 4


def meeting_at_the_first_step(episodes: int) -> type:
    """The async game, whose first steps each wait until those of ``episodes`` episodes are under way (later
    ones pass at once): only steps that run concurrently pass; steps run one after another fail after 10 s,
    never hang."""

    class MeetsAtTheFirstStep(AsyncTurnTaker):
        arrived = 0
        everyone: asyncio.Event | None = None

        async def step(self, text: str):
            if self.played == 0:  # every step runs on the one event loop: the count needs no lock
                cls = type(self)
                cls.everyone = cls.everyone or asyncio.Event()
                cls.arrived += 1
                if cls.arrived == episodes:
                    cls.everyone.set()
                try:
                    await asyncio.wait_for(cls.everyone.wait(), timeout=10)
                except asyncio.TimeoutError:
                    raise AssertionError(
                        f"only {cls.arrived} of {episodes} first steps were under way at once"
                    ) from None
            return await super().step(text)

    return MeetsAtTheFirstStep


def test_async_environments_step_concurrently(pool, tok):
    """Proven by a rendezvous, not by a duration: the first steps of 4 episodes, more than one group holds, are
    under way at the same time (of the 12 episodes, those whose first turn ends by a stop token step)."""
    _, groups = _play(pool, tok, meeting_at_the_first_step(4), prompts=4, group_size=3)
    _, plain = _play(pool, tok, TurnTaker, prompts=4, group_size=3)
    assert [g.completions for g in sorted(groups, key=lambda g: g.prompt_id)] == [
        g.completions for g in sorted(plain, key=lambda g: g.prompt_id)
    ]


def test_max_turns_ends_an_episode_truncated(pool, tok):
    _, groups = _play(pool, tok, Endless, max_turns=2)
    roles = [[role for role, _ in e.turns] for g in groups for e in g.episodes]
    assert all(r == "length" for g in groups for r in g.finish_reasons)
    assert all(r in (["assistant"], ["assistant", "user", "assistant"]) for r in roles)  # one: its turn hit 6 tokens
    assert roles.count(["assistant", "user", "assistant"]) >= len(roles) // 2


def test_the_episode_token_budget_cuts_a_turn_and_an_observation_that_would_overflow(pool, tok):
    _, groups = _play(pool, tok, Endless, max_turns=50, max_episode_tokens=9)
    for group in groups:
        for tokens, episode, reason in zip(group.completions, group.episodes, group.finish_reasons):
            assert reason == "length" and len(tokens) <= 9
    _, groups = _play(pool, tok, LongAnswer, max_turns=3, max_episode_tokens=30)
    assert all(
        r == "length" and e.loss_mask == [1] * len(e.loss_mask)
        for g in groups
        for e, r in zip(g.episodes, g.finish_reasons)
    )


def test_a_turn_cut_at_its_own_limit_ends_the_episode_truncated(pool, tok):
    _, groups = _play(pool, tok, TurnTaker, sampling=SamplingParams(max_new_tokens=1))
    assert all(len(e.turns) == 1 for g in groups for e in g.episodes if e.turns[0][1] and len(e.loss_mask) == 1)
    assert "length" in {r for g in groups for r in g.finish_reasons}


def test_an_environment_that_raises_stops_the_run_or_is_scored_by_the_policy(pool, tok):
    with pytest.raises(EpisodeError, match=r"ConnectionError: tool server down.*on_error=score"):
        _play(pool, tok, FailsOnSecondStep)
    _, groups = _play(pool, tok, FailsOnSecondStep, policy=ScoringPolicy(on_error="score", error_score=-1.0))
    failed = [e for g in groups for e in g.episodes if e.failed]
    assert failed and all("tool server down" in e.failed for e in failed)
    assert all(len([r for r, _ in e.turns if r == "assistant"]) == 2 for e in failed)
    _, groups = _play(pool, tok, FailsOnReset, policy=ScoringPolicy(on_error="score"))
    assert all(e.failed and len(e.turns) == 1 for g in groups for e in g.episodes)


def test_a_hanging_environment_times_out_under_the_policy(pool, tok):
    start = time.monotonic()
    _, groups = _play(pool, tok, HangsOnStep, prompts=2, policy=ScoringPolicy(timeout_s=0.2, on_error="score"))
    stepped = [e for g in groups for e in g.episodes if e.failed or len(e.turns) > 1]
    assert stepped and all(e.failed and "timed out after 0.2 s" in e.failed and len(e.turns) == 1 for e in stepped)
    assert time.monotonic() - start < 10


def test_a_step_that_returns_no_step_is_an_error(pool, tok):
    with pytest.raises(TypeError, match="must return a lit_parl.episodes.Step"):
        _play(pool, tok, ReturnsText, prompts=1)


def test_the_continuations_keep_the_iterations_version_and_sampling(pool, tok):
    _play(pool, tok, TurnTaker)
    assert len(pool.calls) >= 3
    for requests, sampling, _ in pool.calls:
        assert {r.version for r in requests} == {0}
        assert dataclasses.replace(sampling) == SAMPLING
    assert all(r.group_size == 1 for requests, _, _ in pool.calls[1:] for r in requests)


# -- chat templates -----------------------------------------------------------------------------------------------
CHAT = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}<eos>;{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)
CHAT_NO_END_TOKEN = CHAT.replace("<eos>;", ";")
# renders only the last assistant turn's content, as templates that drop past reasoning do
REWRITES_PAST = CHAT.replace(
    "{{ m['content'] }}", "{% if m['role'] != 'assistant' or loop.last %}{{ m['content'] }}{% endif %}"
)


def _chat_tokenizer(tok, template):
    tok = tok.__class__(tokenizer_object=tok.backend_tokenizer, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    tok.chat_template = template
    return tok


def test_a_chat_observation_is_the_templates_delta_with_the_turns_closing(tok):
    chat = _chat_tokenizer(tok, CHAT)
    messages = [{"role": "user", "content": "12="}, {"role": "assistant", "content": "12"}]
    turn = chat("12").input_ids + [chat.eos_token_id]  # ended by the end token: only ";" is the template's
    delta = ObservationTokens(chat, role="user").delta(messages, turn, "+")
    assert chat.decode(delta) == ";u:+<eos>;a:"
    prompt = chat.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    whole = chat(prompt, add_special_tokens=False).input_ids + turn + delta
    rendered = chat.apply_chat_template(
        [*messages, {"role": "user", "content": "+"}], tokenize=False, add_generation_prompt=True
    )
    assert whole == chat(rendered, add_special_tokens=False).input_ids
    plain = _chat_tokenizer(tok, CHAT_NO_END_TOKEN)
    assert plain.decode(ObservationTokens(plain).delta(messages, plain("12").input_ids, "+")) == ";u:+;a:"


def test_a_template_that_rewrites_earlier_turns_is_refused(tok):
    chat = _chat_tokenizer(tok, REWRITES_PAST)
    messages = [{"role": "user", "content": "12="}, {"role": "assistant", "content": "12"}]
    with pytest.raises(TemplateNotAppendOnly, match="append-only"):
        ObservationTokens(chat).delta(messages, chat("12").input_ids + [chat.eos_token_id], "+")


def test_chat_episodes_render_observations_through_the_template(pool, tok):
    chat = _chat_tokenizer(tok, CHAT)
    rows = [PromptRow(index=i, prompt=f"{i}{i}=") for i in range(2)]

    class Rows:
        num_rows = 2

        def row(self, i):
            return rows[i]

    format = PromptFormat(chat=True)
    drawn = PromptSchedule(Rows(), chat, group_size=2, prompt_format=format).draw([0, 1], version=0)
    runner = EpisodeRunner(EpisodeSettings(TurnTaker, max_episode_tokens=60), chat, prompt_format=format)
    groups = list(runner.generate(pool, [d.request for d in drawn.values()], SAMPLING, drawn))
    seen = 0
    for group in groups:
        for tokens, episode in zip(group.completions, group.episodes):
            if len(episode.turns) > 1:  # the first turn ended by a digit (a stop token): the whole closing is added
                first_turn = tokens[: episode.loss_mask.index(0)]
                closing = ";" if first_turn[-1] == chat.eos_token_id else "<eos>;"
                text = chat.decode([t for t, m in zip(tokens, episode.loss_mask) if not m])
                assert text.startswith(closing + "u:++<eos>;a:"), text
                seen += 1
    assert seen


class SwitchesVersionAfterTheFirstTurn:
    """A stand-in pool whose later turns come back sampled by version 1, as a worker that took newer weights
    mid-iteration would answer (every turn: "5" and the end token)."""

    def __init__(self, tok) -> None:
        self.turn, self.answer = 0, [tok.convert_tokens_to_ids("5"), tok.eos_token_id]

    def generate(self, requests, sampling):
        version, self.turn = min(self.turn, 1), self.turn + 1
        for r in requests:
            n = len(r.seeds)
            yield GroupCompletions(
                r.prompt_id, version, list(range(n)), [self.answer] * n, [[-1.0, -1.0]] * n, ["stop"] * n
            )


def test_an_episode_whose_turns_two_versions_sampled_is_refused_as_off_policy(tok):
    """Each turn's version is kept, not only the last: the episode's group is refused, never recorded as version 1."""
    drawn = PromptSchedule(CopyTask(seed=0), tok, group_size=2).draw([0], version=0)
    runner = EpisodeRunner(EpisodeSettings(Endless, max_turns=2, max_episode_tokens=16), tok)
    requests = [d.request for d in drawn.values()]
    with pytest.raises(OffPolicyError, match=r"the episodes of prompt 0 were sampled by policy versions \{0, 1\}"):
        list(runner.generate(SwitchesVersionAfterTheFirstTurn(tok), requests, SamplingParams(max_new_tokens=3), drawn))
