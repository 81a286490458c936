"""The Hydra entry point: ``lit-parl`` or ``python -m lit_parl`` (configs in ``conf/``, installed as ``lit_parl.conf``).

Every config group builds one object through its ``_target_``; ``build(cfg)`` instantiates them and
passes the few objects that several others share (the policy, tokenizer, objective, shape and sampling
parameters), without starting any process, so a bad configuration fails before the pool is launched.
``run(cfg)`` fits and returns the run summary.

Importing this module loads Hydra only: ``lit-parl --help`` and a command line Hydra refuses answer without
loading torch, Lightning and transformers, which ``build`` imports when a job runs.
"""

from __future__ import annotations

import importlib.util
import logging
import re
import signal
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import hydra
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from lit_parl.errors import EndpointError, PoolStartError
from lit_parl.extras import require_installed
from lit_parl.override_checks import override_error

if TYPE_CHECKING:
    import lightning

    from lit_parl.data.rollout_datamodule import RolloutDataModule
    from lit_parl.trainer.grpo_module import GRPOModule

# the Lightning classes a config group may name whose packages are extras: (the package, the extra, the setting).
# Checked before Lightning builds them: its own errors are several chained tracebacks deep.
_TARGET_EXTRAS = {
    "TensorBoardLogger": ("tensorboard", "tensorboard", "logger=tensorboard"),
    "WandbLogger": ("wandb", "wandb", "logger=wandb"),
    "MLFlowLogger": ("mlflow", "mlflow", "logger=mlflow"),
    "DeepSpeedStrategy": ("deepspeed", "deepspeed", "trainer=deepspeed"),
}


# Messages of the libraries that a user of the default job can do nothing about (each checked on the
# versions in use): the iteration stream is sized on purpose and read in-process (num_workers=0); the
# frozen old/reference copies are in eval mode on purpose; Lightning's loader uses a torch pytree class
# that torch deprecated.
_EXPECTED_WARNINGS = (
    r"Your `IterableDataset` has `__len__` defined",
    r"Found \d+ module\(s\) in eval mode at the start of training",
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
)


def _quiet_console(run_dir: Path) -> None:
    """The default job prints its progress and summary, not library notices it cannot act on."""
    for message in _EXPECTED_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    if not run_dir.exists() or {p.name for p in run_dir.iterdir()} <= {".hydra"}:
        # a fresh run: the directory holds only Hydra's record of the config, which the CSV logger may share
        warnings.filterwarnings("ignore", message=r"Experiment logs directory .* exists and is not empty")
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(
        lambda record: "litlogger" not in record.getMessage()
    )
    import transformers

    transformers.utils.logging.disable_progress_bar()  # "Writing model shards" bars for a model of a few MB


def _check_extras(cfg: DictConfig) -> None:
    for group, node in (("logger", cfg.get("logger")), ("trainer", cfg.trainer.get("strategy"))):
        target = node.get("_target_", "") if isinstance(node, DictConfig) else ""
        needed = _TARGET_EXTRAS.get(str(target).rsplit(".", 1)[-1])
        if needed is None or (needed[0] == "tensorboard" and importlib.util.find_spec("tensorboardX")):
            continue  # TensorBoard's logger writes with tensorboardX as well
        require_installed(*needed, hint="(or use logger=csv)" if group == "logger" else "")


def _with_key(key: str, factory):
    """``factory`` whose ValueError also names the config node it was built from."""

    def build_node(**kwargs):
        try:
            return factory(**kwargs)
        except ValueError as error:
            raise ValueError(f"config {key}: {error}") from error

    return build_node


def build(cfg: DictConfig) -> tuple[GRPOModule, RolloutDataModule, lightning.Trainer]:
    import lightning
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lit_parl.kernels.backends import resolve_backend
    from lit_parl.run_checks import check_run

    _check_extras(cfg)
    lightning.seed_everything(cfg.seed, workers=True, verbose=False)
    shape, sampling = instantiate(cfg.shape), instantiate(cfg.sampling)
    objective = instantiate(cfg.algorithm.objective)
    policy, tokenizer = instantiate(cfg.model)
    # Shared objects are passed to a partial, not as instantiate() kwargs: Hydra would turn a dataclass
    # (the shape, the sampling parameters) back into a config node.
    optimizer = instantiate(cfg.optimizer)
    module = _with_key("module", instantiate(cfg.module, _partial_=True))(
        policy=policy,
        objective=objective,
        shape=shape,
        tokenizer=tokenizer,
        optimizer=optimizer,
        lr_schedule=instantiate(cfg.lr_schedule),
    )
    rewards = [
        instantiate(node, name=node.get("name") or name) for name, node in cfg.reward.items() if node is not None
    ]
    datamodule = _with_key("datamodule", instantiate(cfg.datamodule, _partial_=True))(
        data=instantiate(cfg.data),
        rewards=rewards,
        pool=instantiate(cfg.pool),
        tokenizer=tokenizer,
        shape=shape,
        objective=objective,
        initial_model=policy,
        sampling=sampling,
    )
    callbacks = [
        instantiate(callback)
        for name, callback in cfg.callbacks.items()
        if callback is not None and not (name == "checkpoint" and not cfg.checkpoint_every)
    ]
    trainer = instantiate(
        cfg.trainer,
        callbacks=callbacks,
        logger=instantiate(cfg.logger),
        default_root_dir=str(cfg.run_dir),
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
    )
    # fail before any process starts (Lightning starts the other ranks in fit), once
    check_run(cfg.iterations, shape, optimizer, trainer.world_size, trainer.num_nodes)
    # for the dtype the forward will compute in
    resolve_backend(
        module.attention_backend, trainer.strategy.root_device, module.compute_dtype(str(trainer.precision))
    )
    return module, datamodule, trainer


def checkpoint_to_resume(resume: str | None) -> str | None:
    """The checkpoint file ``resume`` names: a file as given, or a run directory's newest (``checkpoints/last.ckpt``,
    or ``last.ckpt`` in the directory itself). Lightning's own names hold ``=``, which Hydra's override parser
    reads as syntax: quote them (``"resume='runs/x/checkpoints/epoch=2-step=5.ckpt'"``), or pass the run directory."""
    if resume is None:
        return None
    path = Path(resume)
    if path.is_file():
        return str(path)
    if path.is_dir():
        for candidate in (path / "checkpoints" / "last.ckpt", path / "last.ckpt"):
            if candidate.is_file():
                return str(candidate)
        found = sorted(str(p.relative_to(path)) for p in path.rglob("*.ckpt"))[:5]
        raise FileNotFoundError(
            f"resume={resume}: the directory holds no checkpoints/last.ckpt or last.ckpt"
            + (
                f"; name one of its checkpoints, quoted: \"resume='{path / found[-1]}'\""
                if found
                else " (nor any .ckpt file)"
            )
        )
    raise FileNotFoundError(f"resume={resume}: no such checkpoint file or run directory")


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt(f"received signal {signum}")


def run(cfg: DictConfig) -> dict:
    from lit_parl.callbacks import RunSummary

    _quiet_console(Path(cfg.run_dir))
    checkpoint = checkpoint_to_resume(cfg.resume)  # before anything is built: a wrong path fails at once
    module, datamodule, trainer = build(cfg)
    # SIGTERM unwinds like Ctrl-C: Lightning's exception path has the datamodule close its pool
    previous = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=checkpoint)
    finally:
        signal.signal(signal.SIGTERM, previous)
    summary = next((c for c in trainer.callbacks if isinstance(c, RunSummary)), None)
    return summary.summary if summary is not None else {}


# Refusals of a bad setting, file or data row: lit_parl raises these with a message that names the fix
_REFUSALS = (ValueError, FileNotFoundError, ImportError, OmegaConfBaseException, PoolStartError, EndpointError)
# found without importing them (lit_parl.callbacks loads Lightning)
_OWN_CODE = tuple(
    Path(path).resolve()
    for package in ("lit_parl", "lit_parl.callbacks", "lit_parl.kernels")
    for path in importlib.util.find_spec(package).submodule_search_locations
)


def refusal_message(error: BaseException) -> str | None:
    """The one line to print for ``error`` when it refuses a bad setting, file or data row: its message, with the
    config key Hydra names; ``None`` for anything else (a failure in user or library code keeps its traceback).

    A refusal is one of ``_REFUSALS`` whose innermost cause was raised by lit_parl's own code (or by OmegaConf,
    for a value the config lacks); a reward or dataset loader of the user's that raises is not. A missing extra
    is one: ``lit_parl.extras`` raises it."""
    cause, key = error, None
    if isinstance(error, InstantiationException) and error.__cause__ is not None:
        found = re.search(r"full_key: (\S+)", str(error))
        cause, key = error.__cause__, found.group(1) if found else None
    innermost = cause
    while innermost.__cause__ is not None:
        innermost = innermost.__cause__
    frame = innermost.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    raised_at = Path(frame.tb_frame.f_code.co_filename).resolve() if frame is not None else None
    own = raised_at is not None and any(raised_at.is_relative_to(root) for root in _OWN_CODE)
    if not isinstance(cause, _REFUSALS) or not (own or isinstance(innermost, OmegaConfBaseException)):
        return None
    if isinstance(cause, OmegaConfBaseException):  # its str() spreads the key and the node's type over lines
        return f"{str(cause).splitlines()[0]}: set it on the command line ({getattr(cause, 'full_key', 'key')}=...)"
    return f"config {key}: {cause}" if key else str(cause)


@hydra.main(config_path="pkg://lit_parl.conf", config_name="config", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    try:
        run(cfg)
    except Exception as error:
        message = refusal_message(error)
        if message is None:
            raise
        raise SystemExit(f"lit-parl: error: {message}") from None


def main() -> None:
    """``lit-parl [overrides]``: the overrides are composed first, so those Hydra would refuse obscurely get one
    line that names the fix (``lit_parl.override_checks``); then Hydra runs the job."""
    message = override_error(sys.argv[1:])
    if message is not None:
        raise SystemExit(f"lit-parl: error: {message}")
    _hydra_main()
