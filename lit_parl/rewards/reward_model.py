"""RewardModel: a learned reward, a Hugging Face sequence-classification model read from a local directory.

Each sample is scored as the reward model was trained to read it: the whole exchange (``conversation``: the row's
messages or its raw prompt, then the sample's turns, an episode's every turn) through the **reward model's own**
chat template, tokenized by its own tokenizer (the policy's may differ); a reward model without a chat template
reads the prompt as the policy saw it followed by the turns' text. Its score is the model's single logit.

Samples are scored in batches across groups as they arrive (``lit_parl.rewards.score_batcher.ScoreBatcher``: at
most ``batch_size``, waiting at most ``max_wait_s`` for more), on a thread of the model's own and on its own
``device``, so neither the trainer's thread nor the rewards' event loop waits on a forward. The scorer keeps
``concurrent_groups`` groups in flight for it (``datamodule.score_workers: null``), which is what lets a batch
hold several groups. Failures and timeouts follow the run's scoring policy like any reward's.

A padded batch gives each sample the score it has alone to float rounding (about 1e-7 relative in float32; the
tests hold it), not bit for bit: which samples share a batch depends on arrival, so two runs of one seed can
differ in a reward's last bits.

``normalize``: ``None`` (the raw logit), ``"group"`` (minus the group's mean, over its std: what GRPO's advantage
does anyway, useful beside other rewards or with Dr. GRPO) or ``"running"`` (minus the mean, over the std, of every
score so far in this process, the group's own included; kept in checkpoints; the order groups arrive in
changes it slightly).

Example (a tiny reward model written here; a real one is any ``AutoModelForSequenceClassification`` directory)::

    >>> import tempfile
    >>> from transformers import Qwen2Config, Qwen2ForSequenceClassification
    >>> from lit_parl.models.char_tokenizer import build_char_tokenizer
    >>> tokenizer = build_char_tokenizer()
    >>> config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
    ...     num_attention_heads=2, num_key_value_heads=2, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    >>> folder = tempfile.TemporaryDirectory()
    >>> path = folder.name
    >>> Qwen2ForSequenceClassification(config).save_pretrained(path)
    >>> _ = tokenizer.save_pretrained(path)
    >>> reward = RewardModel(path, batch_size=4)
    >>> scores = reward.score_texts(["12=", "12=21"])
    >>> len(scores), all(isinstance(s, float) for s in scores)
    (2, True)
    >>> reward.close(); folder.cleanup()
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch

from lit_parl.rewards.reward import Reward
from lit_parl.rewards.score_batcher import ScoreBatcher

NORMALIZATIONS = (None, "group", "running")


class RewardModel(Reward):
    """A sequence-classification reward model as a reward (batched, async, on its own thread and device).

    Args:
        path: a local directory with the model (``config.json``, weights) and its tokenizer.
        name: the metric name (``reward/<name>``).
        weight: its factor in the total reward.
        batch_size: the most samples in one forward (across groups).
        max_wait_s: how long a waiting sample may wait for others to fill its batch.
        device: where the reward model runs (``cpu``, ``cuda:1``, ...): a device of its own keeps it off the
            trainer's.
        dtype: the reward model's dtype (``float32``, ``bfloat16``, ``float16``).
        max_length: the most tokens of an exchange it reads; a longer one keeps its last ``max_length`` tokens
            (the completion's end, where the verdict is). ``None``: the model's context.
        normalize: ``None``, ``"group"`` or ``"running"`` (see above).
        chat_template: a Jinja chat template to use instead of the tokenizer's own.
        concurrent_groups: groups the scorer keeps in flight for it (their samples share batches).
    """

    def __init__(
        self,
        path: str,
        name: str = "reward_model",
        weight: float = 1.0,
        batch_size: int = 32,
        max_wait_s: float = 0.05,
        device: str = "cpu",
        dtype: str = "float32",
        max_length: int | None = None,
        normalize: str | None = None,
        chat_template: str | None = None,
        concurrent_groups: int = 4,
    ) -> None:
        from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

        if normalize not in NORMALIZATIONS:
            raise ValueError(f"RewardModel(normalize={normalize!r}): choose one of {NORMALIZATIONS}")
        if concurrent_groups < 1:
            raise ValueError(f"RewardModel(concurrent_groups={concurrent_groups}) must be >= 1")
        directory = Path(path).expanduser()
        if not (directory / "config.json").is_file():
            raise FileNotFoundError(
                f"RewardModel(path={path!r}): no config.json there; give the directory a sequence-classification "
                "model was saved to (model.save_pretrained(dir) and tokenizer.save_pretrained(dir))"
            )
        self.path = str(directory)
        labels = AutoConfig.from_pretrained(self.path).num_labels
        if labels != 1:
            raise ValueError(
                f"RewardModel(path={path!r}): the model has {labels} labels; a reward model has one (its logit is "
                "the score): save it with num_labels=1"
            )
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.model = AutoModelForSequenceClassification.from_pretrained(self.path, dtype=getattr(torch, dtype))
        if self.tokenizer.pad_token_id is None:  # a batch is padded; the model finds each row's last real token
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.tokenizer.padding_side = "right"
        self.tokenizer.truncation_side = "left"  # keep the completion's end
        self.chat_template = chat_template or self.tokenizer.chat_template
        self.device = torch.device(device)
        self.model.to(self.device).eval()
        self.max_length = max_length
        self.normalize = normalize
        self.concurrent_groups = concurrent_groups
        self._count, self._mean, self._m2 = 0, 0.0, 0.0  # the running normalisation's statistics (Welford)
        self.batcher = ScoreBatcher(self.score_texts, batch_size, max_wait_s, thread_name="lit_parl-reward-model")
        super().__init__(self.score, name=name, weight=weight, batched=True)

    def text(self, prompt: str, conversation: list[dict]) -> str:
        """The text the reward model reads for one sample."""
        if self.chat_template is None:  # the prompt as the policy saw it, then every turn's text
            return prompt + "".join(turn["content"] for turn in conversation[self._prompt_turns(conversation) :])
        return self.tokenizer.apply_chat_template(conversation, chat_template=self.chat_template, tokenize=False)

    @staticmethod
    def _prompt_turns(conversation: list[dict]) -> int:
        first_answer = next((k for k, turn in enumerate(conversation) if turn["role"] == "assistant"), None)
        return len(conversation) if first_answer is None else first_answer

    @torch.inference_mode()
    def score_texts(self, texts: Sequence[str]) -> list[float]:
        """The reward model's logit for each text, in one padded forward."""
        encoded = self.tokenizer(
            list(texts),
            return_tensors="pt",
            padding=True,
            truncation=self.max_length is not None,
            max_length=self.max_length,
            add_special_tokens=self.chat_template is None,
        ).to(self.device)
        logits = self.model(input_ids=encoded.input_ids, attention_mask=encoded.attention_mask).logits
        return [float(v) for v in logits[:, 0].float().cpu()]

    async def score(self, prompt: list[str], conversation: list[list[dict]]) -> list:
        """One group's scores (the ``batched`` reward's call), gathered into batches with other groups'."""
        raw = await self.batcher.submit([self.text(p, c) for p, c in zip(prompt, conversation)])
        if self.normalize is None:
            return raw
        if self.normalize == "group":
            mean = sum(raw) / len(raw)
            std = math.sqrt(sum((v - mean) ** 2 for v in raw) / len(raw))
        else:
            for v in raw:
                self._count += 1
                delta = v - self._mean
                self._mean += delta / self._count
                self._m2 += delta * (v - self._mean)
            mean, std = self._mean, math.sqrt(self._m2 / self._count)
        return [(v - mean) / (std + 1e-6) for v in raw]

    def state_dict(self) -> dict:
        """The running normalisation's statistics (what a resumed run continues from)."""
        return {"count": self._count, "mean": self._mean, "m2": self._m2}

    def load_state_dict(self, state: dict) -> None:
        self._count, self._mean, self._m2 = state["count"], state["mean"], state["m2"]

    def close(self) -> None:
        self.batcher.close()
