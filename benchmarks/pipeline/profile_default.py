"""Host-side costs of the default job, old code against new, side by side in one process.

1. ``pack`` and ``collate`` per micro-batch, and ``sample_groups`` per chunk of requests, timed with the
   code of a baseline commit (``--baseline``, loaded from ``git show``) and with the working tree's. Cases:
   - ``default``: the default job's micro-batch, 8 groups x 8 completions, prompts 6-10 tokens,
     completions 1-6 tokens;
   - ``long_prompt``: the same with prompts of ~200 tokens.
   Both layouts (shared-prompt and padded) are timed, and every result is checked bit-identical first.
   Timings interleave old and new and keep the best of ``--reps`` rounds, since the machine is shared.
2. ``--profile-iterations N``: cProfile of the trainer process (the main one) over a default run of N
   iterations, printing the top cumulative functions outside torch's internals in ms per iteration. The
   rollout worker is a spawned process that cProfile does not follow: profile both processes with
   ``benchmarks/pipeline/profile_default.sh`` (py-spy) instead.

Usage::

    .venv/bin/python benchmarks/pipeline/profile_default.py                        # side-by-side timings
    .venv/bin/python benchmarks/pipeline/profile_default.py --profile-iterations 60
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import pstats
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
BASELINE = "5b6bdd1"  # the last commit with the per-token packing, row-by-row collate and per-step noise draws


def load_baseline(rev: str):
    """(pack, collate, sample_groups) of commit ``rev``, loaded from git into private modules."""

    def module(path: str, name: str, patch=None):
        source = subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{rev}:{path}"], check=True, capture_output=True, text=True
        ).stdout
        spec = importlib.util.spec_from_loader(name, loader=None)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod  # dataclasses look their module up
        exec(compile(source, f"{rev}:{path}", "exec"), mod.__dict__)  # noqa: S102 - the baseline is this repository's own code
        if patch:
            patch(mod)
        return mod

    packing = module("kernels/packing.py", "_baseline_packing")
    trajectory = module("lit_parl/trajectory.py", "_baseline_trajectory", lambda m: setattr(m, "pack", packing.pack))
    sampling = module("lit_parl/rollout/sampling.py", "_baseline_sampling")
    return packing.pack, trajectory.collate, sampling.sample_groups


def micro_batch(rng: random.Random, prompt_len: tuple[int, int], groups: int = 8, group_size: int = 8):
    from lit_parl.data.micro_batch import Trajectory

    out = []
    for g in range(groups):
        prompt = [rng.randrange(1, 50) for _ in range(rng.randint(*prompt_len))]
        for s in range(group_size):
            completion = [rng.randrange(1, 50) for _ in range(rng.randint(1, 6))]
            out.append(
                Trajectory(
                    prompt_id=g,
                    sample_index=s,
                    version=0,
                    prompt_tokens=prompt,
                    completion_tokens=completion,
                    rollout_logprobs=[-rng.expovariate(1.0) for _ in completion],
                    reward=rng.random(),
                    advantage=rng.gauss(0, 1),
                    truncated=False,
                    shaped_reward=None,
                )
            )
    return out


def tensors_equal(a, b) -> bool:
    import dataclasses

    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if dataclasses.is_dataclass(a):
        return all(tensors_equal(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, list):
        return len(a) == len(b) and all(tensors_equal(x, y) for x, y in zip(a, b))
    return a == b


def best_of(fns: dict, reps: int) -> dict:
    """Best per-call seconds of each function, the functions interleaved round by round."""
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(reps):
        for name, (fn, calls) in fns.items():
            start = time.perf_counter()
            for args in calls:
                fn(*args)
            best[name] = min(best[name], (time.perf_counter() - start) / len(calls))
    return best


def side_by_side(rev: str, reps: int) -> None:
    from lit_parl.data.micro_batch import collate
    from lit_parl.kernels.packing import pack

    old_pack, old_collate, old_sample = load_baseline(rev)
    torch.set_num_threads(1)  # the trainer's and the worker's thread count in the default job
    print(f"baseline {rev} (old) vs working tree (new); best of {reps} interleaved rounds, 1 thread")
    print(f"{'case':12s} {'layout':14s} {'function':14s} {'old ms':>8s} {'new ms':>8s} {'old/new':>8s}")
    for case, prompt_len in (("default", (6, 10)), ("long_prompt", (190, 210))):
        rng = random.Random(case)
        batches = [micro_batch(rng, prompt_len) for _ in range(10)]
        groups = [
            [(b[g * 8].prompt_tokens, [t.completion_tokens for t in b[g * 8 : g * 8 + 8]]) for g in range(8)]
            for b in batches
        ]
        for layout in ("shared_prompt", "padded"):
            shared = layout == "shared_prompt"
            for batch, gs in zip(batches, groups):  # bit-identical before timing
                assert tensors_equal(pack(gs, 0, shared), old_pack(gs, 0, shared)), "pack differs from the baseline"
                new_mb, old_mb = collate(batch, 0, 0, layout), old_collate(batch, 0, 0, 256, layout)
                assert tensors_equal(new_mb.tokens, old_mb.tokens) and torch.equal(
                    new_mb.rollout_logprobs, old_mb.rollout_logprobs
                )
            for what, new_fn, old_fn, calls in (
                ("pack", pack, old_pack, [(gs, 0, shared) for gs in groups]),
                ("collate", collate, old_collate, [(b, 0, 0, 256, layout) for b in batches]),
            ):
                t = best_of({"old": (old_fn, calls), "new": (new_fn, calls)}, reps)
                print(
                    f"{case:12s} {layout:14s} {what:14s} "
                    f"{t['old'] * 1e3:8.3f} {t['new'] * 1e3:8.3f} {t['old'] / t['new']:7.1f}x"
                )
    sampling_side_by_side(old_sample, reps)


def sampling_side_by_side(old_sample, reps: int) -> None:
    """The worker's ``sample_groups`` on the default model and chunk (8 prompts x 8 samples, 6 new tokens)."""
    from lit_parl.models import tiny_qwen2
    from lit_parl.rollout.records import GroupRequest, SamplingParams, sample_seed
    from lit_parl.rollout.sampling import sample_groups
    from lit_parl.tasks import CopyTask

    model, tok = tiny_qwen2(hidden_size=128, intermediate_size=512)  # conf/model/tiny_qwen2.yaml
    model.eval()
    task = CopyTask()
    sampling = SamplingParams(max_new_tokens=6)

    def chunk(k: int) -> list[GroupRequest]:
        requests = []
        for pid in range(8 * k, 8 * k + 8):
            prompt, answer = task.make(pid)
            requests.append(
                GroupRequest(
                    pid,
                    tuple(tok(prompt, add_special_tokens=False).input_ids),
                    tuple(tok(answer, add_special_tokens=False).input_ids),
                    0,
                    tuple(sample_seed(0, 0, pid, s) for s in range(8)),
                )
            )
        return requests

    chunks = [chunk(k) for k in range(8)]

    def run(fn, requests):
        return [
            (g.request.prompt_id, g.completions, g.logprobs, g.finish_reasons)
            for g in fn(model, requests, sampling, tok.eos_token_id, tok.pad_token_id)
        ]

    for requests in chunks:
        assert run(sample_groups, requests) == run(old_sample, requests), "sample_groups differs from the baseline"
    calls = [(fn_requests,) for fn_requests in chunks]
    t = best_of({"old": (lambda r: run(old_sample, r), calls), "new": (lambda r: run(sample_groups, r), calls)}, reps)
    print(
        f"{'default':12s} {'8x8, 6 tokens':14s} {'sample_groups':14s} "
        f"{t['old'] * 1e3:8.3f} {t['new'] * 1e3:8.3f} {t['old'] / t['new']:7.2f}x"
    )


TORCH_INTERNALS = (
    "/torch/",
    "{built-in method torch",
    "{method '",
    "<frozen",
    "/threading.py",
    "/queue.py",
    "/multiprocessing/",
)
WRAPPERS = (
    "/hydra/",
    "/selectors.py",
    "'poll' of",
    "builtins.next",
    "/lightning/",
    "/transformers/utils/",
    "/transformers/modeling_layers.py",
)
OURS = ("lit_parl/", "kernels/", "callbacks/")


def profile_trainer(iterations: int, top: int, extra: list[str]) -> None:
    """cProfile the trainer process over a default run; cumulative ms per iteration (startup included)."""
    from lit_parl import cli

    with tempfile.TemporaryDirectory() as run_dir:
        sys.argv = [
            "lit-parl",
            f"iterations={iterations}",
            "trainer.max_time=null",
            f"run_dir={run_dir}",
            "checkpoint_every=0",
            *extra,
        ]
        profiler = cProfile.Profile()
        profiler.enable()
        try:
            cli.main()
        except SystemExit:
            pass
        profiler.disable()
    site = str(Path(torch.__file__).parent.parent) + "/"
    rows = []
    for (filename, line, name), (_, calls, _, cumulative, _) in pstats.Stats(profiler).stats.items():
        full = f"{filename}:{line}({name})"
        if not any(marker in full for marker in TORCH_INTERNALS):
            rows.append((cumulative * 1e3 / iterations, calls / iterations, full))
    rows.sort(reverse=True)
    sections = (
        (
            f"top {top} cumulative outside torch internals and the hydra/Lightning/transformers wrappers",
            lambda full: not any(w in full for w in WRAPPERS),
        ),
        (
            "lit_parl's own functions (lit_parl/, kernels/, callbacks/)",
            lambda full: any(o in full for o in OURS) and site not in full,
        ),
    )
    for title, keep in sections:
        print(f"\ntrainer process, cProfile, {iterations} iterations: {title} (ms per iteration, startup included)")
        print(f"{'ms/it':>9s} {'calls/it':>9s}  function")
        for ms, calls, full in [r for r in rows if keep(r[2])][:top]:
            print(f"{ms:9.2f} {calls:9.1f}  {full.replace(site, '').replace(str(ROOT) + '/', '')}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default=BASELINE, help="git revision of the old code (default: %(default)s)")
    parser.add_argument("--reps", type=int, default=20, help="interleaved timing rounds (the best is kept)")
    parser.add_argument("--skip-timings", action="store_true", help="only the profile")
    parser.add_argument(
        "--profile-iterations", type=int, default=0, help="cProfile the trainer over a default run of N iterations"
    )
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for the profiled run")
    args = parser.parse_args()
    if not args.skip_timings:
        side_by_side(args.baseline, args.reps)
    if args.profile_iterations:
        profile_trainer(args.profile_iterations, args.top, args.overrides)


if __name__ == "__main__":
    main()
