"""The reference backend: transformers' own `generate` on static, left-padded batches.

It stays as the yardstick for correctness and speed of `LLMEngine`. Each step takes the most urgent waiting
requests that can share one `generate` call (same sampling settings), pads them to the longest prompt and
runs them to the longest output, which is exactly the waste our own engine exists to remove.
"""

from __future__ import annotations

import heapq
import itertools
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList

from engine.config import model_dtype
from engine.core.output_text import finish_text, think_ids
from engine.interface import (
    Completion,
    EngineStats,
    FinishReason,
    Request,
    RequestError,
    Timings,
    check_prompt,
)


class _Clock(LogitsProcessor):
    """Called once per generated token: the first call marks the end of prefill."""

    def __init__(self) -> None:
        self.first: float | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.first is None:
            self.first = time.monotonic()
        return scores


class _Presence(LogitsProcessor):
    """OpenAI's presence penalty, which transformers lacks: `penalty` off every token already generated."""

    def __init__(self, start: int, penalty: float) -> None:
        self.start, self.penalty = start, penalty

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        generated = input_ids[:, self.start:]
        if generated.shape[1] == 0:
            return scores
        return scores - self.penalty * torch.zeros_like(scores, dtype=torch.bool).scatter_(1, generated, True)


class _ThinkingBudget(LogitsProcessor):
    """Forces `</think>` once a row's open `<think>` block holds `budget` tokens, as `LLMEngine` does."""

    def __init__(self, start: int, budget: int, think_ids: tuple[int, int]) -> None:
        self.start, self.budget, (self.opening, self.closing) = start, budget, think_ids

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for row, generated in enumerate(input_ids[:, self.start:].tolist()):
            if self.opening not in generated:
                continue
            block = generated[len(generated) - generated[::-1].index(self.opening):]
            if self.closing not in block and len(block) >= self.budget:
                scores[row] = float("-inf")
                scores[row, self.closing] = 0.0
        return scores


class HFEngine:
    def __init__(self, model_path: str, device: str = "cpu", dtype: str = "auto", max_batch_size: int = 16):
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.tokenizer.padding_side = "left"
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=model_dtype(dtype, device))
        self.model.to(device).eval()
        self.device = device
        self.max_batch_size = max_batch_size
        self.max_model_len = int(self.model.config.max_position_embeddings)
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(self.eos_ids)
        self.think_ids = think_ids(self.tokenizer)
        self._waiting: list[tuple[int, float, int, Request]] = []
        self._order = itertools.count()
        self._batches = 0

    def add_request(self, request: Request) -> None:
        check_prompt(len(request.prompt_ids), request.sampling.max_new_tokens, self.max_model_len)
        if request.sampling.grammar is not None or request.sampling.logprobs is not None:
            raise RequestError("the hf reference backend has no grammars and no log-probabilities; "
                               "run our own (CONVOQ_BACKEND=engine)")
        heapq.heappush(self._waiting, (-request.priority, request.arrival, next(self._order), request))

    def abort_request(self, request_id: str) -> Completion | None:
        for i, (_, _, _, request) in enumerate(self._waiting):
            if request.request_id == request_id:
                self._waiting.pop(i)
                heapq.heapify(self._waiting)
                return Completion.empty(request_id, len(request.prompt_ids), FinishReason.cancelled)
        return None

    def partial(self, request_id: str, at_least: int) -> list[int] | None:
        return None  # generate() hands back whole outputs only

    def has_unfinished(self) -> bool:
        return bool(self._waiting)

    def stats(self) -> EngineStats:
        return EngineStats(waiting=len(self._waiting), steps=self._batches)  # a step is one `generate` call

    def step(self) -> list[Completion]:
        batch = self._take_batch()
        start = time.monotonic()
        clock = _Clock()
        s = batch[0].sampling
        longest = max(len(r.prompt_ids) for r in batch)
        budget = [r.sampling.max_new_tokens for r in batch]  # each fits the context whole (`check_prompt`)
        input_ids = torch.full((len(batch), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        for i, r in enumerate(batch):
            input_ids[i, longest - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
            mask[i, longest - len(r.prompt_ids):] = 1
        if s.seed is not None:
            torch.manual_seed(s.seed)
        processors = [clock]
        if s.presence_penalty:
            processors.append(_Presence(longest, s.presence_penalty))
        if s.max_thinking_tokens is not None and self.think_ids is not None:
            processors.append(_ThinkingBudget(longest, s.max_thinking_tokens, self.think_ids))
        sampled = not s.greedy
        with torch.inference_mode():
            # every value explicit: what is left out, generate takes from the model's generation_config
            out = self.model.generate(
                input_ids=input_ids.to(self.device),
                attention_mask=mask.to(self.device),
                max_new_tokens=max(budget),
                do_sample=sampled,
                temperature=s.temperature if sampled else None,
                top_p=s.top_p if sampled else None,
                top_k=s.top_k if sampled else None,
                min_p=s.min_p if sampled else None,
                repetition_penalty=s.repetition_penalty,
                eos_token_id=None if s.ignore_eos else sorted(self.eos_ids),
                pad_token_id=self.pad_id,
                logits_processor=LogitsProcessorList(processors),
            )
        end = time.monotonic()
        self._batches += 1
        first = clock.first or end
        completions = []
        for i, r in enumerate(batch):
            generated = out[i, longest:longest + budget[i]].tolist()
            ids, text, ended = finish_text(
                self.tokenizer, generated, r.sampling.stop, set() if s.ignore_eos else self.eos_ids
            )
            timings = Timings(
                queue_wait_ms=(start - r.arrival) * 1e3,
                ttft_ms=(first - r.arrival) * 1e3,
                prefill_ms=(first - start) * 1e3,
                decode_ms=(end - first) * 1e3,
                batch_size=len(batch),
                first_step=self._batches,
            )
            completions.append(Completion(r.request_id, ids, text, len(r.prompt_ids),
                                          FinishReason.stop if ended else FinishReason.length, None, timings))
        return completions

    def _take_batch(self) -> list[Request]:
        """The most urgent request plus the next most urgent ones that can share its `generate` call."""
        head = heapq.heappop(self._waiting)
        key = self._group_key(head[3])
        batch, kept = [head], []
        while self._waiting and len(batch) < self.max_batch_size:
            item = heapq.heappop(self._waiting)
            (batch if self._group_key(item[3]) == key else kept).append(item)
        for item in kept:
            heapq.heappush(self._waiting, item)
        return [item[3] for item in batch]

    @staticmethod
    def _group_key(request: Request) -> tuple:
        s = request.sampling
        shared = (s.ignore_eos, s.repetition_penalty, s.presence_penalty, s.max_thinking_tokens)
        if s.greedy:
            return ("greedy", *shared)
        # a seeded request runs alone so that its random draws do not depend on its batch-mates
        return ("sample", *shared, s.temperature, s.top_p, s.top_k, s.min_p, s.seed,
                request.request_id if s.seed is not None else None)
