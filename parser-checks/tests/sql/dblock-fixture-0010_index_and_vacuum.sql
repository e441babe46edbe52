-- dblock:no-transaction
CREATE INDEX items_name ON items (name);
VACUUM;
