//! Schema migrations that are safe when every instance starts at once.

/// The advisory-lock key every migration and every start-up DDL script takes first:
/// the ASCII bytes of `DBLOCKM` and a version byte, so that it is recognisable in
/// `pg_locks` (classid 1145195599 = `0x44424c4f`, objid 1129008385 = `0x434b4d01`).
///
/// One key for the whole database, not one per script: the catalogue indexes that
/// concurrent `CREATE … IF NOT EXISTS` collide on are database-wide, so two *different*
/// scripts race exactly as two runs of one script do.
pub const MIGRATION_LOCK_KEY: i64 = 0x4442_4c4f_434b_4d01;

/// `ddl` with the migration lock's acquisition as its first statement.
///
/// Sent as one simple-protocol message, the whole script runs in one implicit
/// transaction: the lock is held for all of it and released at its end, on success and
/// on failure alike, with nothing for the caller to release.
pub fn lock_prefixed(ddl: &str) -> String {
    format!("SELECT pg_advisory_xact_lock({MIGRATION_LOCK_KEY});\n{ddl}")
}
