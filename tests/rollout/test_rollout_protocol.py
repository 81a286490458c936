"""A fourth backend, written in this file from ``RolloutPool``'s docstrings alone, trains through the real
datamodule; and the protocol's base class holds every backend to the same checks."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from helpers.components import fit, make_components
from lit_parl.rollout import PoolHealth, PoolSpec, RolloutPool
from lit_parl.rollout.records import GroupCompletions, GroupRequest, SamplingParams


class FromDocstringsPool(RolloutPool):
    """Samples in the trainer's own process, one token at a time, with a model built from the spec."""

    backend = "in-process"

    def _start(self, spec: PoolSpec) -> None:
        self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(spec.model_dir)).eval()
        self.eos_id = spec.eos_id
        self.held: int | None = None

    def _sync_weights(self, buckets, version: int) -> None:
        parameters, loaded = dict(self.model.named_parameters()), set()
        with torch.no_grad():
            for bucket in buckets:
                for name, tensor in bucket:
                    parameters[name].copy_(tensor)  # copied: the buckets are not ours to keep
                    loaded.add(name)
        if loaded != set(parameters):
            raise ValueError(f"sync_weights left parameters unloaded: {sorted(set(parameters) - loaded)[:5]}")
        self.held = version

    @torch.no_grad()
    def _generate(self, requests: list[GroupRequest], sampling: SamplingParams):
        for request in requests:
            completions, logprobs, reasons = [], [], []
            for seed in request.seeds:
                generator = torch.Generator().manual_seed(seed)
                tokens, values = list(request.prompt_tokens), []
                for _ in range(sampling.max_new_tokens):
                    logits = self.model(input_ids=torch.tensor([tokens])).logits[0, -1].float() / sampling.temperature
                    logp = logits.log_softmax(-1)
                    token = int(torch.multinomial(logp.exp(), 1, generator=generator))
                    tokens.append(token)
                    values.append(float(logp[token]))
                    if token in (self.eos_id, *sampling.stop_token_ids):
                        break
                completion = tokens[len(request.prompt_tokens) :]
                completions.append(completion)
                logprobs.append(values)
                reasons.append("stop" if completion[-1] in (self.eos_id, *sampling.stop_token_ids) else "length")
            indices = list(range(request.group_size))
            yield GroupCompletions(request.prompt_id, self.held, indices, completions, logprobs, reasons)

    def _worker_counts(self) -> tuple[int, int]:
        return (1, 1)

    def _close(self) -> None:
        self.model = None


def test_a_backend_written_from_the_protocol_trains_on_policy():
    pool = FromDocstringsPool()
    module, data = make_components(pool=pool, prompts=4, group_size=4, micro_batch_size=8)
    initial = {k: v.clone() for k, v in module.policy.state_dict().items()}
    trainer = fit(module, data, iterations=2)
    assert [s.version for s in data.history] == [0, 1]
    assert [s.completions for s in data.history] == [16, 16]
    assert data.schedule.cursor == 8
    # the sampler's log-probs are θ_k's on the same tokens: the backend really generated with the synced weights
    assert float(trainer.callback_metrics["mismatch/logprob_abs_diff"]) < 1e-4
    trained = any(not torch.equal(initial[k], v) for k, v in module.policy.state_dict().items())
    assert trained, "training changed nothing"
    # closed by the datamodule
    assert pool.health() == PoolHealth("in-process", started=False, workers=0, alive=0, version=None)


class Misbehaving(FromDocstringsPool):
    """Returns what ``fault`` says instead of what was asked."""

    def __init__(self, fault: str) -> None:
        super().__init__()
        self.fault = fault

    def _generate(self, requests, sampling):
        groups = list(super()._generate(requests, sampling))
        if self.fault == "unrequested":
            groups[0].prompt_id = 999
        elif self.fault == "twice":
            groups.append(groups[0])
        elif self.fault == "missing":
            groups.pop()
        elif self.fault == "samples":
            groups[0].sample_indices = [0, 0]
        yield from groups


@pytest.fixture
def spec(tmp_path):
    module, data = make_components()
    module.policy.save_pretrained(tmp_path)
    tokenizer = data.tokenizer
    return PoolSpec(str(tmp_path), eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id), module.policy


def _requests(version: int) -> list[GroupRequest]:
    return [GroupRequest(prompt_id=i, prompt_tokens=(4, 5, 41), version=version, seeds=(1, 2)) for i in range(3)]


@pytest.mark.parametrize(
    "fault, message",
    [
        ("unrequested", "returned prompt_id 999, which was not requested or already returned"),
        ("twice", "returned prompt_id 0, which was not requested or already returned"),
        ("missing", r"ended its stream with prompts \[2\]"),
        ("samples", r"returned samples \[0, 0\] for prompt 0"),
    ],
)
def test_the_base_refuses_what_a_backend_should_not_return(spec, fault, message):
    model_spec, policy = spec
    pool = Misbehaving(fault)
    pool.start(model_spec)
    pool.sync_weights([list(policy.named_parameters())], version=0)
    with pytest.raises(RuntimeError, match=message):
        list(pool.generate(_requests(0), SamplingParams(max_new_tokens=2)))
    pool.close()


def test_the_base_owns_the_lifecycle_and_the_version(spec):
    model_spec, policy = spec
    pool = FromDocstringsPool()
    with pytest.raises(RuntimeError, match="is not started"):
        pool.sync_weights([], version=0)
    pool.start(model_spec)
    with pytest.raises(RuntimeError, match="start called twice"):
        pool.start(model_spec)
    assert pool.health() == PoolHealth("in-process", started=True, workers=1, alive=1, version=None)
    with pytest.raises(RuntimeError, match="no confirmed weights"):
        list(pool.generate(_requests(0), SamplingParams()))
    pool.sync_weights([list(policy.named_parameters())], version=0)
    assert pool.version == 0
    with pytest.raises(ValueError, match="unloaded"):  # a failed sync leaves no confirmed version
        pool.sync_weights([list(policy.named_parameters())[:1]], version=1)
    assert pool.version is None
    pool.sync_weights([list(policy.named_parameters())], version=3)
    assert pool.version == 3 and pool.health().version == 3
    with pytest.raises(AttributeError):
        pool.version = 4  # read-only: only a confirmed sync sets it
    with pytest.raises(RuntimeError, match=r"requests for policy version\(s\) \[2\] reached a pool holding version 3"):
        list(pool.generate(_requests(2), SamplingParams()))
    pool.close()
    with pytest.raises(RuntimeError, match="was closed"):
        list(pool.generate(_requests(3), SamplingParams()))
    assert pool.health().started is False
