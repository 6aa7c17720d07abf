"""The API's wire models: what its routes take and answer, beside the job's own contract (`jobs.schemas`)."""
