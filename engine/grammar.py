"""Constrained decoding with xgrammar: a request's grammar (`engine.interface.GrammarSpec`, made a grammar by
`engine.grammar_build`) becomes a matcher that masks the tokens it forbids.

Compiling happens on the compiler's own thread, which the submitting thread (`LLMEngine.prepare`) waits on for at
most `compile_s`: a grammar that takes longer, or whose compiling fails in any way (out of memory included), is
that request's `RequestError`, never the engine's end. A compile that ran past its limit goes on to its end
(xgrammar cannot be stopped) and is kept; requests for a spec being compiled wait on that one compile. Compiled
grammars are kept in an LRU keyed by the spec, bounded by their bytes (a few KB to tens of MB each for a 150k
vocabulary), so a schema seen before costs a lookup. Each step, the loop fills the bitmasks of the rows that
sample under a grammar in one batched call (`masks`), which the sampler applies to the logits on their device
before penalties; rows without a grammar pay nothing.

For speculation a matcher's forced text gives drafts (`engine.grammar_drafts`); a row with drafts has a mask per
position, each filled after its drafts before it are accepted, and the matcher rolled back after.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import torch
import xgrammar as xgr

from engine.grammar_build import grammar_of
from engine.interface import GrammarSpec, RequestError
from engine.step import TokenMasks


def _message(e: Exception) -> str:
    """xgrammar's error without its source location (`[time] path.cc:line: message`)."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text


def _background() -> None:
    """This thread (and the threads it starts) yield the CPU to every other of the process."""
    with contextlib.suppress(OSError, AttributeError):  # a system without per-thread priorities
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


class Grammars:
    """One model's grammar compiler, its cache, and the batched work of its matchers."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: Iterable[int], threads: int = 1,
                 compile_s: float = 30.0, cache_bytes: int = 1 << 30) -> None:
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=sorted(stop_ids))
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher()
        self.words = xgr.get_bitmask_shape(1, self.info.vocab_size)[1]
        self.compile_s = compile_s
        self.cache_bytes = cache_bytes
        self._compiled: OrderedDict[GrammarSpec, xgr.CompiledGrammar] = OrderedDict()
        self._cached_bytes = 0
        self._compiling: dict[GrammarSpec, Future[xgr.CompiledGrammar]] = {}
        self._lock = threading.Lock()  # requests are prepared on any submitting thread
        # one compile at a time, on one thread at the lowest priority: compiling is background work, which gets
        # the CPU the step loop leaves (with two threads at the loop's priority, chats beside a compile of a
        # schema at the API's bounds took 3x their time on two cores)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile",
                                            initializer=_background)

    def compiled(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """`spec` compiled, from the cache when it was seen before; raises `RequestError` naming the problem,
        or saying it was not compiled within `compile_s`."""
        with self._lock:
            hit = self._compiled.get(spec)
            if hit is not None:
                self._compiled.move_to_end(spec)
                return hit
            compiling = self._compiling.get(spec)
            if compiling is None:
                compiling = self._compiling[spec] = self._executor.submit(self._compile, spec)
        try:
            return compiling.result(self.compile_s)
        except FutureTimeout:
            raise RequestError(f"grammar: not compiled within {self.compile_s:g}s (CONVOQ_GRAMMAR_COMPILE_S); a "
                               "smaller schema compiles sooner") from None

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """On the compiler's thread: `spec` compiled and cached, or a `RequestError`."""
        error: RequestError | None = None
        try:
            compiled = self.compiler.compile_grammar(grammar_of(spec))
        except MemoryError:
            error = RequestError("grammar: out of memory while compiling it")
        except Exception as e:  # whatever a spec makes xgrammar raise is that spec's problem
            error = RequestError(f"grammar: {_message(e)}")
        with self._lock:
            del self._compiling[spec]
            if error is None:
                self._keep(spec, compiled)
        if error is not None:
            raise error
        return compiled

    def _keep(self, spec: GrammarSpec, compiled: xgr.CompiledGrammar) -> None:
        """Cache `compiled`, the least recently used going first past `cache_bytes` (one larger than all of
        it is not kept). Under the lock."""
        size = compiled.memory_size_bytes
        if size > self.cache_bytes:
            return
        self._compiled[spec] = compiled
        self._cached_bytes += size
        while self._cached_bytes > self.cache_bytes:
            _, dropped = self._compiled.popitem(last=False)
            self._cached_bytes -= dropped.memory_size_bytes

    @property
    def cached_bytes(self) -> int:
        return self._cached_bytes

    def matcher(self, spec: GrammarSpec) -> xgr.GrammarMatcher:
        """A fresh matcher for `spec`."""
        return xgr.GrammarMatcher(self.compiled(spec))

    def masks(self, num_rows: int, rows: list[int], matchers: list[xgr.GrammarMatcher],
              walks: list[tuple[int, xgr.GrammarMatcher, list[int]]] = ()) -> TokenMasks:
        """The next-token bitmasks of `matchers`, those of sample positions `rows` out of `num_rows`, filled in
        one call (the rows of the others are left as they are: the sampler never reads them). `walks` holds (row,
        its matcher, drafts) for those of `rows` with drafts: the positions after such a row are its drafts',
        each masked as the matcher stands once the drafts before it are accepted."""
        bitmask = torch.empty((num_rows, self.words), dtype=torch.int32)
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        drafted = []
        for row, matcher, drafts in walks:
            for j, token in enumerate(drafts, 1):
                matcher.accept_token(token)
                matcher.fill_next_token_bitmask(bitmask, row + j)
                drafted.append(row + j)
            matcher.rollback(len(drafts))
        return TokenMasks(rows + drafted, bitmask)
