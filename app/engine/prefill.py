"""Chunked prefill's budget: how many prompt tokens an engine step consumes, and in which
chunks (`Scheduler.prefill_groups` takes them; the rows and their turns are the
scheduler's).

With nothing decoding, every prefilling row takes its next segment. While rows decode,
`tokens_per_step` (`Settings.prefill_tokens_per_step`) bounds how long a prompt arriving
stalls the streams (each decode step waits for the step's prompt chunks), times how many
rows wait on a prompt for each row that decodes, rounded up (TGI's `waiting_served_ratio`
weighs the same two counts). A long prompt arriving among streams is consumed at the budget
itself; a burst of requests arriving together, of which the first already decode, is not
held at the budget of one prompt: its prompts are consumed as many chunks a step as there
are rows waiting for their first token per decoding row, so the burst's rows reach their
first tokens (and decode together) sooner, and the decoding rows' gaps grow by that ratio
only while the waiting rows outnumber them. The budget grows up to one segment a step
(never below the setting): the most one prompt consumes in a step with nothing decoding, so
a client's flood of long prompts beside another's streams stretches their gaps to at most a
segment's prefill, for a shorter while than the setting alone would.

The budget is shared out evenly: each row takes at most its equal share, so that rows
consuming their prompts together take chunks of one length, one forward for them all
(bench/burst.py; docs/BENCHMARKS.md "A burst of prompts").
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .runner import Row


@dataclass
class PrefillBudget:
    tokens_per_step: int  # `Settings.prefill_tokens_per_step`
    segment_len: int  # the model's longest chunk

    def __post_init__(self) -> None:
        if self.tokens_per_step < 1:
            raise ValueError("prefill_tokens_per_step must be >= 1")

    def tokens(self, waiting: int, decoding: int) -> float:
        """The prompt tokens a step may consume, `waiting` rows on a prompt beside
        `decoding` rows (the module's docstring)."""
        if not decoding:
            return math.inf
        ratio = max(1, -(-waiting // decoding))
        return max(self.tokens_per_step, min(self.tokens_per_step * ratio, self.segment_len))

    def chunks(self, rows: list[Row], decoding: int) -> tuple[list[tuple[int, list[Row]]], int]:
        """This step's chunks of `rows` (in their turn): (chunk length, the rows that consume
        one that long), and how many of `rows`, from the first, were served."""
        budget = self.tokens(len(rows), decoding)
        share = self.segment_len if math.isinf(budget) else max(1, int(budget) // max(1, len(rows)))
        groups: dict[int, list[Row]] = collections.defaultdict(list)
        served = 0
        for r in rows:
            if budget <= 0:
                break
            size = int(min(self.segment_len, share, len(r.pending), budget))
            budget -= size
            groups[size].append(r)
            served += 1
        return list(groups.items()), served
