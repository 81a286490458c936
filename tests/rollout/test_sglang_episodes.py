"""Multi-turn episodes over the SGLang pool (two stand-in servers, no router): continuations are ordinary
``/generate`` requests carrying the episode's tokens as sampled, each turn of an episode goes to the server of its
previous turn (its prefix is cached there), and the turns of different episodes still spread over both servers."""

from __future__ import annotations

import json

from helpers.episode_envs import DIGIT_STOPS, TurnTaker
from helpers.sglang_pools import attached, buckets, launch_standin
from lit_parl.data.prompt_schedule import PromptSchedule
from lit_parl.episodes import EpisodeRunner, EpisodeSettings
from lit_parl.episodes.episode import turn_seed
from lit_parl.models.char_tokenizer import build_char_tokenizer
from lit_parl.rollout.records import SamplingParams
from lit_parl.rollout.sglang.servers import Server, ServerFleet
from lit_parl.tasks import CopyTask


def test_an_episodes_turns_stay_on_one_server_and_episodes_spread_over_both(saved_model, tmp_path):
    model, spec, model_dir = saved_model
    journal = tmp_path / "journal"
    launched = [launch_standin(model_dir, "--journal", str(journal)) for _ in range(2)]
    pool = attached([url for _, url in launched])
    try:
        pool.start(spec)
        pool.sync_weights(buckets(model), version=0)
        tok = build_char_tokenizer()
        drawn = PromptSchedule(CopyTask(seed=0), tok, group_size=4).draw(list(range(6)), version=0)
        runner = EpisodeRunner(EpisodeSettings(TurnTaker, max_turns=4, max_episode_tokens=40), tok)
        sampling = SamplingParams(max_new_tokens=6, stop_token_ids=DIGIT_STOPS)
        groups = list(runner.generate(pool, [d.request for d in drawn.values()], sampling, drawn))
    finally:
        pool.close()
        for process, _ in launched:
            process.kill()
            process.wait()
    events = [json.loads(line) for line in journal.read_text().splitlines()]
    served = [e for e in events if e["event"] == "generate"]
    ports_of, turns = {}, 0
    for group in groups:
        request = drawn[group.prompt_id].request
        for sample, tokens, episode in zip(group.sample_indices, group.completions, group.episodes):
            whole = list(request.prompt_tokens) + tokens
            seeds = {turn_seed(request.seeds[sample], t) for t in range(4)}
            mine = [e for e in served if whole[: len(e["prompt"])] == e["prompt"] and e["seeds"][0] in seeds]
            model_turns = sum(1 for role, _ in episode.turns if role == "assistant")
            assert len(mine) == model_turns, (group.prompt_id, sample)
            ports_of[(group.prompt_id, sample)] = {e["port"] for e in mine}
            turns += model_turns
    assert turns > len(ports_of), "no episode had a second turn"
    assert all(len(ports) == 1 for ports in ports_of.values()), "an episode's turns went to two servers"
    assert len({p for ports in ports_of.values() for p in ports}) == 2, "the episodes did not spread over both"


def test_a_turn_goes_to_its_episodes_server_while_it_is_up_and_elsewhere_once_it_is_down():
    fleet = ServerFleet("/tmp")
    fleet.servers = [Server(url="http://a"), Server(url="http://b")]
    fleet.servers[0].in_flight = 5  # a is busier: a new episode goes to b
    assert fleet.pick((0, 1, 0)).url == "http://b"
    fleet.episodes[(0, 1, 0)] = "http://a"
    assert fleet.pick((0, 1, 0)).url == "http://a"
    fleet.servers[0].alive = False
    assert fleet.pick((0, 1, 0)).url == "http://b"
