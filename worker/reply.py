"""A chat job's run: its requests into the engine, one per choice, then their answers as its outcome."""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, replace

from engine.interface import Completion
from jobs.chat import chat_for, chat_problem
from jobs.tool_calls import tool_use
from worker.bridge import JobRun
from worker.outcome import Outcome
from worker.summarize import merged_timings


@dataclass
class Asked:
    """A chat job's requests, in the engine since `start`: a future per choice."""

    start: float
    choices: list[Future[Completion]]


def ask(run: JobRun) -> Asked | Outcome:
    """A chat job's requests into the engine: one per choice (`n`), its prompt and output within the model's
    context; or, when they are not, the job's failure."""
    start = time.monotonic()
    prompt = run.prompt_ids(chat_for(run.job))
    if problem := chat_problem(len(prompt), run.job.sampling.max_new_tokens, run.max_model_len):
        return Outcome.failed(run.job_id, problem)
    return Asked(start, run.choices(prompt))


def answered(run: JobRun, asked: Asked | Outcome) -> Outcome:
    """What a chat job's requests gave: choice 0's text streams, and its outcome holds the others, with the timings
    of all of them as the job's."""
    if isinstance(asked, Outcome):
        return asked
    first, *others = completions = [future.result() for future in asked.choices]
    engine_ms = (time.monotonic() - asked.start) * 1e3
    first = replace(first, timings=merged_timings([completions], first))
    tools = tool_use(run.job)
    outcome = Outcome.answered(first, engine_ms, run.thinking, run.tokenizer, tools)
    outcome.choices = [Outcome.answered(c, engine_ms, run.thinking, run.tokenizer, tools) for c in others]
    return outcome


def reply(run: JobRun) -> Outcome:
    """A chat job: its requests (`ask`), then their answers (`answered`)."""
    return answered(run, ask(run))
