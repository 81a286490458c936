"""Packing a micro-batch's trajectories into rows, shared-prompt or padded.

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

import itertools
from dataclasses import dataclass

import numpy as np
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
    key_offset: (
        torch.Tensor
    )  # [S] k_len - q_len: query i is key i + key_offset (also its position in the segment's keys)

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


_torch = torch.from_numpy  # the arrays become the layout's tensors without a copy


def _expand(lengths: np.ndarray, total: int) -> tuple[np.ndarray, np.ndarray]:
    """For ``lengths`` ``[S]`` summing to ``total``: (owner ``[total]``, offset ``[total]``), item k being the
    ``offset[k]``-th of ``owner[k]``'s ``lengths[owner[k]]`` items, in order."""
    owner = np.repeat(np.arange(lengths.shape[0]), lengths)
    offset = np.arange(total) - (lengths.cumsum() - lengths)[owner]
    return owner, offset


def _bucket(q_start: np.ndarray, q_len: np.ndarray, p_start: np.ndarray, p_len: np.ndarray) -> SegmentBucket:
    """Segments whose queries are the flat token indices ``q_start + [0, q_len)`` and whose keys are their
    prompt's ``p_start + [0, p_len)`` followed by the queries (``p_len`` 0: a prompt segment)."""
    k_len = p_len + q_len
    key_offset = k_len - q_len
    i = np.arange(q_len.max())[None, :]
    j = np.arange(k_len.max())[None, :]
    query_valid = i < q_len[:, None]
    query_index = (q_start[:, None] + i) * query_valid
    key_index = np.where(j < p_len[:, None], p_start[:, None] + j, q_start[:, None] + (j - p_len[:, None])) * (
        j < k_len[:, None]
    )
    # bottom-right causal: query i is the (key_offset + i)-th key (so it never sees past the segment's keys);
    # padded query slots see no key but key 0, so no softmax row is empty
    last_key = np.where(query_valid, i + key_offset[:, None], -1)
    allowed = j[:, None, :] <= last_key[:, :, None]
    allowed[:, :, 0] |= ~query_valid
    return SegmentBucket(
        _torch(query_index), _torch(key_index), _torch(allowed)[:, None], _torch(query_valid), _torch(key_offset)
    )


def pack(
    groups: list[GroupTokens],
    pad_id: int,
    shared_prompt: bool,
    max_row_tokens: int | None = None,
) -> PackedTokens:
    """Lay out ``groups`` for one forward pass. Samples are numbered in order: group by group, then
    completion by completion; the output rows of ``completion_mask`` follow that numbering.

    One Python pass over the samples records where each segment starts and where its tokens come from;
    every tensor is then expanded from that table by a fixed number of array ops, with no per-token
    Python work: the token ids cross into an array once, each prompt once. The ops are numpy's, turned
    into tensors at the end without a copy: on micro-batches of a few hundred tokens a torch op's fixed
    cost is most of its time, and this runs on the trainer's thread between steps."""
    completions = [c for _, cs in groups for c in cs]
    if any(len(c) == 0 for c in completions):
        raise ValueError("every completion needs at least one token")
    if any(len(p) == 0 for p, _ in groups):
        raise ValueError(
            "every prompt needs at least one token (a completion's first token is read at the prompt's last position)"
        )
    width = max(len(c) for c in completions)
    prompt_len = [len(p) for p, _ in groups]
    sample_len = [len(c) for c in completions]
    first_sample = [0]  # each group's first sample
    for _, cs in groups:
        first_sample.append(first_sample[-1] + len(cs))
    # a unit is what shares one prompt: (group, first sample, samples)
    if shared_prompt:
        units = [(g, first_sample[g], len(cs)) for g, (_, cs) in enumerate(groups)]
    else:
        units = [(g, s, 1) for g in range(len(groups)) for s in range(first_sample[g], first_sample[g + 1])]
    unit_sizes = [prompt_len[g] + sum(sample_len[s : s + k]) - k for g, s, k in units]

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

    # token ids cross into an array once: every prompt, then every completion (the label targets)
    prompt_tokens = [token for p, _ in groups for token in p]
    n_labels = sum(sample_len)
    label_targets = np.fromiter(itertools.chain.from_iterable(completions), dtype=np.int64, count=n_labels)
    source = np.concatenate([np.array(prompt_tokens, dtype=np.int64), label_targets])
    prompt_source = [0]  # where each group's prompt starts in `source`
    for P in prompt_len:
        prompt_source.append(prompt_source[-1] + P)
    sample_source = [len(prompt_tokens)]  # where each completion starts in `source`
    for R in sample_len:
        sample_source.append(sample_source[-1] + R)

    # one row per segment, in segment order (a prompt, then its completions that have input tokens):
    # (flat index of its first token in B * L, tokens, position of its first token, the prompt segment it
    #  sees (itself for a prompt), flat start and length of the prompt keys before its own (0, 0 for a
    #  prompt), where its tokens start in `source`)
    segments: list[tuple[int, int, int, int, int, int, int]] = []
    prompt_segments: list[int] = []
    completion_segments: list[int] = []
    label_anchor: list[int] = []  # per sample: the prompt's last position, which reads its first label
    label_start: list[int] = []  # per sample: its first input token's position, which reads its second label
    prompt_keys = 0  # keys the completion segments read from their prompts
    for r, row in enumerate(rows):
        cursor = r * length
        for u in row:
            g, first, count = units[u]
            P = prompt_len[g]
            prompt_start, prompt_segment = cursor, len(segments)
            prompt_segments.append(prompt_segment)
            segments.append((cursor, P, 0, prompt_segment, 0, 0, prompt_source[g]))
            cursor += P
            prompt_last = cursor - 1
            for s in range(first, first + count):
                n = sample_len[s] - 1
                label_anchor.append(prompt_last)
                label_start.append(cursor)
                if n:
                    completion_segments.append(len(segments))
                    segments.append((cursor, n, P, prompt_segment, prompt_start, P, sample_source[s]))
                    prompt_keys += P
                    cursor += n

    table = np.array(segments, dtype=np.int64)
    seg_start, seg_len, seg_position, seg_visible, seg_prompt_start, seg_prompt_len, seg_source = table.T
    total = sum(unit_sizes)
    owner, offset = _expand(seg_len, total)
    token_index = seg_start[owner] + offset  # flat index of every non-pad token, in segment order
    input_ids = np.full((len(rows), length), pad_id, dtype=np.int64)
    input_ids.reshape(-1)[token_index] = source[seg_source[owner] + offset]

    lengths = np.array(sample_len, dtype=np.int64)
    sample, t = _expand(lengths, n_labels)
    anchor = np.array(label_anchor, dtype=np.int64)
    start = np.array(label_start, dtype=np.int64)
    labels = {
        # label t of a sample is read at the prompt's last position (t = 0), else at its input token t - 1
        "label_positions": _torch(np.where(t == 0, anchor[sample], start[sample] + t - 1)),
        "label_targets": _torch(label_targets),
        "label_slots": _torch(sample * width + t),
        "completion_mask": _torch(np.arange(width)[None, :] < lengths[:, None]),
        "tokens_computed": total,
    }
    if not shared_prompt:
        return PackedTokens(input_ids=_torch(input_ids), position_ids=None, attention=None, **labels)

    position_ids = np.zeros((len(rows), length), dtype=np.int64)
    segment_ids = np.full((len(rows), length), -1, dtype=np.int64)
    visible_prompt = np.full((len(rows), length), -1, dtype=np.int64)
    position_ids.reshape(-1)[token_index] = seg_position[owner] + offset
    segment_ids.reshape(-1)[token_index] = owner
    visible_prompt.reshape(-1)[token_index] = seg_visible[owner]

    # varlen: segment s's keys are its prompt's tokens (none for a prompt's own segment), then its own
    key_len = seg_prompt_len + seg_len
    key_owner, j = _expand(key_len, total + prompt_keys)
    key_prompt_len = seg_prompt_len[key_owner]
    key_index = np.where(
        j < key_prompt_len, seg_prompt_start[key_owner] + j, seg_start[key_owner] + (j - key_prompt_len)
    )
    cu_q = np.concatenate([[0], seg_len]).cumsum(dtype=np.int32)
    cu_k = np.concatenate([[0], key_len]).cumsum(dtype=np.int32)

    def bucket(members: list[int]) -> SegmentBucket:
        index = np.array(members, dtype=np.int64)
        return _bucket(seg_start[index], seg_len[index], seg_prompt_start[index], seg_prompt_len[index])

    buckets = [bucket(prompt_segments)]
    if completion_segments:
        buckets.append(bucket(completion_segments))
    positions = _torch(position_ids)
    attention = SharedPromptLayout(
        segment_ids=_torch(segment_ids),
        positions=positions,
        visible_prompt=_torch(visible_prompt),
        query_index=_torch(token_index),
        key_index=_torch(key_index),
        cu_seqlens_q=_torch(cu_q),
        cu_seqlens_k=_torch(cu_k),
        max_seqlen_q=int(seg_len.max()),
        max_seqlen_k=int(key_len.max()),
        buckets=buckets,
    )
    return PackedTokens(input_ids=_torch(input_ids), position_ids=positions, attention=attention, **labels)


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
