"""The trainer's side: the LightningModule (``grpo_module``), the loss (``grpo_objective``), its guards,
per-iteration metrics and position, lean checkpoints, precision, the learning-rate schedule, and what each
Lightning strategy does differently (``strategies``)."""
