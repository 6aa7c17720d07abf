"""What the API does, apart from HTTP: routes parse a request, call these, and shape the answer.

Refusals are raised as `HTTPException` (a status and a sentence), as admission and paging already do, so a
route never translates them. `jobs.load` and `jobs.cancel` answer None for a job the caller cannot see instead:
the event streams and the chat route call them where that is no error.
"""
