"""Pools for tests: one without worker processes (``InProcessPool``), and wrappers of a real pool that reorder,
delay, corrupt or hold back what it does (``WrappedPool`` and its subclasses)."""

from __future__ import annotations

import copy
import functools
import random
from collections.abc import Iterator

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lit_parl.rollout import HFRolloutPool, PoolSpec, RolloutPool
from lit_parl.rollout.records import GroupCompletions, GroupRequest, SamplingParams


class InProcessPool(RolloutPool):
    """A pool without worker processes: samples in the trainer's process from the synced weights.

    For tests of the data path, where the backend does not matter and a spawned worker's start-up (seconds)
    would dominate the fit. Each sample draws from its own seed, at the sampling temperature, and reports
    the full softmax's log-probs, as every backend does; top-k/top-p filtering is not implemented.
    """

    backend = "in-process"

    def _start(self, spec: PoolSpec) -> None:
        self.model = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(spec.model_dir), attn_implementation="sdpa"
        ).eval()
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
            raise ValueError(f"version {version} left parameters unloaded: {sorted(set(parameters) - loaded)[:5]}")
        self.held = version

    @torch.no_grad()
    def _generate(self, requests: list[GroupRequest], sampling: SamplingParams) -> Iterator[GroupCompletions]:
        if sampling.top_k or sampling.top_p < 1 or sampling.stop:
            raise NotImplementedError(
                "InProcessPool samples from the full softmax only (top_k=0, top_p=1, no stop strings)"
            )
        temperature = sampling.temperature or 1.0  # greedy: the argmax, log-probs of the plain softmax
        stops = (self.eos_id, *sampling.stop_token_ids)
        for request in requests:  # the group's samples side by side; each row draws from its own seed
            generators = [torch.Generator().manual_seed(seed) for seed in request.seeds]
            tokens = torch.tensor([request.prompt_tokens] * request.group_size)
            steps = []
            for _ in range(sampling.max_new_tokens):
                logp = (self.model(input_ids=tokens).logits[:, -1].float() / temperature).log_softmax(-1)
                if sampling.greedy:
                    drawn = logp.argmax(-1)
                else:
                    drawn = torch.cat(
                        [torch.multinomial(row.exp(), 1, generator=g) for row, g in zip(logp, generators)]
                    )
                steps.append((drawn.tolist(), logp.gather(-1, drawn[:, None])[:, 0].tolist()))
                tokens = torch.cat([tokens, drawn[:, None]], dim=1)
            completions, logprobs, reasons = [], [], []
            for k in range(request.group_size):
                drawn = [step[0][k] for step in steps]
                end = next((t + 1 for t, token in enumerate(drawn) if token in stops), len(drawn))
                completions.append(drawn[:end])
                logprobs.append([step[1][k] for step in steps[:end]])
                reasons.append("stop" if drawn[end - 1] in stops else "length")
            yield GroupCompletions(
                request.prompt_id, self.held, list(range(request.group_size)), completions, logprobs, reasons
            )

    def _worker_counts(self) -> tuple[int, int]:
        return (1, 1)

    def _close(self) -> None:
        self.model = None

    def logprob_tolerance(self) -> float:
        return 1e-5  # float32 on the trainer's own weights: measured ~1e-8 per token, so the on-policy check is tight


class WrappedPool(RolloutPool):
    """Delegates to a real pool; subclasses override ``transform`` to reorder, delay or corrupt groups."""

    backend = "wrapped"

    def __init__(self, inner: RolloutPool) -> None:
        super().__init__()
        self.inner = inner
        self.returned: list[GroupCompletions] = []

    def _start(self, spec) -> None:
        self.inner.start(spec)

    def _sync_weights(self, buckets, version: int) -> None:
        self.inner.sync_weights(buckets, version)

    def _generate(self, requests: list[GroupRequest], sampling: SamplingParams) -> Iterator[GroupCompletions]:
        for group in self.transform(self.inner.generate(requests, sampling)):
            self.returned.append(copy.deepcopy(group))
            yield group

    def transform(self, groups: Iterator[GroupCompletions]) -> Iterator[GroupCompletions]:
        yield from groups

    def _worker_counts(self) -> tuple[int, int]:
        health = self.inner.health()
        return health.workers, health.alive

    def _close(self) -> None:
        self.inner.close()

    def reserved_cpus(self, colocated: bool) -> int:
        return self.inner.reserved_cpus(colocated)

    def logprob_tolerance(self):
        return self.inner.logprob_tolerance()

    def _busy_intervals(self):
        return self.inner.busy_intervals()


class KeepsFirstWeights(WrappedPool):
    """Pushes the first sync's weights at every sync, under each new version: the labels are all correct, the
    weights stale (a sync that was not applied)."""

    first = None

    def _sync_weights(self, buckets, version):
        buckets = [[(name, tensor.detach().clone()) for name, tensor in bucket] for bucket in buckets]
        if self.first is None:
            self.first = buckets
        self.inner.sync_weights(self.first, version)


class ShufflingPool(WrappedPool):
    """Hands groups out in a different order than they finished (a pool where some groups are slow)."""

    def __init__(self, inner, seed: int = 0) -> None:
        super().__init__(inner)
        self.rng = random.Random(seed)

    def transform(self, groups):
        groups = list(groups)
        self.rng.shuffle(groups)
        yield from groups


class EnginePool(HFRolloutPool):
    """An hf pool whose workers build ``engine(model_dir, eos_id, pad_id, threads)`` instead of ``HFEngine``."""

    def __init__(self, engine, **kwargs) -> None:
        super().__init__(**kwargs)
        self.engine = engine

    def _engine(self, spec, threads):
        return functools.partial(self.engine, str(spec.model_dir), spec.eos_id, spec.pad_id, threads)


class Retokenizing(WrappedPool):
    """A continuation's context decoded to text and encoded again (special tokens dropped on the way): the
    engine continues another sequence than the one the trainer trains."""

    def _generate(self, requests, sampling):
        from lit_parl.models.char_tokenizer import build_char_tokenizer

        tok = build_char_tokenizer()
        again = [
            GroupRequest(
                r.prompt_id,
                tuple(tok(tok.decode(r.prompt_tokens, skip_special_tokens=True)).input_ids),
                r.version,
                r.seeds,
            )
            if r.group_size == 1
            else r
            for r in requests
        ]
        yield from self.inner._generate(again, sampling)
