"""Packing a micro-batch's trajectories into rows, shared-prompt or padded (DESIGN.md §3).

Shared-prompt packing puts each group's prompt once, followed by its completions:
``[p, c_1[:-1], c_2[:-1], ...]``. Position ids run 0..P-1 over the prompt and restart at P for every
completion. The label ``c_i[0]`` is read from the prompt's last position, which all of the group's
completions share; ``c_i[t]`` is read from the position of ``c_i[t-1]``. A completion's last token is
only a label, so it never needs an input position.

Padded packing is the plain layout: one row ``[p, c_i[:-1]]`` per completion, right-padded, with causal
attention. Under causal attention no real token sees a right pad, so no mask is needed.

Both layouts give the same ``label_*`` description, so one function computes the completion log-probs
``[n_samples, T]`` from either. ``SharedPromptLayout`` carries everything the attention backends need.
It is built here, on the CPU, once per micro-batch, and reused by every layer and by all three models
of the tri-model.

Example::

    >>> batch = pack([([7, 8, 9], [[1, 2], [3]])], pad_id=0, shared_prompt=True)
    >>> batch.input_ids.tolist(), batch.position_ids.tolist()
    ([[7, 8, 9, 1]], [[0, 1, 2, 3]])
    >>> batch.label_positions.tolist(), batch.label_targets.tolist()
    ([2, 3, 2], [1, 2, 3])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# (prompt token ids, [completion token ids, ...]) for each group in the micro-batch
GroupTokens = tuple[list[int], list[list[int]]]


@dataclass
class SegmentBucket:
    """Segments gathered into a padded batch for mask-based kernels (sdpa, npu).

    ``query_index[s, i]`` and ``key_index[s, j]`` are flat token indices into ``B * L``. ``allowed[s, 0, i, j]``
    says whether query i of segment s sees key j. Padded query slots (``query_valid`` False) see key 0 only,
    so no softmax row is empty; their outputs are dropped.
    """

    query_index: torch.Tensor  # [S, Qmax] long
    key_index: torch.Tensor  # [S, Kmax] long
    allowed: torch.Tensor  # [S, 1, Qmax, Kmax] bool
    query_valid: torch.Tensor  # [S, Qmax] bool
    key_offset: torch.Tensor  # [S] k_len - q_len: query i is key i + key_offset (also its position in the segment's keys)

    def windowed(self, window: int) -> torch.Tensor:
        """``allowed`` restricted to a sliding window: query i sees key j only if (i + key_offset) - j < window.

        Key positions are contiguous within a segment (a completion's start right after its prompt's),
        so index distance is position distance."""
        i = torch.arange(self.allowed.shape[2], device=self.allowed.device)[None, None, :, None]
        j = torch.arange(self.allowed.shape[3], device=self.allowed.device)[None, None, None, :]
        mask = self.allowed & (j > i + self.key_offset[:, None, None, None] - window)
        mask[:, 0, :, 0] |= ~self.query_valid  # padded query slots still see key 0
        return mask


@dataclass
class SharedPromptLayout:
    """Which token sees which, in the forms the attention backends want.

    Each token belongs to one segment: a prompt, or one completion's input tokens. A token sees the
    earlier tokens of its own segment and, for a completion, all of its group's prompt.
    """

    segment_ids: torch.Tensor  # [B, L] segment of each token, -1 for padding
    positions: torch.Tensor  # [B, L] position ids (for sliding windows)
    visible_prompt: torch.Tensor  # [B, L] the prompt segment a token sees besides its own (itself for a prompt), -1 pad
    # varlen form (flash): segment s's queries are query_index[cu_q[s]:cu_q[s+1]], its keys key_index[cu_k[s]:cu_k[s+1]]
    query_index: torch.Tensor  # [Tq] long, every non-pad token exactly once
    key_index: torch.Tensor  # [Tk] long
    cu_seqlens_q: torch.Tensor  # [S + 1] int32
    cu_seqlens_k: torch.Tensor  # [S + 1] int32
    max_seqlen_q: int
    max_seqlen_k: int
    buckets: list[SegmentBucket]  # prompts and completions, padded separately (their lengths differ a lot)
    backend: str = "sdpa"  # set by the module before the forward


@dataclass
class PackedTokens:
    input_ids: torch.Tensor  # [B, L]
    position_ids: torch.Tensor | None  # [B, L]; None for padded rows (0..L-1)
    attention: SharedPromptLayout | None  # None: plain causal rows
    label_positions: torch.Tensor  # [N] flat index into B * L of the position whose logits predict the label
    label_targets: torch.Tensor  # [N] the label token ids
    label_slots: torch.Tensor  # [N] flat index into n_samples * T of the label's place in the output
    completion_mask: torch.Tensor  # [n_samples, T] bool
    tokens_computed: int  # non-pad input tokens the model runs over


def _bucket(segments: list[tuple[list[int], list[int]]]) -> SegmentBucket:
    """``segments``: (query token indices, key token indices), the queries being the keys' last tokens."""
    count = len(segments)
    q_max = max(len(q) for q, _ in segments)
    k_max = max(len(k) for _, k in segments)
    query_index = torch.zeros((count, q_max), dtype=torch.long)
    key_index = torch.zeros((count, k_max), dtype=torch.long)
    query_valid = torch.zeros((count, q_max), dtype=torch.bool)
    q_len = torch.tensor([len(q) for q, _ in segments])
    k_len = torch.tensor([len(k) for _, k in segments])
    for s, (queries, keys) in enumerate(segments):
        query_index[s, : len(queries)] = torch.tensor(queries)
        key_index[s, : len(keys)] = torch.tensor(keys)
        query_valid[s, : len(queries)] = True
    i = torch.arange(q_max)[None, :, None]
    j = torch.arange(k_max)[None, None, :]
    # bottom-right causal: query i is the (k_len - q_len + i)-th key
    allowed = (j < k_len[:, None, None]) & (j <= i + (k_len - q_len)[:, None, None])
    allowed = allowed & query_valid[:, :, None]
    allowed[:, :, 0] |= ~query_valid  # padded query slots see key 0 only
    return SegmentBucket(query_index, key_index, allowed[:, None], query_valid, k_len - q_len)


def pack(
    groups: list[GroupTokens],
    pad_id: int,
    shared_prompt: bool,
    max_row_tokens: int | None = None,
) -> PackedTokens:
    """Lay out ``groups`` for one forward pass. Samples are numbered in order: group by group, then
    completion by completion; the output rows of ``completion_mask`` follow that numbering."""
    completions = [c for _, cs in groups for c in cs]
    if any(len(c) == 0 for c in completions):
        raise ValueError("every completion needs at least one token")
    if any(len(p) == 0 for p, _ in groups):
        raise ValueError("every prompt needs at least one token (a completion's first token is read at the prompt's last position)")
    width = max(len(c) for c in completions)
    if shared_prompt:
        units = [[(prompt, cs)] for prompt, cs in groups]  # a unit is what shares one prompt
    else:
        units = [[(prompt, [c])] for prompt, cs in groups for c in cs]
    unit_sizes = [sum(len(p) + sum(len(c) - 1 for c in cs) for p, cs in unit) for unit in units]

    rows: list[list[int]] = [[]]  # unit indices per row
    row_len = 0
    for u, size in enumerate(unit_sizes):
        if rows[-1] and max_row_tokens is not None and row_len + size > max_row_tokens:
            rows.append([])
            row_len = 0
        rows[-1].append(u)
        row_len += size
    if not shared_prompt:
        rows = [[u] for u in range(len(units))]  # padded layout: one completion per row, always
    length = max(sum(unit_sizes[u] for u in row) for row in rows)

    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    position_ids = torch.zeros((len(rows), length), dtype=torch.long)
    segment_ids = torch.full((len(rows), length), -1, dtype=torch.long)
    visible_prompt = torch.full((len(rows), length), -1, dtype=torch.long)
    label_positions, label_targets, label_slots = [], [], []
    prompt_segments, completion_segments = [], []  # (query indices, key indices) in flat B * L
    varlen = []  # (query indices, key indices) in segment order
    sample = 0
    segment = 0
    for r, row in enumerate(rows):
        cursor = 0
        for u in row:
            for prompt, cs in units[u]:
                base = r * length
                P = len(prompt)
                prompt_tokens = list(range(base + cursor, base + cursor + P))
                input_ids[r, cursor : cursor + P] = torch.tensor(prompt)
                position_ids[r, cursor : cursor + P] = torch.arange(P)
                segment_ids[r, cursor : cursor + P] = segment
                visible_prompt[r, cursor : cursor + P] = segment
                prompt_segment = segment
                prompt_segments.append((prompt_tokens, prompt_tokens))
                varlen.append((prompt_tokens, prompt_tokens))
                segment += 1
                cursor += P
                last_prompt_position = prompt_tokens[-1]
                for completion in cs:
                    inputs = completion[:-1]
                    n = len(inputs)
                    own = list(range(base + cursor, base + cursor + n))
                    if n:
                        input_ids[r, cursor : cursor + n] = torch.tensor(inputs)
                        position_ids[r, cursor : cursor + n] = torch.arange(P, P + n)
                        segment_ids[r, cursor : cursor + n] = segment
                        visible_prompt[r, cursor : cursor + n] = prompt_segment
                        completion_segments.append((own, prompt_tokens + own))
                        varlen.append((own, prompt_tokens + own))
                        segment += 1
                    positions = [last_prompt_position, *own]
                    label_positions.extend(positions)
                    label_targets.extend(completion)
                    label_slots.extend(sample * width + t for t in range(len(completion)))
                    cursor += n
                    sample += 1

    completion_mask = torch.zeros((len(completions), width), dtype=torch.bool)
    for i, c in enumerate(completions):
        completion_mask[i, : len(c)] = True
    tokens_computed = int((segment_ids >= 0).sum())
    labels = dict(
        label_positions=torch.tensor(label_positions, dtype=torch.long),
        label_targets=torch.tensor(label_targets, dtype=torch.long),
        label_slots=torch.tensor(label_slots, dtype=torch.long),
        completion_mask=completion_mask,
        tokens_computed=tokens_computed,
    )
    if not shared_prompt:
        return PackedTokens(input_ids=input_ids, position_ids=None, attention=None, **labels)

    query_index = torch.tensor([t for q, _ in varlen for t in q], dtype=torch.long)
    key_index = torch.tensor([t for _, k in varlen for t in k], dtype=torch.long)
    cu_q = torch.tensor([0] + [len(q) for q, _ in varlen], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_k = torch.tensor([0] + [len(k) for _, k in varlen], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    buckets = [_bucket(prompt_segments)]
    if completion_segments:
        buckets.append(_bucket(completion_segments))
    attention = SharedPromptLayout(
        segment_ids=segment_ids,
        positions=position_ids,
        visible_prompt=visible_prompt,
        query_index=query_index,
        key_index=key_index,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=max(len(q) for q, _ in varlen),
        max_seqlen_k=max(len(k) for _, k in varlen),
        buckets=buckets,
    )
    return PackedTokens(input_ids=input_ids, position_ids=position_ids, attention=attention, **labels)


def dense_allowed(layout: SharedPromptLayout, window: int | None = None) -> torch.Tensor:
    """The full ``[B, 1, L, L]`` boolean mask of the layout (the test reference; O(L²) memory).

    A pad token sees the earlier pads of its row, itself included, so no softmax row is empty. With a
    sliding ``window``, a real token sees a key only if their positions differ by less than ``window``.
    """
    seg, visible = layout.segment_ids, layout.visible_prompt
    L = seg.shape[1]
    causal = torch.ones((L, L), dtype=torch.bool, device=seg.device).tril()
    same = seg[:, :, None] == seg[:, None, :]
    sees_prompt = visible[:, :, None] == seg[:, None, :]
    allowed = causal & (same | sees_prompt)
    if window is not None:
        near = (layout.positions[:, :, None] - layout.positions[:, None, :]) < window
        allowed = allowed & (near | (seg[:, :, None] < 0))  # pads keep their causal pad block
    return allowed[:, None]
