"""Drive vLLM's V1 rejection sampler on the CPU build's C++ stand-ins, many draws at once.

Run in its own process (tests/mtp_pruning/test_mtp_pruning_cpu_rejection.py): installing the
stand-ins rebinds module globals of vllm.v1.sample.rejection_sampler, which must not leak into the
test process. Writes one JSON object to --out.

A batch of N requests with the same target logits and the same draft tokens is N independent
draws: each request gets its own uniform and its own exponential noise row, as in a real step.
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import vllm.v1.sample.rejection_sampler as rs
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.worker.cpu_model_runner import CPUModelRunner

# The target's logits over a 16-id vocabulary: 8 even ids (the keep-set) and 8 odd ids, the odd
# ones carrying a real share of the mass, so that a sampler biased towards the drafts' ids shows.
TARGET_LOGITS = [2.0, 2.2, 1.0, 1.6, 0.5, 1.1, 0.0, 0.4, -0.5, 0.2, -1.0, -0.3, -1.5, -0.8, -2.0, -1.2]
TEMPERATURE = 0.7


def metadata(batch: int, temperature: float) -> SamplingMetadata:
    """All-random sampling metadata as the V1 runner builds it for BATCH seedless requests."""
    return SamplingMetadata(
        temperature=torch.full((batch,), temperature),
        all_greedy=False,
        all_random=True,
        top_p=None,
        top_k=None,
        generators={},
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(batch),
        presence_penalties=torch.zeros(batch),
        repetition_penalties=torch.ones(batch),
        output_token_ids=[[] for _ in range(batch)],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
    )


def sample(target_logits: torch.Tensor, drafts: list[int], batch: int, temperature: float, *, tempered: bool):
    """rejection_sample over BATCH requests that each propose DRAFTS (draft_probs=None, as MTP does).

    tempered=True divides the logits by the temperature here (what the Triton expand kernel gives on
    a GPU); tempered=False takes vLLM's own apply_sampling_constraints, i.e. the CPU stand-in of
    expand_kernel. Returns the [batch, k + 1] output ids.
    """
    k = len(drafts)
    logits = target_logits.repeat(batch * k, 1).contiguous()
    cu = torch.arange(1, batch + 1, dtype=torch.int32) * k
    md = metadata(batch, temperature)
    if tempered:
        logits = logits / temperature
    else:
        logits = rs.apply_sampling_constraints(logits, cu, md)
    draft_ids = torch.tensor(drafts * batch, dtype=torch.int32)
    bonus = torch.full((batch, 1), -2, dtype=torch.int32)  # recognisable: never a real id
    return rs.rejection_sample(draft_ids, [k] * batch, k, cu, None, logits, bonus, md)


def position_stats(out: torch.Tensor, drafts: list[int], vocab: int) -> dict:
    """Histogram of the first output id, and the share of each draft position accepted."""
    first = out[:, 0].to(torch.int64)
    hist = torch.bincount(first.clamp(min=0), minlength=vocab)[:vocab].tolist()
    accepted = torch.ones(out.shape[0], dtype=torch.bool)
    rates = []
    for pos, draft in enumerate(drafts):
        # Position pos is accepted when it holds the draft and the next slot is filled (the kernel
        # writes the next position or the bonus only after an acceptance).
        accepted = accepted & (out[:, pos] == draft) & (out[:, pos + 1] != rs.PLACEHOLDER_TOKEN_ID)
        rates.append(accepted.double().mean().item())
    return {"hist": hist, "accepted": rates, "draft_in_first": (first == drafts[0]).double().mean().item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write the figures to")
    parser.add_argument("--draws", type=int, default=20000, help="requests per batch (draws)")
    args = parser.parse_args()

    torch.manual_seed(0)
    CPUModelRunner._postprocess_triton(None)  # the CPU model runner's own stand-in install step
    result = {"stand_in": rs.expand_kernel.func.__module__ + "." + rs.expand_kernel.func.__name__}

    target_logits = torch.tensor([TARGET_LOGITS])
    vocab = target_logits.shape[1]
    target = torch.softmax(target_logits[0] / TEMPERATURE, -1)
    result["target"] = target.tolist()

    # 1. The sampler alone, fed tempered logits: drafts from the even keep-set (pruned head) and
    #    from the full vocabulary (the target's own argmax 1, unpruned head).
    for name, drafts in (("pruned", [0, 2, 4]), ("unpruned", [1, 3, 5])):
        out = sample(target_logits, drafts, args.draws, TEMPERATURE, tempered=True)
        result[name] = position_stats(out, drafts, vocab)

    # 2. vLLM's own temperature path on the CPU build. The expand stand-in, called as
    #    expand_batch_to_tokens calls it, on an output prefilled with a sentinel: float32 (the
    #    temperature, top_p) and int64 (a control); then expand_batch_to_tokens itself (an
    #    uninitialised new_empty output), then the whole path into the sampler.
    cu = torch.arange(1, 5, dtype=torch.int32)
    for dtype, value in ((torch.float32, TEMPERATURE), (torch.int64, 3)):
        dest = torch.full((4,), -5, dtype=dtype)
        rs.expand_kernel[(4,)](dest, torch.full((4,), value, dtype=dtype), cu, 0, 1, MAX_NUM_TOKENS=rs.MAX_SPEC_LEN)
        result[f"expand_into_sentinel_{str(dtype).removeprefix('torch.')}"] = dest.tolist()
    result["expanded_temperature"] = rs.expand_batch_to_tokens(
        torch.full((4,), TEMPERATURE), cu, 4, replace_from=0, replace_to=1
    ).tolist()
    out = sample(target_logits, [0, 2, 4], args.draws, TEMPERATURE, tempered=False)
    result["stock_path_pruned"] = position_stats(out, [0, 2, 4], vocab)

    # 3. What the C++ kernels do with NaN target probabilities (softmax of logits divided by a zero
    #    or NaN "temperature"): nothing is accepted and the recovered token is the draft itself.
    nan_logits = torch.full((1, vocab), math.nan)
    out = sample(nan_logits, [0, 2, 4], 256, 1.0, tempered=True)
    result["nan_probs"] = position_stats(out, [0, 2, 4], vocab)

    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
