"""Our inference engine for Qwen3 checkpoints: `core/` decides what a step runs, `model/` runs it, `runtime/`
drives an engine from a loop of its own.

The engine's words, each for one thing:

- request: what the worker hands in (`engine.interface.Request`): prompt ids, sampling, priority; it ends as
  a completion (`Completion`), its tokens, text and finish reason.
- engine: a model and its scheduler, stepped from one thread (`engine.interface.StepEngine`): `LLMEngine`
  (ours) or `HFEngine` (transformers' `generate`, the reference).
- runner: an engine behind a step loop of its own that any thread may submit to and gets futures back from
  (`engine.interface.EngineRunner`): `EngineThread` (a thread of this process) or `EngineProcess` (a spawned
  process).
- step: one pass of that loop. The scheduler plans it (`engine.step.StepPlan`), the executor runs it and the
  engine applies what comes back (`StepResult`) to its sequences.
- executor: what runs a step's plan on the model (`engine.model.step_executor.StepExecutor`): packs the rows,
  runs the forward, samples.
- sequence: a request's state inside the scheduler (`engine.core.sequence.Sequence`): its tokens, how many are
  in the KV cache, its block tables.
- context: the tokens a sequence attends over; the model's context (`max_model_len`) is the most tokens one
  request ever holds, prompt included.
- block: the K/V of `block_size` consecutive tokens of one sequence, in one pool; full blocks may be shared
  through the prefix cache.
- pool: the KV blocks of one attention kind (full attention, or one sliding window), grown within its ceiling;
  which pools a model needs and each one's ceiling are its KV plan (`engine.model.kv_plan.KVPlan`, sized by
  `engine.model.memory_fit`).
"""
