# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Qwen4Exp n-gram ids computed on the host, bit-identical to the model's hashing.

``NGramHasher`` turns a step's token ids (and each request's preceding
context) into the ids of the n-gram table's rows, with Python ints for a few
tokens, numpy for a decode step, or tensor ops on the inputs' device for a
prefill chunk: the staging of ``ple_mmap`` hashes a step before the forward
with it. Imports only torch, numpy and the standard library.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

_MASK64 = (1 << 64) - 1
_SIGN64 = 1 << 63


def _wrap_int64(value: int) -> int:
    """Python int -> the int64 two's-complement value torch would hold."""
    value &= _MASK64
    return value - (1 << 64) if value & _SIGN64 else value


class NGramHasher:
    """Host-side n-gram ids, bit-identical to ``compute_ngram_ids`` of the model.

    Tokens of request ``r`` are ``input_ids[query_start_loc[r]:query_start_loc[r + 1]]``
    (tokens past the last boundary belong to the last request, as on the device),
    preceded by ``ngram_context[r]`` (its previous ``ngram_size - 1`` tokens, EOS
    where there are none). An n-gram never reaches back across an EOS token.
    """

    # Steps up to this many tokens are mixed with Python ints in ids_numpy.
    PYTHON_MIX_MAX_TOKENS = 32

    def __init__(
        self,
        *,
        multipliers: Sequence[int],
        head_vocab_sizes: Sequence[int],
        head_offsets: Sequence[int],
        ngram_size: int,
        heads_per_ngram: int,
        eos_token_id: int,
    ) -> None:
        self.multipliers = [int(m) for m in multipliers]
        self.head_vocab_sizes = [int(s) for s in head_vocab_sizes]
        self.head_offsets = [int(o) for o in head_offsets]
        self.ngram_size = int(ngram_size)
        self.heads_per_ngram = int(heads_per_ngram)
        self.eos_token_id = int(eos_token_id)
        self.num_heads = (self.ngram_size - 1) * self.heads_per_ngram
        if len(self.multipliers) != self.ngram_size:
            raise ValueError(
                f"need {self.ngram_size} multipliers, got {len(self.multipliers)}"
            )
        if (
            len(self.head_vocab_sizes) != self.num_heads
            or len(self.head_offsets) != self.num_heads
        ):
            raise ValueError(f"need {self.num_heads} head sizes and offsets")
        self._tensors: dict[
            torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]
        ] = {}

    def mixed_hashes(
        self, input_ids: Sequence[int], query_start_loc: Sequence[int], ngram_context
    ) -> list[int]:
        """Per token, the mixed hash of each n-gram order (``ngram_size - 1`` ints).

        Python ints: cheaper than a dozen tensor ops for a decode step's tokens.
        """
        context_len = self.ngram_size - 1
        eos = self.eos_token_id
        multipliers = self.multipliers
        num_tokens = len(input_ids)
        num_reqs = len(query_start_loc) - 1
        hashes: list[int] = []
        for req in range(num_reqs):
            start = query_start_loc[req]
            end = num_tokens if req == num_reqs - 1 else query_start_loc[req + 1]
            if end <= start:
                continue
            seq = list(ngram_context[req][:context_len])
            seq += input_ids[start:end]
            for pos in range(context_len, len(seq)):
                mixed = seq[pos] * multipliers[0]
                shifted = seq[pos - 1]
                for shift in range(1, self.ngram_size):
                    if shift > 1 and shifted != eos:
                        shifted = seq[pos - shift]
                    mixed ^= shifted * multipliers[shift]
                    if mixed >= _SIGN64 or mixed < -_SIGN64:
                        mixed = _wrap_int64(mixed)
                    hashes.append(mixed)
        return hashes

    def ids_host(
        self, input_ids: Sequence[int], query_start_loc: Sequence[int], ngram_context
    ) -> torch.Tensor:
        """``[num_tokens, num_heads]`` int64 ids on the CPU from Python lists."""
        _, sizes, offsets = self._head_tensors(torch.device("cpu"))
        mixed = torch.tensor(
            self.mixed_hashes(input_ids, query_start_loc, ngram_context),
            dtype=torch.long,
            device="cpu",
        )
        grouped = (self.ngram_size - 1, self.heads_per_ngram)
        ids = torch.remainder(mixed.view(-1, grouped[0], 1), sizes.view(grouped))
        return ids.add_(offsets.view(grouped)).view(-1, self.num_heads)

    def ids_numpy(
        self,
        input_ids: np.ndarray,
        query_start_loc: np.ndarray,
        ngram_context: np.ndarray,
    ) -> np.ndarray:
        """``[num_tokens, num_heads]`` int64 ids from host arrays, vectorised.

        The same arithmetic as ``ids_tensor`` (int64 products wrap, ``%`` of a
        positive size is non-negative), in a few numpy calls: a decode step's
        tokens cost microseconds instead of a dozen tensor dispatches.
        """
        if not hasattr(self, "_np_heads"):
            grouped = (self.ngram_size - 1, self.heads_per_ngram)
            self._np_multipliers = np.array(self.multipliers, dtype=np.int64)
            self._np_heads = (
                np.array(self.head_vocab_sizes, dtype=np.int64).reshape(grouped),
                np.array(self.head_offsets, dtype=np.int64).reshape(grouped),
            )
        sizes, offsets = self._np_heads
        context_len = self.ngram_size - 1
        if input_ids.size <= self.PYTHON_MIX_MAX_TOKENS:
            # A decode step: mixing a few Python ints beats two dozen numpy calls.
            mixed = self.mixed_hashes(
                input_ids.reshape(-1).tolist(),
                query_start_loc.tolist(),
                ngram_context.tolist(),
            )
            ids = np.array(mixed, dtype=np.int64).reshape(-1, context_len, 1) % sizes
            ids += offsets
            return ids.reshape(-1, self.num_heads)
        multipliers = self._np_multipliers
        tokens = input_ids.reshape(-1).astype(np.int64)
        qsl = query_start_loc.astype(np.int64)
        num_tokens, num_reqs = tokens.size, qsl.size - 1
        positions = np.arange(num_tokens)
        requests = np.searchsorted(qsl, positions, side="right") - 1
        np.clip(requests, 0, num_reqs - 1, out=requests)
        # Each request's context directly precedes its tokens in one flat sequence.
        token_slots = positions + (requests + 1) * context_len
        sequence = np.empty(num_tokens + num_reqs * context_len, dtype=np.int64)
        context_slots = (qsl[:num_reqs] + np.arange(num_reqs) * context_len)[:, None]
        sequence[context_slots + np.arange(context_len)] = ngram_context[
            :num_reqs, :context_len
        ]
        sequence[token_slots] = tokens
        mixed = tokens * multipliers[0]
        shifted = sequence[token_slots - 1]
        ids = np.empty((num_tokens, context_len, self.heads_per_ngram), dtype=np.int64)
        for shift in range(1, self.ngram_size):
            if shift > 1:
                shifted = np.where(
                    shifted == self.eos_token_id, shifted, sequence[token_slots - shift]
                )
            mixed ^= shifted * multipliers[shift]
            np.remainder(mixed[:, None], sizes[shift - 1], out=ids[:, shift - 1])
        ids += offsets
        return ids.reshape(num_tokens, self.num_heads)

    def _head_tensors(
        self, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if device not in self._tensors:
            self._tensors[device] = (
                torch.tensor(self.multipliers, dtype=torch.long, device=device),
                torch.tensor(self.head_vocab_sizes, dtype=torch.long, device=device),
                torch.tensor(self.head_offsets, dtype=torch.long, device=device),
            )
        return self._tensors[device]

    def ids_tensor(
        self,
        input_ids: torch.Tensor,
        query_start_loc: torch.Tensor,
        ngram_context: torch.Tensor,
    ) -> torch.Tensor:
        """``[num_tokens, num_heads]`` int64 ids, computed on the inputs' device."""
        device = input_ids.device
        multipliers, sizes, offsets = self._head_tensors(device)
        context_len = self.ngram_size - 1
        tokens = input_ids.reshape(-1).long()
        qsl = query_start_loc.to(device=device, dtype=torch.long)
        num_tokens, num_reqs = tokens.numel(), qsl.numel() - 1
        positions = torch.arange(num_tokens, device=device)
        requests = (torch.searchsorted(qsl, positions, right=True) - 1).clamp_(
            0, num_reqs - 1
        )
        # Each request's context directly precedes its tokens in one flat sequence.
        token_slots = positions + (requests + 1) * context_len
        context_slots = (
            qsl[:num_reqs] + torch.arange(num_reqs, device=device) * context_len
        ).unsqueeze(1) + torch.arange(context_len, device=device)
        sequence = torch.empty(
            num_tokens + num_reqs * context_len, dtype=torch.long, device=device
        )
        sequence[context_slots] = ngram_context[:num_reqs, :context_len].to(
            device=device, dtype=torch.long
        )
        sequence[token_slots] = tokens
        mixed = tokens * multipliers[0]
        shifted = sequence[token_slots - 1]
        blocks = []
        for shift in range(1, self.ngram_size):
            if shift > 1:
                shifted = torch.where(
                    shifted == self.eos_token_id, shifted, sequence[token_slots - shift]
                )
            mixed = torch.bitwise_xor(mixed, shifted * multipliers[shift])
            heads = slice(
                (shift - 1) * self.heads_per_ngram, shift * self.heads_per_ngram
            )
            blocks.append(
                torch.remainder(mixed.unsqueeze(-1), sizes[heads]) + offsets[heads]
            )
        return torch.cat(blocks, dim=-1)
