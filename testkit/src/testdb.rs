//! A database of one test's own on any of the three backends; what a test written once
//! for all of them needs to see on the server (holders, waiters) and to do to it (end a
//! holder's session); and [`every_backend!`](crate::every_backend), which runs one test
//! source on each backend.

use std::os::unix::fs::MetadataExt;
use std::time::Duration;

use crate::{MyDb, PgSchema, SqliteDb};

/// A database of one test's own on one of the three backends: a PostgreSQL schema (and
/// namespace), a MySQL/MariaDB database, an SQLite file in a directory of its own.
pub enum TestDb {
    Postgres(Box<PgSchema>),
    Sqlite(SqliteDb),
    MySql(MyDb),
}

impl TestDb {
    pub async fn postgres(tag: &str) -> TestDb {
        TestDb::Postgres(Box::new(PgSchema::new(tag).await))
    }

    /// PostgreSQL in a database of the test's own ([`PgSchema::own_database`]): for
    /// tests that take the database-wide migration lock.
    pub async fn postgres_own_database(tag: &str) -> TestDb {
        TestDb::Postgres(Box::new(PgSchema::own_database(tag).await))
    }

    pub async fn sqlite(_tag: &str) -> TestDb {
        TestDb::Sqlite(SqliteDb::new())
    }

    pub async fn mysql(tag: &str) -> TestDb {
        TestDb::MySql(MyDb::new(tag).await)
    }

    /// Another database of the test's own, of the same backend, that dblock has never
    /// seen: on PostgreSQL a database of its own (dblock's tables are database-wide), a
    /// MySQL database, an SQLite file. For tests of what dblock does on first contact.
    pub async fn fresh(&self, tag: &str) -> TestDb {
        match self {
            TestDb::Postgres(_) => TestDb::postgres_own_database(tag).await,
            TestDb::Sqlite(_) => TestDb::sqlite(tag).await,
            TestDb::MySql(_) => TestDb::mysql(tag).await,
        }
    }

    /// The URL of this test's database (schema, file).
    pub fn url(&self) -> &str {
        match self {
            TestDb::Postgres(s) => &s.url,
            TestDb::Sqlite(d) => &d.url,
            TestDb::MySql(d) => &d.url,
        }
    }

    /// `"postgres"`, `"sqlite"` or `"mysql"`, as `Locks::backend_name` says.
    pub fn backend(&self) -> &'static str {
        match self {
            TestDb::Postgres(_) => "postgres",
            TestDb::Sqlite(_) => "sqlite",
            TestDb::MySql(_) => "mysql",
        }
    }

    /// A handle on this database, with the defaults.
    pub async fn locks(&self) -> dblock::Locks {
        dblock::Locks::connect(self.url()).await.unwrap()
    }

    /// A builder for a handle on this database.
    pub fn builder(&self) -> dblock::Builder {
        dblock::Locks::builder().url(self.url())
    }

    /// The default namespace of handles on [`TestDb::url`].
    pub fn namespace(&self) -> &str {
        match self {
            TestDb::Postgres(s) => &s.name,
            _ => "public",
        }
    }

    /// The key of `name` in the default namespace.
    pub fn key(&self, name: &str) -> dblock::Key {
        dblock::Key::new(self.namespace(), name).unwrap()
    }

    /// Whether the backend has a shared mode (MySQL's named locks have none).
    pub fn has_shared(&self) -> bool {
        !matches!(self, TestDb::MySql(_))
    }

    /// Whether the backend enforces leases (the embedded backend's locks end with
    /// their process, never sooner).
    pub fn has_leases(&self) -> bool {
        !matches!(self, TestDb::Sqlite(_))
    }

    /// Whether a holder whose session is ended ([`TestDb::end_holder`]) is told at once
    /// through `lost()` (the embedded backend notices at `check`, `is_held`, `release`).
    pub fn tells_loss(&self) -> bool {
        !matches!(self, TestDb::Sqlite(_))
    }

    /// A URL of this backend that cannot be reached (or opened).
    pub fn unreachable_url(&self) -> String {
        match self {
            TestDb::Postgres(_) => "postgres://postgres@127.0.0.1:1/test".into(),
            TestDb::MySql(_) => "mysql://root@127.0.0.1:1/test".into(),
            // A directory that exists but where no file can be created (a missing
            // directory is refused before any I/O, as an invalid URL).
            TestDb::Sqlite(_) => "sqlite:/proc/x.db".into(),
        }
    }

    /// Holders of `name` as the server (or the kernel) shows them.
    pub async fn holders(&self, name: &str) -> usize {
        match self {
            TestDb::Postgres(s) => s
                .advisory(self.key(name))
                .await
                .iter()
                .filter(|r| r.2)
                .count(),
            TestDb::MySql(d) => d.holder(&d.lock_name(name)).await.map_or(0, |_| 1),
            TestDb::Sqlite(d) => {
                let offset = self.key(name).file_offset();
                kernel_locks(d, |s, e| s <= offset && offset <= e).0
            }
        }
    }

    /// Requests waiting for `name` on the server (MySQL: any `GET_LOCK` waiting in this
    /// test's database), or in line in the kernel (SQLite: at the name's gate byte).
    pub async fn waiting(&self, name: &str) -> usize {
        match self {
            TestDb::Postgres(s) => s
                .advisory(self.key(name))
                .await
                .iter()
                .filter(|r| !r.2)
                .count(),
            TestDb::MySql(d) => {
                let n: i64 = sqlx::query_scalar(
                    "SELECT COUNT(*) FROM information_schema.PROCESSLIST \
                     WHERE DB = ? AND STATE = 'User lock'",
                )
                .bind(&d.name)
                .fetch_one(d.admin())
                .await
                .unwrap();
                n as usize
            }
            TestDb::Sqlite(d) => {
                // The gate byte alone (a holder may hold gate and lock byte together).
                let gate = self.key(name).file_offset() ^ 1;
                let (held, blocked) = kernel_locks(d, |s, e| s == gate && e == gate);
                held + blocked
            }
        }
    }

    /// Polls (bounded, 10 s) until `n` requests wait for `name`; returns whether seen.
    pub async fn until_waiting(&self, name: &str, n: usize) -> bool {
        crate::eventually(10, &mut || async { self.waiting(name).await == n }).await
    }

    /// Ends the holder of `name` from outside, as an operator or a failing network
    /// would: PostgreSQL terminates its backend, MySQL kills its connection, SQLite
    /// replaces the lock file under it (every lock in the file is lost).
    pub async fn end_holder(&self, name: &str) {
        match self {
            TestDb::Postgres(s) => assert_eq!(s.terminate_holders(self.key(name)).await, 1),
            TestDb::MySql(d) => {
                let id = d.holder(&d.lock_name(name)).await.expect("a holder");
                d.kill_connection(id).await;
                let gone = crate::eventually(10, &mut || async {
                    d.holder(&d.lock_name(name)).await != Some(id)
                })
                .await;
                assert!(gone, "the killed session let go");
            }
            TestDb::Sqlite(d) => {
                let file = lock_file(d);
                let tmp = file.with_extension("new");
                std::fs::write(&tmp, b"").unwrap();
                std::fs::rename(&tmp, &file).unwrap();
            }
        }
    }
}

fn lock_file(d: &SqliteDb) -> std::path::PathBuf {
    d.dir.path().join("locks.db-locks")
}

/// Kernel locks on the database's lock file (from /proc/locks) whose range `fits`
/// (first byte, last byte): (held, blocked).
fn kernel_locks(d: &SqliteDb, fits: impl Fn(u64, u64) -> bool) -> (usize, usize) {
    let Ok(meta) = std::fs::metadata(lock_file(d)) else {
        return (0, 0);
    };
    let ino = meta.ino().to_string();
    let (mut held, mut blocked) = (0, 0);
    for line in std::fs::read_to_string("/proc/locks").unwrap().lines() {
        let t: Vec<&str> = line.split_whitespace().collect();
        let is_blocked = t.get(1) == Some(&"->");
        let t: Vec<&str> = t.into_iter().filter(|t| *t != "->").collect();
        let start = t.get(6).and_then(|v| v.parse::<u64>().ok());
        let end = t.get(7).and_then(|v| match *v {
            "EOF" => Some(u64::MAX),
            v => v.parse::<u64>().ok(),
        });
        if t.get(5).and_then(|d| d.rsplit(':').next()) == Some(ino.as_str())
            && start.zip(end).is_some_and(|(s, e)| fits(s, e))
        {
            if is_blocked {
                blocked += 1;
            } else {
                held += 1;
            }
        }
    }
    (held, blocked)
}

/// A bound for awaits in generic tests: panics naming `what` after `secs`.
pub async fn within<F: std::future::Future>(secs: u64, what: &str, f: F) -> F::Output {
    match tokio::time::timeout(Duration::from_secs(secs), f).await {
        Ok(v) => v,
        Err(_) => panic!("{what}: not within {secs} s"),
    }
}

/// One test source, run on every backend: for each `async fn NAME(db: &TestDb)`
/// listed, a module `NAME` with the tests `postgres`, `sqlite` and `mysql`, each on a
/// database of its own. With `own_database:` first, PostgreSQL's is a database of the
/// test's own too, not a schema of a shared one: for tests that take a database-wide
/// key (migrations).
#[macro_export]
macro_rules! every_backend {
    (own_database: $($test:ident),* $(,)?) => {
        $crate::every_backend!(@postgres postgres_own_database; $($test),*);
    };
    (@postgres $pg:ident; $($test:ident),* $(,)?) => {$(
        mod $test {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn postgres() {
                let db = $crate::TestDb::$pg(stringify!($test)).await;
                super::$test(&db).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn sqlite() {
                let db = $crate::TestDb::sqlite(stringify!($test)).await;
                super::$test(&db).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn mysql() {
                let db = $crate::TestDb::mysql(stringify!($test)).await;
                super::$test(&db).await;
            }
        }
    )*};
    ($($test:ident),* $(,)?) => {
        $crate::every_backend!(@postgres postgres; $($test),*);
    };
}
