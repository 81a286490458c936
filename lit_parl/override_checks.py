"""``override_error``: the command line's overrides composed before Hydra runs the job, so that the three mistakes
Hydra answers obscurely get one line that names the fix.

- a key the config lacks (``shape.prompt=8``): Hydra advises ``+shape.prompt=8``, which adds a key that no
  constructor takes; the right fix is the key meant, found among the node's keys (``shape.prompts``);
- a value holding ``=`` (Lightning's checkpoint names: ``resume=runs/x/epoch=1-step=2.ckpt``): Hydra's parser
  reports ``mismatched input '='``; the value must be quoted;
- an unknown option of a group (``pool=sglan``): Hydra's message spreads the options over lines; one line here.

Anything else is left to Hydra, which reports it as it does. Composing costs a fraction of a second, against
the seconds that importing the training stack takes.

Example::

    >>> override_error(["shape.prompt=8"])
    "shape.prompt=8: the config has no key shape.prompt; did you mean shape.prompts=8? (shape's keys: ...)"
"""

from __future__ import annotations

import difflib
import re

from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf

CONFIG_MODULE = "lit_parl.conf"


def _compose(overrides: list[str]) -> DictConfig:
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
            return compose(config_name="config", overrides=overrides, return_hydra_config=True)
    finally:
        GlobalHydra.instance().clear()  # hydra.main initializes its own


def _unknown_key(overrides: list[str], key: str) -> str:
    given = next((o for o in overrides if o.split("=", 1)[0] == key), key)
    value = given.split("=", 1)[1] if "=" in given else "..."
    parent, _, leaf = key.rpartition(".")
    try:  # the node as the other overrides compose it (a group switched on the command line has other keys)
        node = OmegaConf.select(_compose([o for o in overrides if o != given]), parent) if parent else None
    except Exception:
        node = None
    keys = [k for k in node.keys() if not str(k).startswith("_")] if isinstance(node, DictConfig) else []
    close = difflib.get_close_matches(leaf, keys, n=1, cutoff=0.6)
    hint = f"did you mean {parent}.{close[0]}={value}?" if close else "check its spelling"
    listed = f" ({parent}'s keys: {', '.join(keys)})" if keys else ""
    return f"{given}: the config has no key {key}; {hint}{listed}"


def override_error(overrides: list[str]) -> str | None:
    """The one-line error for ``overrides`` (Hydra's command-line arguments) that Hydra would refuse obscurely;
    ``None`` when they compose, or fail in a way Hydra's own message explains."""
    if any(arg.startswith("-") for arg in overrides):  # --help, --cfg, --multirun...: Hydra's own modes
        return None
    try:
        _compose(overrides)
    except OverrideParseException:
        quoted = [o for o in overrides if o.count("=") > 1 and not re.search(r"=\s*['\"]", o)]
        if not quoted:
            return None
        key, _, value = quoted[0].partition("=")
        return (
            f"{quoted[0]}: Hydra reads the '=' inside the value as its own syntax; quote the value: "
            f"\"{key}='{value}'\"" + (" (or pass the run directory)" if key.lstrip("+~") == "resume" else "")
        )
    except MissingConfigException as error:  # "Could not find 'pool/x'", then the options one a line
        lines = [line.strip() for line in str(error).split("Config search path:")[0].splitlines() if line.strip()]
        if len(lines) > 2 and lines[1].startswith("Available options"):
            return f"{lines[0]}; {lines[1].rstrip(':').lower()}: {', '.join(lines[2:])}"
        return " ".join(lines)
    except ConfigCompositionException as error:
        found = re.match(r"Could not override '([^']+)'", str(error))
        return _unknown_key(overrides, found.group(1)) if found else None
    except Exception:
        return None
    return None
