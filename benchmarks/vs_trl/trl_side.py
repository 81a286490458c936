"""The TRL side of ``benchmarks/vs_trl/vs_trl.py``: Hugging Face TRL's ``GRPOTrainer``
on lit_parl's tiny model and task.

Runs in ``.venv-trl`` (``benchmarks/vs_trl/setup_trl_env.sh``), one synchronous process: generate a batch, score it,
train on it. ``vs_trl.py`` starts it as a subprocess; it can also be run by hand::

    .venv-trl/bin/python benchmarks/vs_trl/trl_side.py --model-dir /tmp/tiny --steps 20 --out /tmp/trl.json

The settings mirror lit_parl's default job (``conf/``), and each choice is commented where it is made.
``--batch-size`` and ``--grad-accum`` set how TRL trains a step's 256 completions: ``256 x 1`` (one batch,
the default) or ``64 x 4`` (four accumulated micro-batches). Both generate the same 256 completions per
step in one ``model.generate`` call and take one optimizer step on the same objective. Which is faster
depends on the model and the machine; ``vs_trl.py`` runs both.
The reward function is lit_parl's ``positional_reward`` on the completion's token ids (TRL cuts each
completion after its first end token, end token included, which is what lit_parl's reward expects); with
``--task math``, lit_parl's ``math_reward`` (its last-number fallback on) on the completion's text.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

_T0 = time.monotonic()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", required=True, help="a save_pretrained directory (model + tokenizer)")
    p.add_argument("--task", choices=("copy", "preamble", "reverse", "math"), default="copy")
    p.add_argument(
        "--data-file",
        default=None,
        help="--task math: a JSONL of question/answer rows (conf/data/gsm8k_format.yaml's columns), drawn in the "
        "order lit_parl's PromptSchedule draws them at --seed, scored by lit_parl's math_reward on the text "
        "(its last-number fallback on)",
    )
    p.add_argument(
        "--system-prompt",
        default=None,
        help="every prompt through the tokenizer's chat template with this system turn (lit_parl's PromptFormat "
        "renders the text, as datamodule.prompt_format.chat=true does)",
    )
    p.add_argument("--preamble-chars", type=int, default=200)
    p.add_argument("--steps", type=int, required=True, help="optimizer steps (= lit_parl iterations)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompts-per-step", type=int, default=32)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument(
        "--batch-size",
        type=int,
        default=256,
        help="per_device_train_batch_size: completions per forward/backward (256: the whole step in one batch)",
    )
    p.add_argument(
        "--grad-accum",
        type=int,
        default=1,
        help="gradient_accumulation_steps; batch-size x grad-accum must be prompts-per-step x group-size",
    )
    p.add_argument("--max-new-tokens", type=int, default=6)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--beta", type=float, default=0.0)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", required=True, help="JSON result path")
    args = p.parse_args(argv)
    if (args.task == "math") != (args.data_file is not None):
        p.error("--data-file goes with --task math, and --task math needs it")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)  # the same 2-core budget lit_parl's pool + trainer share
    import datasets
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from lit_parl.prompts.prompt_format import PromptFormat
    from lit_parl.prompts.prompt_row import PromptRow
    from lit_parl.tasks import CopyTask, ReverseTask, positional_reward

    if args.task == "math":
        task = None  # rows from --data-file, below
    elif args.task == "copy":
        task = CopyTask(min_digits=2, max_digits=4, seed=args.seed)  # conf/task/copy.yaml
    elif args.task == "reverse":
        task = ReverseTask(min_digits=2, max_digits=4, seed=args.seed)  # conf/data/reverse.yaml
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from vs_trl_task import PreambleCopyTask

        task = PreambleCopyTask(min_digits=2, max_digits=4, seed=args.seed, preamble_chars=args.preamble_chars)

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32, attn_implementation="sdpa")
    eos_id = tokenizer.eos_token_id
    # where TRL's time goes: its generation is model.generate on this object (no wrapper on one CPU process)
    generate_s = [0.0]
    plain_generate = model.generate

    def timed_generate(*generate_args, **generate_kwargs):
        begin = time.monotonic()
        try:
            return plain_generate(*generate_args, **generate_kwargs)
        finally:
            generate_s[0] += time.monotonic() - begin

    model.generate = timed_generate

    # lit_parl's iteration k trains prompts k*N .. k*N+N-1 of the task, in order: same here (no shuffle)
    n_prompts = args.steps * args.prompts_per_step
    if task is None:  # lit_parl's data path: its dataset rows, in its order for this seed, rendered as it renders
        from lit_parl.data.prompt_schedule import PromptSchedule
        from lit_parl.prompts.dataset_prompts import DatasetPrompts

        rows = DatasetPrompts(path=args.data_file, prompt_column="question", answer_column="answer")
        chat = PromptFormat(chat=True, system_prompt=args.system_prompt)
        drawn = PromptSchedule(rows, tokenizer, args.group_size, args.seed, chat).draw(list(range(n_prompts)), 0)
        made = [(drawn[i].text, drawn[i].row.answer) for i in range(n_prompts)]
    else:
        made = [task.make(i) for i in range(n_prompts)]
    if task is not None and args.system_prompt is not None:  # the chat-rendered text lit_parl's pool gets
        chat = PromptFormat(chat=True, system_prompt=args.system_prompt)
        made = [(chat.render(PromptRow(index=i, prompt=p), tokenizer), a) for i, (p, a) in enumerate(made)]
    dataset = datasets.Dataset.from_dict({"prompt": [p for p, _ in made], "answer": [a for _, a in made]})
    # TRL tokenizes plain-text prompts with processing_class(text=...): check it gives lit_parl's ids
    probe = made[0][0]
    assert tokenizer(text=[probe])["input_ids"][0] == tokenizer(probe, add_special_tokens=False).input_ids, (
        "special tokens added"
    )

    record = {"rewards": [], "completions": 0, "tokens": 0, "reward_calls": 0}
    answer_cache: dict[str, list[int]] = {}

    def copy_reward(prompts, completions, completion_ids, answer, **kwargs):
        """lit_parl.tasks.positional_reward on token ids (answer + end token), as lit_parl's workers score."""
        rewards = []
        for ids, text in zip(completion_ids, answer):
            target = answer_cache.get(text)
            if target is None:
                target = answer_cache[text] = tokenizer(text, add_special_tokens=False).input_ids
            rewards.append(positional_reward(target, ids, eos_id))
        record["rewards"].append(sum(rewards) / len(rewards))  # one call per generation batch = one step
        record["completions"] += len(rewards)
        record["tokens"] += sum(len(ids) for ids in completion_ids)
        record["reward_calls"] += 1
        return rewards

    def sum_reward(prompts, completions, answer, **kwargs):
        """lit_parl.rewards.math_answers.math_reward (last-number fallback on) on the decoded completion."""
        from lit_parl.rewards.math_answers import math_reward

        rewards = [math_reward(text, gold, fallback_last_number=True) for text, gold in zip(completions, answer)]
        record["rewards"].append(sum(rewards) / len(rewards))
        record["completions"] += len(rewards)
        record["tokens"] += sum(len(ids) for ids in kwargs["completion_ids"])
        record["reward_calls"] += 1
        return rewards

    step_times: list[float] = []

    every = max(1, args.steps // 10)

    class StepClock(TrainerCallback):
        def on_step_end(self, targs, state, control, **kwargs):
            step_times.append(time.monotonic())
            if state.global_step % every == 0:  # progress in the log: step, seconds, reward of the step
                print(
                    f"trl_side: step {state.global_step}/{args.steps} at {step_times[-1] - start:.1f} s, "
                    f"reward {record['rewards'][-1]:.3f}",
                    flush=True,
                )

    samples_per_step = args.prompts_per_step * args.group_size
    if args.batch_size * args.grad_accum != samples_per_step:
        raise SystemExit(f"--batch-size {args.batch_size} x --grad-accum {args.grad_accum} must be {samples_per_step}")
    output_dir = tempfile.mkdtemp(prefix="trl_side_")
    config = GRPOConfig(
        output_dir=output_dir,
        seed=args.seed,
        data_seed=args.seed,
        # one optimizer step = prompts_per_step x G completions (lit_parl: 32 x 8 = 256 per iteration), trained
        # as grad_accum batches of batch_size: 256x1 (one batch) or 64x4 (4 accumulated micro-batches).
        # steps_per_generation = grad_accum (TRL's default, spelled out) makes the generation batch
        # batch_size x grad_accum = 256: one model.generate call of 256 rows per optimizer step in both layouts,
        # and since grad_accum % steps_per_generation == 0 TRL skips the old-log-prob forward (on-policy).
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        steps_per_generation=args.grad_accum,
        num_generations=args.group_size,
        max_steps=args.steps,
        num_iterations=1,  # one pass: on-policy, old log-probs = current (TRL skips their forward)
        shuffle_dataset=False,
        # sampling: lit_parl conf/config.yaml (sampling)
        max_completion_length=args.max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        use_vllm=False,
        # objective: conf/algorithm/grpo.yaml (clip 0.2/0.2, group std scaling, seq-mean-token-mean)
        beta=args.beta,
        epsilon=0.2,
        # per-sequence token mean, mean over the batch's sequences, divided by grad_accum: with equal batches this
        # is the mean over all 256 sequences in both layouts == lit_parl's seq-mean-token-mean
        loss_type="grpo",
        scale_rewards="group",
        mask_truncated_completions=False,
        # optimizer: lit_parl's AdamW(lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0), clip 1.0, no schedule
        learning_rate=args.lr,
        optim="adamw_torch",
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        weight_decay=0.0,
        max_grad_norm=args.max_grad_norm,
        lr_scheduler_type="constant",
        warmup_steps=0,
        # numerics and machine: fp32 on the CPU, no checkpointing, nothing logged or saved
        bf16=False,
        fp16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        dataloader_num_workers=0,
        report_to="none",
        logging_steps=max(args.steps, 1),
        disable_tqdm=True,
        save_strategy="no",
        log_completions=False,
    )
    if config.generation_batch_size != samples_per_step or config.steps_per_generation != args.grad_accum:
        raise RuntimeError(
            f"TRL derived generation_batch_size {config.generation_batch_size}, steps_per_generation "
            f"{config.steps_per_generation}; expected {samples_per_step}, {args.grad_accum}"
        )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=sum_reward if task is None else copy_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepClock()],
    )
    setup_s = time.monotonic() - _T0
    start = time.monotonic()  # read by StepClock
    trainer.train()
    wall = time.monotonic() - start
    shutil.rmtree(output_dir, ignore_errors=True)  # save_strategy="no": nothing of TRL's is kept there
    rewards = record["rewards"]
    if len(rewards) != args.steps or record["completions"] != args.steps * samples_per_step:
        raise RuntimeError(
            f"expected {args.steps} generation batches of {samples_per_step}, "
            f"got {len(rewards)} / {record['completions']}"
        )
    result = {
        "side": "trl",
        "trl_config": f"{args.batch_size}x{args.grad_accum}",
        "steps": args.steps,
        "completions": record["completions"],
        "completion_tokens": record["tokens"],
        "wall_s": round(wall, 3),
        "setup_s": round(setup_s, 3),
        "completions_per_s": round(record["completions"] / wall, 2),
        "generate_s": round(generate_s[0], 3),
        "tokens_per_s": round(record["tokens"] / wall, 2),
        "rewards": rewards,
        "step_end_s": [round(t - start, 4) for t in step_times],
        "threads": torch.get_num_threads(),
        "versions": {
            "trl": trl.__version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "datasets": datasets.__version__,
        },
        "config": {
            k: getattr(config, k)
            for k in (
                "per_device_train_batch_size",
                "gradient_accumulation_steps",
                "generation_batch_size",
                "steps_per_generation",
                "num_generations",
                "num_iterations",
                "max_completion_length",
                "temperature",
                "top_p",
                "top_k",
                "beta",
                "epsilon",
                "epsilon_high",
                "loss_type",
                "scale_rewards",
                "learning_rate",
                "optim",
                "lr_scheduler_type",
                "max_grad_norm",
                "weight_decay",
                "bf16",
                "gradient_checkpointing",
                "use_vllm",
                "shuffle_dataset",
            )
        },
    }
    result["config"]["optim"] = str(result["config"]["optim"])
    result["config"]["lr_scheduler_type"] = str(result["config"]["lr_scheduler_type"])
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(
        "trl_side summary: "
        f"{json.dumps({k: v for k, v in result.items() if k not in ('rewards', 'step_end_s', 'config')})}",
        flush=True,
    )
    return result


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
