"""Training data for drafters: prompts -> the target's own responses (batched, resumable,
cached as JSON lines) -> blocks at random anchor positions, as DFlash trains.

A record is ``{"id": str, "prompt": [token ids], "response": [token ids]}``. A block anchored at
position ``a`` of ``seq = prompt + response`` has the root ``seq[a]`` (its context is
``seq[:a]``) and labels ``seq[a + 1 : a + D]``; positions past the end are invalid.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Iterable

import torch

log = logging.getLogger(__name__)


def read_records(path: str) -> list[dict]:
    """Records of a JSON-lines cache; a torn last line (an interrupted write) is dropped."""
    if not os.path.exists(path):
        return []
    records = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                log.warning("%s:%d: dropping an incomplete record (interrupted write?)", path, line_no)
    return records


def _rewrite_if_torn(path: str, records: list[dict]) -> None:
    """After an interrupted write the file may end inside a record; appending to it would glue
    the next record onto the torn one. Rewrite it with just the complete records."""
    if not os.path.exists(path):
        return
    with open(path, "rb") as f:
        data = f.read()
    if not data or (data.endswith(b"\n") and data.count(b"\n") == len(records)):
        return
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    os.replace(tmp, path)


def generate_responses(target, prompts: list[tuple[str, list[int]]], path: str, max_new_tokens: int = 256,
                       batch_size: int = 8, temperature: float = 0.0, stop_token_ids: Iterable[int] = (),
                       seed: int = 0, progress: bool = True) -> list[dict]:
    """The target's responses to ``prompts`` (``(id, token ids)`` pairs), appended to ``path``
    batch by batch; prompts already in ``path`` are skipped, so a killed run resumes. Returns
    every record of ``path`` in prompt order."""
    from ..decoding import SpeculativeDecoder, left_pad
    cached = read_records(path)
    _rewrite_if_torn(path, cached)
    done = {r["id"]: r for r in cached}
    todo = [(pid, ids) for pid, ids in prompts if pid not in done]
    if done and todo:
        log.info("resuming response generation: %d of %d prompts already cached in %s", len(done), len(prompts),
                 path)
    if todo:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        decoder = SpeculativeDecoder(target, None, "ar")
        device = next(target.parameters()).device
        bar = None
        if progress:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(todo), desc="target responses", unit="prompt")
        # longest first keeps padding low inside a batch
        todo.sort(key=lambda item: -len(item[1]))
        for start in range(0, len(todo), batch_size):
            chunk = todo[start:start + batch_size]
            input_ids, mask = left_pad([ids for _, ids in chunk])
            width = input_ids.shape[1]
            gen = torch.Generator(device=device).manual_seed(seed + start)
            out = decoder.generate(input_ids, mask, max_new_tokens=max_new_tokens, temperature=temperature,
                                   stop_token_ids=stop_token_ids, generator=gen)
            with open(path, "a") as f:
                for b, (pid, ids) in enumerate(chunk):
                    n = out.stats.requests[b].new_tokens
                    rec = {"id": pid, "prompt": list(ids), "response": out.sequences[b, width:width + n].tolist()}
                    done[pid] = rec
                    f.write(json.dumps(rec) + "\n")
                f.flush()
                os.fsync(f.fileno())
            if bar is not None:
                bar.update(len(chunk))
        if bar is not None:
            bar.close()
    return [done[pid] for pid, _ in prompts if pid in done]


@dataclasses.dataclass
class BlockBatch:
    """One training batch: ``sequences int64[S, T]`` (right-padded, ``lengths int64[S]``) and
    ``num_blocks`` anchors per sequence."""

    sequences: torch.Tensor
    lengths: torch.Tensor
    anchors: torch.Tensor     # int64[S, n]: root positions
    block_seq: torch.Tensor   # int64[S * n]: the sequence of each block
    indices: list[int] = dataclasses.field(default_factory=list)  # the sampler's sequence numbers


class BlockSampler:
    """Deterministic batches of sequences and anchors: step ``s`` of epoch ``e`` always gives the
    same sequences and anchors whatever the number of processes, so a distributed run is the
    single-process run split by sequence."""

    def __init__(self, records: list[dict], block_size: int, batch_size: int, blocks_per_sequence: int,
                 max_length: int = 512, seed: int = 0) -> None:
        seqs = []
        for r in records:
            seq = (list(r["prompt"]) + list(r["response"]))[:max_length]
            first = max(0, len(r["prompt"]) - 1)   # the first root: the last prompt token
            if len(seq) - 2 >= first:               # at least one label
                seqs.append((seq, first))
        if not seqs:
            raise ValueError("no usable training sequence (every response is empty?)")
        if batch_size > len(seqs):
            raise ValueError(f"batch_size {batch_size} exceeds the {len(seqs)} usable sequences")
        self.seqs, self.block_size, self.batch_size = seqs, block_size, batch_size
        self.blocks_per_sequence, self.seed = blocks_per_sequence, seed

    @property
    def steps_per_epoch(self) -> int:
        return len(self.seqs) // self.batch_size

    def batch(self, step: int, rank: int = 0, world: int = 1) -> BlockBatch:
        """This process's share (every ``world``-th sequence from ``rank``) of global batch ``step``."""
        if self.batch_size % world:
            raise ValueError(f"batch_size {self.batch_size} must be divisible by the {world} processes")
        epoch, index = divmod(step, self.steps_per_epoch)
        order = torch.randperm(len(self.seqs), generator=torch.Generator().manual_seed(self.seed * 100003 + epoch))
        picked = order[index * self.batch_size:(index + 1) * self.batch_size][rank::world].tolist()
        width = max(len(self.seqs[i][0]) for i in picked)
        seqs = torch.zeros(len(picked), width, dtype=torch.int64)
        lengths = torch.zeros(len(picked), dtype=torch.int64)
        anchors = torch.zeros(len(picked), self.blocks_per_sequence, dtype=torch.int64)
        for row, i in enumerate(picked):
            seq, first = self.seqs[i]
            seqs[row, :len(seq)] = torch.tensor(seq)
            lengths[row] = len(seq)
            gen = torch.Generator().manual_seed(self.seed * 7919 + step * 104729 + i)
            anchors[row] = torch.randint(first, len(seq) - 1, (self.blocks_per_sequence,), generator=gen)
        block_seq = torch.arange(len(picked)).repeat_interleave(self.blocks_per_sequence)
        return BlockBatch(seqs, lengths, anchors, block_seq, picked)
