//! `dblock setup`: the one-time setup, run by a schema's owner, for roles that may not
//! create tables (see `dblock::Locks::setup`).

use clap::Args;

use crate::{exit_code, one_line};

#[derive(Args, Debug)]
pub struct SetupArgs {
    /// Database URL of a role that may create tables in the schema (its owner); as for
    /// `run`.
    #[arg(long, value_name = "URL")]
    db: Option<String>,

    /// A role to grant what fenced locks, leader election and `run --once-per` need
    /// (repeatable; `PUBLIC` for every role).
    #[arg(long, value_name = "ROLE")]
    grant: Vec<String>,
}

pub async fn setup(args: SetupArgs) -> u8 {
    let mut builder = dblock::Locks::builder();
    if let Some(url) = &args.db {
        builder = builder.url(url);
    }
    let locks = match builder.build().await {
        Ok(l) => l,
        Err(e) => {
            errln!("dblock: {}", one_line(&e));
            return exit_code(&e);
        }
    };
    let grant: Vec<&str> = args.grant.iter().map(String::as_str).collect();
    // A backend with nothing to set up says so (Error::Unsupported, a usage error).
    match locks.setup(&grant).await {
        Ok(tables) => {
            for table in tables.split(", ") {
                outln!("{table} ready");
            }
            for g in &grant {
                outln!("granted to {}", crate::status::shown(g));
            }
            0
        }
        Err(e) => {
            errln!("dblock: {}", one_line(&e));
            exit_code(&e)
        }
    }
}
