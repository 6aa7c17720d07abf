"""What a prompt's tokenization costs a thread while other threads of its process are busy.

    python -m bench.prompt_encode --json

A worker tokenizes each job's prompt on one of its many threads while others run Python. Side by side in one
run, for the same chats: transformers' own `apply_chat_template(tokenize=True)` and the service's `encode_chat`
(the rendered chat encoded by the Rust tokenizer directly, `jobs.chat.encode_rendered`), each first on an idle
process and then with `--busy` threads spinning in Python. CPU is the calling thread's own
(`time.thread_time`), wall the time the call took. A call that lets go of the interpreter lock waits up to a
switch interval (`sys.getswitchinterval()`, 5 ms) to get it back behind a busy thread.
"""

from __future__ import annotations

import argparse
import threading
import time

from transformers import AutoTokenizer

from bench.common import report, tiny_model
from jobs.chat import encode_chat


def chats(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"Where is my order {i}? It was due on Monday and it is late."}]
            for i in range(n)]


def per_call_ms(call, inputs: list) -> tuple[float, float]:
    """(CPU ms, wall ms) per call of `call` over `inputs`, on this thread."""
    cpu, wall = time.thread_time(), time.perf_counter()
    for item in inputs:
        call(item)
    return ((time.thread_time() - cpu) / len(inputs) * 1e3, (time.perf_counter() - wall) / len(inputs) * 1e3)


def spin(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(i * i for i in range(200))


def run(n: int, busy: int) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model("tiny"))
    ways = {
        "transformers": lambda chat: tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                                                   enable_thinking=False),
        "encode_chat": lambda chat: encode_chat(tokenizer, chat, False),
    }
    inputs = chats(n)
    for call in ways.values():  # warm-up: the compiled template, the tokenizer's caches
        per_call_ms(call, inputs[:50])
    result: dict = {"prompts": n, "busy_threads": busy}
    idle = {name: per_call_ms(call, inputs) for name, call in ways.items()}
    stop = threading.Event()
    spinners = [threading.Thread(target=spin, args=(stop,), daemon=True) for _ in range(busy)]
    for thread in spinners:
        thread.start()
    try:
        loaded = {name: per_call_ms(call, inputs) for name, call in ways.items()}
    finally:
        stop.set()
    for name in ways:
        result[f"{name}_idle_cpu_ms"], result[f"{name}_idle_wall_ms"] = (round(x, 4) for x in idle[name])
        result[f"{name}_busy_cpu_ms"], result[f"{name}_busy_wall_ms"] = (round(x, 4) for x in loaded[name])
    result["busy_cpu_ratio"] = round(loaded["transformers"][0] / loaded["encode_chat"][0], 2)
    result["busy_wall_ratio"] = round(loaded["transformers"][1] / loaded["encode_chat"][1], 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=500)
    parser.add_argument("--busy", type=int, default=1, help="threads spinning in Python meanwhile")
    parser.add_argument("--json", action="store_true", help="print only the JSON result line")
    args = parser.parse_args()
    report(run(args.prompts, args.busy), args.json)


if __name__ == "__main__":
    main()
