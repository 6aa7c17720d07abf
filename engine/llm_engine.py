"""Our engine: a Qwen3 model, paged KV pools and a continuous-batching scheduler behind `StepEngine`.

`engine.parts` wires the parts; this class holds the requests' sequences and runs the steps: the scheduler
plans one (`engine.step.StepPlan`), the step executor runs it, and the `StepResult` is applied here.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import numpy as np
import torch

from engine.config import EngineConfig
from engine.core.block_key import extend_keys
from engine.core.drafts import Drafter
from engine.core.ngram import NgramIndex
from engine.core.output_text import finish_text, stops_hit
from engine.core.sequence import Sequence, Status
from engine.core.step_cost import work_of
from engine.grammar import Grammars
from engine.grammar_drafts import ForcedDrafts
from engine.interface import (
    Completion,
    EngineStats,
    FinishReason,
    Request,
    RequestError,
    check_prompt,
)
from engine.model.parallel import ALONE
from engine.model.weight_memory import expert_bytes, weights_bytes
from engine.parts import build
from engine.step import StepPlan, StepResult, TokenMasks
from engine.tensor_parallel import Ranks


class LLMEngine:
    def __init__(self, config: EngineConfig, weights: Iterable[tuple[str, torch.Tensor]] | None = None) -> None:
        """`weights` (checkpoint names and tensors) stands in for the folder's *.safetensors when given. With
        `tensor_parallel` > 1 this engine is rank 0 and starts the other ranks (engine.tensor_parallel)."""
        if config.tensor_parallel > 1 and weights is not None:
            raise ValueError("weights given in memory cannot reach the other tensor-parallel ranks")
        self.ranks = Ranks(config) if config.tensor_parallel > 1 else None
        try:
            parts = build(self.ranks.config if self.ranks else config, weights,
                          self.ranks.split if self.ranks else ALONE)
        except BaseException:
            self.close()
            raise
        if self.ranks is not None:
            self.ranks.attach(parts)
        self.config = config
        self.device = torch.device(config.device)
        self.tokenizer = parts.tokenizer
        self.model = parts.model
        self.max_model_len = parts.max_model_len
        self.eos_ids = parts.eos_ids
        self.think_ids = parts.think_ids
        self.kv_plan = parts.kv_plan
        self.windows = parts.kv_plan.windows
        self.activation_bytes = parts.activation_bytes
        self.blocks = parts.blocks
        self.scheduler = parts.scheduler
        self.executor = parts.executor
        self._seqs: dict[str, Sequence] = {}
        self._steps = 0
        self._tokens_generated = 0
        self._tokens_computed = 0
        self._peak_blocks = 0  # most KV blocks in use after any step's scheduling
        self._token_texts: dict[int, str] = {}  # token id -> its text alone, for stop strings
        # grammars are compiled for the submitting thread (engine.grammar); the compiler is built with the engine, not at the first schema: importing xgrammar and reading the vocabulary hold
        # the interpreter for about half a second, which would stop the step loop of a serving engine
        self.grammars = Grammars(self.tokenizer, self.model.shape.vocab_size, self.eos_ids,
                                 compile_s=config.grammar_compile_s, cache_bytes=config.grammar_cache_bytes)
        self._constrained: dict[str, Sequence] = {}  # sequences whose sampling a grammar constrains now
        self.scheduler.drafter = Drafter(ForcedDrafts(self.grammars.info), self.eos_ids,
                                         self.think_ids[1] if self.think_ids else None)
        self._drafts = [0, 0, 0]  # drafts verified, of those accepted, rows that carried them

    def prepare(self, request: Request) -> Sequence:
        """Check `request` and build its sequence, with the content keys of its prompt's blocks: work that reads
        nothing a step changes, so the engine's runner does it on the submitting thread, where it never widens
        the gap between two steps. Raises `RequestError` for a request that can never run. The sampling values'
        own bounds are the service's to check (`jobs.schemas.Sampling`); only what this engine knows is here."""
        n, p = len(request.prompt_ids), request.sampling
        check_prompt(n, p.max_new_tokens, self.max_model_len)
        if p.max_thinking_tokens is not None and self.think_ids is None:
            raise RequestError("max_thinking_tokens needs a thinking model; this tokenizer has no <think> tokens")
        most = self.model.shape.vocab_size if self.config.max_logprobs is None else self.config.max_logprobs
        if p.logprobs is not None and not 0 <= p.logprobs <= most:
            raise RequestError(f"logprobs must be 0..{most}, not {p.logprobs}")
        needed = self.kv_plan.blocks_per_seq(self.config.block_size, n + p.max_new_tokens)
        for pool, blocks in zip(self.blocks.pools, needed, strict=True):
            if blocks > pool.max_blocks:
                raise RequestError(f"needs {blocks} KV blocks; the memory budget allows {pool.max_blocks}")
        seq = Sequence(request, len(self.blocks.pools))
        if p.grammar is not None:
            seq.matcher = self.grammars.matcher(p.grammar)
            seq.constrained = not (p.grammar_after_think and self.think_ids is not None)
        if self.blocks.prefix is not None:  # what admission looks the prompt up by
            extend_keys(seq.block_keys, seq.token_ids, self.config.block_size, seq.cache_root)
        if (p.speculative or self.config.speculative) == "ngram":  # its prompt indexed here, off the step loop
            seq.ngram = NgramIndex(self.config.speculative_ngram_min, self.config.speculative_ngram_max)
            seq.ngram.update(seq.token_ids)
        return seq

    def add_request(self, request: Request, prepared: Sequence | None = None) -> None:
        """Queue `request`; `prepared` is what `prepare(request)` returned, if the caller called it."""
        if request.request_id in self._seqs:
            raise RequestError(f"request {request.request_id!r} is already running")
        seq = self.prepare(request) if prepared is None else prepared
        self._seqs[request.request_id] = seq
        if seq.constrained:
            self._constrained[request.request_id] = seq
        self.blocks.prefetch(seq)
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> Completion | None:
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.finish(seq)
        return self._completion(seq, FinishReason.cancelled)

    def partial(self, request_id: str, at_least: int) -> list[int] | None:
        seq = self._seqs.get(request_id)
        if seq is None or seq.num_tokens - seq.num_prompt_tokens < at_least:
            return None
        return seq.output_ids

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[Completion]:
        start = time.monotonic()
        plan = self.scheduler.schedule(start)
        if plan is None:
            return []
        self._peak_blocks = max(self._peak_blocks, sum(p.num_used for p in self.blocks.pools))
        work = work_of(plan)
        masks = (lambda: self._masks(plan)) if self._constrained else None
        result = self.executor.run(plan, masks) if self.ranks is None else \
            self.ranks.step(plan, lambda: self.executor.run(plan, masks))
        end = time.monotonic()
        self._steps += 1
        self._record_computed(plan, start, end)
        verifying = [(self._seqs[plan.request_ids[row]], int(plan.starts[row]), int(plan.drafts[row]))
                     for row in np.flatnonzero(plan.drafts).tolist()] if plan.drafts is not None else []
        done = self._append_sampled(result, end) if result.request_ids else []
        if verifying:
            self._verified(verifying)
        # the whole step, planning and bookkeeping included: what an interactive request waits per token
        self.scheduler.cost.observe(work, time.monotonic() - start)
        return done

    def _masks(self, plan: StepPlan) -> TokenMasks | None:
        """The grammar masks of the plan's constrained sample positions, filled in one call (a row with drafts:
        its first position there, the others after each of its drafts in turn)."""
        rows, matchers, walks, constrained = [], [], [], self._constrained
        previous = None
        for j, request_id in enumerate(plan.sample_ids):
            seq = constrained.get(request_id)
            if seq is not None and request_id != previous:
                rows.append(j)
                matchers.append(seq.matcher)
                if plan.drafts is not None and j + 1 < len(plan.sample_ids) and plan.sample_ids[j + 1] == request_id:
                    walks.append((j, seq.matcher, seq.drafts))
            previous = request_id
        return self.grammars.masks(len(plan.sample_ids), rows, matchers, walks) if rows else None

    def _record_computed(self, plan: StepPlan, start: float, end: float) -> None:
        """The tokens each row of the step computed, its sequence's timings, and the blocks it filled (indexed in
        the prefix cache). One plain loop: it runs for every row of every step."""
        size, block_size, seqs = len(plan.request_ids), self.config.block_size, self._seqs
        indexing = self.blocks.prefix is not None
        # a row's drafts are computed but not yet verified: they count once accepted (`_append_sampled`)
        counts = plan.counts if plan.drafts is None else plan.counts - plan.drafts
        for request_id, n in zip(plan.request_ids, counts.tolist(), strict=True):
            seq = seqs[request_id]
            prefilled = n > 1 or seq.num_computed == 0
            if prefilled or seq.first_scheduled is None:
                seq.record_step(self._steps, start, end, size, prefilled)
            elif seq.timings.batch_size < size:  # a later decode: of `record_step` only the largest batch can change
                seq.timings.batch_size = size
            seq.num_computed += n
            if indexing and seq.num_computed >= (seq.num_indexed + 1) * block_size:  # a block filled up
                self.blocks.index(seq)
        self._tokens_computed += int(plan.counts.sum())

    def _append_sampled(self, result: StepResult, end: float) -> list[Completion]:
        """Append each sampled token to its sequence and finish those it ends: EOS, a stop string (its tail
        decoded only after a token that can complete one, every such row in one call), or the length. A row with
        drafts gives its kept tokens in turn, each after the draft before it stands; the rest of its tokens go
        once one ends its sequence or is not the token sampled (a reasoning budget's `</think>`)."""
        done: list[Completion] = []
        stopping: dict[Sequence, int] = {}  # sequence -> its tokens since the first that can complete a stop
        eos_ids, seqs = self.eos_ids, self._seqs
        logprobs = result.logprobs or [None] * len(result.request_ids)
        previous = dropping = None
        for request_id, token, lp in zip(result.request_ids, result.token_ids, logprobs, strict=True):
            if request_id == dropping:
                continue
            seq = seqs[request_id]
            if request_id == previous:  # a row's next token: the draft before it stands, its K/V computed
                seq.num_computed += 1
            previous = request_id
            if seq.reasoning_budget is not None:
                sampled, token = token, self._within_reasoning_budget(seq, token)
                if token != sampled:
                    dropping = request_id  # what the row sampled after this position followed another token
            # a grammar that took its stop token ends the output, even one that ignores EOS otherwise
            ended = seq.matcher is not None and self._follow_grammar(seq, token)
            if seq.logprobs is not None:
                seq.logprobs.append(lp)
            seq.token_ids.append(token)
            seq.last_token = end
            if seq.first_token is None:
                seq.first_token = end
                seq.timings.ttft_ms = (end - seq.request.arrival) * 1e3
            if seq in stopping:
                stopping[seq] += 1
            elif seq.stop_ends and not seq.stop_ends.isdisjoint(self._token_text(token)):
                stopping[seq] = 1  # decoded together below
            if ended or (token in eos_ids and not seq.params.ignore_eos):
                self._finish(seq, FinishReason.stop, done)
                dropping = request_id
            elif len(seq.token_ids) >= seq.token_limit:
                if seq not in stopping:
                    self._finish(seq, FinishReason.length, done)
                dropping = request_id
        self._tokens_generated += len(result.token_ids)
        stopping = {seq: n for seq, n in stopping.items() if seq.request_id in seqs}
        if stopping:
            outputs = [(seq.output_tail(seq.stop_window + n - 1), seq.params.stop) for seq, n in stopping.items()]
            hits = stops_hit(self.tokenizer, outputs)
            for seq, hit in zip(stopping, hits, strict=True):
                if hit or len(seq.token_ids) >= seq.token_limit:
                    self._finish(seq, FinishReason.stop if hit else FinishReason.length, done)
        return done

    def _verified(self, verifying: list[tuple[Sequence, int, int]]) -> None:
        """After a step with drafts, for each (sequence, its row's start, its drafts): the drafts counted and
        folded into the sequence's record; one still running gives back the blocks its rejected drafts took and
        indexes those its accepted ones filled (only tokens that stand ever reach the prefix cache)."""
        indexing, block_size = self.blocks.prefix is not None, self.config.block_size
        for seq, start, k in verifying:
            accepted = seq.num_computed - start - 1
            self._drafts[0] += k
            self._drafts[1] += accepted
            self._drafts[2] += 1
            self.scheduler.drafter.record(seq, k, accepted)
            if seq.status is Status.RUNNING:
                self.blocks.trim(seq)
                if indexing and seq.num_computed >= (seq.num_indexed + 1) * block_size:
                    self.blocks.index(seq)

    def _follow_grammar(self, seq: Sequence, token: int) -> bool:
        """Advance `seq`'s matcher by `token` (from the reasoning's `</think>` on); True once it terminated."""
        if not seq.constrained:
            if token == self.think_ids[1]:  # the answer, and the constraint, start after the reasoning
                seq.constrained = True
                self._constrained[seq.request_id] = seq
            return False
        if not seq.matcher.accept_token(token):
            raise RuntimeError(f"request {seq.request_id}: token {token} was sampled against its grammar")
        return seq.matcher.is_terminated()

    def _within_reasoning_budget(self, seq: Sequence, token: int) -> int:
        """`token`, or `</think>` once the open reasoning block has used the request's budget."""
        opening, closing = self.think_ids
        if seq.think_block_tokens is not None and seq.think_block_tokens >= seq.reasoning_budget:
            token = closing
        if token == opening:
            seq.think_block_tokens = 0
        elif token == closing:
            seq.think_block_tokens = None
        elif seq.think_block_tokens is not None:
            seq.think_block_tokens += 1
        return token

    def _token_text(self, token: int) -> str:
        """One token's own text, decoded once per engine (byte-level tokens: never more than a few bytes)."""
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = self.tokenizer.decode([token], skip_special_tokens=True)
        return text

    def _finish(self, seq: Sequence, reason: FinishReason, done: list[Completion]) -> None:
        self.scheduler.finish(seq)
        del self._seqs[seq.request_id]
        done.append(self._completion(seq, reason))

    def _completion(self, seq: Sequence, reason: FinishReason) -> Completion:
        if seq.matcher is not None:
            self._constrained.pop(seq.request_id, None)
            seq.matcher = None
        eos = set() if seq.params.ignore_eos else self.eos_ids
        ids, text, _ = finish_text(self.tokenizer, seq.output_ids, seq.params.stop, eos)
        logprobs = seq.logprobs[:len(ids)] if seq.logprobs is not None else None
        return Completion(seq.request_id, ids, text, seq.num_prompt_tokens, reason, None, seq.final_timings(),
                          logprobs=logprobs)

    def close(self) -> None:
        """Stop the other tensor-parallel ranks, if any."""
        if self.ranks is not None:
            self.ranks.close()

    def stats(self) -> EngineStats:
        pools = self.blocks.pools
        used, ceiling = sum(p.num_used for p in pools), sum(p.max_blocks for p in pools)
        s = self.scheduler
        return EngineStats(
            running=len(s.running),
            waiting=len(s.waiting),
            interactive_running=sum(seq.interactive for seq in s.running),
            interactive_waiting=sum(seq.interactive for seq in s.waiting),
            kv_blocks_total=sum(p.capacity for p in pools),
            kv_blocks_used=used,
            kv_blocks_peak=self._peak_blocks,
            kv_blocks_max=ceiling,
            kv_usage=used / ceiling,
            kv_window_blocks_used=sum(p.num_used for p, w in zip(pools, self.windows, strict=True) if w > 0),
            preemptions=s.num_preemptions,
            preemptions_spared=s.num_preemptions_spared,
            bulk_rows_deferred=s.num_rows_deferred,
            limited_steps=s.num_limited_steps,
            **s.cost.coefficients,
            steps=self._steps,
            tokens_generated=self._tokens_generated,
            tokens_computed=self._tokens_computed,
            draft_tokens=self._drafts[0],
            draft_tokens_accepted=self._drafts[1],
            draft_rows=self._drafts[2],
            draft_accepted_length=self._drafts[1] / max(1, self._drafts[2]),
            **self._prefix_stats(),
        )

    def _prefix_stats(self) -> dict[str, float]:
        """`EngineStats`' prefix and host cache fields."""
        prefix, s = self.blocks.prefix, self.scheduler
        host = prefix.host if prefix is not None else None
        prefetched = prefix.num_prefetched if host is not None else 0
        return dict(
            prefix_cache_queries_tokens=s.num_query_tokens,
            prefix_cache_hit_tokens=s.num_hit_tokens,
            prefix_cache_hit_rate=s.num_hit_tokens / max(1, s.num_query_tokens),
            host_hit_tokens=s.num_host_hit_tokens,
            host_prefetch_hit_rate=prefix.num_prefetch_hits / prefetched if prefetched else 0.0,
            prefix_cached_blocks=self.blocks.pools[0].num_cached,
            evictions=prefix.num_evictions if prefix is not None else 0,
            host_evictions=host.num_evictions if host is not None else 0,
        )

    def memory_report(self) -> dict[str, int]:
        """Where the memory goes, and how much work fits in the KV budget."""
        pools = self.blocks.pools
        block_bytes = [p.cache.bytes_per_block for p in pools]
        per_seq_at_max = self.kv_plan.blocks_per_seq(self.config.block_size, self.max_model_len)
        full = [p.max_blocks for p, w in zip(pools, self.windows, strict=True) if w == 0]
        return {
            "weights_bytes": weights_bytes(self.model),
            "expert_bytes": expert_bytes(self.model),  # of the weights: every expert of a mixture-of-experts model
            "activation_bytes": self.activation_bytes,  # held back from a fractional budget (CUDA only)
            "graph_bytes": self.executor.pieces.nbytes if self.executor.pieces is not None else 0,
            "kv_bytes_per_token": self.kv_plan.kv_bytes_per_token,
            "kv_budget_bytes": self.kv_plan.budget_bytes,
            "block_size": self.config.block_size,
            "pool_blocks": sum(p.capacity for p in pools),
            "pool_blocks_used": sum(p.num_used for p in pools),
            "pool_blocks_free": sum(len(p.free) for p in pools),
            "pool_blocks_max": sum(p.max_blocks for p in pools),
            "pool_bytes": sum(p.capacity * b for p, b in zip(pools, block_bytes, strict=True)),
            "dense_decode_bytes": self.executor.dense.nbytes if self.executor.dense is not None else 0,
            # tokens of context the budget holds across all sequences (the window pools never limit it more)
            "max_tokens": min(full, default=max(p.max_blocks for p in pools)) * self.config.block_size,
            "max_batch_at_max_len": min(p.max_blocks // n for p, n in zip(pools, per_seq_at_max, strict=True)),
        }
