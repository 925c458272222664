"""The queue, which is the ledger: its format, storage, the lifecycle of a job, and waiting."""
