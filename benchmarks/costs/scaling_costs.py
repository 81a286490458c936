"""Costs that scale with the model (issue 16): weight sync, log-prob memory, packed against padded.

Every part builds random Qwen2 models from a config (no download), with Qwen2's vocabulary of 151,936
tokens and tied embeddings, at about 10M, 50M, 150M and 500M parameters (`SIZES`; the 500M one is
Qwen2-0.5B's shape). The exact parameter counts are printed.

1. ``sync``: the embedded pool's weight sync against its bound. ``HFRolloutPool(num_workers=1)`` is
   started from the policy's saved directory (``InitialModelDir``, as the datamodule does), and
   ``pool.sync_weights([named_parameters], version)`` is timed after a first sync (which allocates the
   shared memory), beside a plain ``copy_`` of the same tensors into preallocated tensors (the bound),
   the two interleaved rep by rep, with the trainer's torch on 2 threads and on 1 (lit_parl's async
   default here: the cores the pool's one worker thread leaves). The worker's parameters are the shared
   tensors (``HFEngine.load``), so a sync is the trainer's one copy into shared memory: its bound is one
   memcpy. A second pool runs the load that was replaced (``two-copy``: the worker copies the shared
   tensors into its own model, so a sync is two copies back to back; its ratio is also given against two
   memcpys). The worker's load is timed inside the worker (a subclass that only adds a timer), so the
   sync splits into the trainer's copy, the worker's load and the rest (messages).
2. ``memory``: the trainer's peak memory for the forward and backward of one micro-batch (8 padded
   rows of 64 prompt + 64 completion tokens), through lit_parl's chunked log-prob kernel
   (``lit_parl.kernels.forward.completion_logprobs``) and through the plain path
   (``model(input_ids).logits`` -> ``log_softmax`` -> gather). Each case runs in a fresh process; the
   figure is the rise of the process's peak resident set (VmHWM, reset through /proc/self/clear_refs
   once the model is built) during the step, so it sees every CPU allocation of torch. The rise
   includes the parameters' gradients (the same for every path; printed beside). The log-probs of
   the paths are compared (max abs difference).
3. ``packing``: the policy's log-probs, forward and backward, of one group of G=8 samples with P=512
   prompt and R=64 completion tokens, in lit_parl's shared-prompt layout (the prompt computed once)
   against one padded row per sample. bfloat16 autocast (as Lightning's ``bf16-mixed``) when this CPU's
   bfloat16 matmul is faster than its float32 one, else float32. Median of ``--packing-reps`` after a warm-up
   step, the two layouts interleaved, in one fresh process per model; peak memory as in part 2, from
   the warm-up step. A layout whose warm-up step takes longer than ``--max-step-s`` is not timed
   further (its one step is reported), and the padded step is not run at all when the packed one times
   the token ratio exceeds three times that.

Run (from the repository root; about 13 minutes here for everything, on 2 shared cores):

    .venv/bin/python benchmarks/costs/scaling_costs.py
    .venv/bin/python benchmarks/costs/scaling_costs.py --sizes 10m 50m --parts sync memory --reps 3
    .venv/bin/python benchmarks/costs/scaling_costs.py --parts packing --packing-dtype float32 --max-step-s 120
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import multiprocessing
import os
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable

import torch
from transformers import AutoModelForCausalLM, Qwen2Config
from transformers.utils import logging as transformers_logging

from lit_parl.data.initial_model_dir import InitialModelDir
from lit_parl.data.micro_batch import Trajectory, collate
from lit_parl.kernels.forward import completion_logprobs
from lit_parl.models.char_tokenizer import build_char_tokenizer
from lit_parl.rollout import HFRolloutPool, PoolSpec
from lit_parl.rollout.hf_pool import HFEngine

VOCAB = 151_936  # Qwen2's
SIZES = {
    "10m": dict(
        hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2
    ),
    "50m": dict(
        hidden_size=256, intermediate_size=1024, num_hidden_layers=10, num_attention_heads=4, num_key_value_heads=2
    ),
    "150m": dict(
        hidden_size=640, intermediate_size=1728, num_hidden_layers=12, num_attention_heads=10, num_key_value_heads=2
    ),
    "500m": dict(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2
    ),
}
PARTS = ("sync", "memory", "packing")
THREADS = 2  # the machine's cores
PAD = 0


# -- models and micro-batches ---------------------------------------------------------------------------
def build_model(size: str, max_positions: int = 4096) -> torch.nn.Module:
    """A random float32 Qwen2 of ``size``, the same weights in every process (seed 0)."""
    config = Qwen2Config(
        vocab_size=VOCAB, tie_word_embeddings=True, max_position_embeddings=max_positions, **SIZES[size]
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")


def parameter_count(size: str) -> int:
    config = Qwen2Config(vocab_size=VOCAB, tie_word_embeddings=True, **SIZES[size])
    with torch.device("meta"):  # no memory, no init: just the shapes
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def trajectories(groups: int, group_size: int, P: int, R: int, seed: int = 0) -> list[Trajectory]:
    """``groups`` prompts of ``P`` random tokens, each with ``group_size`` completions of ``R`` tokens."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for g in range(groups):
        prompt = torch.randint(3, VOCAB, (P,), generator=generator).tolist()
        for s in range(group_size):
            completion = torch.randint(3, VOCAB, (R,), generator=generator).tolist()
            out.append(Trajectory(g, s, 0, prompt, completion, [-1.0] * R, float(s % 2), float(s % 2) - 0.5, False))
    return out


# -- measuring ----------------------------------------------------------------------------------------
def seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def median_time(fn: Callable[[], object], reps: int) -> float:
    return statistics.median(seconds(fn) for _ in range(reps))


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak() -> int:
    """Give freed heap back to the system, reset the peak resident set to the current one; return it (KiB).

    Without the trim, memory glibc keeps after a free would count as resident before the step and
    hide part of its rise."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # 5: reset VmHWM to VmRSS (Linux >= 4.0)
    return _status_kib("VmRSS:")


def peak_rise_mib(base_kib: int) -> float:
    return (_status_kib("VmHWM:") - base_kib) / 1024


def in_fresh_process(fn: Callable, *args):
    """``fn(*args)`` in a new spawned process: its peak memory is its own, and it returns it all when done."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    process = context.Process(target=_call_into, args=(results, fn, args))
    process.start()
    try:
        ok, value = results.get()
    finally:
        process.join()
    if not ok:
        raise RuntimeError(f"{fn.__name__}{args} failed in its process:\n{value}")
    return value


def _call_into(results, fn: Callable, args: tuple) -> None:
    torch.set_num_threads(THREADS)
    try:
        results.put((True, fn(*args)))
    except BaseException:  # noqa: BLE001 - reported by the parent
        results.put((False, traceback.format_exc()))


def machine_line() -> str:
    cpu = "unknown CPU"
    with open("/proc/cpuinfo") as info:
        for line in info:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"torch {torch.__version__}, {THREADS} threads, {os.cpu_count()} cores, CPU: {cpu}, load average {load}"


class Table:
    """A Markdown table printed row by row, as each is measured (a long run shows its progress)."""

    def __init__(self, title: str, header: list[str], wide: dict[str, int] | None = None) -> None:
        self.widths = [max(len(h), (wide or {}).get(h, 8)) for h in header]
        print(f"\n{title}")
        self._line(header)
        print("|" + "|".join("-" * (w + 2) for w in self.widths) + "|", flush=True)

    def row(self, cells: list[str]) -> None:
        self._line(cells)

    def _line(self, cells: list[str]) -> None:
        print("| " + " | ".join(c.rjust(w) for c, w in zip(cells, self.widths)) + " |", flush=True)


# -- part 1: weight sync --------------------------------------------------------------------------------
class TimedHFEngine(HFEngine):
    """lit_parl's ``hf`` engine with a timer around ``load``: each line of ``log_path`` is ``version seconds``."""

    def __init__(self, model_dir: str, eos_id: int, pad_id: int, threads: int, log_path: str) -> None:
        super().__init__(model_dir, eos_id, pad_id, threads)
        self.log_path = log_path

    def load(self, shared: dict[str, torch.Tensor], version: int) -> None:
        start = time.perf_counter()
        self.load_weights(shared, version)
        with open(self.log_path, "a") as log:
            log.write(f"{version} {time.perf_counter() - start}\n")

    def load_weights(self, shared: dict[str, torch.Tensor], version: int) -> None:
        super().load(shared, version)  # the parameters are the shared tensors after the first load: no copy


class CopyingHFEngine(TimedHFEngine):
    """The load as it was before the engine held the shared tensors: one ``copy_`` per parameter, on the
    worker's one thread, so a sync was two copies back to back. Kept as the reference."""

    def load_weights(self, shared: dict[str, torch.Tensor], version: int) -> None:
        with torch.no_grad():
            for name, parameter in self.model.named_parameters():
                parameter.copy_(shared[name])


class TimedPool(HFRolloutPool):
    """``HFRolloutPool`` whose workers run ``engine`` (one of the two above), which logs its load times."""

    def __init__(self, engine: type[TimedHFEngine], log_path: str) -> None:
        super().__init__(num_workers=1, threads_per_worker=1)  # the embedded default's worker
        self.engine, self.log_path = engine, log_path

    def _engine(self, spec: PoolSpec, threads: int):
        return functools.partial(self.engine, str(spec.model_dir), spec.eos_id, spec.pad_id, threads, self.log_path)

    def load_times(self) -> dict[int, float]:
        with open(self.log_path) as log:
            return {int(v): float(s) for v, s in (line.split() for line in log)}


def copy_all(named: list[tuple[str, torch.Tensor]], targets: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for (_, tensor), target in zip(named, targets):
            target.copy_(tensor)


def sync_rows(size: str, reps: int, thread_counts: list[int]) -> list[dict]:
    """One row per (load method, trainer threads): ``reps`` syncs, memcpys and worker loads, interleaved rep by rep."""
    model = build_model(size)
    named = list(model.named_parameters())
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    targets = [torch.empty_like(t) for _, t in named]
    copy_all(named, targets)  # the bound's first copy faults its pages in; the pool's first sync does the same
    tokenizer = build_char_tokenizer()
    saved = InitialModelDir(model, tokenizer)
    rows = []
    try:
        for method, engine in (("lit_parl", TimedHFEngine), ("two-copy", CopyingHFEngine)):
            with tempfile.NamedTemporaryFile(prefix="scaling_costs_load_", suffix=".log") as log:
                pool = TimedPool(engine, log.name)
                try:
                    pool.start(PoolSpec(saved.path(), eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id))
                    torch.set_num_threads(THREADS)
                    first = seconds(functools.partial(pool.sync_weights, [named], 0))
                    version = 0
                    for threads in thread_counts:
                        torch.set_num_threads(threads)
                        syncs, copies, versions = [], [], []
                        for _ in range(reps):
                            version += 1
                            syncs.append(seconds(functools.partial(pool.sync_weights, [named], version)))
                            versions.append(version)
                            copies.append(seconds(functools.partial(copy_all, named, targets)))
                        loads = pool.load_times()
                        rows.append(
                            dict(
                                method=method,
                                threads=threads,
                                bytes=nbytes,
                                first=first,
                                syncs=syncs,
                                copies=copies,
                                loads=[loads[v] for v in versions],
                            )
                        )
                finally:
                    pool.close()
                    torch.set_num_threads(THREADS)
    finally:
        saved.remove()
    return rows


def run_sync(sizes: list[str], reps: int) -> None:
    print(
        "\n## 1. Weight sync: HFRolloutPool(num_workers=1, threads_per_worker=1).sync_weights against a plain memcpy\n"
        "'load': how the worker takes the weights. 'lit_parl' is HFEngine.load: the worker's parameters are the\n"
        "shared tensors, so a sync is the trainer's one copy into shared memory (bound: one memcpy). 'two-copy' is\n"
        "the load it replaced (a copy_ per parameter into the worker's own model, after the trainer's copy: bound\n"
        "half a memcpy's bandwidth; its ratio is also given against two memcpys). 'threads': torch threads of the\n"
        "trainer's process (its copy into shared memory, and the memcpy); the worker has 1."
    )
    main = Table(
        f"median of {reps} syncs and {reps} memcpys, interleaved",
        [
            "size",
            "load",
            "threads",
            "MB",
            "sync s",
            "memcpy s",
            "sync GB/s",
            "memcpy GB/s",
            "ratio vs 1 memcpy",
            "ratio vs 2 memcpy",
        ],
        wide={"load": 9},
    )
    diagnosis = []
    for size in sizes:
        for r in sync_rows(size, reps, thread_counts=[THREADS, 1]):
            sync_s, copy_s = statistics.median(r["syncs"]), statistics.median(r["copies"])
            ratio = copy_s / sync_s  # bandwidths: bytes / sync_s over bytes / copy_s
            copying = r["method"] == "two-copy"
            main.row(
                [
                    size,
                    r["method"],
                    str(r["threads"]),
                    f"{r['bytes'] / 1e6:,.0f}",
                    f"{sync_s:.4f}",
                    f"{copy_s:.4f}",
                    f"{r['bytes'] / sync_s / 1e9:.2f}",
                    f"{r['bytes'] / copy_s / 1e9:.2f}",
                    f"{ratio:.2f}",
                    f"{2 * ratio:.2f}" if copying else "-",
                ]
            )
            load_s = statistics.median(r["loads"])
            rest_s = statistics.median(
                sync - copy - load for sync, copy, load in zip(r["syncs"], r["copies"], r["loads"])
            )
            diagnosis.append(
                [
                    size,
                    r["method"],
                    str(r["threads"]),
                    f"{r['first']:.2f}",
                    f"{load_s:.4f}",
                    f"{r['bytes'] / load_s / 1e9:.1f}",
                    f"{rest_s:.4f}",
                    f"{min(r['syncs']):.4f}",
                    f"{min(r['copies']):.4f}",
                    f"{min(r['copies']) / min(r['syncs']):.2f}",
                ]
            )
    where = Table(
        "Where a sync's time goes. 'first sync': allocates the shared memory (not in the medians). 'worker load': the\n"
        "worker's load timed inside it (median). 'rest': median of sync - memcpy - worker load per rep (the trainer's\n"
        "copy taken as one memcpy): messages and waiting. 'min': the fastest of the reps (the least disturbed by\n"
        "other processes), and the ratio of the two minimums (sync bandwidth / memcpy bandwidth).",
        [
            "size",
            "load",
            "threads",
            "first sync s",
            "worker load s",
            "worker GB/s",
            "rest s",
            "min sync s",
            "min memcpy s",
            "ratio of mins",
        ],
        wide={"load": 9},
    )
    for cells in diagnosis:
        where.row(cells)


# -- part 2: log-prob memory ----------------------------------------------------------------------------
MEMORY_BATCH = dict(groups=8, group_size=1, P=64, R=64)  # 8 rows of 64 prompt + 64 completion tokens


def full_logits_logprobs(model, tokens, temperature: float = 1.0) -> torch.Tensor:
    """The plain path: every position's logits, log_softmax over the vocabulary, gather the labels."""
    logits = model(input_ids=tokens.input_ids, use_cache=False).logits  # [B, L, V] float32
    every = (logits / temperature).log_softmax(-1).reshape(-1, logits.shape[-1])  # [B * L, V]
    logprobs = every[tokens.label_positions].gather(-1, tokens.label_targets[:, None])[:, 0]
    out = logprobs.new_zeros(tokens.completion_mask.numel()).scatter(0, tokens.label_slots, logprobs)
    return out.view(tokens.completion_mask.shape)


def logprob_memory_case(size: str, chunk_size: int | None, out_path: str) -> dict:
    """In a fresh process: the peak memory rise of one forward + backward; ``chunk_size`` None: full logits."""
    model = build_model(size)
    tokens = collate(trajectories(**MEMORY_BATCH), PAD, packing="padded").tokens
    base = reset_peak()
    start = time.perf_counter()
    if chunk_size is None:
        logprobs = full_logits_logprobs(model, tokens)
    else:
        logprobs = completion_logprobs(model, tokens, 1.0, chunk_size)
    (logprobs * tokens.completion_mask).sum().backward()
    step_s = time.perf_counter() - start
    rise = peak_rise_mib(base)
    torch.save(logprobs.detach(), out_path)
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    return dict(rise_mib=rise, seconds=step_s, grad_mib=grads / 2**20)


def run_memory(sizes: list[str], chunk_sizes: list[int]) -> None:
    b = MEMORY_BATCH
    print(
        f"\n## 2. Trainer peak memory of one micro-batch's forward + backward, vocabulary {VOCAB:,}, float32\n"
        f"{b['groups'] * b['group_size']} padded rows of {b['P']} prompt + {b['R']} completion tokens. "
        f"'full logits': model(input_ids).logits,\n"
        f"log_softmax over every position, gather; 'chunked N': lit_parl's completion_logprobs "
        f"with logprob_chunk_size=N\n"
        f"(the head on the completion labels only, N at a time). MiB: rise of the peak resident set during the step,\n"
        f"in a fresh process per case; it includes the parameters' gradients ('grads MiB', the same in every case).\n"
        f"'max |diff|': log-probs against the full-logits ones."
    )
    table = Table(
        f"label tokens per micro-batch: {b['groups'] * b['group_size'] * b['R']}",
        ["size", "path", "peak rise MiB", "less grads MiB", "grads MiB", "full / this", "step s", "max |diff|"],
        wide={"path": 12},
    )
    for size in sizes:
        with tempfile.TemporaryDirectory(prefix="scaling_costs_") as tmp:
            cases = [("full logits", None), *((f"chunked {c}", c) for c in chunk_sizes)]
            results = {}
            for name, chunk in cases:
                results[name] = in_fresh_process(logprob_memory_case, size, chunk, os.path.join(tmp, f"{chunk}.pt"))
            full = results["full logits"]
            reference = torch.load(os.path.join(tmp, "None.pt"))
            for name, chunk in cases:
                r = results[name]
                diff = (torch.load(os.path.join(tmp, f"{chunk}.pt")) - reference).abs().max().item()
                table.row(
                    [
                        size,
                        name,
                        f"{r['rise_mib']:,.0f}",
                        f"{r['rise_mib'] - r['grad_mib']:,.0f}",
                        f"{r['grad_mib']:,.0f}",
                        f"{full['rise_mib'] / r['rise_mib']:.2f}",
                        f"{r['seconds']:.2f}",
                        f"{diff:.2e}",
                    ]
                )


# -- part 3: packed against padded ----------------------------------------------------------------------
PACKING_SHAPE = dict(P=512, R=64, G=8)


def bf16_is_faster() -> tuple[bool, str]:
    """Whether this CPU's bfloat16 matmul beats float32 (oneDNN uses AVX512-BF16 / AMX where present)."""
    rates = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(1024, 2048, dtype=dtype), torch.randn(2048, 2048, dtype=dtype)
        a @ b  # warm-up: kernel selection
        rates[dtype] = 2 * 1024 * 2048 * 2048 / median_time(functools.partial(torch.matmul, a, b), 5) / 1e9
    faster = rates[torch.bfloat16] > 1.2 * rates[torch.float32]
    return faster, f"matmul GFLOP/s: float32 {rates[torch.float32]:.0f}, bfloat16 {rates[torch.bfloat16]:.0f}"


def policy_step(model, tokens, autocast: bool) -> torch.Tensor:
    """The policy's part of a training step: completion log-probs with gradient, then backward."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logprobs = completion_logprobs(model, tokens, 1.0)
    (logprobs * tokens.completion_mask).sum().backward()
    model.zero_grad(set_to_none=True)
    return logprobs.detach()


def packing_case(size: str, autocast: bool, reps: int, max_step_s: float) -> dict:
    """In a fresh process: each layout's warm-up step (its peak memory), then ``reps`` timed steps of each,
    interleaved. A layout whose warm-up took longer than ``max_step_s`` is not timed further; the padded
    one is not run at all when the packed warm-up times the token ratio exceeds three times that."""
    P, R, G = PACKING_SHAPE["P"], PACKING_SHAPE["R"], PACKING_SHAPE["G"]
    model = build_model(size, max_positions=4096)  # positions beyond P + R are allowed
    batch = trajectories(1, G, P, R)
    layouts = {name: collate(batch, PAD, packing=name).tokens for name in ("shared_prompt", "padded")}
    layouts["shared_prompt"].attention.backend = "sdpa"  # the CPU backend (what `auto` resolves to here)
    out = {"token_ratio": layouts["padded"].tokens_computed / layouts["shared_prompt"].tokens_computed}
    logprobs = {}
    for name, tokens in layouts.items():  # packed first: it bounds the padded step before that runs
        if name == "padded":
            estimate = out["shared_prompt"]["warmup_s"] * out["token_ratio"]
            if estimate > 3 * max_step_s:
                out[name] = dict(skipped=f"about {estimate:.0f} s a step")
                continue
        base = reset_peak()
        start = time.perf_counter()
        logprobs[name] = policy_step(model, tokens, autocast)
        out[name] = dict(warmup_s=time.perf_counter() - start, peak_mib=peak_rise_mib(base), times=[])
    timed = [name for name in layouts if out[name].get("warmup_s", float("inf")) <= max_step_s]
    for _ in range(reps):
        for name in timed:
            out[name]["times"].append(seconds(functools.partial(policy_step, model, layouts[name], autocast)))
    for name in timed:
        out[name]["median_s"] = statistics.median(out[name]["times"])
    if len(logprobs) == 2:
        mask = layouts["padded"].completion_mask
        out["max_diff"] = (logprobs["padded"] - logprobs["shared_prompt"]).float().abs()[mask].max().item()
    return out


def step_seconds(layout: dict) -> str:
    if "skipped" in layout:
        return f"skipped ({layout['skipped']})"
    if "median_s" in layout:
        return f"{layout['median_s']:.3f}"
    return f"{layout['warmup_s']:.1f} (1 step)"


def speedup(padded: dict, packed: dict) -> str:
    """Medians where both layouts were timed, else their warm-up steps (said so)."""
    if "median_s" in padded and "median_s" in packed:
        return f"{padded['median_s'] / packed['median_s']:.2f}x"
    if "warmup_s" in padded:
        return f"{padded['warmup_s'] / packed['warmup_s']:.2f}x (warm-ups)"
    return "-"


def run_packing(sizes: list[str], reps: int, max_step_s: float, dtype: str) -> None:
    if dtype == "auto":
        autocast, rates = bf16_is_faster()
        why = f"{rates}: {'bfloat16 autocast' if autocast else 'float32 (bfloat16 not faster here)'}"
    else:
        autocast, why = dtype == "bfloat16", f"{dtype} (--packing-dtype)"
    P, R, G = PACKING_SHAPE["P"], PACKING_SHAPE["R"], PACKING_SHAPE["G"]
    print(
        f"\n## 3. Policy log-probs forward + backward, one group: P={P}, R={R}, G={G}; "
        f"shared-prompt packed against padded\n"
        f"Compute: {why}.\n"
        f"Median of {reps} after a warm-up step, the layouts interleaved; MiB: peak rise of the warm-up step.\n"
        f"'max |diff|': padded against packed log-probs. "
        f"A layout whose warm-up step took over {max_step_s:.0f} s is not\n"
        f"timed further ('(1 step)': its warm-up); the padded step is not run when the packed warm-up times the\n"
        f"token ratio exceeds {3 * max_step_s:.0f} s."
    )
    table = Table(
        "padded / packed",
        [
            "size",
            "token ratio",
            "padded s",
            "packed s",
            "speedup",
            "padded MiB",
            "packed MiB",
            "MiB ratio",
            "max |diff|",
        ],
        wide={"padded s": 12, "speedup": 17},
    )
    for size in sizes:
        r = in_fresh_process(packing_case, size, autocast, reps, max_step_s)
        packed, padded = r["shared_prompt"], r["padded"]
        ran = "peak_mib" in padded
        table.row(
            [
                size,
                f"{r['token_ratio']:.2f}",
                step_seconds(padded),
                step_seconds(packed),
                speedup(padded, packed),
                f"{padded['peak_mib']:,.0f}" if ran else "-",
                f"{packed['peak_mib']:,.0f}",
                f"{padded['peak_mib'] / packed['peak_mib']:.2f}" if ran else "-",
                f"{r['max_diff']:.2e}" if "max_diff" in r else "-",
            ]
        )


# -- entry point ----------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--reps", type=int, default=15, help="timed syncs and memcpys per row of part 1")
    parser.add_argument("--packing-reps", type=int, default=3, help="timed steps per layout of part 3")
    parser.add_argument(
        "--chunk-sizes",
        nargs="+",
        type=int,
        default=[1024, 128],
        help="logprob_chunk_size values of part 2 (1024: lit_parl's default)",
    )
    parser.add_argument(
        "--max-step-s",
        type=float,
        default=60.0,
        help="part 3: a layout whose warm-up step takes longer is not timed further",
    )
    parser.add_argument("--packing-dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    args = parser.parse_args()
    torch.set_num_threads(THREADS)
    transformers_logging.disable_progress_bar()  # save_pretrained's bar would fill the log
    started = time.perf_counter()
    print(machine_line())
    print(
        "parameters (vocabulary 151,936, tied embeddings): "
        + ", ".join(f"{s} = {parameter_count(s):,}" for s in args.sizes)
    )
    if "sync" in args.parts:
        run_sync(args.sizes, args.reps)
    if "memory" in args.parts:
        run_memory(args.sizes, args.chunk_sizes)
    if "packing" in args.parts:
        run_packing(args.sizes, args.packing_reps, args.max_step_s, args.packing_dtype)
    print(f"\n{machine_line()}\ntotal {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
