-- Applied exactly once, however many processes start at the same moment: a second
-- ADD COLUMN would fail.
ALTER TABLE example_notes ADD COLUMN tags text;
