//! Where each migration of a set and of a database stands ([`Runner::status`]), read
//! without the lock by the same runner that applies them.
//!
//! [`Runner::status`]: super::Runner::status

use std::collections::HashSet;
use std::fmt;
use std::time::Duration;

use super::adopt;
use super::plan::{Record, RecordState, refuse_interrupted};
use super::run::{Ctx, Unlocked, read};
use super::set::Migration;
use super::split::split;
use crate::error::Error;

/// The state of each migration of a set and a database ([`Runner::status`](super::Runner::status)).
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct Status {
    /// One entry per version, in version order: the set's migrations and the
    /// database's unknown ones.
    pub entries: Vec<StatusEntry>,
    /// Why a run would refuse because of another tool's history (a file differs from
    /// what sqlx applied, or a history dblock cannot verify), as the error would say it.
    pub foreign: Option<String>,
    /// Why a run would refuse because a migration was interrupted part way
    /// ([`State::Interrupted`]), as the error would say it: what ran, and what to do.
    pub interrupted: Option<String>,
    ignore_missing: bool,
}

impl Status {
    /// How many entries are in `state`.
    pub fn count(&self, state: State) -> usize {
        self.entries.iter().filter(|e| e.state == state).count()
    }

    /// Whether a run would refuse: an applied migration was edited, a migration was
    /// interrupted part way, another tool's history cannot be adopted as it stands, or
    /// the database has versions the set lacks (unless the status was taken with
    /// [`Runner::ignore_missing`](super::Runner::ignore_missing)).
    pub fn would_refuse(&self) -> bool {
        self.foreign.is_some()
            || self.interrupted.is_some()
            || self.count(State::Edited) > 0
            || (!self.ignore_missing && self.count(State::Unknown) > 0)
    }
}

/// One migration in a [`Status`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct StatusEntry {
    /// Its version.
    pub version: i64,
    /// Its name: the file's, or for an unknown migration the one recorded.
    pub name: String,
    /// Where it stands.
    pub state: State,
    /// The file name, for migrations of the set.
    pub file_name: Option<String>,
    /// When it was applied (or, interrupted or being applied, started), for every
    /// state but pending: RFC 3339 in UTC (`2026-05-01T12:00:00.123Z`), as recorded.
    pub applied_at: Option<String>,
    /// How long it took, as recorded.
    pub duration: Option<Duration>,
    /// For a version dblock has not recorded but another tool has: that tool
    /// (`"sqlx"`). A run adopts it when its checksum matches.
    pub recorded_by: Option<&'static str>,
    /// Whether the file runs outside a transaction (its first line is a no-transaction
    /// header), as the dry run marks it.
    pub no_transaction: bool,
    /// For a migration interrupted or being applied statement by statement: how many
    /// of its statements are known to have completed, and how many it has.
    pub progress: Option<(usize, usize)>,
}

/// Where one migration stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum State {
    /// Applied, and the file is unchanged.
    Applied,
    /// In the set, not yet applied.
    Pending,
    /// Applied, but the file changed since: a run refuses ([`Error::MigrationEdited`]).
    Edited,
    /// Applied, but not in the set: a run refuses ([`Error::UnknownMigrations`]) unless
    /// told to ignore these ([`Runner::ignore_missing`](super::Runner::ignore_missing)).
    Unknown,
    /// Started outside a transaction and never finished, and no run holds the lock: its
    /// run was killed or lost its connection part way. A run refuses
    /// ([`Error::MigrationInterrupted`]) until someone has looked.
    Interrupted,
    /// Started outside a transaction and not finished, while a run holds the migration
    /// lock: being applied now.
    Applying,
}

impl fmt::Display for State {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            State::Applied => "applied",
            State::Pending => "pending",
            State::Edited => "edited",
            State::Unknown => "unknown",
            State::Interrupted => "interrupted",
            State::Applying => "applying",
        })
    }
}

/// Every migration of the set and of the database, with its state; changes nothing.
pub(crate) async fn status(c: &Ctx<'_>, ignore_missing: bool) -> Result<Status, Error> {
    let Unlocked {
        mut records,
        history,
        running,
    } = read(c).await?;
    let interrupted = match running {
        true => None,
        false => refuse_interrupted(c.set, &records, c.store.transactional_ddl())
            .err()
            .map(|e| e.to_string()),
    };
    let sqlx = c.sqlx.sqlx();
    let r = adopt::reconcile(c.set, &records, &history, sqlx);
    let foreign = adopt::refusal(&records, &history, &r, sqlx).map(|e| e.to_string());
    let by_sqlx: HashSet<i64> = (r.adopt.iter().chain(&r.differing).chain(&r.unknown))
        .map(|r| r.version)
        .collect();
    records.extend(r.adopt.into_iter().chain(r.differing).chain(r.unknown));
    let mut status = status_of(c.set, records, running);
    for e in &mut status.entries {
        if by_sqlx.contains(&e.version) {
            e.recorded_by = Some("sqlx");
        }
    }
    status.foreign = foreign;
    status.interrupted = interrupted;
    status.ignore_missing = ignore_missing;
    Ok(status)
}

pub(super) fn status_of(set: &[Migration], records: Vec<Record>, running: bool) -> Status {
    let mut entries: Vec<StatusEntry> = set
        .iter()
        .map(|m| StatusEntry {
            version: m.version(),
            name: m.name().to_string(),
            state: State::Pending,
            file_name: Some(m.file_name().to_string()),
            applied_at: None,
            duration: None,
            recorded_by: None,
            no_transaction: m.no_transaction(),
            progress: None,
        })
        .collect();
    for r in records {
        let duration = Some(Duration::from_millis(
            u64::try_from(r.duration_ms).unwrap_or(0),
        ));
        match set.binary_search_by_key(&r.version, Migration::version) {
            Ok(i) => {
                if let Some(e) = entries.get_mut(i) {
                    e.state = state_of(&set[i], &r, running);
                    e.progress = progress_of(&set[i], &r);
                    e.duration = duration.filter(|_| !r.started());
                    e.applied_at = Some(r.applied_at);
                }
            }
            Err(_) => entries.push(StatusEntry {
                version: r.version,
                name: r.name,
                state: match r.state {
                    RecordState::Done => State::Unknown,
                    RecordState::Started { .. } if running => State::Applying,
                    RecordState::Started { .. } => State::Interrupted,
                },
                file_name: None,
                applied_at: Some(r.applied_at),
                duration,
                recorded_by: None,
                no_transaction: false,
                progress: None,
            }),
        }
    }
    entries.sort_by_key(|e| e.version);
    Status {
        entries,
        ..Status::default()
    }
}

fn state_of(m: &Migration, r: &Record, running: bool) -> State {
    match r.state {
        RecordState::Started { .. } if running => State::Applying,
        RecordState::Started { .. } => State::Interrupted,
        RecordState::Done if m.checksum() == r.checksum => State::Applied,
        RecordState::Done => State::Edited,
    }
}

fn progress_of(m: &Migration, r: &Record) -> Option<(usize, usize)> {
    match r.state {
        RecordState::Started { completed: Some(k) } if m.checksum() == r.checksum => {
            Some((k, split(m.sql()).len()))
        }
        _ => None,
    }
}
