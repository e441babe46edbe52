//! The host-local default is never a silent surprise: when no URL was configured and
//! dblock falls back to the embedded file, it says so in one line on stderr.

/// Set (to anything but empty or `0`) to silence the notice. Naming the file
/// (`--db sqlite:PATH`, or the same in `DBLOCK_DATABASE_URL`) silences it too: then the
/// host-local lock is a choice, not a fallback.
pub(crate) const QUIET_VAR: &str = "DBLOCK_NO_DEFAULT_NOTICE";

/// Prints the notice if `db` (the `--db` option) and the URL variables are all unset.
pub(crate) fn embedded_default(db: Option<&str>) {
    if db.is_some() || dblock::url_from_env().is_some() {
        return;
    }
    if std::env::var_os(QUIET_VAR).is_some_and(|v| !v.is_empty() && v != "0") {
        return;
    }
    // Without a path the build fails next, with its own message.
    if let Ok(path) = dblock::default_sqlite_path() {
        errln!(
            "dblock: note: no database URL (--db, DBLOCK_DATABASE_URL, DATABASE_URL); locking \
             on the host-local file {}, which excludes processes on this host only \
             (set {QUIET_VAR}=1 to silence this)",
            crate::status::shown(&path.display().to_string())
        );
    }
}
