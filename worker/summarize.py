"""Summaries of transcripts of any length: map-reduce over chunks that fit the model's context.

A transcript whose prompt fits (context minus the output budget) is summarized in one request. A longer
one is split on turn boundaries into chunks that fit (a single turn too long for a chunk is split on
word boundaries, or between characters where it has no spaces), each chunk is summarized, and the partial summaries are combined, again in chunks if
they do not fit together, until one summary remains. Nothing is truncated. A transcript that cannot be
reduced within the budget fails with a clear error instead. A job's `response_format` and logprobs are its
answer's. The parts and the combines before the last run free, and only the final summary (the one request,
or the last combine) is constrained.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace

from engine.interface import Completion, Timings
from jobs.chat import Chat, chat_for, combine_chat, part_chat, prompt_budget, split_reasoning, summary_problem
from jobs.schemas import Message
from worker.bridge import JobRun
from worker.outcome import STOPPED, Outcome

Turns = list[Message]


class TooLong(ValueError):
    pass


def split_turn(turn: Message, fits: Callable[[Turns], bool]) -> Turns:
    """A turn too long for any chunk, as consecutive pieces that each fit: split on word boundaries, and a run
    without spaces (Chinese or Japanese text, a long URL) between characters."""
    if fits([turn]):
        return [turn]
    text = turn.content
    words = text.split(" ")
    if len(words) >= 2:
        half = len(words) // 2
        head, tail = " ".join(words[:half]), " ".join(words[half:])
    elif len(text) >= 2:
        head, tail = text[:len(text) // 2], text[len(text) // 2:]
    else:
        raise TooLong("a single character does not fit the model's context")
    return (split_turn(turn.model_copy(update={"content": head}), fits)
            + split_turn(turn.model_copy(update={"content": tail}), fits))


def plan_chunks(turns: Turns, fits: Callable[[Turns], bool]) -> list[Turns]:
    """Consecutive groups of turns, each as large as fits.

    A chunk's end is found by doubling then bisecting, so a chunk of n turns costs about 2 log2(n) prompt
    tokenizations rather than n (each of a whole chunk): what fits only grows with fewer turns.
    """
    pieces = [piece for turn in turns for piece in split_turn(turn, fits)]
    chunks: list[Turns] = []
    start = 0
    while start < len(pieces):
        fit, step = start + 1, 1  # pieces[start:fit] fits, as a piece on its own always does
        while fit + step <= len(pieces) and fits(pieces[start:fit + step]):
            fit += step
            step *= 2
        over = min(fit + step, len(pieces) + 1)  # pieces[start:over] does not fit, or runs past the end
        while over - fit > 1:
            mid = (fit + over) // 2
            if fits(pieces[start:mid]):
                fit = mid
            else:
                over = mid
        chunks.append(pieces[start:fit])
        start = fit
    return chunks


def merge(levels: list[list[Completion]], final: Completion) -> Completion:
    """One completion for the job: the final text, with the requests of every level (parts, then combines, the
    last being `final`) folded into one (`merged_timings`)."""
    completions = [c for level in levels for c in level]
    return replace(final, prompt_tokens=sum(c.prompt_tokens for c in completions),
                   timings=merged_timings(levels, final))


def merged_timings(levels: list[list[Completion]], final: Completion) -> Timings:
    """The timings of a job's requests as one: levels of requests run side by side, one level after the other,
    the job's answer being `final`'s. Prefill and decode are the job's wall time in them: each level counts the
    request that ended last, and the levels add up (their sum would count overlapping time many times over).
    Every request counts its waiting from the job's creation, so the final one's first token is the job's."""
    t = [c.timings for level in levels for c in level]
    last = [max(level, key=lambda c: c.timings.ttft_ms + c.timings.decode_ms).timings for level in levels]
    return Timings(
        queue_wait_ms=min(x.queue_wait_ms for x in t),
        ttft_ms=final.timings.ttft_ms,
        prefill_ms=sum(x.prefill_ms for x in last),
        decode_ms=sum(x.decode_ms for x in last),
        prompt_tokens_reused=sum(x.prompt_tokens_reused for x in t),
        host_tokens_reused=sum(x.host_tokens_reused for x in t),
        batch_size=max(x.batch_size for x in t),
        first_step=final.timings.first_step,
        preemptions=sum(x.preemptions for x in t),
    )


def summarize(run: JobRun) -> Outcome:
    """The final request (the whole transcript, or the last combine) streams its text; a part that does not
    succeed ends the job with that part's completion (a stop keeps the part's text so far)."""
    job, started = run.job, time.monotonic()
    if problem := summary_problem(job.sampling.max_new_tokens, run.max_model_len):
        return _too_long(run.job_id, problem, started)
    budget = prompt_budget(run.max_model_len, job.sampling.max_new_tokens)

    def fits_with(make_chat: Callable[[Turns], Chat]) -> Callable[[Turns], bool]:
        return lambda turns: len(run.prompt_ids(make_chat(turns))) <= budget

    def run_all(chats: list[Chat], level: int, final: bool = False) -> list[Completion]:
        futures: list[Future] = [run.submit(f"{level}:{i}", run.prompt_ids(chat), stream=final, free=not final)
                                 for i, chat in enumerate(chats)]
        return [f.result() for f in futures]

    def failed(completion: Completion, what: str) -> Outcome:
        if completion.finish_reason not in STOPPED:
            completion = replace(completion, error=f"{what}: {completion.error}")
        return Outcome(completion, (time.monotonic() - started) * 1e3)

    def answers(completions: list[Completion]) -> list[str]:
        """What the parts concluded: with thinking, only the answer after each one's reasoning is combined."""
        return [split_reasoning(c.text)[1] if run.thinking else c.text for c in completions]

    whole = chat_for(job)
    if len(run.prompt_ids(whole)) <= budget:
        [completion] = run_all([whole], 1, final=True)
        return Outcome.answered(completion, (time.monotonic() - started) * 1e3, run.thinking, run.tokenizer)

    try:
        # sized with a two-digit part header, which the real header is never longer than
        chunks = plan_chunks(job.messages, fits_with(lambda ts: part_chat(ts, 99, 99)))
    except TooLong as exc:
        return _too_long(run.job_id, str(exc), started)
    done: list[Completion] = run_all([part_chat(c, i, len(chunks)) for i, c in enumerate(chunks, 1)], 1)
    if bad := next((c for c in done if not c.ok), None):
        return failed(bad, "a chunk failed")
    levels = [done]
    summaries, level = answers(done), 1
    combine_fits = fits_with(lambda ts: combine_chat([t.content for t in ts]))
    while True:
        level += 1
        as_turns = [Message.model_construct(role="user", content=s) for s in summaries]
        if combine_fits(as_turns):
            [final] = run_all([combine_chat(summaries)], level, final=True)
            if not final.ok:
                return failed(final, "combining the summaries failed")
            return Outcome.answered(merge([*levels, [final]], final), (time.monotonic() - started) * 1e3,
                                    run.thinking, run.tokenizer, chunks=len(chunks), levels=level)
        groups = plan_chunks(as_turns, combine_fits)
        if len(groups) >= len(summaries):
            return _too_long(run.job_id, "the partial summaries do not fit together two at a time; lower "
                             "max_new_tokens", started)
        level_done = run_all([combine_chat([t.content for t in g]) for g in groups], level)
        levels.append(level_done)
        if bad := next((c for c in level_done if not c.ok), None):
            return failed(bad, "combining the summaries failed")
        summaries = answers(level_done)


def _too_long(job_id: str, why: str, started: float) -> Outcome:
    return Outcome.failed(job_id, f"cannot summarize within the model's context: {why}",
                          (time.monotonic() - started) * 1e3)
