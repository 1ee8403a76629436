"""Engine: the API's asyncio-facing handle on the model, its scheduler and its tokenizer.

Every method that touches tensors runs on the scheduler thread (`Scheduler.call` or
`Scheduler.submit`); the coroutines here only await results. The engine speaks in token
ids and state blobs, never in HTTP.
"""

from __future__ import annotations

import math
from collections.abc import Generator
from dataclasses import dataclass

import torch

from model import LanguageModel
from model.sampling import SamplingParams
from model.tokenizer import Tokenizer

from .requests import Generation
from .scheduler import Scheduler


@dataclass(frozen=True)
class Consumed:
    """The outcome of teacher-forcing tokens into a state."""

    logprobs: list[float | None]  # None where the state had no context at all
    state: bytes | None  # the new state, when asked for
    n_tokens: int


class Engine:
    def __init__(
        self,
        lm: LanguageModel,
        *,
        name: str,
        state_dtype: str = "float32",
        max_batch_size: int = 32,
        cpu_threads: int = 0,
    ):
        if cpu_threads:
            # tiny decode steps gain nothing from intra-op threads and lose a lot to contention
            torch.set_num_threads(cpu_threads)
        if lm.tokenizer is None:
            raise ValueError("the model has no tokenizer")
        self.lm = lm
        self.name = name
        self.tokenizer: Tokenizer = lm.tokenizer
        self.fingerprint = lm.fingerprint
        self.state_dtype = state_dtype
        self.scheduler = Scheduler(lm, state_dtype=state_dtype, max_batch_size=max_batch_size)

    def start(self) -> None:
        self.scheduler.start()

    def stop(self) -> None:
        self.scheduler.stop()

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.vocab_size)

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def _chunks(self, ids: list[int]) -> list[list[int]]:
        n = self.lm.segment_len
        return [ids[i : i + n] for i in range(0, len(ids), n)]

    async def new_session(self, prompt: list[int]) -> Consumed:
        """A fresh state with BOS (if the model has one) and `prompt` consumed."""

        def run() -> Generator[None, None, Consumed]:
            bos = self.tokenizer.bos_id
            ids = ([bos] if bos is not None else []) + prompt
            state = self.lm.new_state(1)
            for k, chunk in enumerate(self._chunks(ids)):
                if k:
                    yield  # let decode steps run between chunks
                _, state = self.lm.consume(chunk, state)
            return Consumed([], state.to_bytes(self.state_dtype), int(state.n_tokens[0]))

        return await self.scheduler.call(run)

    async def score(self, state: bytes, tokens: list[int], keep_state: bool) -> Consumed:
        """Teacher-forced log-probs of `tokens` continuing `state` (and the new state)."""

        def run() -> Generator[None, None, Consumed]:
            st = self.lm.load_state(state)
            values: list[float | None] = []
            for k, chunk in enumerate(self._chunks(tokens)):
                if k:
                    yield  # let decode steps run between chunks
                lps, st = self.lm.consume(chunk, st)
                values += [None if math.isnan(x) else x for x in lps[0].tolist()]
            return Consumed(
                values, st.to_bytes(self.state_dtype) if keep_state else None, int(st.n_tokens[0])
            )

        return await self.scheduler.call(run)

    def generate(
        self,
        state: bytes,
        prompt: list[int],
        params: SamplingParams,
        *,
        seed: int | None,
        max_tokens: int,
        stop: list[str],
    ) -> Generation:
        """Start a generation; iterate the result for its tokens, then read `.result`."""
        gen = Generation(
            state=state, prompt=prompt, params=params, seed=seed, max_tokens=max_tokens, stop=stop
        )
        self.scheduler.submit(gen)
        return gen
