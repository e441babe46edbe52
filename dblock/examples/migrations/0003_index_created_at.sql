-- dblock:no-transaction
-- Runs statement by statement outside a transaction, as CREATE INDEX CONCURRENTLY must on
-- PostgreSQL (plain CREATE INDEX here, so that the example also runs on SQLite).
DROP INDEX IF EXISTS example_notes_created_at;
CREATE INDEX example_notes_created_at ON example_notes (created_at);
