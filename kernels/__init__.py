"""Compute kernels of the trainer's forward pass (imported as ``lit_parl.kernels``).

Keep this file free of transformers imports and use relative imports. Run from the repository root,
``import kernels`` finds this folder before Hugging Face's hub-kernels package of the same name, which
transformers imports while it initialises (a dependency of transformers from 5.25; before, an optional
package it probed for). Imported under that top-level name, this file hands the import over to the installed
``kernels`` distribution when there is one, and otherwise imports cleanly with no ``__version__``, so
transformers concludes that package is absent. The attention backends (which register with transformers)
live in ``lit_parl.kernels.attention`` and ``lit_parl.kernels.forward``.
"""


def _hub_kernels_origin() -> str | None:
    """The ``__init__.py`` of the installed ``kernels`` distribution (Hugging Face's), if there is one."""
    import importlib.metadata
    import os

    try:
        origin = str(importlib.metadata.distribution("kernels").locate_file("kernels/__init__.py"))
    except importlib.metadata.PackageNotFoundError:
        return None
    return origin if os.path.isfile(origin) and os.path.abspath(origin) != os.path.abspath(__file__) else None


_origin = _hub_kernels_origin() if __name__ == "kernels" else None  # imported as a top-level package
if _origin is not None:
    # from the repository root: the import system returns sys.modules["kernels"] once this file has run, so
    # replacing it there hands the importer Hugging Face's package
    import importlib.util
    import os
    import sys

    _spec = importlib.util.spec_from_file_location(
        "kernels", _origin, submodule_search_locations=[os.path.dirname(_origin)]
    )
    _hub = importlib.util.module_from_spec(_spec)
    sys.modules["kernels"] = _hub
    _spec.loader.exec_module(_hub)
else:
    from .logprobs import linear_token_logprobs, token_logprobs
    from .packing import PackedTokens, SharedPromptLayout, pack

    __all__ = ["PackedTokens", "SharedPromptLayout", "linear_token_logprobs", "pack", "token_logprobs"]
