//! A worker process for dblock's multi-process tests.
//!
//! ```text
//! dblock-worker counter URL NAME FILE ITERATIONS SLEEP_US [--no-lock]
//!     ITERATIONS times: take NAME, read the integer in FILE, sleep, write it + 1,
//!     release. An "inside" marker file created with O_EXCL counts overlapping
//!     critical sections. Prints `overlaps=N`.
//! dblock-worker hold URL NAME [--fenced] [--shared] [--session] [--lease-ms N] [--check-ms N (timeout 2N)]
//!     takes NAME, prints `held TOKEN`, then sleeps until killed.
//! dblock-worker wait URL NAME
//!     waits for NAME, prints `acquired`, exits.
//! dblock-worker semaphore URL NAME LIMIT ITERATIONS SLEEP_MS DIR [--no-lock]
//!     prints `ready`, waits for a line on stdin (so that every process starts at
//!     once), then ITERATIONS times: takes a slot of the semaphore NAME, creates a
//!     marker file in DIR, counts the markers there, sleeps, removes its marker,
//!     releases. Prints `max=M`: the most markers it saw at once.
//! dblock-worker hold-slot URL NAME LIMIT
//!     takes a slot of the semaphore NAME, prints `held SLOT`, then sleeps until killed.
//! dblock-worker wait-slot URL NAME LIMIT
//!     waits for a slot of the semaphore NAME, prints `acquired SLOT`, exits.
//! dblock-worker kleppmann URL NAME [--no-fence]
//!     takes NAME fenced, prints `held TOKEN`, waits for a line on stdin, then writes
//!     `resource` row 1 (value 'A') in a transaction checked by the fence (unless
//!     --no-fence); prints `written` or `rejected`.
//! dblock-worker check-pause URL NAME LEASE_MS [--unbounded]
//!     (PostgreSQL) takes NAME fenced with a lease (checks every 100 ms), begins a
//!     transaction that updates `resource` row 1 to 'A' and checks the fence
//!     (`Fence::check_postgres`; with --unbounded, the row read `FOR SHARE` by hand, as
//!     the check did before it bounded the transaction's idle time), prints
//!     `checked TOKEN`, waits for a line on stdin, commits; prints `committed` or
//!     `failed ERROR`.
//! dblock-worker candidate URL NAME CHECK_MS LEASE_MS [--no-fence] [--stubborn]
//!     stands for election NAME; while leader, inserts its token into `leader_log`
//!     every 20 ms, fenced (unless --no-fence); prints `leader TOKEN`, `rejected TOKEN`,
//!     `lost`. A --stubborn leader ignores the loss of its term and keeps writing.
//! dblock-worker lead URL NAME VALUE
//!     stands for election NAME publishing VALUE (`-`: none), prints `leader TOKEN`; then
//!     for each line `publish X` on stdin publishes X and prints `published` or
//!     `error KIND`; holds the term until killed.
//! dblock-worker lock-all URL NAMES ITERATIONS DIR [--one-by-one] [--no-lock]
//!     NAMES is comma-separated. Prints `ready`, waits for a line on stdin, then
//!     ITERATIONS times: takes every name with `lock_all` (or, --one-by-one, with one
//!     `try_lock_for(2 s)` per name in the order given, holding each, stopping at the
//!     first that times out: a deadlock), creates a marker file per
//!     name in DIR with O_EXCL (one that exists already is an overlap), yields, removes
//!     them, releases. Prints `overlaps=N errors=E` and the first error, if any.
//! dblock-worker hold-share URL NAME [--no-share]
//!     takes NAME, starts `sleep 1000` sharing the lock with it
//!     (`LockGuard::share_with_child`, unless --no-share), prints `held CHILD_PID`;
//!     on a line on stdin releases the lock and prints `released`, then sleeps until
//!     killed.
//! dblock-worker first-contact URL FEATURE INDEX
//!     opens a handle, prints `ready`, waits for a line on stdin (so that every process
//!     starts at once), then uses FEATURE once — `fenced` (a fenced try_lock of a name
//!     of its own, INDEX), `try` (an unfenced one), `wait` (a fenced lock of one shared
//!     name, held a moment), `limit2` (a fenced try of a slot of a limit-2 semaphore,
//!     a slot held until stdin closes),
//!     `lock-all` (three shared names), `status`, `leader` (who leads, then a term of
//!     the shared election, resigned; then a term of an election of its own, INDEX,
//!     publishing a value that is read back) — and prints `ok ANSWER` or
//!     `error KIND: MESSAGE`.
//! ```
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::Write;
use std::time::Duration;

use dblock_testkit::appdb::Outcome;

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize| args.get(i).cloned().unwrap_or_default();
    if arg(0) == "first-contact" {
        let out = match first_contact(&arg(1), &arg(2), &arg(3)).await {
            // Said already.
            Ok(answer) if answer.is_empty() => return,
            Ok(answer) => format!("ok {answer}"),
            Err(e) => format!("error {e:?}: {e}"),
        };
        println!("{}", out.replace('\n', " "));
        return;
    }
    // DBLOCK_TEST_NAMESPACE: the namespace, when the schema in use may vary by server
    // connection (behind a session pooler whose DISCARD ALL resets search_path).
    let mut builder = dblock::Locks::builder().url(arg(1));
    if let Ok(ns) = std::env::var("DBLOCK_TEST_NAMESPACE") {
        builder = builder.namespace(ns);
    }
    let locks = builder.build().await.unwrap();
    let name = arg(2);
    match arg(0).as_str() {
        "counter" => {
            let file = std::path::PathBuf::from(arg(3));
            let marker = file.with_extension("inside");
            let iterations: u32 = arg(4).parse().unwrap();
            let sleep = Duration::from_micros(arg(5).parse().unwrap());
            let locked = !args.iter().any(|a| a == "--no-lock");
            let mut overlaps = 0u32;
            for _ in 0..iterations {
                let guard = if locked {
                    Some(locks.lock(&name).await.unwrap())
                } else {
                    None
                };
                let entered = std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .open(&marker)
                    .is_ok();
                if !entered {
                    overlaps += 1;
                }
                let n: u64 = std::fs::read_to_string(&file)
                    .ok()
                    .and_then(|s| s.trim().parse().ok())
                    .unwrap_or(0);
                tokio::time::sleep(sleep).await;
                std::fs::write(&file, format!("{}\n", n + 1)).unwrap();
                if entered {
                    std::fs::remove_file(&marker).unwrap();
                }
                if let Some(g) = guard {
                    g.release().await.unwrap();
                }
            }
            println!("overlaps={overlaps}");
        }
        "hold" => {
            let opt = |flag: &str| {
                args.iter()
                    .position(|a| a == flag)
                    .and_then(|i| args.get(i + 1))
                    .map(|v| Duration::from_millis(v.parse().unwrap()))
            };
            let locks = match opt("--check-ms") {
                Some(check) => dblock::Locks::builder()
                    .url(arg(1))
                    .check_interval(check)
                    .check_timeout(check * 2)
                    .build()
                    .await
                    .unwrap(),
                None => locks,
            };
            let mut req = locks.request(&name);
            if args.iter().any(|a| a == "--fenced") {
                req = req.fenced();
            }
            if args.iter().any(|a| a == "--shared") {
                req = req.shared();
            }
            if args.iter().any(|a| a == "--session") {
                req = req.scope(dblock::Scope::Session);
            }
            if let Some(lease) = opt("--lease-ms") {
                req = req.lease(lease);
            }
            let guard = req.lock().await.unwrap();
            println!("held {}", guard.fencing_token().unwrap_or(0));
            std::io::stdout().flush().unwrap();
            tokio::time::sleep(Duration::from_secs(3600)).await;
            drop(guard);
        }
        "wait" => {
            let guard = locks.lock(&name).await.unwrap();
            println!("acquired");
            std::io::stdout().flush().unwrap();
            drop(guard);
        }
        "semaphore" => {
            let limit: u32 = arg(3).parse().unwrap();
            let iterations: u32 = arg(4).parse().unwrap();
            let sleep = Duration::from_millis(arg(5).parse().unwrap());
            let dir = std::path::PathBuf::from(arg(6));
            let locked = !args.iter().any(|a| a == "--no-lock");
            println!("ready");
            std::io::stdout().flush().unwrap();
            let mut line = String::new();
            std::io::stdin().read_line(&mut line).unwrap();
            let marker = dir.join(format!("inside-{}", std::process::id()));
            let mut max = 0;
            for _ in 0..iterations {
                let guard = if locked {
                    Some(locks.semaphore(&name, limit).lock().await.unwrap())
                } else {
                    None
                };
                std::fs::write(&marker, "").unwrap();
                let inside = std::fs::read_dir(&dir).unwrap().count();
                max = max.max(inside);
                tokio::time::sleep(sleep).await;
                std::fs::remove_file(&marker).unwrap();
                if let Some(g) = guard {
                    g.release().await.unwrap();
                }
            }
            println!("max={max}");
        }
        "lock-all" => {
            let names: Vec<String> = name.split(',').map(String::from).collect();
            let iterations: u32 = arg(3).parse().unwrap();
            let dir = std::path::PathBuf::from(arg(4));
            let flag = |f: &str| args.iter().any(|a| a == f);
            let (one_by_one, locked) = (flag("--one-by-one"), !flag("--no-lock"));
            println!("ready");
            std::io::stdout().flush().unwrap();
            let mut line = String::new();
            std::io::stdin().read_line(&mut line).unwrap();
            let (mut overlaps, mut errors, mut first_error) = (0u32, 0u32, None);
            for _ in 0..iterations {
                let mut singles = Vec::new();
                let mut set = None;
                let taken: Result<(), String> = async {
                    if !locked {
                    } else if one_by_one {
                        for n in &names {
                            // Holds under contention last microseconds: a second
                            // without the next name is a deadlock, which the server
                            // cannot see (each lock is on a connection of its own).
                            match locks.try_lock_for(n, Duration::from_secs(2)).await {
                                Ok(Some(g)) => singles.push(g),
                                Ok(None) => return Err(format!("deadlock: no {n} in 2 s")),
                                Err(e) => return Err(e.to_string()),
                            }
                        }
                    } else {
                        set = Some(locks.lock_all(&names).await.map_err(|e| e.to_string())?);
                    }
                    Ok(())
                }
                .await;
                if let Err(e) = taken {
                    errors += 1;
                    first_error.get_or_insert(e);
                    if one_by_one {
                        break;
                    }
                    continue;
                }
                let mut mine = Vec::new();
                for n in &names {
                    let marker = dir.join(n);
                    match std::fs::OpenOptions::new()
                        .write(true)
                        .create_new(true)
                        .open(&marker)
                    {
                        Ok(_) => mine.push(marker),
                        Err(_) => overlaps += 1,
                    }
                }
                tokio::time::sleep(Duration::from_micros(200)).await;
                for m in mine {
                    std::fs::remove_file(m).unwrap();
                }
                drop(singles);
                drop(set);
            }
            println!("overlaps={overlaps} errors={errors}");
            if let Some(e) = first_error {
                println!("first error: {e}");
            }
        }
        "hold-slot" => {
            let limit: u32 = arg(3).parse().unwrap();
            let guard = locks.semaphore(&name, limit).lock().await.unwrap();
            println!("held {}", guard.slot());
            std::io::stdout().flush().unwrap();
            tokio::time::sleep(Duration::from_secs(3600)).await;
            drop(guard);
        }
        "wait-slot" => {
            let limit: u32 = arg(3).parse().unwrap();
            let guard = locks.semaphore(&name, limit).lock().await.unwrap();
            println!("acquired {}", guard.slot());
            std::io::stdout().flush().unwrap();
            drop(guard);
        }
        "kleppmann" => {
            let no_fence = args.iter().any(|a| a == "--no-fence");
            let app = dblock_testkit::appdb::AppDb::connect(&arg(1)).await;
            let guard = locks.request(&name).fenced().lock().await.unwrap();
            let fence = guard.fence().unwrap().clone();
            println!("held {}", fence.token());
            std::io::stdout().flush().unwrap();
            let mut line = String::new();
            std::io::stdin().read_line(&mut line).unwrap();
            // Whatever happened meanwhile, this process now does its write, as a holder
            // that paused without noticing would.
            let checked = (!no_fence).then_some(&fence);
            match app.write_resource("A", fence.token(), checked).await {
                Outcome::Written => println!("written"),
                Outcome::Rejected => println!("rejected"),
                Outcome::Failed(e) => println!("failed {e}"),
            }
            drop(guard);
        }
        "check-pause" => {
            let lease = Duration::from_millis(arg(3).parse().unwrap());
            let unbounded = args.iter().any(|a| a == "--unbounded");
            let locks = dblock::Locks::builder()
                .url(arg(1))
                .check_interval(Duration::from_millis(100))
                .check_timeout(Duration::from_millis(200))
                .build()
                .await
                .unwrap();
            let guard = locks
                .request(&name)
                .fenced()
                .lease(lease)
                .lock()
                .await
                .unwrap();
            let fence = guard.fence().unwrap().clone();
            let dblock_testkit::appdb::AppDb::Pg(pool) =
                dblock_testkit::appdb::AppDb::connect(&arg(1)).await
            else {
                panic!("check-pause is for PostgreSQL");
            };
            let mut tx = pool.begin().await.unwrap();
            sqlx::query("UPDATE resource SET value = 'A', token = $1 WHERE id = 1")
                .bind(fence.token())
                .execute(&mut *tx)
                .await
                .unwrap();
            if unbounded {
                let sql = format!(
                    "SELECT token FROM {}.{} WHERE key = {} FOR SHARE",
                    dblock::fencing::PG_SCHEMA,
                    dblock::fencing::TABLE,
                    fence.key().as_i64()
                );
                let latest: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
                    .fetch_one(&mut *tx)
                    .await
                    .unwrap();
                assert_eq!(latest, fence.token());
            } else {
                fence.check_postgres(&mut tx).await.unwrap();
            }
            println!("checked {}", fence.token());
            std::io::stdout().flush().unwrap();
            let mut line = String::new();
            std::io::stdin().read_line(&mut line).unwrap();
            match tx.commit().await {
                Ok(()) => println!("committed"),
                Err(e) => println!("failed {}", e.to_string().replace('\n', " ")),
            }
            drop(guard);
        }
        "candidate" => {
            let check = Duration::from_millis(arg(3).parse().unwrap());
            let lease = Duration::from_millis(arg(4).parse().unwrap());
            let no_fence = args.iter().any(|a| a == "--no-fence");
            let stubborn = args.iter().any(|a| a == "--stubborn");
            let locks = dblock::Locks::builder()
                .url(arg(1))
                .check_interval(check)
                .check_timeout(check * 2)
                .build()
                .await
                .unwrap();
            let app = dblock_testkit::appdb::AppDb::connect(&arg(1)).await;
            let election = dblock::leader::Election::new(&locks, &name).lease(lease);
            loop {
                let term = election.campaign().await.unwrap();
                let fence = term.fence().unwrap().clone();
                println!("leader {}", fence.token());
                std::io::stdout().flush().unwrap();
                let mut lost = std::pin::pin!(term.lost());
                loop {
                    tokio::select! {
                        _ = &mut lost, if !stubborn => {
                            println!("lost");
                            std::io::stdout().flush().unwrap();
                            break;
                        }
                        () = tokio::time::sleep(Duration::from_millis(20)) => {}
                    }
                    let checked = (!no_fence).then_some(&fence);
                    let out = app.log_term(fence.token(), checked).await;
                    if let Outcome::Failed(e) = &out {
                        eprintln!("log_term: {e}");
                    }
                    if out == Outcome::Rejected {
                        println!("rejected {}", fence.token());
                        std::io::stdout().flush().unwrap();
                    }
                }
                drop(term);
            }
        }
        "lead" => {
            let mut election = dblock::leader::Election::new(&locks, &name);
            if arg(3) != "-" {
                election = election.value(arg(3));
            }
            let term = election.campaign().await.unwrap();
            println!("leader {}", term.token());
            std::io::stdout().flush().unwrap();
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<String>();
            std::thread::spawn(move || {
                for line in std::io::stdin().lines() {
                    let Ok(line) = line else { break };
                    if tx.send(line).is_err() {
                        break;
                    }
                }
            });
            while let Some(line) = rx.recv().await {
                if let Some(v) = line.strip_prefix("publish ") {
                    match term.publish(v).await {
                        Ok(()) => println!("published"),
                        Err(e) => println!("error {e:?}"),
                    }
                    std::io::stdout().flush().unwrap();
                }
            }
            std::future::pending::<()>().await;
        }
        "hold-share" => {
            let mut guard = locks.lock(&name).await.unwrap();
            let mut cmd = std::process::Command::new("sleep");
            cmd.arg("1000");
            if !args.iter().any(|a| a == "--no-share") {
                guard.share_with_child(&mut cmd).await.unwrap();
            }
            // Left to run past this process (the test ends it); reaped by init.
            #[allow(clippy::zombie_processes)]
            let child = cmd.spawn().unwrap();
            drop(cmd);
            println!("held {}", child.id());
            std::io::stdout().flush().unwrap();
            let mut line = String::new();
            let stdin = tokio::task::spawn_blocking(move || {
                let _ = std::io::stdin().read_line(&mut line);
            });
            let _ = stdin.await;
            guard.release().await.unwrap();
            println!("released");
            std::io::stdout().flush().unwrap();
            std::future::pending::<()>().await;
        }
        other => panic!("unknown mode {other:?}"),
    }
}

/// One use of `feature` on a database dblock may never have seen (see the module docs).
async fn first_contact(url: &str, feature: &str, index: &str) -> Result<String, dblock::Error> {
    let locks = dblock::Locks::connect(url).await?;
    println!("ready");
    std::io::stdout().flush().unwrap();
    let mut go = String::new();
    std::io::stdin().read_line(&mut go).unwrap();
    let own = format!("own-{index}");
    Ok(match feature {
        "fenced" => match locks.request(&own).fenced().try_lock().await? {
            Some(g) => format!("held {}", g.fencing_token().unwrap_or(0)),
            None => "busy".into(),
        },
        "try" => match locks.try_lock(&own).await? {
            Some(_) => "held".into(),
            None => "busy".into(),
        },
        "wait" => {
            let g = locks.request("shared").fenced().lock().await?;
            tokio::time::sleep(Duration::from_millis(5)).await;
            g.release().await?;
            "held".into()
        }
        "limit2" => match locks.semaphore("exports", 2).fenced().try_lock().await? {
            Some(g) => {
                // Held until the test has every answer: said now, then held until
                // stdin closes.
                println!("ok slot {}", g.slot());
                std::io::stdout().flush().unwrap();
                let _ = std::io::stdin().read_line(&mut go);
                drop(g);
                String::new()
            }
            None => "busy".into(),
        },
        "lock-all" => {
            let set = locks.lock_all(["a", "b", "c"]).await?;
            set.release().await?;
            "held".into()
        }
        "status" => format!("{} locks", locks.status(&[]).await?.len()),
        "leader" => {
            // One election shared by all, then one of its own each, publishing a value
            // (the leaders' table made on first use by all at once), read back without
            // standing, before and after.
            let election = dblock::leader::Election::new(&locks, "leader");
            let before = election.leader().await?;
            let term = election.campaign().await?;
            let token = term.token();
            term.resign().await?;
            let value = format!("addr-{index}");
            let watching = locks.current_leader(&own).await?;
            let mine = dblock::leader::Election::new(&locks, &own).value(value.clone());
            let term = mine.campaign().await?;
            let now = locks.current_leader(&own).await?;
            term.resign().await?;
            let seen = now.as_ref().and_then(|l| l.value.as_deref());
            if seen != Some(value.as_str()) || watching.is_some() {
                return Err(dblock::Error::Unexpected {
                    message: format!(
                        "read back {seen:?} as this term's value, not {value:?} (a leader \
                         before: {watching:?})"
                    ),
                });
            }
            format!("leader {token} (before: {})", before.is_some())
        }
        other => panic!("unknown feature {other:?}"),
    })
}
