-- The first release: notes.
CREATE TABLE IF NOT EXISTS example_notes (
    id integer PRIMARY KEY,
    body text NOT NULL,
    created_at text NOT NULL DEFAULT CURRENT_TIMESTAMP
);
