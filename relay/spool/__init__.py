"""The spool: SQLite or PostgreSQL storage of messages, recipients, dedup keys and alerts."""
