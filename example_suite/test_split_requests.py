"""Finding each prompt in vLLM's flattened batch (no engine needed)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from example_suite.hidden_states import ForwardCapture, split_requests  # noqa: E402

pytestmark = pytest.mark.needs_clean_gpus


def _forward(*runs: tuple[list[int], list[int]]) -> ForwardCapture:
    # Concatenate (token ids, positions) runs the way vLLM flattens a step's requests.
    ids = [t for run_ids, _ in runs for t in run_ids]
    positions = [p for _, run_positions in runs for p in run_positions]
    return ForwardCapture(input_ids=torch.tensor(ids), positions=torch.tensor(positions))


def test_finds_prompts_in_any_order_next_to_padding_and_decode_tokens() -> None:
    long, prefix, other = [1, 5, 6, 7, 8], [1, 5, 6], [1, 9]
    fwd = _forward(
        (other, [0, 1]),
        ([42], [17]),  # a decode token of some other request
        (long, [0, 1, 2, 3, 4]),
        (prefix, [0, 1, 2]),
        ([0, 0], [0, 0]),  # padding
    )
    found = split_requests([fwd], [long, prefix, other])
    assert [start for _, start in found] == [3, 8, 0]


def test_identical_prompts_get_their_own_runs_across_forwards() -> None:
    prompt = [1, 5, 6]
    first = _forward((prompt, [0, 1, 2]))
    second = _forward(([1, 9], [0, 1]), (prompt, [0, 1, 2]))
    found = split_requests([first, second], [prompt, [1, 9], prompt])
    assert [(fwd is second, start) for fwd, start in found] == [(False, 0), (True, 0), (True, 2)]


def test_a_prompt_not_prefilled_whole_is_an_error() -> None:
    # What chunked prefill or a prefix-cache hit would produce: the prompt's tail only.
    fwd = _forward(([6, 7], [2, 3]))
    with pytest.raises(RuntimeError, match="not found whole"):
        split_requests([fwd], [[1, 5, 6, 7]])
