"""Each objective option as ``GRPOModule.training_step`` uses it, checked against a plain reference.

A real fit (tiny model, the ``hf`` pool, plain SGD, no clipping) records every micro-batch the module
trains on and the policy's weights at the start of each iteration. The reference then redoes the same
optimizer steps at the same mini-batch boundaries from a copy of the initial policy, written out the
long way: one unpacked forward per sample, the loss per token from the formulas (clipped ratio, the
truncated importance weight, the KL estimators, the entropy of softmax(logits / T), the aggregation
and its normaliser over the whole mini-batch), group advantages from the rewards. It calls neither
``lit_parl.trainer.grpo_objective`` nor ``lit_parl.kernels``, so the comparison is not equal by construction.

Tolerance: atol 1e-6, rtol 1e-5 on every parameter. Packed and per-sample float32 forwards differ
only in summation order: about 1e-7 on the weights after two iterations at ``LR`` (measured). At that
rate each wiring mistake listed in docs/testing.md moves some weight by 3e-3 or more (measured by
mutation), three orders above the tolerance. A larger rate buys nothing: at lr 1 the rounding grows to
4e-6 within two iterations of several steps each.
"""

from __future__ import annotations

import copy
import functools
import random

import torch
from lightning.pytorch import Callback

from helpers.components import SAMPLING, fit, make_components, policy_state
from helpers.pools import WrappedPool
from lit_parl import GRPOObjective
from lit_parl.rollout import HFRolloutPool
from lit_parl.tasks import CopyTask

ATOL, RTOL = 1e-6, 1e-5
LR = 0.3
EPS = 1e-6  # the group std's epsilon (GRPOObjective's default)


def dense_reward(completion: list[int]) -> float:
    """A fixed function of the completion in [0, 1): no group has all-equal rewards (a copy task's reward
    is 0 for most of a random model's completions, which would leave most advantages 0)."""
    return random.Random(str(list(completion))).random()


class DenseTask(CopyTask):
    """CopyTask's prompts, ``dense_reward``'s rewards."""

    def reward(self, answer_ids, completion_ids, eos_id) -> float:
        return dense_reward(completion_ids)


class RecordingPool(WrappedPool):
    """Records the prompts asked for and the groups handed out; optionally shifts the rollout log-probs
    (-0.3 on even token positions, +0.2 on odd ones) so the engine's distribution differs from θ_k's."""

    def __init__(self, inner, perturb: bool = False) -> None:
        super().__init__(inner)
        self.perturb = perturb
        self.prompts: dict[int, list[int]] = {}

    def _generate(self, requests, sampling):
        self.prompts.update({r.prompt_id: list(r.prompt_tokens) for r in requests})
        yield from super()._generate(requests, sampling)

    def transform(self, groups):
        for group in groups:
            if self.perturb:
                group.logprobs = [
                    [lp + (-0.3 if t % 2 == 0 else 0.2) for t, lp in enumerate(row)] for row in group.logprobs
                ]
            yield group


class MicroBatchRecorder(Callback):
    """Every micro-batch trained on (its samples, whether a step follows) and the weights at each iteration start."""

    def __init__(self) -> None:
        self.batches: list[tuple[int, list[tuple[int, int]], bool]] = []  # (iteration, samples, ends_step)
        self.starts: list[dict[str, torch.Tensor]] = []

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self.starts.append(policy_state(pl_module))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batches.append(
            (trainer.current_epoch, list(zip(batch.prompt_ids, batch.sample_indices)), bool(batch.ends_step))
        )


# -- the reference -------------------------------------------------------------------------------------
def sample_logprobs(model, prompt: list[int], completion: list[int], temperature: float, entropy: bool = False):
    """log π(c_t | p, c_<t) for every completion token, one unpacked forward; and the entropy of each step's softmax."""
    ids = torch.tensor([prompt + completion[:-1]])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 :].float() / temperature
    logp_all = torch.log_softmax(logits, -1)
    logp = logp_all.gather(-1, torch.tensor(completion)[:, None])[:, 0]
    if not entropy:
        return logp
    return logp, -(logp_all.exp() * logp_all).sum(-1)


def kl(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    d = logp - ref_logp
    return {"k1": d, "k2": 0.5 * d**2, "k3": torch.exp(-d) + d - 1}[estimator]


def group_advantages(rewards: torch.Tensor) -> torch.Tensor:
    rewards = rewards.double()
    if bool((rewards == rewards[0]).all()):
        return torch.zeros_like(rewards)
    return (rewards - rewards.mean()) / (rewards.std() + EPS)


def reference_fit(
    initial,
    pool: RecordingPool,
    recorder: MicroBatchRecorder,
    options: dict,
    lr: float,
    temperature: float,
    max_grad_norm: float | None = None,
    norms: list | None = None,
):
    """The weights at the start of each iteration and at the end, training on the recorded micro-batches; with
    ``max_grad_norm``, each step's gradient (of the mini-batch's mean loss) scaled to at most that global norm,
    and its norm before clipping appended to ``norms``."""
    eps_low = options.get("clip_eps", 0.2)
    eps_high = options.get("clip_eps_high") or eps_low
    beta, estimator = options.get("beta", 0.0), options.get("kl_estimator", "k3")
    kl_in_reward, entropy_coef, cap = (
        options.get("kl_in_reward", False),
        options.get("entropy_coef", 0.0),
        options.get("tis_cap"),
    )
    aggregation = options.get("loss_aggregation", "seq-mean-token-mean")
    assert aggregation in ("token-mean", "seq-mean-token-mean"), f"the reference does not implement {aggregation}"
    groups = {g.prompt_id: g for g in pool.returned}
    policy = copy.deepcopy(initial).train()
    reference = copy.deepcopy(initial).eval()
    states = []
    for iteration in sorted({it for it, _, _ in recorder.batches}):
        states.append({k: v.detach().clone() for k, v in policy.state_dict().items()})
        theta_k = copy.deepcopy(policy).eval()
        batches = [(samples, ends) for it, samples, ends in recorder.batches if it == iteration]
        prompt_ids = sorted({p for samples, _ in batches for p, _ in samples})
        data, old, ref = {}, {}, {}
        with torch.no_grad():
            for p in prompt_ids:
                group = groups[p]
                for k, completion in zip(group.sample_indices, group.completions):
                    data[p, k] = (
                        pool.prompts[p],
                        completion,
                        torch.tensor(group.logprobs[group.sample_indices.index(k)]),
                    )
                    old[p, k] = sample_logprobs(theta_k, pool.prompts[p], completion, temperature)
                    if beta > 0:
                        ref[p, k] = sample_logprobs(reference, pool.prompts[p], completion, temperature)
        advantages = {}
        for p in prompt_ids:
            keys = [(p, k) for k in groups[p].sample_indices]
            rewards = torch.tensor([dense_reward(data[key][1]) for key in keys], dtype=torch.float64)
            if kl_in_reward:  # r - β Σ_t KL_t(θ_k || reference), then the group's advantages
                rewards = rewards - beta * torch.stack(
                    [kl(old[key], ref[key], estimator).sum().double() for key in keys]
                )
            advantages.update(zip(keys, group_advantages(rewards).tolist()))

        total, normaliser = 0.0, 0.0
        for samples, ends_step in batches:
            for key in samples:
                prompt, completion, rollout = data[key]
                logp, entropy = sample_logprobs(policy, prompt, completion, temperature, entropy=True)
                ratio = torch.exp(logp - old[key])
                adv = advantages[key]
                per_token = -torch.minimum(ratio * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv)
                if cap is not None:
                    per_token = per_token * torch.exp(old[key] - rollout).clamp(max=cap)
                if beta > 0 and not kl_in_reward:
                    per_token = per_token + beta * kl(logp, ref[key], estimator)
                if entropy_coef > 0:
                    per_token = per_token - entropy_coef * entropy
                if aggregation == "token-mean":
                    total, normaliser = total + per_token.sum(), normaliser + len(completion)
                else:  # seq-mean-token-mean
                    total, normaliser = total + per_token.mean(), normaliser + 1
            if ends_step:  # one plain SGD step on the mini-batch's mean loss
                policy.zero_grad(set_to_none=True)
                (total / normaliser).backward()
                with torch.no_grad():
                    grads = [parameter.grad for parameter in policy.parameters() if parameter.grad is not None]
                    if max_grad_norm is not None:  # torch's rule: scale by max / (norm + 1e-6) when that is below 1
                        norm = float(torch.sqrt(sum((grad.double() ** 2).sum() for grad in grads)))
                        norms.append(norm)
                        for grad in grads:
                            grad.mul_(min(1.0, max_grad_norm / (norm + 1e-6)))
                    for parameter in policy.parameters():
                        if parameter.grad is not None:
                            parameter.add_(parameter.grad, alpha=-lr)
                total, normaliser = 0.0, 0.0
    states.append({k: v.detach().clone() for k, v in policy.state_dict().items()})
    return states


# -- running both ------------------------------------------------------------------------------------
def check_against_reference(
    options: dict,
    lr: float = LR,
    iterations: int = 2,
    perturb: bool = False,
    max_grad_norm: float | None = None,
    norms: list | None = None,
    **shape,
):
    pool = RecordingPool(
        HFRolloutPool(num_workers=1, threads_per_worker=1, prompts_per_request=2, colocated_threads=1), perturb
    )
    module, datamodule = make_components(
        pool=pool,
        task=DenseTask(seed=0),
        objective=GRPOObjective(**options),
        max_grad_norm=max_grad_norm,
        optimizer=functools.partial(torch.optim.SGD, lr=lr),
        **shape,
    )
    if perturb:
        datamodule.logprob_tolerance = None  # the shifted log-probs are deliberate: no on-policy check
    initial = copy.deepcopy(module.policy)
    recorder = MicroBatchRecorder()
    fit(module, datamodule, iterations, callbacks=[recorder])
    got = [*recorder.starts, policy_state(module)]
    expected = reference_fit(initial, pool, recorder, options, lr, SAMPLING.temperature, max_grad_norm, norms)
    assert len(got) == len(expected) == iterations + 1
    moved = max(float((a - b).abs().max()) for a, b in zip(expected[-1].values(), expected[0].values()))
    assert moved > 1e-3, f"the reference barely moved the weights ({moved:.2g}): the comparison would prove nothing"
    for iteration, (a, b) in enumerate(zip(got, expected)):
        for name in b:
            torch.testing.assert_close(
                a[name], b[name], atol=ATOL, rtol=RTOL, msg=lambda m: f"after {iteration} iteration(s), {name}: {m}"
            )
    return recorder


def steps_and_sizes(recorder: MicroBatchRecorder) -> tuple[int, set[int]]:
    """Optimizer steps taken and the micro-batch sizes seen: what the test claims to exercise."""
    return sum(ends for _, _, ends in recorder.batches), {len(samples) for _, samples, _ in recorder.batches}


def test_importance_weights_and_entropy_bonus():
    """TIS weights min(π_old / π_rollout, cap) from the engine's log-probs (not θ_k's: that is weight 1), and the
    entropy bonus subtracted (not added) per token."""
    check_against_reference({"tis_cap": 1.2, "entropy_coef": 0.1}, perturb=True)


def test_kl_in_the_loss_and_several_steps_per_iteration():
    """β·KL(policy || reference) in the loss, once, against θ_0; with two mini-batches and two passes the ratio
    is taken against the θ_k snapshot, not against the half-updated policy."""
    options = {"beta": 0.5, "kl_estimator": "k3", "loss_aggregation": "token-mean", "clip_eps": 0.05}
    recorder = check_against_reference(options, mini_batches=2, passes=2, micro_batch_size=4)
    # 2 iterations x 2 passes x 2 mini-batches, each of four micro-batches: the normaliser spans micro-batches
    assert steps_and_sizes(recorder) == (8, {4}) and len(recorder.batches) == 32


def test_kl_in_the_reward_comes_from_theta_k_group_by_group():
    """Advantages from r - β·Σ_t KL_t(θ_k || reference), normalised within each group (two groups per micro-batch)."""
    options = {"beta": 0.5, "kl_in_reward": True, "kl_estimator": "k1"}
    recorder = check_against_reference(options, prompts=8, mini_batches=2, micro_batch_size=8)
    assert steps_and_sizes(recorder) == (4, {8})
    assert all(len({p for p, _ in samples}) == 2 for _, samples, _ in recorder.batches)  # two whole groups each


def test_clipping_acts_on_the_normalised_gradient():
    """The global norm is clipped after the gradient is divided by the mini-batch's normaliser (token-mean over
    four micro-batches here): clipping the un-normalised sum would shrink every update by up to the normaliser.
    The limit lies between the steps' norms, so some steps are clipped and some are not."""
    norms: list[float] = []
    options = {"loss_aggregation": "token-mean"}
    check_against_reference(options, max_grad_norm=1.2, norms=norms, mini_batches=2, micro_batch_size=4)
    assert len(norms) == 4 and min(norms) < 1.2 < max(norms), norms
