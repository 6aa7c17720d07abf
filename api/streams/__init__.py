"""Streams of a job's progress: the process's hub of job channels, the job's events, and OpenAI's chat stream."""
